"""Which broadcasts can wait: scalings moved before them, broadcasts left to readers.

The gradient of a mean broadcasts a small tensor to the input's full size and
divides the big result by the count after (``Tile`` then ``RealDiv`` by N:
TensorFlow's Mean gradient); the variance's gradient then doubles it (``Mul``
by 2) and multiplies it by x - mean. Each of those is a full-size op of its own
on TensorFlow's executor, and in float16 the broadcast of an unscaled sum has to
stay float32 until its division (a sum can leave float16's range where its
terms do not). Two exact edits, made before colouring:

* **Scalings move before the broadcast.** Every element of ``tile(r) / c`` is
  ``r[j] / c``, the same operation on the same operands, so
  ``RealDiv(Tile(r, m), c)`` and ``Tile(RealDiv(r, c), m)`` are bit-identical
  (likewise ``Mul`` by a scalar on either side, ``Neg``, and ``BroadcastTo``),
  where ``c`` is a scalar constant and the broadcast feeds nothing else. The
  divided sum is then a small mean-sized statistic the colouring can cast, and
  the big tensor is written once. The two nodes swap roles and keep their
  names: the broadcast's node computes the small scaling, the scaling's node
  broadcasts it (its readers get the same values under the same name). Chains
  move one step at a time: ``Mul(2, RealDiv(Tile(r), N))`` becomes
  ``Tile(Mul(2, RealDiv(r, N)))``.
* **A broadcast read by an op that broadcasts is dropped.** ``Mul(Tile(r), y)``
  with ``r`` broadcastable to ``y``'s shape and ``y`` of the Tile's shape is
  ``Mul(r, y)``: the op's own broadcasting repeats the same elements. The
  Tile, read by nothing else, is removed.

``hoist_broadcasts(graph_def, view, shapes, outputs) -> Hoisted | None``: pure;
None when nothing changes.
"""

from __future__ import annotations

import dataclasses

from tensorflow.core.framework import graph_pb2

from tfamp.rewrite.graph import Body, GraphView, TensorRef
from tfamp.rewrite.node_edits import (
    TF1_FRAME_OPS,
    add_output_shape,
    attrs_of,
    copy_message,
    rewrite_node,
    split_inputs,
)
from tfamp.rewrite.shapes import TensorShapes, dtype_bytes

# Broadcasts whose first input is the value copied (the second says how).
BROADCASTS = frozenset({"Tile", "BroadcastTo"})
# Element-wise scalings by a scalar: op -> the input positions the big operand
# may take (the other, if any, must be a scalar constant).
SCALINGS = {"RealDiv": (0,), "Mul": (0, 1), "Neg": (0,)}
_MAX_ROUNDS = 8  # the longest chain seen is two (RealDiv by N, then Mul by 2)


@dataclasses.dataclass
class Hoisted:
    """A graph whose broadcasts wait (see the module doc).

    Attributes:
      graph_def: the new GraphDef (a copy; the input is not modified).
      written: body name -> {node name: NodeDef written or added, or None for a
        node removed} (build_view's ``written``: every other NodeDef equals
        the input's).
      moves: (body, scaling node, its op, broadcast node) per move, in order:
        the scaling node now broadcasts, the broadcast node now scales.
      dropped: (body, broadcast node removed, its op, the node that reads its
        input now).
      shapes: the new graph's shapes.
      resized: body -> {node: bytes per element} of the nodes whose output is
        now the small tensor (each written once and read once, before and after).
      removed: body -> {node: bytes per element} of the broadcasts dropped.
    """

    graph_def: graph_pb2.GraphDef
    written: dict[str, dict[str, object]]
    moves: list[tuple[str, str, str, str]]
    dropped: list[tuple[str, str, str, str]]
    shapes: TensorShapes
    resized: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    removed: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)

    def traffic_delta(self, original: TensorShapes) -> dict[str, tuple[dict[int, int], int]] | None:
        """What ``traffic`` counts more for the graph as given than for this one,
        per body: ({degree: bytes}, kernels); None where a size is unknown.

        The edits change only the tensors of ``resized`` (big before, small now,
        one writer and one reader either way) and ``removed`` (written and read
        once, one executor kernel); every other tensor keeps its size and its
        readers. Under the fused model all of them are element-wise values that
        no boundary reads, before and after: nothing changes there.
        """
        delta: dict[str, tuple[dict[int, int], int]] = {}
        for body in set(self.resized) | set(self.removed):
            sums: dict[int, int] = {}
            for nodes, now in ((self.resized.get(body, {}), self.shapes),
                               (self.removed.get(body, {}), None)):
                for node, size in nodes.items():
                    ref = TensorRef(node, 0)
                    before = original.elements(body, ref)
                    after = (0, 0) if now is None else now.elements(body, ref)
                    if before is None or after is None:
                        return None
                    for (degree, count), sign in ((before, 1), (after, -1)):
                        sums[degree] = sums.get(degree, 0) + sign * 2 * size * count
            delta[body] = (sums, len(self.removed.get(body, {})))
        return delta

    def touches(self, top_nodes: frozenset[str]) -> bool:
        """Did an edit of the top graph change one of `top_nodes`?"""
        return bool(top_nodes) and any(
            node in top_nodes for nodes in (self.resized.get("", {}), self.removed.get("", {}))
            for node in nodes)

    def edits(self) -> list[dict[str, str]]:
        """The report's ``broadcast_edits`` (see ``RewriteReport``)."""
        return [{"edit": edit, "function": function, "node": node, "op": op, "into": into}
                for edit, rows in (("moved", self.moves), ("dropped", self.dropped))
                for function, node, op, into in rows]


