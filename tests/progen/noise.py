"""A float32 run with rounding noise: how far 16-bit rounding may move each output.

While a program is traced inside ``rounding_noise()``, every op that
computes a float32 value y is followed by ``y + (u_op * m + clip(y, -t, t)) * r``,
r = +1 or -1 at random (a stateless random op with a fixed seed): the
standard model of floating-point rounding, ``fl(x op y) = (x op y)(1 + d)``
with ``|d| <= u``, the unit roundoff of a 16-bit type, plus an absolute term
of at most t (float16's subnormal half-spacing) that never moves a value
past zero (an underflow flushes it, keeping its sign). m is |y|, except for
an op that sums k terms (a matmul's inner dimension, a convolution's window,
a reduction), where m is the sum of the terms' magnitudes (the op run again
on |inputs|: a sum whose terms cancel may change sign) and
``u_op = u * sqrt(k)``: a 16-bit kernel may accumulate in 16 bits on the CPU.
Ops that only move values (reshape, transpose, gather, relu, max) add
nothing, and nor does an element-wise result that is a small integer (at most
256: exact in both 16-bit types, so a 16-bit op that rounds to nearest gives it
too, such as a mask's ``1 - m``). The noise is a forward perturbation (``stop_gradient``): gradient
ops are noised in their own right (the tape builds them while tracing).

Range, too: a noised result beyond the 16-bit type's largest finite value
becomes infinite, as the 16-bit kernel's would (float16 overflows past 65504;
bfloat16 has float32's range). An output computed from a value float16
cannot hold is then not finite in the noisy run either, and is not judged: a
gradient of 1e7 is the loss scale's and the fallback's business, not the
rewrite's (programs 2000569 and 2001003 of the long mode, session 13: a
value cubed in a loop). Every output of an allow op that reads such a value
overflows too (the rewrite casts a deny op's float32 result to the 16-bit type
for it). The price: an infer or clear op the rewrite keeps
float32 (next to float32 neighbours) may hold such a value, and what reads it
is then not judged either. Deny ops are never noised, so never overflow here.
Nor is an op that reads a constant past float16's range (a mask's -1e9),
directly or through the ops that carry it (``tfamp.oplists.SENTINEL_CARRIERS``):
the rewrite keeps those float32 (its sentinel rule), so they stay exact here.
Noised, -1e9 overflowed (and its rounding, 5e5, swamped the scores), and every
output of a padded attention went unjudged in float16.
A Cast into float32 from bfloat16 or float64 overflows the same way (no
rounding): its value was never range-checked by a float32 op, and the rewrite
may cast it straight to the 16-bit type (12000260).

A summing op whose float16 CPU kernel accumulates in float16 on this machine
(``sixteen_bit_accumulators``: Einsum on an Intel Xeon with AVX-512 in
TensorFlow 2.21, not on the AMD CPUs without it) overflows where a partial sum
passes float16's range, though the result fits (17000847: a weight gradient
of 709 summed from terms of 1e5): there an output whose terms' magnitudes sum
past the range may overflow, and is not judged.

Only ops on the 16-bit type's allow, infer and clear lists are noised
(``with_noise_size``): the reference is "every op the rewrite may convert
rounds", and an op it must keep float32 stays exact. The noisy run is the
reference for the tolerance (see ``invariants``): an output that such rounding
moves by much is ill-conditioned at that precision, and how much it moves is
how much the 16-bit run may differ.

TensorFlow's op callbacks (``op_callbacks.add_op_callback``, the mechanism
``tf.debugging.enable_check_numerics`` uses) replace an op's outputs while a
graph is built; that is what this relies on.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import graph_pb2
from tensorflow.python.framework import op_callbacks, tensor_util

from tfamp.oplists import SENTINEL_CARRIERS

# Ops whose output is exactly one of their inputs' values (or made of them),
# control flow and calls (replacing their outputs is unsupported), and ops
# that make values rather than compute them.
_EXACT_OPS = frozenset({
    "Identity", "IdentityN", "Reshape", "Transpose", "ConcatV2", "Concat", "Split", "SplitV",
    "Slice", "StridedSlice", "StridedSliceGrad", "Pack", "Unpack", "Tile", "ExpandDims",
    "Squeeze", "GatherV2", "Gather", "GatherNd", "Relu", "Relu6", "ReluGrad", "Maximum",
    "Minimum", "Neg", "Abs", "Sign", "Select", "SelectV2", "ZerosLike", "OnesLike", "Fill",
    "BroadcastTo", "Shape", "ShapeN", "Size", "Rank", "Cast", "StopGradient",
    "PreventGradient", "Snapshot", "EnsureShape", "CheckNumerics", "Pad", "PadV2",
    "MirrorPad", "OneHot", "MaxPool", "MaxPoolGrad", "Reverse", "ReverseV2", "Floor", "Ceil",
    "Round", "ClipByValue", "Placeholder", "PlaceholderWithDefault", "Const", "VarHandleOp",
    "While", "StatelessWhile", "If", "StatelessIf", "Case", "StatelessCase",
    "PartitionedCall", "StatefulPartitionedCall", "NoOp", "Range", "LinSpace",
    "BroadcastGradientArgs", "InvertPermutation", "DynamicStitch", "ParallelDynamicStitch",
    "Empty", "TensorScatterUpdate", "ScatterNd", "Where", "Unique", "TopKV2",
    "StatelessRandomUniformV2", "StatelessRandomNormalV2", "StatelessRandomGetKeyCounter",
    "StatelessRandomUniformFullIntV2", "StatelessRandomGetAlg", "StatefulUniformFullInt",
    "RngReadAndSkip", "StatelessRandomUniform", "StatelessRandomNormal",
    "StatelessTruncatedNormalV2", "MatrixBandPart", "MatrixDiagV3", "MatrixSetDiagV3",
    "Max", "Min", "ArgMax", "ArgMin", "Equal", "Less", "Greater", "LessEqual",
    "GreaterEqual", "NotEqual",
})
# Scalar constants the noise is built with, replaced by the real sizes in the
# GraphDef (``with_noise_size``): one trace serves every 16-bit type.
MAGIC_SIZE = np.float32(1.2345678e-4)
MAGIC_TINY = np.float32(8.7654321e-9)
MAGIC_LARGEST = np.float32(1.2345678e30)
# The same for what an allow op reads (with_noise_size: other ops' readers stay exact)
MAGIC_READ = np.float32(2.3456789e30)
# Types whose values no float32 op of the trace range-checked (see the Casts in
# ``rounding_noise``).
_UNRANGED = (tf.bfloat16, tf.float64)


def _terms(op_type: str, inputs, outputs, attrs: dict) -> int:
    """How many terms an op sums per output element (1 for element-wise ops)."""
    def dims(tensor):
        shape = tensor.shape
        return None if shape.rank is None else [d if d is not None else 0 for d in shape]

    try:
        if op_type == "MatMul":
            a = dims(inputs[0])
            return (a[0] if attrs.get("transpose_a") else a[1]) if a else 1
        if op_type.startswith("BatchMatMul"):
            a = dims(inputs[0])
            return (a[-2] if attrs.get("adj_x") else a[-1]) if a else 1
        if op_type in ("Conv2D", "Conv3D", "Conv2DBackpropInput"):
            f = dims(inputs[1])
            window = math.prod(f[:-2]) if f else 1
            return window * (f[-2] if op_type != "Conv2DBackpropInput" else f[-1])
        if op_type in ("DepthwiseConv2dNative", "DepthwiseConv2dNativeBackpropInput"):
            f = dims(inputs[1])
            return math.prod(f[:-2]) if f else 1
        if op_type == "Einsum":
            equation = attrs.get("equation", b"")
            equation = equation.decode() if isinstance(equation, bytes) else equation
            lhs, _, rhs = equation.partition("->")
            sizes = {}
            for spec, tensor in zip(lhs.split(","), inputs, strict=False):
                shape = dims(tensor)
                if shape and len(shape) == len(spec):
                    sizes.update(zip(spec, shape, strict=True))
            return math.prod(v for k, v in sizes.items() if k not in rhs and v) or 1
        if op_type in ("Sum", "Mean", "Prod", "EuclideanNorm", "BiasAddGrad",
                       "Conv2DBackpropFilter", "DepthwiseConv2dNativeBackpropFilter",
                       "UnsortedSegmentSum", "Cumsum", "FusedBatchNormV3",
                       "FusedBatchNormGradV3", "SoftmaxCrossEntropyWithLogits",
                       "SparseSoftmaxCrossEntropyWithLogits", "Softmax", "LogSoftmax"):
            big = max((math.prod(d) for d in map(dims, inputs) if d), default=1)
            small = math.prod(dims(outputs[0]) or [1]) or 1
            if op_type in ("Softmax", "LogSoftmax", "Cumsum"):
                last = dims(inputs[0])
                return last[-1] if last else 1
            return max(1, big // small) if big else 1
    except (TypeError, IndexError, ValueError):
        return 1
    return 1


# Ops whose result is a sum of products of their float inputs (linear in each):
# the same op on the inputs' magnitudes is the sum of the terms' magnitudes.
_SUMMING_OPS = frozenset({
    "MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum", "Conv2D", "Conv3D",
    "DepthwiseConv2dNative", "Conv2DBackpropInput", "Conv2DBackpropFilter",
    "DepthwiseConv2dNativeBackpropInput", "DepthwiseConv2dNativeBackpropFilter", "Sum",
    "Mean", "BiasAddGrad", "UnsortedSegmentSum", "Cumsum", "AddN",
})


@functools.cache
def sixteen_bit_accumulators() -> frozenset[str]:
    """The summing ops whose float16 CPU kernel on this machine accumulates in
    float16: 64 products of +-9e4 that cancel overflow there, and are 0 where
    the kernel sums in float32."""
    a = np.full((1, 64), 300.0, np.float16)
    b = np.tile(np.asarray([[300.0], [-300.0]], np.float16), (32, 1))
    runs = {
        "Einsum": lambda: tf.einsum("bi,ij->bj", a, b),
        "MatMul": lambda: tf.raw_ops.MatMul(a=a, b=b),
        "BatchMatMulV2": lambda: tf.raw_ops.BatchMatMulV2(x=a[None], y=b[None]),
        "Conv2D": lambda: tf.raw_ops.Conv2D(input=a.reshape(1, 1, 64, 1),
                                            filter=b.reshape(1, 64, 1, 1),
                                            strides=[1, 1, 1, 1], padding="VALID"),
    }
    found = set()
    with tf.init_scope(), tf.device("/CPU:0"):
        for name, run in runs.items():
            if not np.all(np.isfinite(run().numpy())):
                found.add(name)
    if "BatchMatMulV2" in found:
        found |= {"BatchMatMul", "BatchMatMulV3"}
    return frozenset(found)


def _sum_of_magnitudes(op_type, inputs, attrs, outputs, graph):
    """The op of `op_type` run again on |inputs| (float inputs only): for a
    summing op, the sum of its terms' magnitudes, per output element."""
    absolute = [tf.abs(t) if t.dtype == tf.float32 else t for t in inputs]
    attr_map = dict(zip(attrs[::2], attrs[1::2], strict=False)) if attrs else {}
    op = graph._create_op_internal(op_type, absolute, dtypes=[t.dtype for t in outputs],
                                   attrs=attr_map)
    return op.outputs[0]


