"""``tfamp.enable(model)`` / ``tfamp.disable(model)`` for tf_keras and Keras 3 models.

A Keras 3 model (``import keras`` / ``tf.keras``, TensorFlow backend) is handed
to ``tfamp.keras.keras3``, which installs the same kind of hooks with Keras 3's
names and tfamp's Keras 3 loss-scale optimizer. What follows is the tf_keras path.

Enabling installs per-instance hooks (nothing on the class, so other models and
saved files are unaffected): ``make_train_function``, ``make_test_function`` and
``make_predict_function`` wrap the tf.functions Keras builds in tfamp's
``RewrittenFunction``; ``train_step`` runs in the model's step scope (every loss
scaled once by the model's scale, an overridden step included) and adds
``loss_scale`` and ``skipped_steps`` to the logs (so they reach History and
TensorBoard); ``compile`` wraps the optimizer it is given; ``call`` runs the model rewritten, with loss scaling, inside
the user's own tf.function (``tfamp.keras.custom_loop``). Disabling removes the
hooks and unwraps the optimizer.
"""

from __future__ import annotations

import logging

import tensorflow as tf
import tf_keras as keras

from tfamp.config import AmpConfig
from tfamp.keras import hooks
from tfamp.keras.loss_scale import (
    DEFAULT_GROWTH_INTERVAL,
    DEFAULT_INITIAL_SCALE,
    DEFAULT_MIN_SCALE,
    LossScaleOptimizer,
    validate_settings,
)
from tfamp.keras.state import EnabledState
from tfamp.runtime import log_lines
from tfamp.runtime.runner import RewrittenFunction

log = logging.getLogger("tfamp")

class _EnabledState(EnabledState):
    """tf_keras: tfamp's LossScaleOptimizer around a tf_keras optimizer."""

    tfamp_optimizer = LossScaleOptimizer
    keras_loss_scale_optimizer = keras.mixed_precision.LossScaleOptimizer
    optimizer_base = keras.optimizers.Optimizer
    keras_name = "tf_keras"


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
    keras3 = _check_model(model)
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
    ranges = _check_ranges(ranges)
    if keras3 is not None:
        keras3.enable(model, keras3.Keras3State(
            config, loss_scale, initial_scale, growth_interval, min_scale, check,
            ranges=ranges, auto_start=auto_start))
        log.info("tfamp: enabled %s on Keras 3 model %r (loss scale: %s)", config.dtype,
                 model.name, loss_scale)
        return model
    _check_no_other_mixed_precision(model)
    state = _EnabledState(config, loss_scale, initial_scale, growth_interval, min_scale, check,
                          ranges=ranges, auto_start=auto_start)
    if getattr(model, "_tfamp_state", None) is not None:
        disable(model)
    _install_hooks(model, state)
    if getattr(model, "optimizer", None) is not None:
        model.optimizer = state.wrap_optimizer(model.optimizer)
    hooks.reset_functions(model)
    log.info("tfamp: enabled %s on model %r (loss scale: %s)", config.dtype, model.name,
             loss_scale)
    return model


def disable(model):
    """Restores float32 training for a model `enable` was called on.

    Returns:
      `model` itself. A model tfamp never enabled is returned unchanged.
    """
    keras3 = _check_model(model)
    if keras3 is not None:
        return keras3.disable(model)
    if getattr(model, "_tfamp_state", None) is None:
        return model
    hooks.uninstall(model)
    optimizer = getattr(model, "optimizer", None)
    if isinstance(optimizer, LossScaleOptimizer):
        inner = optimizer.inner_optimizer
        inner._is_wrapped_by_loss_scale_optimizer = False
        model.optimizer = inner
    object.__setattr__(model, "_tfamp_state", None)
    hooks.reset_functions(model)
    return model


def is_enabled(model) -> bool:
    """True if `tfamp.enable` is in force on `model`."""
    return getattr(model, "_tfamp_state", None) is not None


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
    """Returns None for a tf_keras model, the Keras 3 hooks module for a Keras 3 one."""
    if isinstance(model, keras.Model):
        return None
    keras3 = _keras3_module()
    if keras3 is not None and keras3.is_keras3_model(model):
        return keras3
    kind = f"{type(model).__module__}.{type(model).__name__}"
    raise TypeError(
        f"tfamp.enable expects a Keras model: a Keras 3 keras.Model (import keras, or "
        f"tf.keras) or a tf_keras.Model (import tf_keras); received {kind}. For a "
        f"training loop without a Keras model, use @tfamp.function on the step, or run "
        f"the script with TFAMP_ENABLE=1.")


