"""Estimated float memory traffic of one step: bytes written and read by float tensors.

The model (deliberately simple, the same for every graph it compares):

* every float output is written once and read once per consuming input, at
  its element count x bytes of its dtype (float32 4, float16/bfloat16 2);
* a Cast between float types reads its input and writes its output, and is
  read by its consumers like any tensor; ``cast_bytes`` is what the Casts
  themselves read and write;
* ops that only pass a buffer along (``NO_COPY_OPS``: Identity, Reshape, ...,
  and calls: PartitionedCall, While, If, ...) neither read nor write; what
  flows through a call is counted inside the called body;
* each body counts once per run: the top graph once, a called function once per
  call, a ``While``/``StatelessWhile`` body and cond once per iteration where the
  trip count is static (``static_trip_count``), else ``default_trips`` times
  (1 unless the caller knows better) and the loop is listed as not static;
  both branches of an ``If``/``Case`` count (an upper bound);
* a float tensor whose shape is unknown (e.g. FusedBatchNormV3's reserve
  space) is left out and counted in ``unknown_tensors``; the figure is given
  only when at most ``MAX_UNKNOWN_SHARE`` of the float tensors are left out.

``estimate_traffic`` works on any GraphView (the original graph, tfamp's or
grappler's result) and, given a Coloring, on the graph tfamp is about to write
(new dtypes and the Casts ``insert_casts`` will add) without building it.
Linear in the number of nodes and edges.
"""

from __future__ import annotations

import dataclasses

from tfamp.rewrite.graph import FLOAT_TYPES, Body, GraphView, Node, TensorRef
from tfamp.rewrite.shapes import Bytes, TensorShapes, dtype_bytes

NO_COPY_OPS = frozenset({
    "Identity", "IdentityN", "StopGradient", "PreventGradient", "Reshape",
    "ExpandDims", "Squeeze", "NoOp",
})
LOOP_OPS = frozenset({"While", "StatelessWhile"})
_LESS_OPS = {"Less": 0, "LessEqual": 1}
MAX_UNKNOWN_SHARE = 0.05


@dataclasses.dataclass
class CallWeights:
    """How many times each body runs per step.

    Attributes:
      weights: body name ("" = top graph) -> runs per step (0: never called).
      not_static: loops ("function/node") whose trip count could not be derived.
    """

    weights: dict[str, int]
    not_static: list[str]


@dataclasses.dataclass
class Traffic:
    """Estimated float bytes written + read per step.

    Attributes:
      total: all float tensors, Casts included; None if too many shapes are
        unknown (see the module docstring).
      cast: what the float-to-float Casts read and write; None likewise.
      casts: number of float-to-float Casts (per graph, not per run).
      unknown_tensors: float tensors (that run) whose shape is unknown.
      known_tensors: float tensors (that run) counted.
    """

    total: Bytes | None
    cast: Bytes | None
    casts: int
    unknown_tensors: int
    known_tensors: int = 0

    def total_bytes(self) -> int | None:
        return None if self.total is None else self.total.known()

    def cast_bytes(self) -> int | None:
        return None if self.cast is None else self.cast.known()


def body_weights(view: GraphView, default_trips: int = 1) -> CallWeights:
    """Runs per step of every body, following calls from the top graph.

    Args:
      view: the graph.
      default_trips: iterations assumed for a loop without a static trip count.
    """
    bodies = {body.name: body for body in view.bodies}
    calls: dict[str, list[tuple[str, int]]] = {}
    not_static = []
    for body in view.bodies:
        for node in body.nodes.values():
            if not node.called_functions:
                continue
            multiplier = 1
            if node.op in LOOP_OPS:
                trips = static_trip_count(bodies, body, node)
                if trips is None:
                    not_static.append(f"{body.name}/{node.name}" if body.name else node.name)
                    trips = default_trips
                multiplier = trips
            for callee in node.called_functions:
                if callee in bodies:
                    calls.setdefault(body.name, []).append((callee, multiplier))
    # Calls form a DAG (TensorFlow has no recursion): Kahn's order from the top.
    indegree = dict.fromkeys(bodies, 0)
    for edges in calls.values():
        for callee, _ in edges:
            indegree[callee] += 1
    weights = dict.fromkeys(bodies, 0)
    weights[""] = 1
    ready = [name for name, deg in indegree.items() if deg == 0]
    while ready:
        name = ready.pop()
        for callee, multiplier in calls.get(name, ()):
            weights[callee] += weights[name] * multiplier
            indegree[callee] -= 1
            if indegree[callee] == 0:
                ready.append(callee)
    return CallWeights(weights, not_static)