def _attr_value(value):
    """A graph op's attribute (an AttrValue proto) as a Python value: a bool or bytes."""
    kind = value.WhichOneof("value") if hasattr(value, "WhichOneof") else None
    return getattr(value, kind) if kind in ("b", "s", "i", "f") else value


# Comparisons whose answer 16-bit rounding of their inputs may change (see
# rounding_noise's `ties_only`), and how near is near, in unit roundoffs
# of the inputs' magnitudes (a few chained 16-bit ops: 9000082's gap was 1.3,
# the rounding that closed it 1.7).
_ORDERINGS = frozenset({"Greater", "GreaterEqual", "Less", "LessEqual"})
_TIE_ROUNDOFFS = 4.0


def _root_terms(op_type: str, inputs, attrs, outputs) -> float:
    """sqrt of the number of terms one output of the op sums (``_terms``)."""
    attr_map = {key: _attr_value(value) for key, value
                in zip(attrs[::2], attrs[1::2], strict=False)} if attrs else {}
    return math.sqrt(_terms(op_type, inputs, outputs, attr_map))


# float16's largest finite value: a constant past it is a sentinel (see the module doc).
_FLOAT16_MAX = 65504.0


def _sentinel_constant(tensor) -> bool:
    """Is `tensor` a float constant with a finite element past float16's range?"""
    if tensor.dtype not in (tf.float32, tf.float64) or tensor.op.type != "Const":
        return False
    value = tensor_util.constant_value(tensor)
    if value is None:
        return False
    finite = np.abs(value[np.isfinite(value)])
    return bool(finite.size) and float(finite.max()) > _FLOAT16_MAX


