"""``tfamp.enable(model)`` / ``tfamp.disable(model)``: the public entry to the lifecycle.

``enable`` validates its arguments, then hands the model to one
``lifecycle.ModelPrecision`` (tf_keras and Keras 3 alike: the few facts where
they differ are ``flavour.py``'s), which installs per-instance hooks (nothing on
the class, so other models and saved files are unaffected) and wraps the
optimizer. ``enable_for_compile`` is the small entry the ``TFAMP_ENABLE``
start-up hook uses when a script compiles a model.
"""

from __future__ import annotations

import logging

from tfamp.config import AmpConfig
from tfamp.keras.flavour import flavour_of, mixed_policy_of_layers
from tfamp.keras.lifecycle import ModelPrecision, Settings
from tfamp.keras.scale_state import (
    DEFAULT_GROWTH_INTERVAL,
    DEFAULT_INITIAL_SCALE,
    DEFAULT_MIN_SCALE,
    validate_settings,
)
from tfamp.runtime import log_lines

log = logging.getLogger("tfamp")


def enable(model, *, dtype: str = "float16", loss_scale="default",
           initial_scale: float | str = "auto",
           growth_interval: int = DEFAULT_GROWTH_INTERVAL,
           min_scale: float = DEFAULT_MIN_SCALE,
           config: AmpConfig | None = None, check: bool = False,
           verbose: bool | None = None, ranges=None):
    """Turns a Keras model's training and inference into mixed precision.

    Works before or after ``model.compile``. From then on ``fit``, ``evaluate``,
    ``predict``, ``train_on_batch`` and ``predict_on_batch`` run tfamp-rewritten
    graphs, and the optimizer is wrapped in a loss-scale optimizer. Calling it
    again is harmless; ``tfamp.disable(model)`` restores float32.

    Args:
      model: a Keras 3 ``keras.Model`` (``tf.keras``; TensorFlow backend) or a
        ``tf_keras.Model``.
      dtype: "float16" or "bfloat16" (ignored when `config` is given).
      loss_scale: "dynamic", a positive number (fixed scale) or None. The
        default is "dynamic" for float16 and None for bfloat16.
      initial_scale: the dynamic scale's start: "auto" (default) sets it from the
        first batch's gradients at the first ``fit`` (one float32 forward and
        backward, nothing applied: ``tfamp.keras.start_scale``), so the first
        steps neither overflow nor flush; a number starts there (2**15 was
        the default before).
      growth_interval, min_scale: dynamic loss-scale settings (2000 good
        steps, floor 1).
      config: a full AmpConfig (op-list changes, keep_fp32, ...).
      check: validate every rewritten graph (slower; for debugging).
      verbose: print one line per rewritten function (the ``tfamp`` logger at
        INFO, to stderr). None (default): yes, unless logging is already
        configured (the ``tfamp`` or the root logger has a handler), in which
        case the lines go wherever that configuration sends them. True:
        always; False: never add tfamp's handler (the lines still reach any
        handler the application set up). Process-wide, like all logging.
      ranges: True or a directory: the next ``fit`` also runs a
        ``tfamp.RangeMonitor`` on its first 3 batches and writes where the
        gradients sit against float16's limits there (ranges.txt / .json /
        .html / .png; True: "tfamp_ranges"). Off (None) by default.

    Returns:
      `model` itself.

    Example:
      >>> model.compile(optimizer="adam", loss="mse")
      >>> tfamp.enable(model)            # float16 with dynamic loss scaling
      >>> model.fit(x, y, epochs=3)      # history has loss_scale, skipped_steps
    """
    flavour = _check_model(model)
    _show_log_lines(verbose)
    config = config or AmpConfig(dtype=dtype)
    if loss_scale == "default":
        loss_scale = "dynamic" if config.dtype == "float16" else None
    if isinstance(initial_scale, str) and initial_scale != "auto":
        raise ValueError(
            f"initial_scale must be 'auto' (from the first batch's gradients) or a "
            f"positive number, received {initial_scale!r}; e.g. initial_scale='auto' or "
            f"initial_scale=2**15.")
    auto_start = initial_scale == "auto"
    if auto_start:
        initial_scale = DEFAULT_INITIAL_SCALE  # until the probe sets it
        auto_start = loss_scale == "dynamic"
    if loss_scale is not None:  # fail now, not at the first fit
        validate_settings(loss_scale, initial_scale, growth_interval, min_scale)
    settings = Settings(config, loss_scale, initial_scale, growth_interval, min_scale,
                        check, ranges=_check_ranges(ranges), auto_start=auto_start)
    ModelPrecision(model, settings).enable()
    log.info("tfamp: enabled %s on %smodel %r (loss scale: %s)", config.dtype,
             "Keras 3 " if flavour.is_keras3 else "", model.name, loss_scale)
    return model


