"""Estimated float memory traffic of one step: bytes written and read by float tensors.

The model (deliberately simple, the same for every graph it compares):

* every float output is written once and read once per consuming input, at
  its element count x bytes of its dtype (float32 4, float16/bfloat16 2);
  twice by a kernel that makes two passes over it (``oplists.TWO_PASS_INPUTS``:
  a training FusedBatchNorm's x, its gradient's dy and x);
* a Cast between float types reads its input and writes its output, and is
  read by its consumers like any tensor; ``cast_bytes`` is what the Casts
  themselves read and write;
* ops that only pass a buffer along or read its shape (``NO_COPY_OPS``:
  Identity, Reshape, Shape, ..., and calls: PartitionedCall, While, If, ...)
  neither read nor write; what flows through a call is counted inside the
  called body;
* each body counts once per run: the top graph once, a called function once per
  call, a ``While``/``StatelessWhile`` body and cond once per iteration where the
  trip count is static (``static_trip_count``), else ``default_trips`` times
  (1 unless the caller knows better) and the loop is listed as not static;
  both branches of an ``If``/``Case`` count (an upper bound);
* a float tensor whose shape is unknown (e.g. FusedBatchNormV3's reserve
  space) is left out and counted in ``unknown_tensors``; the figure is given
  only when at most ``MAX_UNKNOWN_SHARE`` of the float tensors are left out.

Per runtime (``runtime_cost``), the same walk also counts the kernels each
op launches on TensorFlow's executor (``kernels``: every op but views, weights
and constants, plus each Cast) and the fused model's figures: the bytes of the
tensors materialised at fusion boundaries (``fused``) and the fused kernels
(``fused_kernels``: library kernels, reductions, element-wise fusions that
write a result, Casts that fuse with nothing).

``estimate_traffic`` works on any GraphView (the original graph, tfamp's or
grappler's result) and, given a Coloring, on the graph tfamp is about to write
(new dtypes and the Casts ``insert_casts`` will add) without building it.
Linear in the number of nodes and edges.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable

from tensorflow.core.framework import types_pb2
from tensorflow.python.framework import op_def_registry

from tfamp.oplists import NO_KERNEL_OPS, TWO_PASS_INPUTS
from tfamp.rewrite.graph import FLOAT_TYPES, Body, GraphView, Node, TensorRef
from tfamp.rewrite.runtime_cost import ELEMENTWISE, LIBRARY, PARAMETER, REDUCTION, op_kind
from tfamp.rewrite.shapes import BYTES_PER_ELEMENT, Bytes, TensorShapes, dtype_bytes

NO_COPY_OPS = frozenset({
    "Identity", "IdentityN", "StopGradient", "PreventGradient", "Reshape",
    "ExpandDims", "Squeeze", "NoOp",
    "Shape", "ShapeN", "Rank", "Size",  # read the shape only
})
LOOP_OPS = frozenset({"While", "StatelessWhile"})
# A Cast of a constant is folded before the step runs (TensorFlow's constant
# folding, XLA's): the executor launches no kernel for it.
CONSTANT_OPS = frozenset({"Const", "HostConst"})
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
      kernels: kernels TensorFlow's executor launches per step (ops with a
        float result but views, weights and constants; Casts included).
      fused: bytes of the tensors materialised under XLA's fusion (see
        ``runtime_cost``); None likewise.
      fused_kernels: kernels per step under XLA's fusion.
    """

    total: Bytes | None
    cast: Bytes | None
    casts: int
    unknown_tensors: int
    known_tensors: int = 0
    kernels: int = 0
    fused: Bytes | None = None
    fused_kernels: int = 0

    def fused_bytes(self) -> int | None:
        return None if self.fused is None else self.fused.known()

    def total_bytes(self) -> int | None:
        return None if self.total is None else self.total.known()

    def cast_bytes(self) -> int | None:
        return None if self.cast is None else self.cast.known()


