"""tfamp.enable(model) on Keras 3 models (import keras / tf.keras): fit, evaluate, predict."""

import glob
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfamp
from tests.keras3_helpers import data, mlp
from tfamp.keras.flavour import StepFunctions
from tfamp.keras.optimizer_keras3 import LossScaleOptimizer
from tfamp.runtime.runner import RewrittenFunction


def fit(model, epochs=3, **kwargs):
    x, y = data()
    return model.fit(x, y, epochs=epochs, batch_size=32, verbose=0, **kwargs).history


def test_tf_keras_is_keras3():
    assert tf.keras.Model is keras.Model and keras.__version__.startswith("3")


@pytest.mark.parametrize("order", ["enable_then_compile", "compile_then_enable"])
def test_fit_runs_rewritten_with_loss_scaling_and_matches_float32(order):
    reference = mlp()
    reference.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    want = fit(reference, epochs=10)["loss"]

    model = mlp()
    if order == "enable_then_compile":
        assert tfamp.enable(model) is model
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
    else:
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
        tfamp.enable(model)
    history = fit(model, epochs=10, validation_data=data(64, seed=1))
    assert isinstance(model.optimizer, LossScaleOptimizer)
    assert isinstance(model.train_function, StepFunctions)
    (step,) = model.train_function.rewritten
    assert isinstance(step, RewrittenFunction)
    assert model.train_function.reports[0].converted.get("MatMul", 0) >= 2
    # 80 steps, no growth yet: every halving is one skipped (overflowing) step.
    scale, skipped = history["loss_scale"][-1], history["skipped_steps"][-1]
    start = model._tfamp_state.start_scale.scale  # from the first batch's gradients
    assert scale * 2**skipped == start and skipped <= 3
    assert {"val_loss", "val_mae", "mae"} <= set(history)
    assert history["loss"][-1] == pytest.approx(want[-1], rel=0.05)
    assert history["loss"][-1] < 0.05 * history["loss"][0]
    assert all(v.dtype == "float32" for v in model.weights)


def test_evaluate_predict_and_batch_methods_are_rewritten():
    x, y = data()
    model = mlp()
    model.compile(optimizer="adam", loss="mse")
    fit(model, epochs=1)
    want_pred = model.predict(x, verbose=0)
    want_eval = model.evaluate(x, y, verbose=0)
    want_batch = model.predict_on_batch(x[:8])
    tfamp.enable(model)
    pred = model.predict(x, verbose=0)
    assert pred.dtype == np.float32
    assert isinstance(model.predict_function, StepFunctions)
    assert model.predict_function.reports[0].converted.get("MatMul") == 2
    np.testing.assert_allclose(pred, want_pred, rtol=2e-2, atol=2e-2 * np.abs(want_pred).max())
    assert not np.array_equal(pred, want_pred)  # float16 math ran
    assert model.evaluate(x, y, verbose=0) == pytest.approx(want_eval, rel=2e-2)
    assert isinstance(model.test_function, StepFunctions)
    batch = model.predict_on_batch(x[:8])
    np.testing.assert_allclose(batch, want_batch, rtol=2e-2, atol=2e-2)
    assert not np.array_equal(batch, want_batch)
    logs = model.train_on_batch(x[:32], y[:32], return_dict=True)
    assert set(logs) == {"loss", "loss_scale", "skipped_steps"}
    assert model.test_on_batch(x[:32], y[:32]) == pytest.approx(
        model.evaluate(x[:32], y[:32], verbose=0), rel=1e-5)


