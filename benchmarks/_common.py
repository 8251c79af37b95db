"""Shared helpers for the benchmark scripts: TensorFlow start-up, models, tables.

Imported by ``rewrite_scaling.py`` and ``vs_grappler.py`` after they have set
their environment variables (TensorFlow reads them once, at import). Not a
test module and not part of the ``tfamp`` package.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:  # so `python benchmarks/X.py` finds tfamp without PYTHONPATH
    sys.path.insert(0, REPO_ROOT)

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# TensorFlow's C++ start-up notices go to fd 2 before TF_CPP_MIN_LOG_LEVEL applies;
# tfamp's command line filters them the same way.
from tfamp._quiet import import_tensorflow_quietly  # noqa: E402

import_tensorflow_quietly()
import tensorflow as tf  # noqa: E402
import tf_keras as keras  # noqa: E402

import tfamp  # noqa: E402

layers = keras.layers


# -- training steps -------------------------------------------------------------

def train_step(model, x_shape: Sequence[int], y_shape: Sequence[int], *,
               loss=None, y_dtype=tf.float32):
    """The ConcreteFunction of one Adam training step of `model` (MSE loss by default)."""
    optimizer = keras.optimizers.Adam()
    loss_fn = loss or keras.losses.MeanSquaredError()

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss_value = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss_value, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss_value

    return step.get_concrete_function(
        tf.TensorSpec(list(x_shape), tf.float32), tf.TensorSpec(list(y_shape), y_dtype))


def node_count(graph_def) -> int:
    """Nodes in the top graph plus every library function."""
    return len(graph_def.node) + sum(len(f.node_def) for f in graph_def.library.function)


def output_names(concrete) -> list[str]:
    return [t.name for t in concrete.graph.outputs]


def release_graphs() -> None:
    """Drops Keras' global state and collects, so the next graph is timed alone."""
    keras.backend.clear_session()
    gc.collect()


# -- models ---------------------------------------------------------------------

class _Stack(keras.Model):
    """Calls its blocks in order. Subclassed (not Sequential) so that a
    thousand blocks neither recurse past Python's limit in Keras' functional
    graph walk nor cost an eager build before tracing."""

    def __init__(self, blocks, head):
        super().__init__()
        self.blocks = blocks
        self.head = head

    def call(self, x, training=None):
        for block in self.blocks:
            x = block(x, training=training)
        return self.head(x)


def dense_stack(depth: int, width: int = 32, features: int = 32, classes: int = 10):
    """`depth` Dense+ReLU blocks and a Dense head; (model, x_shape, y_shape)."""
    blocks = [layers.Dense(width, activation="relu") for _ in range(depth)]
    return _Stack(blocks, layers.Dense(classes)), (8, features), (8, classes)


def conv_bn_stack(depth: int, channels: int = 8, size: int = 8, classes: int = 10):
    """`depth` Conv2D+BatchNorm+ReLU blocks, pooling and a Dense head."""
    blocks = []
    for _ in range(depth):
        blocks += [layers.Conv2D(channels, 3, padding="same", use_bias=False),
                   layers.BatchNormalization(), layers.ReLU()]
    head = keras.Sequential([layers.GlobalAveragePooling2D(), layers.Dense(classes)])
    return _Stack(blocks, head), (4, size, size, channels), (4, classes)


def resnet50(batch: int = 8):
    """Keras' ResNet-50 (random weights, nothing downloaded) at 64x64x3, 10 classes."""
    model = keras.applications.ResNet50(weights=None, input_shape=(64, 64, 3), classes=10)
    return model, (batch, 64, 64, 3), (batch, 10)


def mlp():
    model = keras.Sequential([
        keras.Input((64,)), layers.Dense(256, activation="relu"),
        layers.Dense(256, activation="relu"), layers.Dense(256, activation="relu"),
        layers.Dense(10)])
    return model, (32, 64), (32, 10)


def cnn_bn():
    model = keras.Sequential([
        keras.Input((32, 32, 3)),
        layers.Conv2D(16, 3, padding="same", use_bias=False), layers.BatchNormalization(),
        layers.ReLU(), layers.MaxPooling2D(),
        layers.Conv2D(32, 3, padding="same", use_bias=False), layers.BatchNormalization(),
        layers.ReLU(), layers.MaxPooling2D(),
        layers.Conv2D(64, 3, padding="same"), layers.BatchNormalization(), layers.ReLU(),
        layers.GlobalAveragePooling2D(), layers.Dense(10)])
    return model, (8, 32, 32, 3), (8, 10)


def resnet_small(blocks: int = 3, channels: int = 16):
    """A ResNet-style stack: conv-BN-ReLU-conv-BN + identity shortcut (Add) + ReLU."""
    inputs = keras.Input((32, 32, 3))
    h = layers.Conv2D(channels, 3, padding="same", use_bias=False)(inputs)
    h = layers.ReLU()(layers.BatchNormalization()(h))
    for _ in range(blocks):
        r = layers.Conv2D(channels, 3, padding="same", use_bias=False)(h)
        r = layers.ReLU()(layers.BatchNormalization()(r))
        r = layers.Conv2D(channels, 3, padding="same", use_bias=False)(r)
        r = layers.BatchNormalization()(r)
        h = layers.ReLU()(layers.Add()([h, r]))
    h = layers.GlobalAveragePooling2D()(h)
    return keras.Model(inputs, layers.Dense(10)(h)), (8, 32, 32, 3), (8, 10)


