"""tfamp against TensorFlow's own grappler AMP pass, on the same training-step graphs.

For each model (MLP, CNN+BatchNorm, ResNet-style with residual adds, LSTM, GRU,
Transformer block with MultiHeadAttention + LayerNormalization, Keras'
ResNet-50, a BERT-style encoder) an Adam training
step is traced once; its GraphDef is rewritten by

* tfamp: ``tfamp.rewrite_graph_def(graph_def, AmpConfig(dtype), outputs=...)``;
* grappler: ``tf_optimizer.OptimizeGraph`` with only the AMP optimizer enabled
  ("auto_mixed_precision_cpu" for float16 with
  TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_EMULATE_FP16=0, i.e. really retyping to
  half; "auto_mixed_precision_onednn_bfloat16" for bfloat16), one meta-optimizer
  iteration, min_graph_nodes=-1, model pruning and the TFG optimizer off, the
  step's output nodes as fetches (``train_op`` collection).

Both results are measured the same way (top graph and every library function):

* ops converted: nodes present before and after whose float32 type attributes
  (``T``, ``U``, list types, ...) now say float16 / bfloat16 (by node name);
* casts inserted: Cast nodes after minus before;
* 16-bit FLOPs: share of MatMul / BatchMatMul* / Conv2D* / Einsum FLOPs whose
  node computes in 16-bit afterwards. FLOPs come from static shapes on the live
  traced FuncGraphs (the step's graph and the FuncGraph of every library
  function), weighted by how often each function runs per step: once per call,
  and --seq-len times per While loop body (the RNN loops run once per time
  step). Functions the step never calls (e.g. the cuDNN variants of LSTM/GRU
  kept for the implementation selector) do not count;
* estimated float memory traffic per step: tfamp's estimator
  (``tfamp.rewrite.traffic``: each float tensor written once and read once per
  consumer, Casts included, loop bodies times their static trip count) run on
  the float32 step, tfamp's graph and grappler's graph alike, with the float32
  step's shapes (nodes keep their names; new Casts take their input's shape);
  shown as a share of the float32 step's. "cast MB": what the float-to-float
  Casts read and write. A data-dependent dimension (an embedding's sparse
  gradient rows) is taken as UNKNOWN_DIM;
* problems: ``tfamp.check_graph_def`` (edge dtypes, Cast round trips, and
  TensorFlow importing the graph and every function);
* pass time: best of --repeat (perf_counter), the two tools taking turns so
  a shared machine's changes of speed hit both; CPU time (process_time) too.
  For grappler, the whole OptimizeGraph call on a reused cluster; the
  "overhead" row is the same call with a no-op optimizer list
  (["debug_stripper"]), i.e. what is not the AMP pass.

    python benchmarks/vs_grappler.py                       # all models, both dtypes
    python benchmarks/vs_grappler.py --models gru --dtypes bfloat16
    python benchmarks/vs_grappler.py --json out/vs_grappler.json
    python benchmarks/vs_grappler.py --strip-shapes   # graphs without _output_shapes

grappler registers its oneDNN bfloat16 pass only when oneDNN is enabled, so this
script sets TF_ENABLE_ONEDNN_OPTS=1 (before TensorFlow is imported) unless the
environment already sets it.
"""

from __future__ import annotations

import argparse
import collections
import copy
import itertools
import logging
import math
import os
import re
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Really retype to half in grappler's CPU float16 mode (not emulate it in float32).
os.environ["TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_EMULATE_FP16"] = "0"
# Without oneDNN, grappler does not register "auto_mixed_precision_onednn_bfloat16"
# and silently runs nothing.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402  (imports TensorFlow after the environment is set)
from _common import tf, tfamp  # noqa: E402
from tensorflow.core.framework import types_pb2  # noqa: E402
from tensorflow.core.protobuf import config_pb2, meta_graph_pb2, rewriter_config_pb2  # noqa: E402
from tensorflow.python.eager import wrap_function  # noqa: E402
from tensorflow.python.grappler import cluster as gcluster  # noqa: E402
from tensorflow.python.grappler import tf_optimizer  # noqa: E402

from tfamp.rewrite.boundaries import original_function_name  # noqa: E402
from tfamp.rewrite.graph import build_view  # noqa: E402
from tfamp.rewrite.runtime_cost import EXECUTOR, XLA  # noqa: E402
from tfamp.rewrite.shapes import (  # noqa: E402
    TensorShapes,
    tensor_shapes,
    without_recorded_shapes,
)
from tfamp.rewrite.traffic import body_weights, estimate_traffic  # noqa: E402

log = logging.getLogger("vs_grappler")

