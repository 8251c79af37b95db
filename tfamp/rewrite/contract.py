"""Which weight gradients are one matrix product: per-example products summed.

A dense layer applied to a 3-D input (Keras 3's ``EinsumDense`` and
``MultiHeadAttention`` projections: ``x [batch, seq, d] @ kernel [d, f]``)
runs as a ``BatchMatMulV2`` that broadcasts the kernel over the batch. Its
gradient for the kernel is TensorFlow's ``BatchMatMulV2(x, g, adj_x=True)``,
one ``[d, f]`` product per example (a ``[batch, d, f]`` tensor, batch times
the kernel's size), then a ``Sum`` over the batch axes. The same value is one
``MatMul`` of ``x`` and ``g`` flattened to ``[batch * seq, d]`` and
``[batch * seq, f]`` (``transpose_a``): sum over examples of sum over positions
is the sum over both. Made before colouring, the edit

* never writes the per-example tensor (BERT-base, batch 32: 38 MB per kernel
  in float16, 76 MB in float32, for each of its 48 attention projections);
* accumulates the whole contraction inside one matrix kernel (in float32 on a
  GPU for 16-bit inputs) and rounds once, where the colouring would otherwise
  round each example's product to 16-bit and cast them all to float32 for a
  float32 ``Sum`` (TensorFlow's GPU Sum for half accumulates in half).

The result is the same sum in another order: equal in exact arithmetic, equal
to float32 rounding in float32 (not bit-identical, unlike ``hoist``'s edits).

Under XLA too, every product is contracted, although XLA:GPU then lays a transformer's
residual stream out as [seq, d, batch] (nothing pins it row-major once no batched matrix
product is left, and a reduction over the batch prefers its summed axes minor) and
transposes it at each matrix product: Keras 3's BERT step (batch 32) launches 1491 kernels,
Keras's own program 1367. Leaving one product per-example pins the stream row-major again
(1343 kernels; session 17's rewrite did so), but that program measured 7% (float16) and 9%
(bfloat16) slower side by side on an H200: row-major, XLA fuses each LayerNorm's
parameter-gradient sum over 4096 rows with two full-size element-wise outputs into one
column-reduction kernel of 82 us, 1.9 ms of the step's 11.3 ms of kernel time; its
reductions and transposes take 4.5 ms, the transposed program's 3.1 ms (BUILD_NOTES.md,
session 19). Fewer kernels is not faster here, so the measured program is the one kept.

Only where the shapes are static and say it: the Sum reduces exactly the
batch axes of a ``BatchMatMulV2`` with ``adj_x`` and not ``adj_y`` (the
contracted axis sits next to the batch axes on both sides, so flattening needs
no transpose), read by nothing else; both operands have those batch axes
(no broadcasting between them); ``keep_dims`` is false. Top graph only (a
Keras step's gradients live there), and not one with TF1 loops.

``contract_weight_gradients(graph_def, view, shapes, outputs) -> EditedGraph | None``:
pure; None when nothing changes. Its ``made`` rows are (body, the Sum node, now a MatMul;
the BatchMatMulV2 node, now the Reshape of its first operand), reported as edit
"contracted", op "Sum".
"""

from __future__ import annotations

import math

import numpy as np
from tensorflow.core.framework import attr_value_pb2, graph_pb2, types_pb2
from tensorflow.python.framework import tensor_util

from tfamp.rewrite.graph import FLOAT_TYPES, Body, GraphView, TensorRef
from tfamp.rewrite.node_edits import (
    TF1_FRAME_OPS,
    EditedGraph,
    add_output_shape,
    bool_attr,
    copy_message,
    rewrite_node,
    split_inputs,
    type_attr,
)
from tfamp.rewrite.shapes import TensorShapes

_SUFFIX = "/tfamp_contract"


