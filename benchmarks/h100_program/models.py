"""The five Keras 3 training set-ups the benchmark compiles (model, optimizer, loss, one batch).

The same definitions as the team's H100 timing tool (``../shared/gpu_xla/export_hlo.py``),
so the compiled programs are the programs whose step times were measured on a real H100
and the calibration of the time estimate holds for them: ResNet-50, MobileNetV2 and
EfficientNetB0 from ``keras.applications`` (random weights, 224x224x3, 1000 classes, SGD with
momentum), a BERT-base encoder built from Keras layers (12 layers, width 768, sequence 128,
AdamW) and a two-layer LSTM language model (width 1024, sequence 64, vocabulary 10000, Adam).

Imported only in the export subprocess (it imports Keras).
"""

from __future__ import annotations

import keras
import numpy as np

from benchmarks.h100_program.plan import DEFAULT_BATCH


class PositionEmbedding(keras.layers.Layer):
    """BERT's learned position embedding, added to a [batch, seq, width] input."""

    def __init__(self, length: int, width: int, **kwargs):
        super().__init__(**kwargs)
        self.length, self.width = length, width

    def build(self, input_shape):
        self.pos = self.add_weight(shape=(self.length, self.width), name="pos",
                                   initializer=keras.initializers.RandomNormal(stddev=0.02))

    def call(self, x):
        return x + keras.ops.cast(self.pos, x.dtype)[None]


def _image(app, batch: int, rng):
    model = app(weights=None, input_shape=(224, 224, 3), classes=1000)
    x = rng.standard_normal((batch, 224, 224, 3), dtype=np.float32)
    y = rng.integers(0, 1000, (batch,)).astype(np.int32)
    return (model, keras.optimizers.SGD(learning_rate=0.1, momentum=0.9),
            keras.losses.SparseCategoricalCrossentropy(), x, y)


def _bert(batch: int, rng):
    seq, hidden, heads, ffn, layers, vocab = 128, 768, 12, 3072, 12, 30522
    ids = keras.Input((seq,), dtype="int32")
    h = keras.layers.Embedding(vocab, hidden)(ids)
    h = PositionEmbedding(seq, hidden)(h)
    h = keras.layers.LayerNormalization(epsilon=1e-12)(h)
    for _ in range(layers):
        a = keras.layers.MultiHeadAttention(heads, hidden // heads)(h, h)
        h = keras.layers.LayerNormalization(epsilon=1e-12)(h + a)
        f = keras.layers.Dense(ffn, activation="gelu")(h)
        f = keras.layers.Dense(hidden)(f)
        h = keras.layers.LayerNormalization(epsilon=1e-12)(h + f)
    cls = keras.layers.Dense(hidden, activation="tanh")(h[:, 0])
    model = keras.Model(ids, keras.layers.Dense(2)(cls))
    x = rng.integers(0, vocab, (batch, seq)).astype(np.int32)
    y = rng.integers(0, 2, (batch,)).astype(np.int32)
    return (model, keras.optimizers.AdamW(learning_rate=1e-4),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True), x, y)


def _lstm(batch: int, rng):
    seq, vocab = 64, 10000
    model = keras.Sequential([
        keras.Input((seq,), dtype="int32"),
        keras.layers.Embedding(vocab, 512),
        keras.layers.LSTM(1024, return_sequences=True),
        keras.layers.LSTM(1024, return_sequences=True),
        keras.layers.Dense(vocab),
    ])
    x = rng.integers(0, vocab, (batch, seq)).astype(np.int32)
    y = rng.integers(0, vocab, (batch, seq)).astype(np.int32)
    return (model, keras.optimizers.Adam(learning_rate=1e-3),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True), x, y)


def build(name: str, batch: int):
    """(model, optimizer, loss, x, y) for one of ``DEFAULT_BATCH``'s models, seeded."""
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    if name == "resnet50":
        return _image(keras.applications.ResNet50, batch, rng)
    if name == "mobilenetv2":
        return _image(keras.applications.MobileNetV2, batch, rng)
    if name == "efficientnetb0":
        return _image(keras.applications.EfficientNetB0, batch, rng)
    if name == "bert":
        return _bert(batch, rng)
    if name == "lstm":
        return _lstm(batch, rng)
    raise ValueError(f"unknown model {name!r}; expected one of {sorted(DEFAULT_BATCH)}")
