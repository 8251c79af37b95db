"""LossScaleOptimizer: skip, halve, grow, floor, fixed scale, checkpoint, errors."""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

from tfamp.keras.optimizer_tf_keras import LossScaleOptimizer


def make(**kwargs):
    var = tf.Variable([1.0, 2.0], name="weight")
    other = tf.Variable([3.0], name="bias")
    optimizer = LossScaleOptimizer(keras.optimizers.Adam(0.1), **kwargs)
    return optimizer, var, other


def apply(optimizer, var, other, bad=False):
    grad = tf.constant([np.inf, 1.0]) if bad else tf.constant([0.5, -0.5])
    optimizer.apply_gradients([(grad, var), (tf.constant([0.25]), other)])


def snapshot(optimizer, var, other):
    slots = [v.numpy().copy() for v in optimizer.inner_optimizer.variables]
    return var.numpy().copy(), other.numpy().copy(), slots


def test_nonfinite_step_is_skipped_with_weights_and_slots_untouched():
    optimizer, var, other = make(initial_scale=1024.0)
    apply(optimizer, var, other)  # builds Adam's m and v with real values
    before = snapshot(optimizer, var, other)
    iterations = int(optimizer.iterations.numpy())
    apply(optimizer, var, other, bad=True)
    after = snapshot(optimizer, var, other)
    np.testing.assert_array_equal(before[0], after[0])
    np.testing.assert_array_equal(before[1], after[1])
    inner = optimizer.inner_optimizer
    slot_vars = [v for v in inner.variables if v is not inner.iterations]
    assert slot_vars, "Adam should have m and v slots"
    for old, new, v in zip(before[2], after[2], inner.variables, strict=True):
        if v is not inner.iterations:
            np.testing.assert_array_equal(old, new)
    assert float(optimizer.loss_scale) == 512.0
    assert int(optimizer.skipped_steps.numpy()) == 1
    # Documented choice: iterations still advance, so LR schedules count batches.
    assert int(optimizer.iterations.numpy()) == iterations + 1


def test_finite_step_updates_weights():
    optimizer, var, other = make()
    before = var.numpy().copy()
    apply(optimizer, var, other)
    assert not np.array_equal(before, var.numpy())
    assert int(optimizer.skipped_steps.numpy()) == 0


def test_scale_doubles_after_growth_interval_good_steps():
    optimizer, var, other = make(initial_scale=8.0, growth_interval=3)
    seen = []
    for _ in range(7):
        apply(optimizer, var, other)
        seen.append(float(optimizer.loss_scale))
    assert seen == [8.0, 8.0, 16.0, 16.0, 16.0, 32.0, 32.0]


def test_skip_resets_the_growth_count():
    optimizer, var, other = make(initial_scale=8.0, growth_interval=3)
    apply(optimizer, var, other)
    apply(optimizer, var, other)
    apply(optimizer, var, other, bad=True)  # 8 -> 4, count back to 0
    apply(optimizer, var, other)
    apply(optimizer, var, other)
    assert float(optimizer.loss_scale) == 4.0
    apply(optimizer, var, other)
    assert float(optimizer.loss_scale) == 8.0


def test_floor_holds_and_stuck_warning_names_the_variable_once():
    optimizer, var, other = make(initial_scale=8.0, min_scale=4.0)
    apply(optimizer, var, other, bad=True)  # 8 -> 4 (not yet at floor when skipped)
    assert float(optimizer.loss_scale) == 4.0
    assert optimizer.check_stuck() is False
    apply(optimizer, var, other, bad=True)  # at floor: first skip there
    apply(optimizer, var, other, bad=True)  # second: stuck
    assert float(optimizer.loss_scale) == 4.0
    with pytest.warns(RuntimeWarning, match=r"stuck at its floor \(4\).*weight"):
        assert optimizer.check_stuck() is True
    apply(optimizer, var, other, bad=True)
    assert optimizer.check_stuck() is False  # warns once only
    assert int(optimizer.skipped_steps.numpy()) == 4


def test_fixed_scale_skips_nonfinite_and_never_changes():
    optimizer, var, other = make(loss_scale=128)
    assert not optimizer.dynamic and optimizer.get_config()["dynamic"] is False
    before = var.numpy().copy()
    apply(optimizer, var, other, bad=True)
    np.testing.assert_array_equal(before, var.numpy())
    for _ in range(3):
        apply(optimizer, var, other)
    assert float(optimizer.loss_scale) == 128.0
    assert int(optimizer.skipped_steps.numpy()) == 1


def test_graph_mode_step_skips_too():
    optimizer, var, other = make(initial_scale=64.0)

    @tf.function
    def step(bad):
        grad = tf.where(bad, tf.constant([np.nan, 1.0]), tf.constant([0.5, 0.5]))
        optimizer.apply_gradients([(grad, var), (tf.constant([0.1]), other)])

    step(tf.constant(False))
    before = var.numpy().copy()
    step(tf.constant(True))
    np.testing.assert_array_equal(before, var.numpy())
    assert float(optimizer.loss_scale) == 32.0


def test_scaled_loss_gives_unscaled_float32_gradients():
    optimizer, var, _ = make(initial_scale=2.0**10)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(var * var)
    grads_and_vars = optimizer.compute_gradients(loss, [var], tape=tape)
    np.testing.assert_allclose(grads_and_vars[0][0].numpy(), 2 * var.numpy())


def test_checkpoint_resumes_scale_and_counters(tmp_path):
    optimizer, var, other = make(initial_scale=64.0, growth_interval=5)
    apply(optimizer, var, other, bad=True)
    apply(optimizer, var, other)
    path = tf.train.Checkpoint(optimizer=optimizer, var=var).save(str(tmp_path / "ckpt"))
    restored, var2, _ = make(initial_scale=2.0**15, growth_interval=5)
    tf.train.Checkpoint(optimizer=restored, var=var2).restore(path)
    assert float(restored.loss_scale) == 32.0
    assert int(restored.skipped_steps.numpy()) == 1
    assert int(restored.dynamic_counter.numpy()) == 1


@pytest.mark.parametrize("kwargs, error, message", [
    ({"loss_scale": "auto"}, ValueError, "must be 'dynamic', a positive number or None"),
    ({"loss_scale": -4}, ValueError, "loss_scale must be a positive finite number"),
    ({"loss_scale": True}, TypeError, "received True"),
    ({"growth_interval": 0}, ValueError, "growth_interval must be a positive"),
    ({"initial_scale": 0.5, "min_scale": 1.0}, ValueError, "below min_scale"),
])
def test_bad_settings_are_rejected(kwargs, error, message):
    with pytest.raises(error, match=message):
        LossScaleOptimizer(keras.optimizers.SGD(), **kwargs)
