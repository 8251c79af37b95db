"""Automatic float32 fallback: a layer that overflows float16 moves to float32 by itself.

A forward op whose float16 result exceeds 65504 (large inputs into a frozen
Dense, say) makes every step non-finite whatever the loss scale: dynamic
scaling halves to its floor and every step is skipped. Loss scaling cannot fix
what does not depend on the scale; keeping that one layer float32 can.

Algorithm (an enabled model with loss scaling, after each train call)::

    consecutive = skipped steps since the last applied one
    if consecutive >= next_probe_at                   # 2 (8 once layers moved)
            and (a skipped step's logs held inf/nan   # a forward pass overflowed
                 or the scale is at its floor):
        reset inf/nan in BatchNorm moving statistics (the skipped steps' forward
            passes wrote them; undone unless layers move)
        decision = decide(model, config, first batch of fit's data)
        MOVED:     config.keep_fp32 += decision.patterns; rebuild the step
                   functions; write the patterns into the checkpointed record;
                   one log line naming them and the permanent fix
        NOT_FOUND: loss scaling's problem: next_probe_at *= 2
        otherwise: say why once and never probe again

    decide:                                           # on the host, once
        config' = config
        repeat (at most MAX_MOVED - already moved):
            found = first non-finite op of the step rewritten with config',
                    at loss scale 1 (numerics.nonfinite)
            none                  -> MOVED (config' - config), or NOT_FOUND
            computed in float32   -> OVERFLOWS_IN_FP32 (moving cannot help)
            its layer already kept float32 -> NOT_COVERED
            else                  -> config'.keep_fp32 += the layer's pattern

The probe runs at loss scale 1, so what it finds overflows unscaled: a
gradient that overflows only at a large scale is dynamic scaling's business
and is not moved. The region moved is the op's layer (its name scope: the
forward ops and their gradients), the ``keep_fp32`` pattern the stuck-at-floor
diagnosis already suggests; when that makes the next layer's input Cast
overflow, the next layer follows, up to ``MAX_MOVED`` layers per model.
"Checking in float32 before moving" is the probe after each candidate: the
moved layer computes in float32 there, so an overflow it still makes is
float32's, reported as such, and nothing moves.

Every replica runs the same graph: the decision is made once on the host and
applied by rebuilding the model's step functions (``make_train_function(force=True)``;
``fit`` reads ``model.train_function`` before each step, so the next step
uses it). Under a multi-worker strategy each worker decides on its own; they agree
when they pass ``fit`` the same data (BUILD_NOTES.md, Known limits).

Checkpoints: the moved patterns are written, UTF-8 encoded, into the int32
variable ``fallback_fp32`` of the model's loss-scale state, so whatever saves
the optimizer saves them (``tf.train.Checkpoint``, tf_keras ``BackupAndRestore``
and TF-format ``save_weights``, Keras 3 ``save_weights`` / ``BackupAndRestore`` /
``.keras``). At the start of every ``fit`` (after ``BackupAndRestore`` restored,
before the first step) the record is read and any pattern not yet applied is.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time

log = logging.getLogger("tfamp")

# Consecutive skipped steps before the first look (a step that overflows at
# the start scale is usually one halving away from fine).
FIRST_PROBE_AFTER = 2
# After layers moved: skipped steps in a row before looking again (a from-scratch
# model may still overflow at its start scale; that is loss scaling's to fix).
PROBE_AFTER_MOVE = 8
# Layers moved per model at most (all decisions together).
MAX_MOVED = 4
# Length of the checkpointed record (int32 codes of the UTF-8 patterns, "\n"-joined).
RECORD_LENGTH = 512

# -- what a decision can be ------------------------------------------------------
# Every value finite once the patterns are float32: they move.
MOVED = "moved"
# Nothing non-finite at loss scale 1: the skipped steps are loss scaling's to fix.
NOT_FOUND = "nothing at scale 1"
# The first non-finite op computes in float32 (before or after moving): 16-bit is
# not the cause, so moving cannot help.
OVERFLOWS_IN_FP32 = "overflows in float32 too"
# The op's layer pattern is kept float32 already, yet the op still computes in
# 16-bit (its name is outside the pattern): tfamp cannot say what to move.
NOT_COVERED = "pattern does not cover the op"
# Still non-finite after MAX_MOVED layers.
CAP_REACHED = "too many layers"
# No batch to look at (train_on_batch, a generator fit cannot re-read).
NO_BATCH = "no batch"


@dataclasses.dataclass(frozen=True)
class FallbackDecision:
    """What ``decide`` found: a kind above, the patterns to keep float32 (for MOVED),
    every finding on the way (``NonFiniteOp``) and the seconds it took."""

    kind: str
    patterns: tuple[str, ...] = ()
    findings: tuple = ()
    seconds: float = 0.0
    repaired: tuple[str, ...] = ()  # "variable: entries" reset from inf/nan (repair_state)

    @property
    def last(self):
        return self.findings[-1] if self.findings else None


@dataclasses.dataclass
class FallbackState:
    """One enabled model's fallback: what moved, and when to look next."""

    moved: tuple[str, ...] = ()
    last_skipped: int | None = None  # skipped_steps at the last train call
    last_nonfinite: int = 0  # the model's count of skipped steps with inf/nan logs, then
    consecutive: int = 0  # skipped steps in a row
    next_probe_at: int = FIRST_PROBE_AFTER
    stopped: str = ""  # a decision kind: never look again (said once)
    decisions: list = dataclasses.field(default_factory=list)


