"""A plain TensorFlow custom training loop: no tfamp import anywhere.

    python examples/plain_custom_loop.py                 # float32
    TFAMP_ENABLE=1 python examples/plain_custom_loop.py  # mixed precision + loss scaling

Step 10 feeds a batch scaled by 1e20: its loss overflows even float32, so the
plain run's weights turn to nan there; with TFAMP_ENABLE=1 that step is skipped.
"""

import numpy as np
import tensorflow as tf
import tf_keras as keras

keras.utils.set_random_seed(0)
model = keras.Sequential([
    keras.layers.Dense(64, activation="relu", input_shape=(16,)),
    keras.layers.Dense(64, activation="relu"),
    keras.layers.Dense(1),
])
optimizer = keras.optimizers.Adam(1e-2)
rng = np.random.default_rng(0)
x = tf.constant(rng.normal(size=(256, 16)).astype("float32"))
y = tf.reduce_sum(x[:, :4], axis=1, keepdims=True)


@tf.function
def train_step(x, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
    return loss


for step in range(40):
    batch = x * 1e20 if step == 10 else x
    before = model.get_weights()[0].copy()
    loss = float(train_step(batch, y))
    if step == 10:
        same = np.array_equal(before, model.get_weights()[0])
        print(f"step 10 (overflowing batch): weights unchanged: {same}, "
              f"finite: {bool(np.isfinite(model.get_weights()[0]).all())}")
    if step % 10 == 9 or step == 39:
        print(f"step {step + 1}: loss {loss:.4f}")
