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
import pytest
import tensorflow as tf
import tf_keras

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
    # The skips left the scale at 1; the probe, run again with the projection
    # float32, puts it where the 16-bit rest allows (it stayed 1 before, for the
    # thousands of steps dynamic scaling takes to grow it).
    assert history["loss_scale"][-1] >= 2**10, history
    assert all(np.all(np.isfinite(w)) for w in model.get_weights())
    assert np.all(np.isfinite(history["loss"]))
    assert history["loss"][-1] < history["loss"][0] and history["loss"][-1] < want[0], (
        history["loss"], want)


def test_layers_kept_float32_by_name_set_no_start_scale():
    """The start-scale probe guessed from the op lists what stays float32, so the
    zero row's 1e11 gradient in the projection, kept float32 by keep_fp32, held
    the scale at 1: a tiny loss then underflowed the head's float16 gradient
    (cosine 0.94 against float32). It now asks the rewrite."""
    keep = AmpConfig(keep_fp32=[r"zr(_\d+)?/proj(_\d+)?/"])
    model = tfamp.enable(unit_norm_model(), verbose=False, config=keep)
    history = model.fit(X, Y, batch_size=32, epochs=1, verbose=0).history
    found = model._tfamp_state.start_scale
    assert found.scale >= 2**10 and "proj" not in found.where, found
    assert history["skipped_steps"][-1] == 0, history


def layer_norm_model(k):
    """A BERT-style LayerNorm (epsilon 1e-12) after a Dense: a zero input row gives a
    row of equal values (the zero bias), whose variance is 0, so rsqrt(var + eps) is
    1e6; float16 makes it inf (Known limits: such normalisations are not held
    float32, they cost BERT's step 2 GB)."""
    k.utils.set_random_seed(0)
    inputs = k.Input((8,))
    h = k.layers.Dense(16, name="proj")(inputs)
    h = k.layers.LayerNormalization(epsilon=1e-12, name="ln")(h)
    model = k.Model(inputs, k.layers.Dense(3, name="head")(h), name="ve")
    model.compile(k.optimizers.Adam(1e-2),
                  k.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.parametrize("k", [keras, tf_keras], ids=["keras3", "tf_keras"])
def test_a_layer_norm_of_equal_values_falls_back(k):
    want = layer_norm_model(k).fit(X, Y, batch_size=32, epochs=3, verbose=0).history["loss"]
    model = tfamp.enable(layer_norm_model(k), verbose=False)
    history = model.fit(X, Y, batch_size=32, epochs=3, verbose=0).history
    moved = model._tfamp_state.fallback.moved
    assert moved and all("ln" in p for p in moved), moved
    assert history["skipped_steps"][-1] <= 3, history
    assert np.all(np.isfinite(history["loss"])), history
    assert abs(history["loss"][-1] - want[-1]) < 0.15, (history, want)


def contrastive_model(k):
    """SimCLR's shape (keras.io semisupervised_simclr), in Keras module `k`: a
    train_step of its own, an optimizer of its own (``contrastive_optimizer``), no
    compiled loss, fit(x) alone; its projection head's l2-normalised output is zero
    on a zero input row."""

    class ContrastiveModel(k.Model):
        def __init__(self):
            super().__init__()
            self.encoder = k.Sequential([k.Input((8,)), k.layers.Dense(16, activation="relu")])
            self.head = k.Sequential([k.Input((16,)), k.layers.Dense(16, activation="relu"),
                                      k.layers.Dense(16)], name="head")
            self.tracker = k.metrics.Mean(name="c_loss")

        def compile(self, contrastive_optimizer, **kwargs):
            super().compile(**kwargs)
            self.contrastive_optimizer = contrastive_optimizer

        @property
        def metrics(self):
            return [self.tracker]

        def train_step(self, data):
            with tf.GradientTape() as tape:
                z1 = tf.math.l2_normalize(self.head(self.encoder(data)), axis=1)
                z2 = tf.math.l2_normalize(self.head(self.encoder(data * 0.9)), axis=1)
                logits = tf.matmul(z1, z2, transpose_b=True) / 0.1
                loss = tf.reduce_mean(k.losses.sparse_categorical_crossentropy(
                    tf.range(tf.shape(data)[0]), logits, from_logits=True))
            weights = self.encoder.trainable_weights + self.head.trainable_weights
            self.contrastive_optimizer.apply_gradients(
                zip(tape.gradient(loss, weights), weights, strict=True))
            self.tracker.update_state(loss)
            return {"c_loss": self.tracker.result()}

    k.utils.set_random_seed(0)
    model = ContrastiveModel()
    model.compile(contrastive_optimizer=k.optimizers.Adam())
    return model


def _contrastive_fit(k, enable: bool):
    model = contrastive_model(k)
    if enable:
        model = tfamp.enable(model, verbose=False)
    x = np.random.default_rng(0).normal(size=(128, 8)).astype("float32")
    x[::8] = 0
    return model, model.fit(x, batch_size=32, epochs=4, verbose=0).history


@pytest.mark.parametrize("k", [keras, tf_keras], ids=["keras3", "tf_keras"])
def test_a_train_step_of_its_own_falls_back_too(k):
    """It was skipped at every step (the gradient dy * 1e6 of the zero row overflows
    the head's float16 weight-gradient MatMul), and the fallback could not look: no
    compiled loss, and fit(x) kept no batch."""
    _, want = _contrastive_fit(k, enable=False)
    model, history = _contrastive_fit(k, enable=True)
    moved = model._tfamp_state.fallback.moved
    assert moved and all("sequential" in p or "head" in p for p in moved), moved
    assert history["skipped_steps"][-1] <= 3, history
    assert history["c_loss"][-1] < history["c_loss"][0]
    assert abs(history["c_loss"][-1] - want["c_loss"][-1]) < 0.15, (history, want)


class SiameseModel(keras.Model):
    """metric_learning's shape (keras.io): one embedding model called on anchors and on
    positives in a train_step of its own; Keras 3 scopes the two calls apart
    (``embedding_1/...``, ``embedding_3/...``)."""

    def __init__(self):
        super().__init__()
        self.embedding = keras.Sequential([
            keras.Input((8,)), keras.layers.Dense(16, name="proj"),
            keras.layers.UnitNormalization(name="unit")], name="embedding")
        self.tracker = keras.metrics.Mean(name="pair_loss")

    def train_step(self, data):
        anchors, positives = data
        with tf.GradientTape() as tape:
            similarities = tf.matmul(self.embedding(anchors), self.embedding(positives),
                                     transpose_b=True) / 0.2
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
                tf.range(tf.shape(anchors)[0]), similarities, from_logits=True))
        weights = self.embedding.trainable_weights
        self.optimizer.apply_gradients(zip(tape.gradient(loss, weights), weights, strict=True))
        self.tracker.update_state(loss)
        # (the loss as a tensor too, as metric_learning returns it: Keras 3's History
        # then shows its own, never updated, loss tracker's 0)
        return {"loss": loss, "pair_loss": self.tracker.result()}


