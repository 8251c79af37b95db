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
        decision = decide(model, config, fit's first batch, or the batch of the
                          train_on_batch call that skipped)
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

**At scale** every replica and worker runs the same graph. The locator runs
the step the way it runs, once per replica in a replica context, each replica
on its share of the batch its worker read (``overflow_locator``, with
``replicas.run_per_replica``); each worker decides on what its replicas saw,
then every worker's decision is gathered (``replicas.agree_rows``) and
``combine`` makes one: the patterns any worker would move, in worker order
(capped), else the first reason to stop, else nothing found. Every worker then
applies the same patterns at the same step, rebuilding the model's step
functions (``make_train_function(force=True)``; ``fit`` reads
``model.train_function`` before each step, so the next step uses it). When
to look is decided from what every worker shares: the skipped-step counter and
the scale (the same everywhere), and the count of skipped steps whose logs were
inf/nan, summed over replicas and workers.

Checkpoints: the moved patterns are written, UTF-8 encoded, into the int32
variable ``fallback_fp32`` of the model's loss-scale state, so whatever saves
the optimizer saves them (``tf.train.Checkpoint``, tf_keras ``BackupAndRestore``
and TF-format ``save_weights``, Keras 3 ``save_weights`` / ``BackupAndRestore`` /
``.keras``). At the start of every ``fit`` (after ``BackupAndRestore`` restored,
before the first step), and at a model's first ``train_on_batch`` call, the
record is read and any pattern not yet applied is (on every worker: each
restores the same record). Each line is ``<model name>\t<pattern>``: models
compiled with one optimizer (a Keras 2 GAN's, on tf_keras) share one wrapper and
so one record, and each re-applies its own lines only (a line without a name,
as older records hold, is every model's).

This module decides and says; the lifecycle (``lifecycle.py``) asks it after
each train call and applies what it decides. A custom loop's step under
``TFAMP_ENABLE`` is asked about by the start-up hook (``tfamp.runtime.startup``:
before its first run, and from a watch on its skipped steps), with ``decide_with``
on ``overflow_locator.step_locator``.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np

from tfamp.keras import replicas
from tfamp.keras.flavour import layers_of
from tfamp.keras.scale_state import RECORD_LENGTH
from tfamp.numerics.nonfinite import scope_keep_pattern, shell_quoted

log = logging.getLogger("tfamp")

# Consecutive skipped steps before the first look (a step that overflows at
# the start scale is usually one halving away from fine).
FIRST_PROBE_AFTER = 2
# After layers moved: skipped steps in a row before looking again (a from-scratch
# model may still overflow at its start scale; that is loss scaling's to fix).
PROBE_AFTER_MOVE = 8
# Layers moved per model at most (all decisions together).
MAX_MOVED = 4

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
# No batch to look at (a generator fit cannot re-read).
NO_BATCH = "no batch"
# Finding the op failed (the warning says why).
FAILED = "failed"
# Codes for agreeing across workers, and which decision wins when they differ:
# moving wins (what one worker's data needs, every worker moves), then a reason
# to stop, then nothing found.
KIND_CODES = {MOVED: 1, OVERFLOWS_IN_FP32: 2, NOT_COVERED: 3, CAP_REACHED: 4, FAILED: 5,
              NOT_FOUND: 6, NO_BATCH: 7}
_STOP_KINDS = (OVERFLOWS_IN_FP32, NOT_COVERED, CAP_REACHED, FAILED, NO_BATCH)


@dataclasses.dataclass(frozen=True)
class FallbackDecision:
    """What ``decide`` found: a kind above, the patterns to keep float32 (for MOVED),
    every finding on the way (``NonFiniteOp``) and the seconds it took."""

    kind: str
    patterns: tuple[str, ...] = ()
    findings: tuple = ()
    seconds: float = 0.0
    repaired: tuple[str, ...] = ()  # "variable: entries" reset from inf/nan (repair_state)
    elsewhere: bool = False  # decided from another replica's or worker's batch

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

    def should_look(self, skipped: int, at_floor: bool, forward_overflowed) -> bool:
        """After a train call: has the time come to look for an op to move?

        Args:
          skipped: the skipped-step counter now (the same on every worker).
          at_floor: the scale is at its floor.
          forward_overflowed: () -> did a skipped step's logs hold inf/nan since
            the last look (asked only when needed: it reads across workers).
        """
        if self.stopped:
            return False
        previous = self.last_skipped if self.last_skipped is not None else 0
        self.last_skipped = skipped
        if skipped <= previous:
            self.consecutive = 0
            if not self.moved:
                self.next_probe_at = FIRST_PROBE_AFTER
            return False
        self.consecutive += skipped - previous
        if self.consecutive < self.next_probe_at:
            return False
        # Every skipped step's forward pass was finite: the gradients overflow,
        # which is the scale's to fix (until it is at its floor). No look.
        return at_floor or forward_overflowed()

    def record(self, decision: FallbackDecision) -> None:
        """What a look decided, for when to look again."""
        self.decisions.append(decision)
        if decision.kind == MOVED:
            self.moved = (*self.moved, *(p for p in decision.patterns if p not in self.moved))
            self.consecutive, self.next_probe_at = 0, PROBE_AFTER_MOVE
        elif decision.kind == NOT_FOUND:
            self.next_probe_at *= 2
        else:
            self.stopped = decision.kind


# -- deciding ----------------------------------------------------------------------

def decide(model, config, batch, *, room: int = MAX_MOVED, strategy=None) -> FallbackDecision:
    """Which layers to keep float32 so that one batch's step is finite (changes nothing).

    Decides on what this worker's replicas see (see ``combine`` for every worker).

    Args:
      model: an enabled, compiled Keras model.
      config: the AmpConfig its functions run with now.
      batch: (x, y, sample_weight) of one batch.
      room: layers that may still move.
      strategy: the model's tf.distribute strategy: the step runs per replica.

    Returns:
      the decision (see the module docstring).

    Example:
      >>> decision = decide(model, model._tfamp_state.config, (x[:32], y[:32], None))
      >>> decision.kind, decision.patterns
      ('moved', ('pipe/frozen/',))
    """
    from tfamp.keras.overflow_locator import keras_step_locator

    start = time.perf_counter()
    x, y, sample_weight = batch
    # One trace for every candidate: only the rewrite and the runs repeat.
    with keras_step_locator(model, x, y, sample_weight, loss_scale=1.0,
                            strategy=strategy) as locate:
        return decide_with(locate, config, room=room, start=start)


def decide_with(locate, config, *, room: int = MAX_MOVED,
                start: float | None = None) -> FallbackDecision:
    """The decision loop of ``decide`` for any step: `locate` (AmpConfig -> the first
    ``NonFiniteOp`` of the step rewritten with it at loss scale 1, or None) is asked
    with `config`, then with each layer found kept float32 as well.

    Args:
      locate: the step's locator (``overflow_locator.keras_step_locator``'s, or
        ``step_locator``'s for a custom loop's step).
      config: the AmpConfig the step runs with now.
      room: layers that may still move.
      start: ``time.perf_counter()`` when deciding began (default: now).
    """
    start = time.perf_counter() if start is None else start
    candidate, patterns, findings = config, [], []

    def done(kind: str) -> FallbackDecision:
        moved = tuple(patterns) if kind == MOVED else ()
        return FallbackDecision(kind, moved, tuple(findings), time.perf_counter() - start)

    while True:
        found = locate(candidate)
        if found is None:
            return done(MOVED if patterns else NOT_FOUND)
        findings.append(found)
        if not found.ran_16bit:
            return done(OVERFLOWS_IN_FP32)
        pattern = found.keep_fp32  # (the layer's every call: ``call_scopes``)
        one_call = scope_keep_pattern(found.layer)
        if pattern in candidate.keep_fp32 or one_call in candidate.keep_fp32:
            return done(NOT_COVERED)
        if len(patterns) >= room:
            return done(CAP_REACHED)
        patterns.append(pattern)
        candidate = candidate.replace(keep_fp32=(*candidate.keep_fp32, pattern))


# -- the log lines ---------------------------------------------------------------------

def moved_message(who: str, config, decision: FallbackDecision, *,
                  restored: bool = False) -> str:
    """The one loud line: what moved, why, its cost, and how to make it permanent.

    `who`: what moved them ("model 'name'", "custom loop step 'train_step'")."""
    names = ", ".join(shell_quoted(p) for p in decision.patterns)
    keep = list(config.keep_fp32)
    if restored:
        why = "restored from the checkpoint's float32 fallback record"
    elif decision.elsewhere or not decision.findings:
        why = ("found on another replica's or worker's batch; every replica and worker "
               "moves the same layers")
    else:
        first = decision.findings[0]
        why = (f"{first.op} '{first.node}' ({first.phase}) gave {first.value} in "
               f"{first.dtype} with finite inputs at loss scale 1, so no loss scale "
               f"could fix it; decided in {decision.seconds:.2f} s")
    if decision.repaired:
        shown = ", ".join(decision.repaired[:2]) + (", ..." if len(decision.repaired) > 2 else "")
        why += (f"; the skipped steps had written inf/nan into {len(decision.repaired)} "
                f"non-trainable variables ({shown} entries), reset to their initial values")
    return (f"tfamp: float32 fallback on {who}: now keeping {names} float32 "
            f"({why}). The step functions are rewritten again (one more trace and "
            f"rewrite); those layers now cost float32 time and memory. To make it "
            f"permanent and skip the lost steps: TFAMP_KEEP_FP32={shell_quoted(','.join(keep))} or "
            f"AmpConfig(keep_fp32={keep!r}).")


def stopped_message(who: str, decision: FallbackDecision) -> str:
    """The one line when tfamp will not move anything (and will not try again).

    `who`: as ``moved_message``'s."""
    found = decision.last
    where = f"{found.op} '{found.node}' (layer/scope '{found.layer}')" if found else "?"
    if decision.elsewhere:
        return (f"tfamp: no float32 fallback on {who}: on another replica "
                f"or worker's batch, {decision.kind} (its line says more); tfamp will not "
                f"retry, on any worker.")
    if decision.kind == OVERFLOWS_IN_FP32:
        tried = (f" after keeping {', '.join(repr(f.keep_fp32) for f in decision.findings[:-1])}"
                 f" float32" if len(decision.findings) > 1 else "")
        return (f"tfamp: no float32 fallback on {who}: {where} gives "
                f"{found.value} computing in float32 too{tried}, so moving it to float32 "
                f"would not help; tfamp leaves the rewrite as it is and will not retry. "
                f"Expected finite values in float32; check the data's scale, the "
                f"learning rate and the model.")
    if decision.kind == NOT_COVERED:
        return (f"tfamp: no float32 fallback on {who}: {where} still "
                f"computes in {found.dtype} though keep_fp32 has {found.keep_fp32!r} "
                f"(its name is outside that pattern); tfamp will not retry. Keep it float32 "
                f"with a keep_fp32 pattern matching {found.node!r}, or "
                f"{found.fix_oplist_api}.")
    if decision.kind == CAP_REACHED:
        return (f"tfamp: no more float32 fallback on {who}: with the "
                f"most layers it moves ({MAX_MOVED}) float32, {where} would still "
                f"overflow float16; tfamp moves none of them and will not retry. Keep the "
                f"region float32 yourself ({found.fix_api}) or use dtype='bfloat16'.")
    return (f"tfamp: no float32 fallback on {who}: fit's data cannot be "
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


def recorded_for(values, model_name: str) -> tuple[str, ...]:
    """The patterns the record `values` holds for the model named `model_name`."""
    found = []
    for line in decode(values):
        name, tab, pattern = line.rpartition("\t")
        if (not tab or name == model_name) and pattern not in found:
            found.append(pattern)
    return tuple(found)


def record_with(values, model_name: str, patterns: tuple[str, ...]) -> list[int]:
    """The record `values` with the lines of `model_name` set to `patterns` (other
    models' lines kept; a line without a name that `patterns` holds is replaced).

    Raises:
      ValueError: it does not fit in ``RECORD_LENGTH`` bytes.
    """
    others = []
    for line in decode(values):
        name, tab, pattern = line.rpartition("\t")
        replaced = name == model_name if tab else pattern in patterns
        if not replaced:
            others.append(line)
    return encode((*others, *(f"{model_name}\t{p}" for p in patterns)))


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


def repair_state(model) -> tuple[tuple[str, ...], object]:
    """Resets the inf/nan entries of non-trainable variables to their initial values.

    Only variables a layer creates with an ``<attr>_initializer`` next to them
    (a BatchNorm's ``moving_mean`` / ``moving_variance``) are repaired.

    Returns:
      ("name: count", ...) of what was reset, and a function that undoes it.
    """
    import numpy as np

    initializers = {}
    for layer in layers_of(model, include_self=False):
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


# A Keras BatchNormalization's moving statistics and their default initial values
# (both Kerases: ``moving_mean_initializer="zeros"``, ``moving_variance_initializer="ones"``).
_MOVING_STATISTICS = (("moving_mean", 0.0), ("moving_variance", 1.0))


def reset_moving_statistics(variables) -> tuple[str, ...]:
    """Resets the inf/nan entries of BatchNorm moving statistics among `variables` to
    the layer's default initial values (0 for the mean, 1 for the variance).

    A custom loop's skipped steps still ran their forward pass, whose BatchNorm
    updates wrote a float16 overflow's inf/nan into these: once there, every later
    inference (``training=False``) is NaN. ``fit``'s fallback resets them from the
    layer's own initializers (``repair_state``); a custom loop's step has no
    model to read them from, so the variable's name decides.

    Returns:
      ("name: entries", ...) of what was reset.
    """
    repaired = []
    for variable in variables:
        name = getattr(variable, "path", None) or variable.name
        base = name.split(":")[0].rsplit("/", 1)[-1]
        start = dict(_MOVING_STATISTICS).get(base)
        if start is None or not variable.dtype.is_floating:
            continue
        for component in replicas.local_components(variable):
            value = np.asarray(component.numpy())
            bad = ~np.isfinite(value)
            if bad.any():
                component.assign(np.where(bad, np.asarray(start, value.dtype), value))
                repaired.append(f"{name}: {int(bad.sum())}")
    return tuple(repaired)


# -- one decision for every worker ------------------------------------------------------

def encode_decision(decision: FallbackDecision) -> np.ndarray:
    """[kind code, record of its patterns...]: one row for ``replicas.agree_rows``."""
    try:
        record = encode(decision.patterns)
    except ValueError:
        record = encode(())
    return np.asarray([KIND_CODES[decision.kind], *record], np.int32)


def combine(local: FallbackDecision, rows: np.ndarray, *, room: int) -> FallbackDecision:
    """One decision from every worker's (rows of ``encode_decision``, worker order).

    Moving wins: the patterns any worker would move (first seen first, at most
    `room`); otherwise the first reason to stop (a worker without a batch
    to look at stops them all: they must look together); otherwise nothing
    found. This worker's own findings stay for its messages when its decision
    is the one taken.
    """
    kinds = {code: kind for kind, code in KIND_CODES.items()}
    decided = [(kinds[int(row[0])], decode(row[1:])) for row in np.asarray(rows)]
    moved = [p for kind, patterns in decided if kind == MOVED for p in patterns]
    if moved:
        patterns = tuple(dict.fromkeys(moved))[:room]
        same = local.kind == MOVED and local.patterns == patterns
        return dataclasses.replace(local, kind=MOVED, patterns=patterns, elsewhere=not same)
    for kind in _STOP_KINDS:
        if any(k == kind for k, _ in decided):
            if local.kind == kind:
                return local
            return FallbackDecision(kind, (), (), local.seconds, elsewhere=True)
    return local if local.kind == NOT_FOUND else FallbackDecision(NOT_FOUND, (), (),
                                                                  local.seconds)


def agree(strategy, local: FallbackDecision, *, room: int) -> FallbackDecision:
    """``combine`` of every worker's decision (collective: every worker calls it)."""
    if not replicas.is_distributed(strategy):
        return local
    return combine(local, replicas.agree_rows(strategy, encode_decision(local)), room=room)