# Integers up to this magnitude are exact in float16 and bfloat16 (8 significant bits).
_EXACT_INTEGERS = 256.0


def _small_integer(tensor):
    """Where `tensor` holds an integer that both 16-bit types hold exactly."""
    return tf.logical_and(tf.equal(tensor, tf.round(tensor)),
                          tf.abs(tensor) <= _EXACT_INTEGERS)


@contextlib.contextmanager
def rounding_noise(salt: int = 0, ties_only: bool = False, crossed: bool = False,
                   away: bool = False):
    """Traces inside this add rounding noise to every float32 op (see the module doc).

    The noise's sizes are placeholders (MAGIC_SIZE, MAGIC_TINY) until
    ``with_noise_size`` sets them for a 16-bit type. `salt`: a second seed
    word (another sample of the same noise). `ties_only`: no rounding noise;
    instead every ordering comparison (``a > b``, ...) of float32 values closer
    than a few 16-bit roundings, ``|a - b| <= 4 u (|a| + |b|)``, is answered as
    for equal values. 16-bit rounding lands values on a coarse grid, so such a
    gap may close, and a ``tf.where`` then picks the other side: 9000082, a
    16-bit attention output rounded onto the grid value it was compared with
    (gap 1.3 u); a random-sign sample crosses such a gap only by chance (a
    quarter of them here), and one that moves the other way widens it.
    `crossed`: no rounding noise either; instead every result of a summing op
    closer to zero than its rounding, ``|y| < u sqrt(k) m`` (m the sum of the
    terms' magnitudes, as for the noise), changes sign: a ReLU (or any kink)
    it feeds then takes the other branch, as a 16-bit run's may. 11000068: a
    Dense pre-activation of -3.8e-4 whose 16 terms' magnitudes sum to 1.7
    (0.11 of that rounding); upstream 16-bit rounding turned it positive, the
    ReLU let its gradient through (0.029 on the bias); 2 of 8 random samples
    cross it, none of the three that judged it did.
    `away`: every rounding moves its value away from zero, by the whole bound
    (no random signs): the most each value can grow, so every value that some
    sample could push past the 16-bit range overflows in this one. A random
    sample may leave a value just past the range finite (17000847: a weight
    gradient of 6.56e4 to 6.8e4 in float32, which one sample's signs moved to
    6.3e4), where the 16-bit run overflows.
    """
    counter = [0]
    carriers: set = set()  # refs of tensors that carry a sentinel constant

    def callback(op_type, inputs, attrs, outputs, op_name=None, graph=None):
        # Reads a sentinel (a constant past float16's range, or a value that
        # carries one)? Then its result does not overflow here: the rewrite
        # keeps such ops float32. What the carrying ops make carries it on.
        sentinel = graph is not None and any(
            t.dtype.is_floating and (t.ref() in carriers or _sentinel_constant(t))
            for t in inputs)
        if sentinel:
            if op_type in SENTINEL_CARRIERS:
                carriers.update(t.ref() for t in outputs)
            return None
        return _callback(op_type, inputs, attrs, outputs, graph)

    def _callback(op_type, inputs, attrs, outputs, graph):
        if ties_only:
            if (graph is None or op_type not in _ORDERINGS or len(inputs) != 2
                    or any(t.dtype != tf.float32 for t in inputs)):
                return None
            a, b = inputs
            size = tf.constant(MAGIC_SIZE, name=f"progen_noise__{op_type}__")
            near = tf.abs(a - b) <= (tf.abs(a) + tf.abs(b)) * (size * _TIE_ROUNDOFFS)
            if op_type in ("Greater", "Less"):  # (a tie is not strictly ordered)
                return [tf.logical_and(outputs[0], tf.logical_not(near))]
            return [tf.logical_or(outputs[0], near)]
        if crossed:
            if graph is None or op_type not in _SUMMING_OPS or len(outputs) != 1 or (
                    outputs[0].dtype != tf.float32):
                return None
            (tensor,) = outputs
            terms = _root_terms(op_type, inputs, attrs, outputs)
            size = tf.constant(MAGIC_SIZE, name=f"progen_noise__{op_type}__")
            scale = _sum_of_magnitudes(op_type, inputs, attrs, outputs, graph)
            near = tf.abs(tensor) < scale * (size * terms)
            # (a forward change only, as for the noise)
            return [tensor + tf.stop_gradient(tf.where(near, -2.0 * tensor,
                                                       tf.zeros_like(tensor)))]
        if (graph is not None and op_type == "Cast" and len(inputs) == 1 and len(outputs) == 1
                and outputs[0].dtype == tf.float32 and inputs[0].dtype in _UNRANGED):
            # A value entering float32 from bfloat16 or float64 was never checked
            # against float16's range, and overflows here: the rewrite may cast it
            # straight to the 16-bit type for its consumers (12000260: the
            # gradient of a Cast to bfloat16, 1.4e5, retargeted to float16 for
            # a float16 SigmoidGrad whose own result, 3.8e4, fits). No rounding.
            (tensor,) = outputs
            largest = tf.constant(MAGIC_LARGEST, name="progen_range__Cast__")
            return [tensor + tf.stop_gradient(tf.where(
                tf.abs(tensor) > largest, tf.sign(tensor) * np.float32(np.inf),
                tf.zeros_like(tensor)))]
        if graph is None or op_type in _EXACT_OPS or re.match(r"(TensorList|TensorArray|"
                                                                r"ReadVariable|Assign|"
                                                                r"ResourceApply)", op_type):
            return None
        if not outputs or not any(t.dtype == tf.float32 for t in outputs):
            return None
        terms = _root_terms(op_type, inputs, attrs, outputs)
        partial_sums_overflow = op_type in accumulators
        # Past the 16-bit type's range an output overflows (see the module doc).
        largest = tf.constant(MAGIC_LARGEST, name=f"progen_noise__{op_type}__")
        # So does every output of an allow op that reads a finite value past it
        # (a deny op's float32 result the rewrite casts to 16 bits for it: 29000855,
        # a Pow of 1e5 read by a float16 MatMul in a loop). Not an infer or clear
        # op's: the rewrite's range rules may hold those float32 (an l2
        # normalisation's rsqrt of 1e6 and what reads it). An inf is inf in 16
        # bits too (a mask's -inf).
        wide = [t for t in inputs if t.dtype == tf.float32]
        read_limit = tf.constant(MAGIC_READ, name=f"progen_noise__{op_type}__")
        read_past = (tf.reduce_any([tf.reduce_any(tf.logical_and(
            tf.abs(t) > read_limit, tf.math.is_finite(t))) for t in wide])
            if wide and graph is not None else None)
        replaced = []
        for tensor in outputs:
            if tensor.dtype != tf.float32:
                replaced.append(tensor)
                continue
            counter[0] += 1
            # A random sign, not a uniform draw: each value moves by the whole
            # bound (one draw near 0 would make a scalar's reference exact).
            # (the seed a named constant: ``with_salt`` makes another sample of a trace)
            r = tf.sign(tensor) if away else tf.sign(tf.random.stateless_uniform(
                tf.shape(tensor), minval=-1.0, maxval=1.0,
                seed=tf.constant([counter[0], salt], tf.int64, name="progen_seed__")))
            size = tf.constant(MAGIC_SIZE, name=f"progen_noise__{op_type}__")
            limit = tf.constant(MAGIC_TINY, name=f"progen_noise__{op_type}__")
            # A sum's rounding is relative to its terms, not to its result: a
            # result near zero (terms that cancel) may change sign.
            scale = (_sum_of_magnitudes(op_type, inputs, attrs, outputs, graph)
                     if op_type in _SUMMING_OPS else tensor)
            # float16's absolute error: up to the value itself (a flush to
            # zero), never past it: rounding keeps a value's sign, and a zero.
            error = (scale * (size * terms) + tf.clip_by_value(tensor, -limit, limit)) * r
            if op_type not in _SUMMING_OPS:
                # A small integer is on both 16-bit grids: an element-wise result
                # float32 rounds to one, 16-bit rounding gives too (a mask's 1 - m).
                error = tf.where(_small_integer(tensor), tf.zeros_like(error), error)
            noisy = tensor + error
            past = tf.abs(noisy) > largest
            if partial_sums_overflow:  # (a kernel that accumulates in 16 bits)
                past = tf.logical_or(past, scale > largest)
            if read_past is not None:
                past = tf.logical_or(past, read_past)
            error += tf.where(past, tf.where(noisy < 0, -np.float32(np.inf), np.float32(np.inf)),
                              tf.zeros_like(noisy))
            # A forward perturbation only: the gradient ops have their own.
            # (Without the stop, a loop's gradient would keep every factor.)
            replaced.append(tensor + tf.stop_gradient(error))
        return replaced

    accumulators = sixteen_bit_accumulators()
    op_callbacks.add_op_callback(callback)
    try:
        yield
    finally:
        op_callbacks.remove_op_callback(callback)


