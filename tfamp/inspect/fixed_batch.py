"""A graph with an open batch dimension, sized at a given batch: ``at_batch(graph_def, n)``.

A SavedModel signature is saved with its batch open (-1) in every shape that
depends on it, so its traffic is a share "for large B" and its FLOPs are per B.
``tfamp inspect SAVED_MODEL --batch-size N`` wants bytes at N. The loaded
signature's function keeps the shapes it was saved with (calling it at a fixed
batch does not re-shape its body), so the GraphDef is edited instead: the
arguments' leading -1 becomes N (top-graph Placeholders and library functions'
argument attributes), and every other recorded shape with a leading -1 is
dropped. tfamp's shape inference (``rewrite.shape_inference``) then runs
TensorFlow's shape functions from the arguments down, callers before callees;
shapes that never depended on the batch (variables, constants) stay as
recorded.

Only a leading -1 counts as the batch: an open dimension elsewhere (a sequence
length) stays open, and the report then still speaks of large sizes for it.
"""

from __future__ import annotations

from tensorflow.core.framework import graph_pb2


def has_open_batch(shapes) -> bool:
    return any(shape.dim and shape.dim[0].size == -1 for shape in shapes)


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
        elif has_open_batch(recorded):
            del node.attr["_output_shapes"]


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
