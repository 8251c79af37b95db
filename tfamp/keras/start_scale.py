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

**At scale** (a tf.distribute strategy): the probe runs the way the step runs,
once per replica in a replica context (``replicas.run_per_replica``: Keras's
metric variables accept updates only there), each replica on its share of the
batch its worker read; the largest magnitude over every replica of every
worker (``replicas.agree_rows``) sets the one start scale. A probe that fails
on one worker fails on all (each warns and starts at the default scale).

Custom training loops call ``calibrate_loss_scale(step, *args, model=...)``
once before the loop (the same probe on the user's step function).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import time

import numpy as np
import tensorflow as tf

from tfamp.keras import replicas, step_scope, tape
from tfamp.keras.scale_update import is_loss_target
from tfamp.keras.step_scope import probe_mode
from tfamp.runtime.plain import plain_calls, plain_function

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


# -- recording ------------------------------------------------------------------------

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


# -- running a probe ----------------------------------------------------------------

def probe_step(step, args, kwargs, *, extra_state=(), min_scale: float = 1.0,
               op_lists=None, strategy=None, per_replica: bool = True) -> StartScale:
    """Runs ``step(*args, **kwargs)`` once in probe mode; returns the chosen scale.

    Args:
      step: a Python training-step function (not yet a tf.function).
      args, kwargs: its arguments (one batch).
      extra_state: variables to restore besides those the step assigns.
      min_scale: the optimizer's floor.
      op_lists: the rewrite's float16 op lists (``AmpConfig.op_lists``): backward
        ops on none of them or on the deny list stay float32 and are not
        recorded. None records every backward op.
      strategy: the model's tf.distribute strategy: every worker chooses from
        the largest value of all (None: one device).
      per_replica: run `step` once per replica of `strategy` (a Keras
        ``train_step``); False for a step that distributes itself (a custom
        loop's, calling ``strategy.run``).

    Raises:
      ValueError: the step differentiated no float loss, or its float32
        gradients are not finite (no scale helps: see the message), here or
        on another replica or worker.
    """
    tape.install()
    start = time.perf_counter()
    try:
        local = _probe_locally(step, args, kwargs, extra_state, op_lists,
                               strategy if per_replica else None)
        error = None
    except Exception as err:  # every worker must still reach the agreement below
        local, error = None, err
    row = ([1.0, local.top, local.weight_max] if local is not None else [0.0, 0.0, 0.0])
    agreed = replicas.agree_rows(strategy, np.asarray(row, np.float64))
    if error is not None:
        raise error
    if not agreed[:, 0].all():
        raise ValueError("the probe failed on another replica or worker (its warning says why)")
    top, weight_max = float(agreed[:, 1].max()), float(agreed[:, 2].max())
    where = local.where if local.top >= top else "another replica or worker"
    scale = choose_scale(top, min_scale=min_scale)
    return StartScale(scale=scale, max_abs=top, where=where, weight_max=weight_max,
                      underflow_share=local.underflow_share(scale),
                      seconds=time.perf_counter() - start, batch_size=_rows(args))


@dataclasses.dataclass(frozen=True)
class _Found:
    """What this worker's replicas measured (largest over them)."""

    top: float
    where: str
    weight_max: float
    ranges: tuple  # TensorRange of each weight gradient (counts summed over replicas)

    def underflow_share(self, scale: float) -> float:
        nonzero = sum(r.nonzero for r in self.ranges)
        lost = sum(r.underflow_share(scale) * r.nonzero for r in self.ranges)
        return lost / nonzero if nonzero else 0.0


def _probe_locally(step, args, kwargs, extra_state, op_lists, strategy) -> _Found:
    """The probe on this worker's replicas (no communication with other workers)."""
    from tfamp.numerics.ranges import TensorRange

    recorders = []

    def replica_step(args, kwargs):
        args, kwargs = replicas.replica_rows((args, kwargs))
        recorder = Recorder(op_lists)
        recorders.append(recorder)
        with probe_mode(recorder), plain_calls():
            step(*args, **kwargs)
        return recorder.outputs()

    def run(args, kwargs):
        per_replica = replicas.run_per_replica(strategy, replica_step, args, kwargs)
        maxes, counts, weight_maxes = zip(*per_replica, strict=True)
        return tf.stack(maxes), tf.stack(counts), tf.stack(weight_maxes)

    concrete = plain_function(run).get_concrete_function(args, kwargs)
    if not recorders or not recorders[0].tapes:
        raise ValueError("the step differentiated no float loss with a GradientTape")
    restore = _unique([*assigned_variables(concrete), *extra_state])
    saved = [(c, np.array(c.numpy(), copy=True))
             for v in restore for c in replicas.local_components(v)]
    # Grappler is off for this one call: on a ResNet-50 step (14k ops) it took
    # 20-28 s of the probe's first run, which then took 4 s without it.
    options = tf.config.optimizer.get_experimental_options()
    tf.config.optimizer.set_experimental_options({**options, "disable_meta_optimizer": True})
    try:
        maxes, counts, weight_maxes = (x.numpy() for x in concrete(args, kwargs))
    finally:
        tf.config.optimizer.set_experimental_options(options)
        for component, value in saved:
            component.assign(value)
    recorder = recorders[0]
    names = [_unreplicated(n) for n, _ in recorder.backward]
    weight_names = [n for n, _ in recorder.weights]
    maxes, weight_maxes = maxes.max(axis=0), weight_maxes.max(axis=0)
    counts = counts.sum(axis=0)
    if not (np.all(np.isfinite(maxes)) and np.all(np.isfinite(weight_maxes))):
        bad = [n for n, m in zip(names + weight_names, [*maxes, *weight_maxes], strict=True)
               if not np.isfinite(m)][:3]
        raise ValueError(f"the first batch's float32 gradients are not finite ({', '.join(bad)})")
    all_values = [*zip(names, maxes, strict=True), *zip(weight_names, weight_maxes, strict=True)]
    where, top = max(all_values, key=lambda item: item[1]) if all_values else ("-", 0.0)
    ranges = tuple(TensorRange.from_vector(n, n, "weight_gradient", row, m)
                   for n, row, m in zip(weight_names, counts, weight_maxes, strict=True))
    return _Found(top=float(top), where=where,
                  weight_max=float(max(weight_maxes, default=0.0)), ranges=ranges)


def _unreplicated(name: str) -> str:
    """An op's name without a replica's "replica_<n>/" scope (wherever it sits)."""
    return re.sub(r"(^|/)replica_\d+/", r"\1", name)


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


# -- fit's first batch --------------------------------------------------------------------

def first_batch(flavour, args, kwargs):
    """Fit's first batch as Keras hands it to ``train_step`` (this worker's), or None.

    Arrays and tensors are cut as Keras's own array adapter cuts them; a
    tf.data Dataset is read for one element (it must be re-iterable, as ``fit``
    reads it again); generators and Sequences are not read.
    """
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
        dataset = flavour.array_dataset(x, y, sample_weight, int(batch_size))
    for batch in dataset.take(1):
        return batch
    return None


# -- custom loops -----------------------------------------------------------------------

def calibrate_loss_scale(step, *args, model=None, strategy=None, **kwargs) -> StartScale:
    """Sets the start loss scale of a custom loop from its step's own gradients.

    Call it once before the loop, with the step and its first batch. The step
    runs once in float32 in probe mode (nothing is applied, variables it
    writes are restored) and the scale its tapes use is set: `model`'s
    (an enabled model: its loss-scale optimizer or custom-loop scale) or,
    under ``TFAMP_ENABLE``, the process-wide custom-loop scale.

    Under a tf.distribute strategy, call it on every worker with the batch it
    read: the step (which calls ``strategy.run`` itself) runs once, and every
    worker sets the one scale the largest value of all of them gives.

    Args:
      step: the training step, a Python function or a tf.function.
      *args, **kwargs: its arguments for one batch.
      model: the enabled model whose scale the step uses (None: TFAMP_ENABLE's).
      strategy: the strategy the step distributes with (default: the model's,
        else the one in scope).

    Returns:
      the StartScale (also logged).

    Example:
      >>> tfamp.enable(model)
      >>> tfamp.calibrate_loss_scale(train_step, x[:32], y[:32], model=model)
      >>> for x_batch, y_batch in data: train_step(x_batch, y_batch)
    """
    from tfamp.keras.range_probe import state_variables

    lifecycle = getattr(model, "_tfamp_state", None) if model is not None else None
    owner = _custom_loop_owner(model, lifecycle)
    if strategy is None:
        strategy = (lifecycle.strategy() if lifecycle is not None
                    else tf.distribute.get_strategy())
    python_step = getattr(step, "python_function", step)
    found = probe_step(python_step, args, kwargs,
                       extra_state=state_variables(model) if model is not None else [],
                       min_scale=owner.min_scale,
                       op_lists=lifecycle.float16_lists() if lifecycle is not None else None,
                       strategy=strategy, per_replica=False)
    owner.set_scale(found.scale)
    if lifecycle is not None:
        lifecycle.start_scale = found
    log.info("%s", found.message())
    return found


def _custom_loop_owner(model, lifecycle):
    if model is not None:
        owner = lifecycle.scale_owner() if lifecycle is not None else None
        if owner is None:
            raise ValueError(
                f"calibrate_loss_scale needs a model tfamp.enable was called on with "
                f"loss scaling; model {getattr(model, 'name', model)!r} has none. Call "
                f"tfamp.enable(model) first (loss_scale='dynamic'), or pass model=None "
                f"under TFAMP_ENABLE=1.")
        return owner
    owner = step_scope.process_owner()
    if owner is None:
        raise ValueError(
            "calibrate_loss_scale(model=None) sets TFAMP_ENABLE's custom-loop scale, but "
            "TFAMP_ENABLE is not on (or its loss scaling is off). Pass the enabled model "
            "(model=...), or run the script with TFAMP_ENABLE=1.")
    return owner
