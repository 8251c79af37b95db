"""A row of zeros through a Keras 3 unit normalisation, where no static hold can help.

Keras 3 normalises as ``x * minimum(rsqrt(sum(x * x)), 1e12)``: on a zero row the
rsqrt is inf in float32 too (the minimum tames it), and the gradient is dy * 1e12.
Behind a linear Dense (zero bias: a black image's row stays zero) that gradient
reaches the Dense's weight-gradient MatMul, whose float16 Cast overflows at any
loss scale; float32 gives 0 there (the row's inputs are 0). The first non-finite
op is that Cast, not the rsqrt's intended inf, and the fallback moves the Dense.
"""

from __future__ import annotations

import keras
import numpy as np

import tfamp
from tfamp.config import AmpConfig
from tfamp.keras.overflow_locator import locate_keras_nonfinite

RNG = np.random.default_rng(0)
X = RNG.normal(size=(256, 8)).astype("float32")
X[::4] = 0  # every fourth row: the projection's output row is exactly zero
Y = RNG.integers(0, 3, 256)


def unit_norm_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    h = keras.layers.Dense(16, name="proj")(inputs)
    h = keras.layers.UnitNormalization(name="unit")(h)
    model = keras.Model(inputs, keras.layers.Dense(3, name="head")(h), name="zr")
    model.compile(keras.optimizers.Adam(1e-2),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_an_inf_float32_makes_and_tames_is_no_origin():
    found = locate_keras_nonfinite(unit_norm_model(), X[:32], Y[:32], config=AmpConfig())
    assert found is not None
    # not the rsqrt's inf (float32's own, clamped by the minimum) ...
    assert found.op != "Rsqrt" and found.ran_16bit, found.describe()
    # ... but the Cast that takes dy * 1e12 into the projection's weight gradient
    assert found.inserted_cast and found.phase == "backward", found.describe()
    assert "proj" in found.layer and "MatMul" in found.feeds[0], found.describe()
    assert found.inputs[0].max_abs > 65504 and found.inputs[0].nonfinite == 0


def test_the_fallback_moves_the_projection_and_training_goes_on():
    reference = unit_norm_model()
    want = reference.fit(X, Y, batch_size=32, epochs=3, verbose=0).history["loss"]
    model = tfamp.enable(unit_norm_model(), verbose=False)
    history = model.fit(X, Y, batch_size=32, epochs=3, verbose=0).history
    [moved] = model._tfamp_state.fallback.moved
    assert "proj" in moved, moved
    # skipped until the fallback (2 steps), then every step applies
    assert history["skipped_steps"][-1] <= 3, history
    assert all(np.all(np.isfinite(w)) for w in model.get_weights())
    assert np.all(np.isfinite(history["loss"]))
    assert history["loss"][-1] < history["loss"][0] and history["loss"][-1] < want[0], (
        history["loss"], want)
