"""tfamp's loss-scale optimizers for tf_keras (``tfamp.LossScaleOptimizer``).

Two classes with one behaviour (``_TfampScaling``): ``LossScaleOptimizer`` wraps
tf_keras's optimizers (``keras.optimizers.*``), on tf_keras's
``LossScaleOptimizerV3``; ``LegacyLossScaleOptimizer`` wraps its legacy ones
(``keras.optimizers.legacy.*``, the Keras 2 API many scripts still compile
with), on tf_keras's ``LossScaleOptimizer``. ``LossScaleOptimizer(inner)`` gives
whichever fits `inner`, as tf_keras's own class does.

The scaling algorithm (dynamic by default, or fixed) is ``ScaleState``'s: see
``tfamp/keras/scale_state.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import tensorflow as tf
from tf_keras.src.mixed_precision import loss_scale_optimizer as keras_lso
from tf_keras.src.optimizers.legacy.optimizer_v2 import OptimizerV2
from tf_keras.src.saving import object_registration

from tfamp.keras import step_scope
from tfamp.keras.scale_state import (
    DEFAULT_GROWTH_INTERVAL,
    DEFAULT_INITIAL_SCALE,
    DEFAULT_MIN_SCALE,
    STUCK_PATIENCE,
    ScaleState,
    scale_has_run,
    validate_settings,
    warn_stuck,
)
from tfamp.keras.scale_update import apply_gradients_if_finite, loss_scale_ops, mark_scaled

log = logging.getLogger("tfamp")


class _TfampScaling:
    """tfamp's loss scaling on a tf_keras loss-scale optimizer class (see the
    module docstring): its own scale state, the start-scale probe's pass-through,
    the skip record, and what every scale owner answers (scale_state.py)."""

    def __init__(self, inner_optimizer, loss_scale="dynamic", *,
                 initial_scale: float = DEFAULT_INITIAL_SCALE,
                 growth_interval: int = DEFAULT_GROWTH_INTERVAL,
                 min_scale: float = DEFAULT_MIN_SCALE):
        dynamic, start = validate_settings(loss_scale, initial_scale, growth_interval,
                                           min_scale)
        # The parent's fixed mode creates no state; tfamp's own state replaces it.
        super().__init__(inner_optimizer, dynamic=False, initial_scale=start)
        self._loss_scale = ScaleState(
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
    def is_dynamic(self) -> bool:
        return self._loss_scale.is_dynamic

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
        if step_scope.current_probe() is not None:  # the start-scale probe measures true sizes
            return loss
        with loss_scale_ops():
            scaled = super().get_scaled_loss(loss)
        mark_scaled(scaled)  # scaled by hand: tfamp's custom-loop tape hook leaves it alone
        step_scope.note_scaled_loss()
        return scaled

    def get_unscaled_gradients(self, grads):
        if step_scope.current_probe() is not None:
            return grads
        with loss_scale_ops():
            return super().get_unscaled_gradients(grads)

    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        if step_scope.current_probe() is not None:
            return step_scope.probe_apply_result(self)
        pending = step_scope.take_pending()
        process = step_scope.take_process_owner(self) if pending is None else None
        if process is not None:  # a TFAMP_ENABLE custom loop's tape scaled them
            self._loss_has_been_scaled = self._gradients_have_been_unscaled = True
            step_scope.note_update(process, scaled=True)
            return apply_gradients_if_finite(
                self.inner_optimizer, _inner_apply_gradients, grads_and_vars, args, kwargs,
                process.update_from_flags, skipped_steps=process.skipped_steps)
        if pending is not None:
            # tfamp's tape hook scaled and unscaled (a custom loop); this optimizer
            # checks finiteness itself. Keeps tf_keras's "you forgot" warning quiet.
            self._loss_has_been_scaled = self._gradients_have_been_unscaled = True
        step_scope.note_update(
            pending, scaled=pending is not None or step_scope.take_scaled_loss())
        grads_and_vars = list(grads_and_vars)
        # Same filter the parent applies before the finiteness check, so index i
        # of the recorded flags names variable i here.
        self._variable_names = [v.name for g, v in grads_and_vars if g is not None]
        return super().apply_gradients(grads_and_vars, *args, **kwargs)

    # -- what every scale owner answers (scale_state.py) ---------------------

    def scale_tensor(self) -> tf.Tensor:
        return tf.convert_to_tensor(self._loss_scale.current_loss_scale)

    def update_from_flags(self, flags, *, count_skipped: bool = True):
        return self._loss_scale.update_from_flags(flags, count_skipped=count_skipped)

    def set_scale(self, value: float) -> None:
        self._loss_scale.current_loss_scale.assign(value)

    def has_stepped(self) -> bool:
        state = self._loss_scale
        return scale_has_run(state.current_loss_scale, state.initial_loss_scale,
                             state.counter, state.skipped_steps)

    def ensure_built(self, variables) -> None:  # the scale state exists from the start
        del variables

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


class LossScaleOptimizer(_TfampScaling, keras_lso.LossScaleOptimizerV3):
    """Wraps a tf_keras optimizer with loss scaling (see the module docstring).

    Args:
      inner_optimizer: a tf_keras optimizer (e.g. ``keras.optimizers.Adam()``); a
        legacy one (``keras.optimizers.legacy.Adam()``) gives a
        ``LegacyLossScaleOptimizer``, which behaves the same.
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

    def __new__(cls, inner_optimizer=None, *args, **kwargs):
        # As tf_keras's own LossScaleOptimizer: the class that fits the inner one.
        fits = loss_scale_optimizer_class(inner_optimizer)
        if cls is LossScaleOptimizer and fits is not cls:
            return fits(inner_optimizer, *args, **kwargs)
        return super().__new__(cls)


class LegacyLossScaleOptimizer(_TfampScaling, keras_lso.LossScaleOptimizer):
    """``LossScaleOptimizer`` for tf_keras's legacy optimizers
    (``keras.optimizers.legacy.*``): same arguments, same behaviour."""

    _keras_api_names = ("keras.mixed_precision.LossScaleOptimizer",)
    _keras_api_names_v1 = ("keras.mixed_precision.LossScaleOptimizer",)


def _inner_apply_gradients(inner, grads_and_vars, *args, **kwargs):
    return inner.apply_gradients(grads_and_vars, *args, **kwargs)


def loss_scale_optimizer_class(inner_optimizer) -> type:
    """tfamp's class for wrapping `inner_optimizer` (legacy or not)."""
    if isinstance(inner_optimizer, OptimizerV2):
        return LegacyLossScaleOptimizer
    return LossScaleOptimizer


# Legacy SavedModel metadata names an optimizer by get_registered_name(its class).
# Give tfamp's classes tf_keras's own names so such a file loads without tfamp, as
# tf_keras's LossScaleOptimizerV3 and LossScaleOptimizer (same config keys, same
# checkpoint layout).
object_registration._GLOBAL_CUSTOM_NAMES[LossScaleOptimizer] = "LossScaleOptimizerV3"
object_registration._GLOBAL_CUSTOM_NAMES[LegacyLossScaleOptimizer] = "LossScaleOptimizer"