def state_of(state) -> FallbackState:
    """The model's FallbackState (made on first use)."""
    if state.fallback is None:
        state.fallback = FallbackState()
    return state.fallback


# -- deciding ----------------------------------------------------------------------

def decide(model, config, batch, *, room: int = MAX_MOVED) -> FallbackDecision:
    """Which layers to keep float32 so that one batch's step is finite (changes nothing).

    Args:
      model: an enabled, compiled Keras model.
      config: the AmpConfig its functions run with now.
      batch: (x, y, sample_weight) of one batch.
      room: layers that may still move.

    Returns:
      the decision (see the module docstring).

    Example:
      >>> decision = decide(model, model._tfamp_state.config, (x[:32], y[:32], None))
      >>> decision.kind, decision.patterns
      ('moved', ('pipe/frozen/',))
    """
    from tfamp.numerics.nonfinite import keras_step_locator

    start = time.perf_counter()
    x, y, sample_weight = batch
    candidate, patterns, findings = config, [], []

    def done(kind: str) -> FallbackDecision:
        moved = tuple(patterns) if kind == MOVED else ()
        return FallbackDecision(kind, moved, tuple(findings), time.perf_counter() - start)

    # One trace for every candidate: only the rewrite and the runs repeat.
    with keras_step_locator(model, x, y, sample_weight, loss_scale=1.0) as locate:
        while True:
            found = locate(candidate)
            if found is None:
                return done(MOVED if patterns else NOT_FOUND)
            findings.append(found)
            if not found.ran_16bit:
                return done(OVERFLOWS_IN_FP32)
            if found.keep_fp32 in candidate.keep_fp32:
                return done(NOT_COVERED)
            if len(patterns) >= room:
                return done(CAP_REACHED)
            patterns.append(found.keep_fp32)
            candidate = candidate.replace(keep_fp32=(*candidate.keep_fp32, found.keep_fp32))


# -- the log lines ---------------------------------------------------------------------

def moved_message(model, config, decision: FallbackDecision, *, restored: bool = False) -> str:
    """The one loud line: what moved, why, its cost, and how to make it permanent."""
    names = ", ".join(repr(p) for p in decision.patterns)
    keep = list(config.keep_fp32)
    if restored:
        why = "restored from the checkpoint's float32 fallback record"
    else:
        first = decision.findings[0]
        why = (f"{first.op} '{first.node}' ({first.phase}) gave {first.value} in "
               f"{first.dtype} with finite inputs at loss scale 1, so no loss scale "
               f"could fix it; decided in {decision.seconds:.2f} s")
    if decision.repaired:
        shown = ", ".join(decision.repaired[:2]) + (", ..." if len(decision.repaired) > 2 else "")
        why += (f"; the skipped steps had written inf/nan into {len(decision.repaired)} "
                f"non-trainable variables ({shown} entries), reset to their initial values")
    return (f"tfamp: float32 fallback on model {model.name!r}: now keeping {names} float32 "
            f"({why}). The step functions are rewritten again (one more trace and "
            f"rewrite); those layers now cost float32 time and memory. To make it "
            f"permanent and skip the lost steps: TFAMP_KEEP_FP32={','.join(keep)!r} or "
            f"AmpConfig(keep_fp32={keep!r}).")