# Output argument names, for references inside a FunctionDef ("node:arg:0").
_OUTPUT_ARG = {"Tile": "output", "BroadcastTo": "output", "RealDiv": "z", "Mul": "z",
               "Neg": "y"}
# Element-wise binary ops that broadcast their operands (TensorFlow's BCast).
BROADCASTING = frozenset({"Mul", "AddV2", "Add", "Sub", "RealDiv", "DivNoNan", "Maximum",
                          "Minimum", "SquaredDifference"})


class _Ops(dict):
    """Each node's op as the plan has edited it (the body's, unless overridden;
    None for a name the body does not have)."""

    def __init__(self, body: Body):
        super().__init__()
        self.nodes = body.nodes

    def __missing__(self, name: str) -> str | None:
        node = self.nodes.get(name)
        return None if node is None else node.op


@dataclasses.dataclass
class _Plan:
    moves: list[tuple[str, str]]  # (scaling, broadcast)
    drops: list[tuple[str, str, int]]  # (broadcast, reader, input position)
    shapes: dict  # the body's shapes after the edits


def hoist_broadcasts(graph_def: graph_pb2.GraphDef, view: GraphView, shapes: TensorShapes,
                     outputs: list[str]) -> Hoisted | None:
    """Moves scalings before broadcasts and drops broadcasts (see the module doc)."""
    fetched = {name.split(":")[0] for name in outputs}
    plans = {body.name: _plan(body, set() if body.is_function else fetched, shapes)
             for body in view.bodies if not body.ops & TF1_FRAME_OPS}
    plans = {name: plan for name, plan in plans.items() if plan.moves or plan.drops}
    if not plans:
        return None
    new_graph_def = graph_pb2.GraphDef()
    new_graph_def.CopyFrom(graph_def)
    functions = {f.signature.name: f for f in new_graph_def.library.function}
    written: dict[str, dict[str, object]] = {}
    moves, dropped = [], []
    resized: dict[str, dict[str, int]] = {}
    removed: dict[str, dict[str, int]] = {}
    new_shapes = dict(shapes.shapes)
    for body in view.bodies:
        plan = plans.get(body.name)
        if plan is None:
            continue
        fdef = functions.get(body.name) if body.is_function else None
        editor = _Editor(body, fdef.node_def if fdef is not None else new_graph_def.node, fdef)
        for scaling, broadcast in plan.moves:
            editor.swap(scaling, broadcast, plan.shapes.get(TensorRef(broadcast, 0)))
            moves.append((body.name, scaling, body.nodes[scaling].op, broadcast))
            resized.setdefault(body.name, {})[broadcast] = _element_bytes(body, broadcast)
        if fdef is not None:
            editor.rename_outputs({name for pair in plan.moves for name in pair})
        for broadcast, reader, position in plan.drops:
            dropped.append((body.name, broadcast, editor.node_defs[broadcast].op, reader))
            resized.get(body.name, {}).pop(broadcast, None)
            removed.setdefault(body.name, {})[broadcast] = _element_bytes(body, broadcast)
            editor.drop(broadcast, reader, position)
        editor.remove_dropped()
        new_shapes[body.name] = plan.shapes
        written[body.name] = editor.written
    return Hoisted(new_graph_def, written, moves, dropped, TensorShapes(new_shapes),
                   resized, removed)