def with_noise_size(graph_def, unit_roundoff: float, tiny: float,
                    lists, largest: float = np.inf) -> graph_pb2.GraphDef:
    """A copy of a noisy trace's GraphDef with the noise sized for one 16-bit type.

    Only ops the rewrite may compute in 16-bit (on the allow, infer or clear
    list of `lists`) get noise; the others stay exact, as the rewrite keeps
    them float32: a run that rounds a deny op (an Exp, an optimizer's bias
    correction) where the rewrite may not is no reference for it.

    Args:
      graph_def: traced under ``rounding_noise``.
      unit_roundoff: the relative size u (2**-11 for float16, 2**-8 for bfloat16).
      tiny: the absolute size (float16's subnormal half-spacing, 2**-25; 0 for
        bfloat16, whose range is float32's).
      lists: the ``tfamp.OpLists`` of that type.
      largest: past this magnitude a result overflows (float16's rounding
        threshold 65520; infinity: no overflow).
    """
    copy = graph_pb2.GraphDef()
    copy.CopyFrom(graph_def)
    values = {MAGIC_SIZE.tobytes(): np.float32(unit_roundoff),
              MAGIC_TINY.tobytes(): np.float32(tiny),
              MAGIC_LARGEST.tobytes(): np.float32(largest)}
    exact = {MAGIC_SIZE.tobytes(): np.float32(0.0), MAGIC_TINY.tobytes(): np.float32(0.0),
             MAGIC_LARGEST.tobytes(): np.float32(np.inf)}
    bodies = [copy.node] + [f.node_def for f in copy.library.function]
    for nodes in bodies:
        for node in nodes:
            if node.op == "Const" and _RANGE_NAME.search(node.name):  # (any Cast's range)
                node.attr["value"].tensor.CopyFrom(
                    tensor_util.make_tensor_proto(np.float32(largest)))
                continue
            named = _NOISE_NAME.search(node.name)
            if node.op != "Const" or named is None:
                continue
            value = tensor_util.MakeNdarray(node.attr["value"].tensor)
            if value.tobytes() == MAGIC_READ.tobytes():
                new = np.float32(largest if lists.list_of(named.group(1)) == "allow"
                                 else np.inf)
                node.attr["value"].tensor.CopyFrom(tensor_util.make_tensor_proto(new))
                continue
            new = values.get(value.tobytes())
            if new is None:
                continue
            if lists.list_of(named.group(1)) not in ("allow", "infer", "clear"):
                new = exact[value.tobytes()]
            node.attr["value"].tensor.CopyFrom(tensor_util.make_tensor_proto(new))
    return copy


def with_salt(graph_def, salt: int) -> graph_pb2.GraphDef:
    """A copy of a GraphDef traced under ``rounding_noise(s)`` (random signs) that is
    the trace under ``rounding_noise(salt)``: only the seeds' second word differs
    between samples, and a noisy trace costs 15 times a plain one (4000217: 4 s)."""
    copy = graph_pb2.GraphDef()
    copy.CopyFrom(graph_def)
    for nodes in [copy.node] + [f.node_def for f in copy.library.function]:
        for node in nodes:
            if node.op == "Const" and _SEED_NAME.search(node.name):
                seed = tensor_util.MakeNdarray(node.attr["value"].tensor).copy()
                seed[1] = salt
                node.attr["value"].tensor.CopyFrom(tensor_util.make_tensor_proto(seed))
    return copy


_SEED_NAME = re.compile(r"progen_seed__")
_NOISE_NAME = re.compile(r"progen_noise__(\w+?)__")
_RANGE_NAME = re.compile(r"progen_range__Cast__")