SEQ_LEN = 10


def lstm():
    model = keras.Sequential([keras.Input((SEQ_LEN, 16)), layers.LSTM(32), layers.Dense(10)])
    return model, (8, SEQ_LEN, 16), (8, 10)


def gru():
    model = keras.Sequential([keras.Input((SEQ_LEN, 16)), layers.GRU(32), layers.Dense(10)])
    return model, (8, SEQ_LEN, 16), (8, 10)


def transformer_block(seq: int = 16, dim: int = 32, heads: int = 4):
    inputs = keras.Input((seq, dim))
    attn = layers.MultiHeadAttention(num_heads=heads, key_dim=dim // heads)(inputs, inputs)
    h = layers.LayerNormalization()(layers.Add()([inputs, attn]))
    ff = layers.Dense(dim)(layers.Dense(2 * dim, activation="relu")(h))
    h = layers.LayerNormalization()(layers.Add()([h, ff]))
    h = layers.GlobalAveragePooling1D()(h)
    return keras.Model(inputs, layers.Dense(10)(h)), (8, seq, dim), (8, 10)


def bert_encoder(layers_count: int = 2, seq: int = 32, dim: int = 64, heads: int = 4,
                 vocab: int = 1000):
    """A BERT-style encoder: token + position embeddings, `layers_count` post-LN
    Transformer layers (MultiHeadAttention, LayerNorm, GELU Dense FFN), and a
    classifier on the first token. Inputs are floats mapped to token ids inside."""
    tokens = keras.Input((seq,))
    # Any float input maps to a valid id (the benchmark feeds random normals).
    ids = layers.Lambda(lambda t: tf.math.floormod(
        tf.cast(tf.abs(t) * 100.0, tf.int32), vocab))(tokens)
    h = layers.Embedding(vocab, dim)(ids)
    h = h + layers.Embedding(seq, dim)(tf.range(seq))
    h = layers.LayerNormalization()(h)
    for _ in range(layers_count):
        attn = layers.MultiHeadAttention(num_heads=heads, key_dim=dim // heads)(h, h)
        h = layers.LayerNormalization()(layers.Add()([h, attn]))
        ff = layers.Dense(4 * dim, activation="gelu")(h)
        ff = layers.Dense(dim)(ff)
        h = layers.LayerNormalization()(layers.Add()([h, ff]))
    first = layers.Lambda(lambda t: t[:, 0])(h)
    return keras.Model(tokens, layers.Dense(10)(first)), (8, seq), (8, 10)


def tile_graph_def(graph_def, copies: int, outputs: Sequence[str]):
    """`copies` disjoint copies of a graph in one GraphDef, node names prefixed "copyK/".

    A cheap way to a ~100k-node graph: tracing that many nodes takes minutes,
    copying a traced training step takes milliseconds. The library (if any) is
    shared. Returns (GraphDef, the outputs of every copy).
    """
    from tensorflow.core.framework import graph_pb2

    tiled = graph_pb2.GraphDef()
    tiled.versions.CopyFrom(graph_def.versions)
    tiled.library.CopyFrom(graph_def.library)
    tiled_outputs = []
    for k in range(copies):
        prefix = f"copy{k}/"
        for node in graph_def.node:
            new = tiled.node.add()
            new.CopyFrom(node)
            new.name = prefix + node.name
            new.input[:] = [f"^{prefix}{text[1:]}" if text.startswith("^") else prefix + text
                            for text in node.input]
            if "_class" in new.attr:  # colocation constraints name other nodes
                values = new.attr["_class"].list.s
                values[:] = [v.replace(b"loc:@", b"loc:@" + prefix.encode(), 1) for v in values]
        tiled_outputs.extend(prefix + name for name in outputs)
    return tiled, tiled_outputs


# -- timing and output ----------------------------------------------------------

def best_of(fn: Callable[[], Any], repeat: int, *, disable_gc: bool = False):
    """(best wall seconds, best CPU seconds, the last call's result) over `repeat` calls.

    Wall time is time.perf_counter; CPU time (time.process_time) is shown too
    because other processes may share the cores.
    """
    best_wall, best_cpu, result = float("inf"), float("inf"), None
    for _ in range(repeat):
        result = None  # let the previous result go before timing the next call
        was_enabled = gc.isenabled()
        if disable_gc:
            gc.disable()
        try:
            wall, cpu = time.perf_counter(), time.process_time()
            result = fn()
            best_wall = min(best_wall, time.perf_counter() - wall)
            best_cpu = min(best_cpu, time.process_time() - cpu)
        finally:
            if disable_gc and was_enabled:
                gc.enable()
    return best_wall, best_cpu, result


def load_average() -> str:
    try:
        return "/".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "n/a"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table; numbers right-aligned, text left-aligned."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    numeric = [all(_is_number(row[i]) for row in rows) if rows else False
               for i in range(len(headers))]

    def line(values):
        return "  ".join(v.rjust(w) if num else v.ljust(w)
                         for v, w, num in zip(values, widths, numeric, strict=True)).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in cells])


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _cell(value) -> str:
    if isinstance(value, float):
        if value != value:  # NaN
            return "-"
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def write_json(path: str, data: dict) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=1, sort_keys=False)
        handle.write("\n")


def environment() -> dict:
    import platform

    return {
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "tf_keras": keras.__version__,
        "tfamp": tfamp.__version__,
        "cpu_count": os.cpu_count(),
        "gpus": len(tf.config.list_physical_devices("GPU")),
    }