def test_callbacks_see_the_loss_scale_every_batch():
    seen = []

    class Spy(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(dict(logs))

    model = mlp()
    model.compile(optimizer="adam", loss="mse")
    tfamp.enable(model, initial_scale=2.0**10)
    fit(model, epochs=1, callbacks=[Spy()])
    assert len(seen) == 8
    assert all(logs["loss_scale"] == 2.0**10 and logs["skipped_steps"] == 0 for logs in seen)


def test_steps_per_execution_loop_calls_the_rewritten_step():
    model = mlp()
    model.compile(optimizer="adam", loss="mse", steps_per_execution=4)
    tfamp.enable(model)
    history = fit(model, epochs=2)
    assert history["loss"][1] < history["loss"][0]
    # One rewritten step; the loop around it is a plain tf.function.
    assert len(model.train_function.reports) == 1


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(32, activation="relu")
        self.out = keras.layers.Dense(1)

    def call(self, x):
        return self.out(self.hidden(x))


def test_subclassed_model_enabled_before_it_is_built():
    keras.utils.set_random_seed(0)
    model = Subclassed()
    tfamp.enable(model)
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    assert not model.built and not model.optimizer.built
    history = fit(model, epochs=3)
    assert history["loss"][-1] < 0.5 * history["loss"][0]
    assert model.train_function.reports[0].converted.get("MatMul", 0) >= 2
    start = model._tfamp_state.start_scale.scale  # probed once the model was built
    assert history["loss_scale"][-1] * 2 ** history["skipped_steps"][-1] == start


def test_keras_trainer_module_gets_its_tensorflow_back():
    from keras.src.backend.tensorflow import trainer as trainer_module

    model = mlp()
    model.compile(optimizer="adam", loss="mse")
    tfamp.enable(model)
    fit(model, epochs=1)
    model.predict(data()[0], verbose=0)
    assert trainer_module.tf is tf
    # A model tfamp does not know builds plain tf.functions as before.
    other = mlp(seed=1)
    other.compile(optimizer="adam", loss="mse")
    fit(other, epochs=1)
    assert not isinstance(other.train_function, StepFunctions)
    assert "loss_scale" not in fit(other, epochs=1)


def test_enable_twice_is_harmless_and_disable_restores_float32():
    model = mlp()
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    inner = model.optimizer
    tfamp.enable(model)
    tfamp.enable(model)
    assert isinstance(model.optimizer, LossScaleOptimizer)
    assert model.optimizer.inner_optimizer is inner
    fit(model, epochs=1)
    tfamp.disable(model)
    assert model.optimizer is inner and not tfamp.keras.activation.is_enabled(model)
    history = fit(model, epochs=1)
    assert "loss_scale" not in history
    assert not isinstance(model.train_function, StepFunctions)
    tfamp.enable(model)
    assert fit(model, epochs=1)["skipped_steps"] == [0]


def test_bfloat16_defaults_to_no_loss_scaling():
    model = mlp()
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    tfamp.enable(model, dtype="bfloat16")
    assert not isinstance(model.optimizer, LossScaleOptimizer)
    history = fit(model, epochs=2)
    assert history["loss"][1] < history["loss"][0]
    assert model.train_function.reports[0].dtype == "bfloat16"


def test_run_eagerly_warns_and_stays_float32(caplog):
    model = mlp()
    model.compile(optimizer="adam", loss="mse", run_eagerly=True)
    tfamp.enable(model)
    with caplog.at_level("WARNING", logger="tfamp"), warnings.catch_warnings():
        warnings.simplefilter("error")  # one message (the log line), not a second warning
        fit(model, epochs=1)
    assert "runs eagerly" in caplog.text
    assert not isinstance(model.train_function, StepFunctions)


def test_loss_scale_reaches_tensorboard(tmp_path):
    model = mlp()
    model.compile(optimizer="adam", loss="mse")
    tfamp.enable(model)
    fit(model, epochs=1, callbacks=[keras.callbacks.TensorBoard(str(tmp_path))])
    tags = set()
    for path in glob.glob(str(tmp_path / "train" / "events.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            tags.update(value.tag for value in event.summary.value)
    assert {"epoch_loss_scale", "epoch_skipped_steps"} <= tags


def test_not_a_model_names_both_keras_flavours_and_tfamp_enable():
    with pytest.raises(TypeError, match=r"Keras 3 keras.Model .*tf_keras.Model.*received "
                                        r"builtins.str.*TFAMP_ENABLE=1"):
        tfamp.enable("model.keras")


def test_keras_mixed_policy_is_named_with_the_fix():
    keras.config.set_dtype_policy("mixed_float16")
    try:
        model = mlp()
        with pytest.raises(ValueError, match=r"'mixed_float16' policy is in force and so "
                                             r"is tfamp.*set_dtype_policy\('float32'\)"):
            tfamp.enable(model)
    finally:
        keras.config.set_dtype_policy("float32")


def test_keras_loss_scale_optimizer_is_refused_with_the_fix():
    model = mlp()
    model.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam()),
                  loss="mse")
    with pytest.raises(ValueError, match="already a Keras LossScaleOptimizer"):
        tfamp.enable(model)


def test_other_keras_backend_is_refused_saying_why(monkeypatch):
    # Keras 3's other backends (jax, torch, numpy+scipy) are not installed here;
    # what tfamp checks is keras.backend.backend(), which KERAS_BACKEND sets.
    monkeypatch.setattr(keras.backend, "backend", lambda: "jax")
    with pytest.raises(ValueError, match=r"tfamp rewrites TensorFlow graphs, but Keras 3 is "
                                         r"running on the 'jax' backend.*"
                                         r"KERAS_BACKEND=tensorflow"):
        tfamp.enable(mlp())


@pytest.mark.slow  # a fresh TensorFlow process, ~15 s
def test_example_script_runs():
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TFAMP_")}
    env.update({"TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": repo})
    result = subprocess.run([sys.executable, os.path.join(repo, "examples", "keras3_enable.py"),
                             "--epochs", "2"], capture_output=True, text=True, timeout=300,
                            env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "loss scale per epoch:" in result.stdout
    summary = next(line for line in result.stdout.splitlines() if "one_step_on_data:" in line)
    converted = summary.split("-> float16 (", 1)[1].split(")", 1)[0]
    assert "MatMul x6" in converted, summary  # (the Dense layers' matrix products)


def _moving_mean_after_fit(enable: bool) -> np.ndarray:
    """A BatchNorm's moving mean after 256 steps of a Keras 3 fit compiled with XLA,
    on channels whose batch means sit near 2.9 (momentum 0.99)."""
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(1024, 4, 4, 8)) * 1.4 + 3.0).astype("float32")
    y = rng.normal(size=(1024, 1)).astype("float32")
    eye = keras.initializers.Constant(np.eye(8, dtype="float32").reshape(1, 1, 8, 8))
    model = keras.Sequential([
        keras.Input((4, 4, 8)),
        keras.layers.Conv2D(8, 1, kernel_initializer=eye, use_bias=False, trainable=False),
        keras.layers.BatchNormalization(momentum=0.99),
        keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse", jit_compile=True)
    if enable:
        tfamp.enable(model, dtype="bfloat16")
    model.fit(x, y, batch_size=16, epochs=4, verbose=0, shuffle=False)
    return np.asarray(model.layers[1].moving_mean)


def test_bfloat16_moving_statistics_keep_moving_like_float32():
    """Keras 3's BatchNorm assigns moving * 0.99 + mean * 0.01. Computed in bfloat16
    (8 bits of mantissa), a step below half a bfloat16 spacing is lost: the moving
    mean stalled at 2.34 where float32's reached 2.77. tfamp keeps the old-to-new
    path float32 (coloring._hold_variable_updates)."""
    want = _moving_mean_after_fit(enable=False)
    got = _moving_mean_after_fit(enable=True)
    assert want.min() > 2.6  # (the channels' means moved most of the way to ~2.9)
    np.testing.assert_allclose(got, want, rtol=5e-3)


def _keras2_style_gan(amp: bool):
    """eriklindernoren/Keras-GAN's dcgan, in small: the discriminator compiled (and, as
    ``TFAMP_ENABLE`` does at compile, enabled) while trainable, then frozen, and the
    combined model compiled with the same optimizer; trained with train_on_batch."""
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    shared = keras.optimizers.Adam(1e-2, 0.5)
    discriminator = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                                      keras.layers.Dense(1, activation="sigmoid")])
    discriminator.compile(optimizer=shared, loss="binary_crossentropy", metrics=["accuracy"])
    if amp:
        tfamp.enable(discriminator, verbose=False)
    generator = keras.Sequential([keras.Input((2,)), keras.layers.Dense(4)])
    discriminator.trainable = False
    z = keras.Input((2,))
    combined = keras.Model(z, discriminator(generator(z)))
    combined.compile(optimizer=shared, loss="binary_crossentropy")
    if amp:
        tfamp.enable(combined, verbose=False)
    before = [w.copy() for w in generator.get_weights() + discriminator.get_weights()]
    images, noise = rng.normal(size=(16, 4)), rng.normal(size=(16, 2))
    ones = np.ones((16, 1))
    logs = {"d": discriminator.train_on_batch(images, ones),
            "g": [combined.train_on_batch(noise, ones) for _ in range(3)]}
    after = generator.get_weights() + discriminator.get_weights()
    return logs, [a - b for a, b in zip(after, before, strict=True)], combined


