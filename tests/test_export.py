"""tfamp export: a mixed-precision SavedModel for serving, checked against float32.

Small models here (the default suite); the Keras applications, the BERT-style
encoder and the tf_keras CNN are in test_export_models.py (slow).
"""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tfamp
from tests.export_helpers import (
    folder_bytes,
    overflow_model,
    relative_error,
    serve_without_tfamp,
)
from tfamp import cli
from tfamp.serving.errors import ExportError


def run_cli(capsys, *argv):
    try:
        code = cli.main(list(argv))
    except SystemExit as stop:  # argparse's own errors
        code = stop.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def mlp_saved_model(tmp_path_factory):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((32,), name="features")
    h = keras.layers.Dense(64, activation="relu", name="hidden")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(10, name="logits")(h))
    folder = tmp_path_factory.mktemp("src") / "mlp"
    model.export(str(folder), verbose=False)
    return folder


def test_export_serves_without_tfamp_with_16bit_weights(mlp_saved_model, tmp_path):
    destination = tmp_path / "served"
    report = tfamp.export(mlp_saved_model, destination)
    assert report.written and report.within_tolerance
    signature = next(s for s in report.signatures if s.name == "serving_default")
    assert signature.weights_16bit == 4 and not signature.weights_float32
    assert signature.weight_casts_removed == 4 and signature.weight_casts_remaining == 0
    assert report.weight_bytes_after * 2 == report.weight_bytes_before
    x = np.random.default_rng(1).normal(size=(5, 32)).astype(np.float32)
    facts, served = serve_without_tfamp(destination, "serving_default", {"features": x},
                                        tmp_path)
    assert not facts["tfamp_imported"]
    assert facts["weight_casts"] == []
    assert facts["inputs"] == ["features"] and facts["input_dtypes"] == {"features": "float32"}
    assert facts["outputs"] == {"output_0": ["float32", [None, 10]]}
    reference = tf.saved_model.load(str(mlp_saved_model)).signatures["serving_default"](
        features=tf.constant(x))["output_0"].numpy()
    assert 0 < relative_error(served["output_0"], reference) <= report.tolerance
    # TF Serving's layout, and weights about half the size on disk
    assert (destination / "saved_model.pb").is_file()
    assert (destination / "variables" / "variables.index").is_file()
    assert (destination / "assets").is_dir()
    assert folder_bytes(destination / "variables") < 0.6 * folder_bytes(
        mlp_saved_model / "variables")
    dtypes = {v.dtype for v in tf.saved_model.load(str(destination)).weights_16bit}
    assert dtypes == {tf.float16}


def test_bfloat16_export(mlp_saved_model, tmp_path):
    report = tfamp.export(mlp_saved_model, tmp_path / "bf16",
                          config=tfamp.AmpConfig(dtype="bfloat16"))
    assert report.written and report.tolerance == pytest.approx(16 * 2 ** -8)
    loaded = tf.saved_model.load(str(tmp_path / "bf16"))
    assert {v.dtype for v in loaded.weights_16bit} == {tf.bfloat16}


def test_overflowing_layer_is_kept_float32_and_named(tmp_path):
    source = tmp_path / "overflow"
    overflow_model().export(str(source), verbose=False)
    report = tfamp.export(source, tmp_path / "served", signatures=["serving_default"])
    assert report.written and report.within_tolerance
    assert [k.layer.split("/")[-1] for k in report.kept_fp32] == ["frozen_1"]
    kept = report.kept_fp32[0]
    assert kept.step == "ranges" and "beyond float16's largest value 65504" in kept.reason
    # found by the float32 ranges: the first attempt and the fixed one, no bisection
    assert report.search["range_runs"] == 1 and report.search["evaluations"] == 2
    text = report.render_text()
    assert "kept float32 for accuracy" in text and "frozen_1" in text
    signature = report.signatures[0]
    assert {name.split("/")[0] for name, _ in signature.weights_float32} >= {"frozen"}
    x = np.random.default_rng(3).normal(size=(4, 8)).astype(np.float32)
    facts, served = serve_without_tfamp(tmp_path / "served", "serving_default",
                                        {"features": x}, tmp_path)
    reference = tf.saved_model.load(str(source)).signatures["serving_default"](
        features=tf.constant(x))["output_0"].numpy()
    assert np.all(np.isfinite(served["output_0"]))
    assert relative_error(served["output_0"], reference) <= report.tolerance


def test_overflow_without_the_search_would_be_nonfinite(tmp_path):
    """The failure the search repairs is real: the same model with its ranges step
    pointed at nothing (a tolerance check only) keeps inf/nan out of the output."""
    from tfamp.serving import api

    source = tmp_path / "overflow"
    overflow_model().export(str(source), verbose=False)
    with api.open_source(source, ["serving_default"]) as src:
        exporter = api._Exporter(src, 0.0078, [], 2, 16)
        first = exporter.attempt(tfamp.AmpConfig())
    row = first.errors["serving_default"][0]
    assert not row.within and row.nonfinite_new > 0