def body_weights(view: GraphView, default_trips: int = 1,
                 shapes: TensorShapes | None = None) -> CallWeights:
    """Runs per step of every body, following calls from the top graph.

    Args:
      view: the graph.
      default_trips: iterations assumed for a loop without a static trip count.
      shapes: tensor shapes, so a bound read from a static shape (a Keras RNN
        loops ``tf.shape(inputs)[0]`` times) counts as static.
    """
    values = _IntValues(view, shapes)
    calls: dict[str, list[tuple[str, int]]] = {}
    not_static = []
    for body in view.bodies:
        for node in body.nodes.values():
            if not node.called_functions:
                continue
            multiplier = 1
            if node.op in LOOP_OPS:
                trips = values.trip_count(body, node)
                if trips is None:
                    not_static.append(f"{body.name}/{node.name}" if body.name else node.name)
                    trips = default_trips
                multiplier = trips
            for callee in node.called_functions:
                if callee in values.bodies:
                    calls.setdefault(body.name, []).append((callee, multiplier))
    # Calls form a DAG (TensorFlow has no recursion): Kahn's order from the top.
    indegree = dict.fromkeys(values.bodies, 0)
    for edges in calls.values():
        for callee, _ in edges:
            indegree[callee] += 1
    weights = dict.fromkeys(values.bodies, 0)
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


_ARG_OFFSET = {"If": 1, "StatelessIf": 1, "Case": 1, "StatelessCase": 1}
_CALL_OPS = frozenset({"PartitionedCall", "StatefulPartitionedCall"})
_IntValue = int | tuple[int, ...] | None


