"""The per-model method hooks an enabled model gets, alike for both Kerases.

``tfamp.enable`` sets instance attributes over a model's own methods (its class
is left alone). What differs between tf_keras (``activation.py``) and Keras 3
(``keras3.py``) is how a step function is built and how the loss scale is read;
the hooks below take those as arguments.
"""

from __future__ import annotations

from collections.abc import Callable

# Keys tfamp adds to the logs of an enabled model's train step.
LOG_KEYS = ("loss_scale", "skipped_steps")
# The step functions Keras builds lazily and caches on the model.
FUNCTION_ATTRS = ("train_function", "test_function", "predict_function")


def fit_hook(model, cls, state):
    """``fit`` that keeps one batch for the stuck-at-floor diagnosis and adds the
    RangeMonitor when ranges were asked for."""

    def fit(*args, **kwargs):
        from tfamp.keras.range_monitor import prepare_fit

        args, kwargs = prepare_fit(model, state.ranges, args, kwargs)
        return cls.fit(model, *args, **kwargs)

    return fit


def metrics_result_hook(model, base: Callable, read_scale: Callable):
    """Keras's epoch-end metrics re-read, with tfamp's log keys set aside.

    Keras re-reads its metrics at epoch end (right under tf.distribute) only
    when the log keys are exactly its metric names: set tfamp's keys aside, let
    it, then read tfamp's values from the optimizer itself.

    Args:
      model: the enabled model.
      base: the class's method (``_validate_and_get_metrics_result`` in
        tf_keras, ``_get_metrics_result_or_logs`` in Keras 3), unbound.
      read_scale: optimizer -> (loss scale, skipped steps) as Python numbers,
        or None when the optimizer scales nothing.
    """

    def metrics_result(logs):
        if not (isinstance(logs, dict) and any(k in logs for k in LOG_KEYS)):
            return base(model, logs)
        result = base(model, {k: v for k, v in logs.items() if k not in LOG_KEYS})
        scale = read_scale(model.optimizer)
        if isinstance(result, dict) and scale is not None:
            result = dict(result)
            result["loss_scale"], result["skipped_steps"] = scale
        return result

    return metrics_result


def after_train_hook(model, lso_cls):
    """After each train call: warn (naming the op) when the scale is stuck at its floor."""

    def after_train_call(_outputs):
        optimizer = model.optimizer
        if isinstance(optimizer, lso_cls):
            optimizer.check_stuck(diagnose=lambda: _diagnose(model))

    return after_train_call


def _diagnose(model):
    from tfamp.inspect.nonfinite import diagnose_keras_model

    return diagnose_keras_model(model)


def install(model, cls, state, lso_cls, *, compile: Callable,  # noqa: A002
            train_step: Callable, hooked_maker: Callable, metrics_method: str,
            read_scale: Callable) -> None:
    """Sets every hook on `model`: the flavour's own `compile`, `train_step` and
    step-function maker, the shared ones above, and the custom-loop ``call``.

    Args:
      model: the model; `cls` its class, whose methods the hooks call.
      state: its EnabledState.
      lso_cls: the flavour's LossScaleOptimizer class.
      compile: ``compile`` that wraps the optimizer.
      train_step: ``train_step`` that adds tfamp's log keys.
      hooked_maker: (attr, maker name, after_call=None) -> the
        ``make_*_function`` hook.
      metrics_method: the name of Keras's epoch-end metrics method.
      read_scale: see ``metrics_result_hook``.
    """
    from tfamp.keras import custom_loop

    hooks = {
        "call": custom_loop.call_hook(model, cls.call, state, lso_cls),
        "compile": compile,
        "fit": fit_hook(model, cls, state),
        "train_step": train_step,
        metrics_method: metrics_result_hook(model, getattr(cls, metrics_method), read_scale),
        "make_train_function": hooked_maker(
            "train_function", "make_train_function", after_train_hook(model, lso_cls)),
        "make_test_function": hooked_maker("test_function", "make_test_function"),
        "make_predict_function": hooked_maker("predict_function", "make_predict_function"),
    }
    for name, hook in hooks.items():
        object.__setattr__(model, name, hook)
    object.__setattr__(model, "_tfamp_hooks", tuple(hooks))


def uninstall(model) -> None:
    """Removes every hook ``install`` set, so the class's own methods show again."""
    for name in model.__dict__.pop("_tfamp_hooks", ()):
        model.__dict__.pop(name, None)


def reset_functions(model) -> None:
    """Drops the step functions Keras cached, so the next call builds them anew."""
    for attr in FUNCTION_ATTRS:
        if hasattr(model, attr):
            object.__setattr__(model, attr, None)
