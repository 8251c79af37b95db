"""``TFAMP_ENABLE=1``: mixed precision for scripts that never import tfamp.

Imported by the interpreter start-up hook (``tfamp_startup.pth``) only when
TFAMP_ENABLE is set, and by ``tfamp run``. ``activate()`` validates every
setting first (a bad one stops the script with one line and exit status 2),
then patches, once:

* ``tf.function``: every function the script traces is rewritten by tfamp
  (Keras fit/evaluate/predict and the user's own; tf.data builds its functions
  without the public ``tf.function``, so pipelines are left alone);
* ``Model.compile`` of tf_keras and of Keras 3: the optimizer gets loss scaling
  (tfamp's optimizer for tf_keras, Keras 3's own ``LossScaleOptimizer`` there);
* ``tf.GradientTape.gradient`` and the optimizers' ``apply_gradients``, for
  custom training loops: backprop of a scalar loss is seeded with the loss
  scale, the gradients are unscaled in float32, and a step whose gradients are
  not finite is skipped (weights and slots untouched) while the scale adapts.
  Keras's own train steps are marked so they are not scaled twice.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import re
import sys
import threading
from pathlib import Path

from tfamp.env import EnvError, EnvSettings, settings_from_env

log = logging.getLogger("tfamp")
_LEVELS = {0: logging.WARNING, 1: logging.INFO, 2: logging.DEBUG}


class _Activation:
    """What activate() installed, and what it saw (for the exit notice)."""

    def __init__(self, settings: EnvSettings):
        self.settings = settings
        self.reports = []
        self.report_files = 0
        self.no_tape_scaling = threading.local()
        self.scale_state = None  # created on first use, outside any trace


_active: _Activation | None = None


def activate(environ=None, *, from_startup_hook: bool = False) -> bool:
    """Turns mixed precision on for this process if TFAMP_ENABLE says so.

    Args:
      environ: the environment to read (``os.environ`` if None).
      from_startup_hook: called from ``tfamp_startup.pth``, where an exception
        would abort the interpreter with a fatal-error traceback; exit directly.

    Returns:
      True if tfamp is now active. Exits with status 2 and a one-line message
      when a TFAMP_* setting is invalid, before the script runs.
    """
    global _active
    if _active is not None:
        return True
    try:
        settings = settings_from_env(environ)
    except EnvError as err:
        print(f"tfamp: error: {err}", file=sys.stderr)
        sys.stderr.flush()
        if from_startup_hook:
            os._exit(2)
        raise SystemExit(2) from None
    if not settings.enabled:
        return False
    _configure_logging(settings.verbosity)
    _active = _Activation(settings)
    _patch_tf_function(_active)
    _patch_tf_keras(_active)
    _patch_keras3(_active)
    _patch_custom_loops(_active)
    _note_hardware()
    atexit.register(_exit_notice, _active)
    log.debug("tfamp: active (%s, loss scale %s)", settings.config.dtype, settings.loss_scale)
    return True


def _configure_logging(verbosity: int) -> None:
    log.setLevel(_LEVELS[verbosity])
    if not any(getattr(h, "_tfamp", False) for h in log.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler._tfamp = True
        log.addHandler(handler)
        log.propagate = False


# -- tf.function ----------------------------------------------------------------

def _patch_tf_function(active: _Activation) -> None:
    import tensorflow as tf

    from tfamp.runtime.runner import RewrittenFunction

    original = tf.function
    on_report = functools.partial(_record_report, active)

    @functools.wraps(original)
    def function(func=None, **kwargs):
        if func is None:
            return lambda f: function(f, **kwargs)
        if isinstance(func, RewrittenFunction):
            return func
        return RewrittenFunction(original(func, **kwargs), active.settings.config,
                                 on_report=on_report)

    function._tfamp_original = original
    # tf_keras calls tensorflow.compat.v2.function: patch every public alias.
    import tensorflow.compat.v2 as tf_v2

    for module in (tf, tf_v2):
        if getattr(module, "function", None) is original:
            module.function = function


def _record_report(active: _Activation, report) -> None:
    active.reports.append(report)
    folder = active.settings.report_dir
    if folder is None:
        return
    Path(folder).mkdir(parents=True, exist_ok=True)
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", report.function or "graph")
    active.report_files += 1
    path = Path(folder) / f"{active.report_files:03d}_{safe}.json"
    path.write_text(report.to_json())
    log.debug("tfamp: wrote %s", path)


# -- Keras --------------------------------------------------------------------

def _patch_tf_keras(active: _Activation) -> None:
    try:
        import tf_keras
    except ImportError:
        return
    from tfamp.keras import activation

    model_class = tf_keras.Model
    original = model_class.compile

    @functools.wraps(original)
    def compile(self, *args, **kwargs):  # noqa: A001
        result = original(self, *args, **kwargs)
        if not activation.is_enabled(self):
            activation.enable(self, config=active.settings.config,
                              loss_scale=active.settings.loss_scale,
                              ranges=active.settings.ranges_dir)
        return result

    model_class.compile = compile


def _patch_keras3(active: _Activation) -> None:
    try:
        import keras
        from keras.src.backend.tensorflow import trainer as tf_trainer
    except ImportError:
        return
    if not getattr(keras, "__version__", "0").startswith("3"):
        return
    original_compile = keras.Model.compile

    @functools.wraps(original_compile)
    def compile(self, *args, **kwargs):  # noqa: A001
        result = original_compile(self, *args, **kwargs)
        loss_scale = active.settings.loss_scale
        optimizer = getattr(self, "optimizer", None)
        if (loss_scale is not None and optimizer is not None
                and not isinstance(optimizer, keras.optimizers.LossScaleOptimizer)):
            if loss_scale != "dynamic":
                log.warning("tfamp: Keras 3's LossScaleOptimizer is dynamic only; "
                            "TFAMP_LOSS_SCALE=%s starts the dynamic scale there.", loss_scale)
            self.optimizer = keras.optimizers.LossScaleOptimizer(
                optimizer, **({} if loss_scale == "dynamic" else {"initial_scale": loss_scale}))
        return result

    keras.Model.compile = compile
    original_step = tf_trainer.TensorFlowTrainer.train_step

    @functools.wraps(original_step)
    def train_step(self, data):
        with _keras_scales_itself(active):
            return original_step(self, data)

    tf_trainer.TensorFlowTrainer.train_step = train_step


@contextlib.contextmanager
def _keras_scales_itself(active: _Activation):
    """Marks a Keras train step: its optimizer scales the loss, the tape must not."""
    previous = getattr(active.no_tape_scaling, "on", False)
    active.no_tape_scaling.on = True
    try:
        yield
    finally:
        active.no_tape_scaling.on = previous


# -- custom training loops --------------------------------------------------------

def _patch_custom_loops(active: _Activation) -> None:
    if active.settings.loss_scale is None:
        return
    import tensorflow as tf

    from tfamp.keras import loss_scale as loss_scale_lib

    original_gradient = tf.GradientTape.gradient

    @functools.wraps(original_gradient)
    def gradient(self, target, sources, output_gradients=None, **kwargs):
        if (getattr(active.no_tape_scaling, "on", False) or output_gradients is not None
                or not _is_scalar_float(target)):
            return original_gradient(self, target, sources, output_gradients, **kwargs)
        scale = _scale_state(active).current_loss_scale
        seed = tf.cast(tf.fill(tf.shape(target), scale), target.dtype)
        grads = original_gradient(self, target, sources, seed, **kwargs)
        return tf.nest.map_structure(lambda g: _unscale(g, scale), grads)

    tf.GradientTape.gradient = gradient

    for optimizer_class in _optimizer_classes():
        _patch_apply_gradients(active, optimizer_class, loss_scale_lib)

    # tfamp's own loss-scale optimizer scales through the tape by itself.
    original_compute = loss_scale_lib.LossScaleOptimizer.compute_gradients

    @functools.wraps(original_compute)
    def compute_gradients(self, *args, **kwargs):
        with _keras_scales_itself(active):
            return original_compute(self, *args, **kwargs)

    loss_scale_lib.LossScaleOptimizer.compute_gradients = compute_gradients


def _optimizer_classes():
    classes = []
    try:
        import tf_keras

        classes.append(tf_keras.optimizers.Optimizer)
    except ImportError:
        pass
    try:
        import keras

        if getattr(keras, "__version__", "0").startswith("3"):
            classes.append(keras.optimizers.Optimizer)
    except ImportError:
        pass
    return classes


def _patch_apply_gradients(active: _Activation, optimizer_class, loss_scale_lib) -> None:
    import tensorflow as tf

    original = optimizer_class.apply_gradients

    @functools.wraps(original)
    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        if (getattr(active.no_tape_scaling, "on", False) or _is_loss_scale_optimizer(self)
                or getattr(self, "_is_wrapped_by_loss_scale_optimizer", False)):
            return original(self, grads_and_vars, *args, **kwargs)
        grads_and_vars = list(grads_and_vars)
        variables = [v for _, v in grads_and_vars]
        if not (getattr(self, "built", False) or getattr(self, "_built", False)):
            with tf.init_scope():
                self.build(variables)  # slots exist before the conditional update
        state = _scale_state(active)
        _, finite = state.update([g for g, _ in grads_and_vars])

        def apply():
            original(self, grads_and_vars, *args, **kwargs)
            return tf.constant(True)

        def skip():
            self.iterations.assign_add(1)  # as Keras's own wrapper: schedules keep counting
            return tf.constant(False)

        if tf.executing_eagerly():
            return apply() if bool(finite) else skip()
        return tf.cond(finite, apply, skip)

    optimizer_class.apply_gradients = apply_gradients


def _is_loss_scale_optimizer(optimizer) -> bool:
    return "LossScaleOptimizer" in type(optimizer).__name__


def _scale_state(active: _Activation):
    if active.scale_state is None:
        import tensorflow as tf

        from tfamp.keras.loss_scale import (
            DEFAULT_GROWTH_INTERVAL,
            DEFAULT_INITIAL_SCALE,
            DEFAULT_MIN_SCALE,
            _ScaleState,
        )

        loss_scale = active.settings.loss_scale
        with tf.init_scope():
            if loss_scale == "dynamic":
                active.scale_state = _ScaleState(
                    DEFAULT_INITIAL_SCALE, DEFAULT_GROWTH_INTERVAL, DEFAULT_MIN_SCALE)
            else:
                active.scale_state = _ScaleState(float(loss_scale), None, DEFAULT_MIN_SCALE)
    return active.scale_state


def _is_scalar_float(target) -> bool:
    import tensorflow as tf

    return (isinstance(target, (tf.Tensor, tf.Variable)) and target.dtype.is_floating
            and target.shape.rank == 0)


def _unscale(grad, scale):
    import tensorflow as tf

    if grad is None:
        return None
    if isinstance(grad, tf.IndexedSlices):
        values = tf.cast(grad.values, tf.float32) / scale
        return tf.IndexedSlices(tf.cast(values, grad.values.dtype), grad.indices,
                                grad.dense_shape)
    return tf.cast(tf.cast(grad, tf.float32) / scale, grad.dtype)


# -- telling the user -------------------------------------------------------------

def _note_hardware() -> None:
    import tensorflow as tf

    fast = []
    for gpu in tf.config.list_physical_devices("GPU"):
        capability = tf.config.experimental.get_device_details(gpu).get("compute_capability")
        if capability and tuple(capability) >= (7, 0):
            fast.append(gpu.name)
    if not fast:
        log.warning("tfamp: no GPU with fast 16-bit math (CUDA compute capability 7.0+) "
                    "is visible, so 16-bit ops will run slower here than float32 "
                    "(CPUs emulate them); tfamp goes on, which is useful for checking "
                    "correctness.")


def _exit_notice(active: _Activation) -> None:
    converted = sum(sum(r.converted.values()) for r in active.reports)
    if converted:
        return
    if not active.reports:
        log.warning("tfamp: TFAMP_ENABLE is on but the script traced no tf.function, so "
                    "nothing was rewritten: eager code runs as written. Wrap the training "
                    "step in @tf.function (Keras fit does this unless run_eagerly=True).")
        return
    kinds: dict[str, int] = {}
    for report in active.reports:
        for kind, count in report.kept_fp32.items():
            kinds[kind] = kinds.get(kind, 0) + count
    reasons = ", ".join(f"{k} x{n}" for k, n in sorted(kinds.items(), key=lambda kv: -kv[1]))
    log.warning("tfamp: TFAMP_ENABLE is on but none of the %d rewritten functions had an op "
                "that could run in %s (no allow-list op such as MatMul or Conv2D was "
                "converted%s).", len(active.reports), active.settings.config.dtype,
                f"; kept float32: {reasons}" if reasons else "")
