"""Which converted nodes to keep float32 when a signature's outputs moved too far.

Two steps, cheapest first:

1. **Ranges** (no 16-bit evaluation): one float32 run records the largest |x| of
   every float tensor of the model's body; a tensor the rewrite makes 16-bit
   (a converted op's output, or the input of a Cast tfamp inserts) whose float32
   values exceed the 16-bit type's largest finite value overflows there. Its
   layer (the node's name scope) is kept float32 and the graph rewritten again,
   until no 16-bit tensor is out of range: rewrites only, no further runs.
2. **Ranked bisection**: one instrumented 16-bit run compares every converted
   op's output with float32's and ranks layers by the error each adds (its
   output's relative error less the largest of its inputs'); a binary search
   then finds the shortest prefix of that ranking that brings the outputs
   within tolerance: about log2(layers) + 1 evaluations. ONNX's
   auto_mixed_precision (segment bisection) needs about 2 log2(nodes) per
   culprit and Polygraphy's ``debug precision`` (bisect) log2(layers) + 1 but
   keeps a whole prefix or suffix of the network in float32.

The model's body is the signature's one called function (a SavedModel signature
is a call of the model's function), or the top graph when it holds the ops.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import numpy as np

from tfamp.rewrite.graph import FLOAT_TYPES, build_view
from tfamp.rewrite.report import RewriteReport

_CALL_OPS = ("StatefulPartitionedCall", "PartitionedCall")


@dataclasses.dataclass(frozen=True)
class Kept:
    """A layer kept float32 for accuracy: its keep_fp32 pattern and why."""

    pattern: str
    layer: str
    reason: str
    step: str  # "ranges" or "bisection"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class ModelBody:
    """Where the model's ops are: the top graph, or the one function it calls."""

    function: str                 # "" for the top graph
    graph_def: Any                # that body as a GraphDef (float32 original)
    inner: tuple | None           # run_imported's `inner` for a called function


def model_body(graph_def) -> ModelBody:
    """The body holding a signature's ops (see the module docstring)."""
    calls = [n for n in graph_def.node if n.op in _CALL_OPS]
    if len(calls) != 1:
        return ModelBody("", graph_def, None)
    return ModelBody(calls[0].attr["f"].func.name, *_callee(graph_def, calls[0]))


def _callee(graph_def, call) -> tuple[Any, tuple]:
    from tensorflow.python.framework.function_def_to_graph import function_def_to_graph

    name = call.attr["f"].func.name
    fdef = next(f for f in graph_def.library.function if f.signature.name == name)
    graph = function_def_to_graph(fdef)
    body_def = graph.as_graph_def()
    return body_def, (call, body_def, [t.name for t in graph.inputs])


def float32_maxima(concrete, body: ModelBody, batches: list[list]) -> dict[str, float]:
    """Tensor name ("node:0") -> largest finite |x| over `batches`, for every float
    tensor of `body` in the float32 graph (one run per batch)."""
    import tensorflow as tf

    from tfamp.numerics.run_graph import run_imported

    view = build_view(body.graph_def)
    nodes = view.bodies[0].nodes
    fetches = [f"{name}:{i}" for name, node in nodes.items()
               if node.op not in ("Const", "Placeholder", "_Arg")
               for i, port in enumerate(node.outputs) if port.dtype in FLOAT_TYPES]
    if not fetches:
        return {}

    def post(tensors):
        return [tf.reduce_max(tf.where(tf.math.is_finite(t), tf.abs(t), tf.zeros_like(t)))
                if t.shape.num_elements() != 0 else tf.zeros([], t.dtype)
                for t in tensors]

    graph_def = concrete.graph.as_graph_def()
    maxima: dict[str, float] = {}
    for flat_args in batches:
        values = run_imported(concrete, graph_def, fetches, flat_args, post=post,
                              inner=body.inner)
        for name, value in zip(fetches, values, strict=True):
            maxima[name] = max(maxima.get(name, 0.0), float(value))
    return maxima


