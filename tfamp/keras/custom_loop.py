"""An enabled model inside the user's own training step: mixed precision there too.

``tfamp.enable(model)`` rewrites Keras's own fit / evaluate / predict functions.
A custom loop traces its step with the plain ``tf.function``, which tfamp does
not rewrite; the model's ``call`` hook (``call_hook``) makes the model's part of
such a step mixed precision anyway, for tf_keras and Keras 3 models alike:

* **Forward (and its gradient).** When an enabled model is called while a plain
  tf.function is being traced, its ``call`` runs as a nested tfamp-rewritten
  function (one per model, traced per input signature). TensorFlow
  differentiates a function call from the called graph itself, so the backward
  of the rewritten forward is 16-bit where the forward is; variables stay
  float32 and their gradients arrive float32 (through the Casts' gradients).
* **Loss scaling** (``tape.py``), only for a tape whose float loss depends on
  such a call and whose sources include that model's variables: backprop is
  seeded with the model's scale (its tfamp loss-scale optimizer's, or a scale
  state of its own) and the gradients are unscaled in float32; the next
  optimizer update in that trace skips a non-finite step and updates that scale.

Eager custom loops (no tf.function) stay float32: tfamp rewrites graphs. The
model says so once, with the fix, when it is called eagerly under a recording
GradientTape.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import re
import types
import warnings
import weakref

import tensorflow as tf
from tensorflow.python.eager import record

from tfamp.keras import step_scope, tape
from tfamp.keras.notices import user_stacklevel
from tfamp.runtime.plain import in_plain_calls
from tfamp.runtime.runner import RewrittenFunction, is_tracing_for_tfamp

log = logging.getLogger("tfamp")


class ModelLoop:
    """Per enabled model: its rewritten forward for custom loops, and its scale owner.

    Args:
      model: the enabled Keras model (tf_keras or Keras 3).
      class_call: the class's ``call`` (unbound).
      config_of: () -> the AmpConfig the model runs with now.
      check: validate every rewritten graph.
      scale_owner: () -> the model's scale owner (built), or None without scaling.
    """

    def __init__(self, model, class_call, config_of, check, scale_owner):
        self.model_ref = weakref.ref(model)
        self.class_call = class_call
        self._config_of = config_of
        self._check = check
        self.scale_owner = scale_owner
        self._forward = None
        self._forward_config = None
        self.warned_eager = False
        self.warned_control_flow = False
        self.noted_start_scale = False
        self.skipped_before = None  # the owner's skipped steps when a loop first scaled

    def note_start_scale(self) -> None:
        """Once per model, where the user's own step scales its loss: says that the
        scale starts where nobody chose it from the gradients (``fit`` probes them
        first, TFAMP_ENABLE's start-up hook probes a custom loop; here neither has,
        and the loop did not call ``calibrate_loss_scale``)."""
        if self.noted_start_scale:
            return
        self.noted_start_scale = True
        self._tell_skips_at_exit()
        model = self.model_ref()
        state = getattr(model, "_tfamp_state", None) if model is not None else None
        if (state is None or not state.settings.auto_start or state.start_scale is not None
                or step_scope.process_scaling_registered()):
            return
        owner = self.scale_owner()
        if owner is None or not owner.is_dynamic:
            return
        with tf.init_scope():
            if owner.has_stepped():
                return
            start = float(owner.scale_tensor().numpy())
        log.info("tfamp: model %r in your own training step: dynamic loss scaling starts "
                 "at %g, not from the model's gradients (fit measures them first; a "
                 "custom loop is not measured). If its first steps are skipped, call "
                 "tfamp.calibrate_loss_scale(step, x_batch, y_batch, model=model) once "
                 "before the loop, or pass initial_scale=<number> to tfamp.enable.",
                 model.name, start)

    def _tell_skips_at_exit(self) -> None:
        """A custom loop has no History: at exit, one line if its steps were skipped
        (``tell_skips``), counted from now (``fit`` may share the scale)."""
        owner = self.scale_owner()
        if owner is None:
            return
        with tf.init_scope():
            self.skipped_before = int(owner.skipped_steps.numpy())
        atexit.register(tell_skips, weakref.ref(self))

    def forward(self) -> RewrittenFunction:
        """The rewritten call (made again when the model's config changed)."""
        config = self._config_of()
        if self._forward is None or self._forward_config is not config:
            model_ref, class_call = self.model_ref, self.class_call

            def call(*args, **kwargs):
                model = model_ref()
                # In the model's name scope, as Keras's own steps call it: a keep_fp32
                # pattern (the fallback's, the report's) names a layer alike in both.
                with _name_scope(model.name):
                    return class_call(model, *args, **kwargs)

            call.__name__ = f"{_safe_name(self.model_ref().name)}_call"
            self._forward = RewrittenFunction(call, config, check=self._check)
            self._forward_config = config
        return self._forward


def tell_skips(loop_ref) -> None:
    """At exit: how many steps an enabled model's custom loop skipped, and, where its
    scale ended at its floor (every step overflowing whatever the scale: a layer that
    overflows float16, which ``fit`` and ``TFAMP_ENABLE`` move by themselves), the fix.
    Without it a loop that printed NaN losses heard nothing from tfamp."""
    loop = loop_ref()
    model = loop.model_ref() if loop is not None else None
    owner = loop.scale_owner() if model is not None else None
    if owner is None or loop.skipped_before is None:
        return
    try:
        skipped = int(owner.skipped_steps.numpy()) - loop.skipped_before
        scale = float(owner.scale_tensor().numpy())
    except Exception:  # noqa: BLE001 (interpreter shutdown: nothing to say)
        return
    if skipped <= 0:
        return
    fix = ""
    if scale <= owner.min_scale:
        fix = (" It ends at its floor, where a step overflows whatever the scale: most "
               "likely a layer computing in float16 overflows (values past 65504). "
               "tfamp.calibrate_loss_scale(step, x_batch, y_batch, model=model), called "
               "once before the loop, finds such a layer and keeps it float32 (so does "
               "running the script with TFAMP_ENABLE=1); or keep it float32 yourself "
               "with tfamp.enable(model, config=tfamp.AmpConfig(keep_fp32=[<layer "
               "scope>])), or use dtype='bfloat16'.")
    (log.warning if fix else log.info)(
        "tfamp: model %r in your own training step: its loss scale skipped %d step%s "
        "(float16 values overflowed: those updates were not applied) and ends at %g.%s",
        model.name, skipped, "" if skipped == 1 else "s", scale, fix)


def run_call(loop: ModelLoop, model, args, kwargs):
    """What an enabled model's ``call`` hook does (tf_keras and Keras 3)."""
    if in_plain_calls():
        return loop.class_call(model, *args, **kwargs)
    if tf.executing_eagerly():
        # (fit with run_eagerly=True has its own warning from the step-function hook)
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
    tape.install()
    loop.scale_owner()  # made and built outside this trace
    outputs = loop.forward()(*args, **kwargs)
    step_scope.record_call(outputs, loop)
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
    # Keras's symbolic calls (functional construction, output specs, tf_keras's
    # Model.build(input_shape)) trace in scratch graphs: not a step that runs.
    return getattr(graph, "_building_function", False) and not (
        "scratch_graph" in name or name in ("keras_graph", "build_graph"))


def _in_control_flow_branch() -> bool:
    """True when tracing a tf.cond branch or a tf.while_loop body / condition."""
    from tensorflow.python.ops import control_flow_v2_func_graphs as control_flow

    return isinstance(tf.compat.v1.get_default_graph(), (
        control_flow.CondBranchFuncGraph, control_flow.WhileBodyFuncGraph,
        control_flow.WhileCondFuncGraph))


def call_hook(model, loop: ModelLoop):
    """The bound ``call`` tfamp.enable installs on `model` (tf_keras and Keras 3).

    Inside the user's own tf.function the model runs rewritten, with loss
    scaling; elsewhere exactly as the class's ``call``. Bound, with the class's
    signature: Keras inspects ``call`` (SavedModel export traces it with its
    argument names).
    """

    @functools.wraps(loop.class_call)
    def call_function(self, *args, **kwargs):
        return run_call(loop, self, args, kwargs)

    return types.MethodType(call_function, model)


def part_call_hook(part, parent_name: str, warned: list[bool]):
    """The bound ``call`` tfamp.enable installs on each model nested in an enabled
    one (a VAE's encoder and decoder): the class's ``call``, telling once when the
    user's own step calls the part alone under a GradientTape, where it runs
    float32 (only the enabled model's own call is rewritten there). Inside the
    enabled model's call, fit and saving it says nothing. `warned`: shared by the
    parts of one model (one line per model)."""
    class_call = type(part).call

    @functools.wraps(class_call)
    def call_function(self, *args, **kwargs):
        if (not warned[0] and not in_plain_calls() and record.could_possibly_record()
                and _in_user_tf_function() and not _in_control_flow_branch()):
            warned[0] = True
            warnings.warn(part_message(self, parent_name), UserWarning,
                          stacklevel=user_stacklevel())
        return class_call(self, *args, **kwargs)

    return types.MethodType(call_function, part)


# -- telling the user -----------------------------------------------------------------

def part_message(part, parent_name: str) -> str:
    return (f"tfamp: {part.name!r}, a part of the enabled model {parent_name!r}, is called "
            f"on its own in your training step, so it runs in float32 there: "
            f"tfamp.enable rewrites the model's own call. Call {parent_name!r} itself, "
            f"or rewrite the whole step: @tfamp.function on it, or run the script with "
            f"TFAMP_ENABLE=1.")


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


def _name_scope(name: str):
    """``tf.name_scope(name)``, or none where `name` is no valid root scope (TensorFlow's
    rule; a name Keras takes as a nested scope, "_model", in the user's own scope)."""
    if _ROOT_SCOPE.fullmatch(name):
        return tf.name_scope(name)
    return contextlib.nullcontext()


_ROOT_SCOPE = re.compile(r"[A-Za-z0-9.][A-Za-z0-9_.\\/>-]*")


def _safe_name(name: str) -> str:
    return "".join(c if c.isalnum() or c == "_" else "_" for c in name) or "model"