def static_trip_count(bodies: dict[str, Body], caller: Body, node: Node) -> int | None:
    """Iterations of a While loop, if its cond bounds a counter by a constant.

    Recognised: the cond compares loop variable j with ``Less``/``LessEqual``
    against a Const (in the cond, or a loop variable whose initial value is a
    Const in the caller); loop variable j starts from a Const in the caller and
    the body adds a positive Const to it. The smallest such bound is the trip
    count (TensorFlow's own ``maximum_iterations`` counter has this form).
    """
    attr = node.node_def.attr
    cond = bodies.get(attr["cond"].func.name) if "cond" in attr else None
    body = bodies.get(attr["body"].func.name) if "body" in attr else None
    if cond is None or body is None:
        return None
    cond_args = list(cond.arg_dtypes)
    body_args = list(body.arg_dtypes)
    rets = list(body.rets.values())
    best = None
    for cnode in cond.nodes.values():
        if cnode.op not in _LESS_OPS or len(cnode.data_inputs) != 2:
            continue
        (a, _), (b, _) = cnode.data_inputs
        if not a.is_arg or a.node not in cond_args:
            continue
        j = cond_args.index(a.node)
        limit = _const_in(cond, b, caller, node, cond_args)
        start = _caller_const(caller, node, j)
        step = _increment(body, body_args, rets, j)
        if limit is None or start is None or not step:
            continue
        trips = max(0, -(-(limit - start + _LESS_OPS[cnode.op]) // step))
        best = trips if best is None else min(best, trips)
    return best


def _const_in(cond: Body, ref: TensorRef, caller: Body, node: Node,
              cond_args: list[str]) -> int | None:
    if ref.is_arg:
        return _caller_const(caller, node, cond_args.index(ref.node)) \
            if ref.node in cond_args else None
    return _scalar_const(cond.nodes.get(ref.node))


def _caller_const(caller: Body, node: Node, index: int) -> int | None:
    if index >= len(node.data_inputs):
        return None
    ref = node.data_inputs[index][0]
    return None if ref.is_arg else _scalar_const(caller.nodes.get(ref.node))


def _increment(body: Body, body_args: list[str], rets, index: int) -> int | None:
    if index >= len(rets) or index >= len(body_args):
        return None
    ref = rets[index][0]
    producer = None if ref.is_arg else body.nodes.get(ref.node)
    while producer is not None and producer.op == "Identity" and producer.data_inputs:
        ref = producer.data_inputs[0][0]
        producer = None if ref.is_arg else body.nodes.get(ref.node)
    if producer is None or producer.op not in ("Add", "AddV2") \
            or len(producer.data_inputs) != 2:
        return None
    (a, _), (b, _) = producer.data_inputs
    if not (a.is_arg and a.node == body_args[index]):
        a, b = b, a
    if not (a.is_arg and a.node == body_args[index]) or b.is_arg:
        return None
    step = _scalar_const(body.nodes.get(b.node))
    return step if step and step > 0 else None


def _scalar_const(node: Node | None) -> int | None:
    if node is None or node.op != "Const" or "value" not in node.node_def.attr:
        return None
    tensor = node.node_def.attr["value"].tensor
    if tensor.tensor_shape.dim:
        return None
    if tensor.int_val:
        return int(tensor.int_val[0])
    if tensor.int64_val:
        return int(tensor.int64_val[0])
    if tensor.tensor_content:
        import numpy as np

        width = 8 if len(tensor.tensor_content) == 8 else 4
        return int(np.frombuffer(tensor.tensor_content, dtype=f"<i{width}")[0])
    return None


def estimate_traffic(view: GraphView, shapes: TensorShapes, weights: CallWeights,
                     converted: dict[tuple[str, str], tuple[str, ...]] | None = None,
                     target: int = 0) -> Traffic:
    """Estimated float bytes written and read per step (see the module docstring).

    Args:
      view: the graph.
      shapes: its tensor shapes.
      weights: runs per step of each body (``body_weights``).
      converted: to measure the graph tfamp is about to write instead of
        `view` itself: (function, node) -> the type attributes switched to
        `target` (a Coloring's decisions). A Cast is then counted wherever an
        edge's two ends disagree, one per (tensor, dtype), as ``insert_casts``
        adds them.
      target: the 16-bit DataType enum `converted` switches to.

    Returns:
      A Traffic.
    """
    return estimate_traffic_before_after(view, shapes, weights, converted or {}, target)[1]


def estimate_traffic_before_after(
        view: GraphView, shapes: TensorShapes, weights: CallWeights,
        converted: dict[tuple[str, str], tuple[str, ...]], target: int,
) -> tuple[Traffic, Traffic]:
    """(traffic of `view` as it is, traffic with `converted` applied), in one pass."""
    by_body: dict[str, dict[str, tuple[str, ...]]] = {}
    for (function, node), attrs in converted.items():
        if attrs:
            by_body.setdefault(function, {})[node] = attrs
    totals = [[Bytes(), Bytes(), 0] for _ in range(2)]  # total, cast, casts
    unknown = counted = 0
    for body in view.bodies:
        weight = weights.weights.get(body.name, 0)
        if not weight:
            continue
        acc = _BodyTraffic(body, shapes, by_body.get(body.name, {}), target)
        acc.run()
        unknown += acc.unknown
        counted += acc.known
        for mode, result in enumerate(totals):
            result[0] = result[0] + _scale(acc.sums[mode], weight)
            result[1] = result[1] + _scale(acc.cast_sums[mode], weight)
            result[2] += acc.casts[mode]
    known = unknown <= MAX_UNKNOWN_SHARE * (unknown + counted)
    before, after = (
        Traffic(total if known else None, cast if known else None, casts, unknown, counted)
        for total, cast, casts in totals)
    return before, after


def _scale(sums: dict[int, int], factor: int) -> Bytes:
    return Bytes(tuple(sorted(((d, c * factor) for d, c in sums.items() if c),
                              reverse=True)))


def _passes_through(node: Node) -> bool:
    return node.op in NO_COPY_OPS or bool(node.called_functions)


class _BodyTraffic:
    """One body's bytes as {degree: bytes} sums, for two modes at once.

    Mode 0 is the body as it is; mode 1 applies `converted` (node -> type
    attributes now `target`). Lookups by tensor are shared by both.
    """

    def __init__(self, body: Body, shapes: TensorShapes,
                 converted: dict[str, tuple[str, ...]], target: int):
        self.body = body
        self.counts = shapes.counts(body.name)
        self.converted = converted
        self.target = target
        self.sums: list[dict[int, int]] = [{}, {}]
        self.cast_sums: list[dict[int, int]] = [{}, {}]
        self.casts = [0, 0]
        self.unknown = 0
        self.known = 0
        self.ret_dtypes: dict[TensorRef, list[int]] = {}
        for ref, _, dtype in body.rets.values():
            self.ret_dtypes.setdefault(ref, []).append(dtype)
        self.through = {name for name, node in body.nodes.items() if _passes_through(node)}

    def dtype(self, mode: int, name: str, port) -> int:
        if mode:
            attrs = self.converted.get(name)
            if attrs and port.type_attr in attrs:
                return self.target
        return port.dtype

    def run(self) -> None:
        body = self.body
        for name, dtype in body.arg_dtypes.items():
            if dtype in FLOAT_TYPES:
                self._tensor(TensorRef(name, 0, is_arg=True), None, True, None)
        for name, node in body.nodes.items():
            write = name not in self.through
            cast_source = None
            if node.op == "Cast" and node.data_inputs and node.inputs:
                cast_source = node.data_inputs[0][0]
                self._existing_cast(name, node, cast_source)
            for index, port in enumerate(node.outputs):
                if port.dtype in FLOAT_TYPES:
                    self._tensor(TensorRef(name, index), port, write, cast_source)

    def _existing_cast(self, name: str, node: Node, source: TensorRef) -> None:
        elements = self.counts.get(source)
        for mode in (0, 1):
            src = self.dtype(mode, name, node.inputs[0])
            dst = self.dtype(mode, name, node.outputs[0])
            if src in FLOAT_TYPES and dst in FLOAT_TYPES and src != dst:
                self.casts[mode] += 1
                if elements is not None:
                    degree, count = elements
                    sums = self.cast_sums[mode]
                    sums[degree] = sums.get(degree, 0) + count * (
                        dtype_bytes(src) + dtype_bytes(dst))

    def _tensor(self, ref: TensorRef, port, write: bool, cast_source) -> None:
        """`port` is the producing output port, or None for a function argument."""
        body = self.body
        consumers = body.consumers.get(ref, ())
        elements = self.counts.get(ref)
        if elements is None:
            if consumers or (write and port is not None):
                self.unknown += 1
            return
        self.known += 1
        degree, count = elements
        if port is None:
            have = (body.arg_dtypes[ref.node],) * 2
        else:
            have = (port.dtype, self.dtype(1, ref.node, port))
        per_element = [dtype_bytes(have[0]), dtype_bytes(have[1])] if write else [0, 0]
        wanted: list[tuple[int, int]] = []  # (mode, dtype) that need a Cast
        nodes, through, converted, target = body.nodes, self.through, self.converted, self.target
        for consumer, index in consumers:
            inputs = nodes[consumer].inputs
            if index >= len(inputs):
                continue
            in_port = inputs[index]
            attrs = converted.get(consumer)
            want = (in_port.dtype,
                    target if attrs and in_port.type_attr in attrs else in_port.dtype)
            for mode in (0, 1):
                if want[mode] != have[mode] and want[mode] in FLOAT_TYPES:
                    wanted.append((mode, want[mode]))
            if consumer not in through:
                per_element[0] += dtype_bytes(want[0])
                per_element[1] += dtype_bytes(want[1])
        for dtype in self.ret_dtypes.get(ref, ()):
            for mode in (0, 1):
                if dtype != have[mode] and dtype in FLOAT_TYPES:
                    wanted.append((mode, dtype))
        for mode, dtype in dict.fromkeys(wanted):
            if not self._bypass(mode, cast_source, dtype):
                self._cast(mode, degree, count, have[mode], dtype)
        for mode in (0, 1):
            if per_element[mode]:
                sums = self.sums[mode]
                sums[degree] = sums.get(degree, 0) + count * per_element[mode]

    def _cast(self, mode: int, degree: int, count: int, have: int, want: int) -> None:
        moved = count * (dtype_bytes(have) + dtype_bytes(want))
        self.casts[mode] += 1
        for sums in (self.sums[mode], self.cast_sums[mode]):
            sums[degree] = sums.get(degree, 0) + moved

    def _bypass(self, mode: int, cast_source: TensorRef | None, want: int) -> bool:
        """A Cast's consumer wanting the Cast's own input dtype reads the input."""
        if cast_source is None:
            return False
        port = self.body.producer_port(cast_source)
        if port is None:
            return False
        if cast_source.is_arg:
            return port.dtype == want
        return self.dtype(mode, cast_source.node, port) == want
