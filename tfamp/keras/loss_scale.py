"""Loss scaling: the scale state and the optimizer wrapper that applies it.

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

``LossScaleOptimizer`` builds on tf_keras's ``LossScaleOptimizerV3``: it keeps
that class's gradient all-reduce before the finiteness check (so every replica
makes the same decision), its checkpoint layout, and its behaviour of advancing
``iterations`` on a skipped step (learning-rate schedules keep counting
batches). It replaces the scale state to add what tf_keras lacks: a floor other
than 1, a count of skipped steps, skipping for fixed scales, and the names of
the first variables whose gradients were non-finite, for the stuck-at-floor
warning.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable

import tensorflow as tf
from tf_keras.src.mixed_precision import loss_scale_optimizer as keras_lso
from tf_keras.src.saving import object_registration

from tfamp.keras.fallback import RECORD_LENGTH
from tfamp.keras.scale_update import (
    BAD_NAMES_KEPT,
    finite_flags,
    loss_scale_ops,
    mark_scaled,
    update_scale,
)
from tfamp.keras.start_scale import current_probe

log = logging.getLogger("tfamp")

DEFAULT_INITIAL_SCALE = 2.0**15
DEFAULT_GROWTH_INTERVAL = 2000
DEFAULT_MIN_SCALE = 1.0
# Consecutive skipped steps at the floor before the stuck warning.
STUCK_PATIENCE = 2


class _ScaleState(keras_lso._DynamicLossScaleState):
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
                    min_scale: float = DEFAULT_MIN_SCALE) -> _ScaleState:
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


class LossScaleOptimizer(keras_lso.LossScaleOptimizerV3):
    """Wraps a tf_keras optimizer with loss scaling (see the module docstring).

    Args:
      inner_optimizer: a tf_keras ``Optimizer`` (e.g. ``keras.optimizers.Adam()``).
      loss_scale: "dynamic" (default) or a positive number for a fixed scale.
      initial_scale: the starting dynamic scale (2**15).
      growth_interval: good steps before the dynamic scale doubles (2000).
      min_scale: the floor of the dynamic scale (1).

    Saved models record it as tf_keras's ``LossScaleOptimizer`` (same config
    keys), so a process without tfamp loads them.

    Example:
      >>> opt = LossScaleOptimizer(keras.optimizers.Adam(), growth_interval=100)
      >>> model.compile(optimizer=opt, loss="mse")
    """

    # Serialize under tf_keras's public name: a .keras file must load without tfamp.
    _keras_api_names = ("keras.mixed_precision.LossScaleOptimizer",)
    _keras_api_names_v1 = ("keras.mixed_precision.LossScaleOptimizer",)

    def __init__(self, inner_optimizer, loss_scale="dynamic", *,
                 initial_scale: float = DEFAULT_INITIAL_SCALE,
                 growth_interval: int = DEFAULT_GROWTH_INTERVAL,
                 min_scale: float = DEFAULT_MIN_SCALE):
        dynamic, start = validate_settings(loss_scale, initial_scale, growth_interval,
                                           min_scale)
        # The parent's fixed mode creates no state; tfamp's own state replaces it.
        super().__init__(inner_optimizer, dynamic=False, initial_scale=start)
        self._loss_scale = _ScaleState(
            start, int(growth_interval) if dynamic else None, min_scale)
        self._track_trackable(self._loss_scale, "loss_scale", overwrite=True)
        self._variable_names: list[str] = []
        self._warned_stuck = False

    def _track_trackable(self, trackable, name, overwrite=False):
        # tf_keras's wrapper tracks its state on the *inner* optimizer. After
        # tfamp.disable the same inner optimizer can be wrapped again; its
        # "loss_scale" dependency is then replaced rather than duplicated.
        return super()._track_trackable(
            trackable, name, overwrite=overwrite or name == "loss_scale")

    # -- what users and logs read --------------------------------------------

    @property
    def dynamic(self) -> bool:
        return self._loss_scale.is_dynamic

    @property
    def dynamic_growth_steps(self):
        return self._loss_scale.growth_steps if self.dynamic else None

    @property
    def dynamic_counter(self):
        return self._loss_scale.counter if self.dynamic else None

    @property
    def min_scale(self) -> float:
        return self._loss_scale.min_scale

    @property
    def fallback_fp32(self) -> tf.Variable:
        """The float32 fallback's record (``tfamp.keras.fallback``), checkpointed."""
        return self._loss_scale.fallback_fp32

    @property
    def skipped_steps(self) -> tf.Variable:
        """Steps skipped because a gradient was inf or nan (int64 variable)."""
        return self._loss_scale.skipped_steps

    def get_config(self):
        config = super().get_config()
        if not self.dynamic:
            config["dynamic_growth_steps"] = None
        return config

    # -- applying ------------------------------------------------------------

    def get_scaled_loss(self, loss):
        from tfamp.keras import custom_loop

        if current_probe() is not None:  # the start-scale probe measures true sizes
            return loss
        with loss_scale_ops():
            scaled = super().get_scaled_loss(loss)
        mark_scaled(scaled)  # scaled by hand: tfamp's custom-loop tape hook leaves it alone
        custom_loop.note_scaled_loss()
        return scaled

    def get_unscaled_gradients(self, grads):
        if current_probe() is not None:
            return grads
        with loss_scale_ops():
            return super().get_unscaled_gradients(grads)

    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        from tfamp.keras import custom_loop

        if current_probe() is not None:
            return self.iterations  # the start-scale probe applies nothing
        pending = custom_loop.take_pending()
        if pending is not None:
            # tfamp's tape hook scaled and unscaled (a custom loop); this optimizer
            # checks finiteness itself. Keeps tf_keras's "you forgot" warning quiet.
            self._loss_has_been_scaled = self._gradients_have_been_unscaled = True
        custom_loop.note_update(
            pending, scaled=pending is not None or custom_loop.take_scaled_loss())
        grads_and_vars = list(grads_and_vars)
        # Same filter the parent applies before the finiteness check, so index i
        # of the recorded flags names variable i here.
        self._variable_names = [v.name for g, v in grads_and_vars if g is not None]
        return super().apply_gradients(grads_and_vars, *args, **kwargs)

    def check_stuck(self, diagnose: Callable[[], str | None] | None = None) -> bool:
        """Warns once if steps keep being skipped with the scale at its floor.

        Called by tfamp after each training step (a few scalar reads). Returns
        True if the warning was issued now.

        Args:
          diagnose: called once, when warning, to name the first op that made
            an inf/nan (``tfamp.numerics.nonfinite``); its answer goes into the
            warning. It must not change any state.
        """
        if self._warned_stuck or int(self._loss_scale.floor_skips.numpy()) < STUCK_PATIENCE:
            return False
        self._warned_stuck = True
        indices = [int(i) for i in self._loss_scale.first_nonfinite.numpy() if i >= 0]
        names = [self._variable_names[i] for i in indices if i < len(self._variable_names)]
        warn_stuck(self.min_scale, int(self.skipped_steps.numpy()), names, diagnose)
        return True


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


# Legacy SavedModel metadata names an optimizer by get_registered_name(its class).
# Give tfamp's class tf_keras's own name so such a file loads without tfamp, as
# tf_keras's LossScaleOptimizerV3 (same config keys, same checkpoint layout).
object_registration._GLOBAL_CUSTOM_NAMES[LossScaleOptimizer] = "LossScaleOptimizerV3"
