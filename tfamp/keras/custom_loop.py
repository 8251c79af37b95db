"""An enabled model inside the user's own training step: mixed precision there too.

``tfamp.enable(model)`` rewrites Keras's own fit / evaluate / predict functions.
A custom loop traces its step with the plain ``tf.function``, which tfamp does
not rewrite; this module makes the model's part of such a step mixed precision
anyway, for tf_keras and Keras 3 models alike:

* **Forward (and its gradient).** When an enabled model is called while a plain
  tf.function is being traced, its ``call`` runs as a nested tfamp-rewritten
  function (one per model, traced per input signature). TensorFlow
  differentiates a function call from the called graph itself, so the backward
  of the rewritten forward is 16-bit where the forward is; variables stay
  float32 and their gradients arrive float32 (through the Casts' gradients).
* **Loss scaling**, only for a tape whose float loss (a scalar, or a
  per-example vector: see ``scale_update.is_loss_target``) depends on such a
  call and whose sources include that model's variables: backprop is seeded
  with the loss scale and the gradients are unscaled in float32 (as
  ``TFAMP_ENABLE`` does). The scale is the model's tfamp loss-scale optimizer's
  (``model.optimizer`` after ``compile``); a model without one gets its own
  scale state. A loss marked as already scaled (``get_scaled_loss`` /
  ``scale_loss`` of a tfamp or Keras loss-scale optimizer) is left alone, so a
  user who scales by hand gets it once.
* **Skipping non-finite steps.** The tape records one pending scaled step for
  this trace and thread. The next optimizer update in that trace consumes it:
  tfamp's own loss-scale optimizers check finiteness themselves; any other
  optimizer (the inner one, or one the model was never compiled with) is run
  through ``scale_update.apply_if_finite`` with the model's scale state, so
  weights and slots stay untouched on an overflow and the scale halves. The
  optimizer patches act only when such a step is pending, so nothing else in
  the process changes.

Eager custom loops (no tf.function) stay float32: tfamp rewrites graphs. The
model says so once, with the fix, when it is called eagerly under a recording
GradientTape.
"""

from __future__ import annotations

import functools
import logging
import threading
import types
import warnings
import weakref
from pathlib import Path

import tensorflow as tf
from tensorflow.python.eager import record
from tensorflow.python.util import nest

from tfamp.keras import scale_update, start_scale
from tfamp.runtime.runner import RewrittenFunction, is_tracing_for_tfamp

log = logging.getLogger("tfamp")


# Per traced graph: {name of an op an enabled model's rewritten call produced: model}.
_calls: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_calls_lock = threading.Lock()
# Pending scaled steps, per thread (replica) and graph (trace): [owner, ...].
_pending = threading.local()
_patch_lock = threading.Lock()
_patched = False


class ModelLoop:
    """Per enabled model: its rewritten forward and its custom-loop scale.

    Args:
      model: the enabled Keras model (tf_keras or Keras 3).
      class_call: the class's ``call`` (unbound).
      config, check: the rewrite settings of ``tfamp.enable``.
      loss_scale: the ``tfamp.enable`` setting ("dynamic", a number, None).
      find_optimizer: returns the model's tfamp loss-scale optimizer, or None.
    """

    def __init__(self, model, class_call, config, check, loss_scale, find_optimizer,
                 initial_scale, growth_interval, min_scale):
        self.model_ref = weakref.ref(model)
        self.class_call = class_call
        self.config = config
        self.check = check
        self.loss_scale = loss_scale
        self.find_optimizer = find_optimizer
        self._scale_settings = (initial_scale, growth_interval, min_scale)
        self._forward = None
        self._own_state = None
        self.step_owner = None  # the scale owner the model's train step last applied
        self.warned_eager = False
        self.warned_control_flow = False

    # -- the forward --------------------------------------------------------

    def forward(self):
        if self._forward is None:
            model, class_call = self.model_ref(), self.class_call
            model_ref = self.model_ref

            def call(*args, **kwargs):
                return class_call(model_ref(), *args, **kwargs)

            call.__name__ = f"{_safe_name(model.name)}_call"
            self._forward = RewrittenFunction(call, self.config, check=self.check)
        return self._forward

    # -- the scale ------------------------------------------------------------

    def scale_owner(self):
        """What keeps this model's custom-loop scale: its loss-scale optimizer or own state."""
        if self.loss_scale is None:
            return None
        optimizer = self.find_optimizer()
        if optimizer is not None:
            return optimizer
        if self._own_state is None:
            from tfamp.keras.loss_scale import _ScaleState

            self._own_state = _ScaleState.for_setting(self.loss_scale, *self._scale_settings)
        return self._own_state


