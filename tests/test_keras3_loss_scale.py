"""tfamp's Keras 3 LossScaleOptimizer: dynamic and fixed scales, floor, skips, checkpoints."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfamp
from tests.keras3_helpers import data, mlp, optimizer_state, overflow_batch, weights_of
from tfamp.keras.optimizer_keras3 import LossScaleOptimizer


def enabled_mlp(optimizer=None, **enable_kwargs):
    model = mlp()
    model.compile(optimizer=optimizer or keras.optimizers.Adam(1e-2), loss="mse")
    tfamp.enable(model, **enable_kwargs)
    return model


def step(model, x, y):
    return model.train_on_batch(x, y, return_dict=True)


def test_overflowing_step_is_skipped_with_weights_and_adam_state_untouched():
    x, y = data(64)
    model = enabled_mlp(initial_scale=2.0**8)
    first = step(model, x[:32], y[:32])
    assert first["skipped_steps"] == 0 and first["loss_scale"] == 2.0**8
    weights, state = weights_of(model), optimizer_state(model.optimizer)
    inner = model.optimizer.inner_optimizer
    assert int(inner.iterations.numpy()) == 1
    logs = step(model, *overflow_batch(x, y))
    assert logs["skipped_steps"] == 1 and logs["loss_scale"] == 2.0**7
    for old, new in zip(weights, weights_of(model), strict=True):
        np.testing.assert_array_equal(old, new)
    after = optimizer_state(model.optimizer)
    changed = {path.rsplit("/", 1)[-1] for path in state
               if not np.array_equal(state[path], after[path])}
    # Only the scale state moves (scale halved, good-step count reset); Adam's
    # momentums, velocities and iterations do not.
    assert changed == {"dynamic_scale", "step_counter", "skipped_steps",
                       "first_nonfinite"}, changed
    assert int(inner.iterations.numpy()) == 1
    assert {v.path for v in inner.variables} <= set(state)
    good = step(model, x[:32], y[:32])
    assert good["skipped_steps"] == 1 and int(inner.iterations.numpy()) == 2
    assert not np.array_equal(weights[0], weights_of(model)[0])


def test_scale_doubles_after_growth_interval_good_steps_and_a_skip_resets_the_count():
    x, y = data(64)
    model = enabled_mlp(initial_scale=2.0**4, growth_interval=3)
    scales = [step(model, x[:32], y[:32])["loss_scale"] for _ in range(3)]
    assert scales == [2.0**4, 2.0**4, 2.0**5]
    step(model, x[:32], y[:32])  # one good step counted
    assert step(model, *overflow_batch(x, y))["loss_scale"] == 2.0**4  # skip: halve, reset
    scales = [step(model, x[:32], y[:32])["loss_scale"] for _ in range(3)]
    assert scales == [2.0**4, 2.0**4, 2.0**5]


def test_fixed_scale_skips_nonfinite_steps_and_never_changes():
    x, y = data(64)
    model = enabled_mlp(loss_scale=128, growth_interval=1)
    assert not model.optimizer.is_dynamic
    logs = [step(model, x[:32], y[:32]) for _ in range(3)]
    assert [entry["loss_scale"] for entry in logs] == [128.0] * 3
    weights = weights_of(model)
    skipped = step(model, *overflow_batch(x, y))
    assert skipped["loss_scale"] == 128.0 and skipped["skipped_steps"] == 1
    for old, new in zip(weights, weights_of(model), strict=True):
        np.testing.assert_array_equal(old, new)


def test_floor_holds_and_stuck_warning_names_the_first_bad_gradients_once():
    x, y = data(64)
    x[:, 0] = np.nan  # every gradient non-finite, whatever the scale
    model = enabled_mlp(keras.optimizers.SGD(1e-3), initial_scale=8.0, min_scale=4.0)
    with pytest.warns(RuntimeWarning, match=r"stuck at its floor \(4\).*dense") as record:
        history = model.fit(x, y, epochs=1, batch_size=8, verbose=0).history
    assert len([w for w in record if "stuck" in str(w.message)]) == 1
    assert history["loss_scale"] == [4.0] and history["skipped_steps"] == [8]


def test_custom_loop_with_scale_loss_gives_float32_gradients_once():
    x, y = data(32)
    model = mlp()
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=2.0**10)
    optimizer.build(model.trainable_variables)
    reference = mlp()
    ref_optimizer = keras.optimizers.SGD(0.1)

    @tf.function
    def train(model, optimizer, scaled):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
            target = optimizer.scale_loss(loss) if scaled else loss
        grads = tape.gradient(target, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)

    train(model, optimizer, True)
    train(reference, ref_optimizer, False)
    for got, want in zip(weights_of(model), weights_of(reference), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    # Gradients that were never scaled (no scale_loss) are not divided either.
    train(model, optimizer, False)
    train(reference, ref_optimizer, False)
    for got, want in zip(weights_of(model), weights_of(reference), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_checkpoint_resumes_scale_and_counters(tmp_path):
    x, y = data(64)
    model = enabled_mlp(initial_scale=2.0**6, growth_interval=5)
    step(model, x[:32], y[:32])
    step(model, *overflow_batch(x, y))
    step(model, x[:32], y[:32])
    optimizer = model.optimizer
    saved = optimizer_state(optimizer)
    path = tf.train.Checkpoint(optimizer=optimizer).save(str(tmp_path / "ckpt"))
    model.save_weights(str(tmp_path / "model.weights.h5"))

    fresh = enabled_mlp(initial_scale=2.0**6, growth_interval=5)
    fresh.optimizer.build(fresh.trainable_variables)
    tf.train.Checkpoint(optimizer=fresh.optimizer).restore(path).assert_consumed()
    # Variable paths carry per-instance names (adam_1/...): compare in order.
    for got, want in zip(optimizer_state(fresh.optimizer).values(), saved.values(),
                         strict=True):
        np.testing.assert_array_equal(got, want)
    assert float(fresh.optimizer.dynamic_scale.numpy()) == 2.0**5
    assert int(fresh.optimizer.skipped_steps.numpy()) == 1

    # Keras 3 weight files carry the optimizer, scale state included.
    again = enabled_mlp(initial_scale=2.0**6, growth_interval=5)
    again.optimizer.build(again.trainable_variables)
    again.load_weights(str(tmp_path / "model.weights.h5"))
    for got, want in zip(optimizer_state(again.optimizer).values(), saved.values(),
                         strict=True):
        np.testing.assert_array_equal(got, want)
    assert step(again, x[:32], y[:32])["skipped_steps"] == 1


@pytest.mark.parametrize("kwargs, error, message", [
    ({"loss_scale": "sometimes"}, ValueError, "'dynamic', a positive number or None"),
    ({"loss_scale": -1}, ValueError, "loss_scale must be a positive finite number"),
    ({"min_scale": 0}, ValueError, "min_scale must be a positive finite number"),
    ({"initial_scale": 1.0, "min_scale": 2.0}, ValueError, "below min_scale"),
])
def test_bad_settings_are_rejected(kwargs, error, message):
    with pytest.raises(error, match=message):
        LossScaleOptimizer(keras.optimizers.Adam(), **kwargs)
    with pytest.raises(error, match=message):
        tfamp.enable(mlp(), **kwargs)


def test_wraps_only_keras3_optimizers():
    import tf_keras

    with pytest.raises(TypeError, match="wraps a Keras 3 optimizer"):
        LossScaleOptimizer(tf_keras.optimizers.Adam())


def test_config_round_trip():
    optimizer = LossScaleOptimizer(keras.optimizers.Adam(3e-3), 512.0, min_scale=2.0)
    clone = LossScaleOptimizer.from_config(optimizer.get_config())
    assert clone.loss_scale_mode == 512.0 and not clone.is_dynamic
    assert clone.min_scale == 2.0 and clone.initial_scale == 512.0
    assert float(clone.inner_optimizer.learning_rate.numpy()) == pytest.approx(3e-3)
