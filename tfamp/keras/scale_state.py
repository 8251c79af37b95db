"""The loss-scale state: its variables, its rules, its settings, and what every owner answers.

Algorithm (dynamic, the float16 default)::

    scale = initial_scale                      # 2**15
    each step:
        grads = grad(loss * scale) / scale     # unscaled in float32
        if all grads finite:
            apply grads; good_steps += 1
            if good_steps == growth_interval:  # 2000
                scale *= 2; good_steps = 0
        else:                                  # skip: weights and slots untouched
            skipped_steps += 1; good_steps = 0
            scale = max(scale / 2, min_scale)  # min_scale default 1

A fixed scale skips non-finite steps the same way but never changes.

A **scale owner** is what keeps one scale: tfamp's tf_keras loss-scale
optimizer (``optimizer_tf_keras``), its Keras 3 one (``optimizer_keras3``), or
a bare ``ScaleState`` (an enabled model without a loss-scale optimizer, and
``TFAMP_ENABLE``'s custom-loop scale). Every owner answers the same questions
(``scale_tensor``, ``skipped_steps``, ``min_scale``, ``is_dynamic``,
``update_from_flags``, ``set_scale``, ``has_stepped``, ``ensure_built``,
``fallback_fp32``, ``check_stuck``); the module functions below ask them.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable

import numpy as np
import tensorflow as tf
from tf_keras.src.mixed_precision import loss_scale_optimizer as keras_lso

from tfamp.keras.scale_update import BAD_NAMES_KEPT, finite_flags, update_scale

log = logging.getLogger("tfamp")

DEFAULT_INITIAL_SCALE = 2.0**15
DEFAULT_GROWTH_INTERVAL = 2000
DEFAULT_MIN_SCALE = 1.0
# Consecutive skipped steps at the floor before the stuck warning.
STUCK_PATIENCE = 2
# Length of the float32 fallback's checkpointed record (int32 codes of the UTF-8
# of its "\n"-joined keep_fp32 patterns: keras/fallback.py).
RECORD_LENGTH = 512


class ScaleState(keras_lso._DynamicLossScaleState):
    """tf_keras's dynamic state plus floor, skip counter and first bad gradients.

    Same checkpoint names as tf_keras ("current_loss_scale", "good_steps") plus
    "skipped_steps", "floor_skips", "first_nonfinite" and "fallback_fp32".
    """

    def __init__(self, initial_scale: float, growth_interval: int | None, min_scale: float):
        super().__init__(initial_scale, growth_interval or 1, multiplier=2)
        self.is_dynamic = growth_interval is not None
        self.min_scale = float(min_scale)
        self.skipped_steps = self._add_weight("skipped_steps", 0, dtype=tf.int64)
        self.floor_skips = self._add_weight("floor_skips", 0, dtype=tf.int64)
        self.first_nonfinite = self._add_weight(
            "first_nonfinite", [-1] * BAD_NAMES_KEPT, dtype=tf.int32)
        # The layers moved to float32 after a float16 overflow (keras/fallback.py).
        self.fallback_fp32 = self._add_weight(
            "fallback_fp32", [0] * RECORD_LENGTH, dtype=tf.int32)

    @classmethod
    def for_setting(cls, loss_scale, initial_scale: float = DEFAULT_INITIAL_SCALE,
                    growth_interval: int = DEFAULT_GROWTH_INTERVAL,
                    min_scale: float = DEFAULT_MIN_SCALE) -> ScaleState:
        """The state for a ``loss_scale`` setting: "dynamic", or a fixed number.

        Its variables are made outside any function being traced (a custom
        loop's step may be what first asks for them).
        """
        with tf.init_scope():
            if loss_scale == "dynamic":
                return cls(initial_scale, growth_interval, min_scale)
            return cls(float(loss_scale), None, min_scale)

    def update(self, grads):
        """Updates the scale for this step; returns (update op, apply grads?)."""
        grads = [g for g in tf.nest.flatten(grads) if g is not None]
        if tf.distribute.has_strategy() and tf.distribute.in_cross_replica_context():
            strategy = tf.distribute.get_strategy()
            flags = strategy.experimental_local_results(
                strategy.extended.call_for_each_replica(finite_flags, args=(grads,)))[0]
        else:
            flags = finite_flags(grads)
        finite, group = self.update_from_flags(flags)
        return group, finite

    def update_from_flags(self, flags, *, count_skipped: bool = True):
        """The scale rules for a step whose gradient flags are `flags`: (finite, updates).

        `count_skipped` False: the caller's skip branch counts skipped steps.
        """
        return update_scale(
            flags, scale=self.current_loss_scale, good_steps=self.counter,
            skipped_steps=self.skipped_steps if count_skipped else None,
            floor_skips=self.floor_skips,
            first_nonfinite=self.first_nonfinite, dynamic=self.is_dynamic,
            growth_interval=self.growth_steps, min_scale=self.min_scale)

    # -- what every scale owner answers ------------------------------------------

    def scale_tensor(self) -> tf.Tensor:
        return tf.convert_to_tensor(self.current_loss_scale)

    def set_scale(self, value: float) -> None:
        self.current_loss_scale.assign(value)

    def has_stepped(self) -> bool:
        return has_stepped_counters(self.skipped_steps)

    def ensure_built(self, variables) -> None:  # its variables exist from the start
        del variables

    def check_stuck(self, diagnose=None) -> bool:
        """Warns once if steps keep being skipped at the floor (variable names unknown)."""
        if getattr(self, "_warned_stuck", False) or (
                int(self.floor_skips.numpy()) < STUCK_PATIENCE):
            return False
        self._warned_stuck = True
        warn_stuck(self.min_scale, int(self.skipped_steps.numpy()), [], diagnose)
        return True


# The owner protocol, as functions (tests and messages read owners through them).

def current_scale(owner) -> tf.Tensor:
    """`owner`'s current loss scale as a float32 tensor (its initial one until built)."""
    return tf.cast(owner.scale_tensor(), tf.float32)


def scale_values(owner) -> tuple[tf.Tensor, tf.Tensor]:
    """(current scale as float32, skipped steps as int64) of any scale owner."""
    return current_scale(owner), tf.cast(tf.convert_to_tensor(owner.skipped_steps), tf.int64)


def step_log_values(owner) -> tuple[tf.Tensor, tf.Tensor]:
    """``scale_values`` for a train step's logs: the scale as float64 (the same
    number: the conversion is exact), the skipped steps as ``scale_values`` has them.

    Not float32: a log is an output of the compiled step, and so is the scale
    variable's new value; one value that is both needs a second buffer, so XLA
    copied it (a ``copy`` kernel in the H100 program). Converted, the log is a
    value of its own, computed in the scale update's fusion (measured, H100
    program: a 40-block test model 659 -> 658 kernels). The skipped-step count
    stays int64: converted, it became a convert kernel in place of the copy (its
    update is a select on the apply-or-skip predicate alone, which joins no
    other fusion).
    Users see the same numbers: Keras turns step logs into Python numbers.
    """
    scale, skipped = scale_values(owner)
    return tf.cast(scale, tf.float64), skipped


def scale_has_run(scale, initial: float, *counters) -> bool:
    """Has this scale state been run: a step counter of its own (good or skipped
    steps) above 0, or a scale moved from its `initial` value? A restored run keeps
    its scale; a state that has not run is probed.

    The optimizer's ``iterations`` are no evidence: a file can restore them without
    the scale (tf_keras's ``.keras`` format saves the inner optimizer only, and
    ``tfamp.enable`` on a model loaded from any file wraps its optimizer in a new
    state), which left a resumed run at a fresh 2^15 and no line saying so. A state
    restored right after its scale came back to exactly `initial` is probed again:
    a measured scale, not a lost one.
    """
    try:
        moved = float(np.asarray(scale.numpy() if hasattr(scale, "numpy") else scale)) != initial
    except (TypeError, ValueError):
        moved = False
    return moved or has_stepped_counters(*counters)


def has_stepped_counters(*counters) -> bool:
    """True if any of the (checkpointed) step counters is above 0."""
    for value in counters:
        if value is None:
            continue
        try:
            if int(np.asarray(value.numpy() if hasattr(value, "numpy") else value)) > 0:
                return True
        except (TypeError, ValueError):
            continue
    return False


def warn_stuck(min_scale: float, skipped: int, names: list[str],
               diagnose: Callable[[], str | None] | None = None) -> str:
    """Logs and warns (RuntimeWarning) that the scale is stuck at its floor.

    Shared by the tf_keras and Keras 3 loss-scale optimizers.

    Args:
      min_scale: the floor; skipped: steps skipped so far.
      names: the variables whose gradients were first non-finite.
      diagnose: called once to name the first op that made an inf/nan
        (``tfamp.numerics.nonfinite``); its answer is appended. It must not
        change any state; if it fails, the warning says so and still goes out.

    Returns:
      the message.
    """
    message = (
        f"tfamp: loss scale is stuck at its floor ({min_scale:g}) and steps keep "
        f"being skipped ({skipped} skipped so far): the gradients are inf/nan even "
        f"unscaled, so no weights are being updated. First non-finite gradients: "
        f"{', '.join(names) or 'unknown'}. Check the data and learning rate, keep the "
        f"op producing them float32 (keep_fp32=...), or try dtype='bfloat16'.")
    if diagnose is not None:
        try:
            found = diagnose()
        except Exception as err:  # the warning matters more than the diagnosis
            found = f"tfamp could not localise the op ({type(err).__name__}: {err})"
        if found:
            message += f" Localised: {found}"
    log.error("%s", message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)
    return message


def validate_settings(loss_scale, initial_scale: float, growth_interval: int,
                      min_scale: float) -> tuple[bool, float]:
    """Checks loss-scale settings; returns (dynamic?, starting scale).

    Raises:
      ValueError / TypeError: naming the argument, the value and what is accepted.
    """
    dynamic, start = _parse_loss_scale(loss_scale, initial_scale)
    _check_positive(growth_interval=growth_interval, min_scale=min_scale)
    if dynamic and start < min_scale:
        raise ValueError(
            f"initial_scale ({start}) is below min_scale ({min_scale}); pass an "
            f"initial_scale >= min_scale.")
    return dynamic, start


def _parse_loss_scale(loss_scale, initial_scale: float) -> tuple[bool, float]:
    if isinstance(loss_scale, str):
        if loss_scale != "dynamic":
            raise ValueError(
                f"loss_scale must be 'dynamic', a positive number or None, received "
                f"{loss_scale!r}.")
        _check_positive(initial_scale=initial_scale)
        return True, float(initial_scale)
    if isinstance(loss_scale, bool) or not isinstance(loss_scale, (int, float)):
        raise TypeError(
            f"loss_scale must be 'dynamic', a positive number or None, received "
            f"{loss_scale!r} ({type(loss_scale).__name__}).")
    _check_positive(loss_scale=loss_scale)
    return False, float(loss_scale)


def _check_positive(**values) -> None:
    for name, value in values.items():
        if not (isinstance(value, (int, float)) and not isinstance(value, bool)
                and value > 0 and value == value and value != float("inf")):
            raise ValueError(f"{name} must be a positive finite number, received {value!r}.")
