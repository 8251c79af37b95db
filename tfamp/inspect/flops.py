"""How many FLOPs do the matrix-multiply and convolution ops of a graph do?

From static shapes:

* ``graph_def_flops``: a GraphDef with ``_output_shapes`` attributes
  (``as_graph_def(add_shapes=True)`` of a traced or loaded function; without
  them, TensorFlow's shape inference fills them in), counting
  inside library functions too, each weighted by how often it runs per step (a
  loop body times its static trip count; see ``tfamp.rewrite.traffic``). This
  is what ``tfamp inspect`` uses for SavedModels, Keras files and GraphDefs.

An op whose shapes are not fully known is left out and counted as unknown.
"""

from __future__ import annotations

import re

from tfamp.oplists import MATRIX_OPS


def graph_def_flops(graph_def) -> tuple[dict[tuple[str, str], int], int, int]:
    """FLOPs per step of every matrix/convolution op that runs, library included.

    An unknown dimension (a SavedModel's batch) is a symbol B: an op's FLOPs
    are c x B**d. Only the highest power of B found counts (the others vanish
    as B grows), so the share in 16-bit is exact for large batches.

    Args:
      graph_def: a GraphDef, ideally with ``_output_shapes`` attributes.

    Returns:
      ({(function, node name): FLOPs x runs per step, as the coefficient of
      B**degree}, number of matrix ops that run but whose shapes are unknown,
      degree). Function "" is the top graph.
    """
    from tfamp.rewrite.graph import build_view
    from tfamp.rewrite.shapes import tensor_shapes
    from tfamp.rewrite.traffic import body_weights

    view = build_view(graph_def)
    shapes = tensor_shapes(graph_def, view)
    weights = body_weights(view, shapes=shapes).weights
    terms: dict[tuple[str, str], tuple[int, int]] = {}
    unknown = 0
    for body in view.bodies:
        weight = weights.get(body.name, 0)
        if not weight:
            continue
        known = shapes.shapes.get(body.name, {})
        for name, node in body.nodes.items():
            if node.op not in MATRIX_OPS:
                continue
            value = _node_flops(node, known)
            if value is None:
                unknown += 1
            else:
                terms[(body.name, name)] = (value[0], value[1] * weight)
    degree = max((d for d, _ in terms.values()), default=0)
    flops = {key: coeff for key, (d, coeff) in terms.items() if d == degree}
    return flops, unknown, degree


def _mono(*factors) -> tuple[int, int]:
    """(number of unknown (-1) factors, product of the others)."""
    degree, product = 0, 1
    for factor in factors:
        if factor < 0:
            degree += 1
        else:
            product *= factor
    return degree, product


def _node_flops(node, shapes) -> tuple[int, int] | None:
    """FLOPs of one node as (power of B, coefficient), or None."""
    from tfamp.rewrite.graph import TensorRef

    inputs = [shapes.get(ref) for ref, _ in node.data_inputs]
    out = shapes.get(TensorRef(node.name, 0))
    attr = node.node_def.attr
    kind = node.op
    if kind == "Einsum":
        equation = attr["equation"].s.decode() if "equation" in attr else ""
        return _einsum_from_dims(equation, inputs)
    if out is None or not inputs:
        return None
    if kind == "MatMul" or kind.startswith("BatchMatMul"):
        k = _contracted(kind, attr, *(inputs + [None])[:2])
        return None if k is None else _mono(2, *out, k)
    if kind in ("Conv2D", "Conv3D", "DepthwiseConv2dNative"):
        kernel = inputs[1] if len(inputs) > 1 else None
        if kernel is None:
            return None
        channels = 1 if kind.startswith("Depthwise") else kernel[-2]
        return _mono(2, *out, *kernel[:-2], channels)
    grad = inputs[2] if len(inputs) > 2 else None
    filter_shape = out if "Filter" in kind else inputs[1]
    if grad is None or filter_shape is None:
        return None
    channels = 1 if "Depthwise" in kind else filter_shape[-2]
    return _mono(2, *grad, *filter_shape[:-2], channels)


def _contracted(kind: str, attr, a, b) -> int | None:
    """The size of a product's contracted dimension: from either operand, so
    a row count TensorFlow could not infer (Keras's Dense on a sequence reshapes
    its input to a computed [-1, -1]) does not lose it: the kernel knows it."""
    batched = kind != "MatMul"
    flag_a, flag_b = ("adj_x", "adj_y") if batched else ("transpose_a", "transpose_b")
    sizes = []
    if a is not None and len(a) >= 2 and (batched or len(a) == 2):
        sizes.append(a[-2] if flag_a in attr and attr[flag_a].b else a[-1])
    if b is not None and len(b) >= 2 and (batched or len(b) == 2):
        sizes.append(b[-1] if flag_b in attr and attr[flag_b].b else b[-2])
    known = [size for size in sizes if size >= 0]
    return known[0] if known else (sizes[0] if sizes else None)


def _einsum_from_dims(equation: str, inputs) -> tuple[int, int] | None:
    lhs, _, _ = equation.partition("->")
    sizes: dict[str, int] = {}
    if not re.fullmatch(r"[a-zA-Z,\s]+", lhs or "-"):
        return None
    for spec, dims in zip(lhs.split(","), inputs, strict=False):
        spec = spec.strip()
        if dims is None or len(spec) != len(dims):
            return None
        for letter, size in zip(spec, dims, strict=True):
            if sizes.get(letter, -1) < 0:
                sizes[letter] = size
    return _mono(2, *sizes.values()) if sizes else None


def share_in_16bit(flops: dict, converted: set) -> float | None:
    """Fraction of the counted FLOPs whose op is in `converted` (None if none counted)."""
    total = sum(flops.values())
    if total == 0:
        return None
    return sum(v for name, v in flops.items() if name in converted) / total