def test_models_sharing_one_optimizer_train_as_in_float32():
    """Keras 3 builds an optimizer at its first apply (here the combined model's, with the
    generator's variables). tfamp built it at compile with the discriminator's, and the
    combined model's first step failed: "Unknown variable" (session 33). And
    train_on_batch returned tfamp's log keys too, so the script's ``"%f" % g_loss``
    failed on a list."""
    want_logs, want, _ = _keras2_style_gan(amp=False)
    logs, got, combined = _keras2_style_gan(amp=True)
    assert isinstance(combined.optimizer, LossScaleOptimizer)
    # The values float32 returns, as float32 returns them: a number for a loss alone.
    assert all(isinstance(loss, float) for loss in logs["g"])
    assert len(logs["d"]) == len(want_logs["d"]) == 2
    np.testing.assert_allclose(logs["g"], want_logs["g"], rtol=2e-2)
    # Keras 3 trains only the generator (the frozen discriminator does not train, in
    # float32 either); its update matches float32's.
    for delta in want[2:] + got[2:]:
        assert not delta.any()
    want_flat = np.concatenate([d.ravel() for d in want[:2]])
    got_flat = np.concatenate([d.ravel() for d in got[:2]])
    cosine = want_flat @ got_flat / np.linalg.norm(want_flat) / np.linalg.norm(got_flat)
    assert cosine > 0.99 and np.linalg.norm(got_flat) == pytest.approx(
        np.linalg.norm(want_flat), rel=0.05)
