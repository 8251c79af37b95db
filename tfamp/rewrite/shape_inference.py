"""Shapes from TensorFlow's own shape functions, for graphs stored without them.

``inferred_shapes(graph_def, view, recorded)`` imports the top graph into a
scratch ``tf.Graph`` (the importer runs every op's C++ shape function, as
grappler's shape inference does) and reads each output's static shape; each
library function is then imported on its own, its arguments taking the shapes
its callers pass (callers first, so a loop body called from a function gets
that function's inferred shapes). Only nodes without ``_output_shapes`` take
these shapes; the caller decides whether inference is needed at all, because
it costs an import of the whole graph (see BUILD_NOTES, session 7).

Variables. A traced training step reads its weights through captured
resource placeholders that carry no shape, so TensorFlow knows a read's
rank and size only where it has recorded it. Where an update of the same
resource (``AssignVariableOp``, ``AssignAddVariableOp``, ``ResourceApply*``)
receives a value of known shape, the reads of that resource take it: the
gradient fixes the weight's shape. Reads are hinted through ``_output_shapes``
on a copy of the graph (the importer merges such attributes into what it
infers), and the import is repeated while that teaches it something new, a
few rounds at most.

A graph TensorFlow cannot import (an op it does not know, a malformed edge)
gives ``None``: the pass then works as before, with the shapes it can read.
"""

from __future__ import annotations

import logging

from tensorflow.core.framework import graph_pb2, tensor_shape_pb2
from tensorflow.python.framework import errors, function_def_to_graph, importer, ops
from tensorflow.python.framework import tensor_shape as tf_tensor_shape

from tfamp.rewrite.graph import Body, GraphView, TensorRef

log = logging.getLogger("tfamp")

Shape = tuple[int, ...]
BodyShapes = dict[TensorRef, "Shape | None"]

# Ops that write a value of the variable's full shape into the resource at
# input 0: op -> the input that carries that value.
_WRITE_VALUE_INPUT = {
    "AssignVariableOp": 1, "AssignAddVariableOp": 1, "AssignSubVariableOp": 1,
    "ResourceApplyGradientDescent": 2, "ResourceApplyMomentum": 3,
    "ResourceApplyKerasMomentum": 3, "ResourceApplyAdam": 9,
    "ResourceApplyAdamWithAmsgrad": 10, "ResourceApplyAdagrad": 2,
    "ResourceApplyAdagradV2": 3, "ResourceApplyRMSProp": 7,
    "ResourceApplyCenteredRMSProp": 8, "ResourceApplyAdadelta": 6,
    "ResourceApplyAdaMax": 8, "ResourceApplyFtrl": 3, "ResourceApplyFtrlV2": 3,
}
# Element-wise arithmetic an optimizer's update is made of (see _value_shape).
_ELEMENTWISE_OPS = frozenset({
    "Add", "AddV2", "Sub", "Mul", "RealDiv", "Div", "DivNoNan", "Maximum", "Minimum",
    "Sqrt", "Rsqrt", "Square", "Neg", "Identity", "Cast", "Sign", "Abs",
})
# Imports of the top graph: the first one, then "hint the reads, import
# again" while the hints teach TensorFlow something (each import can only add
# shapes; the forward pass with the weights' ranks can refine the gradients).
# An import of a ResNet-50 step costs about 0.6 s.
_MAX_ROUNDS = 2
# Passes over the writes between two imports (reads hinted in one pass make
# the values written in the next known).
_MAX_PASSES = 4
_IMPORT_ERRORS = (ValueError, TypeError, KeyError, errors.OpError)


