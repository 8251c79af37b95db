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
floored at the optimizer's ``min_scale``), halved up to twice more where that
sends no more weight-gradient values below float16's smallest subnormal
(``extra_room``: gradients can grow past two doublings after the first update),
and halved on down to TensorFlow's usual start 2**15 while that sends no more of
them below float16's smallest either and at most 1% below its smallest normal (a
scale above 2**15 is taken only where it keeps gradients from underflowing or
their bits; ``USUAL_START``); dynamic scaling takes over from there. The scale
owner is then marked as calibrated only by the steps it takes:
an owner whose scale state has run (good or skipped steps above 0, or a scale
moved from its initial value, which a checkpoint restores) is never recalibrated
(``scale_state.scale_has_run``; the optimizer's ``iterations`` alone do not count).

**At scale** (a tf.distribute strategy): the probe runs the way the step runs,
once per replica in a replica context (``replicas.run_per_replica``: Keras's
metric variables accept updates only there), each replica on its share of the
batch its worker read; the largest magnitude over every replica of every
worker (``replicas.agree_rows``) sets the one start scale. A probe that fails
on one worker fails on all (each warns and starts at the default scale).

Custom training loops call ``calibrate_loss_scale(step, *args, model=...)`` (``calibrate.py``)
once before the loop (the same probe on the user's step function). Under
``TFAMP_ENABLE`` the start-up hook does that itself, before the step's first
run, with the batch it was called with (``tfamp.runtime.startup``).
"""

from __future__ import annotations

import collections.abc
import contextlib
import dataclasses
import itertools
import logging
import math
import re
import threading
import time

import numpy as np
import tensorflow as tf

from tfamp.keras import replicas, scale_update, tape
from tfamp.keras.scale_update import is_loss_target
from tfamp.keras.step_scope import probe_mode
from tfamp.runtime.plain import plain_calls, plain_function

log = logging.getLogger("tfamp")


class NoLossDifferentiated(ValueError):
    """The probed function took no gradient of a float loss (not a training step)."""

AUTO = "auto"
# The probe sees one batch before any update; gradients grow in the first steps
# of a from-scratch model, so keep two doublings of room (max * S < 2**14).
START_HEADROOM_BITS = 2
# After the float32 fallback the probe runs again (the skips before it left the
# scale at its floor): those steps showed values outgrowing float16, and the scale
# then only rises, so it keeps 2^4 more room. Measured (BUILD_NOTES.md, session
# 25): with the start's 2 bits a Dense whose gradients grew 20x in its first
# epoch lost 4 more steps to halvings, none with 6; with 10, SimCLR's contrastive
# step rose only from 1 to 2.
AFTER_FALLBACK_HEADROOM_BITS = START_HEADROOM_BITS + 4
# Where it costs nothing, the start takes up to two more halvings of room: those
# that send no more than EXTRA_ROOM_UNDERFLOW of the weight-gradient values (the
# probe's histogram of them) below float16's smallest subnormal. Measured
# (BUILD_NOTES.md, session 31): TensorFlow's quickstart CNN under Adam grew its
# largest gradient 12.6x on the second step, past the start's two bits (a skipped
# step, update cosine 0.88 after 8 steps); at two more bits no weight-gradient
# value underflowed more than at the first choice. A tiny loss keeps its scale:
# there every halving loses values.
EXTRA_ROOM_BITS = 2
EXTRA_ROOM_UNDERFLOW = 1e-4
# Above TensorFlow's and Keras's usual start, 2**15, a higher scale buys only
# small gradients kept from underflowing; the risk it adds is a skipped step
# when the gradients move. So the start comes down towards 2**15 for as long as
# each halving sends no more than EXTRA_ROOM_UNDERFLOW of the weight-gradient
# values below float16's smallest, and at most SETTLE_SUBNORMAL of them sit
# below its smallest normal (where they keep fewer bits). Measured (BUILD_NOTES.md,
# session 38): keras.io's collaborative filtering (one dot product over the
# whole batch) read max |g| 0.0124 on its first batch, started at 2**18 and
# skipped its second step, whose gradient was 20x larger (update cosine 0.935
# against float32's); from 2**15 it skips nothing (1.0000), with 0.9% of its
# weight-gradient values (its L2 penalty's, on weights near 0) below float16's
# smallest normal. A tiny loss (x1e-6, tests/patterns.py's VAE) keeps 2**21 or
# more of its 2**24: at 2**20 1.3% of its values are there (6.5% at 2**17, and
# none underflows).
USUAL_START = 2.0**15
SETTLE_SUBNORMAL = 0.01
# The start-scale line adds a note when at least this share of the weight-gradient
# values sits below float16's smallest normal at the scale chosen (see
# StartScale._subnormal_note). Measured (BUILD_NOTES.md, session 34): under
# 0.5% on keras-hub's T5, GPT-2, BERT, ResNet, ViT and Llama and on Keras-GAN's
# cgan and lsgan; 16% on Keras-GAN's wgan, whose generator drifts past float32's
# own noise in float16 and not in bfloat16.
SUBNORMAL_NOTE = 0.1
# Ops that write a resource variable (their first input): the probe restores what
# they wrote. A tf.random.Generator's state is one (tf_keras's random layers draw
# from one: a probe that advanced it gave training other flips and crops than
# float32's from the same seed, a helper found in session 22).
_ASSIGN_OPS = frozenset({
    "AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp",
    "ResourceScatterUpdate", "ResourceScatterAdd", "ResourceScatterSub",
    "ResourceScatterMul", "ResourceScatterDiv", "ResourceScatterMin",
    "ResourceScatterMax", "ResourceScatterNdUpdate", "ResourceScatterNdAdd",
    "ResourceScatterNdSub", "ResourceStridedSliceAssign",
    "RngReadAndSkip", "RngSkip", "StatefulUniform", "StatefulUniformInt",
    "StatefulUniformFullInt", "StatefulStandardNormalV2", "StatefulTruncatedNormal",
    "StatefulRandomBinomial",
})


@dataclasses.dataclass(frozen=True)
class StartScale:
    """What the probe found and the scale it chose (a structured fact, also logged).

    Attributes:
      scale: the start scale (a power of two).
      max_abs: the largest |value| the scale must fit: of the float32 backward
        pass, or of the float16 step's where that is larger (per unit of scale).
      where: the tensor that holds it (a variable label or a backward op name).
      weight_max: the largest |weight gradient|.
      underflow_share: share of nonzero weight-gradient values still below
        float16's smallest subnormal at `scale`.
      subnormal_share: share of them below float16's smallest normal (2^-14)
        at `scale`, where float16 keeps fewer significant bits: from
        SUBNORMAL_NOTE on the line names bfloat16.
      seconds: wall time of the probe (trace + run + restore).
      batch_size: rows of the batch the probe ran on (None if unknown).
      how: what ran: the step's own first trace, cut down to what the
        backward values need, or a trace of the step of its own.
      checked: what the check on the float16 step found (``_checked_on_16bit``),
        or "" where it did not run (a trace of its own).
      extra_room: halvings below ``choose_scale(max_abs)`` taken because they
        lose no weight-gradient values (``extra_room``; down to USUAL_START
        where that takes more than EXTRA_ROOM_BITS).
      forward_overflow: the check on the float16 step overflowed at every scale it
        tried (three, 2^8 apart): most likely an overflow no loss scale fixes (a
        forward pass's), the float32 fallback's case, which looks at scale 1.
    """

    scale: float
    max_abs: float
    where: str
    weight_max: float
    underflow_share: float
    seconds: float
    batch_size: int | None = None
    how: str = "a trace of its own"  # or "the step's own trace" (no second trace)
    checked: str = ""
    extra_room: int = 0
    subnormal_share: float = 0.0
    room_underflow: float = 0.0  # the share of underflow_share the extra room added
    forward_overflow: bool = False

    def message(self) -> str:
        exponent = int(math.log2(self.scale))
        checked = f"; {self.checked}" if self.checked else ""
        if self.extra_room:
            times = {1: "once", 2: "twice"}.get(self.extra_room, f"{self.extra_room} times")
            cost = (f"{100 * self.room_underflow:.2g}% more of them" if self.room_underflow > 0
                    else "no more of them")
            why = "for room"
            if self.extra_room > EXTRA_ROOM_BITS:  # (then on down towards USUAL_START)
                why = (f"for room ({EXTRA_ROOM_BITS} to grow, "
                       f"{self.extra_room - EXTRA_ROOM_BITS} towards the usual start "
                       f"2^{int(math.log2(USUAL_START))})")
            checked += f"; halved {times} more {why}, which puts {cost} below it"
        source = "float32 gradients" if not self.checked else "gradients"
        # max_abs: of the backward values the scale must fit (16-bit ones), where the
        # weight gradients may be float32 and larger.
        return (f"tfamp: start loss scale 2^{exponent} ({self.scale:g}) from the first "
                f"batch's {source} (the scale must fit max |g| {self.max_abs:.3g}, in "
                f"{self.where}; "
                f"weight gradients max {self.weight_max:.3g}, "
                f"{100 * self.underflow_share:.2g}% of their values below float16's "
                f"smallest at this scale{checked}); probe cost {self.seconds:.2f} s (on "
                f"{self.how}). initial_scale=<number> (TFAMP_INITIAL_SCALE) skips the probe."
                f"{self._subnormal_note()}")

    def _subnormal_note(self) -> str:
        if self.subnormal_share < SUBNORMAL_NOTE:
            return ""
        from tfamp.numerics.ranges import MAX_SCALE_EXP

        if self.scale * 2.0**EXTRA_ROOM_BITS >= 2.0**MAX_SCALE_EXP:
            why = (f"the gradients are that small even at the largest start scales "
                   f"(up to 2^{MAX_SCALE_EXP})")
        else:
            why = (f"this backward pass spans more range than float16 holds at one scale "
                   f"(its largest value {self.max_abs:.3g}, the largest weight gradient "
                   f"{self.weight_max:.3g})")
        return (f" Note: {100 * self.subnormal_share:.0f}% of the weight-gradient values "
                f"sit below float16's smallest normal (6.1e-5) at this scale, where it "
                f"keeps fewer significant bits: {why}. bfloat16 (TFAMP_DTYPE=bfloat16, or "
                f"dtype='bfloat16') has float32's range.")


def choose_scale(max_abs: float, *, min_scale: float = 1.0,
                 headroom_bits: int = START_HEADROOM_BITS) -> float:
    """The largest power of two S with ``max_abs * S < 2**(16 - headroom_bits)``.

    Capped at 2**MAX_SCALE_EXP (all-zero gradients get the cap) and floored
    at `min_scale`.

    Example:
      >>> choose_scale(2.13)   # WGAN-GP's critic kernel: 2.13 * 4096 = 8724
      4096.0
    """
    from tfamp.numerics.ranges import FP16_OVERFLOW_EXP, MAX_SCALE_EXP

    if max_abs > 0:
        top = math.floor(math.log2(max_abs))
        k = FP16_OVERFLOW_EXP - 1 - headroom_bits - top
    else:
        k = MAX_SCALE_EXP
    scale = 2.0 ** min(k, MAX_SCALE_EXP)
    return max(scale, 2.0 ** math.ceil(math.log2(min_scale)))


def extra_room(rises, *, scale: float, min_scale: float = 1.0) -> int:
    """How many of the halvings after `scale` to take: `rises[j - 1]` is the share
    of weight-gradient values that underflow at ``scale / 2**j`` and not at
    `scale` (largest over workers); each halving taken must stay within
    EXTRA_ROOM_UNDERFLOW, and the scale above `min_scale`'s power of two.

    Example:
      >>> extra_room([0.0, 0.0], scale=2.0**17)
      2
      >>> extra_room([0.0, 0.3], scale=2.0**17)   # a tiny loss: the second halving loses 30%
      1
    """
    floor = 2.0 ** math.ceil(math.log2(min_scale))
    taken = 0
    for j, rise in enumerate(rises, start=1):
        if rise > EXTRA_ROOM_UNDERFLOW or scale / 2.0**j < floor:
            break
        taken = j
    return taken


# -- recording ------------------------------------------------------------------------

# Ops whose output values are an arrangement or a selection of their inputs' (or
# those masked to 0): never larger, so their outputs add nothing to the largest
# value a scale must fit, and the probe does not reduce them (fewer ops to trace).
_NO_LARGER_THAN_INPUTS = frozenset({
    "Identity", "IdentityN", "Reshape", "Squeeze", "ExpandDims", "Transpose",
    "ConjugateTranspose", "Slice", "StridedSlice", "ConcatV2", "Pack", "Unpack", "Split",
    "SplitV", "GatherV2", "GatherNd", "Select", "SelectV2", "ReluGrad", "Relu6Grad",
    "Relu", "Relu6", "Tile", "BroadcastTo", "Pad", "PadV2", "MirrorPad", "ReverseV2",
    "ZerosLike", "Snapshot", "StopGradient", "EnsureShape",
})


def reached_backward(graph, before: int, seeds, op_lists=None) -> list[tuple[str, tf.Tensor]]:
    """(name, tensor) of the backward values the loss scale multiplies: the outputs of
    the ops made after op number `before` that `seeds` (the tape's initial
    gradient) reach, and that the rewritten step may compute in float16.

    Only what the seed reaches scales with the loss scale: the backward also
    recomputes forward values (a sigmoid for softplus's gradient), which the
    scale never touches. Ops the rewrite never puts in float16 (deny or unlisted
    for `op_lists`: RsqrtGrad, the BatchNorm variance's backward, ...) and
    clear-list ops that read only such values stay float32 and bound nothing;
    single values are the loss path's own (d mean / d sum); the outputs of ops
    that only rearrange their inputs are covered by those inputs.
    """
    def list_of(op_type: str) -> str | None:
        return op_lists.list_of(op_type) if op_lists is not None else None

    reached = {s.op.name for s in tf.nest.flatten(seeds)}
    float32 = set()  # reached ops whose values stay float32 in the rewritten step
    bounded = set()  # reached ops every float output of which is recorded or covered
    found = []
    for op in graph.get_operations()[before:]:
        if not any(t.op.name in reached for t in op.inputs):
            continue
        reached.add(op.name)
        kind = list_of(op.type)
        float_inputs = [t for t in op.inputs if t.dtype.is_floating]
        if kind in ("deny", "unlisted") or (
                kind == "clear" and float_inputs
                and all(t.op.name in float32 for t in float_inputs)):
            float32.add(op.name)
            continue
        reached_inputs = [t for t in float_inputs if t.op.name in reached]
        if (op.type in _NO_LARGER_THAN_INPUTS and reached_inputs
                and all(t.op.name in bounded for t in reached_inputs)):
            # Covered by its inputs only where they were recorded: a select of a
            # value that stays float32 (l2_normalize's backward: the Maximum's
            # SelectV2 after RsqrtGrad) may itself run in float16.
            bounded.add(op.name)
            continue
        outputs = [out for out in op.outputs if out.dtype.is_floating]
        recorded = [out for out in outputs
                    if out.shape.rank is None or out.shape.num_elements() is None
                    or out.shape.num_elements() > 1]
        found.extend((op.name, out) for out in recorded)
        if outputs and len(recorded) == len(outputs):
            bounded.add(op.name)
    return found


def weight_gradients(sources, grads) -> list[tuple[str, tf.Tensor]]:
    """(variable label, gradient values) of a tape's non-None gradients."""
    found = []
    for source, grad in zip(tf.nest.flatten(sources), tf.nest.flatten(grads), strict=False):
        if grad is None:
            continue
        if isinstance(grad, tf.IndexedSlices):
            grad = grad.values
        found.append((_label(source), grad))
    return found


class Recorder:
    """What tapes differentiated in one trace: the backward values the loss scale
    multiplies, and the weight gradients.

    In probe mode (``gradient``, a trace of its own) every float loss is
    differentiated unscaled; in an enabled model's own step (``record``, the
    step's first trace) the tape seeds as it would and the values carry the
    scale. Replica threads of one trace may share a recorder.
    """

    def __init__(self, op_lists=None, seed_scale=None):
        self._op_lists = op_lists
        self.owner_of = None  # () -> the scale owner a recorded step seeds with
        # Probe mode's seed: 1, or this variable's value (1 in the float32 run; the
        # check on the 16-bit step sets it: ``_SeedScale``).
        self._seed_scale = seed_scale
        self.backward: list[tuple[str, tf.Tensor]] = []
        self.weights: list[tuple[str, tf.Tensor]] = []
        self.tapes = 0
        self._lock = threading.Lock()

    def gradient(self, original, tape, target, sources, output_gradients, kwargs):
        """``tape.gradient`` in probe mode: unscaled, recording what tfamp would scale."""
        if (tf.executing_eagerly() or output_gradients is not None
                or not is_loss_target(target, sources)):
            return original(tape, target, sources, output_gradients, **kwargs)
        # What the tape seeds with by default (every element of every target), or
        # what a scaled step seeds with, at the probe's own scale.
        seed = (tf.nest.map_structure(tf.ones_like, target) if self._seed_scale is None
                else scale_update.seed(target, self._seed_scale))
        return self.record(original, tape, target, sources, seed, kwargs)

    def record(self, original, tape, target, sources, seed, kwargs):
        """``original(tape, target, sources, seed)``, recording what the seed reaches."""
        graph = tf.compat.v1.get_default_graph()
        before = len(graph.get_operations())
        grads = original(tape, target, sources, seed, **kwargs)
        backward = reached_backward(graph, before, seed, self._op_lists)
        with self._lock:
            self.tapes += 1
            self.backward.extend(backward)
            self.weights.extend(weight_gradients(sources, grads))
        return grads

    def in_graph(self, graph) -> tuple[list, list]:
        """(backward, weights) recorded in `graph` (not in functions nested in it)."""
        with self._lock:
            return ([(n, t) for n, t in self.backward if t.graph is graph],
                    [(n, t) for n, t in self.weights if t.graph is graph])

    def outputs(self, scale=None):
        """(backward maxes, weight-gradient maxes, the weight gradients' log2 counts
        together) as tensors; the values divided by `scale` when given."""
        backward, weights = self.in_graph(tf.compat.v1.get_default_graph())
        return _summaries([t for _, t in backward], [t for _, t in weights], scale)


def _largest_of_each(tensors) -> tf.Tensor:
    """max |t| of each tensor as a float32 vector: inf where t holds a NaN (whether a
    reduction passes NaN on is the kernel's choice), 0 for an empty t.

    Four ops per tensor, as the probe builds them for thousands of backward tensors
    (keras.io's CycleGAN: 6,208, twice; ten ops each took 37 of the probe's 95 s):
    max |t| in t's own type (exact: casting is monotonic), plus the sum of t * 0,
    which is 0 where t is finite and NaN where it holds an inf or a NaN; the NaN
    becomes inf and an empty t's -inf becomes 0 once, on the stacked vector.
    """
    axes, zeros, found = {}, {}, []
    for t in tensors:
        rank = t.shape.rank
        if rank is None:
            axis = tf.range(tf.rank(t))
        else:
            axis = axes.get(rank)
            if axis is None:
                axis = axes[rank] = tf.constant(list(range(rank)), tf.int32)
        zero = zeros.get(t.dtype)
        if zero is None:
            zero = zeros[t.dtype] = tf.constant(0, t.dtype)
        largest = tf.raw_ops.AddV2(
            x=tf.raw_ops.Max(input=tf.raw_ops.Abs(x=t), axis=axis),
            y=tf.raw_ops.Sum(input=tf.raw_ops.Mul(x=t, y=zero), axis=axis))
        if t.dtype != tf.float32:
            largest = tf.cast(largest, tf.float32)
        found.append(largest)
    stacked = tf.stack(found)
    return tf.where(tf.math.is_nan(stacked), tf.constant(np.inf, tf.float32),
                    tf.maximum(stacked, 0.0))


def _summaries(backward, weights, scale=None):
    """(max |t| of each backward tensor, of each weight gradient, and one log2
    histogram of every weight-gradient value), divided by `scale` when given."""
    from tfamp.numerics.ranges import NUM_COLUMNS, bucket_counts

    def largest(tensors):
        if not tensors:
            return tf.zeros([0])
        return _largest_of_each(tensors)

    maxes, weight_maxes = largest(backward), largest(weights)
    if weights:
        values = tf.concat([tf.reshape(tf.cast(t, tf.float32), [-1]) for t in weights], 0)
        if scale is not None:
            values = values / scale
        counts = bucket_counts(values)
    else:
        counts = tf.zeros([NUM_COLUMNS], tf.int32)
    if scale is not None:
        maxes, weight_maxes = maxes / scale, weight_maxes / scale
    return maxes, weight_maxes, counts


# -- running a probe ----------------------------------------------------------------

def probe_step(step, args, kwargs, *, extra_state=(), min_scale: float = 1.0,
               op_lists=None, strategy=None, per_replica: bool = True,
               trace=None, rewritten=None, rewrite_config=None, check_config=None,
               headroom_bits: int = START_HEADROOM_BITS,
               extra_bits: int | None = None) -> StartScale:
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
      trace: (ConcreteFunction, Recorder, batch) of the step's own first trace,
        whose recorder saw its tapes: the probe then runs a part of that graph
        (``_probe_in_trace``) instead of tracing the step again; when it cannot,
        the step is traced as above.
      rewritten: the rewrite of `trace`'s graph (``runner.RewrittenGraph``), the
        step that will run: with it, only the values it holds in 16 bits count,
        and the scale chosen is checked on it (``_checked_on_16bit``): a value
        only the 16-bit step makes (a sum whose terms cancel in float32 and not
        in 16 bits) lowers it. Only with `trace`.
      rewrite_config: the AmpConfig the step is rewritten with, where the op
        lists are not enough to say what stays float32 (layers kept float32 by
        ``keep_fp32``, the float32 fallback's among them): the traced step is
        rewritten with it and only the values the rewrite holds in 16 bits, or
        casts to 16 bits, count. None: the op lists' guess (no second rewrite).
      check_config: the AmpConfig the step runs rewritten with, whole, where the
        probe traces the step itself: the scale is checked on that trace's
        rewrite (``_probe_locally``). It only ever lowers the scale: the trace
        has no update and the probe's own summaries, so its rewrite is near the
        step's, not the same (which values it holds in 16 bits may differ).
      headroom_bits: ``choose_scale``'s room below float16's largest value.
      extra_bits: at most this many more halvings, where they send no more
        weight-gradient values below float16's smallest (``extra_room``; 0: none,
        nor any towards USUAL_START; None: EXTRA_ROOM_BITS), and more down to
        USUAL_START on the same terms.

    Raises:
      ValueError: the step differentiated no float loss, or its float32
        gradients are not finite (no scale helps: see the message), here or
        on another replica or worker.
    """
    start = time.perf_counter()
    local, error, how = None, None, "a trace of its own"
    try:
        measured = None
        if trace is not None:
            try:
                measured = _probe_in_trace(
                    *trace, strategy=strategy, rewrite_config=rewrite_config,
                    report=rewritten.report if rewritten is not None else None)
            except Exception as err:  # traced again below; the reason for the debug log
                log.debug("tfamp: start-scale probe from the step's trace: %s: %s; tracing "
                          "the step for it instead", type(err).__name__, err)
        if measured is not None:
            # What the values say (not finite: no scale helps) is the probe's answer,
            # not a reason to trace the step again.
            local, how = _found(*measured), "the step's own trace"
            if rewritten is not None:
                local = _checked_on_16bit(local, *trace, rewritten, strategy=strategy,
                                          min_scale=min_scale, headroom_bits=headroom_bits)
        else:
            tape.install()
            with _tapes_recording():
                local = _probe_locally(step, args, kwargs, extra_state, op_lists,
                                       strategy if per_replica else None, rewrite_config,
                                       check_config=check_config, min_scale=min_scale,
                                       headroom_bits=headroom_bits)
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
    scale = choose_scale(top, min_scale=min_scale, headroom_bits=headroom_bits)
    taken = _extra_room_agreed(local, top, scale, strategy=strategy, min_scale=min_scale,
                               headroom_bits=headroom_bits,
                               extra_bits=EXTRA_ROOM_BITS if extra_bits is None else extra_bits)
    before_room = scale
    scale /= 2.0**taken
    return StartScale(scale=scale, max_abs=top, where=where, weight_max=weight_max,
                      underflow_share=local.underflow_share(scale),
                      room_underflow=(local.underflow_share(scale)
                                      - local.underflow_share(before_room)) if taken else 0.0,
                      subnormal_share=local.subnormal_share(scale),
                      seconds=time.perf_counter() - start, batch_size=_rows(args), how=how,
                      checked=local.checked, extra_room=taken,
                      forward_overflow=local.forward_overflow)


def _extra_room_agreed(local, top: float, scale: float, *, strategy, min_scale: float,
                       headroom_bits: int, extra_bits: int) -> int:
    """``extra_room`` for `scale`, the same on every worker: each worker's rises of
    the lost share, the largest of all (a second agreement, which every worker
    reaches: the first raised on all of them or none)."""
    # A scale at the 2**24 cap may have that room already.
    roomy = choose_scale(top, min_scale=min_scale, headroom_bits=headroom_bits + extra_bits)
    room_bits = min(extra_bits, round(math.log2(scale / roomy)))
    # And on down towards the usual start where that loses no values either (USUAL_START).
    settle_bits = max(0, round(math.log2(scale / USUAL_START))) if extra_bits > 0 else 0
    halvings = max(room_bits, settle_bits)
    if halvings <= 0:
        return 0

    def rise(j: int) -> float:
        if local.weights is None:  # no weight-gradient histogram: nothing says it is free
            return math.inf
        if j > room_bits and local.subnormal_share(scale / 2.0**j) > SETTLE_SUBNORMAL:
            return math.inf  # settling would cost bits
        return local.underflow_share(scale / 2.0**j) - local.underflow_share(scale)

    rises = [rise(j) for j in range(1, halvings + 1)]
    rises = replicas.agree_rows(strategy, np.asarray(rises, np.float64)).max(axis=0)
    return extra_room(list(rises), scale=scale, min_scale=min_scale)


@dataclasses.dataclass(frozen=True)
class _Found:
    """What this worker's replicas measured (largest over them)."""

    top: float
    where: str
    weight_max: float
    weights: object  # TensorRange of every weight-gradient value together, or None
    checked: str = ""  # what the check on the 16-bit step found (StartScale.checked)
    forward_overflow: bool = False  # (StartScale.forward_overflow)

    def underflow_share(self, scale: float) -> float:
        return self.weights.underflow_share(scale) if self.weights is not None else 0.0

    def subnormal_share(self, scale: float) -> float:
        return self.weights.subnormal_share(scale) if self.weights is not None else 0.0


def _found(names, maxes, weight_names, weight_maxes, counts, weight_mask=None) -> _Found:
    """`weight_mask`: which weight gradients the rewritten step computes in 16 bits
    (None: all); the others bound no scale."""
    from tfamp.numerics.ranges import TensorRange

    if not (np.all(np.isfinite(maxes)) and np.all(np.isfinite(weight_maxes))):
        bad = [n for n, m in zip(names + weight_names, [*maxes, *weight_maxes], strict=True)
               if not np.isfinite(m)][:3]
        raise ValueError(f"the first batch's float32 gradients are not finite ({', '.join(bad)})")
    all_values = [*zip(names, maxes, strict=True),
                  *zip(weight_names, _only_16bit(np.asarray(weight_maxes), weight_mask),
                       strict=True)]
    where, top = max(all_values, key=lambda item: item[1]) if all_values else ("-", 0.0)
    weights = (TensorRange.from_vector("weight gradients", "", "weight_gradient", counts,
                                       float(max(weight_maxes, default=0.0)))
               if weight_names else None)
    return _Found(top=float(top), where=_unreplicated(where),
                  weight_max=float(max(weight_maxes, default=0.0)), weights=weights)


def _in_16bit(concrete, backward, rewrite_config) -> np.ndarray | None:
    """Per recorded backward tensor: does the step rewritten with `rewrite_config`
    hold it in 16 bits (or cast it to 16 bits)? None without a config."""
    if rewrite_config is None:
        return None
    from tfamp.runtime.runner import rewrite_report

    return _sixteen_bit_mask(rewrite_report(concrete, rewrite_config), backward)


def _only_16bit(maxes: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    """`maxes` with the values the rewritten step keeps float32 set to 0."""
    return maxes if mask is None else np.where(mask, maxes, 0.0)


def _probe_locally(step, args, kwargs, extra_state, op_lists, strategy,
                   rewrite_config=None, *, check_config=None, min_scale: float = 1.0,
                   headroom_bits: int = START_HEADROOM_BITS) -> _Found:
    """The probe on this worker's replicas, in a trace of its own (no communication
    with other workers). With `check_config`, where the trace is one copy of the
    step on a batch of tensors (a custom loop's on one device, a tf_keras step
    XLA compiles or that runs several batches per call), the scale is checked on
    the trace's rewrite as on a fit step's own trace (``_checked_on_16bit``): the
    tapes seed with a scale of the probe's own (1 in the float32 run)."""
    recorders = []
    checkable = (check_config is not None and not replicas.is_distributed(strategy)
                 and all(isinstance(leaf, (np.ndarray, tf.Tensor, tf.Variable))
                         for leaf in tf.nest.flatten((args, kwargs))))
    seed_scale = _SeedScale() if checkable else None

    def replica_step(args, kwargs):
        args, kwargs = replicas.replica_rows((args, kwargs))
        recorder = Recorder(op_lists, seed_scale.variable if seed_scale else None)
        recorder.owner_of = lambda: seed_scale
        recorders.append(recorder)
        with probe_mode(recorder), plain_calls():
            step(*args, **kwargs)
        return recorder.outputs()

    def run(args, kwargs):
        per_replica = replicas.run_per_replica(strategy, replica_step, args, kwargs)
        maxes, weight_maxes, counts = zip(*per_replica, strict=True)
        return tf.stack(maxes), tf.stack(weight_maxes), tf.stack(counts)

    concrete = plain_function(run).get_concrete_function(args, kwargs)
    # (tf.function traces twice when the first trace made variables: the last counts.)
    final = [r for r in recorders if any(r.in_graph(concrete.graph))]
    if not final:
        raise NoLossDifferentiated("the step differentiated no float loss with a GradientTape")
    restore = _unique([*assigned_variables(concrete), *extra_state])
    saved = [(c, np.array(c.numpy(), copy=True))
             for v in restore for c in replicas.local_components(v)]
    try:
        maxes, weight_maxes, counts = (x.numpy() for x in _without_grappler(concrete)(
            args, kwargs))
    finally:
        for component, value in saved:
            component.assign(value)
    backward, weights = [], []
    for recorder in final:  # (each replica's recorder: its copy of the step)
        replica_backward, replica_weights = recorder.in_graph(concrete.graph)
        backward += replica_backward
        weights += replica_weights
    mask = _in_16bit(concrete, backward + weights, rewrite_config)
    if mask is not None:  # a value counts where one replica's copy of it is 16-bit
        weight_mask = mask[len(backward):].reshape(len(final), -1).any(axis=0)
        mask = mask[:len(backward)].reshape(len(final), -1).any(axis=0)
    else:
        weight_mask = None
    names, weight_names = ([n for n, _ in part] for part in final[0].in_graph(concrete.graph))
    found = _found(names, _only_16bit(maxes.max(axis=0), mask), weight_names,
                   weight_maxes.max(axis=0), counts.sum(axis=0), weight_mask)
    if seed_scale is not None and len(final) == 1:
        from tfamp.runtime.runner import rewritten_graph_def

        try:
            rewritten = rewritten_graph_def(concrete, check_config)
        except Exception as err:  # the float32 probe's answer stands, as in the check
            log.debug("tfamp: start-scale check: rewriting the probe's trace: %s: %s",
                      type(err).__name__, err)
            return found
        found = _checked_on_16bit(found, concrete, final[0], (args, kwargs), rewritten,
                                  min_scale=min_scale, headroom_bits=headroom_bits)
    return found


class _SeedScale:
    """The scale a probe's own trace seeds its tapes with (a variable, 1 until the
    check on the 16-bit step sets it), as a scale owner (``_at_scale``)."""

    def __init__(self):
        with tf.init_scope():
            self.variable = tf.Variable(1.0, trainable=False, dtype=tf.float32,
                                        name="tfamp_probe_seed_scale")

    def scale_tensor(self):
        return self.variable

    def set_scale(self, scale: float) -> None:
        self.variable.assign(scale)


@contextlib.contextmanager
def _tapes_recording():
    """Gradient tapes record within it, also under ``tf.init_scope``, which stops
    them on this thread: the probe of a step's own trace runs there (Keras 3
    traces that step inside its loop's function), and the step it traces again
    when it cannot cut that graph needs its tapes (else no gradient: "the step
    differentiated no float loss"). TensorFlow has no public way to resume them."""
    from tensorflow.python import pywrap_tfe

    stopped = pywrap_tfe.TFE_Py_TapeSetIsStopped()
    if stopped:
        pywrap_tfe.TFE_Py_TapeSetRestartOnThread()
    try:
        yield
    finally:
        if stopped:
            pywrap_tfe.TFE_Py_TapeSetStopOnThread()


def _without_grappler(function):
    """`function` called with TensorFlow's graph optimizer off.

    On a ResNet-50 step (14k ops) grappler took 20-28 s of the probe's first
    run, which then took 4 s without it; the probe runs once.
    """
    def call(*args, **kwargs):
        options = tf.config.optimizer.get_experimental_options()
        tf.config.optimizer.set_experimental_options({**options,
                                                      "disable_meta_optimizer": True})
        try:
            return function(*args, **kwargs)
        finally:
            tf.config.optimizer.set_experimental_options(options)
    return call


def _unreplicated(name: str) -> str:
    """An op's name without a replica's "replica_<n>/" scope (wherever it sits)."""
    return re.sub(r"(^|/)replica_\d+/", r"\1", name)


# -- the probe from the step's own trace ------------------------------------------------

# Ops that read a batch from an iterator inside a step (tf_keras's train function).
_NEXT_OPS = frozenset({"IteratorGetNext", "IteratorGetNextSync",
                       "MultiDeviceIteratorGetNextFromShard"})


def _probe_in_trace(concrete, recorder: Recorder, batch, *, strategy=None,
                    rewrite_config=None, report=None) -> tuple:
    """The probe from the float32 graph of the step's own first trace: ``_found``'s
    arguments (names and values measured; not yet checked).

    The step was traced once, for Keras, with a recorder on its tapes; the part
    of its graph the recorded backward values depend on (the forward, the loss,
    the backward; no update, no metric, no iterator) is run once on fit's first
    batch, each replica's copy on its rows, with the model's live variables
    (``_cut_runner``). The recorded values carry the loss scale the step seeds with
    (its current value), which is divided out. `report`: the rewrite's of this
    trace, which says which values the step holds in 16 bits (else a rewrite
    with `rewrite_config`, else the op lists' guess).

    Raises:
      ValueError: the graph is not one this can cut (its tapes in a nested
        function, no batch input it can find): the caller traces the step.
    """
    backward, weights = _recorded(concrete, recorder)
    maxes, weight_maxes, counts = _cut_runner(
        concrete, concrete.graph.as_graph_def(), backward, weights, batch,
        strategy)(_scale_in(recorder))
    if report is not None:
        mask = _sixteen_bit_mask(report, backward + weights)
    else:
        mask = _in_16bit(concrete, backward + weights, rewrite_config)
    if mask is not None:
        maxes = _only_16bit(maxes, mask[:len(backward)])
    return ([n for n, _ in backward], maxes, [n for n, _ in weights], weight_maxes, counts,
            None if mask is None else mask[len(backward):])


def _recorded(concrete, recorder: Recorder) -> tuple[list, list]:
    """The recorder's (backward, weights) of `concrete`'s own graph; ValueError where
    it recorded none there or some in functions nested in it."""
    backward, weights = recorder.in_graph(concrete.graph)
    if not backward and not weights:
        raise ValueError("no tape recorded in the step's own graph")
    if len(backward) + len(weights) != len(recorder.backward) + len(recorder.weights):
        raise ValueError("tapes inside functions nested in the step")
    return backward, weights


def _cut_runner(concrete, graph_def, backward, weights, batch, strategy):
    """measure(scale) -> (max |value| / scale of each backward tensor, of each weight
    gradient, the weight gradients' log2 counts), each call one run of the part of
    `graph_def` (the traced step's graph or its rewrite) these tensors need, on
    `batch`; the part is cut, registered and traced once, whatever the calls.

    The step's batch inputs become placeholders, control edges are dropped (they
    could reach an update or the iterator), the variables it captures are the
    live ones; only a random generator's state is written (the forward's draws),
    and it is restored. A tensor `graph_def` does not hold (the rewrite removed
    its op) reads as 0.
    """
    from tensorflow.core.framework import graph_pb2

    from tfamp.runtime.runner import _register_renamed_library, _rename_counter

    graph = concrete.graph
    sources = _batch_sources(concrete, graph_def, batch, strategy)
    placeholder = {name: f"tfamp_probe_batch_{k}" for k, (name, _) in enumerate(sources)}
    cut = graph_pb2.GraphDef()
    cut.CopyFrom(graph_def)
    for k, (_, value) in enumerate(sources):
        node = cut.node.add()
        node.name, node.op = f"tfamp_probe_batch_{k}", "Placeholder"
        node.attr["dtype"].type = tf.as_dtype(value.dtype).as_datatype_enum
    for node in cut.node:
        # Data edges only: a control edge could reach an update or the iterator.
        inputs = [i for i in node.input if not i.startswith("^")]
        del node.input[:]
        node.input.extend(placeholder.get(i if ":" in i else f"{i}:0", i) for i in inputs)
    held = {node.name for node in cut.node}
    present = [k for k, (_, t) in enumerate(backward + weights) if t.op.name in held]
    fetches = [(backward + weights)[k][1].name for k in present]
    if not fetches:
        raise ValueError("none of the recorded values is in the graph")
    from tensorflow.python.util import deprecation

    with deprecation.silence():  # (TensorFlow's v1 name; no other public one)
        cut = tf.compat.v1.graph_util.extract_sub_graph(
            cut, sorted({f.split(":")[0] for f in fetches}))
    # (a name of its own per cut: the float32 graph's and the rewrite's library
    # functions share their names)
    _register_renamed_library(cut, f"_tfamp_probe{next(_rename_counter)}")
    kept = {node.name for node in cut.node}
    captures = [(internal.name, external) for external, internal in graph.captures
                if internal.op.name in kept]
    # (a variable the step takes as an argument: its handle, as a capture's)
    captures += [(name, variable.handle) for name, variable in
                 _variable_arguments(concrete, batch) if name.split(":")[0] in kept]
    held_backward = sum(1 for k in present if k < len(backward))

    def run(scale, *values):
        inner = tf.compat.v1.get_default_graph()
        input_map = {f"tfamp_probe_batch_{k}:0": v for k, v in enumerate(values)}
        for name, external in captures:
            input_map[name] = inner.capture(external)
        fetched = tf.graph_util.import_graph_def(cut, input_map=input_map,
                                                 return_elements=fetches, name="")
        return _summaries(fetched[:held_backward], fetched[held_backward:], scale)

    values = [value for _, value in sources]
    written = {node.input[0].split(":")[0] for node in cut.node
               if node.op in _ASSIGN_OPS and node.input}
    written_variables = _captured_variables(concrete, written)
    function = plain_function(run, autograph=False)
    # One trace per cut by design (the float32 graph's, then the 16-bit step's): not
    # the retracing TensorFlow warns a user about.
    function._omit_frequent_tracing_warning = True

    def measure(scale: float) -> tuple:
        saved = [(c, np.array(c.numpy(), copy=True)) for v in written_variables
                 for c in replicas.local_components(v)]
        try:
            found_maxes, found_weight_maxes, counts = (
                x.numpy() for x in _without_grappler(function)(
                    tf.constant(scale, tf.float32), *values))
        finally:
            for component, value in saved:
                component.assign(value)
        everything = np.zeros(len(backward) + len(weights), np.float32)
        everything[present] = np.concatenate([found_maxes, found_weight_maxes])
        return everything[:len(backward)], everything[len(backward):], counts

    return measure


# The check on the 16-bit step: runs at the chosen scale, then (where some value
# overflowed) at 2^-RETRY_BITS of it, at most TRIES runs in all.
SIXTEEN_BIT_TRIES = 3
SIXTEEN_BIT_RETRY_BITS = 8


def _checked_on_16bit(found: _Found, concrete, recorder: Recorder, batch, rewritten, *,
                      strategy=None, min_scale: float = 1.0,
                      headroom_bits: int = START_HEADROOM_BITS) -> _Found:
    """`found` (the float32 probe's) checked on the step that will run: the rewrite's
    graph runs once at the scale `found` gives, with the same cut and batch, and
    its 16-bit backward values, per unit of scale, join the float32 ones.

    A value the float32 step does not have appears there: a one-channel
    LayerNorm's variance gradient (keras.io's timeseries Transformer) is the sum
    of two terms that cancel exactly in float32, one computed in float32 and the
    other rounded to float16, so the 16-bit step's residual times
    (variance + eps)^-1.5 = 1e9 overflowed at the float32 choice: six skipped
    steps. Where a value overflows the run is repeated at a lower scale. A check
    that cannot run, or overflows at every scale tried (a forward overflow,
    which no scale helps: the float32 fallback's case), leaves `found` as it is.
    """
    scale = choose_scale(found.top, min_scale=min_scale, headroom_bits=headroom_bits)
    floor = 2.0 ** math.ceil(math.log2(min_scale))  # (choose_scale's floor)
    backward, weights = _recorded(concrete, recorder)
    mask = _sixteen_bit_mask(rewritten.report, backward + weights)
    names = [_unreplicated(n) for n, _ in backward + weights]
    tried = []
    measure = None
    for _ in range(SIXTEEN_BIT_TRIES):
        try:
            measure = measure or _cut_runner(concrete, rewritten.graph_def, backward,
                                             weights, batch, strategy)
            maxes = np.concatenate(_at_scale(recorder, measure, scale)[:2])
        except Exception as err:  # the float32 probe's answer stands
            log.debug("tfamp: start-scale check on the 16-bit step: %s: %s",
                      type(err).__name__, err)
            return found
        tried.append(scale)
        if np.all(np.isfinite(maxes)):
            break
        if scale <= floor:
            break
        scale = max(floor, scale / 2.0 ** SIXTEEN_BIT_RETRY_BITS)
    powers = [f"2^{int(math.log2(t))}" for t in tried]
    if not np.all(np.isfinite(maxes)):
        return dataclasses.replace(found, forward_overflow=True, checked=(
            f"the float16 step overflowed at {', '.join(powers)}: no loss scale helps "
            f"there (an overflow in the forward pass: fit, train_on_batch and a custom "
            f"loop under TFAMP_ENABLE then move its layer to float32; keep_fp32 / "
            f"TFAMP_KEEP_FP32 keeps it float32 from the start, or run in bfloat16)"))
    sixteen = np.where(mask, maxes, 0.0)
    if not mask.any():  # (every layer kept float32: a fallback's, or keep_fp32's)
        return dataclasses.replace(found, checked=(
            f"the step holds no backward value in float16 (checked at {powers[-1]})"))
    k = int(np.argmax(sixteen))
    overflowed = f"; it overflowed at {', '.join(powers[:-1])}" if len(tried) > 1 else ""
    lowered = (choose_scale(float(sixteen[k]), min_scale=min_scale, headroom_bits=headroom_bits)
               < choose_scale(found.top, min_scale=min_scale, headroom_bits=headroom_bits))
    if not lowered:  # (a value rounded up a little in 16 bits changes nothing)
        return dataclasses.replace(found, checked=(
            f"checked on the float16 step at {powers[-1]}: max {sixteen[k]:.3g}{overflowed}"))
    return dataclasses.replace(found, top=float(sixteen[k]), where=names[k], checked=(
        f"set by the float16 step, at {powers[-1]} (float32's max {found.top:.3g} in "
        f"{found.where}{overflowed})"))


def _at_scale(recorder: Recorder, measure, scale: float) -> tuple:
    """``measure(scale)`` (a ``_cut_runner``'s) with the step's scale owner set to
    `scale` (restored after)."""
    owner = recorder.owner_of() if recorder.owner_of is not None else None
    if owner is None:
        raise ValueError("the recorded step's scale owner is unknown")
    before = float(np.asarray(owner.scale_tensor()))
    owner.set_scale(scale)
    try:
        return measure(scale)
    finally:
        owner.set_scale(before)


def _sixteen_bit_mask(report, recorded) -> np.ndarray:
    """Per recorded (name, tensor): does the rewrite (`report`) hold it in 16 bits
    or cast it to 16 bits?"""
    sixteen = report.sixteen_bit_tensors()
    return np.asarray([t.op.name in sixteen or t.name in sixteen for _, t in recorded],
                      bool)


def _scale_in(recorder: Recorder) -> float:
    """The loss scale the recorded step seeds with now (its owner's current one)."""
    if recorder.owner_of is None:
        raise ValueError("the recorded step's scale owner is unknown")
    return float(np.asarray(recorder.owner_of().scale_tensor()))


def _batch_sources(concrete, graph_def, batch, strategy) -> list[tuple[str, np.ndarray]]:
    """(tensor name in the step's graph, the value to feed for it) for every tensor
    that carries the batch in: the step's own arguments (Keras 3: one per
    component of each replica's batch, component by component) or what its
    iterator op returns (tf_keras on one device), each replica's share of the
    rows of `batch`. (tf_keras under a strategy reads its batch inside a
    conditional: not cut here, the probe traces the step instead.)"""
    graph = concrete.graph
    # (a None, train_on_batch's missing sample weights, is no tensor of the step)
    flat = [np.asarray(value) for value in tf.nest.flatten(batch)
            if value is not None and not isinstance(value, tf.Variable)]
    local = len(strategy.extended.worker_devices) if replicas.is_distributed(strategy) else 1
    # The step's own arguments come first among its inputs (captures follow).
    count = len(tf.nest.flatten(concrete.structured_input_signature, expand_composites=True))
    arguments = [t for t in graph.inputs[:count] if t.dtype not in (tf.resource, tf.variant)]
    if arguments:
        if len(arguments) != local * len(flat):
            raise ValueError(f"the step takes {len(arguments)} batch tensors, the batch has "
                             f"{len(flat)} per replica")
        # A structure of per-replica values flattens component by component.
        return [(arguments[i * local + r].name, replicas.host_rows(strategy, leaf, r))
                for i, leaf in enumerate(flat) for r in range(local)]
    nexts = [node for node in graph_def.node if node.op in _NEXT_OPS]
    if len(nexts) != local:
        raise ValueError(f"{len(nexts)} iterator reads for {local} replicas")
    for node in nexts:
        if len(node.attr["output_types"].list.type) != len(flat):
            raise ValueError("the iterator's elements do not match fit's first batch")
    return [(f"{node.name}:{i}", replicas.host_rows(strategy, leaf, r))
            for r, node in enumerate(nexts) for i, leaf in enumerate(flat)]


def _variable_arguments(concrete, batch) -> list[tuple[str, object]]:
    """(resource input name, variable) for each variable the step takes as an
    argument (a style transfer's image), in order; ValueError where the trace's
    resource arguments do not pair with them."""
    variables = [v for v in tf.nest.flatten(batch) if isinstance(v, tf.Variable)]
    if not variables:
        return []
    count = len(tf.nest.flatten(concrete.structured_input_signature, expand_composites=True))
    handles = [t for t in concrete.graph.inputs[:count] if t.dtype == tf.resource]
    if len(handles) != len(variables):
        raise ValueError(f"the step takes {len(handles)} variable arguments, the batch has "
                         f"{len(variables)}")
    return [(t.name, v) for t, v in zip(handles, variables, strict=True)]


def assigned_variables(concrete) -> list:
    """The captured variables the traced step writes (outer graph; nested
    function bodies are not searched: see BUILD_NOTES)."""
    return _captured_variables(concrete, {
        op.inputs[0].op.name for op in concrete.graph.get_operations()
        if op.type in _ASSIGN_OPS})


def _captured_variables(concrete, names: set[str]) -> list:
    """The variables whose handles `concrete` captures as the ops named `names`."""
    by_handle = {}
    for variable in concrete.variables:
        handle = getattr(variable, "handle", None)
        if handle is not None:
            by_handle[id(handle)] = variable
    found = []
    for external, internal in concrete.graph.captures:
        variable = by_handle.get(id(external)) if internal.op.name in names else None
        if variable is not None:
            found.append(variable)
    return _unique(found)


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

def first_batch(flavour, args, kwargs, *, dataset: bool = True):
    """Fit's first batch as Keras hands it to ``train_step`` (this worker's), or None.

    Arrays and tensors are cut by a Keras array adapter of the probe's own
    (nothing of fit's is read). A tf.data Dataset is read for one element only
    when `dataset` (under a tf.distribute strategy, whose iterator cannot hand
    a batch back: a second iterator over the Dataset draws the next reshuffle
    seed of every ``shuffle`` in it); else None, and the batch is read through
    fit's own iterator (``read_ahead``). Generators and Sequences: None.
    """
    x = args[0] if args else kwargs.get("x")
    y = args[1] if len(args) > 1 else kwargs.get("y")
    batch_size = (args[2] if len(args) > 2 else kwargs.get("batch_size")) or 32
    sample_weight = kwargs.get("sample_weight")
    if isinstance(x, tf.data.Dataset):
        if not dataset:
            return None
        data = x
    else:
        readable = (np.ndarray, tf.Tensor)
        parts = tf.nest.flatten(x) + tf.nest.flatten(y) + tf.nest.flatten(sample_weight)
        if not parts or not all(p is None or isinstance(p, readable) for p in parts):
            return None
        if x is None:
            return None
        data = flavour.array_dataset(x, y, sample_weight, int(batch_size))
    for batch in data.take(1):
        return batch
    return None


def can_read_ahead(iterator) -> bool:
    """Can `read_ahead` take batches from `iterator` and hand them back? A
    ``tf.data.Iterator`` (fit's own, tf_keras's ``train_on_batch``) or a plain
    Python iterator (Keras 3's ``train_on_batch``); not a distributed one."""
    if isinstance(iterator, tf.data.Iterator):
        return True
    return (isinstance(iterator, collections.abc.Iterator)
            and not isinstance(iterator, tf.distribute.DistributedIterator))


def read_ahead(iterator, steps: int):
    """The elements one train call would take from `iterator`, and a
    one-shot iterator of them for that call.

    For a ``tf.data.Iterator`` the one-shot iterator has `iterator`'s element
    spec (e.g. a batch dimension of None), so the train function is not traced
    again for it; `iterator` is left just past the elements, so fit trains on
    exactly the batches, in the order, it would have. A Python iterator is
    handed back as the elements followed by the rest of it. Returns
    ([], `iterator`) when it has none left.

    Args:
      iterator: one that ``can_read_ahead``.
      steps: elements one call takes (Keras's ``steps_per_execution``).
    """
    steps = max(1, int(steps))
    if not isinstance(iterator, tf.data.Iterator):
        elements = list(itertools.islice(iterator, steps))
        return elements, itertools.chain(elements, iterator) if elements else iterator
    elements = []
    for _ in range(steps):
        optional = iterator.get_next_as_optional()
        if not optional.has_value():
            break
        elements.append(optional.get_value())
    if not elements:
        return elements, iterator
    replay = tf.data.Dataset.from_tensors(elements[0])
    for element in elements[1:]:
        replay = replay.concatenate(tf.data.Dataset.from_tensors(element))
    replay = tf.data.experimental.from_variant(tf.data.experimental.to_variant(replay),
                                               iterator.element_spec)
    return elements, iter(replay)
