"""A graph with an open batch dimension, sized at a given batch: ``at_batch(graph_def, n)``.

A SavedModel signature is saved with its batch open (-1) in every shape that
depends on it, so its traffic is a share "for large B" and its FLOPs are per B.
``tfamp inspect SAVED_MODEL --batch-size N`` wants bytes at N. The loaded
signature's function keeps the shapes it was saved with (calling it at a fixed
batch does not re-shape its body), so the GraphDef is edited instead: the
arguments' leading -1 becomes N (top-graph Placeholders and library functions'
argument attributes), and every other recorded shape with an open dimension
is dropped (wherever the -1 stands: a time-major RNN's transpose of its input
holds the batch second; where the -1 was a sequence length, inference gives it
back from the arguments). tfamp's shape inference (``rewrite.shape_inference``)
then runs TensorFlow's shape functions from the arguments down, callers before callees;
shapes that never depended on the batch (variables, constants) stay as
recorded.

Two shapes are declared rather than inferred, and are sized the same way: a
``While``'s ``output_shapes`` (its shape function returns them as they are, so
a recurrent layer's state after its loop kept an open batch), and the
``element_shape`` a TensorList op is given (a Const; inside a loop body the
list arrives as an argument without its element shape, so the time step a
Keras RNN reads from its input list kept an open batch). Such a Const is
sized only where every reader takes it as an element shape.

Only an argument's leading -1 counts as the batch: an open dimension elsewhere
(a sequence length) stays open, and the report then still speaks of large sizes for it.
"""

from __future__ import annotations

from tensorflow.core.framework import graph_pb2, types_pb2
from tensorflow.python.framework import tensor_util

_WHILE_OPS = frozenset({"While", "StatelessWhile"})
_INDEX_TYPES = (types_pb2.DT_INT32, types_pb2.DT_INT64)
# TensorList op -> the input that is its element shape.
_ELEMENT_SHAPE_INPUT = {
    "EmptyTensorList": 0, "TensorListReserve": 0, "TensorListFromTensor": 1,
    "TensorListGetItem": 2, "TensorListStack": 1, "TensorListGather": 2,
    "TensorListConcatV2": 1, "TensorListPopBack": 1,
}


def _size_shapes(shapes, batch: int) -> None:
    for shape in shapes:
        if shape.dim and shape.dim[0].size == -1:
            shape.dim[0].size = batch


def _edit_nodes(nodes, batch: int) -> None:
    for node in nodes:
        recorded = node.attr["_output_shapes"].list.shape if "_output_shapes" in node.attr \
            else ()
        if node.op == "Placeholder":
            _size_shapes(recorded, batch)
            if "shape" in node.attr:
                _size_shapes([node.attr["shape"].shape], batch)
        elif any(dim.size == -1 for shape in recorded for dim in shape.dim):
            del node.attr["_output_shapes"]
        if node.op in _WHILE_OPS and "output_shapes" in node.attr:
            _size_shapes(node.attr["output_shapes"].list.shape, batch)
    for node in _element_shape_consts(nodes):
        value = tensor_util.MakeNdarray(node.attr["value"].tensor)
        if value.ndim == 1 and value.size and value[0] == -1:
            value = value.copy()
            value[0] = batch
            node.attr["value"].tensor.CopyFrom(tensor_util.make_tensor_proto(value))


def _element_shape_consts(nodes) -> list:
    """The Const nodes of one body whose every reader takes them as a TensorList
    element shape."""
    consts = {node.name: node for node in nodes if node.op == "Const"}
    readers: dict[str, list[bool]] = {}
    for node in nodes:
        for index, text in enumerate(i for i in node.input if not i.startswith("^")):
            source = text.split(":")[0]
            if source in consts:
                readers.setdefault(source, []).append(
                    _ELEMENT_SHAPE_INPUT.get(node.op) == index)
    return [consts[name] for name, roles in readers.items() if all(roles)
            and consts[name].attr["dtype"].type in _INDEX_TYPES]


def at_batch(graph_def: graph_pb2.GraphDef, batch: int) -> graph_pb2.GraphDef:
    """A copy of `graph_def` whose open leading dimensions are `batch` (see above)."""
    sized = graph_pb2.GraphDef()
    sized.CopyFrom(graph_def)
    _edit_nodes(sized.node, batch)
    for fdef in sized.library.function:
        _edit_nodes(fdef.node_def, batch)
        for attrs in fdef.arg_attr.values():
            if "_output_shapes" in attrs.attr:
                _size_shapes(attrs.attr["_output_shapes"].list.shape, batch)
    return sized
