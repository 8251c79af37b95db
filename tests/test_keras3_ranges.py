"""Value ranges and the first non-finite op on Keras 3 models (``import keras``,
TensorFlow backend): the same entry points as for tf_keras (tests/test_ranges.py,
tests/test_nonfinite.py) give the same answers."""

from __future__ import annotations

import json
import math
import re
import zipfile

import keras
import numpy as np
import pytest
import tf_keras

import tfamp
from tests import keras3_helpers, test_ranges
from tests.test_nonfinite import EXP_16BIT, X, Y, fit_until_stuck
from tests.test_ranges import (
    check_tensorboard_histograms,
    check_underflow_and_recommendation,
    regression_data,
    run_with_tfamp_ranges,
)
from tfamp import cli
from tfamp.keras.overflow_locator import locate_keras_nonfinite
from tfamp.keras.range_monitor import RangeMonitor
from tfamp.keras.range_probe import KerasRangeProbe, collect_keras_ranges

MULTIPLIER = 2.0**-26  # the loss is this small: its gradients sit below 2^-24


@keras.saving.register_keras_serializable(package="tfamp_tests_keras3")
def small_mse(y_true, y_pred):
    return MULTIPLIER * keras.ops.mean(keras.ops.square(y_true - y_pred), axis=-1)