def _element_bytes(body: Body, name: str) -> int:
    return dtype_bytes(body.nodes[name].node_def.attr["T"].type)


def _plan(body: Body, fetched: set[str], shapes: TensorShapes) -> _Plan:
    """The moves, then the drops, of one body, on a model of the edits (each
    node's op and small input), so a chain moves in one plan: after a swap the
    scaling's node is the broadcast that its own reader may move before."""
    small = {name: node.data_inputs[0][0] for name, node in body.nodes.items()
             if node.op in BROADCASTS and node.data_inputs}
    if not small:
        return _Plan([], [], {})
    op = _Ops(body)
    body_shapes = shapes.shapes.get(body.name, {})
    new_shapes = None  # copied on the first edit
    # A broadcast whose value is read from outside (a fetch, a function result)
    # keeps it. One that something waits on may move: the waiter then waits on
    # the small op, which still runs first (see _Editor._scalar for the one
    # waiter that would wait on itself); it is not dropped.
    returned = {ref.node for ref, _, _ in body.rets.values() if not ref.is_arg}
    blocked = fetched | returned
    moves = []
    broadcasts = list(small)
    for _ in range(_MAX_ROUNDS):
        moved = []
        for broadcast in broadcasts:
            if broadcast in blocked:
                continue
            scaling = _reader_to_hoist(body, broadcast, op)
            if scaling is None:
                continue
            if new_shapes is None:
                new_shapes = dict(body_shapes)
            moves.append((scaling, broadcast))
            new_shapes[TensorRef(broadcast, 0)] = new_shapes.get(small[broadcast])
            op[scaling], op[broadcast] = op[broadcast], op[scaling]
            small[scaling] = TensorRef(broadcast, 0)
            moved.append(scaling)  # the broadcast now sits at the scaling's node
        if not moved:
            break
        broadcasts = moved
    shapes_now = new_shapes if new_shapes is not None else body_shapes
    drops = []
    for broadcast, source in small.items():
        if op[broadcast] not in BROADCASTS or broadcast in blocked:
            continue
        reader = _broadcasting_reader(body, broadcast, source, op, shapes_now)
        if reader is not None:
            drops.append((broadcast, *reader))
    if drops:  # (a broadcast something waits on stays: the waiter would lose it)
        waited_on = body.waiters()
        drops = [drop for drop in drops if drop[0] not in waited_on]
    return _Plan(moves, drops, new_shapes if new_shapes is not None else dict(body_shapes))


def _reader_to_hoist(body: Body, broadcast: str, op: dict[str, str]) -> str | None:
    """The scaling that alone reads `broadcast`'s output, if it can move before it."""
    readers = body.consumers.get(TensorRef(broadcast, 0), ())
    if len(readers) != 1:
        return None
    scaling, index = readers[0]
    if index not in SCALINGS.get(op[scaling], ()):
        return None
    node = body.nodes[scaling]
    if node.node_def.attr["T"].type != body.nodes[broadcast].node_def.attr["T"].type:
        return None
    for other, (ref, _) in enumerate(node.data_inputs):
        if other != index and not _scalar_constant(body, ref):
            return None
    return scaling


def _broadcasting_reader(body: Body, broadcast: str, source: TensorRef, op: dict[str, str],
                         shapes: dict) -> tuple[str, int] | None:
    """(reader, position) if `broadcast`'s only reader broadcasts `source` the same way."""
    readers = body.consumers.get(TensorRef(broadcast, 0), ())
    if len(readers) != 1:
        return None
    reader, position = readers[0]
    if op[reader] not in BROADCASTING or reader in (broadcast, source.node):
        return None
    node = body.nodes[reader]
    if len(node.data_inputs) != 2:
        return None
    big = shapes.get(TensorRef(broadcast, 0))
    other = shapes.get(node.data_inputs[1 - position][0])
    small_shape = shapes.get(source)
    if big is None or other != big or small_shape is None or min(big, default=0) < 0:
        return None
    if len(small_shape) > len(big) or any(
            s != b and s != 1 for s, b in zip(reversed(small_shape), reversed(big), strict=False)):
        return None
    return reader, position


def _scalar_constant(body: Body, ref: TensorRef) -> bool:
    """Is `ref` a Const of shape []?"""
    node = None if ref.is_arg else body.nodes.get(ref.node)
    if node is None or node.op != "Const":
        return False
    shape = node.node_def.attr["value"].tensor.tensor_shape
    return not shape.dim and not shape.unknown_rank


