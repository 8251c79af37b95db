"""Tensor shapes and sizes in every body of a GraphView, and byte arithmetic.

``tensor_shapes(graph_def, view) -> TensorShapes``: the static shape of each
output and function argument, read from ``_output_shapes`` attributes (what
``graph.as_graph_def(add_shapes=True)`` writes on every node of the graph and
of its library functions, and FunctionDef ``arg_attr`` for arguments). A node
without the attribute gets a shape where that is simple and safe: Const and
Placeholder from their attributes, shape-preserving element-wise ops (Cast,
Identity, Relu, ...) from their first input, broadcasting binary ops from their
inputs when those agree. Anything else is unknown (None). One pass in
topological order per body: linear in the size of the graph.

Unknown dimensions. A traced Keras step usually has an unknown batch
dimension. Such a size is kept as a monomial ``coeff x B**degree`` (``degree``
= number of unknown dimensions, ``B`` the unknown size) rather than discarded,
and byte totals are polynomials in ``B`` (``Bytes``). Two totals compare as
``B`` grows large (highest degree first), which is what matters for choices
like "cast the [B, 32, 32, 64] tensor or the [64] one". A byte *figure*
(``Bytes.known()``) exists only when no unknown dimension is involved; the
report then says the traffic is unknown rather than guessing a batch size.
"""

from __future__ import annotations

import dataclasses
import math

from tfamp.rewrite import shape_inference
from tfamp.rewrite.graph import (
    DT_BFLOAT16,
    DT_FLOAT,
    DT_HALF,
    IDENTITIES,
    Body,
    GraphView,
    TensorRef,
    source_in,
)

# Ops whose output 0 has the shape of input 0 (element-wise, or same layout).
SAME_SHAPE_OPS = frozenset({
    "Abs", "BiasAdd", "BiasAddV1", "Cast", "CheckNumerics", "Cos", "Elu", "EluGrad",
    "Erf", "Exp", "Expm1", "Floor", "Identity", "Inv", "LeakyRelu", "LeakyReluGrad",
    "Log", "Log1p", "LogSoftmax", "Neg", "OnesLike", "PreventGradient", "Reciprocal",
    "Relu", "Relu6", "Relu6Grad", "ReluGrad", "Round", "Rsqrt", "RsqrtGrad", "Selu",
    "SeluGrad", "Sigmoid", "SigmoidGrad", "Sign", "Sin", "Snapshot", "Softmax",
    "Softplus", "SoftplusGrad", "Softsign", "Sqrt", "SqrtGrad", "Square",
    "StopGradient", "Tanh", "TanhGrad", "ZerosLike",
})
# Broadcasting binary ops: output shape is the inputs' common shape.
BROADCAST_OPS = frozenset({
    "Add", "AddV2", "BiasAdd", "DivNoNan", "Maximum", "Minimum", "Mul", "MulNoNan",
    "Pow", "RealDiv", "SquaredDifference", "Sub",
})
# Shape values: a tuple of dims (-1 = unknown), or None for unknown rank.
Shape = tuple[int, ...]

_BYTES = {DT_FLOAT: 4, DT_HALF: 2, DT_BFLOAT16: 2}
# dtype -> bytes per element, for loops that look it up per edge (read only;
# dtype_bytes(d) == BYTES_PER_ELEMENT.get(d, 0))
BYTES_PER_ELEMENT = _BYTES


def dtype_bytes(dtype: int) -> int:
    """Bytes per element of a float DataType (0 for anything else)."""
    return _BYTES.get(dtype, 0)


@dataclasses.dataclass(frozen=True)
class Bytes:
    """A byte count that may grow with unknown dimensions: sum of c_k * B**k.

    ``terms`` holds (degree, coefficient) pairs, highest degree first, no zero
    coefficients. Comparison is for large ``B`` (highest degree decides).
    """

    terms: tuple[tuple[int, int], ...] = ()

    @staticmethod
    def of(elements: tuple[int, int] | None, per_element: int) -> Bytes | None:
        """Bytes of a tensor of `elements` (degree, known product) elements."""
        if elements is None:
            return None
        degree, count = elements
        return Bytes(((degree, count * per_element),)) if count * per_element else Bytes()

    @staticmethod
    def of_sums(sums: dict[int, int]) -> Bytes:
        """The Bytes of {degree: coefficient} sums (what adding them up one by one gives)."""
        if len(sums) == 1:  # (the usual case: every size known)
            for degree, coeff in sums.items():
                return Bytes(((degree, coeff),)) if coeff else Bytes()
        return Bytes(tuple(sorted(((d, c) for d, c in sums.items() if c), reverse=True)))

    def __add__(self, other: Bytes) -> Bytes:
        merged: dict[int, int] = dict(self.terms)
        for degree, coeff in other.terms:
            merged[degree] = merged.get(degree, 0) + coeff
        return Bytes(tuple(sorted(((d, c) for d, c in merged.items() if c),
                                  reverse=True)))

    def __lt__(self, other: Bytes) -> bool:
        return _compare(self.terms, other.terms) < 0

    def __le__(self, other: Bytes) -> bool:
        return _compare(self.terms, other.terms) <= 0

    def at(self, size: int) -> int:
        """The number of bytes if every unknown dimension is `size`."""
        return sum(c * size ** d for d, c in self.terms)

    def known(self) -> int | None:
        """The number of bytes, or None if it depends on an unknown dimension."""
        if any(degree for degree, _ in self.terms):
            return None
        return sum(c for _, c in self.terms)