def inferred_shapes(graph_def: graph_pb2.GraphDef, view: GraphView,
                    recorded: dict[str, BodyShapes]) -> dict[str, BodyShapes] | None:
    """Static shapes TensorFlow infers for every body of `view`.

    Args:
      graph_def: the GraphDef `view` was built from (not modified).
      view: its GraphView.
      recorded: shapes already known per body (from ``_output_shapes``); the
        resource hints start from them.

    Returns:
      {body name: {TensorRef: shape or None}} for the bodies TensorFlow could
      import, or None if it cannot import the top graph.
    """
    top = view.bodies[0]
    # TensorFlow edits what it imports: import_graph_def sets the default
    # attributes of the top graph's NodeDefs in place, and function_def_to_graph
    # adds an (empty) arg_attr entry for every argument that has none. Both
    # read this one copy, never the caller's graph (the pass is pure).
    work = graph_pb2.GraphDef()
    work.CopyFrom(graph_def)
    hints: dict[str, Shape] = {}  # read node -> shape
    shapes: BodyShapes | None = None
    for round_ in range(_MAX_ROUNDS):
        try:
            if hints:
                _hint(work, hints)
            graph = _import(work)
        except _IMPORT_ERRORS as err:
            log.debug("tfamp: TensorFlow cannot import the graph%s for shape inference: %s",
                      " with the variables' shapes" if hints else "",
                      str(err).splitlines()[0] if str(err) else type(err).__name__)
            if shapes is None:
                return None
            break  # (keep the last round's shapes)
        shapes = _read_shapes(top, graph, {})
        merged = {**shapes, **{r: s for r, s in recorded.get("", {}).items()
                               if s is not None}}
        # What the writes say, to a fixed point before importing again: a
        # moment's shape (from the gradient) gives the weight's update its own.
        new: dict[str, Shape] = {}
        for _ in range(_MAX_PASSES):
            found = _variable_shapes(top, merged)
            if not found:
                break
            new.update(found)
            merged.update((TensorRef(name, 0), shape) for name, shape in found.items())
        if not new:
            break
        log.debug("tfamp: shape inference: %d variable reads hinted, e.g. %s", len(new),
                  [(k, hints.get(k), v) for k, v in list(new.items())[:3]])
        hints.update(new)
        if round_ == _MAX_ROUNDS - 1:  # (no import left to take them further)
            shapes.update((TensorRef(name, 0), shape) for name, shape in new.items())
    assert shapes is not None
    result = {"": shapes}
    result.update(_function_shapes(work, view, graph, result, recorded))
    return result


def _import(graph_def) -> ops.Graph:
    graph = ops.Graph()
    with graph.as_default():
        importer.import_graph_def(graph_def, name="")
    return graph


def _hint(graph_def, hints: dict[str, Shape]) -> None:
    """Records the hinted shapes on the read nodes of `graph_def` (shape
    inference's own copy)."""
    for node in graph_def.node:
        shape = hints.get(node.name)
        if shape is not None:
            listed = node.attr["_output_shapes"].list.shape
            del listed[:]
            listed.append(_shape_proto(shape))


def _shape_proto(shape: Shape) -> tensor_shape_pb2.TensorShapeProto:
    proto = tensor_shape_pb2.TensorShapeProto()
    for size in shape:
        proto.dim.add().size = size
    return proto


def _as_shape(static: tf_tensor_shape.TensorShape) -> Shape | None:
    if static.rank is None:
        return None
    return tuple(-1 if d is None else int(d) for d in static.as_list())


def _read_shapes(body: Body, graph: ops.Graph, names: dict[str, str]) -> BodyShapes:
    """Shapes of `body`'s node outputs in `graph` (node names mapped by `names`)."""
    by_name = {op.name: op for op in graph.get_operations()}
    shapes: BodyShapes = {}
    for name, node in body.nodes.items():
        op = by_name.get(names.get(name, name))
        if op is None or op.type != node.op:
            continue
        for index in range(min(len(node.outputs), len(op.outputs))):
            shapes[TensorRef(name, index)] = _as_shape(op.outputs[index].shape)
    return shapes


def _variable_shapes(body: Body, shapes: BodyShapes) -> dict[str, Shape]:
    """Read node -> what the updates of its resource say about its shape.

    A variable has one shape, so every value written to it has that shape:
    their dimensions are merged (a dimension one write knows, the others
    take), and the reads are hinted where that knows more than they do.
    """
    written: dict[TensorRef, Shape] = {}
    for node in body.nodes.values():
        value_input = _WRITE_VALUE_INPUT.get(node.op)
        if value_input is None or len(node.data_inputs) <= value_input:
            continue
        resource = _resource(body, node.data_inputs[0][0])
        shape = _value_shape(body, node.data_inputs[value_input][0], shapes, resource)
        if shape is None:
            continue
        merged = _merge(written.get(resource), shape)
        if merged is not None:
            written[resource] = merged
    if not written:
        return {}
    found = {}
    for node in body.nodes.values():
        if node.op == "ReadVariableOp" and node.data_inputs:
            shape = written.get(_resource(body, node.data_inputs[0][0]))
            current = shapes.get(TensorRef(node.name, 0))
            if shape is not None and _knows_more(shape, current):
                found[node.name] = shape if current is None else _merge(current, shape)
    return found