def sixteen_bit_tensors(report: RewriteReport, body: ModelBody, rewritten_view
                        ) -> dict[str, str]:
    """Tensor name -> the converted node that makes it 16-bit (itself, or the node a
    Cast of it feeds), for the body's tensors the rewrite turns 16-bit."""
    found: dict[str, str] = {}
    body_view = next((b for b in rewritten_view.bodies if b.name == body.function), None)
    if body_view is None:
        return found
    for entry in report.nodes:
        if entry.converted and entry.function == body.function:
            node = body_view.nodes.get(entry.name)
            if node is None:
                continue
            for i, port in enumerate(node.outputs):
                if port.dtype in FLOAT_TYPES:
                    found.setdefault(f"{entry.name}:{i}", entry.name)
    for cast in report.casts:
        if cast.function != body.function or cast.dst_dtype == "float32":
            continue
        source = _tensor_name(cast.source, body_view)
        consumers = [c for c in cast.consumers if not c.startswith("<")]
        if source and consumers:
            found.setdefault(source, consumers[0])
    return found


def _tensor_name(source: str, body_view) -> str | None:
    """'node:out:0' or 'node' (as written in a body) -> 'node:k' (flat index)."""
    parts = source.split(":")
    node = body_view.nodes.get(parts[0])
    if node is None:
        return None  # a function argument: no node of the body computes it
    if len(parts) == 1:
        return f"{parts[0]}:0"
    if len(parts) == 2:
        return f"{parts[0]}:{parts[1]}"
    return f"{parts[0]}:{node.output_offsets.get(parts[1], 0) + int(parts[2])}"


def layer_of(node: str) -> str:
    """The name scope of a node ("model/dense/MatMul" -> "model/dense")."""
    return node.rsplit("/", 1)[0] if "/" in node else node


def keep_pattern(layer: str, node: str) -> str:
    return f"^{re.escape(layer)}/" if layer != node else f"^{re.escape(node)}$"


def out_of_range(report: RewriteReport, body: ModelBody, rewritten_view,
                 maxima: dict[str, float]) -> list[Kept]:
    """Layers whose 16-bit tensors exceed the 16-bit type's range in float32's run."""
    from tfamp.serving.accuracy import MAX_VALUE

    limit = MAX_VALUE[report.dtype]
    kept: dict[str, Kept] = {}
    for tensor, node in sixteen_bit_tensors(report, body, rewritten_view).items():
        value = maxima.get(tensor)
        if value is None or value <= limit:
            continue
        layer = layer_of(node)
        if layer in kept:
            continue
        op = rewritten_view_op(rewritten_view, body.function, tensor.split(":")[0])
        kept[layer] = Kept(keep_pattern(layer, node), layer,
                           f"{op} '{tensor.rsplit(':', 1)[0]}' reaches {value:.3g} in float32, "
                           f"beyond {report.dtype}'s largest value {limit:g}", "ranges")
    return list(kept.values())


def rewritten_view_op(view, function: str, node: str) -> str:
    body = next((b for b in view.bodies if b.name == function), None)
    found = body.nodes.get(node) if body is not None else None
    return found.op if found is not None else "op"