def _compare(a, b) -> int:
    degrees = sorted({d for d, _ in a} | {d for d, _ in b}, reverse=True)
    da, db = dict(a), dict(b)
    for degree in degrees:
        diff = da.get(degree, 0) - db.get(degree, 0)
        if diff:
            return 1 if diff > 0 else -1
    return 0


def elements_of(shape: Shape | None) -> tuple[int, int] | None:
    """(number of unknown dims, product of the known ones), or None (unknown rank)."""
    if shape is None:
        return None
    if not shape or min(shape) >= 0:  # the usual case, without two generator passes
        return 0, math.prod(shape)
    unknown = sum(1 for d in shape if d < 0)
    return unknown, math.prod(d for d in shape if d >= 0)


def format_elements(elements: tuple[int, int] | None) -> str:
    """'524,288' or '64 x B' (B: an unknown dimension) or '?'."""
    if elements is None:
        return "?"
    degree, count = elements
    if not degree:
        return f"{count:,}"
    return f"{count:,} x B" + (f"^{degree}" if degree > 1 else "")


@dataclasses.dataclass
class TensorShapes:
    """Static shapes of tensors, per body: shapes[body name][TensorRef]."""

    shapes: dict[str, dict[TensorRef, Shape | None]]
    # (body name, with its structure's counts?) -> counts (see ``counts``)
    _counts: dict[tuple[str, bool], dict] = dataclasses.field(default_factory=dict,
                                                              repr=False)

    def counts(self, body: str, nodes: Body | None = None
               ) -> dict[TensorRef, tuple[int, int] | None]:
        """Element counts (see ``elements_of``) of the tensors of body `body`,
        computed once; with its `nodes` (the Body, or a copy of it) also the
        counts its structure gives where a shape does not
        (``broadcast_sum_counts``)."""
        key = (body, nodes is not None)
        if key not in self._counts:
            counts = self._counts.get((body, False))
            if counts is None:
                counts = {ref: elements_of(shape)
                          for ref, shape in self.shapes.get(body, {}).items()}
            self._counts[key] = counts if nodes is None else broadcast_sum_counts(nodes, counts)
        return self._counts[key]

    def shape(self, body: str, ref: TensorRef) -> Shape | None:
        return self.shapes.get(body, {}).get(ref)

    def elements(self, body: str, ref: TensorRef) -> tuple[int, int] | None:
        return elements_of(self.shape(body, ref))

    def any_known(self) -> bool:
        return any(s is not None for body in self.shapes.values() for s in body.values())


def broadcast_sum_operand(body: Body, node) -> TensorRef | None:
    """The operand whose gradient `node` is, where `node` is TensorFlow's gradient
    Sum of a broadcasting op (AddV2, Mul, BatchMatMulV2, ...):
    ``Sum(dy, BroadcastGradientArgs(Shape(a), Shape(b))[i])``, reshaped to operand
    a (i = 0) or b (i = 1) after it; else None."""
    if node.op != "Sum" or len(node.data_inputs) < 2:
        return None
    nodes = body.nodes
    axes = source_in(nodes, node.data_inputs[1][0], IDENTITIES, 4)
    producer = None if axes.is_arg else nodes.get(axes.node)
    if (producer is None or producer.op != "BroadcastGradientArgs"
            or axes.index >= len(producer.data_inputs)):
        return None
    ref = source_in(nodes, producer.data_inputs[axes.index][0], IDENTITIES, 4)
    shape = None if ref.is_arg else nodes.get(ref.node)
    if shape is None or shape.op != "Shape" or not shape.data_inputs:
        return None
    return shape.data_inputs[0][0]


