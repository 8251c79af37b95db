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
from collections.abc import Callable

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


# Given (body, node, port index), the dtype an output / input has in the graph
# being measured.
DtypeOf = Callable[[Body, Node, int], int]


def estimate_traffic(view: GraphView, shapes: TensorShapes, weights: CallWeights,
                     out_dtype: DtypeOf | None = None,
                     in_dtype: DtypeOf | None = None) -> Traffic:
    """Estimated float bytes written and read per step (see the module docstring).

    Args:
      view: the graph.
      shapes: its tensor shapes.
      weights: runs per step of each body (``body_weights``).
      out_dtype, in_dtype: the dtype of a node's output / input in the graph
        to measure; by default the dtypes `view` has. Given (e.g. from a
        Coloring), a Cast is counted wherever an edge's two ends disagree, one
        per (tensor, dtype), as ``insert_casts`` adds them.

    Returns:
      A Traffic.
    """
    out_dtype = out_dtype or _port_out
    in_dtype = in_dtype or _port_in
    total, cast_total = Bytes(), Bytes()
    casts = unknown = counted = 0
    for body in view.bodies:
        weight = weights.weights.get(body.name, 0)
        if not weight:
            continue
        acc = _BodyTraffic(body, shapes, out_dtype, in_dtype)
        acc.run()
        casts += acc.casts
        unknown += acc.unknown
        counted += acc.known
        total = total + _scale(acc.total, weight)
        cast_total = cast_total + _scale(acc.cast, weight)
    known = unknown <= MAX_UNKNOWN_SHARE * (unknown + counted)
    return Traffic(total if known else None, cast_total if known else None, casts,
                   unknown, counted)


def _scale(value: Bytes, factor: int) -> Bytes:
    return Bytes(tuple((d, c * factor) for d, c in value.terms))


def _port_out(body: Body, node: Node, index: int) -> int:
    return node.outputs[index].dtype


def _port_in(body: Body, node: Node, index: int) -> int:
    return node.inputs[index].dtype


def _passes_through(node: Node) -> bool:
    return node.op in NO_COPY_OPS or bool(node.called_functions)


class _BodyTraffic:
    """Accumulates one body's bytes as plain (degree -> bytes) sums."""

    def __init__(self, body: Body, shapes: TensorShapes, out_dtype, in_dtype):
        self.body = body
        self.shapes = shapes.shapes.get(body.name, {})
        self.out_dtype = out_dtype
        self.in_dtype = in_dtype
        self.sums: dict[int, int] = {}
        self.cast_sums: dict[int, int] = {}
        self.casts = 0
        self.unknown = 0
        self.known = 0
        self.ret_dtypes: dict[TensorRef, list[int]] = {}
        for ref, _, dtype in body.rets.values():
            self.ret_dtypes.setdefault(ref, []).append(dtype)

    @property
    def total(self) -> Bytes:
        return Bytes(tuple(sorted(self.sums.items(), reverse=True)))

    @property
    def cast(self) -> Bytes:
        return Bytes(tuple(sorted(self.cast_sums.items(), reverse=True)))

    def run(self) -> None:
        body = self.body
        for name, dtype in body.arg_dtypes.items():
            self._tensor(TensorRef(name, 0, is_arg=True), dtype, write=False, cast_source=None)
        for name, node in body.nodes.items():
            write = not _passes_through(node)
            cast_source = None
            if node.op == "Cast" and node.data_inputs and node.inputs:
                src = self.in_dtype(body, node, 0)
                dst = self.out_dtype(body, node, 0)
                if src in FLOAT_TYPES and dst in FLOAT_TYPES and src != dst:
                    self.casts += 1
                    self._add(self.cast_sums, node.data_inputs[0][0],
                              dtype_bytes(src) + dtype_bytes(dst))
                cast_source = node.data_inputs[0][0]
            for index in range(len(node.outputs)):
                dtype = self.out_dtype(body, node, index)
                if dtype in FLOAT_TYPES:
                    self._tensor(TensorRef(name, index), dtype, write, cast_source)

    def _add(self, sums: dict[int, int], ref: TensorRef, per_element: int) -> bool:
        elements = self._elements(ref)
        if elements is None:
            return False
        degree, count = elements
        sums[degree] = sums.get(degree, 0) + count * per_element
        return True

    def _elements(self, ref: TensorRef):
        shape = self.shapes.get(ref)
        if shape is None:
            return None
        degree, count = 0, 1
        for d in shape:
            if d < 0:
                degree += 1
            else:
                count *= d
        return degree, count

    def _tensor(self, ref: TensorRef, have: int, write: bool, cast_source) -> None:
        body = self.body
        if self._elements(ref) is None:
            if ref in body.consumers or write:
                self.unknown += 1
            return
        self.known += 1
        sums = self.sums
        if write:
            self._add(sums, ref, dtype_bytes(have))
        cast_to: set[int] = set()
        for consumer, index in body.consumers.get(ref, ()):
            node = body.nodes[consumer]
            if index >= len(node.inputs):
                continue
            want = self.in_dtype(body, node, index)
            if want != have and want in FLOAT_TYPES:
                if want not in cast_to and not self._bypass(cast_source, want):
                    self._cast(ref, have, want)
                cast_to.add(want)
            if not _passes_through(node):
                self._add(sums, ref, dtype_bytes(want))
        for want in self.ret_dtypes.get(ref, ()):
            if want != have and want in FLOAT_TYPES and want not in cast_to \
                    and not self._bypass(cast_source, want):
                self._cast(ref, have, want)
                cast_to.add(want)

    def _cast(self, ref: TensorRef, have: int, want: int) -> None:
        per_element = dtype_bytes(have) + dtype_bytes(want)
        self.casts += 1
        self._add(self.sums, ref, per_element)
        self._add(self.cast_sums, ref, per_element)

    def _bypass(self, cast_source: TensorRef | None, want: int) -> bool:
        """A Cast's consumer wanting the Cast's own input dtype reads the input."""
        if cast_source is None:
            return False
        port = self.body.producer_port(cast_source)
        if port is None:
            return False
        if cast_source.is_arg:
            return port.dtype == want
        node = self.body.nodes[cast_source.node]
        return self.out_dtype(self.body, node, cast_source.index) == want