def error_ranking(concrete, graph_def, report: RewriteReport, body: ModelBody,
                  batches: list[list]) -> list[tuple[str, str, float]]:
    """(layer, node, error it adds) for the converted layers of `body`, worst first.

    One run of the rewritten graph and one of the float32 graph fetch every
    converted node's outputs; a node's error is max |y16 - y32| / max |y32|
    over its float outputs, and what it adds is that less the largest error of
    the converted nodes feeding it.
    """
    import tensorflow as tf

    from tfamp.numerics.run_graph import run_imported

    view = build_view(graph_def)
    body_view = next((b for b in view.bodies if b.name == body.function), None)
    if body_view is None:
        return []
    converted = [e.name for e in report.nodes
                 if e.converted and e.function == body.function and e.name in body_view.nodes]
    fetches = [f"{n}:0" for n in converted
               if body_view.nodes[n].outputs and body_view.nodes[n].outputs[0].dtype in
               FLOAT_TYPES]
    if not fetches:
        return []
    new_inner = None
    if body.inner is not None:
        call = next(n for n in graph_def.node if n.op in _CALL_OPS)
        _, new_inner = _callee(graph_def, call)

    def post(tensors):
        return [tf.cast(t, tf.float32) for t in tensors]

    errors: dict[str, float] = {}
    top = concrete.graph.as_graph_def()
    for flat_args in batches:
        new = run_imported(concrete, graph_def, fetches, flat_args, post=post, inner=new_inner)
        ref = run_imported(concrete, top, fetches, flat_args, post=post, inner=body.inner)
        for name, a, b in zip(fetches, new, ref, strict=True):
            scale = float(np.max(np.abs(b))) if b.size else 0.0
            diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
            err = float(np.max(diff)) / scale if scale > 0 and np.all(np.isfinite(diff)) else (
                0.0 if scale == 0 else float("inf"))
            errors[name.split(":")[0]] = max(errors.get(name.split(":")[0], 0.0), err)
    added: dict[str, tuple[float, str]] = {}
    for name in converted:
        if name not in errors:
            continue
        inputs = [errors.get(ref.node, 0.0) for ref, _ in body_view.nodes[name].data_inputs
                  if not ref.is_arg]
        gain = errors[name] - max(inputs, default=0.0)
        layer = layer_of(name)
        if layer not in added or gain > added[layer][0]:
            added[layer] = (gain, name)
    ranked = sorted(added.items(), key=lambda kv: -kv[1][0])
    # A layer whose error jumps (a cancellation, a sum of large terms) needs the
    # precision of its inputs too: the converted layers feeding its worst node
    # follow it in the ranking, before the next worst layer.
    ordered: dict[str, tuple[str, float]] = {}
    for layer, (gain, node) in ranked:
        ordered.setdefault(layer, (node, gain))
        for ref, _ in body_view.nodes[node].data_inputs:
            feeder = _converted_producer(body_view, ref, errors)
            if feeder is not None:
                ordered.setdefault(layer_of(feeder), (feeder, added.get(
                    layer_of(feeder), (0.0, feeder))[0]))
    return [(layer, node, gain) for layer, (node, gain) in ordered.items()]


def _converted_producer(body_view, ref, errors: dict[str, float]) -> str | None:
    """The converted node a data input comes from, looking through a few
    unconverted ops that do no arithmetic (Identity, Reshape, ...)."""
    for _ in range(8):
        if ref.is_arg or ref.node not in body_view.nodes:
            return None
        if ref.node in errors:
            return ref.node
        node = body_view.nodes[ref.node]
        if node.op not in ("Identity", "Reshape", "Cast", "ExpandDims", "Squeeze") or (
                not node.data_inputs):
            return None
        ref = node.data_inputs[0][0]
    return None


def bisect(ranking: list[tuple[str, str, float]],
           passes: Callable[[list[str]], bool]) -> tuple[int | None, int]:
    """The shortest prefix of `ranking` whose layers, kept float32, pass.

    A prefix that is the whole ranking is no answer (nothing would be left in
    16-bit in that body): the search then fails.

    Args:
      ranking: (layer, node, error added), worst first.
      passes: evaluates a list of keep_fp32 patterns (one 16-bit evaluation).

    Returns:
      (prefix length, or None when no shorter prefix than the whole ranking
      passes; evaluations made).
    """
    patterns = [keep_pattern(layer, node) for layer, node, _ in ranking]
    low, high = 0, len(patterns)   # low: known to fail; high: passes, or the whole ranking
    evaluations = 0
    while high - low > 1:
        middle = (low + high) // 2
        evaluations += 1
        if passes(patterns[:middle]):
            high = middle
        else:
            low = middle
    return (high if high < len(patterns) else None), evaluations
