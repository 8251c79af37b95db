"""The start loss scale from the model's own gradients (``initial_scale="auto"``).

Dynamic loss scaling starts at 2**15 and halves on each overflowing step, so a
model whose scaled gradients pass 65504 at 2**15 loses its first steps (a
from-scratch ResNet-50: 4 of 4; WGAN-GP: its first critic step). With
``initial_scale="auto"`` (the default of ``tfamp.enable`` and ``TFAMP_ENABLE``)
the first ``fit`` of an enabled model first runs a **probe**: the model's own
``train_step`` once on fit's first batch, traced as a plain (float32)
tf.function in *probe mode*:

* every ``tape.gradient`` of a float loss (the tapes tfamp scales) runs
  unscaled; the probe records the largest |value| of every tensor of the
  backward pass that the seed reaches, i.e. that the loss scale multiplies
  (activation gradients and every intermediate of the backward, nested tapes'
  second-order terms included), and a log2 histogram of the gradients the
  tape returns (weight gradients);
* tfamp's loss-scale optimizers neither scale nor unscale, and every optimizer
  update is skipped (nothing is applied, no slot is created);
* variables the step assigns (BatchNorm statistics, metrics, seed generators)
  are copied before and restored after.

The start scale is the largest power of two that keeps every recorded value
times the scale below ``2**(16 - START_HEADROOM_BITS)`` = 16384, a quarter of
float16's range (capped at 2**24,
floored at the optimizer's ``min_scale``); dynamic scaling takes over from
there. The scale owner is then marked as calibrated only by the steps it takes:
an owner that has taken a step (``iterations`` or ``skipped_steps`` above 0,
which a checkpoint restores) is never recalibrated.

Custom training loops call ``calibrate_loss_scale(step, *args, model=...)``
once before the loop (the same probe on the user's step function).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
import warnings

import numpy as np
import tensorflow as tf

log = logging.getLogger("tfamp")

AUTO = "auto"
# The probe sees one batch before any update; gradients grow in the first steps
# of a from-scratch model, so keep two doublings of room (max * S < 2**14).
START_HEADROOM_BITS = 2
# Ops that write a resource variable: the probe restores what they wrote.
_ASSIGN_OPS = frozenset({
    "AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp",
    "ResourceScatterUpdate", "ResourceScatterAdd", "ResourceScatterSub",
    "ResourceScatterMul", "ResourceScatterDiv", "ResourceScatterMin",
    "ResourceScatterMax", "ResourceScatterNdUpdate", "ResourceScatterNdAdd",
    "ResourceScatterNdSub", "ResourceStridedSliceAssign",
})


@dataclasses.dataclass(frozen=True)
class StartScale:
    """What the probe found and the scale it chose (a structured fact, also logged).

    Attributes:
      scale: the start scale (a power of two).
      max_abs: the largest |value| the float32 backward pass produced.
      where: the tensor that holds it (a variable label or a backward op name).
      weight_max: the largest |weight gradient|.
      underflow_share: share of nonzero weight-gradient values still below
        float16's smallest subnormal at `scale`.
      seconds: wall time of the probe (trace + run + restore).
      batch_size: rows of the batch the probe ran on (None if unknown).
    """

    scale: float
    max_abs: float
    where: str
    weight_max: float
    underflow_share: float
    seconds: float
    batch_size: int | None = None

    def message(self) -> str:
        exponent = int(math.log2(self.scale))
        return (f"tfamp: start loss scale 2^{exponent} ({self.scale:g}) from the first "
                f"batch's float32 gradients (max |g| {self.max_abs:.3g} in {self.where}; "
                f"weight gradients max {self.weight_max:.3g}, "
                f"{100 * self.underflow_share:.2g}% of their values below float16's "
                f"smallest at this scale); probe cost {self.seconds:.2f} s. "
                f"initial_scale=<number> (TFAMP_INITIAL_SCALE) skips the probe.")


def choose_scale(max_abs: float, *, min_scale: float = 1.0) -> float:
    """The largest power of two S with ``max_abs * S < 2**(16 - START_HEADROOM_BITS)``.

    Capped at 2**MAX_SCALE_EXP (all-zero gradients get the cap) and floored
    at `min_scale`.

    Example:
      >>> choose_scale(2.13)   # WGAN-GP's critic kernel: 2.13 * 4096 = 8724
      4096.0
    """
    from tfamp.numerics.ranges import FP16_OVERFLOW_EXP, MAX_SCALE_EXP

    if max_abs > 0:
        top = math.floor(math.log2(max_abs))
        k = FP16_OVERFLOW_EXP - 1 - START_HEADROOM_BITS - top
    else:
        k = MAX_SCALE_EXP
    scale = 2.0 ** min(k, MAX_SCALE_EXP)
    return max(scale, 2.0 ** math.ceil(math.log2(min_scale)))


# -- probe mode ---------------------------------------------------------------------

_probe = threading.local()


class Recorder:
    """What one probe trace saw: the backward tensors of every scaled tape."""

    def __init__(self, op_lists=None):
        # Ops the rewrite can never put in float16 (deny or unlisted: RsqrtGrad,
        # the BatchNorm variance's backward, ...) do not bound the scale: their
        # values stay float32 in the rewritten step.
        self._never_16bit = (
            (lambda op: op_lists.list_of(op) in ("deny", "unlisted"))
            if op_lists is not None else (lambda op: False))
        # Clear-list ops (Reshape, Identity, Tile, ...) take their input's dtype: one
        # that reads only such float32 values stays float32 too (the BatchNorm
        # gradient's per-channel sums and their reshapes).
        self._follows_input = (
            (lambda op: op_lists.list_of(op) == "clear")
            if op_lists is not None else (lambda op: False))
        self.backward: list[tuple[str, tf.Tensor]] = []
        self.weights: list[tuple[str, tf.Tensor]] = []
        self.tapes = 0

    def gradient(self, original, tape, target, sources, output_gradients, kwargs):
        """``tape.gradient`` in probe mode: unscaled, recording what tfamp would scale."""
        from tfamp.keras.scale_update import is_loss_target

        if (tf.executing_eagerly() or output_gradients is not None
                or not is_loss_target(target, sources)):
            return original(tape, target, sources, output_gradients, **kwargs)
        graph = tf.compat.v1.get_default_graph()
        # What the tape seeds with by default (every element of every target).
        seed = tf.nest.map_structure(tf.ones_like, target)
        before = len(graph.get_operations())
        grads = original(tape, target, sources, seed, **kwargs)
        self.tapes += 1
        # Only what the seed reaches scales with the loss scale: the backward
        # also recomputes forward values (a sigmoid for softplus's gradient),
        # which the scale never touches.
        reached = {s.op.name for s in tf.nest.flatten(seed)}
        float32 = set()  # reached ops whose values stay float32 in the rewritten step
        for op in graph.get_operations()[before:]:
            if not any(t.op.name in reached for t in op.inputs):
                continue
            reached.add(op.name)
            float_inputs = [t for t in op.inputs if t.dtype.is_floating]
            if self._never_16bit(op.type) or (
                    self._follows_input(op.type) and float_inputs
                    and all(t.op.name in float32 for t in float_inputs)):
                float32.add(op.name)
                continue
            for out in op.outputs:
                # Single values are the loss path's own (d mean / d sum and
                # their reshapes): float32 in the rewritten step.
                size = out.shape.num_elements() if out.shape.rank is not None else None
                if out.dtype.is_floating and (size is None or size > 1):
                    self.backward.append((op.name, out))
        for source, grad in zip(tf.nest.flatten(sources), tf.nest.flatten(grads),
                                strict=False):
            if grad is None:
                continue
            if isinstance(grad, tf.IndexedSlices):
                grad = grad.values
            self.weights.append((_label(source), grad))
        return grads

    def outputs(self):
        """(backward maxes, weight-gradient counts, weight-gradient maxes) as tensors."""
        from tfamp.numerics.ranges import NUM_COLUMNS, bucket_counts_many

        graph = tf.compat.v1.get_default_graph()
        self.backward = [(n, t) for n, t in self.backward if t.graph is graph]
        self.weights = [(n, t) for n, t in self.weights if t.graph is graph]
        maxes = (tf.stack([tf.reduce_max(tf.abs(tf.cast(t, tf.float32)))
                           for _, t in self.backward])
                 if self.backward else tf.zeros([0]))
        if self.weights:
            counts, weight_maxes = bucket_counts_many([t for _, t in self.weights])
        else:
            counts, weight_maxes = tf.zeros([0, NUM_COLUMNS], tf.int32), tf.zeros([0])
        return maxes, counts, weight_maxes


def current_probe() -> Recorder | None:
    """The probe recording in this thread, if any (the tape and apply patches ask)."""
    return getattr(_probe, "recorder", None)


class probe_mode:  # noqa: N801  (a context manager, like tf.name_scope)
    """Within it, scaled tapes record instead of scaling and updates are skipped."""

    def __init__(self, recorder: Recorder):
        self._recorder = recorder

    def __enter__(self) -> Recorder:
        self._previous = current_probe()
        _probe.recorder = self._recorder
        return self._recorder

    def __exit__(self, *exc):
        _probe.recorder = self._previous
        return False


# -- running a probe ----------------------------------------------------------------

def probe_step(step, args, kwargs, *, extra_state=(), min_scale: float = 1.0,
               op_lists=None) -> StartScale:
    """Runs ``step(*args, **kwargs)`` once in probe mode; returns the chosen scale.

    Args:
      step: a Python training-step function (not yet a tf.function).
      args, kwargs: its arguments (one batch).
      extra_state: variables to restore besides those the step assigns.
      min_scale: the optimizer's floor.
      op_lists: the rewrite's float16 op lists (``AmpConfig.op_lists``): backward
        ops on none of them or on the deny list stay float32 and are not
        recorded. None records every backward op.

    Raises:
      ValueError: the step differentiated no float loss, or its float32
        gradients are not finite (no scale helps: see the message).
    """
    from tfamp.keras import custom_loop
    from tfamp.numerics.keras_probe import plain_function
    from tfamp.numerics.ranges import TensorRange

    custom_loop.install_patches()
    start = time.perf_counter()
    recorder = Recorder(op_lists)

    def run(*a, **k):
        with probe_mode(recorder), custom_loop.plain_calls():
            step(*a, **k)
        return recorder.outputs()

    function = plain_function(run)
    concrete = function.get_concrete_function(*args, **kwargs)
    if not recorder.tapes:
        raise ValueError("the step differentiated no float loss with a GradientTape")
    restore = _unique([*assigned_variables(concrete), *extra_state])
    saved = [np.array(v.numpy(), copy=True) for v in restore]
    # Grappler is off for this one call: on a ResNet-50 step (14k ops) it took
    # 20-28 s of the probe's first run, which then took 4 s without it.
    options = tf.config.optimizer.get_experimental_options()
    tf.config.optimizer.set_experimental_options({**options, "disable_meta_optimizer": True})
    try:
        maxes, counts, weight_maxes = (x.numpy() for x in concrete(*_flat_inputs(args, kwargs)))
    finally:
        tf.config.optimizer.set_experimental_options(options)
        for variable, value in zip(restore, saved, strict=True):
            variable.assign(value)
    names = [n for n, _ in recorder.backward]
    weight_names = [n for n, _ in recorder.weights]
    if not (np.all(np.isfinite(maxes)) and np.all(np.isfinite(weight_maxes))):
        bad = [n for n, m in zip(names + weight_names, [*maxes, *weight_maxes], strict=True)
               if not np.isfinite(m)][:3]
        raise ValueError(f"the first batch's float32 gradients are not finite ({', '.join(bad)})")
    all_values = [*zip(names, maxes, strict=True), *zip(weight_names, weight_maxes, strict=True)]
    where, top = max(all_values, key=lambda item: item[1]) if all_values else ("-", 0.0)
    scale = choose_scale(float(top), min_scale=min_scale)
    ranges = [TensorRange.from_vector(n, n, "weight_gradient", row, m)
              for n, row, m in zip(weight_names, counts, weight_maxes, strict=True)]
    nonzero = sum(r.nonzero for r in ranges)
    lost = sum(r.underflow_share(scale) * r.nonzero for r in ranges)
    return StartScale(scale=scale, max_abs=float(top), where=where,
                      weight_max=float(max(weight_maxes, default=0.0)),
                      underflow_share=lost / nonzero if nonzero else 0.0,
                      seconds=time.perf_counter() - start, batch_size=_rows(args))


def assigned_variables(concrete) -> list:
    """The captured variables the traced step writes (outer graph; nested
    function bodies are not searched: see BUILD_NOTES)."""
    graph = concrete.graph
    written = set()
    for op in graph.get_operations():
        if op.type in _ASSIGN_OPS:
            written.add(id(op.inputs[0]))
    internal = {id(inner): external for external, inner in graph.captures}
    by_handle = {}
    for variable in concrete.variables:
        handle = getattr(variable, "handle", None)
        if handle is not None:
            by_handle[id(handle)] = variable
    found = []
    for key in written:
        external = internal.get(key)
        variable = by_handle.get(id(external)) if external is not None else None
        if variable is not None:
            found.append(variable)
    return found


def _flat_inputs(args, kwargs):
    return [t for t in tf.nest.flatten((args, kwargs), expand_composites=True)
            if isinstance(t, (tf.Tensor, tf.Variable, np.ndarray))]


def _unique(variables) -> list:
    seen, result = set(), []
    for v in variables:
        if id(v) not in seen:
            seen.add(id(v))
            result.append(v)
    return result


def _rows(args) -> int | None:
    for t in tf.nest.flatten(args):
        shape = getattr(t, "shape", None)
        if shape is not None and len(shape) and shape[0] is not None:
            return int(shape[0])
    return None


def _label(variable) -> str:
    path = getattr(variable, "path", None)
    if isinstance(path, str):
        return path
    return str(getattr(variable, "name", "tensor")).split(":")[0]


# -- the scale owner --------------------------------------------------------------------

def has_stepped(owner) -> bool:
    """True if `owner` (a loss-scale optimizer or scale state) has taken a step.

    Its ``iterations`` and ``skipped_steps`` are checkpointed: a restored run
    keeps its scale.
    """
    for name in ("iterations", "skipped_steps"):
        value = getattr(owner, name, None)
        if value is None:
            continue
        try:
            if int(np.asarray(value.numpy() if hasattr(value, "numpy") else value)) > 0:
                return True
        except (TypeError, ValueError):
            continue
    return False


def set_scale(owner, scale: float) -> None:
    """Sets `owner`'s current loss scale (a tfamp loss-scale optimizer or scale state)."""
    if hasattr(owner, "_update_state"):  # tfamp's Keras 3 loss-scale optimizer (built)
        owner.dynamic_scale.assign(scale)
        return
    state = getattr(owner, "_loss_scale", owner)
    state.current_loss_scale.assign(scale)