def test_cancellation_is_found_by_ranked_bisection(tmp_path):
    """An error without overflow (a large offset subtracted again loses float16's
    digits) is found by the ranked bisection."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,), name="x")
    offset = keras.layers.Dense(8, name="offset", bias_initializer=keras.initializers.Constant(
        3000.0))(inputs)
    centred = keras.layers.Lambda(lambda t: t - 3000.0, name="centre")(offset)
    outputs = keras.layers.Dense(4, name="head")(centred)
    source = tmp_path / "cancel"
    keras.Model(inputs, outputs).export(str(source), verbose=False)
    report = tfamp.export(source, tmp_path / "served", signatures=["serving_default"])
    assert report.written and report.within_tolerance
    assert report.kept_fp32 and all(k.step == "bisection" for k in report.kept_fp32)
    layers = {k.layer.split("/")[-1] for k in report.kept_fp32}
    assert layers & {"offset_1", "centre_1"}
    # one instrumented run + log2-many evaluations, not one per layer
    assert report.search["evaluations"] <= 6


def test_check_failure_writes_nothing_and_says_how_to_proceed(mlp_saved_model, tmp_path):
    destination = tmp_path / "served"
    with pytest.raises(ExportError, match="nothing was written.*--tolerance") as raised:
        tfamp.export(mlp_saved_model, destination, tolerance=1e-9)
    assert not destination.exists()
    assert not list(tmp_path.iterdir())  # no temporary folder left either
    assert raised.value.report is not None and not raised.value.report.written


def test_tf_keras_saved_model_with_batch_norm(tmp_path):
    tf_keras.utils.set_random_seed(0)
    model = tf_keras.Sequential([
        tf_keras.layers.Dense(32, activation="relu", input_shape=(16,), name="dense"),
        tf_keras.layers.BatchNormalization(name="bn"),
        tf_keras.layers.Dense(3, activation="softmax", name="probs")])
    source = tmp_path / "tfk"
    model.save(str(source), save_format="tf")
    report = tfamp.export(source, tmp_path / "served")
    assert report.written and report.within_tolerance
    signature = report.signatures[0]
    assert signature.weights_16bit == 4 and signature.weight_casts_remaining == 0
    x = np.random.default_rng(0).normal(size=(3, 16)).astype(np.float32)
    facts, served = serve_without_tfamp(tmp_path / "served", "serving_default",
                                        {"dense_input": x}, tmp_path)
    assert not facts["tfamp_imported"] and facts["weight_casts"] == []
    expected = model(x).numpy()
    assert relative_error(served["probs"], expected) <= report.tolerance


def test_keras_file_source_and_embedding_table_stored_16bit(tmp_path):
    """A .keras file is exported by its own Keras first; an embedding table read
    through a Gather and a Cast is stored 16-bit; token ids are drawn below the
    table's row count."""
    keras.utils.set_random_seed(0)
    ids = keras.Input((6,), dtype="int32", name="ids")
    h = keras.layers.Embedding(50, 16, name="embed")(ids)
    h = keras.layers.Dense(16, activation="relu", name="mix")(h)
    model = keras.Model(ids, keras.layers.Dense(3, name="out")(h))
    source = tmp_path / "tokens.keras"
    model.save(source)
    report = tfamp.export(source, tmp_path / "served")
    assert report.source_kind == "Keras 3 file" and report.written
    signature = report.signatures[0]
    assert "integers in [0, 50)" in signature.inputs
    assert signature.weight_casts_remaining == 0
    assert report.weight_bytes_after < 0.52 * report.weight_bytes_before  # the table too
    tokens = np.random.default_rng(0).integers(0, 50, size=(2, 6)).astype(np.int32)
    facts, served = serve_without_tfamp(tmp_path / "served", "serving_default",
                                        {"ids": tokens}, tmp_path)
    assert facts["weight_casts"] == []
    assert relative_error(served["output_0"], model(tokens).numpy()) <= report.tolerance


