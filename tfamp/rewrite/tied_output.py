"""The products of a tied output layer, which stay float32 in bfloat16.

A language model whose output layer multiplies by its input embedding's table
(keras-hub's ReversibleEmbedding) carries a gradient that is a small difference
of large sums; ``coloring._make_slots`` keeps its products float32 in bfloat16
(reason kind "tied output layer"). This module finds them; it edits nothing.
"""

from __future__ import annotations

from tfamp.oplists import EMBEDDING_LOOKUPS, TABLE_PRODUCTS, WEIGHT_VIEWS
from tfamp.rewrite import scopes
from tfamp.rewrite.graph import Body, TensorRef, source_in, variable_key

# Most WEIGHT_VIEWS between a variable's read and the product that reads it
# (a tied layer's Transpose and Tensordot's Reshape: two).
_VIEW_DEPTH = 6


def tied_vocabulary_products(body: Body) -> dict[str, str]:
    """The products of a tied output layer: node -> the embedding lookup
    (oplists.EMBEDDING_LOOKUPS) whose table they multiply by.

    A tied output layer computes logits = hidden @ table^T with the table
    the model's input looks up (keras-hub's ReversibleEmbedding: T5, GPT-2,
    Llama, Gemma, BART). Its products (oplists.TABLE_PRODUCTS) are those
    that read the table, the forward one and d(hidden) = d(logits) @
    table in its gradient, and the gradient product that reads only what
    they read, the weight gradient hidden^T @ d(logits).

    Held float32 in bfloat16 (not float16, whose 3 more bits suffice:
    gradient cosine 0.99999 on keras-hub's T5 either way): d(hidden) is
    sum_v p_v * table_v - table_label, two sums much larger than their
    difference on T5, so bfloat16's 2^-9 rounding of the table and of
    d(logits) came out as 4.7% error in d(hidden), a gradient cosine of
    0.988 against float32 and a weight update of 0.77 after 16 Adam steps.
    The weight gradient is held with them so that d(logits) has no 16-bit
    reader: under XLA the views it passes through went 16-bit for it, and
    d(hidden) read d(logits) rounded (cosine 0.9897 instead of 0.9999).
    Keras's own bfloat16 policy computes all three in float32 (its
    Embedding table is not autocast, and bfloat16 @ float32 promotes).
    Only where the body differentiates through the table: in a graph
    without that gradient (serving), the forward product's rounding is a
    16-bit head's like any other, and ``tfamp export`` can store the
    table, often the model's largest weight, in 16 bits.
    BUILD_NOTES.md, session 34.
    """
    ops = body.ops
    if not (ops & EMBEDDING_LOOKUPS and ops & TABLE_PRODUCTS):
        return {}
    nodes = body.nodes
    tables: dict[str, str] = {}
    for name, node in nodes.items():
        if node.op in EMBEDDING_LOOKUPS and node.data_inputs:
            ref = node.data_inputs[0][0]
            key = (variable_key(nodes, ref) if node.op == "ResourceGather"
                   else _variable_of(nodes, source_in(nodes, ref, WEIGHT_VIEWS, _VIEW_DEPTH)))
            if key is not None:
                tables.setdefault(key, name)
    if not tables:
        return {}
    products: dict[str, str] = {}
    operands: dict[TensorRef, str] = {}  # what held products read besides the table
    for name, node in nodes.items():
        if node.op not in TABLE_PRODUCTS:
            continue
        sources = [source_in(nodes, ref, WEIGHT_VIEWS, _VIEW_DEPTH)
                   for ref, _ in node.data_inputs]
        keys = [_variable_of(nodes, ref) for ref in sources]
        lookup = next((tables[key] for key in keys if key in tables), None)
        if lookup is None:
            continue
        products[name] = lookup
        for ref, key in zip(sources, keys, strict=True):
            if key not in tables:
                operands.setdefault(ref, lookup)
    if not any(map(scopes.is_gradient, products)):
        return {}  # no gradient through the table here: an inference graph
    for name, node in nodes.items():
        if (node.op in TABLE_PRODUCTS and name not in products and node.data_inputs
                and scopes.is_gradient(name)):
            sources = [source_in(nodes, ref, WEIGHT_VIEWS, _VIEW_DEPTH)
                       for ref, _ in node.data_inputs]
            if all(ref in operands for ref in sources):
                products[name] = operands[sources[0]]
    return products


def _variable_of(nodes, ref: TensorRef) -> str | None:
    """graph.variable_key of the variable `ref` reads (a ReadVariableOp's output,
    or a TF1 reference variable itself), in a body's `nodes`; None for any other
    tensor."""
    node = None if ref.is_arg else nodes.get(ref.node)
    if node is None:
        return None
    if node.op in ("VariableV2", "Variable"):
        return f"{ref.node}:{ref.index}"
    if node.op == "ReadVariableOp" and node.data_inputs:
        return variable_key(nodes, node.data_inputs[0][0])
    return None
