"""Value ranges against float16's limits: bucketing, the report's shares and
recommendation, the Keras probe and callback, the entry points, and the picture."""

from __future__ import annotations

import importlib
import json
import math
import re

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

import tfamp
from tfamp import cli
from tfamp.env import EnvError, settings_from_env
from tfamp.keras.range_monitor import RangeMonitor
from tfamp.keras.range_probe import collect_keras_ranges
from tfamp.numerics import plot as ranges_plot
from tfamp.numerics import ranges
from tfamp.numerics.range_report import RangeReport
from tfamp.numerics.ranges import E_MIN, NUM_BINS, TensorRange, bucket_counts

# ------------------------------------------------------------- bucketing


@pytest.mark.parametrize("value, exponent", [
    (1.0, 0), (1.999, 0), (2.0, 1), (0.75, -1),
    (2.0**-24, -24), (2.0**-24 * 0.999, -25), (2.0**-14, -14), (65504.0, 15),
    (65536.0, 16), (-3.0, 1), (2.0**-63, -63),
])
def test_bucket_of_a_value_is_floor_log2(value, exponent):
    counts = bucket_counts(tf.constant([value], tf.float32)).numpy()
    assert counts.shape == (ranges.NUM_COLUMNS,)
    assert counts[exponent - E_MIN] == 1 and counts.sum() == 1
    assert exponent == math.floor(math.log2(abs(value)))


def test_special_values_have_their_own_columns():
    values = tf.constant([0.0, -0.0, np.inf, -np.inf, np.nan, 1e30, 2.0**-70, 1e-40],
                         tf.float32)
    counts = bucket_counts(values).numpy()
    assert counts[ranges.NONFINITE_COL] == 3
    assert counts[ranges.E_MAX - E_MIN] == 1          # 1e30 clipped to the top bin
    # 1e-40 is a float32 subnormal: TensorFlow's CPU kernels flush it to zero
    # (then it counts as a zero), else it is "tiny" and in the bottom bin.
    tiny = counts[ranges.TINY_COL]
    assert tiny in (0, 1) and counts[ranges.ZEROS_COL] == 3 - tiny
    assert counts[0] == 1 + tiny                      # 2^-70 clipped to the bottom bin


def test_bucketing_matches_numpy_on_random_data():
    rng = np.random.default_rng(0)
    data = (rng.standard_normal(5000) * np.exp2(rng.uniform(-50, 18, 5000))).astype("float32")
    for dtype in (tf.float32, tf.float16, tf.bfloat16):
        x = tf.cast(tf.constant(data), dtype)
        counts = bucket_counts(x).numpy()
        reference = np.abs(x.numpy().astype(np.float64))
        finite = reference[np.isfinite(reference) & (reference > 0)]
        exps = np.clip(np.floor(np.log2(finite)), E_MIN, ranges.E_MAX).astype(int) - E_MIN
        expected = np.bincount(exps, minlength=NUM_BINS)
        np.testing.assert_array_equal(counts[:NUM_BINS], expected, err_msg=dtype.name)
        assert counts[ranges.ZEROS_COL] == int((reference == 0).sum())


# --------------------------------------------------------- report maths


def entry(exponents: dict[int, int], kind="activation_gradient", name="t", **extra):
    counts = [0] * NUM_BINS
    for e, c in exponents.items():
        counts[e - E_MIN] = c
    return TensorRange(name, name, kind, counts, **extra)


@pytest.mark.parametrize("scale, under, subnormal, over", [
    (1.0, 0.5, 0.75, 0.0),      # 2^-30 lost, 2^-20 subnormal
    (2.0**6, 0.0, 0.5, 0.0),    # 2^-30 * 2^6 = 2^-24 kept; 2^-20 * 2^6 = 2^-14 normal
    (2.0**5, 0.5, 0.75, 0.0),
    (2.0**10, 0.0, 0.5, 0.0),   # 2^-20 * 2^10 = 2^-10: normal now
    (2.0**12, 0.0, 0.5, 0.25),  # 2^4 * 2^12 = 2^16: overflow
])
def test_shares_at_a_scale(scale, under, subnormal, over):
    t = entry({-30: 2, -20: 1, 4: 1})
    assert t.underflow_share(scale) == under
    assert t.subnormal_share(scale) == subnormal
    assert t.overflow_share(scale) == over