def test_every_call_of_the_overflowing_layer_moves():
    """The first batch has zero rows among the anchors only, later ones among the
    positives: a pattern for the anchors' call alone ('siamese_1/embedding_1/...')
    left the positives' call float16, and their steps skipped again, at the floor,
    with fit's first batch (finite by then) unable to say why."""
    rng = np.random.default_rng(0)
    anchors, positives = (rng.normal(size=(256, 8)).astype("float32") for _ in range(2))
    anchors[:32:4] = 0
    positives[32::4] = 0
    keras.utils.set_random_seed(0)
    model = SiameseModel()
    model.compile(keras.optimizers.Adam(1e-2))
    model = tfamp.enable(model, verbose=False)
    history = model.fit(tf.data.Dataset.from_tensor_slices((anchors, positives)).batch(32),
                        epochs=2, verbose=0).history
    moved = model._tfamp_state.fallback.moved
    assert moved and all(r"(_\d+)?" in p for p in moved), moved
    assert history["skipped_steps"][-1] <= 3, history
    assert history["pair_loss"][-1] < history["pair_loss"][0], history
    # Keras's never-updated loss tracker reads 0, as in float32: tfamp once made it
    # NaN in the epoch with the skipped steps (an empty metric taken for one every
    # step had put back)
    assert history["loss"] == [0.0, 0.0], history


def test_the_stuck_warnings_fix_names_every_call_too():
    """The stuck-at-floor warning's "Fix:" (``diagnose_keras_model``) named the one
    call's scope ('embedding_1/proj_1/'), which leaves the other call float16."""
    rng = np.random.default_rng(0)
    anchors, positives = (rng.normal(size=(32, 8)).astype("float32") for _ in range(2))
    anchors[::4] = 0
    keras.utils.set_random_seed(0)
    model = SiameseModel()
    model.compile(keras.optimizers.Adam(1e-2))
    model.embedding(anchors)  # (built, as fit's first step leaves it)
    found = locate_keras_nonfinite(model, anchors, positives, config=AmpConfig())
    assert found is not None and found.ran_16bit, found
    assert found.keep_fp32 == r"embedding(_\d+)?/proj(_\d+)?/", found.describe()
    assert r"TFAMP_KEEP_FP32='embedding(_\d+)?/proj(_\d+)?/'" in found.describe()


def test_every_call_keeps_a_layer_name_as_it_is():
    from tfamp.keras.call_scopes import every_call

    names = frozenset({"pipe", "frozen", "embedding", "proj", "dense", "dense_1"})
    assert every_call("pipe/frozen", names) == "pipe/frozen/"  # tf_keras: stable scopes
    pattern = every_call("embedding_1/proj_1", names)
    assert pattern == r"embedding(_\d+)?/proj(_\d+)?/"
    import re

    for name in ("embedding_1/proj_1/MatMul", "gradient_tape/embedding_3/proj_1/MatMul",
                 "embedding/proj/BiasAdd"):
        assert re.search(pattern, name), name
    assert not re.search(pattern, "embedding_1/unit_1/Rsqrt")
    assert every_call("sequential/dense_1", names) == "sequential/dense_1/"  # a layer's name


class Batches(keras.utils.PyDataset):
    """fit's data as a PyDataset (metric_learning's AnchorPositivePairs is a Sequence)."""

    def __init__(self):
        super().__init__()

    def __len__(self):
        return len(X) // 32

    def __getitem__(self, index):
        rows = slice(32 * index, 32 * (index + 1))
        return X[rows], Y[rows]


def test_a_py_dataset_is_read_again_for_the_fallback(caplog):
    """A Sequence / PyDataset used to stop the fallback: "fit's data cannot be re-read"."""
    caplog.set_level("INFO", logger="tfamp")
    model = tfamp.enable(unit_norm_model(), verbose=False)
    history = model.fit(Batches(), epochs=2, verbose=0).history
    assert model._tfamp_state.fallback.moved, [r.getMessage() for r in caplog.records]
    assert history["skipped_steps"][-1] <= 3, history
    [line] = [r.getMessage() for r in caplog.records if "float32 fallback" in r.getMessage()]
    # the regex as a shell reads it back: one backslash, not repr's two
    assert r"TFAMP_KEEP_FP32='zr(_\d+)?/proj(_\d+)?/'" in line, line
