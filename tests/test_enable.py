"""tfamp.enable(model): Keras fit/evaluate/predict in mixed precision, and nothing lost."""

import glob
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

import tfamp
from tfamp.keras.optimizer_tf_keras import LossScaleOptimizer
from tfamp.runtime.runner import RewrittenFunction

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def data(n=256, features=16, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    return x, x[:, :4].sum(axis=1, keepdims=True)


def mlp(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.layers.Dense(32, activation="relu", input_shape=(16,)),
        keras.layers.Dense(1),
    ])


def fit(model, epochs=3, **kwargs):
    x, y = data()
    return model.fit(x, y, epochs=epochs, batch_size=32, verbose=0, **kwargs).history


@pytest.mark.parametrize("order", ["enable_then_compile", "compile_then_enable"])
def test_fit_runs_rewritten_with_loss_scaling_and_matches_float32(order):
    reference = mlp()
    reference.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    want = fit(reference, epochs=10)["loss"]

    model = mlp()
    if order == "enable_then_compile":
        assert tfamp.enable(model) is model
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    else:
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
        tfamp.enable(model)
    history = fit(model, epochs=10, validation_data=data(64, seed=1))
    assert isinstance(model.optimizer, LossScaleOptimizer)
    assert isinstance(model.train_function, RewrittenFunction)
    assert model.train_function.reports[0].converted.get("MatMul", 0) >= 2
    # 80 steps, no growth yet: every halving is one skipped (overflowing) step.
    scale, skipped = history["loss_scale"][-1], history["skipped_steps"][-1]
    start = model._tfamp_state.start_scale.scale  # from the first batch's gradients
    assert scale * 2**skipped == start and skipped <= 3
    assert "val_loss" in history
    # A skipped first step shifts the early curve; the trained loss must agree.
    assert history["loss"][-1] == pytest.approx(want[-1], rel=0.05)
    assert history["loss"][-1] < 0.05 * history["loss"][0]
    assert all(v.dtype == tf.float32 for v in model.weights)


def test_evaluate_and_predict_are_rewritten_and_keep_float32_outputs():
    x, y = data()
    model = mlp()
    model.compile(optimizer="adam", loss="mse")
    fit(model, epochs=1)
    want_pred = model.predict(x, verbose=0)
    want_eval = model.evaluate(x, y, verbose=0)
    tfamp.enable(model)
    pred = model.predict(x, verbose=0)
    assert pred.dtype == np.float32
    assert isinstance(model.predict_function, RewrittenFunction)
    np.testing.assert_allclose(pred, want_pred, rtol=2e-2, atol=2e-2 * np.abs(want_pred).max())
    assert not np.array_equal(pred, want_pred)  # float16 math ran
    assert model.evaluate(x, y, verbose=0) == pytest.approx(want_eval, rel=2e-2)
    assert model.predict_on_batch(x[:4]).shape == (4, 1)
    logs = model.train_on_batch(x[:32], y[:32], return_dict=True)
    assert set(logs) == {"loss", "loss_scale", "skipped_steps"}


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
    assert not isinstance(model.train_function, RewrittenFunction)
    tfamp.enable(model)  # and back on again, re-wrapping the same inner optimizer
    assert fit(model, epochs=1)["skipped_steps"] == [0]


def test_bfloat16_defaults_to_no_loss_scaling():
    model = mlp()
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    tfamp.enable(model, dtype="bfloat16")
    assert not isinstance(model.optimizer, LossScaleOptimizer)
    history = fit(model, epochs=2)
    assert history["loss"][1] < history["loss"][0]
    assert model.train_function.reports[0].dtype == "bfloat16"


def test_overflowing_batch_is_skipped_and_scale_halves():
    x, y = data(64)
    model = mlp()
    model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse")
    tfamp.enable(model, initial_scale=2.0**8)
    first = model.train_on_batch(x[:32], y[:32], return_dict=True)
    assert first["skipped_steps"] == 0 and first["loss_scale"] == 2.0**8
    before = [w.copy() for w in model.get_weights()]
    huge = np.full_like(x[:32], 3e4)  # activations overflow float16 (max 65504)
    logs = model.train_on_batch(huge, y[:32], return_dict=True)
    for old, new in zip(before, model.get_weights(), strict=True):
        np.testing.assert_array_equal(old, new)
    assert logs["skipped_steps"] == 1 and logs["loss_scale"] == 2.0**7


def test_stuck_at_floor_warns_once_naming_variables():
    x, y = data(64)
    x[:, 0] = np.nan  # every gradient non-finite, whatever the scale
    model = mlp()
    model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse")
    tfamp.enable(model, initial_scale=1.0, min_scale=1.0)
    with pytest.warns(RuntimeWarning, match=r"stuck at its floor \(1\).*dense"):
        model.fit(x, y, epochs=1, batch_size=16, verbose=0)


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