def test_highest_safe_scale_keeps_one_bit_of_headroom_and_is_capped():
    report = RangeReport("m", 1, None, [entry({-30: 3, -10: 1}),
                                        entry({-8: 1}, "weight_gradient", "w")])
    # largest exponent -8: bins up to 2^(-8+1+k) <= 2^(16-1) -> k = 22
    assert report.highest_safe_scale() == 2.0**22
    assert report.tensor("w", "weight_gradient").headroom_bits(2.0**22) == 1
    assert report.tensor("t", "activation_gradient").headroom_bits(2.0**22) == 3
    tiny = RangeReport("m", 1, None, [entry({-60: 1})])
    assert tiny.highest_safe_scale() == 2.0**ranges.MAX_SCALE_EXP
    huge = RangeReport("m", 1, None, [entry({17: 1})])
    assert huge.highest_safe_scale() == 1.0


def test_recommendation_says_the_start_scale_already_suffices():
    """Issue 20: "reaches 2^18 after 6000 good steps; 512 would suffice" while 2^15,
    where dynamic scaling starts, already lost nothing."""
    report = RangeReport("m", 2, None, [
        entry({-30: 31, -5: 69}, name="dense_3"),
        entry({-5: 10}, "weight_gradient", "dense_3/kernel")])
    advice = report.advice()
    assert advice.kind == "start_suffices"
    assert advice.scale == report.recommended_scale() == 2.0**15
    assert advice.sufficient == report.smallest_sufficient_scale() == 64.0  # 2^-30 * 64
    assert advice.ceiling == 2.0**19  # 16 - 1 - 1 - (-5)
    assert report.recommendation() == (
        "loss scaling is needed (without scaling 'dense_3' loses 31.0% of its values) and "
        "dynamic scaling's start scale 2^15 (32768) already suffices: no gradient loses "
        "more than 0.10% there; nothing to change (any fixed scale from 2^6 (64) to "
        "2^19 (524288) would do too).")
    assert report.dynamic_steps_to(2.0**12) == (3, "skipped")
    assert report.dynamic_steps_to(2.0**17) == (4000, "good")
    fine = RangeReport("m", 1, None, [entry({-3: 5})])
    assert fine.advice().kind == "no_scaling_needed" and fine.recommended_scale() == 1.0
    assert "without loss scaling" in fine.recommendation()


def test_recommendation_when_dynamic_scaling_must_grow_or_shrink():
    grow = RangeReport("m", 1, None, [entry({-42: 10, -5: 90}, name="deep")])
    advice = grow.advice()  # 2^-42 needs 2^18; the start 2^15 still loses 10%
    assert (advice.kind, advice.scale, advice.steps) == ("grow_to", 2.0**18, 6000)
    assert advice.sentence == (
        "loss scaling is needed (without scaling 'deep' loses 10.0% of its values); "
        "dynamic scaling starts at 2^15 (32768), where 'deep' still loses 10.0%, and "
        "reaches 2^18 (262144) only after 6000 good steps: start there "
        "(initial_scale=262144) or use a fixed scale of 262144.")
    shrink = RangeReport("m", 1, None, [entry({-30: 1, 3: 9}, name="big")])
    advice = shrink.advice()  # ceiling 2^(16-1-1-3) = 2^11; enough from 2^6
    assert (advice.kind, advice.scale, advice.ceiling, advice.steps) == (
        "shrink_to", 64.0, 2.0**11, 4)
    assert "overflows (the highest with head-room is 2^11 (2048)), so it skips 4 steps" in (
        advice.sentence)


def test_one_threshold_for_the_recommendation_the_summary_and_the_table():
    """A tensor losing 0.12% is "losing" everywhere; one losing 0.1% exactly nowhere."""
    above = entry({-60: 12, -3: 9988}, "weight_gradient", "bn/gamma")
    above.layer = "bn"
    at = entry({-60: 1, -3: 999}, "weight_gradient", "other/kernel")
    report = RangeReport("m", 1, None, [above, at])
    advice = report.advice()
    assert advice.kind == "keep_fp32" and advice.keep_fp32 == ("(^|/)bn/",)
    assert "'bn/gamma' loses 0.12% of its values (1 gradient(s) lose more than 0.10%)" in (
        advice.sentence)
    summary = report.summary_text()
    assert "gradients losing more than 0.10% of their values to 0: 1 of 2 at scale 1, 1 at" \
        in summary
    row = next(line for line in report.table_text().splitlines() if "bn/gamma" in line)
    assert "0.12%" in row
    assert ranges.format_pct(0.001) == "0.10%" and ranges.format_pct(0.00005) == "<0.01%"