def _keras3_module():
    """tfamp's Keras 3 module (``tfamp.keras.keras3``) when Keras 3 is installed."""
    from tfamp.keras.flavour import keras3_module

    if keras3_module() is None:
        return None
    from tfamp.keras import keras3 as hooks

    return hooks


def mixed_policy_name(model) -> str | None:
    """The Keras mixed policy (e.g. "mixed_float16") some layer of `model` runs, or None.

    Works for tf_keras and Keras 3 models: both give every layer a
    ``dtype_policy`` whose name starts with "mixed_" under a mixed policy.
    """
    flatten = getattr(model, "_flatten_layers", None)
    layers = list(flatten(include_self=True)) if callable(flatten) else [model]
    for layer in layers:
        name = getattr(getattr(layer, "dtype_policy", None), "name", None)
        if isinstance(name, str) and name.startswith("mixed_"):
            return name
    return None


def _check_ranges(ranges):
    if ranges is None or ranges is False:
        return None
    if ranges is True or (isinstance(ranges, str) and ranges) or hasattr(ranges, "__fspath__"):
        return ranges
    raise TypeError(f"ranges must be None, True or an output directory, received {ranges!r}")


def _check_no_other_mixed_precision(model) -> None:
    policy = keras.mixed_precision.global_policy().name
    mixed = mixed_policy_name(model)
    if policy.startswith("mixed_") or mixed:
        name = policy if policy.startswith("mixed_") else mixed
        raise ValueError(
            f"a Keras {name!r} policy is in force and so is tfamp: they would both "
            f"convert the model. Use one: for tfamp, call "
            f"keras.mixed_precision.set_global_policy('float32') before building the "
            f"model; or keep the Keras policy and do not call tfamp.enable.")
    if tf.config.optimizer.get_experimental_options().get("auto_mixed_precision"):
        raise ValueError(
            "TensorFlow's own auto_mixed_precision graph rewrite is on "
            "(tf.config.optimizer.set_experimental_options) and so is tfamp: they would "
            "both convert the graph. Turn TensorFlow's off with "
            "tf.config.optimizer.set_experimental_options({'auto_mixed_precision': "
            "False}), or do not call tfamp.enable.")


def _install_hooks(model, state: _EnabledState) -> None:
    cls = type(model)
    object.__setattr__(model, "_tfamp_state", state)

    def compile(*args, **kwargs):  # noqa: A001  (mirrors Model.compile)
        result = cls.compile(model, *args, **kwargs)
        model.optimizer = state.wrap_optimizer(model.optimizer)
        return result

    def hooked_maker(attr: str, maker_name: str, after_call=None):
        def make(force=False):
            if attr == "train_function":
                hooks.ensure_step_counters(model, state)
            made = getattr(cls, maker_name)(model, force)
            current = model.__dict__.get(attr, made)
            # RewrittenFunction first: it is a tf.function (PolymorphicFunction) too.
            if isinstance(current, RewrittenFunction):
                # Built by TFAMP_ENABLE's tf.function: the model's own settings rule
                # (they differ after a float32 fallback, keras/fallback.py).
                if current.config is not state.config:
                    current = current.with_config(state.config)
                    object.__setattr__(model, attr, current)
                if after_call is not None:
                    current.set_after_call(after_call)
                return current
            if isinstance(current, tf.types.experimental.PolymorphicFunction):
                wrapped = RewrittenFunction(current, state.config, check=state.check,
                                            after_call=after_call)
                object.__setattr__(model, attr, wrapped)
                return wrapped
            if current is not None:
                log.warning("tfamp: %s runs eagerly (run_eagerly=True), so there is no "
                            "graph to rewrite; it stays float32.", attr)
            return current
        return make

    hooks.install(model, cls, state, LossScaleOptimizer, compile=compile,
                  hooked_maker=hooked_maker, metrics_method="_validate_and_get_metrics_result",
                  replicated_logs=True)