@pytest.mark.parametrize("kwargs, error, message", [
    ({"dtype": "float8"}, ValueError, "dtype must be one of"),
    ({"loss_scale": "sometimes"}, ValueError, "'dynamic', a positive number or None"),
])
def test_bad_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        tfamp.enable(mlp(), **kwargs)


def _tiny_loss(y, pred):
    # Unscaled, float16 gradients of this loss underflow (~1e-5 and below).
    return 1e-5 * tf.reduce_mean(tf.square(y - pred))


def _update(model, optimizer, loop, calibrate=False):
    """The weight change of 8 steps of `model` on the tiny loss: fit, or a custom
    loop (calibrated first: its start scale probed from the first batch)."""
    x, y = data(256)
    before = np.concatenate([w.ravel() for w in model.get_weights()])
    if loop:
        @tf.function
        def step(xb, yb):
            with tf.GradientTape() as tape:
                loss = _tiny_loss(yb, model(xb, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        if calibrate:
            tfamp.calibrate_loss_scale(step, x[:32], y[:32], model=model)
        for i in range(8):
            step(x[32 * i:32 * (i + 1)], y[32 * i:32 * (i + 1)])
    else:
        model.compile(optimizer=optimizer, loss=_tiny_loss)
        model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    return np.concatenate([w.ravel() for w in model.get_weights()]) - before


@pytest.mark.parametrize("loop", [False, True], ids=["fit", "custom_loop"])
def test_a_legacy_optimizer_gets_tfamps_loss_scaling(loop):
    """tf_keras's legacy optimizers (keras.optimizers.legacy.*, the Keras 2 API many
    scripts compile with) get tfamp's own loss scaling: the start scale probed from
    the model's gradients, a skipped step counted. On a loss whose unscaled float16
    gradients underflow, 8 Adam steps move the weights as float32's do.

    Before: enable refused them (fit), and in a custom loop the start-scale probe's
    trace applied its gradients, a hidden extra Adam step (update cosine 0.976)."""
    want = _update(mlp(), keras.optimizers.legacy.Adam(1e-3), loop)
    model = mlp()
    tfamp.enable(model)
    optimizer = keras.optimizers.legacy.Adam(1e-3)
    got = _update(model, optimizer, loop, calibrate=True)
    cosine = float(want @ got / np.linalg.norm(want) / np.linalg.norm(got))
    assert cosine > 0.999 and 0.99 < np.linalg.norm(got) / np.linalg.norm(want) < 1.01, cosine
    assert int(optimizer.iterations.numpy()) == 8  # the probe applied nothing
    owner = model._tfamp_state.scale_owner()
    if not loop:
        assert type(model.optimizer).__name__ == "LegacyLossScaleOptimizer"
        assert model.optimizer.inner_optimizer is optimizer
    # Probed (its tiny gradients measured: at 2^15 all of them are float16 normals,
    # so the start comes down to 2^15); no step skipped.
    found = model._tfamp_state.start_scale
    assert found.max_abs < 1e-4 and float(owner.scale_tensor()) == found.scale
    assert found.scale >= 2.0**15 and found.underflow_share == 0
    assert int(owner.skipped_steps.numpy()) == 0


def test_a_legacy_optimizers_non_finite_step_is_skipped_in_a_custom_loop():
    """A step whose scaled gradients overflow float16 leaves the weights and the
    legacy optimizer's slots as they were, and halves the scale."""
    model = mlp()
    tfamp.enable(model, initial_scale=2.0**10)
    optimizer = keras.optimizers.legacy.Adam(1e-3)
    x, y = data(32)

    @tf.function
    def step(xb, yb, factor):
        with tf.GradientTape() as tape:
            loss = factor * tf.reduce_mean(tf.square(yb - model(xb, training=True)))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))

    step(x, y, tf.constant(1.0))
    weights = [w.copy() for w in model.get_weights()]
    slots = [v.numpy().copy() for v in optimizer.variables()]
    step(x, y, tf.constant(1e6))  # 1e6 x 2^10 overflows float16
    owner = model._tfamp_state.scale_owner()
    assert int(owner.skipped_steps.numpy()) == 1
    assert float(owner.scale_tensor()) == 2.0**9
    for a, b in zip(weights, model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    after = [v.numpy() for v in optimizer.variables()]
    assert int(after[0]) == 2  # iterations still count the skipped batch
    for a, b in zip(slots[1:], after[1:], strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("legacy", [True, False], ids=["legacy", "optimizer"])
def test_one_optimizer_compiled_into_two_models_shares_one_wrapper(legacy):
    """A Keras 2 GAN compiles its discriminator and its combined model with one
    optimizer; tf_keras wraps an optimizer once, so both get the same tfamp wrapper
    and scale (enable used to stop at the second model with tf_keras's "already
    wrapped" ValueError). Different loss-scale settings are refused by name.
    (tf_keras's non-legacy optimizers update one set of variables: in float32 too,
    the second model could not train with it.)"""
    shared = (keras.optimizers.legacy.Adam if legacy else keras.optimizers.Adam)(1e-3)
    first, second, third = mlp(), mlp(1), mlp(2)
    first.compile(optimizer=shared, loss="mse")
    second.compile(optimizer=shared, loss="mse")
    tfamp.enable(first)
    tfamp.enable(second)
    assert first.optimizer is second.optimizer
    assert first.optimizer.inner_optimizer is shared
    x, y = data(32)
    assert np.isfinite(first.train_on_batch(x, y))
    if legacy:
        assert np.isfinite(second.train_on_batch(x, y))
    third.compile(optimizer=shared, loss="mse")
    with pytest.raises(ValueError, match=rf"model '{third.name}' is compiled with an optimizer "
                                         r"\(Adam\) that another enabled model also uses.*"
                                         r"enable them with the same settings"):
        tfamp.enable(third, loss_scale=128)
    assert third.optimizer is shared


def test_not_a_keras_model():
    with pytest.raises(TypeError, match="expects a Keras model.*tf_keras.Model.*received "
                                        "builtins.str"):
        tfamp.enable("model.keras")


def test_keras_mixed_policy_is_named_with_the_fix():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = mlp()
        with pytest.raises(ValueError, match="'mixed_float16' policy is in force and so is "
                                             "tfamp.*set_global_policy\\('float32'\\)"):
            tfamp.enable(model)
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_tensorflow_auto_mixed_precision_is_named_with_the_fix():
    tf.config.optimizer.set_experimental_options({"auto_mixed_precision": True})
    try:
        with pytest.raises(ValueError, match="auto_mixed_precision graph rewrite is on"):
            tfamp.enable(mlp())
    finally:
        tf.config.optimizer.set_experimental_options({"auto_mixed_precision": False})


_LOAD_WITHOUT_TFAMP = textwrap.dedent("""
    import json, sys
    import numpy as np, tensorflow as tf, tf_keras as keras
    folder = sys.argv[1]
    out = {}
    for name in ("model.keras", "saved_model"):
        model = keras.models.load_model(f"{folder}/{name}")
        out[name] = [w.tolist() for w in model.get_weights()]
        out[name + ":optimizer"] = type(model.optimizer).__name__
    model = keras.models.load_model(f"{folder}/model.keras")
    tf.train.Checkpoint(model=model).restore(f"{folder}/ckpt-1").expect_partial()
    out["checkpoint"] = [w.tolist() for w in model.get_weights()]
    out["tfamp_imported"] = "tfamp" in sys.modules
    print(json.dumps(out))
""")


def test_saved_weights_load_without_tfamp_exactly(tmp_path):
    model = mlp()
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    tfamp.enable(model)
    fit(model, epochs=2)
    want = [w.tolist() for w in model.get_weights()]
    model.save(str(tmp_path / "model.keras"))
    model.save(str(tmp_path / "saved_model"))
    tf.train.Checkpoint(model=model).save(str(tmp_path / "ckpt"))
    env = {**os.environ, "PYTHONPATH": "", "TF_CPP_MIN_LOG_LEVEL": "2"}
    result = subprocess.run([sys.executable, "-c", _LOAD_WITHOUT_TFAMP, str(tmp_path)],
                            capture_output=True, text=True, timeout=300, env=env,
                            cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert loaded["tfamp_imported"] is False
    for key in ("model.keras", "saved_model", "checkpoint"):
        assert loaded[key] == want, key


def test_loss_scale_state_resumes_from_checkpoint(tmp_path):
    model = mlp()
    model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse")
    tfamp.enable(model, initial_scale=2.0**10)
    x, y = data(64)
    model.train_on_batch(np.full_like(x[:32], 3e4), y[:32])  # one skip: 1024 -> 512
    path = tf.train.Checkpoint(model=model).save(str(tmp_path / "ckpt"))

    fresh = mlp(seed=1)
    fresh.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse")
    tfamp.enable(fresh, initial_scale=2.0**10)
    tf.train.Checkpoint(model=fresh).restore(path)
    assert float(fresh.optimizer.loss_scale) == 512.0
    assert int(fresh.optimizer.skipped_steps.numpy()) == 1
    for a, b in zip(model.get_weights(), fresh.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