def stopped_message(model, decision: FallbackDecision) -> str:
    """The one line when tfamp will not move anything (and will not try again)."""
    found = decision.last
    where = f"{found.op} '{found.node}' (layer/scope '{found.layer}')" if found else "?"
    if decision.kind == OVERFLOWS_IN_FP32:
        tried = (f" after keeping {', '.join(repr(f.keep_fp32) for f in decision.findings[:-1])}"
                 f" float32" if len(decision.findings) > 1 else "")
        return (f"tfamp: no float32 fallback on model {model.name!r}: {where} gives "
                f"{found.value} computing in float32 too{tried}, so moving it to float32 "
                f"would not help; tfamp leaves the rewrite as it is and will not retry. "
                f"Expected finite values in float32; check the data's scale, the "
                f"learning rate and the model.")
    if decision.kind == NOT_COVERED:
        return (f"tfamp: no float32 fallback on model {model.name!r}: {where} still "
                f"computes in {found.dtype} though keep_fp32 has {found.keep_fp32!r} "
                f"(its name is outside that pattern); tfamp will not retry. Keep it float32 "
                f"with a keep_fp32 pattern matching {found.node!r}, or "
                f"{found.fix_oplist_api}.")
    if decision.kind == CAP_REACHED:
        return (f"tfamp: no more float32 fallback on model {model.name!r}: with the "
                f"most layers it moves ({MAX_MOVED}) float32, {where} would still "
                f"overflow float16; tfamp moves none of them and will not retry. Keep the "
                f"region float32 yourself ({found.fix_api}) or use dtype='bfloat16'.")
    return (f"tfamp: no float32 fallback on model {model.name!r}: fit's data cannot be "
            f"re-read (expected arrays or a tf.data.Dataset), so tfamp cannot find the op "
            f"that overflows; the stuck-scale warning will name what it can.")


# -- the checkpointed record ------------------------------------------------------------

def encode(patterns: tuple[str, ...]) -> list[int]:
    """The record's int32 values: the UTF-8 of the "\\n"-joined patterns, zero padded.

    Raises:
      ValueError: the patterns do not fit in ``RECORD_LENGTH`` bytes.
    """
    data = "\n".join(patterns).encode()
    if len(data) > RECORD_LENGTH:
        raise ValueError(
            f"the float32 fallback record holds {RECORD_LENGTH} bytes, the patterns "
            f"{list(patterns)} need {len(data)}.")
    return list(data) + [0] * (RECORD_LENGTH - len(data))


def decode(values) -> tuple[str, ...]:
    """The patterns a record holds (() for an empty one)."""
    data = bytes(int(v) for v in values if int(v) > 0)
    return tuple(p for p in data.decode(errors="replace").split("\n") if p)


def record_variable(model, state):
    """The model's checkpointed record variable, or None (no tfamp loss scaling)."""
    owner = getattr(state.loop, "step_owner", None) if state.loop is not None else None
    for candidate in (owner, getattr(model, "optimizer", None)):
        variable = getattr(candidate, "fallback_fp32", None)
        if variable is not None:
            return variable
    return None


def _write_record(model, state, patterns: tuple[str, ...]) -> None:
    variable = record_variable(model, state)
    if variable is None:
        return
    try:
        values = encode(patterns)
    except ValueError as err:
        log.warning("tfamp: %s A resumed run will not keep the fallback: make it "
                    "permanent with keep_fp32.", err)
        return
    variable.assign(values)


# -- applying --------------------------------------------------------------------------

