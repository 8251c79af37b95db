"""Helpers for the ``tfamp export`` tests: models, and a process without tfamp."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

# Runs in a fresh interpreter that cannot import tfamp (a meta-path finder
# refuses it, TFAMP_* are unset, the working tree is not on sys.path), loads a
# SavedModel with TensorFlow alone and runs one signature on saved inputs.
_SERVE = textwrap.dedent("""
    import importlib.abc, json, sys
    class _NoTfamp(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "tfamp" or name.startswith("tfamp."):
                raise ImportError("tfamp is not installed here")
    sys.meta_path.insert(0, _NoTfamp())
    import numpy as np
    import tensorflow as tf
    folder, signature, inputs, outputs = sys.argv[1:5]
    loaded = tf.saved_model.load(folder)
    fn = loaded.signatures[signature]
    with np.load(inputs) as data:
        feed = {k: tf.constant(data[k]) for k in data.files}
    result = fn(**feed)
    np.savez(outputs, **{k: v.numpy() for k, v in result.items()})
    graph = fn.graph.as_graph_def()
    bodies = [list(graph.node)] + [list(f.node_def) for f in graph.library.function]
    weight_casts = []
    for nodes in bodies:
        by_name = {n.name: n for n in nodes}
        for n in nodes:
            if n.op != "Cast":
                continue
            source = by_name.get(n.input[0].split(":")[0])
            while source is not None and source.op in ("Identity", "GatherV2", "Reshape"):
                source = by_name.get(source.input[0].split(":")[0])
            if source is not None and source.op in ("ReadVariableOp", "ResourceGather"):
                weight_casts.append(n.name)
    variables = [(v.dtype.name, int(v.shape.num_elements())) for v in loaded.variables] \\
        if hasattr(loaded, "variables") else []
    print(json.dumps({"tfamp_imported": any(m.startswith("tfamp") for m in sys.modules),
                      "weight_casts": weight_casts, "variables": variables,
                      "inputs": sorted(fn.structured_input_signature[1]),
                      "input_dtypes": {k: s.dtype.name for k, s in
                                       fn.structured_input_signature[1].items()},
                      "outputs": {k: [s.dtype.name, s.shape.as_list()] for k, s in
                                  fn.structured_outputs.items()}}))
""")


def serve_without_tfamp(folder: Path, signature: str, feed: dict[str, np.ndarray],
                        work: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """Runs `signature` of the SavedModel `folder` in a process without tfamp.

    Returns:
      (facts: tfamp_imported, weight_casts, variables, inputs, outputs, the outputs).
    """
    inputs, outputs = work / "feed.npz", work / "served.npz"
    np.savez(inputs, **feed)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("TFAMP_") and k != "PYTHONPATH"}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    done = subprocess.run([sys.executable, "-c", _SERVE, str(folder), signature, str(inputs),
                           str(outputs)], capture_output=True, text=True, env=env,
                          cwd=str(work), timeout=600)
    # the error's first lines (its type and message) and its last (where it ended)
    assert done.returncode == 0, done.stderr[:2000] + "\n...\n" + done.stderr[-2000:]
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    with np.load(outputs) as data:
        return facts, {k: data[k] for k in data.files}


def relative_error(new: np.ndarray, ref: np.ndarray) -> float:
    """max |new - ref| / max |ref|, as the export's check computes it."""
    ref = ref.astype(np.float64)
    return float(np.max(np.abs(new.astype(np.float64) - ref)) / np.max(np.abs(ref)))


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def overflow_model():
    """A Keras 3 model whose frozen first layer's outputs exceed float16's range,
    normalised by the next layer."""
    import keras

    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,), name="features")
    h = keras.layers.Dense(16, name="frozen", trainable=False,
                           kernel_initializer=keras.initializers.RandomNormal(
                               stddev=3e4, seed=1))(inputs)
    h = keras.layers.LayerNormalization(name="norm")(h)
    h = keras.layers.Dense(16, activation="relu", name="hidden")(h)
    return keras.Model(inputs, keras.layers.Dense(4, name="head")(h))


def bert_style_encoder(vocab: int = 500, length: int = 16, hidden: int = 64, heads: int = 4,
                       layers: int = 2, seed: int = 0):
    """A small BERT-style encoder from Keras 3 layers, shaped like keras-hub's
    BertBackbone: token_ids, segment_ids and padding_mask in; sequence_output and
    pooled_output out (random weights)."""
    import keras

    keras.utils.set_random_seed(seed)
    token_ids = keras.Input((length,), dtype="int32", name="token_ids")
    segment_ids = keras.Input((length,), dtype="int32", name="segment_ids")
    padding_mask = keras.Input((length,), dtype="int32", name="padding_mask")
    positions = keras.ops.arange(length)
    h = (keras.layers.Embedding(vocab, hidden, name="token_embedding")(token_ids)
         + keras.layers.Embedding(length, hidden, name="position_embedding")(positions)[None]
         + keras.layers.Embedding(2, hidden, name="segment_embedding")(segment_ids))
    h = keras.layers.LayerNormalization(epsilon=1e-12, name="embeddings_layer_norm")(h)
    mask = keras.ops.cast(padding_mask, "bool")[:, None, :]
    for i in range(layers):
        attention = keras.layers.MultiHeadAttention(heads, hidden // heads,
                                                    name=f"layer_{i}_attention")
        a = attention(h, h, attention_mask=mask)
        h = keras.layers.LayerNormalization(epsilon=1e-12, name=f"layer_{i}_attention_norm")(h + a)
        f = keras.layers.Dense(4 * hidden, activation="gelu", name=f"layer_{i}_ffn_in")(h)
        f = keras.layers.Dense(hidden, name=f"layer_{i}_ffn_out")(f)
        h = keras.layers.LayerNormalization(epsilon=1e-12, name=f"layer_{i}_ffn_norm")(h + f)
    pooled = keras.layers.Dense(hidden, activation="tanh", name="pooled_dense")(h[:, 0])
    return keras.Model({"token_ids": token_ids, "segment_ids": segment_ids,
                        "padding_mask": padding_mask},
                       {"sequence_output": h, "pooled_output": pooled})
