"""BackupAndRestore under tfamp.enable: an interrupted, resumed float16 run ends as an
uninterrupted one, weights, loss scale and skipped-step count included (both Kerases)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tf_keras

import tfamp

KERASES = {"tf_keras": tf_keras, "keras3": keras}
EPOCHS, BATCH = 3, 16


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype("float32")
    y = x[:, :1].copy()
    x[5, 0] = 1e5  # finite in float32, inf in float16: one skipped step per epoch
    return x, y


def _model(keras_module):
    keras_module.utils.set_random_seed(0)
    inputs = keras_module.Input((8,))
    hidden = keras_module.layers.Dense(16, activation="relu")(inputs)
    model = keras_module.Model(inputs, keras_module.layers.Dense(1)(hidden))
    model.compile(optimizer=keras_module.optimizers.SGD(0.05), loss="mse")
    tfamp.enable(model, verbose=False)
    return model


def _state(model):
    scale, skipped = model._tfamp_state.read_scale()
    return [w.copy() for w in model.get_weights()], scale, skipped


@pytest.mark.parametrize("flavour", sorted(KERASES))
def test_interrupted_run_resumes_to_the_same_weights_scale_and_skips(flavour, tmp_path):
    keras_module = KERASES[flavour]
    x, y = _data()

    whole = _model(keras_module)
    whole.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    want = _state(whole)
    assert want[2] == EPOCHS  # the overflowing batch was skipped once per epoch

    class Interrupt(keras_module.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 1:
                raise RuntimeError("interrupted")

    backup = str(tmp_path / "backup")
    first = _model(keras_module)
    with pytest.raises(RuntimeError, match="interrupted"):
        first.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                  callbacks=[keras_module.callbacks.BackupAndRestore(backup), Interrupt()])
    resumed = _model(keras_module)  # a fresh process would build the model again
    resumed.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                callbacks=[keras_module.callbacks.BackupAndRestore(backup)])
    got = _state(resumed)
    assert got[1:] == want[1:]
    for a, b in zip(got[0], want[0], strict=True):
        np.testing.assert_array_equal(a, b)