def is_dynamic(owner) -> bool:
    return bool(getattr(owner, "is_dynamic", getattr(owner, "dynamic", False)))


# -- fit ------------------------------------------------------------------------------

def before_fit(model, state, args, kwargs) -> StartScale | None:
    """What an enabled model's ``fit`` does first: calibrate its start scale once.

    Runs only for a dynamic scale with ``initial_scale="auto"``, an owner that
    has taken no step, and a first batch fit's data can give without consuming
    it (arrays, tensors, a tf.data Dataset). Failing, whatever the cause, it
    warns and training starts at the default scale: the probe never stops a
    ``fit``.
    """
    if not getattr(state, "auto_start", False) or state.loop is None:
        return None
    if getattr(state, "start_scale", None) is not None:
        return None
    owner = state.loop.scale_owner()
    if owner is None or not is_dynamic(owner):
        return None
    try:
        return _calibrate_for_fit(model, state, owner, args, kwargs)
    except Exception as err:  # training goes on at the default scale; the user is told
        state.start_scale = False
        start = _scale_now(owner)
        _warn(f"tfamp: model {model.name!r}: no start scale from the gradients "
              f"({type(err).__name__}: {err}); dynamic scaling starts at "
              f"{'its initial scale' if start is None else format(start, 'g')}. Fix: pass "
              f"initial_scale=<number> to tfamp.enable (TFAMP_INITIAL_SCALE) to choose it "
              f"yourself.")
        return None