_plain = threading.local()


class plain_calls:  # noqa: N801  (a context manager, like tf.name_scope)
    """Within it, enabled models run their class's ``call`` as is.

    For tfamp's own probes that trace a model in a plain tf.function on purpose
    (the float32 range probe, the non-finite localiser, which rewrites the
    whole graph itself).
    """

    def __enter__(self):
        self._previous = getattr(_plain, "on", False)
        _plain.on = True
        return self

    def __exit__(self, *exc):
        _plain.on = self._previous
        return False


def run_call(loop: ModelLoop, model, args, kwargs):
    """What an enabled model's ``call`` hook does (tf_keras and Keras 3)."""
    if getattr(_plain, "on", False):
        return loop.class_call(model, *args, **kwargs)
    if tf.executing_eagerly():
        # (fit with run_eagerly=True has its own warning from tfamp.enable's hooks)
        if (not loop.warned_eager and record.could_possibly_record()
                and not getattr(model, "run_eagerly", False)):
            loop.warned_eager = True
            warnings.warn(eager_message(model), UserWarning, stacklevel=user_stacklevel())
        return loop.class_call(model, *args, **kwargs)
    if not _in_user_tf_function():
        return loop.class_call(model, *args, **kwargs)
    if _in_control_flow_branch():
        # The loss-to-model walk that decides loss scaling does not enter cond
        # branches or loop bodies: 16-bit there would be unscaled, so float32.
        if not loop.warned_control_flow:
            loop.warned_control_flow = True
            warnings.warn(control_flow_message(model), UserWarning,
                          stacklevel=user_stacklevel())
        return loop.class_call(model, *args, **kwargs)
    install_patches()
    owner = loop.scale_owner()
    _build_if_needed(owner, model)
    outputs = loop.forward()(*args, **kwargs)
    graph = tf.compat.v1.get_default_graph()
    names = {t.op.name for t in nest.flatten(outputs, expand_composites=True)
             if isinstance(t, tf.Tensor)}
    with _calls_lock:
        table = _calls.setdefault(graph, {})
        for name in names:
            table[name] = loop
    return outputs


def _in_user_tf_function() -> bool:
    """True when tracing a tf.function tfamp does not rewrite (e.g. the user's own step)."""
    if tf.executing_eagerly() or is_tracing_for_tfamp():
        return False
    from tensorflow.python.saved_model import save_context

    if save_context.in_save_context():
        return False  # saving traces call: not a training step
    graph = tf.compat.v1.get_default_graph()
    name = getattr(graph, "name", "") or ""
    # Keras's symbolic calls (functional construction, output specs) trace in
    # scratch graphs: not a step that runs.
    return getattr(graph, "_building_function", False) and not (
        "scratch_graph" in name or name == "keras_graph")


def _in_control_flow_branch() -> bool:
    """True when tracing a tf.cond branch or a tf.while_loop body / condition."""
    from tensorflow.python.ops import control_flow_v2_func_graphs as control_flow

    return isinstance(tf.compat.v1.get_default_graph(), (
        control_flow.CondBranchFuncGraph, control_flow.WhileBodyFuncGraph,
        control_flow.WhileCondFuncGraph))


def _build_if_needed(owner, model) -> None:
    """A Keras 3 loss-scale optimizer's scale is a variable only once built."""
    if owner is None or not hasattr(owner, "_update_state") or owner.built:
        return
    with tf.init_scope():
        owner.build(model.trainable_variables)


# -- an enabled model's train_step -------------------------------------------------------

_step = threading.local()


class StepScope:
    """One trace of an enabled model's ``train_step``: who scales, and what was updated.

    Within it every ``tape.gradient`` of a float loss (any shape) that nobody scaled
    (Keras's own train step scales through its loss-scale optimizer, which marks
    the loss) is seeded with the model's scale and unscaled in float32, and the
    optimizer update that follows checks finiteness and updates that same scale,
    whichever optimizer it is (the compiled one, or a GAN's own two).

    Attributes:
      loop: the model's ModelLoop (its scale owner).
      owner: the scale owner the tapes used, once one was scaled.
      scaled: optimizer updates whose gradients were loss-scaled.
      unscaled: optimizer updates of gradients tfamp did not scale (a
        non-scalar target, ``output_gradients`` given, or an eager tape).
    """

    def __init__(self, loop: ModelLoop):
        self.loop = loop
        self.owner = None
        self.scaled = 0
        self.unscaled = 0
        self.own_losses = 0  # losses a loss-scale optimizer scaled itself, not yet applied

    def owner_for_tape(self, target, sources):
        """The scale owner for ``tape.gradient(target, sources)`` here, or None (do not scale)."""
        if (tf.executing_eagerly() or not scale_update.is_loss_target(target, sources)
                or scale_update.is_scaled(target)):
            return None
        if self.owner is None:
            model = self.loop.model_ref()
            self.owner = self.loop.scale_owner()
            if model is not None:
                _build_if_needed(self.owner, model)
        return self.owner

    def reported_owner(self):
        """The owner whose scale this step applied, or None if it applied none."""
        if not self.scaled:
            return None
        return self.owner if self.owner is not None else self.loop.find_optimizer()