MODELS = {
    "mlp": ("MLP 64-256-256-256-10", _common.mlp),
    "cnn_bn": ("CNN 3x(Conv2D+BN+ReLU)", _common.cnn_bn),
    "resnet": ("ResNet-style 3 residual blocks (BN, Add)", _common.resnet_small),
    "lstm": ("LSTM(32), 10 steps", _common.lstm),
    "gru": ("GRU(32), 10 steps", _common.gru),
    "transformer": ("Transformer block (MHA + LayerNorm)", _common.transformer_block),
    "resnet50": ("ResNet-50, 64x64x3, batch 8", _common.resnet50),
    "bert": ("BERT-style encoder, 2 layers, seq 32, dim 64", _common.bert_encoder),
}
GRAPPLER_OPTIMIZER = {
    "float16": "auto_mixed_precision_cpu",
    "bfloat16": "auto_mixed_precision_onednn_bfloat16",
}
UNKNOWN_DIM = 256  # bert: batch 8 x 32 tokens
TARGET_ENUM = {"float16": types_pb2.DT_HALF, "bfloat16": types_pb2.DT_BFLOAT16}
SIXTEEN_BIT = frozenset(TARGET_ENUM.values())
FLOP_OPS = frozenset({
    "MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum",
    "Conv2D", "Conv2DBackpropInput", "Conv2DBackpropFilter", "Conv2DBackpropInputV2",
    "Conv2DBackpropFilterV2",
})
LOOP_OPS = frozenset({"While", "StatelessWhile"})
FUNC_ATTRS = ("f", "body", "cond", "then_branch", "else_branch", "branches")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Compare tfamp with grappler's auto mixed precision pass.")
    parser.add_argument("--models", type=_names(MODELS), default=tuple(MODELS),
                        help=f"comma-separated subset of {','.join(MODELS)}")
    parser.add_argument("--dtypes", type=_names(TARGET_ENUM), default=tuple(TARGET_ENUM),
                        help="comma-separated subset of float16,bfloat16")
    parser.add_argument("--repeat", type=int, default=3, help="timed passes per tool (best)")
    parser.add_argument("--quick", action="store_true", help="same as --repeat 1")
    parser.add_argument("--no-run", dest="run", action="store_false",
                        help="do not execute one step of each rewritten graph")
    parser.add_argument("--details", type=int, default=8,
                        help="max node names listed per difference (default 8)")
    parser.add_argument("--strip-shapes", action="store_true",
                        help="give both tools the step without recorded shapes "
                             "(no _output_shapes), as a graph read from a file often is; "
                             "traffic is still measured with the float32 step's shapes")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    parser.add_argument("-v", "--verbose", action="store_true", help="progress on stderr")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeat = 1
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    return args


def _names(allowed):
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(v.strip() for v in text.split(",") if v.strip())
        unknown = [n for n in names if n not in allowed]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"unknown name(s) {unknown or text!r}; choose from {','.join(allowed)}")
        return names
    return parse


# -- graph bookkeeping ---------------------------------------------------------

def bodies(graph_def) -> dict[str, dict[str, object]]:
    """Body name ("" = top graph, else function name) -> {node name: NodeDef}."""
    result = {"": {n.name: n for n in graph_def.node}}
    for fdef in graph_def.library.function:
        result[fdef.signature.name] = {n.name: n for n in fdef.node_def}
    return result


def _type_slots(node_def) -> dict[tuple[str, int], int]:
    slots = {}
    for key, value in node_def.attr.items():
        if value.HasField("type"):
            slots[(key, -1)] = value.type
        elif value.HasField("list"):
            for index, dtype in enumerate(value.list.type):
                slots[(key, index)] = dtype
    return slots


def converted_nodes(before, after, target: int) -> list[tuple[str, str, str]]:
    """(body, node, op) of nodes whose float32 type attrs now read `target`."""
    result = []
    for body, nodes in before.items():
        new_nodes = after.get(body, {})
        for name, node in nodes.items():
            new = new_nodes.get(name)
            if new is None:
                continue
            new_slots = _type_slots(new)
            if any(dtype == types_pb2.DT_FLOAT and new_slots.get(slot) == target
                   for slot, dtype in _type_slots(node).items()):
                result.append((body, name, node.op))
    return result


def cast_count(body_map) -> int:
    return sum(n.op == "Cast" for nodes in body_map.values() for n in nodes.values())


def is_16bit(node_def) -> bool:
    return any(node_def.attr[key].type in SIXTEEN_BIT
               for key in ("T", "Ta", "Tb") if key in node_def.attr)


def invocation_weights(graph_def, loop_trips: int) -> dict[str, int]:
    """How often each body runs per step (top graph 1; While bodies x loop_trips)."""
    library = {f.signature.name for f in graph_def.library.function}
    calls: dict[str, list[tuple[str, int]]] = collections.defaultdict(list)
    for body, nodes in bodies(graph_def).items():
        for node in nodes.values():
            multiplier = loop_trips if node.op in LOOP_OPS else 1
            if node.op in library:
                calls[body].append((node.op, 1))
            for key in FUNC_ATTRS:
                if key not in node.attr:
                    continue
                value = node.attr[key]
                names = [value.func.name] if value.HasField("func") else []
                names += [f.name for f in value.list.func]
                for name in names:
                    calls[body].append((name, multiplier))
    weights: dict[str, int] = collections.Counter()

    def visit(body: str, weight: int, depth: int) -> None:
        if depth > 50:
            raise RuntimeError(f"call chain through {body!r} is deeper than 50 (recursion?)")
        weights[body] += weight
        for callee, multiplier in calls.get(body, ()):
            visit(callee, weight * multiplier, depth + 1)

    visit("", 1, 0)
    return dict(weights)


