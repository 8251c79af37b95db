"""Keras 3 models: tfamp against Keras's own mixed policies and grappler's AMP pass.

For each model (ResNet50, MobileNetV2, EfficientNetB0 from ``keras.applications``
with random weights; a BERT-base-like encoder built from Keras layers; an LSTM
language model), with the TensorFlow backend, the step ``fit`` runs
(``model.train_step`` on one batch, traced as a tf.function, nothing executed)
is traced in float32 and again under the ``mixed_float16`` and
``mixed_bfloat16`` global policies. Rows:

* ``float32``: the float32 step as traced;
* ``keras mixed_float16`` / ``keras mixed_bfloat16``: the step traced with the
  policy set, measured as it is;
* ``grappler float16`` / ``grappler bfloat16``: grappler's AMP pass run offline
  on the float32 step (as in ``vs_grappler.py``: ``auto_mixed_precision_cpu``
  really retyping to half, ``auto_mixed_precision_onednn_bfloat16``);
* ``tfamp float16`` / ``tfamp bfloat16``: ``rewrite_graph_def`` of the float32
  step (``--device-type``, GPU by default: the kernels a GPU has), Casts placed
  for TensorFlow's executor (``AmpConfig.runtime="executor"``, what "auto" is
  for a bare GraphDef);
* ``tfamp float16 xla`` / ``tfamp bfloat16 xla``: the same, placed for XLA
  (``runtime="xla"``, what "auto" is for a step compiled with ``jit_compile``,
  Keras 3's default on a GPU). The summary compares these by the XLA cost and
  the executor-placed rows by the other two estimates.

Columns: tfamp's traffic estimate (float bytes written + read per step,
``tfamp.rewrite.traffic``) as a share of the float32 step's, what a GPU pays
by each runtime's estimate (``tfamp.rewrite.runtime_cost``: TensorFlow's
executor, bytes + kernel launches; XLA, bytes materialised at fusion
boundaries + fused kernels) as a share of the float32 step's, the float-to-float
Casts in the step, what those Casts move, and the share of matrix FLOPs
(MatMul, BatchMatMul, Conv2D and their gradients, Einsum; ``tfamp.inspect.flops``)
computed in 16-bit. grappler's and tfamp's outputs are measured with the float32
step's shapes (their nodes keep their names; new Casts take their input's).

    python benchmarks/keras3_models.py                 # 224x224, batch 32, BERT seq 128
    python benchmarks/keras3_models.py --small         # 64x64, batch 8, seq 32: a minute or two
    python benchmarks/keras3_models.py --models resnet50,bert --json out/k3.json
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.pop("TF_USE_LEGACY_KERAS", None)  # Keras 3, whatever the shell says
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# vs_grappler sets grappler's environment (real float16, oneDNN bfloat16) before
# it imports TensorFlow; its grappler set-up and traffic measure are reused.
import vs_grappler  # noqa: E402, I001
from _common import tf, tfamp, write_json  # noqa: E402
import keras  # noqa: E402  (Keras 3)
from tensorflow.core.framework import types_pb2  # noqa: E402
from tensorflow.python.grappler import cluster as gcluster  # noqa: E402
from tensorflow.python.grappler import tf_optimizer  # noqa: E402

from tfamp.inspect.flops import graph_def_flops  # noqa: E402
from tfamp.rewrite.graph import build_view  # noqa: E402
from tfamp.rewrite.shapes import tensor_shapes  # noqa: E402

log = logging.getLogger("keras3_models")

FLOAT_TYPES = frozenset({types_pb2.DT_FLOAT, types_pb2.DT_HALF, types_pb2.DT_BFLOAT16})
SIXTEEN_BIT = frozenset({types_pb2.DT_HALF, types_pb2.DT_BFLOAT16})
POLICIES = {"float16": "mixed_float16", "bfloat16": "mixed_bfloat16"}


# -- models ----------------------------------------------------------------------

class _Positions(keras.layers.Layer):
    """Adds a learned position embedding (BERT's) to a [batch, seq, width] input."""

    def __init__(self, length: int, width: int, **kwargs):
        super().__init__(**kwargs)
        self.length, self.width = length, width

    def build(self, input_shape):
        self.table = self.add_weight(shape=(self.length, self.width), name="positions",
                                     initializer=keras.initializers.RandomNormal(stddev=0.02))

    def call(self, x):
        return x + keras.ops.cast(self.table, x.dtype)[None]


def _image_app(app):
    def build(size: dict):
        side = size["image"]
        model = app(weights=None, input_shape=(side, side, 3), classes=1000)
        return (model, keras.optimizers.SGD(learning_rate=0.1, momentum=0.9),
                keras.losses.SparseCategoricalCrossentropy(),
                tf.TensorSpec([size["batch"], side, side, 3], tf.float32),
                tf.TensorSpec([size["batch"]], tf.int32))
    return build


def bert(size: dict):
    """A BERT-base-like encoder (12 layers of width 768 at full size): token and
    position embeddings, post-LN blocks of MultiHeadAttention and a GELU FFN, a
    pooled first token and a 2-way classifier; AdamW."""
    seq, vocab = size["seq"], 30522
    width, layers, heads = size["bert_width"], size["bert_layers"], size["bert_heads"]
    ids = keras.Input((seq,), dtype="int32")
    h = keras.layers.Embedding(vocab, width)(ids)
    h = keras.layers.LayerNormalization(epsilon=1e-12)(_Positions(seq, width)(h))
    for _ in range(layers):
        attention = keras.layers.MultiHeadAttention(heads, width // heads)(h, h)
        h = keras.layers.LayerNormalization(epsilon=1e-12)(h + attention)
        ffn = keras.layers.Dense(4 * width, activation="gelu")(h)
        h = keras.layers.LayerNormalization(epsilon=1e-12)(h + keras.layers.Dense(width)(ffn))
    pooled = keras.layers.Dense(width, activation="tanh")(h[:, 0])
    model = keras.Model(ids, keras.layers.Dense(2)(pooled))
    return (model, keras.optimizers.AdamW(learning_rate=1e-4),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            tf.TensorSpec([size["batch"], seq], tf.int32),
            tf.TensorSpec([size["batch"]], tf.int32))


def lstm_lm(size: dict):
    """A word-level LSTM language model: embedding, two LSTMs, a softmax over
    the vocabulary at every position; Adam."""
    seq, vocab, width = size["lstm_seq"], size["vocab"], size["lstm_width"]
    model = keras.Sequential([
        keras.Input((seq,), dtype="int32"),
        keras.layers.Embedding(vocab, width // 2),
        keras.layers.LSTM(width, return_sequences=True),
        keras.layers.LSTM(width, return_sequences=True),
        keras.layers.Dense(vocab),
    ])
    return (model, keras.optimizers.Adam(learning_rate=1e-3),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            tf.TensorSpec([size["batch"], seq], tf.int32),
            tf.TensorSpec([size["batch"], seq], tf.int32))


MODELS = {
    "resnet50": ("ResNet50", _image_app(keras.applications.ResNet50)),
    "mobilenetv2": ("MobileNetV2", _image_app(keras.applications.MobileNetV2)),
    "efficientnetb0": ("EfficientNetB0", _image_app(keras.applications.EfficientNetB0)),
    "bert": ("BERT-base-like encoder", bert),
    "lstm": ("LSTM language model", lstm_lm),
}
FULL = {"image": 224, "batch": 32, "seq": 128, "bert_width": 768, "bert_layers": 12,
        "bert_heads": 12, "lstm_seq": 64, "lstm_width": 1024, "vocab": 10000}
SMALL = {"image": 64, "batch": 8, "seq": 32, "bert_width": 256, "bert_layers": 4,
         "bert_heads": 4, "lstm_seq": 16, "lstm_width": 256, "vocab": 2000}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Keras 3 models: tfamp vs Keras mixed policies vs grappler's AMP pass "
                    "(estimated traffic, Casts, 16-bit matrix FLOPs).")
    parser.add_argument("--models", type=vs_grappler._names(MODELS), default=tuple(MODELS),
                        help=f"comma-separated subset of {','.join(MODELS)}")
    parser.add_argument("--small", action="store_true",
                        help="64x64 images, batch 8, BERT 4x256 at seq 32, LSTM 2x256 over "
                             "16 steps (for 2 cores)")
    parser.add_argument("--image", type=int, help="image side (default 224, --small 64)")
    parser.add_argument("--batch", type=int, help="batch size (default 32, --small 8)")
    parser.add_argument("--seq", type=int, help="BERT sequence length (default 128, --small 32)")
    parser.add_argument("--device-type", default="GPU", choices=("GPU", "CPU"),
                        help="kernels tfamp may use (default GPU)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    parser.add_argument("-v", "--verbose", action="store_true", help="progress on stderr")
    args = parser.parse_args(argv)
    args.size = dict(SMALL if args.small else FULL)
    for key in ("image", "batch", "seq"):
        if getattr(args, key) is not None:
            if getattr(args, key) < 1:
                parser.error(f"--{key} must be at least 1, received {getattr(args, key)}")
            args.size[key] = getattr(args, key)
    return args


# -- tracing ---------------------------------------------------------------------

def trace_step(key: str, size: dict, policy: str):
    """(GraphDef with shapes, output tensor names, fetch node names) of the fit step."""
    keras.backend.clear_session()
    keras.mixed_precision.set_global_policy(policy)
    try:
        keras.utils.set_random_seed(0)
        model, optimizer, loss, x_spec, y_spec = MODELS[key][1](size)
        model.compile(optimizer=optimizer, loss=loss, jit_compile=False)
        # Build the optimizer's and metrics' variables outside the trace, as fit does.
        model._symbolic_build(data_batch=(x_spec, y_spec))
        step = tf.function(lambda data: model.train_step(data))
        concrete = step.get_concrete_function((x_spec, y_spec))
        graph_def = concrete.graph.as_graph_def(add_shapes=True)
        outputs = [t.name for t in concrete.graph.outputs]
        fetches = list(dict.fromkeys(t.op.name for t in concrete.graph.outputs))
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return graph_def, outputs, fetches


# -- measures --------------------------------------------------------------------

def float_casts(graph_def) -> int:
    """Cast nodes between float types, top graph and library."""
    nodes = list(graph_def.node) + [n for f in graph_def.library.function for n in f.node_def]
    return sum(1 for n in nodes if n.op == "Cast" and n.attr["SrcT"].type in FLOAT_TYPES
               and n.attr["DstT"].type in FLOAT_TYPES)


def sixteen_bit_share(graph_def, flops: dict) -> float | None:
    """Share of `flops` ({(function, node): FLOPs}) whose node computes in 16-bit here."""
    total = sum(flops.values())
    if not total:
        return None
    nodes = {("", n.name): n for n in graph_def.node}
    for fdef in graph_def.library.function:
        nodes.update(((fdef.signature.name, n.name), n) for n in fdef.node_def)
    done = 0
    for key, value in flops.items():
        node = nodes.get(key)
        if node is not None and any(node.attr[a].type in SIXTEEN_BIT
                                    for a in ("T", "Ta", "Tb") if a in node.attr):
            done += value
    return done / total


def measure(graph_def, reference_shapes, flops: dict, trips: int, fetches,
            seconds: float | None = None) -> dict:
    """Traffic (with `reference_shapes` where a node has none), Casts, 16-bit FLOP share.

    `trips`: how often a loop without a static trip count runs; `fetches`: the
    step's fetched nodes (what never runs is not counted)."""
    traffic = vs_grappler.traffic_of(graph_def, reference_shapes, trips, fetches)
    return {"traffic_bytes": traffic["traffic_bytes"], "cast_bytes": traffic["cast_bytes"],
            "executor_cost": traffic.get("executor_cost"), "xla_cost": traffic.get("xla_cost"),
            "casts": float_casts(graph_def), "flops_16bit_share": sixteen_bit_share(
                graph_def, flops), "seconds": seconds}


def compare(key: str, args, cluster) -> list[dict]:
    size = args.size
    start = time.perf_counter()
    graph_def, outputs, fetches = trace_step(key, size, "float32")
    log.info("%s: float32 step traced in %.1f s", key, time.perf_counter() - start)
    shapes = tensor_shapes(graph_def, build_view(graph_def))
    flops, unknown_flops, _ = graph_def_flops(graph_def)
    trips = size["lstm_seq"] if key == "lstm" else 1
    rows = [{"mode": "float32", **measure(graph_def, shapes, flops, trips, fetches)}]
    metagraph = vs_grappler.metagraph_for(graph_def, fetches)
    for dtype in ("float16", "bfloat16"):
        start = time.perf_counter()
        policy_graph, _, policy_fetches = trace_step(key, size, POLICIES[dtype])
        log.info("%s: %s step traced in %.1f s", key, POLICIES[dtype],
                 time.perf_counter() - start)
        policy_shapes = tensor_shapes(policy_graph, build_view(policy_graph))
        policy_flops, _, _ = graph_def_flops(policy_graph)
        rows.append({"mode": f"keras {POLICIES[dtype]}",
                     **measure(policy_graph, policy_shapes, policy_flops, trips,
                               policy_fetches)})
        del policy_graph, policy_shapes
        start = time.perf_counter()
        grappled = tf_optimizer.OptimizeGraph(
            vs_grappler.grappler_config([vs_grappler.GRAPPLER_OPTIMIZER[dtype]]), metagraph,
            verbose=False, cluster=cluster)
        rows.append({"mode": f"grappler {dtype}",
                     **measure(grappled, shapes, flops, trips, fetches,
                               time.perf_counter() - start)})
        # Placed for each runtime (AmpConfig.runtime): a bare GraphDef's "auto"
        # is the executor; a Keras 3 step compiled by XLA gets "xla".
        for runtime, suffix in (("executor", ""), ("xla", " xla")):
            start = time.perf_counter()
            rewritten, _ = tfamp.rewrite_graph_def(
                graph_def, tfamp.AmpConfig(dtype=dtype, device_type=args.device_type,
                                           runtime=runtime),
                outputs=outputs, function_name=key)
            rows.append({"mode": f"tfamp {dtype}{suffix}", **measure(
                rewritten, shapes, flops, trips, fetches, time.perf_counter() - start)})
    base = rows[0]["traffic_bytes"]
    for cost in ("executor_cost", "xla_cost"):  # what a GPU pays (runtime_cost), vs float32
        first = rows[0][cost]
        for row in rows:
            row[cost.replace("cost", "share")] = (row[cost] / first if first and row[cost]
                                                  is not None else None)
    for row in rows:
        row.update(model=key, nodes=sum(1 for _ in graph_def.node) + sum(
            len(f.node_def) for f in graph_def.library.function),
            matrix_ops_unknown=unknown_flops,
            traffic_share=row["traffic_bytes"] / base
            if base and row["traffic_bytes"] is not None else None)
    keras.backend.clear_session()
    return rows


# -- printing --------------------------------------------------------------------

def markdown(rows: list[dict]) -> str:
    headers = ["model", "mode", "traffic vs fp32", "est. GB/step", "executor cost vs fp32",
               "XLA cost vs fp32", "Casts", "Cast MB", "16-bit matrix FLOPs", "pass ms"]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for r in rows:
        cells = [
            MODELS[r["model"]][0], r["mode"],
            "-" if r["traffic_share"] is None else f"{100 * r['traffic_share']:.1f}%",
            "-" if r["traffic_bytes"] is None else f"{r['traffic_bytes'] / 1e9:.3f}",
            *("-" if r.get(k) is None else f"{100 * r[k]:.1f}%"
              for k in ("executor_share", "xla_share")),
            str(r["casts"]),
            "-" if r["cast_bytes"] is None else f"{r['cast_bytes'] / 1e6:.1f}",
            "-" if r["flops_16bit_share"] is None else f"{100 * r['flops_16bit_share']:.1f}%",
            "-" if r["seconds"] is None else f"{1000 * r['seconds']:.0f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    """Per estimate, model and dtype: is tfamp at or below Keras's policy and grappler?"""
    lines = []
    for field, label, placed in (("traffic_share", "traffic", ""),
                                 ("executor_share", "executor cost", ""),
                                 ("xla_share", "XLA cost (placed for XLA)", " xla")):
        by = collections.defaultdict(dict)
        for r in rows:
            by[r["model"]][r["mode"]] = r.get(field)
        parts = []
        for model, modes in by.items():
            for dtype in ("float16", "bfloat16"):
                t = modes.get(f"tfamp {dtype}{placed}")
                others = {"keras": modes.get(f"keras {POLICIES[dtype]}"),
                          "grappler": modes.get(f"grappler {dtype}")}
                if t is None:
                    continue
                worse = [name for name, v in others.items() if v is not None and t > v * 1.0005]
                parts.append(f"{model}/{dtype}: " + ("lowest" if not worse else
                                                      "above " + ", ".join(worse)))
        lines.append(f"tfamp {label} vs the others: " + "; ".join(parts))
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(message)s", stream=sys.stderr)
    run_start = time.perf_counter()
    cluster = gcluster.Cluster()
    rows = []
    try:
        for key in args.models:
            rows.extend(compare(key, args, cluster))
    finally:
        cluster.Shutdown()
    size = args.size
    print(f"Keras {keras.__version__} fit steps (TensorFlow {tf.__version__}): images "
          f"{size['image']}x{size['image']}, batch {size['batch']}; BERT {size['bert_layers']}"
          f"x{size['bert_width']} at seq {size['seq']}; LSTM LM 2x{size['lstm_width']} over "
          f"{size['lstm_seq']} steps, vocabulary {size['vocab']}; tfamp device type "
          f"{args.device_type}; {os.cpu_count()} CPU cores\n")
    print(markdown(rows))
    print()
    print(summary(rows))
    unknown = {r["model"]: r["matrix_ops_unknown"] for r in rows if r["matrix_ops_unknown"]}
    if unknown:
        print(f"matrix ops without static shapes, left out of the FLOP share: {unknown}")
    total_s = time.perf_counter() - run_start
    print(f"total run time {total_s:.0f} s")
    if args.json:
        write_json(args.json, {"benchmark": "keras3_models", "size": size,
                               "device_type": args.device_type, "keras": keras.__version__,
                               "rows": rows, "total_s": total_s})
        print(f"figures written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