def underflow_model(seed: int = 0):
    """The Keras 3 twin of tests/test_ranges.py's model: gradients ~2^-30."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(32, activation="tanh", name="hidden"),
        keras.layers.Dense(1, name="out")], name="tiny_loss")
    model.compile(optimizer=keras.optimizers.Adam(1e-2, epsilon=1e-30), loss=small_mse)
    return model


def test_underflow_report_shows_loss_at_scale_1_and_none_at_the_recommended():
    model = underflow_model()
    x, y = regression_data()
    report = collect_keras_ranges(model, [(x[:64], y[:64]), (x[64:128], y[64:128])], steps=2)
    assert report.steps == 2 and report.loss_scale is None
    assert {(t.kind, t.name) for t in report.tensors} == {
        *((kind, layer) for kind in ("activation", "activation_gradient")
          for layer in ("hidden", "out")),
        *(("weight_gradient", v.path) for v in model.trainable_variables)}
    assert report.tensor("out", "activation_gradient").nonzero == 128
    check_underflow_and_recommendation(report)
    assert all(t.underflow_share() < 0.01 and t.overflow_share() == 0
               for t in report.of_kind("activation"))


def test_keras3_and_tf_keras_probes_agree_on_the_same_weights():
    # Same layers and weights in both Kerases: the buckets must be identical.
    x, y = regression_data()
    k3 = underflow_model()
    tk = test_ranges.underflow_model()  # the tf_keras twin: same layers, same loss
    tk.set_weights([v.numpy() for v in k3.weights])
    batch = [(x[:64], y[:64])]
    a = collect_keras_ranges(k3, batch, steps=1)
    b = collect_keras_ranges(tk, batch, steps=1)
    for kind in ("activation", "activation_gradient"):
        for layer in ("hidden", "out"):
            assert a.tensor(layer, kind).counts == b.tensor(layer, kind).counts, (kind, layer)


def test_range_monitor_is_a_keras3_callback_and_changes_nothing(tmp_path):
    x, y = regression_data()
    plain = underflow_model()
    plain_history = plain.fit(x, y, batch_size=32, epochs=1, verbose=0, shuffle=False)
    watched = underflow_model()
    monitor = tfamp.RangeMonitor((x, y), steps=3, batch_size=32, output_dir=tmp_path / "r")
    assert isinstance(monitor, keras.callbacks.Callback)
    assert isinstance(monitor, tf_keras.callbacks.Callback)
    history = watched.fit(x, y, batch_size=32, epochs=1, verbose=0, shuffle=False,
                          callbacks=[monitor])
    assert history.history["loss"] == plain_history.history["loss"]
    for a, b in zip(plain.variables, watched.variables, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)
    assert monitor.model is watched
    assert monitor.report is not None and monitor.report.steps == 3
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == [
        "ranges.html", "ranges.json", "ranges.png", "ranges.txt"]
    assert json.loads((tmp_path / "r" / "ranges.json").read_text()) == json.loads(
        monitor.report.to_json())


def test_probe_rejects_an_uncompiled_keras3_model():
    with pytest.raises(ValueError, match="has no loss: compile it first"):
        KerasRangeProbe(keras3_helpers.mlp())


def test_probe_restores_batch_norm_statistics_and_metrics():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    h = keras.layers.BatchNormalization(name="bn")(keras.layers.Dense(8)(inputs))
    model = keras.Model(inputs, keras.layers.Dense(1)(h))
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    x, y = regression_data(64)
    model.evaluate(x, y, verbose=0)  # builds the metrics; they hold values now
    state = [v for v in [*model.non_trainable_variables, *model.metrics_variables]]
    before = [v.numpy().copy() for v in state]
    report = collect_keras_ranges(model, [(x * 5 + 3, y)], steps=1)
    assert report.tensor("bn", "activation_gradient").nonzero > 0
    for variable, old in zip(state, before, strict=True):
        np.testing.assert_array_equal(variable.numpy(), old, err_msg=variable.path)


def test_enable_ranges_on_keras3_writes_the_files_and_tensorboard_histograms(tmp_path):
    model = underflow_model()
    x, y = regression_data()
    tfamp.enable(model, ranges=str(tmp_path / "out"))
    board = keras.callbacks.TensorBoard(log_dir=str(tmp_path / "tb"))
    history = model.fit(x, y, batch_size=64, epochs=1, verbose=0, callbacks=[board])
    # The dynamic scale started where the first batch's gradients put it (start_scale.py):
    # above 2^15 for this tiny loss, and the range report reads the same scale.
    start = model._tfamp_state.start_scale.scale
    assert history.history["loss_scale"] == [start] and start > 2.0**15
    written = json.loads((tmp_path / "out" / "ranges.json").read_text())
    assert written["steps"] == 3 and written["loss_scale"] == start
    assert written["initial_scale"] == start  # the advice reasons from where it started
    assert written["model"] == "tiny_loss"
    assert (tmp_path / "out" / "ranges.png").stat().st_size > 20_000
    tags = check_tensorboard_histograms(tmp_path / "tb", written)
    assert "tfamp_ranges/weight_gradient/tiny_loss/out/kernel" in tags


def test_range_monitor_reads_keras_own_loss_scale_optimizer(tmp_path):
    model = underflow_model()
    model.compile(optimizer=keras.optimizers.LossScaleOptimizer(
        keras.optimizers.Adam(), initial_scale=2.0**10), loss=small_mse)
    x, y = regression_data()
    monitor = RangeMonitor((x, y), steps=1, output_dir=None)
    model.fit(x, y, batch_size=64, epochs=1, verbose=0, callbacks=[monitor])
    assert monitor.report.loss_scale == 2.0**10
    assert monitor.written == {}


def test_inspect_ranges_on_a_keras3_file(tmp_path, capsys):
    model = underflow_model()
    model.save(tmp_path / "m.keras")
    with zipfile.ZipFile(tmp_path / "m.keras") as archive:
        assert json.loads(archive.read("metadata.json"))["keras_version"].startswith("3")
    assert cli.main(["inspect", str(tmp_path / "m.keras"), "--ranges", "--batches", "2",
                     "-o", str(tmp_path / "k"), "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["steps"] == 2 and data["model"] == "tiny_loss"
    assert {t["kind"] for t in data["tensors"]} == {
        "activation", "activation_gradient", "weight_gradient"}
    out_grad = next(t for t in data["tensors"]
                    if t["name"] == "out" and t["kind"] == "activation_gradient")
    assert sum(out_grad["counts"]) == 16  # 2 synthetic batches of 8 rows, all nonzero
    assert (tmp_path / "k" / "ranges.png").is_file()

    keras3_helpers.mlp().save(tmp_path / "uncompiled.keras")
    assert cli.main(["inspect", str(tmp_path / "uncompiled.keras"), "--ranges"]) == 2
    assert "saved without compile()" in capsys.readouterr().err


# ------------------------------------------------------- first non-finite op


def overflow_model():
    """Dense -> exp -> Dense; the Dense output is 12 for all-ones inputs:
    exp(12) = 162755 is finite in float32 and inf in float16."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    h = keras.layers.Dense(8, name="boost",
                           kernel_initializer=keras.initializers.Constant(3.0))(inputs)
    h = keras.layers.Lambda(lambda t: keras.ops.exp(t), name="expo")(h)
    out = keras.layers.Dense(1, name="head",
                             kernel_initializer=keras.initializers.Constant(1e-6))(h)
    model = keras.Model(inputs, out, name="planted")
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    return model