def _value_shape(body: Body, ref: TensorRef, shapes: BodyShapes, resource: TensorRef,
                 depth: int = 6) -> Shape | None:
    """The shape of a value written to the variable `resource`, looking through
    the arithmetic that made it.

    An optimizer's update (Adam's ``(g - m) * (1 - beta1)`` into ``m``) is
    element-wise arithmetic on the gradient, reads of the variable itself and
    scalars. TensorFlow cannot give it a shape while the variable's read is of
    unknown rank; the other operands can: the variable has the shape of the
    largest of them (operands still unknown, such as a learning rate read from
    a variable, are scalars in an optimizer).
    """
    shape = shapes.get(ref)
    if shape is not None or depth == 0 or ref.is_arg:
        return shape
    node = body.nodes.get(ref.node)
    if node is None or node.op not in _ELEMENTWISE_OPS:
        return None
    found = []
    for operand, _ in node.data_inputs:
        producer = body.nodes.get(operand.node) if not operand.is_arg else None
        if (producer is not None and producer.op == "ReadVariableOp" and producer.data_inputs
                and _resource(body, producer.data_inputs[0][0]) == resource):
            continue  # (the variable itself)
        operand_shape = _value_shape(body, operand, shapes, resource, depth - 1)
        if operand_shape is not None:
            found.append(operand_shape)
    rank = max((len(s) for s in found), default=0)
    if not rank and len(found) < len(node.data_inputs):
        # Scalars alone say nothing while another operand is unknown (a
        # learning rate read from a variable nothing writes is of unknown
        # rank too); a tensor operand is the gradient or a moment.
        return None
    merged: Shape | None = None
    for candidate in (s for s in found if len(s) == rank):
        merged = _merge(merged, candidate)
        if merged is None:
            return None
    return merged


def _merge(a: Shape | None, b: Shape) -> Shape | None:
    """The dimensions either knows (None if the ranks or known sizes disagree)."""
    if a is None:
        return b
    if len(a) != len(b) or any(x != y and x >= 0 and y >= 0 for x, y in zip(a, b, strict=True)):
        return None
    return tuple(x if x >= 0 else y for x, y in zip(a, b, strict=True))


def _knows_more(shape: Shape, than: Shape | None) -> bool:
    if than is None:
        return True
    merged = _merge(than, shape)
    return merged is not None and merged != than


def _resource(body: Body, ref: TensorRef) -> TensorRef:
    """The tensor a resource handle comes from, through Identity ops."""
    for _ in range(8):
        node = body.nodes.get(ref.node) if not ref.is_arg else None
        if node is None or node.op != "Identity" or not node.data_inputs:
            return ref
        ref = node.data_inputs[0][0]
    return ref


FIRST_INPUT_IS_NOT_AN_ARG = frozenset({"If", "StatelessIf", "Case", "StatelessCase"})


def _function_shapes(graph_def, view: GraphView, graph: ops.Graph,
                     known: dict[str, BodyShapes],
                     recorded: dict[str, BodyShapes]) -> dict[str, BodyShapes]:
    """Each library function imported alone, its arguments shaped by its callers.

    Functions are visited from the top graph down the call edges (breadth
    first), so a callee's arguments take the shapes inferred for its caller;
    a function reached by no caller, or whose import fails, is left out.
    """
    if len(view.bodies) < 2:
        return {}
    bodies = {body.name: body for body in view.bodies}
    fdefs = {fdef.signature.name: fdef for fdef in graph_def.library.function}
    args: dict[str, list[Shape | None]] = {}
    result: dict[str, BodyShapes] = {}
    pending = [view.bodies[0]]
    while pending:
        caller = pending.pop(0)
        caller_shapes = {**result.get(caller.name, known.get(caller.name, {})),
                         **{r: s for r, s in recorded.get(caller.name, {}).items()
                            if s is not None}}
        for node in caller.nodes.values():
            skip = 1 if node.op in FIRST_INPUT_IS_NOT_AN_ARG else 0
            for callee in node.called_functions:
                target = bodies.get(callee)
                if target is None or callee in args:
                    continue
                passed = [caller_shapes.get(ref) for ref, _ in node.data_inputs[skip:]]
                args[callee] = passed[:len(target.arg_dtypes)]
                shapes = _one_function(target, fdefs.get(callee), args[callee], graph)
                if shapes is not None:
                    result[callee] = shapes
                    pending.append(target)
    return result


def _one_function(body: Body, fdef, arg_shapes: list[Shape | None],
                  graph: ops.Graph) -> BodyShapes | None:
    if fdef is None:
        return None
    names = list(body.arg_dtypes)
    arg_shapes = arg_shapes + [None] * (len(names) - len(arg_shapes))
    input_shapes = [tf_tensor_shape.TensorShape(None) if s is None else
                    tf_tensor_shape.TensorShape([None if d < 0 else d for d in s])
                    for s in arg_shapes]
    try:
        # (inside `graph`, which holds the library, so calls in the body resolve)
        with graph.as_default():
            func_graph = function_def_to_graph.function_def_to_graph(
                fdef, input_shapes=input_shapes, include_library_functions=True)
    except _IMPORT_ERRORS as err:
        log.debug("tfamp: no shape inference for function %r: %s", body.name, err)
        return None
    shapes = _read_shapes(body, func_graph, {})
    for name, shape in zip(names, arg_shapes, strict=True):
        shapes[TensorRef(name, 0, is_arg=True)] = shape
    return shapes
