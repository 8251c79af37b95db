"""Keras 3 files from tfamp-enabled models: loadable without tfamp, optimizer state kept."""

import json
import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

import tfamp
from tests.keras3_helpers import data, mlp, optimizer_state, overflow_batch, weights_of
from tfamp.keras.optimizer_keras3 import LossScaleOptimizer


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TFAMP_")}
    env.update({"TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": "", **extra})
    return env


def run(script, *args, **env):
    result = subprocess.run([sys.executable, "-c", script, *args], capture_output=True,
                            text=True, timeout=300, env=clean_env(**env))
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A fitted, enabled model saved as .keras, with one skipped step in its history."""
    folder = tmp_path_factory.mktemp("keras3_files")
    x, y = data()
    model = mlp()
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    tfamp.enable(model, initial_scale=2.0**10)
    model.fit(x, y, epochs=1, batch_size=32, verbose=0)
    model.train_on_batch(*overflow_batch(x, y))
    path = str(folder / "model.keras")
    model.save(path)
    return path, model


_LOAD_WITHOUT_TFAMP = textwrap.dedent("""
    import json, sys, warnings
    import keras
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = keras.saving.load_model(sys.argv[1])
    print(json.dumps({
        "tfamp_imported": "tfamp" in sys.modules,
        "weights": [w.tolist() for w in model.get_weights()],
        "dtypes": [w.dtype for w in model.weights],
        "optimizer": type(model.optimizer).__name__,
        "optimizer_state": [v.numpy().tolist() for v in model.optimizer.variables],
        "warnings": [str(w.message) for w in caught],
    }))
""")


def test_keras_file_loads_without_tfamp_with_equal_float32_weights(saved):
    path, model = saved
    got, _ = run(_LOAD_WITHOUT_TFAMP, path)
    assert got["tfamp_imported"] is False
    assert got["dtypes"] == ["float32"] * len(model.weights)
    for loaded, want in zip(got["weights"], weights_of(model), strict=True):
        np.testing.assert_array_equal(np.array(loaded, dtype=np.float32), want)
    # The file records the optimizer given to compile; its state loads too.
    assert got["optimizer"] == "Adam"
    assert not [w for w in got["warnings"] if "Skipping variable loading" in w]
    inner = model.optimizer.inner_optimizer.variables
    assert len(got["optimizer_state"]) == len(inner)
    for loaded, want in zip(got["optimizer_state"], inner, strict=True):
        np.testing.assert_array_equal(np.array(loaded), want.numpy())


def test_reload_then_enable_keeps_optimizer_state_and_load_weights_resumes_scale(saved):
    path, model = saved
    reloaded = keras.saving.load_model(path)
    inner = model.optimizer.inner_optimizer
    assert int(reloaded.optimizer.iterations.numpy()) == int(inner.iterations.numpy()) == 8
    tfamp.enable(reloaded)
    for got, want in zip(reloaded.optimizer.inner_optimizer.variables, inner.variables,
                         strict=True):
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    # The scale state lives in the file too; load_weights after enable restores it.
    assert float(reloaded.optimizer.loss_scale.numpy()) == 2.0**15
    reloaded.load_weights(path)
    for got, want in zip(optimizer_state(reloaded.optimizer).values(),
                         optimizer_state(model.optimizer).values(), strict=True):
        np.testing.assert_array_equal(got, want)
    assert float(reloaded.optimizer.loss_scale.numpy()) == 2.0**9
    assert int(reloaded.optimizer.skipped_steps.numpy()) == 1


_LOAD_WITH_TFAMP_ENABLE = textwrap.dedent("""
    import json, sys, warnings
    import keras
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = keras.saving.load_model(sys.argv[1])
    optimizer = model.optimizer
    print(json.dumps({
        "optimizer": type(optimizer).__module__ + "." + type(optimizer).__name__,
        "scale": float(optimizer.dynamic_scale.numpy()),
        "skipped": int(optimizer.skipped_steps.numpy()),
        "iterations": int(optimizer.iterations.numpy()),
        "warnings": [str(w.message) for w in caught],
    }))
""")


def test_reload_under_tfamp_enable_keeps_all_optimizer_state(saved):
    path, model = saved
    got, _ = run(_LOAD_WITH_TFAMP_ENABLE, path, TFAMP_ENABLE="1")
    assert got["optimizer"] == "tfamp.keras.optimizer_keras3.LossScaleOptimizer"
    assert not [w for w in got["warnings"] if "optimizer" in w.lower()], got["warnings"]
    assert got["iterations"] == 8 and got["skipped"] == 1 and got["scale"] == 2.0**9


def test_a_float32_file_resumed_under_tfamp_enable_keeps_its_state_without_warnings(tmp_path):
    """A float32 checkpoint (keras.io's ModelCheckpoint) resumed under TFAMP_ENABLE:
    Keras warned "Skipping variable loading for optimizer 'adam' ... the saved
    optimizer has 0 variables" although tfamp restored every Adam variable."""
    x, y = data(64)
    model = mlp()
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    model.fit(x, y, epochs=1, batch_size=32, verbose=0)
    path = str(tmp_path / "float32.keras")
    model.save(path)
    got, _ = run(_LOAD_WITH_TFAMP_ENABLE.replace(
        '"scale"', '"state": [v.numpy().tolist() for v in optimizer.inner_optimizer.variables], '
        '"scale"'), path, TFAMP_ENABLE="1")
    assert got["optimizer"] == "tfamp.keras.optimizer_keras3.LossScaleOptimizer"
    assert not [w for w in got["warnings"] if "optimizer" in w.lower()], got["warnings"]
    assert got["iterations"] == 2
    want = [v.numpy().tolist() for v in model.optimizer.variables]
    assert len(want) > 2 and got["state"] == want


def test_file_saved_with_keras_loss_scale_optimizer_loads_into_tfamps(tmp_path):
    x, y = data(64)
    model = mlp()
    keras_lso = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(),
                                                    initial_scale=64.0)
    model.compile(optimizer=keras_lso, loss="mse")
    model.fit(x, y, epochs=1, batch_size=32, verbose=0)
    path = str(tmp_path / "keras_lso.weights.h5")
    model.save_weights(path)
    other = mlp()
    other.compile(optimizer=LossScaleOptimizer(keras.optimizers.Adam()), loss="mse")
    other.optimizer.build(other.trainable_variables)
    other.load_weights(path)
    assert float(other.optimizer.loss_scale.numpy()) == 64.0
    assert int(other.optimizer.iterations.numpy()) == 2
    for got, want in zip(other.optimizer.inner_optimizer.variables,
                         keras_lso.inner_optimizer.variables, strict=True):
        np.testing.assert_array_equal(got.numpy(), want.numpy())