def apply(model, state, patterns: tuple[str, ...]) -> None:
    """Keeps `patterns` float32 from the next step on: the model's config, its
    step functions (rebuilt) and the checkpointed record."""
    from tfamp.keras import hooks

    fallback = state_of(state)
    new = tuple(p for p in patterns if p not in state.config.keep_fp32)
    fallback.moved = (*fallback.moved, *(p for p in patterns if p not in fallback.moved))
    if new:
        state.config = state.config.replace(keep_fp32=(*state.config.keep_fp32, *new))
        had_train = getattr(model, "train_function", None) is not None
        hooks.reset_functions(model)
        if had_train:  # fit holds no copy: it reads model.train_function each step
            model.make_train_function(force=True)
    _write_record(model, state, fallback.moved)


def after_train_call(model, state, owner, logs=None) -> bool:
    """After a train call: look for an op to move when steps keep being skipped.

    Args:
      model, state: the enabled model and its EnabledState.
      owner: the loss-scale optimizer its step applied.
      logs: the train call's outputs (Keras's logs), for the loss.

    Returns:
      True if layers moved to float32 now (the stuck-scale check waits then).
    """
    from tfamp.keras import custom_loop

    fallback = state_of(state)
    if fallback.stopped or record_variable(model, state) is None:
        return False
    scale, skipped = (v.numpy() for v in custom_loop.scale_values(owner))
    skipped = int(skipped)
    previous = fallback.last_skipped if fallback.last_skipped is not None else 0
    fallback.last_skipped = skipped
    if skipped <= previous:
        fallback.consecutive = 0
        if not fallback.moved:
            fallback.next_probe_at = FIRST_PROBE_AFTER
        return False
    fallback.consecutive += skipped - previous
    if fallback.consecutive < fallback.next_probe_at:
        return False
    from tfamp.keras.flavour import flavour_of

    if not flavour_of(model).has_loss(model):
        return False  # a step without a compiled loss (a GAN's): the probe cannot rebuild it
    at_floor = float(scale) <= float(getattr(owner, "min_scale", 1.0))
    if not at_floor and not _forward_overflowed(state, fallback):
        # Every skipped step's forward pass was finite: the gradients overflow,
        # which is the scale's to fix. No probe.
        return False
    try:
        decision = _decide_on_fit_batch(model, state, fallback)
    except Exception as err:  # training goes on; the stuck check still warns
        fallback.stopped = "failed"
        log.warning("tfamp: no float32 fallback on model %r: finding the op that overflows "
                    "failed (%s: %s); tfamp will not retry. Please report it; meanwhile keep "
                    "the layer float32 yourself (keep_fp32=[...]).", model.name,
                    type(err).__name__, err)
        return False
    fallback.decisions.append(decision)
    if decision.kind == MOVED:
        apply(model, state, decision.patterns)
        fallback.consecutive, fallback.next_probe_at = 0, PROBE_AFTER_MOVE
        log.warning("%s", moved_message(model, state.config, decision))
        return True
    if decision.kind == NOT_FOUND:
        fallback.next_probe_at *= 2
        log.debug("tfamp: %d steps skipped in a row on %r but the step is finite at loss "
                  "scale 1: loss scaling's to fix; next look after %d.",
                  fallback.consecutive, model.name, fallback.next_probe_at)
        return False
    fallback.stopped = decision.kind
    log.warning("%s", stopped_message(model, decision))
    return False


def _forward_overflowed(state, fallback: FallbackState) -> bool:
    """True if a step skipped since the last look had inf/nan in its logs (its loss):
    a forward pass overflowed (``step_metrics.StepGuard``). Summed over replicas
    and workers, so every worker answers alike."""
    counter = getattr(state, "nonfinite_skips", None)
    if counter is None:
        return True  # no count kept: look
    count = int(counter.numpy())
    seen, fallback.last_nonfinite = fallback.last_nonfinite, count
    return count > seen


def known_cause(state) -> str | None:
    """What the fallback found when it stopped (for the stuck-at-floor warning), or None."""
    fallback = state.fallback
    if fallback is None or not fallback.stopped or not fallback.decisions:
        return None
    decision = fallback.decisions[-1]
    if decision.last is None:
        return None
    text = decision.last.describe()
    if decision.kind == OVERFLOWS_IN_FP32:
        text += " With that layer float32 it overflows in float32 too, so keep_fp32 cannot help."
    return text