def live_graphs(concrete) -> dict[str, object]:
    """Body name -> the traced (Func)Graph that has static shapes for it."""
    graphs = {"": concrete.graph}
    pending = [concrete.graph]
    while pending:
        graph = pending.pop()
        for name, function in getattr(graph, "_functions", {}).items():
            sub = getattr(function, "graph", None)
            if sub is not None and name not in graphs:
                graphs[name] = sub
                pending.append(sub)
    return graphs


def op_flops(op) -> int | None:
    """FLOPs (2 per multiply-add) of one MatMul/BatchMatMul/Conv2D*/Einsum op."""
    try:
        kind = op.type
        if kind == "MatMul":
            a = op.inputs[0].shape.as_list()
            out = op.outputs[0].shape.as_list()
            k = a[0] if op.get_attr("transpose_a") else a[1]
            return _product(out + [k], 2)
        if kind.startswith("BatchMatMul"):
            x = op.inputs[0].shape.as_list()
            out = op.outputs[0].shape.as_list()
            k = x[-2] if op.get_attr("adj_x") else x[-1]
            return _product(out + [k], 2)
        if kind == "Conv2D":
            kh, kw, cin, _ = op.inputs[1].shape.as_list()
            return _product(op.outputs[0].shape.as_list() + [kh, kw, cin], 2)
        if kind.startswith("Conv2DBackpropInput"):
            kh, kw, cin, _ = op.inputs[1].shape.as_list()
            return _product(op.inputs[2].shape.as_list() + [kh, kw, cin], 2)
        if kind.startswith("Conv2DBackpropFilter"):
            kh, kw, cin, _ = op.outputs[0].shape.as_list()
            return _product(op.inputs[2].shape.as_list() + [kh, kw, cin], 2)
        if kind == "Einsum":
            return _einsum_flops(op.get_attr("equation").decode(),
                                 [t.shape.as_list() for t in op.inputs])
    except (ValueError, TypeError, IndexError):  # unknown rank or attribute
        return None
    return None


def _product(dims, factor: int = 1) -> int | None:
    if any(d is None for d in dims):
        return None
    return factor * math.prod(dims)


def _einsum_flops(equation: str, shapes: list[list[int | None]]) -> int | None:
    lhs = equation.replace(" ", "").split("->")[0]
    sizes: dict[str, int | None] = {}
    ellipsis: list[int | None] = []
    for term, shape in zip(lhs.split(","), shapes, strict=True):
        if "..." in term:
            head, tail = term.split("...")
            n_ell = len(shape) - len(head) - len(tail)
            dims = shape[len(head):len(head) + n_ell]
            if len(dims) > len(ellipsis):
                ellipsis = [None] * (len(dims) - len(ellipsis)) + ellipsis
            for i, d in enumerate(dims, start=len(ellipsis) - len(dims)):
                if d is None or ellipsis[i] is None or ellipsis[i] == 1:
                    ellipsis[i] = d if ellipsis[i] in (None, 1) else ellipsis[i]
            letters = list(head) + [None] * n_ell + list(tail)
        else:
            letters = list(term)
        for letter, d in zip(letters, shape, strict=True):
            if letter is not None:
                sizes[letter] = d if sizes.get(letter) in (None, 1) else sizes[letter]
    factor = 2 if len(shapes) > 1 else 1
    return _product(list(sizes.values()) + ellipsis, factor)


def flop_table(concrete, graph_def, loop_trips: int) -> dict:
    """(body, node) -> weighted FLOPs for every MatMul-class node that runs; plus counts."""
    weights = invocation_weights(graph_def, loop_trips)
    graphs = live_graphs(concrete)
    flops: dict[tuple[str, str], int] = {}
    unknown: list[tuple[str, str, str]] = []
    for body, nodes in bodies(graph_def).items():
        weight = weights.get(body, 0)
        graph = graphs.get(body)
        for name, node in nodes.items():
            if node.op not in FLOP_OPS or weight == 0:
                continue
            op = None
            if graph is not None:
                try:
                    op = graph.get_operation_by_name(name)
                except (KeyError, ValueError):
                    op = None
            value = op_flops(op) if op is not None and op.type == node.op else None
            if value is None:
                unknown.append((body, name, node.op))
            else:
                flops[(body, name)] = value * weight
    return {"flops": flops, "unknown": unknown, "weights": weights}


def sixteen_bit_flops(table: dict, after_bodies) -> tuple[int, int, list]:
    """(16-bit FLOPs, total FLOPs, [(body, node, flops) still float32])."""
    done, total, missed = 0, 0, []
    for (body, name), value in table["flops"].items():
        total += value
        node = after_bodies.get(body, {}).get(name)
        if node is not None and is_16bit(node):
            done += value
        else:
            missed.append((body, name, value))
    return done, total, missed


# -- validity beyond check_graph_def ---------------------------------------------

_CALL_TYPE_ATTRS = {  # op -> (input types attr, output types attr, function attrs)
    "While": ("T", "T", ("cond", "body")), "StatelessWhile": ("T", "T", ("cond", "body")),
    "If": ("Tin", "Tout", ("then_branch", "else_branch")),
    "StatelessIf": ("Tin", "Tout", ("then_branch", "else_branch")),
    "Case": ("Tin", "Tout", ("branches",)), "StatelessCase": ("Tin", "Tout", ("branches",)),
    "PartitionedCall": ("Tin", "Tout", ("f",)),
    "StatefulPartitionedCall": ("Tin", "Tout", ("f",)),
}


