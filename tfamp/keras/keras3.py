"""``tfamp.enable(model)`` / ``tfamp.disable(model)`` for Keras 3 models (TensorFlow backend).

Same design as the tf_keras hooks (``tfamp.keras.activation``): everything is
per instance. Keras 3's ``TensorFlowTrainer.make_train_function`` (and test,
predict) builds a Python ``train_function`` around two tf.functions: the step
(``one_step_on_data``) and a loop over it (``multi_step_on_iterator``). While
Keras builds them, tfamp hands the trainer module a ``tf.function`` that wraps
the *first* function built, the step, in ``RewrittenFunction``; the loop stays
a plain tf.function that calls the rewritten step (so it is not coloured
again). ``call`` runs the model rewritten, with loss scaling, inside the user's own
tf.function (``tfamp.keras.custom_loop``). ``train_step`` is the hook both Kerases
share (``tfamp.keras.hooks.train_step_hook``): the model's step scope scales an
overridden ``train_step`` that never calls ``scale_loss`` too, once; ``compile``
wraps the optimizer in tfamp's Keras 3 ``LossScaleOptimizer``.
"""

from __future__ import annotations

import functools
import logging
import threading

import keras
import tensorflow as tf
from keras.src.backend.tensorflow import trainer as trainer_module

from tfamp.keras import hooks
from tfamp.keras.loss_scale3 import INNER_MARK, LossScaleOptimizer
from tfamp.keras.state import EnabledState
from tfamp.runtime.runner import RewrittenFunction

log = logging.getLogger("tfamp")

def is_keras3_model(model) -> bool:
    """True if `model` is a Keras 3 ``keras.Model`` (any backend)."""
    return isinstance(model, keras.Model)


class Keras3State(EnabledState):
    """What ``tfamp.enable`` was asked for on one Keras 3 model."""

    tfamp_optimizer = LossScaleOptimizer
    keras_loss_scale_optimizer = keras.optimizers.LossScaleOptimizer
    optimizer_base = keras.optimizers.Optimizer
    keras_name = "Keras 3"


def check_backend() -> None:
    """Raises unless Keras 3 runs on TensorFlow (tfamp rewrites TensorFlow graphs)."""
    backend = keras.backend.backend()
    if backend != "tensorflow":
        raise ValueError(
            f"tfamp rewrites TensorFlow graphs, but Keras 3 is running on the "
            f"{backend!r} backend (KERAS_BACKEND={backend}), so there is no TensorFlow "
            f"graph to rewrite. Set KERAS_BACKEND=tensorflow before importing keras, or "
            f"use that backend's own mixed precision "
            f"(keras.mixed_precision.set_global_policy('mixed_float16')).")


def check_no_other_mixed_precision(model) -> None:
    """Raises if a Keras mixed policy is in force on `model` (both would convert it)."""
    policy = keras.config.dtype_policy().name
    mixed = sorted({layer.dtype_policy.name for layer in model._flatten_layers()
                    if getattr(layer, "dtype_policy", None) is not None
                    and layer.dtype_policy.name.startswith("mixed_")})
    if policy.startswith("mixed_") or mixed:
        name = policy if policy.startswith("mixed_") else mixed[0]
        raise ValueError(
            f"a Keras {name!r} policy is in force and so is tfamp: they would both "
            f"convert the model. Use one: for tfamp, call "
            f"keras.config.set_dtype_policy('float32') before building the model; or "
            f"keep the Keras policy and do not call tfamp.enable.")


def uses_keras_mixed_precision(model) -> bool:
    """True if `model` already has Keras's own mixed precision (policy or LossScaleOptimizer)."""
    optimizer = getattr(model, "optimizer", None)
    if (isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
            and not isinstance(optimizer, LossScaleOptimizer)):
        return True
    try:
        check_no_other_mixed_precision(model)
    except ValueError:
        return True
    return False


def enable(model, state: Keras3State):
    """Installs tfamp's hooks on a Keras 3 model (called by ``tfamp.enable``)."""
    check_backend()
    check_no_other_mixed_precision(model)
    if getattr(model, "_tfamp_state", None) is not None:
        disable(model)
    _install_hooks(model, state)
    if getattr(model, "optimizer", None) is not None:
        model.optimizer = _wrapped(model, state)
    hooks.reset_functions(model)
    return model