def _decide_on_fit_batch(model, state, fallback: FallbackState) -> FallbackDecision:
    from tfamp.numerics.keras_probe import unpack_batch

    source = getattr(model, "_tfamp_fit_batch", None)
    batch = source() if source is not None else None
    if batch is None:
        return FallbackDecision(NO_BATCH)
    # The skipped steps ran their forward pass: a BatchNorm's moving statistics
    # took the inf/nan in. Repaired first, so the probe sees where it starts;
    # kept only if layers move (the next overflowing step would write them again).
    repaired, undo = repair_state(model)
    decision = decide(model, state.config, unpack_batch(batch),
                      room=MAX_MOVED - len(fallback.moved))
    if decision.kind != MOVED:
        undo()
        return decision
    return dataclasses.replace(decision, repaired=repaired)


def repair_state(model) -> tuple[tuple[str, ...], object]:
    """Resets the inf/nan entries of non-trainable variables to their initial values.

    Only variables a layer creates with an ``<attr>_initializer`` next to them
    (a BatchNorm's ``moving_mean`` / ``moving_variance``) are repaired.

    Returns:
      ("name: count", ...) of what was reset, and a function that undoes it.
    """
    import numpy as np

    initializers = {}
    for layer in model._flatten_layers(include_self=False):
        for attr, value in vars(layer).items():
            initializer = getattr(layer, f"{attr}_initializer", None)
            if initializer is not None and hasattr(value, "assign"):
                initializers[id(value)] = initializer
    repaired, saved = [], []
    for variable in model.non_trainable_variables:
        value = np.asarray(variable.numpy())
        if value.dtype.kind != "f" or np.isfinite(value).all():
            continue
        initializer = initializers.get(id(variable))
        if initializer is None:
            continue
        start = np.asarray(initializer(value.shape, dtype=str(value.dtype)))
        bad = ~np.isfinite(value)
        saved.append((variable, value))
        variable.assign(np.where(bad, start, value))
        repaired.append(f"{getattr(variable, 'path', variable.name)}: {int(bad.sum())}")

    def undo():
        for variable, value in saved:
            variable.assign(value)

    return tuple(repaired), undo


def sync_from_record(model, state) -> tuple[str, ...]:
    """Applies the patterns a restored checkpoint recorded and this run lacks.

    Returns:
      the patterns applied now (() when the record adds nothing).
    """
    variable = record_variable(model, state)
    if variable is None:
        return ()
    fallback = state_of(state)
    recorded = decode(variable.numpy())
    missing = tuple(p for p in recorded if p not in fallback.moved)
    if missing:
        apply(model, state, missing)
        decision = FallbackDecision(MOVED, missing)
        log.warning("%s", moved_message(model, state.config, decision, restored=True))
    import tensorflow as tf

    owner = getattr(state.loop, "step_owner", None) or getattr(model, "optimizer", None)
    skipped = getattr(owner, "skipped_steps", None)
    if skipped is not None:  # count skipped steps in a row from here
        fallback.last_skipped = int(tf.convert_to_tensor(skipped).numpy())
    return missing


def prepare_fit(model, state, args, kwargs) -> tuple[tuple, dict]:
    """Adds the callback that re-applies a restored record before fit's first step.

    It goes last, so ``BackupAndRestore`` (which restores in its
    ``on_train_begin``) has restored by the time it reads the record.
    """
    if state.loss_scale is None:
        return tuple(args), kwargs
    from tfamp.keras.flavour import flavour_of

    callback = _sync_callback_class(flavour_of(model).keras.callbacks.Callback)(state)
    if len(args) > 5:  # callbacks given positionally
        return (*args[:5], [*(args[5] or []), callback], *args[6:]), kwargs
    return tuple(args), {**kwargs, "callbacks": [*(kwargs.get("callbacks") or []), callback]}


@functools.cache
def _sync_callback_class(base: type) -> type:
    class FallbackSync(base):
        """Re-applies the float32 fallback a restored checkpoint recorded (tfamp)."""

        def __init__(self, state):
            super().__init__()
            self._tfamp_state = state

        def on_train_begin(self, logs=None):
            sync_from_record(self.model, self._tfamp_state)

        def on_epoch_begin(self, epoch, logs=None):
            from tfamp.keras import hooks

            hooks.mark_epoch_start(self.model, self._tfamp_state)

    return FallbackSync