def call_signature_mismatches(graph_def) -> list[str]:
    """Call sites whose type attributes disagree with the called function's signature.

    check_graph_def compares every edge with its producer, but not a While's
    ``T`` (or a call's ``Tin``/``Tout``) with the body's argument types; TensorFlow
    only rejects that when the function is instantiated.
    """
    signatures = {f.signature.name: f.signature for f in graph_def.library.function}
    problems = []
    for body, nodes in bodies(graph_def).items():
        where = f"function {body!r}" if body else "top graph"
        for node in nodes.values():
            spec = _CALL_TYPE_ATTRS.get(node.op)
            if spec is None:
                continue
            in_attr, out_attr, func_attrs = spec
            ins = list(node.attr[in_attr].list.type)
            outs = list(node.attr[out_attr].list.type)
            for key in func_attrs:
                value = node.attr[key]
                names = [value.func.name] if value.HasField("func") else []
                names += [f.name for f in value.list.func]
                for name in names:
                    sig = signatures.get(name)
                    if sig is None:
                        continue
                    args = [a.type for a in sig.input_arg]
                    rets = [a.type for a in sig.output_arg]
                    checks = [("argument", ins, args)]
                    if key != "cond":  # a While cond returns one bool
                        checks.append(("result", outs, rets))
                    for what, call_types, sig_types in checks:
                        for i, (c, f) in enumerate(zip(call_types, sig_types, strict=False)):
                            if c != f:
                                problems.append(
                                    f"{where}: {node.op} {node.name!r} passes {what} {i} as "
                                    f"{_dtype(c)} but {key} {name!r} declares {_dtype(f)}")
    return problems


def _dtype(enum: int) -> str:
    return types_pb2.DataType.Name(enum).removeprefix("DT_").lower()


_run_counter = itertools.count()


def run_once(graph_def, concrete, args) -> dict:
    """Runs one training step of `graph_def` on the model's live variables.

    Library functions are renamed first so they can sit next to the originals
    in the eager context; the step's control outputs (variable updates) are
    fetched so the whole step runs, not just the loss.
    """
    graph_def = copy.deepcopy(graph_def)
    _rename_library(graph_def, f"_vsg{next(_run_counter)}")
    inputs = [t.name for t in concrete.graph.inputs]
    fetches = ([t.name for t in concrete.graph.outputs]
               + [op.name for op in concrete.graph.control_outputs])
    try:
        fn = wrap_function.function_from_graph_def(graph_def, inputs, fetches)
        outputs = fn(*args, *concrete.captured_inputs)
        loss = float(outputs[0].numpy())
    except Exception as err:  # noqa: BLE001 - the point is to see what fails
        text = str(err)
        mismatch = re.search(r"Input '[^']+' passed \w+ expected \w+", text)
        building = re.search(r"while building NodeDef '([^']+)'", text)
        if mismatch:
            where = f" building NodeDef {building.group(1)!r}" if building else ""
            return {"ok": False, "error": f"{type(err).__name__}:{where}: {mismatch.group(0)}"}
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        # Skip TensorFlow's "Graph execution error" / "Detected at node" / traceback lines.
        informative = [line for line in lines if not line.startswith(
            ("Graph execution error", "Detected at node", "File ", "[[", "Node:"))]
        first = (informative or lines or [""])[0]
        return {"ok": False, "error": f"{type(err).__name__}: {first}"[:400]}
    return {"ok": math.isfinite(loss), "loss": loss,
            "error": "" if math.isfinite(loss) else "non-finite loss"}


def _rename_library(graph_def, suffix: str) -> None:
    names = {f.signature.name: f.signature.name + suffix for f in graph_def.library.function}

    def fix_attr(value):
        if value.HasField("func") and value.func.name in names:
            value.func.name = names[value.func.name]
        for func in value.list.func:
            if func.name in names:
                func.name = names[func.name]
        if value.s:  # forward/backward function names are kept in string attrs
            text = value.s.decode(errors="replace")
            if text in names:
                value.s = names[text].encode()

    def fix(node_defs):
        for node in node_defs:
            if node.op in names:
                node.op = names[node.op]
            for value in node.attr.values():
                fix_attr(value)

    fix(graph_def.node)
    for fdef in graph_def.library.function:
        fdef.signature.name = names[fdef.signature.name]
        fix(fdef.node_def)
        for value in fdef.attr.values():
            fix_attr(value)
        # As tfamp's runner does: a per-run implementation-selector tag, or
        # grappler may swap in a same-tagged body registered by another run
        # (the original, or the other tool's), whose TensorList types differ.
        if "api_implements" in fdef.attr:
            fdef.attr["api_implements"].s += suffix.encode()
    del graph_def.library.gradient[:]


# -- the two tools ---------------------------------------------------------------

