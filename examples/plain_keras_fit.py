"""A plain tf_keras training script: no tfamp import anywhere.

    python examples/plain_keras_fit.py                              # float32
    TFAMP_ENABLE=1 python examples/plain_keras_fit.py               # float16 + loss scaling
    TFAMP_ENABLE=1 TFAMP_DTYPE=bfloat16 python examples/plain_keras_fit.py
    tfamp run examples/plain_keras_fit.py                           # same as TFAMP_ENABLE=1
"""

import numpy as np
import tf_keras as keras

keras.utils.set_random_seed(0)
rng = np.random.default_rng(0)
x = rng.normal(size=(2048, 16)).astype("float32")
y = x[:, :4].sum(axis=1, keepdims=True)

model = keras.Sequential([
    keras.layers.Dense(128, activation="relu", input_shape=(16,)),
    keras.layers.Dense(128, activation="relu"),
    keras.layers.Dense(1),
])
model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
history = model.fit(x, y, epochs=5, batch_size=64, validation_split=0.1, verbose=2)
print(f"final loss {history.history['loss'][-1]:.4f}")
print("predictions:", model.predict(x[:3], verbose=0).ravel())