def _wrapped(model, state: Keras3State):
    """The model's optimizer wrapped for loss scaling, built if the model is.

    Created and built in the model's tf.distribute scope (as if ``enable`` had
    been called inside ``strategy.scope()``), and built now, as Keras's loader
    builds the optimizer it compiles, so that ``load_weights`` right after
    ``enable`` finds every variable to restore.
    """
    strategy = getattr(model, "distribute_strategy", None) or tf.distribute.get_strategy()
    with strategy.scope():
        optimizer = state.wrap_optimizer(model.optimizer)
        if (isinstance(optimizer, LossScaleOptimizer) and not optimizer.built
                and model.built and model.trainable_variables):
            optimizer.build(model.trainable_variables)
    return optimizer


def disable(model):
    """Removes tfamp's hooks from a Keras 3 model and unwraps its optimizer."""
    if getattr(model, "_tfamp_state", None) is None:
        return model
    hooks.uninstall(model)
    optimizer = getattr(model, "optimizer", None)
    if isinstance(optimizer, LossScaleOptimizer):
        inner = optimizer.inner_optimizer
        inner.__dict__.pop(INNER_MARK, None)
        model.optimizer = inner
    object.__setattr__(model, "_tfamp_state", None)
    hooks.reset_functions(model)
    return model


class StepFunctions:
    """Keras 3's Python ``train_function`` (or test, predict) with tfamp's parts.

    Calls through to Keras's function; ``rewritten`` holds the
    ``RewrittenFunction`` for the step, whose ``reports`` say what was converted.
    """

    def __init__(self, keras_function, rewritten: list[RewrittenFunction], after_call=None):
        self._keras_function = keras_function
        self.rewritten = rewritten
        self._after_call = after_call
        functools.update_wrapper(self, keras_function, updated=())

    @property
    def reports(self):
        return [report for fn in self.rewritten for report in fn.reports]

    def __call__(self, *args, **kwargs):
        outputs = self._keras_function(*args, **kwargs)
        if self._after_call is not None:
            self._after_call(outputs)
        return outputs


class _TfWithRewrittenStep:
    """Stands in for ``tf`` in Keras's trainer module while it builds its functions.

    ``function`` wraps the first function built (the step) in RewrittenFunction
    and builds the rest (loops calling the step) as plain tf.functions.
    """

    def __init__(self, state: Keras3State):
        self._state = state
        self.rewritten: list[RewrittenFunction] = []

    def __getattr__(self, name):
        return getattr(tf, name)

    def function(self, func=None, **kwargs):
        if func is None:
            return lambda f: self.function(f, **kwargs)
        base = getattr(tf.function, "_tfamp_original", tf.function)
        if isinstance(func, RewrittenFunction):
            return func
        made = base(func, **kwargs)
        if self.rewritten:
            return made
        # Under TFAMP_ENABLE, reports also go where the start-up hook keeps them.
        on_report = getattr(tf.function, "_tfamp_on_report", None)
        wrapped = RewrittenFunction(made, self._state.config, check=self._state.check,
                                    on_report=on_report)
        self.rewritten.append(wrapped)
        return wrapped


_build_lock = threading.Lock()


def _install_hooks(model, state: Keras3State) -> None:
    cls = type(model)
    object.__setattr__(model, "_tfamp_state", state)

    def compile(*args, **kwargs):  # noqa: A001  (mirrors Model.compile)
        result = cls.compile(model, *args, **kwargs)
        model.optimizer = _wrapped(model, state)
        return result

    def hooked_maker(attr: str, maker_name: str, after_call=None):
        def make(force=False):
            current = model.__dict__.get(attr)
            if isinstance(current, StepFunctions) and not force:
                return current
            if attr == "train_function":
                hooks.ensure_step_counters(model, state)
            proxy = _TfWithRewrittenStep(state)
            with _build_lock:
                saved = trainer_module.tf
                trainer_module.tf = proxy
                try:
                    getattr(cls, maker_name)(model, force)
                finally:
                    trainer_module.tf = saved
            made = model.__dict__.get(attr)
            if made is None:
                return None
            if not proxy.rewritten:
                log.warning("tfamp: %s runs eagerly (run_eagerly=True), so there is no "
                            "graph to rewrite; it stays float32.", attr)
                return made
            wrapped = StepFunctions(made, proxy.rewritten, after_call)
            object.__setattr__(model, attr, wrapped)
            return wrapped
        return make

    hooks.install(model, cls, state, LossScaleOptimizer, compile=compile,
                  hooked_maker=hooked_maker, metrics_method="_get_metrics_result_or_logs",
                  replicated_logs=False)


__all__ = ["Keras3State", "LossScaleOptimizer", "StepFunctions", "check_backend",
           "disable", "enable", "is_keras3_model", "uses_keras_mixed_precision"]