class _Editor:
    """Edits one body's NodeDefs (of the copy), recording each one written."""

    def __init__(self, body: Body, node_list, fdef):
        self.body = body
        self.node_list = node_list
        self.fdef = fdef
        self.node_defs = {n.name: n for n in node_list}
        self.written: dict[str, object] = {}

    def ref(self, name: str) -> str:
        """How a reader names `name`'s (only) output, given its op now."""
        if self.fdef is None:
            return name
        return f"{name}:{_OUTPUT_ARG[self.node_defs[name].op]}:0"

    def swap(self, scaling: str, broadcast: str, small_shape) -> None:
        """`broadcast` := scaling op (small input, scalar); `scaling` := broadcast of it."""
        b, s = self.node_defs[broadcast], self.node_defs[scaling]
        b_data, b_controls = split_inputs(b.input)
        s_data, s_controls = split_inputs(s.input)
        big = next(i for i, text in enumerate(s_data) if text.split(":")[0] == broadcast)
        scaled = [b_data[0] if i == big else self._scalar(text, broadcast, scaling, b_data[0])
                  for i, text in enumerate(s_data)]
        b_op, b_attrs = b.op, attrs_of(b)
        s_op, s_attrs = s.op, attrs_of(s)
        big_shapes = (copy_message(s.attr["_output_shapes"]) if "_output_shapes" in s.attr
                      else None)
        rewrite_node(b, s_op, s_attrs, scaled + b_controls)
        if small_shape is not None and self.fdef is None and min(small_shape, default=0) >= 0:
            add_output_shape(b, small_shape)
        rewrite_node(s, b_op, b_attrs, [self.ref(broadcast), b_data[1]] + s_controls)
        if big_shapes is not None:
            s.attr["_output_shapes"].CopyFrom(big_shapes)
        self.written[broadcast] = b
        self.written[scaling] = s

    def _scalar(self, text: str, broadcast: str, scaling: str, small_input: str) -> str:
        """The scalar input as the moved scaling reads it. A constant that waits
        on either moving node (TensorFlow's SquaredDifference gradient makes its
        2.0 wait on the incoming gradient) would wait on itself: it waits on
        the small input's producer instead (upstream of both, so no cycle)."""
        const = self.node_defs[text.split(":")[0]]
        controls = [t for t in const.input if t.startswith("^")]
        if not {c[1:] for c in controls} & {broadcast, scaling}:
            return text
        producer = small_input.split(":")[0]
        waits = [t for t in controls if t[1:] not in (broadcast, scaling)]
        if not (self.fdef is not None and producer in _arg_names(self.fdef)):
            waits.append("^" + producer)
        del const.input[:]
        const.input.extend(dict.fromkeys(waits))
        self.written[const.name] = const
        return text

    def drop(self, broadcast: str, reader: str, position: int) -> None:
        """`reader` reads `broadcast`'s input instead; `broadcast` goes."""
        source = split_inputs(self.node_defs[broadcast].input)[0][0]
        node_def = self.node_defs[reader]
        texts = list(node_def.input)
        data = [i for i, text in enumerate(texts) if not text.startswith("^")]
        texts[data[position]] = source
        del node_def.input[:]
        node_def.input.extend(texts)
        self.written[reader] = node_def
        self.written[broadcast] = None

    def remove_dropped(self) -> None:
        gone = {name for name, node_def in self.written.items() if node_def is None}
        if not gone:
            return
        for index in reversed([i for i, n in enumerate(self.node_list) if n.name in gone]):
            del self.node_list[index]

    def rename_outputs(self, moved: set[str]) -> None:
        """In a function, readers of a moved node name the output argument of its new op."""
        renames = {}
        for name in moved:
            now = self.ref(name)
            for arg in set(_OUTPUT_ARG.values()):
                if f"{name}:{arg}:0" != now:
                    renames[f"{name}:{arg}:0"] = now
        for node_def in self.node_list:
            if any(text in renames for text in node_def.input):
                texts = [renames.get(text, text) for text in node_def.input]
                del node_def.input[:]
                node_def.input.extend(texts)
                self.written[node_def.name] = node_def
        for key, text in list(self.fdef.ret.items()):
            if text in renames:
                self.fdef.ret[key] = renames[text]


def _arg_names(fdef) -> set[str]:
    return {arg.name for arg in fdef.signature.input_arg}