def _calibrate_for_fit(model, state, owner, args, kwargs) -> StartScale | None:
    from tfamp.keras.custom_loop import _build_if_needed

    batch = first_batch(model, args, kwargs)
    if batch is None:
        _warn(f"tfamp: model {model.name!r}: no start scale from the gradients: fit's data "
              f"is not arrays, tensors or a tf.data.Dataset, which tfamp can read a batch "
              f"from without consuming it, so dynamic scaling starts at 2^15 and may skip "
              f"its first steps. Fix: pass arrays or a tf.data.Dataset, or call "
              f"tfamp.calibrate_loss_scale(model.train_step, batch, model=model) first.")
        state.start_scale = False
        return None
    cls = type(model)
    found = probe_step(lambda data: cls.train_step(model, data), (batch,), {},
                       extra_state=_state_variables(model),
                       min_scale=getattr(owner, "min_scale", 1.0),
                       op_lists=_float16_lists(state))
    owner = state.loop.scale_owner()  # the probe may have built the model
    _build_if_needed(owner, model)
    if has_stepped(owner):
        state.start_scale = False
        return None
    set_scale(owner, found.scale)
    state.start_scale = found
    log.info("%s", found.message())
    return found


def _float16_lists(state):
    config = getattr(state, "config", None)
    return config.op_lists if config is not None and config.dtype == "float16" else None


