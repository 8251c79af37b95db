"""What the ops that compute a value say about its range, before anything runs.

The colouring's static range facts (``coloring._make_slots`` acts on them):

* ``exp_bound``: an Exp of something never positive (a softmax written out,
  GELU's gradient) lies in [0, 1], one of a value clipped from above (a graph
  attention's scores, a policy's standard deviation) below a small constant:
  an infer op, not a deny one;
* ``rsqrt_overflow``: an Rsqrt that can leave the 16-bit range (an l2
  normalisation of a zero row, a normalisation over one element): a deny op;
* ``copies``: a reduction that keeps its input's size copies it: a clear op;
* ``sentinels``: constants past the 16-bit range (a mask's -1e9) and the
  tensors that carry them on.

Each reads one body's ops (and, for sizes, its tensors' element counts) and
edits nothing. Kept out of ``coloring`` so that each rule can be read, and
switched off in a test, on its own.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from tensorflow.core.framework import types_pb2
from tensorflow.python.framework import dtypes

from tfamp.oplists import NON_NEGATIVE_OPS, SENTINEL_CARRIERS
from tfamp.rewrite.graph import (
    DT_HALF,
    FLOAT_TYPES,
    IDENTITIES,
    Body,
    TensorRef,
    constant_magnitude,
    dtype_name,
    int_constant,
    scalar_constant,
    source_in,
)
from tfamp.rewrite.shapes import broadcast_sum_operand
from tfamp.rewrite.traffic import NO_COPY_OPS

# Ops whose output is their first input's value, same shape (a gradient stop too).
SAME_VALUE_OPS = IDENTITIES | {"StopGradient", "PreventGradient"}
# The most an Exp of a clipped value may reach to count as bounded (exp_bound):
# 16 (a clip at 2.77). exp(clip(x, -2, 2)) reaches 7.4 (keras.io's graph attention,
# a SAC policy's standard deviation); its gradient multiplies the loss-scaled
# gradient by as much, no more than a layer's weights do.
CLIPPED_EXP_MOST = 16.0
# Real types: the values a sentinel walk follows (not an index, a shape, a bool).
REAL_TYPES = FLOAT_TYPES | {types_pb2.DT_DOUBLE}
# How many SENTINEL_CARRIERS a constant's value is followed through (a Keras
# mask's: Const -> SelectV2; a hand-written one's: Const -> Mul -> AddV2).
_SENTINEL_DEPTH = 6

# Element counts by tensor (shapes.elements_of), None where unknown.
Counts = Mapping[TensorRef, "tuple[int, int] | None"]


# -- an Exp that cannot exceed 1 -----------------------------------------------
def exp_bound(body: Body, node) -> float | None:
    """The most `node` (an Exp) can be, whatever its input holds, where small
    enough for a 16-bit type; else None. Bounded, it follows its neighbours
    (infer) like any bounded op.

    Three forms are recognised: the exponential of minus something never
    negative (Neg of oplists.NON_NEGATIVE_OPS, through views: TensorFlow's
    gradients of erf, GELU's backward) and of x minus an upper bound of x
    (_minus_its_bound: a softmax written out, Keras 3's over more than one
    axis) lie in [0, 1]; the exponential of a value clipped from above by a
    constant c (_clipped_to) lies in [0, e^c], bounded where that is at most
    CLIPPED_EXP_MOST."""
    if not node.data_inputs:
        return None
    ref = node.data_inputs[0][0]
    if _minus_its_bound(body, ref):
        return 1.0
    clip = _clipped_to(body, ref)
    if clip is not None and clip <= math.log(CLIPPED_EXP_MOST):
        return math.exp(clip)
    seen_neg = False
    for _ in range(8):
        producer = None if ref.is_arg else body.nodes.get(ref.node)
        if producer is None or not producer.data_inputs:
            return None
        if producer.op in NO_COPY_OPS:
            ref = producer.data_inputs[0][0]
        elif producer.op == "Neg" and not seen_neg:
            seen_neg = True
            ref = producer.data_inputs[0][0]
        else:
            return 1.0 if seen_neg and producer.op in NON_NEGATIVE_OPS else None
    return None


def _clipped_to(body: Body, ref: TensorRef) -> float | None:
    """The constant `ref` is at most by construction: it is (through copies)
    ``minimum(x, c)`` with c a scalar constant, maybe under ``maximum(..., lo)``
    with a scalar constant lo (tf.clip_by_value, keras.ops.clip; then the most
    is max(c, lo)), or ``ClipByValue(x, lo, c)``; else None."""
    nodes, floor = body.nodes, -math.inf
    for _ in range(8):
        node = through_copies(body, ref)
        if node is None or len(node.data_inputs) < 2:
            return None
        values = [None if r.is_arg else scalar_constant(nodes.get(r.node))
                  for r, _ in node.data_inputs]
        if node.op == "ClipByValue" and len(values) == 3 and None not in values[1:]:
            return max(values[1], values[2])
        if node.op not in ("Minimum", "Maximum") or len(values) != 2:
            return None
        constants = [value for value in values if value is not None]
        if len(constants) != 1:  # (a minimum of two tensors, or a constant)
            return None
        if node.op == "Minimum":
            return max(constants[0], floor)
        floor = max(floor, constants[0])
        ref = node.data_inputs[values.index(None)][0]
    return None


def _minus_its_bound(body: Body, ref: TensorRef) -> bool:
    """Is `ref` ``x - b`` where b >= x element by element, whatever x holds:
    b a maximum of x (_max_axes_of), or a logsumexp of x (_logsumexp_of)?

    A softmax written out is exp(x - max(x)), and Keras 3's over more than
    one axis (MultiHeadAttention with two attention axes: keras.io's MobileViT)
    is exp(x - logsumexp(x)); both Exps lie in [0, 1] (BUILD_NOTES.md,
    session 40). x must be the same tensor on both sides (through identities
    only: a Reshape would change which elements line up)."""
    node = _value_source(body, ref)
    if node is None or node.op != "Sub" or len(node.data_inputs) != 2:
        return False
    x = _same_value(body, node.data_inputs[0][0])
    bound = node.data_inputs[1][0]
    return _max_axes_of(body, bound, x) is not None or _logsumexp_of(body, bound, x)


def _same_value(body: Body, ref: TensorRef) -> TensorRef:
    """The tensor whose value `ref` passes on unchanged (SAME_VALUE_OPS)."""
    return source_in(body.nodes, ref, SAME_VALUE_OPS, 4)


def _value_source(body: Body, ref: TensorRef):
    """The node behind `ref` through ops that pass its value on unchanged
    (SAME_VALUE_OPS); None for an argument."""
    ref = _same_value(body, ref)
    return None if ref.is_arg else body.nodes.get(ref.node)


def _max_axes_of(body: Body, ref: TensorRef, x: TensorRef) -> frozenset[int] | None:
    """The constant axes over which `ref` is the maximum of `x`, kept as
    dimensions of one (so that it lines up with x), else None. Also through
    ``where(is_finite(m), m, 0)`` (tf.math.reduce_logsumexp's guard: it
    differs from m only where x holds an infinity)."""
    node = _value_source(body, ref)
    if (node is not None and node.op in ("Select", "SelectV2")
            and len(node.data_inputs) == 3):
        test = _value_source(body, node.data_inputs[0][0])
        kept = _same_value(body, node.data_inputs[1][0])
        if (test is None or test.op != "IsFinite" or not test.data_inputs
                or _same_value(body, test.data_inputs[0][0]) != kept):
            return None
        node = _value_source(body, kept)
    if (node is None or node.op != "Max" or len(node.data_inputs) != 2
            or not node.node_def.attr["keep_dims"].b
            or _same_value(body, node.data_inputs[0][0]) != x):
        return None
    return reduction_axes(body, node)


def _logsumexp_of(body: Body, ref: TensorRef, x: TensorRef) -> bool:
    """Is `ref` ``log(sum(exp(x - m), axes)) + m'`` with m a maximum of x over
    axes the sum covers and m' a maximum of x (tf.math.reduce_logsumexp with
    keepdims)? The sum then holds exp(0) = 1 for each maximum, so its log is
    never negative and the result is at least m' >= x."""
    node = _value_source(body, ref)
    if node is None or node.op not in ("Add", "AddV2") or len(node.data_inputs) != 2:
        return False
    for log_ref, max_ref in (node.data_inputs[0][0], node.data_inputs[1][0]), (
            node.data_inputs[1][0], node.data_inputs[0][0]):
        if _max_axes_of(body, max_ref, x) is None:
            continue
        log = _value_source(body, log_ref)
        total = (_value_source(body, log.data_inputs[0][0])
                 if log is not None and log.op == "Log" and log.data_inputs else None)
        if (total is None or total.op != "Sum" or len(total.data_inputs) != 2
                or not total.node_def.attr["keep_dims"].b):
            continue
        summed = reduction_axes(body, total)
        exp = _value_source(body, total.data_inputs[0][0])
        sub = (_value_source(body, exp.data_inputs[0][0])
               if exp is not None and exp.op == "Exp" and exp.data_inputs else None)
        if (summed is None or sub is None or sub.op != "Sub" or len(sub.data_inputs) != 2
                or _same_value(body, sub.data_inputs[0][0]) != x):
            continue
        inner = _max_axes_of(body, sub.data_inputs[1][0], x)
        if inner is not None and inner <= summed:
            return True
    return False


# -- reductions ------------------------------------------------------------------

def reduction_axes(body: Body, node) -> frozenset[int] | None:
    """A reduction's axes (its second input) where a constant, else None."""
    if len(node.data_inputs) < 2:
        return None
    ref = source_in(body.nodes, node.data_inputs[1][0], IDENTITIES, 4)
    axes = int_constant(None if ref.is_arg else body.nodes.get(ref.node))
    return None if axes is None else frozenset(axes)


def copies(body: Body, counts: Counts, node) -> bool:
    """Does a reduction keep its input's size (it reduces no axis, or only
    axes of one element: TensorFlow's gradients of broadcasting ops sum over
    whatever axes BroadcastGradientArgs names, often none)? Then it copies
    its input, exact in any precision: a clear op, not a deny one."""
    if not node.data_inputs:
        return False
    reduced = counts.get(node.data_inputs[0][0])
    result = counts.get(TensorRef(node.name, 0))
    if reduced is None or reduced != result:
        return False
    # With unknown dimensions equal counts say it only where the axes are
    # constants (reducing an unknown dimension would leave one fewer): not for
    # the axes BroadcastGradientArgs computes (BUILD_NOTES.md, session 38).
    return (not reduced[0] or reduction_axes(body, node) is not None
            or broadcast_sum_operand(body, node) is not None)


def through_copies(body: Body, ref: TensorRef, depth: int = 8):
    """The node that computes `ref`'s value, through ops that only copy it
    (at most `depth` of them); None for an argument."""
    ref = source_in(body.nodes, ref, NO_COPY_OPS, depth)
    return None if ref.is_arg else body.nodes.get(ref.node)


# -- an Rsqrt that can leave the 16-bit range --------------------------------------

def rsqrt_overflow(body: Body, counts: Counts, node, target: int) -> str:
    """Why `node` (oplists.GROWING_INVERSES: an Rsqrt) can leave the range of
    `target` (a 16-bit DataType enum), or "" if it cannot.

    rsqrt(x) passes float16's largest value for x below 2.3e-10. An
    l2 normalisation, x * rsqrt(max(sum(x * x), eps)) (tf.math.l2_normalize,
    eps 1e-12), reaches 1e6 on a row of zeros (a ReLU's, a padded step's): in
    float16 the statistic became inf where it was cast, 0 * inf is NaN where
    float32 gives 0, and its gradient (dy * 1e6) became inf where a ReLU's
    gradient multiplies it by 0. So an Rsqrt of a Sum plus (or max with) a
    constant eps below 2.4e-10 is a deny op, and what reads it stays float32
    up to the next allow op (coloring._propagate_deny). A variance with such
    an eps (BERT's LayerNorm's 1e-12) is left as it is: it is 0 only on a row
    of equal values, and holding every LayerNorm's backward in float32 would
    cost BERT's step 2 GB (BUILD_NOTES.md, session 21). bfloat16 has
    float32's range.
    """
    if not node.data_inputs:
        return ""
    one_element = one_element_variance(body, counts, node)
    if one_element:
        return one_element
    if target != DT_HALF:
        return ""
    producer = through_copies(body, node.data_inputs[0][0])
    if producer is not None and producer.op == "Sum":
        return _clamped_rsqrt(body, node, target)
    eps, sources = _statistic_plus_eps(body, node)
    summed = any(source is not None and source.op == "Sum" for source in sources)
    largest = float(dtypes.as_dtype(target).max)
    if eps is None or not summed or eps ** -0.5 <= largest:
        return ""
    return (f"rsqrt(sum + {eps:g}) reaches {eps ** -0.5:.3g} for a zero row, beyond "
            f"{dtype_name(target)}'s {largest:g}: float32 up to the next allow op")


def _statistic_plus_eps(body: Body, node) -> tuple[float | None, list]:
    """An Rsqrt's input as ``statistic + eps`` (Add, AddV2 or Maximum with a
    positive constant): (eps or None, the nodes behind its other inputs, through
    copies; None for an argument). (None, []) for any other input."""
    producer = through_copies(body, node.data_inputs[0][0])
    if producer is None or producer.op not in ("Add", "AddV2", "Maximum"):
        return None, []
    eps, sources = None, []
    for ref, _ in producer.data_inputs:
        value = None if ref.is_arg else scalar_constant(body.nodes.get(ref.node))
        if value is not None and value > 0:
            eps = float(value)
        else:
            sources.append(through_copies(body, ref))
    return eps, sources


def one_element_variance(body: Body, counts: Counts, node) -> str:
    """Why an Rsqrt of a statistic over one element plus eps must stay
    float32, or "".

    A normalisation over one element (keras.io's timeseries Transformer:
    LayerNormalization over a series' one channel) has variance 0 and
    mean x, so its inverse is eps^-0.5 (1000 at eps 1e-6) and it computes
    ``x * inv + (beta - mean * inv)``: two products that cancel exactly in
    float32, giving beta. In 16 bits the sum ``beta - mean * inv`` rounds
    at the products' size, and its error (about |x| x 1000 x 2^-9 in
    bfloat16) is the output: measured, a model of two such blocks trained
    with an update cosine of 0.10 against float32's in bfloat16, and its
    gammas (whose float32 gradient is exactly 0) moved in float16. So the
    Rsqrt is a deny op and what reads it stays float32 up to the next allow
    op: the products then cancel as in float32. The statistic is over one
    element where its reduction keeps its input's size (``copies``)."""
    eps, sources = _statistic_plus_eps(body, node)
    one_element = any(source is not None and source.op in ("Mean", "Sum")
                      and copies(body, counts, source) for source in sources)
    if eps is None or not one_element:
        return ""
    return (f"rsqrt(variance + {eps:g}) of a normalisation over one element is "
            f"{eps ** -0.5:.3g}, and x * it cancels mean * it exactly only in float32 "
            f"(the output is the offset): float32 up to the next allow op")


def _clamped_rsqrt(body: Body, node, target: int) -> str:
    """Why an Rsqrt of a bare Sum whose result is clamped by ``Minimum`` with a
    constant past the 16-bit range can leave it, or "".

    Keras 3 normalises as ``x * minimum(rsqrt(sum(x * x)), 1 / eps)``
    (``keras.ops.normalize``, eps 1e-7; ``UnitNormalization``, eps 1e-12): on a
    row of zeros the rsqrt is inf in float32 too, the Minimum makes it 1e7 or
    1e12, and the gradient is dy times that. The same hold as l2_normalize's.
    """
    largest = float(dtypes.as_dtype(target).max)
    nodes = body.nodes
    frontier, clamp = [TensorRef(node.name, 0)], None
    for _ in range(8):  # (through copies: Identity, a Reshape)
        reached = []
        for ref in frontier:
            for name, _ in body.consumers.get(ref, ()):
                consumer = nodes[name]
                if consumer.op == "Minimum":
                    for other, _ in consumer.data_inputs:
                        value = None if other.is_arg else scalar_constant(
                            nodes.get(other.node))
                        if value is not None and value > largest:
                            clamp = value if clamp is None else max(clamp, value)
                elif consumer.op in NO_COPY_OPS:
                    reached.append(TensorRef(name, 0))
        frontier = reached
    if clamp is None:
        return ""
    return (f"minimum(rsqrt(sum), {clamp:g}) reaches {clamp:.3g} for a zero row, beyond "
            f"{dtype_name(target)}'s {largest:g}: float32 up to the next allow op")


# -- constants past the 16-bit range (a mask's sentinel) -------------------------------

def sentinels(body: Body, largest: float, input_magnitudes: Mapping[str, float]
              ) -> tuple[dict[str, float], dict[TensorRef, float]]:
    """(node -> a constant past the 16-bit type's `largest` value that one of
    its float inputs carries, tensor -> the constant it carries).

    Readers are the constant's own, and those through oplists.SENTINEL_CARRIERS
    (-1e9 picked by a select, or times a 0/1 mask, then added) up to
    _SENTINEL_DEPTH ops on. One walk forward from such constants (and from
    placeholders fed one: `input_magnitudes`, a capture's largest magnitude by
    placeholder); a body without one (most) costs one look at its Consts. The
    carrying tensors matter beyond the body: a boundary they cross carries the
    value into another body (coloring._boundary_sentinels)."""
    seeds = {}
    for name, node in body.nodes.items():
        if node.op == "Const":
            value = constant_magnitude(node)
        elif node.op == "Placeholder":  # (a captured constant, where known)
            value = input_magnitudes.get(name)
        else:
            continue
        if value is not None and value > largest:
            seeds[TensorRef(name, 0)] = value
    if not seeds:
        return {}, {}
    return walk_sentinels(body, seeds)


def walk_sentinels(body: Body, seeds: Mapping[TensorRef, float]
                   ) -> tuple[dict[str, float], dict[TensorRef, float]]:
    """(node -> the value it reads, tensor -> the value it carries), walking
    forward from `seeds` (tensors that hold a value past the 16-bit range)
    through oplists.SENTINEL_CARRIERS, up to _SENTINEL_DEPTH ops on."""
    nodes, consumers, producer_port = body.nodes, body.consumers, body.producer_port
    arg_dtypes = body.arg_dtypes
    carrying = dict(seeds)
    readers: dict[str, float] = {}
    frontier = list(seeds)
    for depth in range(_SENTINEL_DEPTH + 1):
        reached = []
        for source in frontier:
            if source.is_arg:
                dtype = arg_dtypes.get(source.node)
            else:
                port = producer_port(source)
                dtype = None if port is None else port.dtype
            if dtype not in REAL_TYPES:
                continue  # (an index, a shape, a mask's bool)
            for name, _ in consumers.get(source, ()):
                node = nodes[name]
                readers.setdefault(name, carrying[source])
                if node.op in SENTINEL_CARRIERS and depth < _SENTINEL_DEPTH:
                    for index in range(len(node.outputs)):
                        out = TensorRef(name, index)
                        if out not in carrying:
                            carrying[out] = carrying[source]
                            reached.append(out)
        frontier = reached
    return readers, carrying