class train_step_scope:  # noqa: N801  (a context manager, like tf.name_scope)
    """Within it, tapes and optimizer updates follow the model's scale (``StepScope``)."""

    def __init__(self, loop: ModelLoop):
        self._scope = StepScope(loop)

    def __enter__(self) -> StepScope:
        install_patches()
        self._previous = getattr(_step, "scope", None)
        _step.scope = self._scope
        return self._scope

    def __exit__(self, *exc):
        _step.scope = self._previous
        return False


def current_step() -> StepScope | None:
    """The enabled model's train step being traced in this thread, if any."""
    return getattr(_step, "scope", None)


def note_scaled_loss() -> None:
    """A loss-scale optimizer scaled a loss itself (tf_keras ``get_scaled_loss``)."""
    scope = current_step()
    if scope is not None and not tf.executing_eagerly():
        scope.own_losses += 1


def take_scaled_loss() -> bool:
    """True (once per loss) if a loss-scale optimizer scaled a loss in the current step."""
    scope = current_step()
    if scope is None or scope.own_losses <= 0:
        return False
    scope.own_losses -= 1
    return True


def note_update(owner, scaled: bool | None = None) -> None:
    """Records an optimizer update in the current step: scaled by `owner`, or unscaled.

    `scaled` overrides the inference from `owner` (a loss-scale optimizer that
    scaled through its own ``scale_loss`` passes True with no owner).
    """
    scope = current_step()
    if scope is None or tf.executing_eagerly():
        return
    if scaled if scaled is not None else owner is not None:
        scope.scaled += 1
    else:
        scope.unscaled += 1


def scale_values(owner) -> tuple[tf.Tensor, tf.Tensor]:
    """(current scale as float32, skipped steps as int64) of any scale owner.

    Every owner has ``skipped_steps``: both optimizers (a property on tf_keras's)
    and a bare scale state.
    """
    skipped = tf.convert_to_tensor(owner.skipped_steps)
    return current_scale(owner), tf.cast(skipped, tf.int64)


def unscaled_message(model) -> str:
    return (f"tfamp: model {model.name!r}'s train_step applied gradients that tfamp did not "
            f"loss-scale: they did not come from tape.gradient of a float loss (e.g. "
            f"output_gradients was given to tape.gradient, or the target is not a float "
            f"tensor), so float16 gradients below 6e-8 flush to zero there and no "
            f"loss_scale is reported for them. Fix: differentiate the loss itself, "
            f"tape.gradient(loss, variables) (a scalar or a per-example vector; for "
            f"output_gradients=w, differentiate tf.reduce_sum(target * w), the same "
            f"gradients), which tfamp scales; or use dtype='bfloat16' (no loss scaling "
            f"needed).")


# -- loss scaling on the tape ---------------------------------------------------------

def _loops_reached(target) -> list[ModelLoop]:
    """The enabled models whose rewritten call `target` (a tensor or a list of
    them) depends on (in its graph)."""
    targets = tf.nest.flatten(target)
    graph = getattr(targets[0], "graph", None) if targets else None
    with _calls_lock:
        table = dict(_calls.get(graph, {})) if graph is not None else {}
    if not table:
        return []
    found: dict[int, ModelLoop] = {}
    seen = set()
    pending = [t.op for t in targets]
    while pending:
        op = pending.pop()
        if op.name in seen:
            continue
        seen.add(op.name)
        if op.name in table:
            found[id(table[op.name])] = table[op.name]
            continue
        pending.extend(t.op for t in op.inputs)
    return list(found.values())


def _variable_ids(variables) -> set[int]:
    ids = set()
    for v in nest.flatten(variables):
        ids.add(id(v))
        inner = getattr(v, "_value", None)  # a Keras 3 variable's tf.Variable
        if inner is not None:
            ids.add(id(inner))
    return ids


