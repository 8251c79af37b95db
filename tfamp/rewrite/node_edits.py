"""Editing one NodeDef in place: the few steps the edits before colouring share
(``hoist``, ``contract``, ``fuse_norm``)."""

from __future__ import annotations

import dataclasses

from tensorflow.core.framework import attr_value_pb2, graph_pb2

from tfamp.rewrite.shapes import TensorShapes

# TF1 control flow: a node's frame follows its inputs, and a new constant has
# none. The edits leave a body with these ops alone.
TF1_FRAME_OPS = frozenset({"Enter", "Exit", "NextIteration"})


def split_inputs(inputs) -> tuple[list[str], list[str]]:
    """(data inputs, control inputs "^name") of a NodeDef's input list."""
    return ([t for t in inputs if not t.startswith("^")],
            [t for t in inputs if t.startswith("^")])


def copy_message(message):
    copy = type(message)()
    copy.CopyFrom(message)
    return copy


def attrs_of(node_def) -> dict:
    """Copies of `node_def`'s attributes, its recorded output shapes apart."""
    return {key: copy_message(value) for key, value in node_def.attr.items()
            if key != "_output_shapes"}


def type_attr(dtype: int) -> attr_value_pb2.AttrValue:
    return attr_value_pb2.AttrValue(type=dtype)


def bool_attr(value: bool) -> attr_value_pb2.AttrValue:
    return attr_value_pb2.AttrValue(b=value)


def rewrite_node(node_def, op: str, attrs: dict, inputs: list[str]) -> None:
    """`node_def` becomes `op` with `attrs` ({name: AttrValue}) and `inputs`;
    its name and device stay. Its recorded output shapes go with the old attrs."""
    node_def.op = op
    node_def.ClearField("attr")
    for key, value in attrs.items():
        node_def.attr[key].CopyFrom(value)
    del node_def.input[:]
    node_def.input.extend(inputs)


def add_output_shape(node_def, dims) -> None:
    """Records one more output shape (static `dims`; None: unknown rank) in
    ``_output_shapes``."""
    shape = node_def.attr["_output_shapes"].list.shape.add()
    if dims is None:
        shape.unknown_rank = True
        return
    for size in dims:
        shape.dim.add().size = -1 if size is None or size < 0 else size


@dataclasses.dataclass
class EditedGraph:
    """What an edit before colouring that changes kernels wrote (``contract``,
    ``fuse_norm``).

    Attributes:
      graph_def: the new GraphDef (a copy; the input is not modified).
      written: body name -> {node name: NodeDef written or added, or None for a
        node removed} (build_view's ``written``).
      made: (body, node, into) for each place edited, in order; the editing
        module says what `node` and `into` are.
      shapes: the new graph's shapes.
      edit, op: the "edit" and "op" of the report's ``broadcast_edits`` rows.
      float32: (body, node) -> (reason, kind) for nodes the edit added that the
        colouring must keep float32 (``tfamp.rewrite.reasons`` kinds).
    """

    graph_def: graph_pb2.GraphDef
    written: dict[str, dict[str, object]]
    made: list[tuple[str, str, str]]
    shapes: TensorShapes
    edit: str
    op: str
    float32: dict[tuple[str, str], tuple[str, str]] = dataclasses.field(default_factory=dict)

    def edits(self) -> list[dict[str, str]]:
        """Rows of the report's ``broadcast_edits``."""
        return [{"edit": self.edit, "function": function, "node": node, "op": self.op,
                 "into": into}
                for function, node, into in self.made]