class _IntValues:
    """Static integer values (scalars and shape vectors), across function calls.

    Enough to find loop trip counts: Const, Identity, Shape of a fully known
    shape, StridedSlice of that, a loop-invariant argument (its callers' value),
    a call's result (the callee's), and a While's counter output (start + trips
    x step). Anything else is None. Memoised; each value is resolved once.
    """

    def __init__(self, view: GraphView, shapes: TensorShapes | None):
        self.bodies = {body.name: body for body in view.bodies}
        self.shapes = shapes
        self.memo: dict[tuple[str, TensorRef], _IntValue] = {}
        self.trips: dict[tuple[str, str], int | None] = {}

    @functools.cached_property
    def call_sites(self) -> dict[str, list[tuple[Body, Node]]]:
        """Function name -> (body, node) of every call of it (asked for by
        arguments only: a graph without loops never needs it)."""
        sites: dict[str, list[tuple[Body, Node]]] = {}
        for body in self.bodies.values():
            for node in body.nodes.values():
                if node.called_functions:
                    for callee in dict.fromkeys(node.called_functions):
                        sites.setdefault(callee, []).append((body, node))
        return sites

    def value(self, body: Body, ref: TensorRef) -> _IntValue:
        key = (body.name, ref)
        if key in self.memo:
            return self.memo[key]
        self.memo[key] = None  # guards against cycles while resolving
        result = self._resolve(body, ref)
        self.memo[key] = result
        return result

    def scalar(self, body: Body, ref: TensorRef) -> int | None:
        value = self.value(body, ref)
        return value if isinstance(value, int) else None

    def _resolve(self, body: Body, ref: TensorRef) -> _IntValue:
        if ref.is_arg:
            return self._argument(body, ref.node)
        node = body.nodes.get(ref.node)
        if node is None:
            return None
        op = node.op
        if op == "Const":
            return _const_value(node) if ref.index == 0 else None
        if op in ("Identity", "Snapshot") and node.data_inputs:
            return self.value(body, node.data_inputs[0][0])
        if op == "Shape" and node.data_inputs and self.shapes is not None:
            shape = self.shapes.shape(body.name, node.data_inputs[0][0])
            return shape if shape is not None and all(d >= 0 for d in shape) else None
        if op == "StridedSlice" and len(node.data_inputs) == 4:
            return self._strided_slice(body, node)
        if op in LOOP_OPS:
            return self._loop_output(body, node, ref.index)
        if (op in _CALL_OPS or op in self.bodies) and node.called_functions:
            callee = self.bodies.get(node.called_functions[0])
            rets = list(callee.rets.values()) if callee is not None else []
            if ref.index < len(rets):
                return self.value(callee, rets[ref.index][0])
        return None

    def _argument(self, body: Body, arg: str) -> _IntValue:
        sites = self.call_sites.get(body.name, [])
        index = list(body.arg_dtypes).index(arg)
        found = []
        for caller, node in sites:
            if node.op in LOOP_OPS and not self._invariant(node, index):
                return None
            position = index + _ARG_OFFSET.get(node.op, 0)
            if position >= len(node.data_inputs):
                return None
            found.append(self.value(caller, node.data_inputs[position][0]))
        if not found or any(v is None or v != found[0] for v in found):
            return None
        return found[0]

    def _invariant(self, loop: Node, index: int) -> bool:
        """Does the loop body return loop variable `index` unchanged?"""
        body = self._loop_body(loop)
        if body is None:
            return False
        ref = _through_identity(body, _ret_ref(body, index))
        args = list(body.arg_dtypes)
        return ref is not None and ref.is_arg and index < len(args) and ref.node == args[index]

    def _loop_body(self, loop: Node) -> Body | None:
        attr = loop.node_def.attr
        return self.bodies.get(attr["body"].func.name) if "body" in attr else None

    def _strided_slice(self, body: Body, node: Node) -> _IntValue:
        vector = self.value(body, node.data_inputs[0][0])
        begin, end, strides = (self.value(body, ref) for ref, _ in node.data_inputs[1:])
        attr = node.node_def.attr
        shrink = attr["shrink_axis_mask"].i if "shrink_axis_mask" in attr else 0
        if not isinstance(vector, tuple) or not all(
                isinstance(v, tuple) and len(v) == 1 for v in (begin, end, strides)):
            return None
        if shrink & 1 and strides[0] == 1 and -len(vector) <= begin[0] < len(vector):
            return vector[begin[0]]
        return None

    def _loop_output(self, body: Body, loop: Node, index: int) -> _IntValue:
        if index >= len(loop.data_inputs):
            return None
        start = self.value(body, loop.data_inputs[index][0])
        if self._invariant(loop, index):
            return start
        loop_body = self._loop_body(loop)
        step = _increment(loop_body, index) if loop_body is not None else None
        trips = self.trip_count(body, loop)
        if isinstance(start, int) and step and trips is not None:
            return start + trips * step
        return None

    def trip_count(self, caller: Body, node: Node) -> int | None:
        """Iterations of a While loop, if its cond bounds a counter statically.

        Recognised: the cond compares loop variable j with ``Less`` /
        ``LessEqual`` against a static value (a Const in the cond, or a
        loop-invariant variable whose value is static); j starts from a static
        value and the body adds a positive Const to it. The smallest bound wins
        (TensorFlow's ``maximum_iterations`` counter and Keras' RNN time step
        have this form; a gradient loop runs as often as its forward loop's
        counter says).
        """
        key = (caller.name, node.name)
        if key in self.trips:
            return self.trips[key]
        self.trips[key] = None  # cycle guard
        attr = node.node_def.attr
        cond = self.bodies.get(attr["cond"].func.name) if "cond" in attr else None
        body = self._loop_body(node)
        best = None
        if cond is not None and body is not None:
            cond_args = list(cond.arg_dtypes)
            for cnode in cond.nodes.values():
                if cnode.op not in _LESS_OPS or len(cnode.data_inputs) != 2:
                    continue
                (a, _), (b, _) = cnode.data_inputs
                if not a.is_arg or a.node not in cond_args:
                    continue
                j = cond_args.index(a.node)
                limit = self.scalar(cond, b)
                start = (self.scalar(caller, node.data_inputs[j][0])
                         if j < len(node.data_inputs) else None)
                step = _increment(body, j)
                if limit is None or start is None or not step:
                    continue
                trips = max(0, -(-(limit - start + _LESS_OPS[cnode.op]) // step))
                best = trips if best is None else min(best, trips)
        self.trips[key] = best
        return best


def static_trip_count(view: GraphView, caller: Body, node: Node,
                      shapes: TensorShapes | None = None) -> int | None:
    """Iterations of While `node` in body `caller`, or None if not static."""
    return _IntValues(view, shapes).trip_count(caller, node)


def _ret_ref(body: Body, index: int) -> TensorRef | None:
    rets = list(body.rets.values())
    return rets[index][0] if index < len(rets) else None


def _through_identity(body: Body, ref: TensorRef | None) -> TensorRef | None:
    while ref is not None and not ref.is_arg:
        node = body.nodes.get(ref.node)
        if node is None or node.op != "Identity" or not node.data_inputs:
            break
        ref = node.data_inputs[0][0]
    return ref


def _increment(body: Body, index: int) -> int | None:
    """The positive Const step the loop body adds to loop variable `index`."""
    args = list(body.arg_dtypes)
    ref = _through_identity(body, _ret_ref(body, index))
    producer = None if ref is None or ref.is_arg else body.nodes.get(ref.node)
    if producer is None or producer.op not in ("Add", "AddV2") \
            or len(producer.data_inputs) != 2 or index >= len(args):
        return None
    (a, _), (b, _) = producer.data_inputs
    if not (a.is_arg and a.node == args[index]):
        a, b = b, a
    if not (a.is_arg and a.node == args[index]) or b.is_arg:
        return None
    step = _const_value(body.nodes.get(b.node))
    return step if isinstance(step, int) and step > 0 else None


def _const_value(node: Node | None) -> _IntValue:
    """An integer scalar or vector Const's value."""
    if node is None or node.op != "Const" or "value" not in node.node_def.attr:
        return None
    tensor = node.node_def.attr["value"].tensor
    dims = [d.size for d in tensor.tensor_shape.dim]
    if len(dims) > 1:
        return None
    if tensor.int_val or tensor.int64_val:
        values = list(tensor.int_val) or list(tensor.int64_val)
    elif tensor.tensor_content and tensor.dtype in (types_pb2.DT_INT32, types_pb2.DT_INT64):
        import numpy as np

        width = 4 if tensor.dtype == types_pb2.DT_INT32 else 8
        values = np.frombuffer(tensor.tensor_content, dtype=f"<i{width}").tolist()
    else:
        return None
    if not dims:
        return int(values[0])
    if len(values) == 1 and dims[0] > 1:  # a splat
        values = values * dims[0]
    return tuple(int(v) for v in values) if len(values) == dims[0] else None


def estimate_traffic(view: GraphView, shapes: TensorShapes, weights: CallWeights,
                     converted: dict[tuple[str, str], tuple[str, ...]] | None = None,
                     target: int = 0, outputs: Iterable[str] | None = None) -> Traffic:
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
      outputs: the top graph's fetched tensors or nodes ("node:0" or "node"),
        if known: then its nodes that neither a fetch nor a stateful op needs
        are not counted (``dead_nodes``: TensorFlow never runs them).

    Returns:
      A Traffic.
    """
    return estimate_traffic_before_after(view, shapes, weights, converted or {}, target,
                                         outputs)[1]


def estimate_traffic_before_after(
        view: GraphView, shapes: TensorShapes, weights: CallWeights,
        converted: dict[tuple[str, str], tuple[str, ...]], target: int,
        outputs: Iterable[str] | None = None, dead: frozenset[str] | None = None,
) -> tuple[Traffic, Traffic]:
    """(traffic of `view` as it is, traffic with `converted` applied), in one pass
    (`outputs`: see ``estimate_traffic``; or `dead`, ``dead_nodes``' answer)."""
    if dead is None:
        dead = dead_nodes(view.bodies[0], outputs) if outputs is not None else frozenset()
    by_body: dict[str, dict[str, tuple[str, ...]]] = {}
    for (function, node), attrs in converted.items():
        if attrs:
            by_body.setdefault(function, {})[node] = attrs
    # total, cast, casts, kernels, fused, fused kernels
    totals = [[Bytes(), Bytes(), 0, 0, Bytes(), 0] for _ in range(2)]
    unknown = counted = 0
    for body in view.bodies:
        weight = weights.weights.get(body.name, 0)
        if not weight:
            continue
        acc = _BodyTraffic(body, shapes, by_body.get(body.name, {}), target,
                           dead if not body.is_function else frozenset())
        acc.run()
        unknown += acc.unknown
        counted += acc.known
        for mode, result in enumerate(totals):
            result[0] = result[0] + _scale(acc.sums[mode], weight)
            result[1] = result[1] + _scale(acc.cast_sums[mode], weight)
            result[2] += acc.casts[mode]
            result[3] += (acc.kernels + acc.casts[mode] - acc.folded[mode]) * weight
            result[4] = result[4] + _scale(acc.fused_sums[mode], weight)
            result[5] += acc.fused_kernels[mode] * weight
    known = unknown <= MAX_UNKNOWN_SHARE * (unknown + counted)
    before, after = (
        Traffic(total if known else None, cast if known else None, casts, unknown, counted,
                kernels, fused if known else None, fused_kernels)
        for total, cast, casts, kernels, fused, fused_kernels in totals)
    return before, after


def dead_nodes(body: Body, outputs: Iterable[str]) -> frozenset[str]:
    """The nodes of the top graph `body` that TensorFlow never runs when
    `outputs` ("node:0" or "node") are fetched: neither a fetch, nor a stateful
    op (a variable update, an optimizer's apply: they run in a tf.function
    whatever is fetched), nor an input (data or control) of one that runs.
    TensorFlow prunes them before running a function (and grappler's pruner
    in a graph). Keras 3's ``silu`` gradient, for one, computes a gradient
    for its constant ``beta`` at every activation that nothing reads.

    Found from the graph's loose ends (nodes nothing reads), walking up while
    every reader of a node is dead: the cost is one look at each node and
    the dead region, not a walk of the whole graph."""
    nodes, consumers = body.nodes, body.consumers
    kept = {name.split(":")[0].lstrip("^") for name in outputs}
    kept.update(body.waiters())  # (what something waits on is never dead: its waiter may run)
    stateful: dict[str, bool] = {}

    def removable(name: str, node: Node) -> bool:
        if name in kept:
            return False
        known = stateful.get(node.op)
        if known is None:
            op_def = op_def_registry.get(node.op)  # (a function call: None, kept)
            known = stateful[node.op] = op_def is None or op_def.is_stateful
        return not known

    readers = dict.fromkeys(nodes, 0)
    for ref, edges in consumers.items():
        if not ref.is_arg and ref.node in readers:
            readers[ref.node] += len(edges)
    stack = [name for name, count in readers.items()
             if not count and removable(name, nodes[name])]
    dead: set[str] = set()
    while stack:
        name = stack.pop()
        if name in dead:
            continue
        dead.add(name)
        for ref, _ in nodes[name].data_inputs:
            if ref.is_arg or ref.node not in nodes:
                continue
            readers[ref.node] -= 1
            if not readers[ref.node] and removable(ref.node, nodes[ref.node]):
                stack.append(ref.node)
    return frozenset(dead)


def _scale(sums: dict[int, int], factor: int) -> Bytes:
    return Bytes(tuple(sorted(((d, c * factor) for d, c in sums.items() if c),
                              reverse=True)))


# Reader kinds of the fused model besides runtime_cost's: a call (its
# arguments must be in memory; the callee's nodes do the reading) and a view
# (reads nothing; its own readers decide). A Cast whose input comes from a
# boundary (a library kernel, a reduction, a weight) fuses only into readers
# that are all element-wise, else it is a kernel of its own.
_CALL, _VIEW, _CAST_OF_BOUNDARY = 4, 5, 6


class _BodyTraffic:
    """One body's bytes as {degree: bytes} sums, for two modes at once.

    Mode 0 is the body as it is; mode 1 applies `converted` (node -> type
    attributes now `target`). Lookups by tensor are shared by both.
    """

    def __init__(self, body: Body, shapes: TensorShapes,
                 converted: dict[str, tuple[str, ...]], target: int,
                 dead: frozenset[str] = frozenset()):
        self.body = body
        self.dead = dead  # nodes TensorFlow never runs (dead_nodes): not counted
        self.counts = shapes.counts(body.name, body)
        self.converted = converted
        self.target = target
        self.sums: list[dict[int, int]] = [{}, {}]
        self.cast_sums: list[dict[int, int]] = [{}, {}]
        self.fused_sums: list[dict[int, int]] = [{}, {}]
        self.casts = [0, 0]
        self.kernels = 0  # executor kernels of the body's own ops (Casts apart)
        self.folded = [0, 0]  # inserted Casts of constants (folded: no kernel)
        self.fused_kernels = [0, 0]
        self.unknown = 0
        self.known = 0
        self.ret_dtypes: dict[TensorRef, list[int]] = {}
        for ref, _, dtype in body.rets.values():
            self.ret_dtypes.setdefault(ref, []).append(dtype)
        # Nodes that write no bytes of their own: views of their input
        # (NO_COPY_OPS) and calls (the callee's nodes are counted). Each node's
        # kind as a reader in the fused model (runtime_cost.op_kind).
        # node -> input positions it reads twice (oplists.TWO_PASS_INPUTS)
        self.twice: dict[str, tuple[int, ...]] = {
            name: TWO_PASS_INPUTS[node.op] for name, node in body.nodes.items()
            if node.op in TWO_PASS_INPUTS and node.node_def.attr["is_training"].b
        } if body.ops & TWO_PASS_INPUTS.keys() else {}
        self.through = through = set()
        self.kinds = kinds = {}
        known_kinds: dict[tuple[str, bool], int] = {}
        for name, node in body.nodes.items():
            if node.called_functions:
                through.add(name)
                kinds[name] = _CALL
            elif node.op in NO_COPY_OPS:
                through.add(name)
                kinds[name] = _VIEW
            else:
                key = (node.op, not node.outputs)
                kind = known_kinds.get(key)
                if kind is None:
                    kind = known_kinds[key] = op_kind(node.op, sink=key[1])
                kinds[name] = kind

    def dtype(self, mode: int, name: str, port) -> int:
        if mode:
            attrs = self.converted.get(name)
            if attrs and port.type_attr in attrs:
                return self.target
        return port.dtype

    def _producer_kind(self, ref: TensorRef, memo: dict) -> int:
        """The fused model's kind of what writes `ref`: a view is its source's
        (a view of an element-wise result is written where a reader needs it;
        of anything else, it is in memory already, PARAMETER); a Cast of a
        boundary is _CAST_OF_BOUNDARY."""
        kind = memo.get(ref.node)
        if kind is not None:
            return kind
        if ref.is_arg:
            return PARAMETER
        node = self.body.nodes[ref.node]
        kind = self.kinds[ref.node]
        if kind == _CALL:
            kind = PARAMETER
        elif kind == _VIEW or node.op == "Cast":
            source = node.data_inputs[0][0] if node.data_inputs else None
            memo[ref.node] = PARAMETER  # (cycle guard: TF1 loops)
            inner = PARAMETER if source is None else self._producer_kind(source, memo)
            if node.op == "Cast":
                kind = ELEMENTWISE if inner == ELEMENTWISE else _CAST_OF_BOUNDARY
            else:
                kind = ELEMENTWISE if inner == ELEMENTWISE else PARAMETER
        memo[ref.node] = kind
        return kind

    def run(self) -> None:
        body = self.body
        # (Everything the per-tensor step reads is bound here once: it runs for
        # every float tensor and every edge of the graph.)
        consumers_of, counts, nodes = body.consumers.get, self.counts.get, body.nodes
        through, converted, target = self.through, self.converted, self.target
        ret_dtypes_of, bypass, add_cast = self.ret_dtypes.get, self._bypass, self._cast
        nbytes = BYTES_PER_ELEMENT.get  # (dtype_bytes)
        sums0, sums1 = self.sums
        fused0, fused1 = self.fused_sums
        fused_kernels, folded = self.fused_kernels, self.folded
        kinds, producer_kind, kind_memo = self.kinds, self._producer_kind, {}
        twice = self.twice
        dead = self.dead
        known = unknown = 0

        def fused(sums, mode, pk, degree, count, have, reads, forced, reduced,
                  cast_to, cast_reads, cast_forced, cast_fuses) -> None:
            """Adds one tensor's materialised bytes in one mode (runtime_cost)."""
            if pk == ELEMENTWISE:
                materialised = forced
            elif pk == _CAST_OF_BOUNDARY:
                materialised = forced or reduced
            else:
                materialised = True
            moved = 0
            width = nbytes(have, 0)
            if materialised:
                if pk == ELEMENTWISE or pk == _CAST_OF_BOUNDARY:
                    fused_kernels[mode] += 1  # a fusion that writes this result
                    moved += width
                elif pk != PARAMETER:
                    moved += width  # (the library kernel / reduction is counted per node)
                moved += width * reads
            if cast_to:
                cast_width = nbytes(cast_to, 0)
                if pk == ELEMENTWISE or pk == _CAST_OF_BOUNDARY:
                    if cast_forced:  # the producer's fusion writes the cast result too
                        moved += cast_width * (1 + cast_reads)
                        if not materialised:
                            fused_kernels[mode] += 1
                elif cast_fuses:  # every reader converts as it reads
                    moved += width * cast_reads
                else:  # a Cast between two boundaries: a kernel of its own
                    moved += width + cast_width * (1 + cast_reads)
                    fused_kernels[mode] += 1
            if moved:
                sums[degree] = sums.get(degree, 0) + count * moved

        def tensor(ref: TensorRef, port, write: bool, cast_source) -> None:
            """`port` is the producing output port, or None for a function argument."""
            nonlocal known, unknown
            consumers = consumers_of(ref, ())
            if dead and consumers:
                consumers = [c for c in consumers if c[0] not in dead]
            elements = counts(ref)
            if elements is None:
                if consumers or (write and port is not None):
                    unknown += 1
                return
            known += 1
            degree, count = elements
            if port is None:
                have0 = have1 = body.arg_dtypes[ref.node]
            else:
                have0 = have1 = port.dtype
                attrs = converted.get(ref.node)
                if attrs and port.type_attr in attrs:
                    have1 = target
            bytes0 = bytes1 = nbytes(have0, 0) if write else 0
            if write and have1 != have0:
                bytes1 = nbytes(have1, 0)
            wanted: list[tuple[int, int]] = []  # (mode, dtype) that need a Cast
            # The fused model's readers: direct reads, whether one needs the
            # tensor in memory, whether one is not element-wise; per mode.
            reads0 = reads1 = 0
            forced0 = forced1 = reduced0 = reduced1 = False
            cast_to = cast_reads = 0
            cast_forced, cast_fuses = False, True
            for consumer, index in consumers:
                inputs = nodes[consumer].inputs
                if index >= len(inputs):
                    continue
                in_port = inputs[index]
                want0 = want1 = in_port.dtype
                attrs = converted.get(consumer)
                if attrs and in_port.type_attr in attrs:
                    want1 = target
                if want0 != have0 and want0 in FLOAT_TYPES:
                    wanted.append((0, want0))
                if want1 != have1 and want1 in FLOAT_TYPES:
                    wanted.append((1, want1))
                if consumer not in through:
                    bytes0 += nbytes(want0, 0)
                    bytes1 += nbytes(want1, 0)
                    if twice and index in twice.get(consumer, ()):
                        bytes0 += nbytes(want0, 0)
                        bytes1 += nbytes(want1, 0)
                kind = kinds[consumer]
                reading = kind <= PARAMETER
                forcing = LIBRARY <= kind <= _CALL
                other = kind != ELEMENTWISE and kind != _VIEW
                reads0 += reading
                forced0 = forced0 or forcing
                reduced0 = reduced0 or other
                if want1 == have1 or want1 not in FLOAT_TYPES:
                    reads1 += reading
                    forced1 = forced1 or forcing
                    reduced1 = reduced1 or other
                else:
                    cast_to = want1
                    cast_reads += reading
                    cast_forced = cast_forced or forcing
                    cast_fuses = cast_fuses and not other
            ret_dtypes = ret_dtypes_of(ref)
            if ret_dtypes:
                for dtype in ret_dtypes:
                    if dtype != have0 and dtype in FLOAT_TYPES:
                        wanted.append((0, dtype))
                    if dtype != have1 and dtype in FLOAT_TYPES:
                        wanted.append((1, dtype))
                        cast_to, cast_forced, cast_fuses = dtype, True, False
                    else:
                        forced1 = True
                forced0 = True  # (a result leaves in memory)
            elif not consumers:  # an output of the graph (or unused): written
                forced0 = forced1 = True
            if wanted:
                for mode, dtype in dict.fromkeys(wanted):
                    if not bypass(mode, cast_source, dtype):
                        add_cast(mode, degree, count, have1 if mode else have0, dtype)
                        if port is not None and nodes[ref.node].op in CONSTANT_OPS:
                            folded[mode] += 1  # (folded before the step: no kernel)
            if bytes0:
                sums0[degree] = sums0.get(degree, 0) + count * bytes0
            if bytes1:
                sums1[degree] = sums1.get(degree, 0) + count * bytes1
            pk = PARAMETER if port is None else producer_kind(ref, kind_memo)
            fused(fused0, 0, pk, degree, count, have0, reads0, forced0, reduced0,
                  0, 0, False, True)
            fused(fused1, 1, pk, degree, count, have1, reads1, forced1, reduced1,
                  cast_to, cast_reads, cast_forced, cast_fuses)

        for name, dtype in body.arg_dtypes.items():
            if dtype in FLOAT_TYPES:
                tensor(TensorRef(name, 0, is_arg=True), None, False, None)
        new = tuple.__new__  # (TensorRef(name, index) without its Python-level __new__)
        kernels = boundary_kernels = 0
        for name, node in nodes.items():
            if dead and name in dead:
                continue
            cast_source = None
            if node.op == "Cast" and node.data_inputs and node.inputs:
                cast_source = node.data_inputs[0][0]
                self._existing_cast(name, node, cast_source)
            counted = False
            for index, port in enumerate(node.outputs):
                if port.dtype in FLOAT_TYPES:
                    own = name not in through
                    if own and not counted:
                        counted = True
                        if node.op != "Cast" and node.op not in NO_KERNEL_OPS:
                            kernels += 1  # (Casts are counted as Casts)
                            if kinds[name] in (LIBRARY, REDUCTION):
                                boundary_kernels += 1
                    tensor(new(TensorRef, (name, index, False)), port, own, cast_source)
        self.kernels += kernels
        self.fused_kernels[0] += boundary_kernels
        self.fused_kernels[1] += boundary_kernels
        self.known += known
        self.unknown += unknown

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