def test_rounding_level_offsets_and_all_zero_gradients_are_not_evidence():
    """A bias feeding a BatchNorm: its gradient is a sum of the layer's output gradient
    that cancels exactly; float32 leaves rounding noise 2^-30 below it."""
    out_grad = entry({-8: 100}, "activation_gradient", "conv")
    bias = entry({-40: 4}, "weight_gradient", "conv/bias", max_abs=2.0**-40)
    bias.layer = "conv"
    kernel = entry({-10: 50}, "weight_gradient", "conv/kernel")
    kernel.layer = "conv"
    zero = entry({}, "weight_gradient", "head/beta", zeros=8)
    report = RangeReport("m", 1, None, [out_grad, bias, kernel, zero])
    advice = report.advice()
    assert set(advice.ignored) == {"conv/bias", "head/beta"}
    assert advice.ignored["head/beta"] == "all zero"
    assert advice.ignored["conv/bias"].startswith("rounding-level: largest value 2^-40")
    assert advice.kind == "no_scaling_needed" and report.worst_gradient().name != "conv/bias"
    assert "not counted: 2 gradient(s) zero or at rounding level" in report.summary_text()
    assert "conv/bias*" in report.table_text()
    # the same bias 2^-11 below its layer's output gradient is evidence
    bias.counts = entry({-19: 4}).counts
    assert "conv/bias" not in report.advice().ignored


def test_json_round_trip():
    report = RangeReport("m", 2, 1024.0, [entry({-30: 3, 2: 1}, zeros=4, nonfinite=1, tiny=0,
                                                 max_abs=5.0, steps=2)], notes=["n"])
    data = json.loads(report.to_json())
    assert data["recommended_scale"] == report.recommended_scale()
    again = RangeReport.from_dict(data)
    assert again.to_dict() == report.to_dict()
    with pytest.raises(ValueError, match="version 1 with exponents"):
        RangeReport.from_dict({**data, "e_min": -40})


# ------------------------------------------- a model whose gradients underflow

MULTIPLIER = 2.0**-26  # the loss is this small: its gradients sit below 2^-24


@keras.saving.register_keras_serializable(package="tfamp_tests")
def small_mse(y_true, y_pred):
    return MULTIPLIER * tf.reduce_mean(tf.square(y_true - y_pred), axis=-1)


def underflow_model(seed: int = 0):
    """An MLP trained on `MULTIPLIER * mse`: float32 gradients ~2^-30, all below
    float16's smallest subnormal unless the loss is scaled."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([
        keras.layers.Dense(32, activation="tanh", input_shape=(8,), name="hidden"),
        keras.layers.Dense(1, name="out")], name="tiny_loss")

    model.compile(optimizer=keras.optimizers.Adam(1e-2, epsilon=1e-30), loss=small_mse)
    return model


def check_underflow_and_recommendation(report):
    """The underflow model's gradients: lost at scale 1, kept at the recommended scale."""
    recommended = report.recommended_scale()
    assert recommended >= report.smallest_sufficient_scale() >= 2.0**5
    for t in report.gradients():
        assert t.underflow_share(1.0) > 0.9, t.name
        assert t.underflow_share(recommended) < 0.001, t.name
        assert t.overflow_share(recommended) == 0.0
    assert report.recommendation().startswith("loss scaling is needed")


