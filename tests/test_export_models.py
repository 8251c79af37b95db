"""tfamp export on real architectures (slow): Keras 3 MobileNetV2 and ResNet50, a
BERT-style encoder, a tf_keras CNN saved as a SavedModel.

Each export must load and run in a process without tfamp, give outputs within
tolerance of float32, hold its weights in about half the bytes on disk, and have
no Cast that reads a weight on every call; the report must say so.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tfamp
from tests.export_helpers import (
    bert_style_encoder,
    folder_bytes,
    relative_error,
    serve_without_tfamp,
)

pytestmark = pytest.mark.slow


def _check(report, source, destination, feed, tmp_path, *, outputs=None):
    assert report.written and report.within_tolerance
    text = report.render_text()
    assert "Casts reading a weight on every call: 0" in text
    signature = next(s for s in report.signatures if s.name == "serving_default")
    assert signature.weight_casts_remaining == 0
    # the weights: about half; the variables folder written: about half of float32's
    assert report.weight_bytes_after < 0.55 * report.weight_bytes_before
    assert folder_bytes(destination / "variables") < 0.56 * report.weight_bytes_before
    facts, served = serve_without_tfamp(destination, "serving_default", feed, tmp_path)
    assert not facts["tfamp_imported"] and facts["weight_casts"] == []
    reference = tf.saved_model.load(str(source)).signatures["serving_default"](
        **{k: tf.constant(v) for k, v in feed.items()})
    for name in outputs or reference:
        assert relative_error(served[name], reference[name].numpy()) <= report.tolerance, name
    return report


@pytest.mark.parametrize("name, size", [("MobileNetV2", 96), ("ResNet50", 64)])
def test_keras3_applications(name, size, tmp_path):
    keras.utils.set_random_seed(0)
    model = getattr(keras.applications, name)(weights=None, input_shape=(size, size, 3))
    source, destination = tmp_path / "src", tmp_path / "served"
    model.export(str(source), verbose=False)
    report = tfamp.export(source, destination, signatures=["serving_default"])
    x = np.random.default_rng(1).normal(size=(2, size, size, 3)).astype(np.float32)
    # the input's name is Keras's, uniquified per process ("keras_tensor_12" after
    # another model was built): read it from the signature
    (input_name,) = tf.saved_model.load(str(source)).signatures[
        "serving_default"].structured_input_signature[1]
    _check(report, source, destination, {input_name: x}, tmp_path)
    assert not report.kept_fp32


def test_bert_style_encoder(tmp_path):
    model = bert_style_encoder()
    source, destination = tmp_path / "src", tmp_path / "served"
    model.export(str(source), verbose=False)
    report = tfamp.export(source, destination, signatures=["serving_default"])
    signature = report.signatures[0]
    assert "token_ids: integers in [0, 500)" in signature.inputs
    assert "segment_ids: integers in [0, 2)" in signature.inputs
    rng = np.random.default_rng(2)
    feed = {"token_ids": rng.integers(0, 500, (2, 16)).astype(np.int32),
            "segment_ids": rng.integers(0, 2, (2, 16)).astype(np.int32),
            "padding_mask": np.ones((2, 16), np.int32)}
    _check(report, source, destination, feed, tmp_path)


def test_tf_keras_cnn_saved_model(tmp_path):
    tf_keras.utils.set_random_seed(0)
    model = tf_keras.applications.MobileNetV2(weights=None, input_shape=(64, 64, 3),
                                              classes=10)
    source, destination = tmp_path / "src", tmp_path / "served"
    model.save(str(source), save_format="tf")
    report = tfamp.export(source, destination)
    x = np.random.default_rng(3).normal(size=(2, 64, 64, 3)).astype(np.float32)
    input_name = next(iter(tf.saved_model.load(str(source)).signatures["serving_default"]
                           .structured_input_signature[1]))
    _check(report, source, destination, {input_name: x}, tmp_path)
