"""What ``tfamp.enable`` was asked for on one model, for tf_keras and Keras 3 alike."""

from __future__ import annotations

import dataclasses

from tfamp.config import AmpConfig


@dataclasses.dataclass
class EnabledState:
    """The settings of one enabled model, and how its optimizer gets loss scaling.

    A flavour subclass names, as class attributes (not fields), tfamp's
    loss-scale optimizer class, Keras's own, the optimizer base class and the
    Keras's name for messages.
    """

    config: AmpConfig
    loss_scale: object  # "dynamic", a number, or None
    initial_scale: float
    growth_interval: int
    min_scale: float
    check: bool
    ranges: object = None  # None, True, or an output directory for RangeMonitor
    loop: object = None  # custom_loop.ModelLoop, set when the hooks are installed
    warned_unscaled: bool = False  # the step applied gradients tfamp could not scale
    auto_start: bool = False  # initial_scale="auto": the first fit probes the gradients
    start_scale: object = None  # start_scale.StartScale once probed; False: not probed
    fallback: object = None  # fallback.FallbackState: layers moved to float32 on overflow
    nonfinite_skips: object = None  # step_metrics.counter_variable, made before a train fn
    epoch_skipped_at: object = None  # skipped steps at the training epoch's start

    tfamp_optimizer = None  # set by each flavour
    keras_loss_scale_optimizer = None
    optimizer_base = None
    keras_name = ""

    def wrap_optimizer(self, optimizer):
        """`optimizer` wrapped in tfamp's loss-scale optimizer (unchanged if no scaling)."""
        if self.loss_scale is None or optimizer is None:
            return optimizer
        if isinstance(optimizer, self.tfamp_optimizer):
            return optimizer
        if isinstance(optimizer, self.keras_loss_scale_optimizer):
            raise ValueError(
                "the model's optimizer is already a Keras LossScaleOptimizer; tfamp wraps "
                "the optimizer itself. Compile with the inner optimizer "
                "(optimizer.inner_optimizer), or pass loss_scale=None to tfamp.enable.")
        if not isinstance(optimizer, self.optimizer_base):
            raise TypeError(
                f"tfamp loss scaling needs a {self.keras_name} optimizer "
                f"(keras.optimizers.*), the model has {type(optimizer).__name__}; compile "
                f"with e.g. keras.optimizers.Adam(), or pass loss_scale=None.")
        return self.tfamp_optimizer(
            optimizer, self.loss_scale, initial_scale=self.initial_scale,
            growth_interval=self.growth_interval, min_scale=self.min_scale)
