"""tfamp.enable(model) where users stumble: log lines, custom loops."""

import logging
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

import tfamp
from tfamp.keras import activation


@pytest.fixture
def tfamp_logger():
    logger = logging.getLogger("tfamp")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    logger.handlers = [h for h in logger.handlers if not getattr(h, "_tfamp", False)]
    logger.setLevel(logging.NOTSET)
    yield logger
    logger.handlers, level, logger.propagate = saved[0], saved[1], saved[2]
    logger.setLevel(level)


def small_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    return model


def data():
    x = np.random.default_rng(0).normal(size=(32, 8)).astype("float32")
    return x, x[:, :1]


ENABLE_SCRIPT = textwrap.dedent("""
    import numpy as np
    import tf_keras as keras
    import tfamp
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    tfamp.enable(model)
    x = np.ones((32, 8), "float32")
    model.fit(x, x[:, :1], epochs=1, batch_size=16, verbose=0)
    model.predict(x, verbose=0)
    print("done")
""")


def test_enable_prints_one_line_per_rewritten_function_by_default(tmp_path):
    script = tmp_path / "enable.py"
    script.write_text(ENABLE_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TFAMP_")}
    env.update(TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            env=env, cwd=str(tmp_path), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summaries = [line for line in result.stderr.splitlines()
                 if line.startswith("tfamp: ") and " ops -> float16" in line]
    # fit's train function and predict's function, one line each.
    assert len(summaries) == 2, result.stderr[-3000:]
    assert any(line.startswith("tfamp: train_function: ") for line in summaries), summaries
    assert any(line.startswith("tfamp: predict_function: ") for line in summaries), summaries
    assert "tfamp: enabled float16 on model" in result.stderr


@pytest.mark.parametrize("verbose, shown", [(True, True), (False, False)])
def test_enable_verbose_controls_the_summary_lines(tfamp_logger, capsys, verbose, shown):
    model = small_model()
    tfamp.enable(model, verbose=verbose)
    model.fit(*data(), epochs=1, batch_size=16, verbose=0)
    err = capsys.readouterr().err
    assert ("tfamp: train_function: " in err) is shown, err


def test_enable_respects_logging_the_application_configured(tfamp_logger, caplog):
    # pytest's caplog is a handler on the root logger: logging is configured,
    # so tfamp adds no handler of its own and the lines go through it.
    caplog.set_level(logging.INFO, logger="tfamp")
    model = small_model()
    tfamp.enable(model)
    model.fit(*data(), epochs=1, batch_size=16, verbose=0)
    assert not any(getattr(h, "_tfamp", False) for h in tfamp_logger.handlers)
    messages = [r.getMessage() for r in caplog.records if r.name == "tfamp"]
    assert any(m.startswith("tfamp: train_function: ") for m in messages), messages


def test_enable_keeps_an_explicitly_quieter_tfamp_level(tfamp_logger, capsys):
    tfamp_logger.setLevel(logging.WARNING)
    activation._show_log_lines(None)
    tfamp_logger.info("tfamp: hidden")
    assert "tfamp: hidden" not in capsys.readouterr().err


def custom_step(model, wrap):
    @wrap
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        return loss, grads
    return step


def record_warnings(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn()
    return result, [w for w in caught if "tfamp" in str(w.message)]


def test_enabled_model_in_a_plain_tf_function_runs_16bit_without_warning(tfamp_logger):
    # Issue 11 item 2: the user's own tf.function step now runs the model
    # rewritten (tests/test_enable_custom_loop.py covers training and scaling).
    x, y = data()
    model = small_model()
    want, _ = custom_step(model, tf.function)(x, y)  # float32, before enable
    tfamp.enable(model, verbose=False)
    step = custom_step(model, tf.function)
    (loss, grads), caught = record_warnings(lambda: [step(x, y), step(x * 2, y)][0])
    assert caught == [], [str(w.message) for w in caught]
    assert float(loss) != float(want)  # 16-bit rounding: not the float32 step
    np.testing.assert_allclose(float(loss), float(want), rtol=0.01)
    assert all(g.dtype == tf.float32 for g in grads)


def test_enabled_model_quiet_in_tfamp_function_fit_and_eager_calls(tfamp_logger):
    x, y = data()
    model = small_model()
    tfamp.enable(model, verbose=False)
    step = custom_step(model, tfamp.function)

    def use():
        step(x, y)
        model.fit(x, y, epochs=1, batch_size=16, verbose=0)
        model.predict(x, verbose=0)
        model(x)
    _, caught = record_warnings(use)
    assert caught == []
    assert step.reports[0].converted.get("MatMul", 0) >= 2


def test_disable_removes_the_call_hook(tfamp_logger):
    x, y = data()
    model = small_model()
    tfamp.enable(model, verbose=False)
    tfamp.disable(model)
    _, caught = record_warnings(lambda: custom_step(model, tf.function)(x, y))
    assert caught == [] and "call" not in model.__dict__


MIRRORED_SCRIPT = textwrap.dedent("""
    import warnings
    import numpy as np
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import tf_keras as keras
    import tfamp
    warnings.simplefilter("always")
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16),
                                  keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    tfamp.enable(model)
    x = np.ones((64, 8), "float32")
    model.fit(x, x[:, :1], epochs=1, batch_size=16, verbose=0)
    print("replicas", strategy.num_replicas_in_sync)
""")


@pytest.mark.slow  # ~20 s: a process with two logical CPUs
def test_enabled_model_under_mirrored_strategy_does_not_warn(tmp_path):
    # MirroredStrategy traces each replica in a thread of its own: the replica
    # threads are still inside tfamp's trace of the train function.
    script = tmp_path / "mirrored.py"
    script.write_text(MIRRORED_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TFAMP_")}
    env.update(TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            env=env, cwd=str(tmp_path), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "replicas 2" in result.stdout
    assert "tfamp: train_function: " in result.stderr
    assert "is called inside a tf.function that tfamp does not rewrite" not in result.stderr


def test_the_fix_the_warning_gives_trains_in_mixed_precision(tfamp_logger):
    x, y = data()

    def train(enable):
        model = small_model()
        if enable:
            tfamp.enable(model, verbose=False)
        optimizer = model.optimizer
        wrap = tfamp.function if enable else tf.function

        @wrap
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
                scaled = optimizer.get_scaled_loss(loss) if enable else loss
            grads = tape.gradient(scaled, model.trainable_variables)
            if enable:
                grads = optimizer.get_unscaled_gradients(grads)
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            return loss
        losses = [float(step(x, y)) for _ in range(30)]
        return losses, step, optimizer

    (want, _, _), ((got, step, optimizer), caught) = train(False), record_warnings(
        lambda: train(True))
    assert caught == []
    assert type(optimizer).__name__ == "LossScaleOptimizer"
    assert float(optimizer.loss_scale) == 2.0 ** 15  # no overflow, nothing skipped
    assert step.reports[0].converted.get("MatMul", 0) >= 4  # forward and backward
    assert got != want  # 16-bit rounding is visible...
    np.testing.assert_allclose(got, want, rtol=0.05)  # ...and small
    assert got[-1] < 0.5 * got[0]


def _residual_wrapper(k):
    """A subclassed model with no build() of its own around an unbuilt Sequential
    (TensorFlow's time-series tutorial's ResidualWrapper)."""
    class ResidualWrapper(k.Model):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def call(self, inputs):
            return inputs + self.inner(inputs)

    k.utils.set_random_seed(0)
    return ResidualWrapper(k.Sequential([k.layers.Dense(8, activation="tanh"),
                                         k.layers.Dense(4)]))


@pytest.mark.parametrize("keras_name", ["tf_keras", "keras"])
def test_build_after_compile_then_fit(keras_name):
    """model.build(shape) after compile, then fit, on an enabled float16 model.
    tf_keras's build traces call in a "build_graph", which the call hook took for a
    user's step (it built the loss scale on a model with no weights yet: ValueError);
    Keras 3's marks the wrapper built but not its layers, and the step built the
    optimizer before they had weights ("Unknown variable" at the update). Found by a
    helper running the tutorial unmodified (session 22)."""
    k = pytest.importorskip(keras_name)
    model = _residual_wrapper(k)
    model.compile(optimizer=k.optimizers.Adam(1e-2), loss="mse")
    tfamp.enable(model, dtype="float16", verbose=False)
    model.build((None, 4))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    history = model.fit(x, np.tanh(x), batch_size=16, epochs=3, verbose=0)
    losses = history.history["loss"]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    optimizer = model.optimizer
    assert int(np.asarray(optimizer.skipped_steps)) == 0
    assert float(np.asarray(optimizer.loss_scale)) > 1.0  # (the step scaled its loss)


@pytest.mark.parametrize("form", ["one", "nested", "callback_list"])
@pytest.mark.parametrize("keras_name", ["tf_keras", "keras"])
def test_fit_takes_its_callbacks_in_every_form_keras_does(keras_name, form, tmp_path):
    """tensorflow/docs' simple_audio passes `callbacks=EarlyStopping(...)`, one
    callback and no list, which Keras accepts; tfamp's fit added its own callback
    with `[*callbacks, ours]` and raised TypeError. Every form Keras takes keeps
    working, the user's callback runs, and fit's logs still have loss_scale."""
    k = pytest.importorskip(keras_name)
    k.utils.set_random_seed(0)
    model = k.Sequential([k.Input((4,)), k.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    tfamp.enable(model, dtype="float16", verbose=False, ranges=str(tmp_path))  # (reads them too)
    seen = []
    mine = k.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: seen.append(epoch))
    given = {"one": mine, "nested": [[mine]],
             "callback_list": k.callbacks.CallbackList([mine])}[form]
    x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
    history = model.fit(x, x[:, :1], epochs=2, verbose=0, callbacks=given)
    assert seen == [0, 1]
    assert "loss_scale" in history.history and len(history.history["loss"]) == 2


def _two_part_model(k):
    """TensorFlow's CVAE tutorial's shape: a model whose step calls its parts itself."""
    class TwoPart(k.Model):
        def __init__(self):
            super().__init__()
            self.encoder = k.Sequential([k.Input((8,)), k.layers.Dense(4)], name="encoder")
            self.decoder = k.Sequential([k.Input((4,)), k.layers.Dense(8)], name="decoder")

        def call(self, x):
            return self.decoder(self.encoder(x))

    k.utils.set_random_seed(0)
    model = TwoPart()
    model(np.zeros((1, 8), "float32"))
    return model


@pytest.mark.parametrize("keras_name", ["tf_keras", "keras"])
def test_a_step_that_calls_only_the_models_parts_says_so_once(keras_name):
    """After tfamp.enable(model), a custom step that calls model.encoder and
    model.decoder (never model itself) ran float32 without a word (a helper found
    it on TensorFlow's CVAE tutorial, session 22). Now one warning names the part
    and the fixes; calling the model, and after disable, say nothing."""
    k = pytest.importorskip(keras_name)
    model = _two_part_model(k)
    tfamp.enable(model, verbose=False)
    x = tf.constant(np.random.default_rng(0).normal(size=(4, 8)).astype("float32"))

    @tf.function
    def parts_step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model.decoder(model.encoder(x)) - x))
        return tape.gradient(loss, model.trainable_variables)

    @tf.function
    def whole_step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - x))
        return tape.gradient(loss, model.trainable_variables)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        whole_step(x)
    assert not [w for w in caught if "a part of the enabled model" in str(w.message)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parts_step(x)
        parts_step(x + 1.0)
    said = [str(w.message) for w in caught if "a part of the enabled model" in str(w.message)]
    assert len(said) == 1, said
    assert "'encoder'" in said[0] and "TFAMP_ENABLE=1" in said[0], said[0]
    tfamp.disable(model)
    assert "call" not in model.encoder.__dict__ and "call" not in model.decoder.__dict__


@pytest.mark.parametrize("wrapped", [False, True], ids=["keras", "plain_wrapper"])
def test_train_on_batch_returns_what_float32_returns(wrapped, monkeypatch):
    """``train_on_batch`` (return_dict=False) gives float32's number or list, without
    tfamp's log keys (a script's ``"%f" % loss`` failed on a list, session 33); a dict
    keeps them. ``plain_wrapper``: behind another library's ``(*args, **kwargs)``
    wrapper without ``functools.wraps``, which hid the ``return_dict`` tfamp asks for
    (a Keras-GAN script's ``"%f" % loss`` stopped with a TypeError, session 35)."""
    if wrapped:
        original = keras.Model.train_on_batch

        def wrapper(*args, **kwargs):
            return original(*args, **kwargs)

        monkeypatch.setattr(keras.Model, "train_on_batch", wrapper)
    x, y = data()
    want = small_model().train_on_batch(x, y)
    model = small_model()
    tfamp.enable(model, verbose=False)
    loss = model.train_on_batch(x, y)
    assert isinstance(loss, float) and loss == pytest.approx(want, rel=1e-2)
    logs = model.train_on_batch(x, y, return_dict=True)
    assert set(logs) == {"loss", "loss_scale", "skipped_steps"}
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    assert len(model.train_on_batch(x, y)) == 2  # loss, mae


def test_a_sequential_model_without_an_input_shape_trains():
    """A tf_keras Sequential with no Input builds at its first call, inside fit's first
    trace; tfamp asked for its variables before that, and fit stopped: "Weights for model
    'sequential' have not yet been created" (keras-hub / Model Garden helper, session 33;
    ``enable`` and ``TFAMP_ENABLE`` alike)."""
    x, y = data()

    def run(amp):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
        if amp:
            tfamp.enable(model, verbose=False)
        return model, model.fit(x, y, batch_size=8, epochs=1, verbose=0).history

    _, want = run(False)
    model, got = run(True)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-2)
    assert got["skipped_steps"] == [0] and model._tfamp_state.start_scale  # probed


@pytest.mark.parametrize("enabled", [True, False])
def test_tf_keras_progress_bar_shows_the_scale_and_skips_of_each_step(enabled):
    """tf_keras's progress bar averaged tfamp's per-step logs over the epoch (after one
    skipped step: ``loss_scale: 21845.3333 - skipped_steps: 0.6667``; a helper's
    simple_audio run). For an enabled model they are shown as they are; a float32
    model's progress bar is left alone."""
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    if enabled:
        tfamp.enable(model, verbose=False)
    logger = keras.callbacks.ProgbarLogger(count_mode="steps")
    logger.set_model(model)
    logger.set_params({"verbose": 1, "epochs": 1, "steps": 3})
    logger._maybe_init_progbar()
    kept = {"loss_scale", "skipped_steps"} <= set(logger.progbar.stateful_metrics)
    assert kept == enabled, logger.progbar.stateful_metrics
    # What the bar prints after three steps, one of them skipped:
    for step, (scale, skipped) in enumerate([(32768.0, 0), (16384.0, 1), (16384.0, 1)]):
        logger.progbar.update(step + 1, [("loss_scale", scale), ("skipped_steps", skipped)])
    value = logger.progbar._values["skipped_steps"]
    shown = value[0] / max(1, value[1]) if isinstance(value, list) else value
    assert (shown == 1) == enabled, shown
