"""The per-model method hooks an enabled model gets, alike for both Kerases.

``tfamp.enable`` sets instance attributes over a model's own methods (its class
is left alone). What differs between tf_keras (``activation.py``) and Keras 3
(``keras3.py``) is how a step function is built and how ``compile`` wraps the
optimizer; the hooks below take those as arguments.

``train_step`` is one hook for both: Keras's own step or an overridden one
(a GAN's two optimizers, a VAE's sum-reduced loss) runs in the model's step
scope (``custom_loop.train_step_scope``), so every loss it differentiates is
scaled by the model's one scale and every update checks and updates that scale.
The logs get ``loss_scale`` / ``skipped_steps`` of the scale the step applied,
and none when it applied none. A skipped step is left out of the epoch's
metrics (``step_metrics.py``).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable

from tfamp.keras import fallback

log = logging.getLogger("tfamp")

# Keys tfamp adds to the logs of an enabled model's train step.
LOG_KEYS = ("loss_scale", "skipped_steps")
# The step functions Keras builds lazily and caches on the model.
FUNCTION_ATTRS = ("train_function", "test_function", "predict_function")


def fit_hook(model, cls, state):
    """``fit`` that keeps one batch for the stuck-at-floor diagnosis, adds the
    RangeMonitor when ranges were asked for, and first sets the start loss scale
    from the gradients of the first batch (``initial_scale="auto"``)."""

    def fit(*args, **kwargs):
        from tfamp.keras.start_scale import before_fit
        from tfamp.numerics.monitor import prepare_fit

        args, kwargs = prepare_fit(model, state.ranges, args, kwargs)
        args, kwargs = fallback.prepare_fit(model, state, args, kwargs)
        before_fit(model, state, args, kwargs)
        return cls.fit(model, *args, **kwargs)

    return fit


def train_step_hook(model, cls, state, *, replicated_logs: bool):
    """``train_step`` in the model's step scope, with tfamp's log keys.

    Args:
      replicated_logs: read the scale once for all replicas (tf_keras sums
        per-replica logs under a strategy).
    """
    from tfamp.keras import custom_loop

    def train_step(data):
        if state.loop is None or state.loss_scale is None:
            return cls.train_step(model, data)
        guard = _step_guard(model, state)
        with custom_loop.train_step_scope(state.loop) as scope:
            logs = cls.train_step(model, data)
        if guard is not None:
            logs = guard.finish(logs)
        if scope.unscaled and not state.warned_unscaled:
            state.warned_unscaled = True
            message = custom_loop.unscaled_message(model)
            log.warning("%s", message)
            warnings.warn(message, UserWarning, stacklevel=custom_loop.user_stacklevel())
        owner = scope.reported_owner()
        if owner is None or not isinstance(logs, dict):
            return logs
        state.loop.step_owner = owner

        def read():
            return custom_loop.scale_values(owner)

        scale, skipped = _read_once(read) if replicated_logs else read()
        logs = dict(logs)
        logs["loss_scale"], logs["skipped_steps"] = scale, skipped
        return logs

    return train_step


def _step_guard(model, state):
    """The skipped-step guard of this trace (None when the scale has no skip counter)."""
    import tensorflow as tf

    from tfamp.keras import custom_loop
    from tfamp.keras.step_metrics import StepGuard

    if tf.executing_eagerly():
        return None
    owner = state.loop.scale_owner()
    if owner is None:
        return None
    custom_loop._build_if_needed(owner, model)
    skipped = getattr(owner, "skipped_steps", None)
    if skipped is None:
        return None
    return StepGuard(model, skipped, state.nonfinite_skips)


def ensure_step_counters(model, state) -> None:
    """Makes the model's count of skipped steps with inf/nan logs (before a train
    function is built, outside any trace, in the model's strategy scope)."""
    if state.nonfinite_skips is not None or state.loss_scale is None:
        return
    import tensorflow as tf

    from tfamp.keras.step_metrics import counter_variable

    strategy = getattr(model, "distribute_strategy", None) or tf.distribute.get_strategy()
    state.nonfinite_skips = counter_variable(strategy)


def _read_once(read):
    """`read()` once for all replicas, so Keras's per-replica sum does not multiply it."""
    import tensorflow as tf

    if not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context():
        return read()
    return tf.distribute.get_replica_context().merge_call(lambda _: read())