def first_batch(model, args, kwargs):
    """Fit's first batch as Keras hands it to ``train_step``, or None."""
    from tfamp.keras.flavour import flavour_of

    x = args[0] if args else kwargs.get("x")
    y = args[1] if len(args) > 1 else kwargs.get("y")
    batch_size = (args[2] if len(args) > 2 else kwargs.get("batch_size")) or 32
    sample_weight = kwargs.get("sample_weight")
    if isinstance(x, tf.data.Dataset):
        dataset = x
    else:
        readable = (np.ndarray, tf.Tensor)
        parts = tf.nest.flatten(x) + tf.nest.flatten(y) + tf.nest.flatten(sample_weight)
        if not parts or not all(p is None or isinstance(p, readable) for p in parts):
            return None
        if x is None:
            return None
        flavour = flavour_of(model)
        dataset = _array_dataset(flavour, x, y, sample_weight, int(batch_size))
    for batch in dataset.take(1):
        return batch
    return None


def _array_dataset(flavour, x, y, sample_weight, batch_size: int):
    """The dataset each Keras's own array adapter builds (same element structure)."""
    if flavour.is_keras3:
        from keras.src.trainers.data_adapters import array_data_adapter

        adapter = array_data_adapter.ArrayDataAdapter(
            x, y, sample_weight=sample_weight, batch_size=batch_size, shuffle=False)
        return adapter.get_tf_dataset()
    from tf_keras.src.engine import data_adapter

    adapter = data_adapter.TensorLikeDataAdapter(
        x, y, sample_weights=sample_weight, batch_size=batch_size, shuffle=False)
    return adapter.get_dataset()