def grappler_config(optimizers: list[str]) -> config_pb2.ConfigProto:
    config = config_pb2.ConfigProto()
    rewrite = config.graph_options.rewrite_options
    rewrite.optimizers[:] = optimizers  # only these run
    rewrite.min_graph_nodes = -1
    rewrite.meta_optimizer_iterations = rewriter_config_pb2.RewriterConfig.ONE
    rewrite.disable_model_pruning = True
    rewrite.disable_tfg_optimizer = True
    rewrite.fail_on_optimizer_errors = True
    return config


def metagraph_for(graph_def, fetch_nodes: list[str]) -> meta_graph_pb2.MetaGraphDef:
    metagraph = meta_graph_pb2.MetaGraphDef()
    metagraph.graph_def.CopyFrom(graph_def)
    metagraph.collection_def["train_op"].node_list.value.extend(fetch_nodes)
    return metagraph


def compare(key: str, title: str, builder, dtypes, args, cluster) -> list[dict]:
    start = time.perf_counter()
    model, x_shape, y_shape = builder()
    concrete = _common.train_step(model, x_shape, y_shape)
    graph_def = concrete.graph.as_graph_def(add_shapes=True)
    # What the tools are given; the shaped graph stays the yardstick.
    given = without_recorded_shapes(graph_def) if args.strip_shapes else graph_def
    outputs = _common.output_names(concrete)
    fetch_nodes = list(dict.fromkeys(t.op.name for t in concrete.graph.outputs))
    trips = _common.SEQ_LEN if key in ("lstm", "gru") else 1
    flops = flop_table(concrete, graph_def, trips)
    original_view = build_view(graph_def)
    original_shapes = tensor_shapes(graph_def, original_view)
    fp32_traffic = traffic_of(graph_def, original_shapes, trips, fetch_nodes)
    before = bodies(graph_def)
    casts_before = cast_count(before)
    log.info("%s: traced %d nodes in %.1fs", key, _common.node_count(graph_def),
             time.perf_counter() - start)
    metagraph = metagraph_for(given, fetch_nodes)
    rng = tf.random.Generator.from_seed(0)
    step_args = [rng.normal(x_shape), rng.normal(y_shape)]
    original_run = run_once(graph_def, concrete, step_args) if args.run else None
    overhead_config = grappler_config(["debug_stripper"])
    overhead_s, _, _ = _common.best_of(
        lambda: tf_optimizer.OptimizeGraph(overhead_config, metagraph, verbose=False,
                                           cluster=cluster), args.repeat)
    rows = []
    for dtype in dtypes:
        target = TARGET_ENUM[dtype]
        config = tfamp.AmpConfig(dtype=dtype)
        results = {}

        def run_tfamp(config=config):
            return tfamp.rewrite_graph_def(given, config, outputs=outputs,
                                           function_name=key)

        grappler_cfg = grappler_config([GRAPPLER_OPTIMIZER[dtype]])

        def run_grappler(grappler_cfg=grappler_cfg):
            return tf_optimizer.OptimizeGraph(grappler_cfg, metagraph, verbose=False,
                                              cluster=cluster)

        # The two tools take turns, so a machine that slows down or speeds up
        # during the run (shared cores) affects both alike; best of each.
        tools = (("tfamp", run_tfamp), ("grappler", run_grappler))
        best = {tool: (float("inf"), float("inf")) for tool, _ in tools}
        outs, errors = {}, {}
        for _ in range(args.repeat):
            for tool, fn in tools:
                if tool in errors:
                    continue
                log.info("%s %s: %s", key, dtype, tool)
                try:
                    wall, cpu, outs[tool] = _common.best_of(fn, 1)
                except Exception as err:  # noqa: BLE001 - report and carry on
                    errors[tool] = f"{type(err).__name__}: {err}"[:500]
                    continue
                best[tool] = (min(best[tool][0], wall), min(best[tool][1], cpu))
        for tool, _ in tools:
            if tool in errors:
                results[tool] = {"error": errors[tool]}
                continue
            out, report = outs[tool], None
            if tool == "tfamp":
                out, report = out
            results[tool] = measure(out, before, casts_before, flops, target, best[tool][0])
            results[tool]["cpu_seconds"] = best[tool][1]
            results[tool].update(traffic_of(out, original_shapes, trips, fetch_nodes))
            if report is not None:
                results[tool]["decisions"] = {
                    (n.function, n.name): (n.op, n.reason) for n in report.nodes}
                results[tool]["report_converted"] = sum(report.converted.values())
            if args.run:
                results[tool]["run"] = run_once(out, concrete, step_args)
        if "error" not in results["tfamp"] and "error" not in results["grappler"]:
            results["only_grappler"] = why_not(results["tfamp"], results["grappler"])
            results["only_tfamp"] = why_not(results["grappler"], results["tfamp"],
                                            results["tfamp"]["decisions"])
        results["tfamp"].pop("decisions", None)
        rows.append({
            "model": key, "title": title, "dtype": dtype,
            "only_grappler_converts": results.get("only_grappler", {}),
            "only_tfamp_converts": results.get("only_tfamp", {}),
            "nodes": _common.node_count(graph_def), "top_nodes": len(graph_def.node),
            "functions": len(graph_def.library.function),
            "functions_run": sorted(b for b, w in flops["weights"].items() if b and w),
            "loop_trips": trips,
            "flop_nodes": len(flops["flops"]), "flop_nodes_unknown": len(flops["unknown"]),
            "unknown_flop_nodes": [list(u) for u in flops["unknown"]],
            "grappler_overhead_s": overhead_s,
            "fp32_traffic_bytes": fp32_traffic["traffic_bytes"],
            "grappler_optimizer": GRAPPLER_OPTIMIZER[dtype],
            "original_run": original_run,
            "tfamp": results["tfamp"], "grappler": results["grappler"],
        })
    del model, concrete
    _common.release_graphs()
    return rows