def test_planted_exp_overflow_in_keras3_is_named_with_its_fix():
    model = overflow_model()
    weights = keras3_helpers.weights_of(model)
    found = locate_keras_nonfinite(model, X, Y, config=EXP_16BIT)
    assert found is not None
    assert (found.op, found.phase, found.value) == ("Exp", "forward", "inf")
    # Keras 3 names scopes per graph ("planted_1/expo_1" in a fresh trace); the
    # stuck-at-floor test checks the name against the graph fit really runs.
    assert found.node == f"{found.layer}/Exp" and "expo" in found.layer
    assert found.ran_16bit and found.dtype == "float16" and not found.inserted_cast
    [source] = found.inputs
    assert source.dtype == "float16" and source.max_abs == pytest.approx(12.0)
    assert "allow_add=[]" in found.fix_oplist_api
    for old, new in zip(weights, keras3_helpers.weights_of(model), strict=True):
        np.testing.assert_array_equal(old, new)
    # The suggested keep_fp32 pattern removes this overflow (the next one is the
    # Cast into the head, as for tf_keras).
    fixed = EXP_16BIT.replace(keep_fp32=(found.keep_fp32,))
    second = locate_keras_nonfinite(model, X, Y, config=fixed)
    assert second is not None and second.inserted_cast and "head" in second.layer


def test_keras3_stuck_at_floor_warning_names_the_op():
    model = overflow_model()
    message = fit_until_stuck(model)
    node = re.search(r"Localised: first non-finite value \(inf\) comes from Exp '([^']+)' in "
                     r"the forward pass", message).group(1)
    pattern = re.search(r"TFAMP_KEEP_FP32='([^']+)'", message).group(1)
    # The op named and the suggested pattern are those of the graph fit runs.
    [report] = model.train_function.reports
    assert node in {n.name for n in report.nodes} and "expo" in node
    assert re.search(pattern, node)


# ----------------------------------------------------- TFAMP_RANGES end to end

# tests/test_ranges.py's script, written for Keras 3
RANGES_SCRIPT = test_ranges.RANGES_SCRIPT.replace("import tf_keras as keras", "import keras")


@pytest.mark.slow  # a fresh interpreter importing TensorFlow: ~25 s on 2 busy cores
def test_tfamp_ranges_with_tfamp_enable_on_keras3(tmp_path):
    data = run_with_tfamp_ranges(RANGES_SCRIPT, tmp_path)
    assert "import keras\n" in RANGES_SCRIPT and data["model"] == "sequential"
    # The dynamic scale started where the first batch's gradients put it (a power of
    # two, recorded as the report's start), not at 2^15.
    assert data["steps"] == 3 and data["loss_scale"] == data["initial_scale"]
    assert data["loss_scale"] == 2.0 ** round(math.log2(data["loss_scale"]))
    # float32 reference values: the probe is not rewritten by TFAMP_ENABLE
    assert any("float32 reference" in note for note in data["notes"])