def _state_variables(model) -> list:
    from tfamp.numerics.keras_probe import state_variables

    return state_variables(model)


def _scale_now(owner) -> float | None:
    """The owner's scale as a number, or None if it cannot be read (for messages)."""
    from tfamp.keras.custom_loop import current_scale

    try:
        return float(current_scale(owner).numpy())
    except Exception:  # a message must not fail on the value it reports
        return None


def _warn(message: str) -> None:
    from tfamp.keras.custom_loop import user_stacklevel

    log.warning("%s", message)
    warnings.warn(message, UserWarning, stacklevel=user_stacklevel())


# -- custom loops -----------------------------------------------------------------------

def calibrate_loss_scale(step, *args, model=None, **kwargs) -> StartScale:
    """Sets the start loss scale of a custom loop from its step's own gradients.

    Call it once before the loop, with the step and its first batch. The step
    runs once in float32 in probe mode (nothing is applied, variables it
    writes are restored) and the scale its tapes use is set: `model`'s
    (an enabled model: its loss-scale optimizer or custom-loop scale) or,
    under ``TFAMP_ENABLE``, the process-wide custom-loop scale.

    Args:
      step: the training step, a Python function or a tf.function.
      *args, **kwargs: its arguments for one batch.
      model: the enabled model whose scale the step uses (None: TFAMP_ENABLE's).

    Returns:
      the StartScale (also logged).

    Example:
      >>> tfamp.enable(model)
      >>> tfamp.calibrate_loss_scale(train_step, x[:32], y[:32], model=model)
      >>> for x_batch, y_batch in data: train_step(x_batch, y_batch)
    """
    owner = _custom_loop_owner(model)
    python_step = getattr(step, "python_function", step)
    extra = _state_variables(model) if model is not None else []
    found = probe_step(python_step, args, kwargs, extra_state=extra,
                       min_scale=getattr(owner, "min_scale", 1.0),
                       op_lists=_float16_lists(getattr(model, "_tfamp_state", None)))
    if model is not None:
        from tfamp.keras.custom_loop import _build_if_needed

        _build_if_needed(owner, model)
    set_scale(owner, found.scale)
    state = getattr(model, "_tfamp_state", None)
    if state is not None:
        state.start_scale = found
    log.info("%s", found.message())
    return found


def _custom_loop_owner(model):
    if model is not None:
        state = getattr(model, "_tfamp_state", None)
        owner = state.loop.scale_owner() if state is not None and state.loop else None
        if owner is None:
            raise ValueError(
                f"calibrate_loss_scale needs a model tfamp.enable was called on with "
                f"loss scaling; model {getattr(model, 'name', model)!r} has none. Call "
                f"tfamp.enable(model) first (loss_scale='dynamic'), or pass model=None "
                f"under TFAMP_ENABLE=1.")
        return owner
    from tfamp.runtime import startup

    owner = startup.process_scale_state()
    if owner is None:
        raise ValueError(
            "calibrate_loss_scale(model=None) sets TFAMP_ENABLE's custom-loop scale, but "
            "TFAMP_ENABLE is not on (or its loss scaling is off). Pass the enabled model "
            "(model=...), or run the script with TFAMP_ENABLE=1.")
    return owner