def traffic_of(graph_def, original_shapes, trips: int, fetches=None) -> dict:
    """tfamp's traffic estimate of any version of the step, on the original's shapes.

    `fetches`: the step's fetched nodes; then nodes that neither they nor a
    stateful op need are not counted (TensorFlow never runs them:
    ``traffic.dead_nodes``).

    Nodes keep their names through both rewrites, so a node without its own
    ``_output_shapes`` takes the original's; new Casts take their input's; a
    copy of a function tfamp made (``<name>_tfamp_f16``) takes its original's.
    Loops without a static trip count run `trips` times (the RNN length).
    """
    view = build_view(graph_def)
    copies = {body.name: original_shapes.shapes.get(original_function_name(body.name), {})
              for body in view.bodies if body.name not in original_shapes.shapes}
    if copies:
        original_shapes = TensorShapes({**original_shapes.shapes, **copies})
    shapes = tensor_shapes(graph_def, view, fallback=original_shapes)
    traffic = estimate_traffic(view, shapes, body_weights(view, default_trips=trips, shapes=shapes),
                               outputs=fetches)
    if traffic.total is None:
        return {"traffic_bytes": None, "cast_bytes": None,
                "traffic_unknown_tensors": traffic.unknown_tensors}
    # A data-dependent dimension (the rows of an embedding's sparse gradient)
    # is taken at its upper bound, the number of token ids in the batch.
    # What a GPU pays (tfamp.rewrite.runtime_cost): bytes + kernels x a
    # launch's byte-equivalent, on TensorFlow's executor and fused by XLA.
    executor = traffic.total.at(UNKNOWN_DIM) + traffic.kernels * EXECUTOR.launch_bytes
    fused = None if traffic.fused is None else traffic.fused.at(UNKNOWN_DIM)
    return {"traffic_bytes": traffic.total.at(UNKNOWN_DIM),
            "cast_bytes": traffic.cast.at(UNKNOWN_DIM),
            "traffic_unknown_dims": traffic.total.known() is None,
            "traffic_unknown_tensors": traffic.unknown_tensors,
            "kernels": traffic.kernels, "executor_cost": executor,
            "fused_bytes": fused, "fused_kernels": traffic.fused_kernels,
            "xla_cost": None if fused is None
            else fused + traffic.fused_kernels * XLA.launch_bytes}


def measure(out_graph_def, before, casts_before: int, flops: dict, target: int,
            seconds: float) -> dict:
    after = bodies(out_graph_def)
    converted = converted_nodes(before, after, target)
    done, total, missed = sixteen_bit_flops(flops, after)
    problems = tfamp.check_graph_def(out_graph_def)
    mismatches = call_signature_mismatches(out_graph_def)
    return {
        "seconds": seconds,
        "nodes_after": sum(len(n) for n in after.values()),
        "converted": len(converted),
        "converted_top": sum(1 for body, _, _ in converted if body == ""),
        "converted_library": sum(1 for body, _, _ in converted if body != ""),
        "converted_by_op": dict(collections.Counter(op for _, _, op in converted).most_common()),
        "converted_nodes": sorted([body, name] for body, name, _ in converted),
        "casts_inserted": cast_count(after) - casts_before,
        "flops_16bit": done, "flops_total": total,
        "flops_16bit_share": done / total if total else float("nan"),
        "flops_fp32_nodes": [[body, name, value] for body, name, value in
                             sorted(missed, key=lambda m: -m[2])],
        "problems": len(problems), "problem_examples": problems[:5],
        "signature_mismatches": len(mismatches), "signature_examples": mismatches[:5],
        "functions_added": sorted(set(after) - set(before)),
        "functions_removed": sorted(set(before) - set(after)),
        "nodes_removed": sum(len(set(before[b]) - set(after.get(b, {}))) for b in before),
    }


def why_not(lacking: dict, having: dict, decisions: dict | None = None) -> dict:
    """Nodes `having` converted and `lacking` did not, grouped by tfamp's reason.

    Returns {reason pattern: {op type: count}}, largest groups first. The
    reason is tfamp's (from its report), with quoted names blanked so that
    nodes kept float32 for the same reason group together.
    """
    decisions = decisions or lacking.get("decisions") or having.get("decisions") or {}
    missing = ({tuple(n) for n in having["converted_nodes"]}
               - {tuple(n) for n in lacking["converted_nodes"]})
    groups: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for body, name in missing:
        op, reason = decisions.get((body, name), ("?", "?"))
        pattern = re.sub(r"'[^']*'", "'..'", reason)
        groups[pattern][op] += 1
    ordered = sorted(groups.items(), key=lambda kv: -sum(kv[1].values()))
    return {pattern: dict(ops.most_common()) for pattern, ops in ordered}