def scale_owner_for(target, sources):
    """The scale owner for ``tape.gradient(target, sources)``, or None (do not scale)."""
    if (tf.executing_eagerly() or not scale_update.is_loss_target(target, sources)
            or scale_update.is_scaled(target)):
        return None
    source_ids = _variable_ids(sources)
    owners = {}
    for loop in _loops_reached(target):
        model = loop.model_ref()
        if model is None or not (_variable_ids(model.trainable_variables) & source_ids):
            continue
        owner = loop.scale_owner()
        if owner is not None:
            owners[id(owner)] = owner
    if len(owners) > 1:
        _warn_once("owners", "tfamp: one loss depends on enabled models with different "
                   "loss-scale optimizers and is differentiated for both; tfamp cannot "
                   "scale it with two scales, so these gradients are not loss-scaled. "
                   "Compute one loss per model (per optimizer).")
        return None
    return next(iter(owners.values()), None)


def current_scale(owner):
    """The owner's current loss scale as a float32 tensor."""
    if hasattr(owner, "_update_state"):  # tfamp's Keras 3 loss-scale optimizer
        if not owner.built:  # its scale is a variable only once built
            return tf.constant(float(owner.initial_scale), tf.float32)
        return tf.cast(tf.convert_to_tensor(owner.dynamic_scale), tf.float32)
    state = getattr(owner, "_loss_scale", owner)  # tfamp's tf_keras optimizer, or a state
    return tf.convert_to_tensor(state.current_loss_scale)


# tfamp's own graph code: AutoGraph (converting the user's step) must leave it as written.
@tf.autograph.experimental.do_not_convert
def _scaled_gradient(original, tape, target, sources, owner, kwargs):
    with scale_update.loss_scale_ops():
        scale = current_scale(owner)
    grads = original(tape, target, sources, scale_update.seed(target, scale), **kwargs)
    _push_pending(owner)
    return tf.nest.map_structure(lambda g: scale_update.unscale(g, scale), grads)


# -- pending scaled steps ---------------------------------------------------------------

def _pending_list() -> list:
    table = getattr(_pending, "table", None)
    if table is None:
        table = _pending.table = weakref.WeakKeyDictionary()
    graph = tf.compat.v1.get_default_graph()
    return table.setdefault(graph, [])


def _push_pending(owner) -> None:
    _pending_list().append(owner)


def take_pending():
    """The scale owner of the oldest pending scaled step in this trace and thread, or None."""
    if tf.executing_eagerly():
        return None
    pending = _pending_list()
    return pending.pop(0) if pending else None


def update_owner_scale(owner, flags, *, count_skipped: bool = True) -> None:
    """Updates `owner`'s scale state after a step whose gradient flags are `flags`."""
    if hasattr(owner, "_update_state"):  # tfamp's Keras 3 loss-scale optimizer
        owner._update_state(flags, count_skipped=count_skipped)
        return
    # tf_keras, or a state
    getattr(owner, "_loss_scale", owner).update_from_flags(flags, count_skipped=count_skipped)


def install_patches() -> None:
    """GradientTape.gradient and the optimizers' update, once per process.

    Inert unless an enabled model's rewritten call is in the traced graph (tape)
    or a scaled step is pending in it (optimizers).
    """
    global _patched
    with _patch_lock:
        if _patched:
            return
        _patched = True
        _patch_tape()
        _patch_tf_keras_optimizer()
        _patch_keras3_optimizer()


def _patch_tape() -> None:
    original = tf.GradientTape.gradient

    @functools.wraps(original)
    def gradient(self, target, sources, output_gradients=None, **kwargs):
        probe = start_scale.current_probe()
        if probe is not None:  # the start-scale probe: unscaled, recorded
            return probe.gradient(original, self, target, sources, output_gradients, kwargs)
        if output_gradients is None:
            scope = current_step()
            owner = (scope.owner_for_tape(target, sources) if scope is not None
                     else scale_owner_for(target, sources))
            if owner is not None:
                return _scaled_gradient(original, self, target, sources, owner, kwargs)
        return original(self, target, sources, output_gradients, **kwargs)

    tf.GradientTape.gradient = gradient


def _is_tfamp_optimizer(optimizer) -> bool:
    module = type(optimizer).__module__
    return module.startswith("tfamp.") and "LossScaleOptimizer" in type(optimizer).__name__


def _is_inner_optimizer(optimizer) -> bool:
    """Wrapped by a loss-scale optimizer (tfamp's or Keras's), which reports its updates."""
    from tfamp.keras.loss_scale3 import INNER_MARK

    return bool(getattr(optimizer, INNER_MARK, False)
                or getattr(optimizer, "_is_wrapped_by_loss_scale_optimizer", False))