def broadcast_sum_counts(body: Body, counts: dict) -> dict:
    """`counts` with the result of every broadcast gradient's Sum whose own shape is
    not fully known set to its operand's count.

    With an unknown batch (a ``tf.data`` pipeline without ``drop_remainder``, as in
    most scripts) the Sum's axes are known only at run time, and so is its result's
    shape; but it holds the operand's elements (it sums dy over the axes the operand
    was broadcast along, and is reshaped to it). Unknown, the Sum was a float16 deny
    op with every op behind it float32 up to the next matmul: over no axis (a
    residual add's gradient: a copy, ``value_ranges.copies``) it held every residual
    block's activation gradient float32, and over the channels (a LayerNorm's
    backward: a small statistic, coloring's ``_statistic_input``) the Transformer's
    residual stream. keras.io's speaker CNN, CTC ASR, miniature GPT and MobileViT
    reported "100% of float32's traffic" in float16 (BUILD_NOTES.md, session 38).
    The count is exact unless an operand's unknown dimension is 1 at run time
    where dy's is not. The traffic estimate reads the same counts (session 40)."""
    added = {}
    for name, node in body.nodes.items():
        known = counts.get(TensorRef(name, 0)) if node.op == "Sum" else None
        if node.op != "Sum" or (known is not None and not known[0]):
            continue
        operand = broadcast_sum_operand(body, node)
        count = counts.get(operand) if operand is not None else None
        if count is not None:
            added[TensorRef(name, 0)] = count
    return {**counts, **added} if added else counts


def tensor_shapes(graph_def, view: GraphView,
                  fallback: TensorShapes | None = None) -> TensorShapes:
    """Static shapes of every output and argument in every body of `view`.

    Args:
      graph_def: the GraphDef `view` was built from (for FunctionDef arg_attr).
      view: its GraphView.
      fallback: shapes of another version of the same graph (e.g. before a
        rewrite), used by (body, node name, output index) where a node has no
        ``_output_shapes`` attribute of its own, and by (body, argument name)
        where an argument has none.

    Without `fallback`, a graph stored without ``_output_shapes`` (a node of
    the top graph, or every node of a function, carries none) gets the shapes
    TensorFlow's shape functions give (``shape_inference``) where its nodes
    have none, if TensorFlow can import it. A traced graph is not imported:
    its top graph carries shapes everywhere, and the few function nodes added
    after the trace recorded them (an RNN's forward function) are filled in
    by propagation as before.

    Returns:
      TensorShapes; a shape is None where it is not known.
    """
    arg_shapes: dict[str, dict[str, Shape | None]] = {}
    for fdef in graph_def.library.function:
        names = [arg.name for arg in fdef.signature.input_arg]
        per_arg = {}
        for index, name in enumerate(names):
            attrs = fdef.arg_attr[index].attr if index in fdef.arg_attr else {}
            per_arg[name] = (_first_shape(attrs["_output_shapes"])
                             if "_output_shapes" in attrs else None)
        arg_shapes[fdef.signature.name] = per_arg
    result = {}
    parsed: dict[bytes, tuple[Shape | None, ...]] = {}
    # bodies with nodes that carry no shapes: (name, whether none of them does)
    lacking: list[tuple[str, bool]] = []
    for body in view.bodies:
        old = fallback.shapes.get(body.name) if fallback is not None else None
        args = arg_shapes.get(body.name, {})
        if old is not None and None in args.values():  # (arguments by name, as nodes)
            args = {name: shape if shape is not None else old.get(TensorRef(name, 0, True))
                    for name, shape in args.items()}
        result[body.name] = _body_shapes(body, args, old, parsed, lacking)
    if fallback is None and any(name == "" or none for name, none in lacking):
        inferred = shape_inference.inferred_shapes(graph_def, view, result)
        if inferred is not None:
            lacking_names = {name for name, _ in lacking}
            for body in view.bodies:
                old = inferred.get(body.name)
                args = arg_shapes.get(body.name, {})
                if old is None or (body.name not in lacking_names
                                   and all(s is not None for s in args.values())):
                    continue
                args = {name: shape if shape is not None else
                        old.get(TensorRef(name, 0, is_arg=True))
                        for name, shape in args.items()}
                result[body.name] = _body_shapes(body, args, old, parsed)
    _args_from_callers(view, result)
    return TensorShapes(result)


def _args_from_callers(view: GraphView, result) -> None:
    """An argument without a recorded shape takes the shape its caller passes.

    (Functions loaded from a SavedModel often lack ``_output_shapes`` in
    ``arg_attr``.) The first caller with a known shape wins.
    """
    if len(view.bodies) < 2:  # no functions
        return
    bodies = {body.name: body for body in view.bodies}
    for body in view.bodies:
        shapes = result[body.name]
        for node in body.nodes.values():
            if not node.called_functions:
                continue
            skip = 1 if node.op in shape_inference.FIRST_INPUT_IS_NOT_AN_ARG else 0
            for callee in node.called_functions:
                target = bodies.get(callee)
                if target is None:
                    continue
                callee_shapes = result[callee]
                for arg, (ref, _) in zip(target.arg_dtypes, node.data_inputs[skip:],
                                         strict=False):
                    arg_ref = TensorRef(arg, 0, is_arg=True)
                    if callee_shapes.get(arg_ref) is None and shapes.get(ref) is not None:
                        callee_shapes[arg_ref] = shapes[ref]