# -- printing ----------------------------------------------------------------------

def _mflops(value: int) -> str:
    return f"{value / 1e6:.1f}"


def _share(result: dict) -> str:
    if "error" in result:
        return "error"
    share = result["flops_16bit_share"]
    return "-" if share != share else f"{100 * share:.1f}%"


def _valid(result: dict) -> str:
    """check_graph_def problems, call-signature mismatches and the one-step run, in one word."""
    if "error" in result:
        return "error"
    bad = []
    if result["problems"]:
        bad.append(f"check {result['problems']}")
    if result["signature_mismatches"]:
        bad.append(f"sig {result['signature_mismatches']}")
    run = result.get("run")
    if run is not None and not run["ok"]:
        bad.append("run FAIL")
    return "INVALID: " + ", ".join(bad) if bad else "valid"


def _run_text(run: dict | None) -> str:
    if run is None:
        return "not run"
    return f"ok, loss {run['loss']:.4g}" if run["ok"] else "FAILS"


def print_block(row: dict, details: int) -> None:
    t, g = row["tfamp"], row["grappler"]
    print(f"\n== {row['title']} [{row['model']}], {row['dtype']}: {row['nodes']} nodes "
          f"({row['top_nodes']} top + {row['functions']} functions, "
          f"{len(row['functions_run'])} of them run per step); grappler: "
          f"{row['grappler_optimizer']}")
    for tool, result in (("tfamp", t), ("grappler", g)):
        if "error" in result:
            print(f"   {tool} FAILED: {result['error']}")
    if "error" in t or "error" in g:
        return
    unknown = (f"; {row['flop_nodes_unknown']} MatMul-class nodes without static shapes "
               f"left out" if row["flop_nodes_unknown"] else "")
    rows = [
        ["ops converted (top / library)",
         f"{t['converted']} ({t['converted_top']} / {t['converted_library']})",
         f"{g['converted']} ({g['converted_top']} / {g['converted_library']})"],
        ["casts inserted", str(t["casts_inserted"]), str(g["casts_inserted"])],
        ["16-bit MatMul/Conv/Einsum FLOPs",
         f"{_share(t)} of {_mflops(t['flops_total'])} MFLOP",
         f"{_share(g)} of {_mflops(g['flops_total'])} MFLOP"],
        ["check_graph_def problems", str(t["problems"]), str(g["problems"])],
        ["call/body signature mismatches", str(t["signature_mismatches"]),
         str(g["signature_mismatches"])],
        ["runs one step on CPU", _run_text(t.get("run")), _run_text(g.get("run"))],
        ["pass time s (best of N, turns)", f"{t['seconds']:.4f}",
         f"{g['seconds']:.4f} (overhead {row['grappler_overhead_s']:.4f})"],
        ["pass CPU time s (best of N)", f"{t['cpu_seconds']:.4f}", f"{g['cpu_seconds']:.4f}"],
        ["nodes after", str(t["nodes_after"]), str(g["nodes_after"])],
    ]
    print(_common.table(["metric", "tfamp", "grappler"], rows))
    if unknown:
        print(f"   note{unknown}")
    if row["original_run"] is not None:
        print(f"   original float32 step: {_run_text(row['original_run'])}")
    # Where they differ: nodes converted by one tool only, FLOP-bearing nodes left float32.
    for who, groups in (("grappler", row["only_grappler_converts"]),
                        ("tfamp", row["only_tfamp_converts"])):
        if not groups:
            continue
        total = sum(sum(ops.values()) for ops in groups.values())
        print(f"   converted only by {who}: {total} nodes; tfamp's reasons:")
        for pattern, ops in groups.items():
            listed = ", ".join(f"{op} x{count}" for op, count in ops.items())
            print(f"     {sum(ops.values()):3d}  {pattern[:110]}  [{listed}]")
    for tool, result, other in (("tfamp", t, g), ("grappler", g, t)):
        theirs = {(b, n) for b, n, _ in other["flops_fp32_nodes"]}
        only = [(b, n, v) for b, n, v in result["flops_fp32_nodes"] if (b, n) not in theirs]
        if only:
            names = ", ".join(f"{b + ':' if b else ''}{n} ({_mflops(v)} MFLOP)"
                              for b, n, v in only[:details])
            more = f", ... {len(only) - details} more" if len(only) > details else ""
            print(f"   float32 MatMul-class nodes only in {tool}'s output: {names}{more}")
        if result["problems"]:
            print(f"   {tool} check_graph_def: {result['problem_examples'][0][:400]}")
        if result["signature_mismatches"]:
            print(f"   {tool} signature: {result['signature_examples'][0]}")
        if result.get("run") and not result["run"]["ok"]:
            print(f"   {tool} run: {result['run']['error']}")
        if result["functions_added"] or result["functions_removed"]:
            print(f"   {tool} library: added {result['functions_added']}, "
                  f"removed {result['functions_removed']}")
        if result["nodes_removed"]:
            print(f"   {tool} removed {result['nodes_removed']} original nodes")
    if t.get("report_converted", t["converted"]) != t["converted"]:
        print(f"   NOTE: tfamp's report says {t['report_converted']} nodes converted; "
              f"comparing type attributes finds {t['converted']}")
    if g["converted"] == 0:
        print("   WARNING: grappler converted nothing; is the optimizer registered? "
              "(bfloat16 needs TF_ENABLE_ONEDNN_OPTS=1)")