def _patch_tf_keras_optimizer() -> None:
    try:
        import tf_keras
    except ImportError:
        return
    optimizer_class = tf_keras.optimizers.Optimizer
    original = optimizer_class.apply_gradients

    @functools.wraps(original)
    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        if start_scale.current_probe() is not None:
            return self.iterations  # the start-scale probe applies nothing
        if _is_tfamp_optimizer(self):
            return original(self, grads_and_vars, *args, **kwargs)
        owner = take_pending()
        if not _is_inner_optimizer(self):
            note_update(owner)
        if owner is None:
            return original(self, grads_and_vars, *args, **kwargs)
        return scale_update.apply_gradients_if_finite(
            self, original, grads_and_vars, args, kwargs,
            functools.partial(update_owner_scale, owner), skipped_steps=owner.skipped_steps)

    optimizer_class.apply_gradients = apply_gradients


def _patch_keras3_optimizer() -> None:
    from tfamp.keras.flavour import keras3_module

    keras = keras3_module()
    if keras is None:
        return
    optimizer_class = keras.optimizers.Optimizer
    original = optimizer_class.apply

    @functools.wraps(original)
    def apply(self, grads, trainable_variables=None):
        if start_scale.current_probe() is not None:
            return None  # the start-scale probe applies nothing
        if _is_tfamp_optimizer(self):
            return original(self, grads, trainable_variables)
        owner = take_pending()
        if not _is_inner_optimizer(self):
            note_update(owner)
        if owner is None:
            return original(self, grads, trainable_variables)
        scale_update.apply_keras3_if_finite(self, original, grads, trainable_variables,
                                            functools.partial(update_owner_scale, owner),
                                            skipped_steps=owner.skipped_steps)
        return None

    optimizer_class.apply = apply


# -- telling the user -----------------------------------------------------------------

def _warn_once(key: str, message: str) -> None:
    if key in _warned_keys:
        return
    _warned_keys.add(key)
    log.warning("%s", message)
    warnings.warn(message, UserWarning, stacklevel=user_stacklevel())


_warned_keys: set[str] = set()


def eager_message(model) -> str:
    return (f"tfamp: model {model.name!r} is called eagerly under a GradientTape (a custom "
            f"training loop without tf.function?), so it runs in float32 there: tfamp "
            f"rewrites traced graphs. Decorate the training step with @tf.function; tfamp "
            f"then runs the model in mixed precision with loss scaling inside it.")


def control_flow_message(model) -> str:
    return (f"tfamp: model {model.name!r} is called inside a tf.cond branch or a "
            f"tf.while_loop body of your training step, so it runs in float32 there: tfamp "
            f"cannot tell which loss it feeds to scale it. Call the model outside the "
            f"cond/loop, or decorate the whole step with @tfamp.function (or run with "
            f"TFAMP_ENABLE=1), which rewrites and scales the whole step.")


def user_stacklevel() -> int:
    """The warnings stacklevel of the first frame outside TensorFlow, Keras and tfamp."""
    import sys

    dirs = [str(Path(tf.__file__).parent), str(Path(__file__).parent.parent)]
    for name in ("tf_keras", "keras"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__file__", None):
            dirs.append(str(Path(module.__file__).parent))
    library_dirs = tuple(dirs)
    frame, level = sys._getframe(1), 1
    while frame is not None:
        name = frame.f_code.co_filename
        if not (name.startswith(library_dirs) or "__autograph_generated" in name):
            return level
        frame, level = frame.f_back, level + 1
    return 2


def _safe_name(name: str) -> str:
    return "".join(c if c.isalnum() or c == "_" else "_" for c in name) or "model"


def call_hook(model, class_call, state, loss_scale_optimizer_class):
    """The bound ``call`` tfamp.enable installs on `model` (tf_keras and Keras 3).

    Inside the user's own tf.function the model runs rewritten, with loss
    scaling; elsewhere exactly as the class's ``call``. Bound, with the class's
    signature: Keras inspects ``call`` (SavedModel export traces it with its
    argument names). Sets ``state.loop``.
    """
    def scale_optimizer():
        optimizer = getattr(model, "optimizer", None)
        return optimizer if isinstance(optimizer, loss_scale_optimizer_class) else None

    state.loop = ModelLoop(model, class_call, state.config, state.check, state.loss_scale,
                           scale_optimizer, state.initial_scale, state.growth_interval,
                           state.min_scale)

    @functools.wraps(class_call)
    def call_function(self, *args, **kwargs):
        return run_call(state.loop, self, args, kwargs)

    return types.MethodType(call_function, model)