def test_assets_and_lookup_tables_are_carried(tmp_path):
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("a\nb\nc\n")

    class Scorer(tf.Module):
        def __init__(self):
            self.table = tf.lookup.StaticHashTable(
                tf.lookup.TextFileInitializer(str(vocab), tf.string, 0, tf.int64,
                                              tf.lookup.TextFileIndex.LINE_NUMBER), -1)
            self.w = tf.Variable(tf.random.stateless_normal([4, 3], seed=[1, 2]))

        @tf.function(input_signature=[tf.TensorSpec([None], tf.string),
                                      tf.TensorSpec([None, 4], tf.float32)])
        def serve(self, word, x):
            index = tf.cast(self.table.lookup(word), tf.float32)
            return {"score": tf.matmul(x, self.w) + index[:, None]}

    scorer = Scorer()
    source = tmp_path / "scorer"
    tf.saved_model.save(scorer, str(source), signatures={"serving_default": scorer.serve})
    vocab.unlink()  # the SavedModel's own copy in assets/ must be what is used
    report = tfamp.export(source, tmp_path / "served")
    assert report.written
    assert (tmp_path / "served" / "assets" / "vocab.txt").is_file()
    feed = {"word": np.array([b"c", b"z"]), "x": np.ones((2, 4), np.float32)}
    facts, served = serve_without_tfamp(tmp_path / "served", "serving_default", feed,
                                        tmp_path)
    expected = scorer.serve(tf.constant(feed["word"]), tf.constant(feed["x"]))["score"]
    np.testing.assert_allclose(served["score"], expected.numpy(), rtol=1e-2, atol=1e-2)


def test_user_inputs_from_npz(mlp_saved_model, tmp_path):
    batch = tmp_path / "batch.npz"
    np.savez(batch, features=np.ones((3, 32), np.float32))
    report = tfamp.export(mlp_saved_model, tmp_path / "served", inputs=[batch],
                          signatures=["serving_default"])
    assert report.signatures[0].inputs == f"1 batch from {batch}"
    wrong = tmp_path / "wrong.npz"
    np.savez(wrong, x=np.ones((3, 32), np.float32))
    with pytest.raises(ExportError, match="no array named 'features'.*takes features"):
        tfamp.export(mlp_saved_model, tmp_path / "other", inputs=[wrong])


def test_cli_export_text_and_json(mlp_saved_model, tmp_path, capsys):
    code, out, _ = run_cli(capsys, "export", str(mlp_saved_model), "-o",
                           str(tmp_path / "a"), "--signature", "serving_default")
    assert code == 0
    assert out.startswith(f"tfamp export: wrote {tmp_path / 'a'}: float16, weights ")
    for phrase in ("ops converted to float16:", "Casts reading a weight on every call: 0",
                   "max rel err", "checked on: random inputs", "variables on disk:"):
        assert phrase in out
    code, out, _ = run_cli(capsys, "export", str(mlp_saved_model), "-o",
                           str(tmp_path / "b"), "--format", "json", "--dtype", "bfloat16",
                           "--keep-fp32", "logits")
    data = json.loads(out)
    assert code == 0 and data["written"] and data["dtype"] == "bfloat16"
    sig = next(s for s in data["signatures"] if s["name"] == "serving_default")
    assert sig["accuracy"][0]["within"] and sig["weights_16bit"] == 2  # logits kept float32


@pytest.mark.parametrize("case", ["missing", "corrupt", "signature", "exists", "not_saved_model",
                                  "graph_file", "tolerance"])
def test_cli_bad_input_is_one_line(case, mlp_saved_model, tmp_path, capsys):
    destination = tmp_path / "out"
    argv = ["export", str(mlp_saved_model), "-o", str(destination)]
    expected = ""
    if case == "missing":
        argv[1] = str(tmp_path / "nope")
        expected = "no such file or directory"
    elif case == "corrupt":
        broken = tmp_path / "broken"
        broken.mkdir()
        (broken / "saved_model.pb").write_bytes(b"not a protobuf")
        argv[1] = str(broken)
        expected = "could not be loaded as a SavedModel"
    elif case == "signature":
        argv += ["--signature", "predict"]
        expected = "has no signature 'predict'; available signatures: serve, serving_default"
    elif case == "exists":
        destination.mkdir()
        (destination / "saved_model.pb").write_bytes(b"x")
        expected = "exists; pass --overwrite"
    elif case == "not_saved_model":
        destination.mkdir()
        (destination / "notes.txt").write_text("mine")
        argv.append("--overwrite")
        expected = "is not a SavedModel folder"
    elif case == "graph_file":
        graph = tmp_path / "g.pb"
        graph.write_bytes(b"")
        argv[1] = str(graph)
        expected = "a GraphDef holds no variables"
    elif case == "tolerance":
        argv += ["--tolerance", "-1"]
        expected = "expected a positive number"
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tfamp: error: ") and expected in lines[0]
    if case == "not_saved_model":
        assert (destination / "notes.txt").read_text() == "mine"  # untouched


def test_overwrite_replaces_a_saved_model(mlp_saved_model, tmp_path):
    destination = tmp_path / "served"
    tfamp.export(mlp_saved_model, destination, signatures=["serving_default"])
    (destination / "marker").write_text("old")
    tfamp.export(mlp_saved_model, destination, signatures=["serving_default"],
                 overwrite=True)
    assert not (destination / "marker").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["served"]