def _first_shape(attr_value) -> Shape | None:
    shapes = attr_value.list.shape
    return _shape_proto(shapes[0]) if shapes else None


def _shape_proto(proto) -> Shape | None:
    if proto.unknown_rank:
        return None
    return tuple(int(d.size) for d in proto.dim)


def _body_shapes(body: Body, args: dict[str, Shape | None],
                 old: dict[TensorRef, Shape | None] | None,
                 parsed: dict[bytes, tuple[Shape | None, ...]] | None = None,
                 lacking: list[tuple[str, bool]] | None = None,
                 ) -> dict[TensorRef, Shape | None]:
    """`parsed`: _output_shapes attributes read so far, by their serialized
    bytes (a step has thousands of tensors but few distinct shape lists, and
    reading a shape proto dim by dim is slow). `lacking`: (the body's name,
    whether no node carries shapes) is appended if some node with outputs
    carries none."""
    if parsed is None:
        parsed = {}
    shapes: dict[TensorRef, Shape | None] = {
        TensorRef(name, 0, is_arg=True): shape for name, shape in args.items()}
    missing = []
    new = tuple.__new__  # (TensorRef(name, index) without its Python-level __new__)
    for name, node in body.nodes.items():
        recorded = node.node_def.attr.get("_output_shapes")
        if recorded is None:
            if node.outputs:  # nodes without outputs (NoOp) carry no shapes
                missing.append(name)
            continue
        key = recorded.SerializeToString()
        listed = parsed.get(key)
        if listed is None:
            listed = parsed[key] = tuple(_shape_proto(p) for p in recorded.list.shape)
        outputs = len(node.outputs)
        if outputs == 1:  # (most nodes)
            shapes[new(TensorRef, (name, 0, False))] = listed[0] if listed else None
            continue
        for index in range(outputs):
            shapes[new(TensorRef, (name, index, False))] = (
                listed[index] if index < len(listed) else None)
    if not missing:
        return shapes
    if lacking is not None:
        lacking.append((body.name, len(missing) == sum(1 for n in body.nodes.values()
                                                        if n.outputs)))
    # Some nodes carry no shapes: fill them in producer-first order.
    missing_set = set(missing)
    order = body.topological_order() if len(missing) > 1 else missing
    for name in order:
        if name not in missing_set:
            continue
        node = body.nodes[name]
        if old is not None and TensorRef(name, 0) in old:
            for index in range(len(node.outputs)):
                shapes[TensorRef(name, index)] = old.get(TensorRef(name, index))
            continue
        shapes[TensorRef(name, 0)] = _infer(node, shapes)
    return shapes


def _infer(node, shapes) -> Shape | None:
    op = node.op
    attr = node.node_def.attr
    if op == "Const" and "value" in attr:
        return _shape_proto(attr["value"].tensor.tensor_shape)
    if op == "Placeholder" and "shape" in attr:
        return _shape_proto(attr["shape"].shape)
    inputs = [shapes.get(ref) for ref, _ in node.data_inputs]
    if op in SAME_SHAPE_OPS and inputs and op not in BROADCAST_OPS:
        return inputs[0]
    if op in BROADCAST_OPS and len(inputs) >= 2:
        a, b = inputs[0], inputs[1]
        if a is None or b is None:
            return None
        return _broadcast(a, b)
    return None


def _broadcast(a: Shape, b: Shape) -> Shape | None:
    rank = max(len(a), len(b))
    a = (1,) * (rank - len(a)) + a
    b = (1,) * (rank - len(b)) + b
    dims = []
    for x, y in zip(a, b, strict=True):
        if x == y or y == 1:
            dims.append(x)
        elif x == 1:
            dims.append(y)
        else:  # an unknown dim against a known one other than 1: not simple
            return None
    return tuple(dims)


def without_recorded_shapes(graph_def):
    """A copy of `graph_def` with every recorded shape removed.

    Drops ``_output_shapes`` from the nodes of the top graph and of every
    library function, and ``_output_shapes`` / ``_input_shapes`` from function
    arguments: the graph as a file written without ``add_shapes`` stores it.
    For benchmarks and tests of the shape inference; `graph_def` is unchanged.
    """
    copy = type(graph_def)()
    copy.CopyFrom(graph_def)
    for node in copy.node:
        node.attr.pop("_output_shapes", None)
    for fdef in copy.library.function:
        for node in fdef.node_def:
            node.attr.pop("_output_shapes", None)
        for arg_attr in fdef.arg_attr.values():
            arg_attr.attr.pop("_output_shapes", None)
        fdef.attr.pop("_input_shapes", None)
    return copy