def contract_weight_gradients(graph_def: graph_pb2.GraphDef, view: GraphView,
                              shapes: TensorShapes, outputs: list[str]) -> EditedGraph | None:
    """Per-example products summed over the batch become one MatMul (module doc)."""
    top = view.bodies[0]
    if top.ops & TF1_FRAME_OPS:  # (a new Const would sit outside a TF1 loop's frame)
        return None
    fetched = {name.split(":")[0] for name in outputs}
    found = _find(top, shapes.shapes.get(top.name, {}), fetched)
    if not found:
        return None
    new_graph_def = graph_pb2.GraphDef()
    new_graph_def.CopyFrom(graph_def)
    node_defs = {n.name: n for n in new_graph_def.node}
    body_shapes = dict(shapes.shapes.get(top.name, {}))
    written: dict[str, object] = {}
    for total, product, rows, left, right in found:
        product_def, total_def = node_defs[product], node_defs[total]
        dtype = type_attr(product_def.attr["T"].type)
        (lhs, rhs), controls = split_inputs(product_def.input)
        shape_names = []
        for side, width in (("lhs", left), ("rhs", right)):
            const = new_graph_def.node.add()
            const.name = f"{product}{_SUFFIX}/{side}_shape"
            rewrite_node(const, "Const", {
                "dtype": type_attr(types_pb2.DT_INT32),
                "value": attr_value_pb2.AttrValue(tensor=tensor_util.make_tensor_proto(
                    np.array([rows, width], np.int32)))}, [])
            add_output_shape(const, [2])
            body_shapes[TensorRef(const.name, 0)] = (2,)
            written[const.name] = const
            shape_names.append(const.name)
        reshape_attrs = {"T": dtype, "Tshape": type_attr(types_pb2.DT_INT32)}
        # The product's node flattens the left operand; a new node the right.
        rewrite_node(product_def, "Reshape", reshape_attrs, [lhs, shape_names[0], *controls])
        add_output_shape(product_def, [rows, left])
        body_shapes[TensorRef(product, 0)] = (rows, left)
        written[product] = product_def
        flat_right = new_graph_def.node.add()
        flat_right.name = f"{product}{_SUFFIX}/rhs"
        rewrite_node(flat_right, "Reshape", reshape_attrs, [rhs, shape_names[1]])
        add_output_shape(flat_right, [rows, right])
        body_shapes[TensorRef(flat_right.name, 0)] = (rows, right)
        written[flat_right.name] = flat_right
        # The Sum's node is the MatMul: its readers read the same [d, f] value.
        output_shapes = (copy_message(total_def.attr["_output_shapes"])
                         if "_output_shapes" in total_def.attr else None)
        rewrite_node(total_def, "MatMul", {"T": dtype, "transpose_a": bool_attr(True),
                                           "transpose_b": bool_attr(False)},
                     [product, flat_right.name, *split_inputs(total_def.input)[1]])
        if output_shapes is not None:
            total_def.attr["_output_shapes"].CopyFrom(output_shapes)
        written[total] = total_def
    new_shapes = dict(shapes.shapes)
    new_shapes[top.name] = body_shapes
    return EditedGraph(new_graph_def, {top.name: written},
                       [(top.name, total, product) for total, product, *_ in found],
                       TensorShapes(new_shapes), edit="contracted", op="Sum")


def _find(body: Body, shapes: dict,
          fetched: set[str]) -> list[tuple[str, str, int, int, int]]:
    """(Sum, BatchMatMulV2, rows = batch x contracted, d, f) for each match."""
    found = []
    for name, node in body.nodes.items():
        if node.op != "Sum" or node.node_def.attr["keep_dims"].b or not node.data_inputs:
            continue
        source = node.data_inputs[0][0]
        product = None if source.is_arg else body.nodes.get(source.node)
        if (product is None or product.op != "BatchMatMulV2" or source.index != 0
                or product.name in fetched or len(product.data_inputs) != 2):
            continue
        attrs = product.node_def.attr
        if (not attrs["adj_x"].b or attrs["adj_y"].b or attrs["T"].type not in FLOAT_TYPES
                or len(body.consumers.get(source, ())) != 1):
            continue
        lhs, rhs = (shapes.get(ref) for ref, _ in product.data_inputs)
        out, total = shapes.get(source), shapes.get(TensorRef(name, 0))
        if not all(_static(s) for s in (lhs, rhs, out, total)):
            continue
        if (len(lhs) < 3 or len(rhs) != len(lhs) or lhs[:-1] != rhs[:-1]
                or tuple(out) != (*lhs[:-2], lhs[-1], rhs[-1])
                or tuple(total) != (lhs[-1], rhs[-1])):
            continue
        found.append((name, product.name, math.prod(lhs[:-1]), lhs[-1], rhs[-1]))
    return found


def _static(shape) -> bool:
    return shape is not None and all(isinstance(d, int) and d >= 0 for d in shape)