def disable(model):
    """Restores float32 training for a model `enable` was called on.

    Returns:
      `model` itself. A model tfamp never enabled is returned unchanged.
    """
    _check_model(model)
    precision = getattr(model, "_tfamp_state", None)
    if precision is not None:
        precision.disable()
    return model


def is_enabled(model) -> bool:
    """True if `tfamp.enable` is in force on `model`."""
    return getattr(model, "_tfamp_state", None) is not None


def enable_for_compile(model, *, config: AmpConfig, loss_scale, initial_scale, ranges) -> None:
    """What ``TFAMP_ENABLE`` does when a script compiles a model (either Keras).

    A model that runs a Keras mixed policy is left to Keras (the start-up hook
    says so when it builds its functions); a model compiled with Keras's own
    ``LossScaleOptimizer`` keeps it (its graphs are rewritten, its loss scaling
    stays Keras's: one line says so); any other is enabled once (a tf_keras
    legacy optimizer too: tfamp has a loss-scale optimizer for those).
    """
    if is_enabled(model) or mixed_policy_name(model) is not None:
        return
    flavour = flavour_of(model)
    optimizer = getattr(model, "optimizer", None)
    keras_lso = (isinstance(optimizer, flavour.keras_loss_scale_optimizer)
                 and not type(optimizer).__module__.startswith("tfamp."))
    if keras_lso or flavour.mixed_policy(model) is not None:
        # Keras's own loss scaling (the user's, or restored by load_model from a
        # SavedModel), or its global mixed policy.
        log.info("tfamp: model %r uses Keras's own %s: tfamp rewrites its graphs and leaves "
                 "loss scaling to Keras.", model.name,
                 "LossScaleOptimizer" if keras_lso else "mixed policy")
        return
    enable(model, config=config, loss_scale=loss_scale, ranges=ranges,
           initial_scale=initial_scale)


def mixed_policy_name(model) -> str | None:
    """The Keras mixed policy (e.g. "mixed_float16") some layer of `model` runs, or None."""
    return mixed_policy_of_layers(model)


def _show_log_lines(verbose: bool | None) -> None:
    """Gives the ``tfamp`` logger a stderr handler at INFO when `verbose` asks for it."""
    if verbose is False:
        return
    if log_lines.shown():
        return  # already shown (an earlier enable, or TFAMP_ENABLE with its verbosity)
    if verbose is None and (log.handlers or logging.getLogger().handlers):
        return  # the application configured logging: respect it
    log_lines.show()
    if log.level == logging.NOTSET or (verbose and log.level > logging.INFO):
        log.setLevel(logging.INFO)  # an explicit quieter level is kept unless verbose=True


def _check_model(model):
    """The model's flavour; a TypeError naming what was received for anything else."""
    try:
        return flavour_of(model)
    except TypeError:
        kind = f"{type(model).__module__}.{type(model).__name__}"
        raise TypeError(
            f"tfamp.enable expects a Keras model: a Keras 3 keras.Model (import keras, or "
            f"tf.keras) or a tf_keras.Model (import tf_keras); received {kind}. For a "
            f"training loop without a Keras model, use @tfamp.function on the step, or run "
            f"the script with TFAMP_ENABLE=1.") from None


def _check_ranges(ranges):
    if ranges is None or ranges is False:
        return None
    if ranges is True or (isinstance(ranges, str) and ranges) or hasattr(ranges, "__fspath__"):
        return ranges
    raise TypeError(f"ranges must be None, True or an output directory, received {ranges!r}")
