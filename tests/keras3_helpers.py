"""Small Keras 3 models and data shared by the tests/test_keras3_*.py files."""

from __future__ import annotations

import keras
import numpy as np


def data(n=256, features=16, seed=0):
    """Regression data: y = sum of the first 4 features."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    return x, x[:, :4].sum(axis=1, keepdims=True)


def mlp(seed=0, features=16, cls=None):
    """A two-layer MLP (functional, or `cls` built on the same layers)."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((features,))
    hidden = keras.layers.Dense(32, activation="relu")(inputs)
    outputs = keras.layers.Dense(1)(hidden)
    return (cls or keras.Model)(inputs, outputs)


def weights_of(model):
    return [v.numpy().copy() for v in model.weights]


def optimizer_state(optimizer):
    """Every optimizer variable's value (inner optimizer's too), by path."""
    return {v.path: v.numpy().copy() for v in optimizer.variables}


def overflow_batch(x, y, size=32):
    """A batch that is finite in float32 but overflows to inf in float16."""
    bx, by = x[:size].copy(), y[:size].copy()
    bx[0, 0] = 1e5
    return bx, by