def print_summary(rows: list[dict]) -> None:
    print("\n== summary (t = tfamp, g = grappler; traffic = tfamp's estimate of float bytes "
          "written+read per step, as a share of the float32 step's)")
    headers = ["model", "dtype", "nodes", "casts t", "casts g", "traffic t", "traffic g",
               "cast MB t", "cast MB g", "16b FLOP t", "16b FLOP g", "valid t", "valid g",
               "time t ms", "time g ms"]
    table_rows = []
    for r in rows:
        t, g = r["tfamp"], r["grappler"]

        def get(result, key, default="error"):
            return result.get(key, default)

        table_rows.append([
            r["model"], r["dtype"], r["nodes"],
            get(t, "casts_inserted"), get(g, "casts_inserted"),
            _ratio(t, r), _ratio(g, r), _mb(t), _mb(g), _share(t), _share(g),
            _valid(t), _valid(g),
            1000 * get(t, "seconds", float("nan")), 1000 * get(g, "seconds", float("nan"))])
    print(_common.table(headers, table_rows))
    print(targets_line(rows))


def _traffic_share(result: dict, row: dict) -> float | None:
    value, base = result.get("traffic_bytes"), row.get("fp32_traffic_bytes")
    return value / base if value is not None and base else None


def _ratio(result: dict, row: dict) -> str:
    share = _traffic_share(result, row)
    return "-" if share is None else f"{100 * share:.1f}%"


def _mb(result: dict) -> str:
    value = result.get("cast_bytes")
    return "-" if value is None else f"{value / 1e6:.2f}"


def targets_line(rows: list[dict]) -> str:
    """The issue's targets, each PASS/FAIL with the figure that decides it."""
    pairs = [(_traffic_share(r["tfamp"], r), _traffic_share(r["grappler"], r), r)
             for r in rows]
    known = [(t, g, r) for t, g, r in pairs if t is not None and g is not None]
    worse = [f"{r['model']}/{r['dtype']}" for t, g, r in known if t > g * 1.0005]
    lower = [1 - t / g for t, g, _ in known if g]
    average = sum(lower) / len(lower) if lower else float("nan")
    rnn = [(t, r) for t, _, r in known if r["model"] in ("lstm", "gru")]
    rnn_ok = all(t < 1 for t, _ in rnn)
    resnet = [r for r in rows if r["model"] == "resnet50"
              and "seconds" in r["tfamp"] and "seconds" in r["grappler"]]
    ratios = [r["tfamp"]["seconds"] / r["grappler"]["seconds"] for r in resnet]
    parts = [
        f"traffic <= grappler on every graph: {'PASS' if not worse else 'FAIL ' + ', '.join(worse)}"
        f" ({len(known)} graphs)",
        f"average {100 * average:.1f}% lower than grappler "
        f"({'PASS' if average >= 0.10 else 'FAIL'}, target >= 10%)",
        f"LSTM/GRU below float32: {'PASS' if rnn and rnn_ok else 'FAIL'} ("
        + ", ".join(f"{r['model']}/{r['dtype']} {100 * t:.0f}%" for t, r in rnn) + ")",
    ]
    if ratios:
        cpu = [r["tfamp"]["cpu_seconds"] / r["grappler"]["cpu_seconds"] for r in resnet]
        parts.append(f"ResNet-50 pass time {max(ratios):.1f}x grappler "
                     f"({'PASS' if max(ratios) <= 2 else 'FAIL'}, target <= 2x; "
                     + ", ".join(f"{r['dtype']} {w:.2f}x wall, {c:.2f}x CPU"
                                 for r, w, c in zip(resnet, ratios, cpu, strict=True)) + ")")
    return "targets: " + "; ".join(parts)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(message)s", stream=sys.stderr)
    run_start = time.perf_counter()
    load_start = _common.load_average()
    cluster = gcluster.Cluster()
    rows = []
    try:
        for key in args.models:
            title, builder = MODELS[key]
            rows.extend(compare(key, title, builder, args.dtypes, args, cluster))
    finally:
        cluster.Shutdown()
    print(f"tfamp vs grappler AMP: training steps (Adam, MSE)"
          f"{', given without recorded shapes' if args.strip_shapes else ''}, pass time best of "
          f"{args.repeat}; {os.cpu_count()} CPU cores, TensorFlow {tf.__version__}; "
          f"TF_ENABLE_ONEDNN_OPTS={os.environ.get('TF_ENABLE_ONEDNN_OPTS')}")
    print(f"load average (1/5/15 min) at start {load_start}, at end {_common.load_average()}")
    for row in rows:
        print_block(row, args.details)
    print_summary(rows)
    total_s = time.perf_counter() - run_start
    print(f"total run time {total_s:.0f} s")
    if args.json:
        _common.write_json(args.json, {
            "benchmark": "vs_grappler", "environment": _common.environment(),
            "args": {k: v for k, v in vars(args).items() if k != "json"},
            "rows": rows, "total_s": total_s})
        print(f"figures written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