def regression_data(samples=256, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((samples, 8)).astype("float32")
    y = (x @ rng.standard_normal((8, 1)) * 0.5).astype("float32")
    return x, y


def test_underflow_model_report_shows_loss_at_scale_1_and_none_at_the_recommended():
    model = underflow_model()
    x, y = regression_data()
    report = collect_keras_ranges(model, [(x[:64], y[:64]), (x[64:128], y[64:128])], steps=2)
    assert report.steps == 2 and report.loss_scale is None
    kinds = {t.kind for t in report.tensors}
    assert kinds == {"activation", "activation_gradient", "weight_gradient"}
    out_grad = report.tensor("out", "activation_gradient")
    assert out_grad.nonzero == 128  # 2 batches of 64 rows, 1 output
    check_underflow_and_recommendation(report)
    assert "loses 100.0% of its values" in report.recommendation() or \
        ">99.5%" in report.recommendation()
    # the forward activations are ordinary: nothing near float16's limits
    assert all(t.underflow_share() < 0.01 and t.overflow_share() == 0
               for t in report.of_kind("activation"))


def _fit_losses(loss_scale, epochs=6):
    model = underflow_model()
    x, y = regression_data()
    tfamp.enable(model, loss_scale=loss_scale)
    history = model.fit(x, y, batch_size=64, epochs=epochs, verbose=0, shuffle=False)
    return [v / MULTIPLIER for v in history.history["loss"]], model


def test_without_scaling_training_stalls_and_with_it_converges():
    stalled, model = _fit_losses(None)
    scaled, _ = _fit_losses("dynamic")
    # no scaling: float16 flushes every gradient to 0, so nothing moves
    assert stalled[-1] == pytest.approx(stalled[0], rel=1e-3)
    # dynamic scaling from 2^15 lifts them into range: the loss falls a lot
    assert scaled[-1] < 0.3 * scaled[0] and scaled[-1] < 0.3 * stalled[-1]


# ------------------------------------------------------- callback and hooks


def test_range_monitor_in_fit_changes_nothing_and_writes_the_files(tmp_path):
    x, y = regression_data()
    plain = underflow_model()
    plain_history = plain.fit(x, y, batch_size=32, epochs=1, verbose=0, shuffle=False)
    watched = underflow_model()
    monitor = RangeMonitor((x, y), steps=3, batch_size=32, output_dir=tmp_path / "r")
    history = watched.fit(x, y, batch_size=32, epochs=1, verbose=0, shuffle=False,
                          callbacks=[monitor])
    assert history.history["loss"] == plain_history.history["loss"]
    for a, b in zip(plain.variables, watched.variables, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.name)
    assert monitor.report is not None and monitor.report.steps == 3
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == [
        "ranges.html", "ranges.json", "ranges.png", "ranges.txt"]
    data = json.loads((tmp_path / "r" / "ranges.json").read_text())
    assert data == json.loads(monitor.report.to_json())
    assert "recommendation: " in (tmp_path / "r" / "ranges.txt").read_text()


@pytest.mark.parametrize("keras_module", ["tf_keras", "keras3"])
def test_subclassed_model_gets_weight_gradients_only(keras_module):
    base = keras.Model if keras_module == "tf_keras" else importlib.import_module("keras").Model

    class Sub(base):
        def __init__(self):
            super().__init__()
            self.d = (keras.layers.Dense(2) if keras_module == "tf_keras"
                      else importlib.import_module("keras").layers.Dense(2))

        def call(self, x):
            return self.d(x)

    model = Sub()
    model.compile(optimizer="adam", loss="mse")
    x, y = regression_data(32)
    model(x[:1])
    report = collect_keras_ranges(model, [(x, np.repeat(y, 2, axis=1))], steps=1)
    assert {t.kind for t in report.tensors} == {"weight_gradient"}
    assert any("subclassed model" in note for note in report.notes)


def test_enable_ranges_adds_the_monitor_and_tensorboard_histograms(tmp_path):
    model = underflow_model()
    x, y = regression_data()
    tfamp.enable(model, ranges=str(tmp_path / "out"))
    board = keras.callbacks.TensorBoard(log_dir=str(tmp_path / "tb"))
    model.fit(x, y, batch_size=64, epochs=1, verbose=0, callbacks=[board])
    written = json.loads((tmp_path / "out" / "ranges.json").read_text())
    # The dynamic scale started where the first batch's gradients put it (start_scale.py).
    assert written["steps"] == 3
    assert written["loss_scale"] == model._tfamp_state.start_scale.scale > 2.0**15
    check_tensorboard_histograms(tmp_path / "tb", written)


def check_tensorboard_histograms(log_dir, written: dict) -> dict:
    """Asserts the 'out' activation-gradient histogram in `log_dir` matches the JSON
    report `written`; returns every tag -> (plugin name, buckets)."""
    events = list((log_dir / "tfamp_ranges").glob("events.out.tfevents.*"))
    assert events
    tags = {}
    for event in tf.compat.v1.train.summary_iterator(str(events[0])):
        for value in event.summary.value:
            tags[value.tag] = (value.metadata.plugin_data.plugin_name,
                               tf.make_ndarray(value.tensor))
    plugin, buckets = tags["tfamp_ranges/activation_gradient/out"]
    assert plugin == "histograms" and buckets.shape == (NUM_BINS, 3)
    out = next(t for t in written["tensors"]
               if t["name"] == "out" and t["kind"] == "activation_gradient")
    np.testing.assert_array_equal(buckets[:, 2], out["counts"])
    assert buckets[0, 0] == E_MIN
    return tags


def test_tfamp_ranges_env(tmp_path):
    assert settings_from_env({}).ranges_dir is None
    assert settings_from_env({"TFAMP_RANGES": "off"}).ranges_dir is None
    assert settings_from_env({"TFAMP_RANGES": "1"}).ranges_dir == "tfamp_ranges"
    assert settings_from_env({"TFAMP_RANGES": str(tmp_path)}).ranges_dir == str(tmp_path)
    a_file = tmp_path / "f"
    a_file.write_text("")
    with pytest.raises(EnvError, match="TFAMP_RANGES=.* is a file; accepted values"):
        settings_from_env({"TFAMP_RANGES": str(a_file)})


def test_enable_rejects_a_bad_ranges_value():
    with pytest.raises(TypeError, match="ranges must be None, True or an output directory"):
        tfamp.enable(underflow_model(), ranges=3)


# ------------------------------------------------------------------ picture


@pytest.fixture(scope="module")
def underflow_report():
    model = underflow_model()
    x, y = regression_data()
    return collect_keras_ranges(model, [(x[:64], y[:64])], steps=1)


def test_png_draws_the_float16_ranges_and_the_shifted_histogram(underflow_report, tmp_path):
    from matplotlib.patches import Rectangle

    path = tmp_path / "r.png"
    figure = ranges_plot.write_png(underflow_report, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 20_000
    before, after = figure.axes
    k = ranges.scale_exponent(ranges_plot.after_scale(underflow_report))
    assert k == ranges.scale_exponent(underflow_report.recommended_scale()) > 0
    for ax in (before, after):
        spans = {p.get_gid(): (p.get_x(), p.get_x() + p.get_width()) for p in ax.patches
                 if p.get_gid()}
        assert spans["fp16_subnormal"] == (-24, -14)
        assert spans["fp16_normal"] == (-14, 16)
        assert spans["fp16_zero"][1] == -24 and spans["fp16_overflow"][0] == 16
    merged = underflow_report.combined("activation_gradient")
    expected = {E_MIN + i: 100 * c / merged.nonzero for i, c in enumerate(merged.counts)}

    def bars(ax):
        container = ax.containers[0]  # activation gradients
        return {round(b.get_x()): b.get_height() for b in container if isinstance(b, Rectangle)}

    drawn_before, drawn_after = bars(before), bars(after)
    for e, share in expected.items():
        assert drawn_before[e] == pytest.approx(share)
        assert drawn_after[e + k] == pytest.approx(share)
    # before: the mass sits left of 2^-24; after: right of it
    assert sum(h for x, h in drawn_before.items() if x < -24) > 90
    assert sum(h for x, h in drawn_after.items() if x >= -24) > 99.9


def test_html_page_renders_in_chromium(underflow_report, tmp_path):
    from tests.test_html_report import load

    page = tmp_path / "ranges.html"
    text = ranges_plot.render_ranges_html(underflow_report)
    assert text.isascii() and "http" not in text.replace("http://www.w3.org/2000/svg", "")
    page.write_text(text)
    dom = load(page, tmp_path, fragment="#k=0")
    status = dict(re.findall(r'([\w-]+)="([^"]*)"', re.search(
        r'<div id="status"[^>]*>', dom).group(0)))
    assert status["data-state"] == "ok" and status["data-k"] == "0"
    assert int(status["data-bars"]) > 20
    assert dom.count('class="panel"') == 3
    assert dom.count('class="span fp16_subnormal"') == 3 + len(underflow_report.tensors)
    for t in underflow_report.of_kind("activation_gradient"):
        row = re.search(rf'<tr data-name="{re.escape(t.name)}">(.*?)</tr>', dom).group(1)
        cell = re.search(r'data-col="lost at 1">([^<]*)<', row).group(1)
        assert cell == ranges.format_pct(t.underflow_share(1.0)).replace(">", "&gt;")
    dom_k = load(page, tmp_path, fragment="#k=20")
    assert 'data-k="20"' in dom_k and "lost at 2^20" in dom_k


# ---------------------------------------------------------------------- CLI


def test_cli_ranges_on_a_keras_file_and_a_saved_model(tmp_path, capsys):
    model = underflow_model()
    model.save(tmp_path / "m.keras")
    assert cli.main(["inspect", str(tmp_path / "m.keras"), "--ranges", "--batches", "2",
                     "-o", str(tmp_path / "k"), "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["steps"] == 2 and {t["kind"] for t in data["tensors"]} == {
        "activation", "activation_gradient", "weight_gradient"}
    assert (tmp_path / "k" / "ranges.png").is_file()

    tf.saved_model.save(model, str(tmp_path / "sm"))
    assert cli.main(["inspect", str(tmp_path / "sm"), "--ranges", "-o",
                     str(tmp_path / "s")]) == 0
    out = capsys.readouterr().out
    assert "forward pass only" in out and "tiny_loss/hidden/MatMul" in out
    # issue 20: the answer first, the table in the file (or with --table)
    lines = out.splitlines()
    assert lines[1].startswith("  recommendation: ") and "per-tensor ranges" not in out
    assert lines[-1].endswith("(the per-tensor table is in ranges.txt, or add --table)")
    assert "per-tensor ranges" in (tmp_path / "s" / "ranges.txt").read_text()
    assert cli.main(["inspect", str(tmp_path / "m.keras"), "--ranges", "--batches", "1",
                     "--batch-size", "4", "--table", "-o", str(tmp_path / "t")]) == 0
    out = capsys.readouterr().out
    assert out.index("recommendation: ") < out.index("per-tensor ranges")
    assert "synthetic batches of 4" in out
    saved = json.loads((tmp_path / "s" / "ranges.json").read_text())
    assert {t["kind"] for t in saved["tensors"]} == {"activation"}

    (tmp_path / "g.pbtxt").write_text("")
    assert cli.main(["inspect", str(tmp_path / "g.pbtxt"), "--ranges"]) == 2
    assert "needs a Keras model file" in capsys.readouterr().err


# ----------------------------------------------------- TFAMP_RANGES end to end

RANGES_SCRIPT = """
import numpy as np
import tf_keras as keras
keras.utils.set_random_seed(0)
x = np.random.default_rng(0).normal(size=(256, 8)).astype("float32")
y = x[:, :2].sum(axis=1, keepdims=True)
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dense(1)])
model.compile(optimizer="adam", loss="mse")
model.fit(x, y, epochs=1, batch_size=64, verbose=0)
"""


def run_with_tfamp_ranges(script_text: str, tmp_path) -> dict:
    """Runs `script_text` under TFAMP_ENABLE=1 TFAMP_RANGES=ranges_out; returns the JSON
    report it wrote, after checking the run and the log line."""
    import sysconfig
    from pathlib import Path

    from tests.test_env_activation import run

    hook = Path(sysconfig.get_paths()["purelib"]) / "tfamp_startup.pth"
    assert hook.is_file(), "run `bash scripts/setup.sh`: this test uses the installed package"
    script = tmp_path / "train.py"
    script.write_text(script_text)
    result = run(script, tmp_path, TFAMP_ENABLE="1", TFAMP_RANGES="ranges_out")
    assert result.returncode == 0, result.stderr[-3000:]
    folder = tmp_path / "ranges_out"
    assert re.search(r"value ranges of '\w+' written to", result.stderr)
    assert (folder / "ranges.png").stat().st_size > 20_000
    return json.loads((folder / "ranges.json").read_text())


@pytest.mark.slow  # a fresh interpreter importing TensorFlow: ~25 s on 2 busy cores
def test_tfamp_ranges_with_tfamp_enable_writes_the_picture(tmp_path):
    data = run_with_tfamp_ranges(RANGES_SCRIPT, tmp_path)
    assert data["model"] == "sequential"
    # The dynamic scale started where the first batch's gradients put it (a power of
    # two, recorded as the report's start), not at 2^15.
    assert data["steps"] == 3 and data["loss_scale"] == data["initial_scale"]
    assert data["loss_scale"] == 2.0 ** round(math.log2(data["loss_scale"]))