def read_scale(state) -> tuple[float, int] | None:
    """(loss scale, skipped steps) the model's train step applies, as Python numbers.

    None until a step applied a scale (or when it applies none).
    """
    owner = getattr(state.loop, "step_owner", None) if state.loop is not None else None
    if owner is None:
        return None
    from tfamp.keras import custom_loop

    scale, skipped = custom_loop.scale_values(owner)
    return float(scale.numpy()), int(skipped.numpy())


def metrics_result_hook(model, base: Callable, read_scale: Callable):
    """Keras's epoch-end metrics re-read, with tfamp's log keys set aside.

    Keras re-reads its metrics at epoch end (right under tf.distribute) only
    when the log keys are exactly its metric names: set tfamp's keys aside, let
    it, then read tfamp's values from the optimizer itself.

    Args:
      model: the enabled model.
      base: the class's method (``_validate_and_get_metrics_result`` in
        tf_keras, ``_get_metrics_result_or_logs`` in Keras 3), unbound.
      read_scale: () -> (loss scale, skipped steps) as Python numbers, or None
        when the step applies no scale.
    """

    def metrics_result(logs):
        if not (isinstance(logs, dict) and any(k in logs for k in LOG_KEYS)):
            return base(model, logs)
        result = base(model, {k: v for k, v in logs.items() if k not in LOG_KEYS})
        scale = read_scale()
        if isinstance(result, dict) and scale is not None:
            result = dict(result)
            result["loss_scale"], result["skipped_steps"] = scale
            result = _epoch_end(model, result, scale[1])
        return result

    return metrics_result


def _epoch_end(model, result: dict, skipped: int) -> dict:
    """NaN for the metrics an epoch whose steps were all skipped left empty."""
    state = getattr(model, "_tfamp_state", None)
    mark = getattr(state, "epoch_skipped_at", None)
    if mark is None:
        return result
    state.epoch_skipped_at = None  # the training epoch's read; evaluate's come after
    if skipped <= mark:
        return result
    from tfamp.keras.step_metrics import epoch_results

    return epoch_results(model, result)


def mark_epoch_start(model, state) -> None:
    """Remembers the skipped-step count at an epoch's start (for ``_epoch_end``)."""
    scale = read_scale(state)
    state.epoch_skipped_at = scale[1] if scale is not None else 0


def after_train_hook(model, state):
    """After each train call: move an op that overflows float16 to float32
    (``fallback.py``), else warn (naming the op) when the scale is stuck at its floor."""

    def after_train_call(outputs):
        owner = getattr(state.loop, "step_owner", None) if state.loop is not None else None
        if owner is not None and fallback.after_train_call(model, state, owner, outputs):
            return  # the next step runs the new graph: the stuck check waits for it
        check = getattr(owner, "check_stuck", None)
        if check is not None:
            check(diagnose=lambda: fallback.known_cause(state) or _diagnose(model))

    return after_train_call


def _diagnose(model):
    from tfamp.numerics.nonfinite import diagnose_keras_model

    return diagnose_keras_model(model)


def install(model, cls, state, lso_cls, *, compile: Callable,  # noqa: A002
            hooked_maker: Callable, metrics_method: str, replicated_logs: bool) -> None:
    """Sets every hook on `model`: the flavour's own `compile` and step-function
    maker, the shared ones above, and the custom-loop ``call``.

    Args:
      model: the model; `cls` its class, whose methods the hooks call.
      state: its EnabledState.
      lso_cls: the flavour's LossScaleOptimizer class.
      compile: ``compile`` that wraps the optimizer.
      hooked_maker: (attr, maker name, after_call=None) -> the
        ``make_*_function`` hook.
      metrics_method: the name of Keras's epoch-end metrics method.
      replicated_logs: see ``train_step_hook``.
    """
    from tfamp.keras import custom_loop

    hooks = {
        "call": custom_loop.call_hook(model, cls.call, state, lso_cls),
        "compile": compile,
        "fit": fit_hook(model, cls, state),
        "train_step": train_step_hook(model, cls, state, replicated_logs=replicated_logs),
        metrics_method: metrics_result_hook(model, getattr(cls, metrics_method),
                                            lambda: read_scale(state)),
        "make_train_function": hooked_maker(
            "train_function", "make_train_function", after_train_hook(model, state)),
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
