"""The allow / infer / deny / clear op lists, as data, one set per 16-bit target.

The defaults are the lists TensorFlow 2.21's grappler AMP pass uses: its CUDA
float16 lists (``AutoMixedPrecisionListsFp16`` in CUDA mode) and its oneDNN
bfloat16 lists (``AutoMixedPrecisionListsMkl``). Op names are facts taken from
that public source; the structure here is tfamp's own.

What each list means:

* allow: numerically safe in 16-bit and performance-critical; always converted.
* infer: safe in 16-bit, but made unsafe by an upstream deny op; converted only
  when it sits between 16-bit ops (or right after one, where that saves a cast).
* deny: numerically dangerous in 16-bit, and the danger is visible downstream
  (in Exp -> Add, the Add is unsafe because of the Exp); always float32.
* clear: no numerical effect of its own; follows its 16-bit neighbours.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

LIST_NAMES = ("allow", "infer", "deny", "clear")

# Both targets share these clear ops (grappler's ``AddTensorListOps``). tfamp
# never changes a TensorList's element type (see coloring.FIXED_TYPE_ATTRS), so
# for them "clear" only means "does not make a neighbour unsafe".
_TENSOR_LIST_OPS = frozenset({
    "TensorListConcat", "TensorListConcatLists", "TensorListConcatV2",
    "TensorListGather", "TensorListGetItem", "TensorListPopBack",
    "TensorListPushBack", "TensorListPushBackBatch", "TensorListFromTensor",
    "TensorListScatter", "TensorListScatterV2",
    "TensorListScatterIntoExistingList", "TensorListSetItem",
    "TensorListSplit", "TensorListStack",
})

_COMMON_CLEAR = frozenset({
    "Abs", "ArgMax", "ArgMin", "BatchToSpace", "BatchToSpaceND", "BroadcastTo",
    "Ceil", "CheckNumerics", "ClipByValue", "Concat", "ConcatV2",
    "DepthToSpace", "DynamicPartition", "DynamicStitch", "EnsureShape",
    "Enter", "Equal", "Exit", "ExpandDims", "Fill", "Floor", "Gather",
    "GatherNd", "GatherV2", "Greater", "GreaterEqual", "Identity",
    "IdentityN", "IsFinite", "IsInf", "IsNan", "Less", "LessEqual", "Max",
    "MaxPool", "MaxPool3D", "MaxPool3DGrad", "MaxPool3DGradGrad",
    "MaxPoolGrad", "MaxPoolGradGrad", "MaxPoolGradGradV2", "MaxPoolGradV2",
    "MaxPoolV2", "Maximum", "Merge", "Min", "Minimum", "MirrorPad",
    "MirrorPadGrad", "Neg", "NextIteration", "NotEqual", "OnesLike", "Pack",
    "Pad", "PadV2", "PreventGradient", "Rank", "Relu", "Relu6", "Relu6Grad",
    "ReluGrad", "Reshape", "ResizeNearestNeighbor",
    "ResizeNearestNeighborGrad", "Reverse", "ReverseSequence", "ReverseV2",
    "Round", "Select", "SelectV2", "Shape", "ShapeN", "Sign", "Slice",
    "Snapshot", "SpaceToBatch", "SpaceToBatchND", "SpaceToDepth", "Split",
    "SplitV", "Squeeze", "StopGradient", "StridedSlice", "StridedSliceGrad",
    "Switch", "Tile", "TopK", "TopKV2", "Transpose", "Unpack", "Where",
    "ZerosLike",
}) | _TENSOR_LIST_OPS

_FLOAT16_ALLOW = frozenset({
    "BatchMatMul", "BatchMatMulV2", "BlockLSTM", "BlockLSTMGrad",
    "BlockLSTMGradV2", "BlockLSTMV2", "Conv2D", "Conv2DBackpropFilter",
    "Conv2DBackpropInput", "Conv3D", "Conv3DBackpropFilter",
    "Conv3DBackpropFilterV2", "Conv3DBackpropInput", "Conv3DBackpropInputV2",
    "CudnnRNN", "CudnnRNNBackprop", "CudnnRNNBackpropV2", "CudnnRNNBackpropV3",
    "CudnnRNNV2", "CudnnRNNV3", "DepthwiseConv2dNative",
    "DepthwiseConv2dNativeBackpropFilter", "DepthwiseConv2dNativeBackpropInput",
    "Einsum", "FastUnsortedSegmentMax", "FusedConv2DBiasActivation",
    "FusedSparseConvGpuV2", "GRUBlockCell", "GRUBlockCellGrad", "LSTMBlockCell",
    "LSTMBlockCellGrad", "MatMul", "Mha", "MhaV2", "Pmlp", "Tmlp", "TmlpV2",
    "TmlpV3",
})

_FLOAT16_INFER = frozenset({
    "Add", "AddN", "AddV2", "AvgPool", "AvgPool3D", "AvgPool3DGrad",
    "AvgPoolGrad", "BiasAdd", "BiasAddGrad", "BiasAddV1", "Elu", "EluGrad",
    "Erf", "Erfc", "FloorDiv", "FusedBatchNormGradV2", "FusedBatchNormGradV3",
    "FusedBatchNormV2", "FusedBatchNormV3", "Inv", "LeakyRelu",
    "LeakyReluGrad", "Log", "Log1p", "LogSoftmax", "Mul", "Prod", "RealDiv",
    "Reciprocal", "Selu", "SeluGrad", "Sigmoid", "SigmoidGrad", "Softmax",
    "Softplus", "SoftplusGrad", "Softsign", "SoftsignGrad", "Sqrt", "Sub",
    "Tanh", "TanhGrad", "_FusedBatchNormEx",
})

_FLOAT16_DENY = frozenset({
    "Exp", "Expm1", "L2Loss", "Mean", "Pow", "SaveV2",
    "SoftmaxCrossEntropyWithLogits", "SparseSoftmaxCrossEntropyWithLogits",
    "Sum",
})

_BFLOAT16_ALLOW = frozenset({
    "BatchMatMul", "BatchMatMulV2", "Conv2D", "Conv2DBackpropFilter",
    "Conv2DBackpropInput", "Conv3D", "Conv3DBackpropFilterV2",
    "Conv3DBackpropInputV2", "DepthwiseConv2dNative",
    "DepthwiseConv2dNativeBackpropFilter", "DepthwiseConv2dNativeBackpropInput",
    "Einsum", "FusedPadConv2D", "MatMul",
})

# Reductions float16 denies for its range only: bfloat16 has float32's exponent
# range, so they move from deny to infer there (under XLA the coloring still
# accumulates their statistics in float32: coloring._xla_statistics), and a few
# more elementwise ops join.
RANGE_DENIED_REDUCTIONS = frozenset({"Mean", "Sum"})
_BFLOAT16_INFER = _FLOAT16_INFER | RANGE_DENIED_REDUCTIONS | {
    "Rsqrt", "Square", "SquaredDifference",
}

_BFLOAT16_DENY = _FLOAT16_DENY - RANGE_DENIED_REDUCTIONS

# grappler's oneDNN list also has While and StatelessWhile here; tfamp leaves
# them out because changing a loop's carried dtype without its body is exactly
# how grappler's bf16 pass produced an invalid GRU graph. Loop bodies are
# rewritten as functions in their own right instead.
_BFLOAT16_CLEAR = _COMMON_CLEAR | {
    "ResizeBilinear", "ScatterNd",
}

_FLOAT16_CLEAR = _COMMON_CLEAR | {"OneHot", "Size"}


@dataclasses.dataclass(frozen=True)
class OpLists:
    """The four op lists for one 16-bit target.

    Build changed copies with ``with_changes``; a user's names are added to or
    removed from the defaults, never replace them.
    """

    allow: frozenset[str]
    infer: frozenset[str]
    deny: frozenset[str]
    clear: frozenset[str]

    def __post_init__(self) -> None:
        seen: dict[str, str] = {}
        for list_name in LIST_NAMES:
            for op in getattr(self, list_name):
                if op in seen:
                    raise ValueError(
                        f"op {op!r} is on both the {seen[op]!r} and the "
                        f"{list_name!r} list; an op belongs to one list at "
                        f"most. Remove it from one of them, e.g. "
                        f"{seen[op]}_remove=[{op!r}].")
                seen[op] = list_name
        # The pass asks list_of for every node, often more than once: one dict
        # lookup instead of four set lookups (not a field: no effect on ==, repr).
        object.__setattr__(self, "_list_by_op", seen)

    def list_of(self, op: str) -> str:
        """Returns 'allow', 'infer', 'deny', 'clear' or 'unlisted' for `op`."""
        return self._list_by_op.get(op, "unlisted")

    def with_changes(self, **changes: Iterable[str]) -> OpLists:
        """Returns a copy with ops added to or removed from lists.

        Args:
          **changes: keyword arguments named ``<list>_add`` or ``<list>_remove``
            (e.g. ``allow_add=["Conv2D"]``, ``deny_remove=["Sum"]``), each an
            iterable of op names. An op added to one list is taken off the
            list it was on before, so moving an op is a single change.

        Example:
          >>> lists = DEFAULT_OP_LISTS["float16"].with_changes(deny_add=["Tanh"])
          >>> lists.list_of("Tanh")
          'deny'
        """
        valid = {f"{n}_{verb}" for n in LIST_NAMES for verb in ("add", "remove")}
        unknown = sorted(set(changes) - valid)
        if unknown:
            raise TypeError(
                f"with_changes() got unexpected argument(s) {unknown}; "
                f"expected names of the form <list>_add or <list>_remove, "
                f"one of {sorted(valid)}.")
        lists = {n: set(getattr(self, n)) for n in LIST_NAMES}
        for list_name in LIST_NAMES:
            for op in _as_names(changes.get(f"{list_name}_remove", ()),
                                f"{list_name}_remove"):
                lists[list_name].discard(op)
        for list_name in LIST_NAMES:
            added = _as_names(changes.get(f"{list_name}_add", ()),
                              f"{list_name}_add")
            for op in added:
                for other in LIST_NAMES:
                    lists[other].discard(op)
            lists[list_name].update(added)
        # Two lists adding the same op is ambiguous: reject it.
        adds = {n: set(_as_names(changes.get(f"{n}_add", ()), f"{n}_add"))
                for n in LIST_NAMES}
        for i, first in enumerate(LIST_NAMES):
            for second in LIST_NAMES[i + 1:]:
                both = sorted(adds[first] & adds[second])
                if both:
                    raise ValueError(
                        f"op(s) {both} are added to both the {first!r} and "
                        f"the {second!r} list; an op belongs to one list at "
                        f"most. Add each op to one list only.")
        return OpLists(**{n: frozenset(v) for n, v in lists.items()})

    def all_ops(self) -> frozenset[str]:
        return self.allow | self.infer | self.deny | self.clear


def _as_names(value: Iterable[str], argument: str) -> list[str]:
    if isinstance(value, str):
        raise TypeError(
            f"{argument} expects a list of op names, received the string "
            f"{value!r}; pass [{value!r}] (or split a comma-separated string "
            f"first).")
    names = list(value)
    for name in names:
        if not isinstance(name, str) or not name:
            raise TypeError(
                f"{argument} expects non-empty op name strings, received "
                f"{name!r}.")
    return names


DEFAULT_OP_LISTS: Mapping[str, OpLists] = {
    "float16": OpLists(allow=_FLOAT16_ALLOW, infer=_FLOAT16_INFER,
                       deny=_FLOAT16_DENY, clear=_FLOAT16_CLEAR),
    "bfloat16": OpLists(allow=_BFLOAT16_ALLOW, infer=_BFLOAT16_INFER,
                        deny=_BFLOAT16_DENY, clear=_BFLOAT16_CLEAR),
}

# Reductions that accumulate: their output is a statistic (a mean, a sum, a
# norm) of their first input, which is much larger. On the deny list they
# compute in float32 as any deny op does, but when their output is a small
# statistic, float32 spreads from it only through ops whose results are as
# small (see coloring._BodyColoring._propagate_deny): the big element-wise ops
# that read a statistic (normalise, scale, shift) are decided on their own and
# cast the small statistic, not the big activation.
STATISTIC_REDUCTIONS = frozenset({
    "Mean", "Sum", "Prod", "EuclideanNorm", "L2Loss",
})

# Ops that read rows of a table (their first input) by index: an embedding
# lookup, on a variable's read (GatherV2) or on its handle (ResourceGather).
EMBEDDING_LOOKUPS = frozenset({"Gather", "GatherV2", "ResourceGather"})

# Matrix products that can read an embedding table as a weight: a tied output
# layer computes hidden @ table^T (keras-hub's ReversibleEmbedding), and its
# input gradient d(logits) @ table (tied_output.tied_vocabulary_products).
TABLE_PRODUCTS = frozenset({"MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum"})

# Ops that pass a weight on with its values unchanged (a tied layer reads its
# table transposed, and Tensordot reshapes it).
WEIGHT_VIEWS = frozenset({
    "Identity", "Snapshot", "Transpose", "Reshape", "ExpandDims", "Squeeze", "Cast",
})

# Ops that read only a tensor's shape, not its data.
METADATA_OPS = frozenset({"Shape", "ShapeN", "Rank", "Size"})

# Kernels that read an input twice in training (is_training): a fused batch
# norm reads x for its statistics, then again to normalise (cuDNN's spatial
# mode; the CPU kernel too), and its gradient reads dy and x twice. op ->
# input positions; the traffic estimate counts a second read of those.
TWO_PASS_INPUTS = {
    "FusedBatchNorm": (0,), "FusedBatchNormV2": (0,), "FusedBatchNormV3": (0,),
    "FusedBatchNormGrad": (0, 1), "FusedBatchNormGradV2": (0, 1),
    "FusedBatchNormGradV3": (0, 1),
}

# Fused normalisations whose "U" outputs (1, 2: a training batch's mean and
# variance, always float32) are statistics of their input 0, as a Mean's
# result is: what reads them follows the same rules (coloring._propagate_deny).
FUSED_NORMALISATION_OPS = frozenset({"FusedBatchNormV2", "FusedBatchNormV3"})

# Ops whose result can outgrow their input's range: a Mean of their output
# (a variance) is no more bounded than a Sum is.
GROWING_OPS = frozenset({"Square", "SquaredDifference", "Pow", "Exp", "Expm1"})

# Ops that only copy or rearrange values (a statistic broadcast to a big
# tensor keeps its range through them).
BROADCAST_OPS = frozenset({
    "Tile", "BroadcastTo", "Reshape", "ExpandDims", "Squeeze", "Identity",
})

# Ops whose result is bounded whatever statistic they read: rsqrt(var + eps)
# is at most 1/sqrt(eps) (31.6 for Keras's eps of 1e-3).
BOUNDING_OPS = frozenset({"Rsqrt"})

# Ops through which a constant's magnitude reaches what reads them: they copy,
# pick or combine values without bounding them. A constant past the 16-bit
# range (a mask's sentinel: Keras's softmax picks -1e9 where the mask is
# False, a hand-written attention adds (1 - mask) * -1e9) becomes inf in
# 16-bit, and a softmax row that is all -inf (a padded query's) is NaN where
# float32's is finite; so an op that reads such a value stays float32
# (value_ranges.sentinels, found by the program generator, 25100146). Only the
# float inputs are followed (a Fill's dims, a Tile's multiples are not values);
# only float constants count (an integer one cast to float is not seen).
SENTINEL_CARRIERS = frozenset({
    "Identity", "Snapshot", "Cast", "Neg", "Mul", "Add", "AddV2", "Sub", "Maximum",
    "Minimum", "Select", "SelectV2", "Fill", "Tile", "BroadcastTo", "Reshape", "ExpandDims",
    "Squeeze", "Transpose", "ConcatV2", "Pack", "StridedSlice", "GatherV2",
})

# Ops whose result grows without bound as their input nears 0: in float16 one
# stays a deny op unless a constant epsilon keeps its input away from 0 far
# enough (value_ranges.rsqrt_overflow: rsqrt(x + 1e-12) reaches 1e6 for x = 0).
GROWING_INVERSES = frozenset({"Rsqrt"})
# Their gradients (input 0: the inverse's own output; input 1: the gradient it
# receives).
INVERSE_GRADIENTS = frozenset({"RsqrtGrad"})

# Ops that centre a tensor on a statistic (x - mean). Where one operand is a
# float32 statistic and the result is big, they stay float32: in 16-bit the
# statistic would be rounded once and every element of the result would carry
# the same error, which sums that should cancel (the variance gradient's
# sum of x - mean, then a weight gradient) add up N times instead of sqrt(N).
CENTRING_OPS = frozenset({"Sub", "SquaredDifference"})

# Statistic reductions whose GPU kernel accumulates a float16 input in float32
# and whose result lies within the range of its input, so they may read a
# float16 input as it is (TensorFlow's GPU Mean kernel for half sums in float
# and divides in float; XLA accumulates every 16-bit reduction in float32).
# Sum is not here: TensorFlow's GPU Sum kernel for half accumulates in half,
# and a sum can leave float16's range where its terms do not.
FLOAT32_ACCUMULATING_ON_GPU = frozenset({"Mean"})

# Reductions that XLA accumulates in float32 whatever their 16-bit input (its
# TensorFlow lowering sums half and bfloat16 in float32 and rounds the result
# once), but whose result can leave float16's range where no term does. Under
# XLA one may read a float16 input as it is where its result is a weight's
# gradient (coloring._read_16bit_statistics, coloring._read_cast_products): a
# 16-bit MatMul or convolution weight gradient is rounded the same way, and an
# overflow there is one the loss scale sees and answers. (TensorFlow's XLA
# lowering of BiasAddGrad converts its input to float32, reduces and rounds
# once, as its Sum does.)
FLOAT32_ACCUMULATING_UNDER_XLA = frozenset({"Sum", "BiasAddGrad"})

# TensorFlow kernels whose 16-bit versions lose far more than a rounding, and
# why; such an op stays float32 in a body TensorFlow's kernels run
# (coloring._attr_block_of). Elu and Selu evaluate ``exp(x) - 1`` in the 16-bit
# type (the one Eigen expression of their CPU and GPU functors): just below
# zero exp(x) rounds to 1 and the difference to 0, a relative error of 100%
# for x in (-2.4e-4, 0) in float16 and (-3.9e-3, 0) in bfloat16, and of 2% (18%
# in bfloat16) at x = -0.01 (measured: BUILD_NOTES.md, session 21; found by the
# program generator, 22000066). XLA lowers both with expm1, computed in
# float32 for a 16-bit type (within a rounding of the exact value), so a body
# XLA compiles keeps them 16-bit.
INEXACT_16BIT_KERNELS: Mapping[str, str] = {
    "Elu": "computes exp(x) - 1 in the 16-bit type, so just below 0 the result is 0",
    "Selu": "computes exp(x) - 1 in the 16-bit type, so just below 0 the result is 0",
}

# Ops whose result, rounded to bfloat16, is as close to the exact one when they
# compute from inputs rounded to bfloat16 as when they compute in float32 and
# round (a product: three roundings' error instead of one, no cancellation, and
# bfloat16 has float32's range, so nothing overflows or underflows that float32
# would keep). Under XLA a deny op's downstream product whose readers all read
# bfloat16 computes in bfloat16 (coloring._read_cast_products). Not float16:
# there an input rounded before the product (softmax - onehot before the loss
# scale multiplies it) can leave float16's range where the product would not.
BFLOAT16_SAFE_PRODUCTS = frozenset({"Mul"})

# Reductions that copy their input when they keep its size (they reduce no
# axis, or only axes of one element): there they are clear ops, whatever their
# list says (value_ranges.copies). TensorFlow's gradient of a
# broadcasting op (BatchMatMulV2, AddV2) sums over the axes it broadcast, often
# none: a deny Sum there would hold a whole activation gradient in float32.
SIZE_KEEPING_COPIES = frozenset({"Sum", "Mean", "Max", "Min", "Prod"})

# Ops whose result is never negative, whatever their input. The exponential of
# the negation of one of them lies in (0, 1]: it cannot overflow float16 and
# only underflows to 0 where the true value is below 6e-8
# (value_ranges.bounded_exp: an infer op there instead of a deny one). TensorFlow's
# gradients of erf and erfc (GELU's backward) are exp(-square(x)).
NON_NEGATIVE_OPS = frozenset({"Square", "Abs", "Relu", "Relu6", "Exp", "Sigmoid",
                              "Softplus", "Sqrt", "Rsqrt", "Softmax"})

# Ops whose dtype is bound to their data: the type attribute describes a value
# that already exists elsewhere (a typed constant, a feed, a stored tensor, what a
# Python callable returns), so retyping the node would misread that value. They
# stay as they are whatever the lists say. Op -> why its dtype is bound.
DATA_BOUND_OPS: Mapping[str, str] = {
    "Const": "its value attribute is a typed tensor",
    "HostConst": "its value attribute is a typed tensor",
    "ImmutableConst": "its dtype describes a memory-mapped file",
    "Placeholder": "its dtype is the fed value's",
    "PlaceholderV2": "its dtype is the fed value's",
    "PlaceholderWithDefault": "its dtype is the fed value's",
    "_Arg": "its dtype is the caller's argument's",
    "_Retval": "its dtype is what the caller receives",
    "VarHandleOp": "its dtype is the variable's",
    "ReadVariableOp": "its dtype is the variable's",
    "VariableV2": "its dtype is the variable's",
    "Variable": "its dtype is the variable's",
    "PyFunc": "Tout is what the Python callable returns",
    "PyFuncStateless": "Tout is what the Python callable returns",
    "EagerPyFunc": "Tout is what the Python callable returns",
    "OptionalFromValue": "it must match what OptionalGetValue reads back",
    "OptionalGetValue": "it must match what was stored in the optional",
    "IteratorGetNext": "its types are the dataset's",
    "IteratorGetNextSync": "its types are the dataset's",
    "IteratorGetNextAsOptional": "its types are the dataset's",
    "DatasetToSingleElement": "its types are the dataset's",
    "Bitcast": "it reinterprets bits: another type is another value",
    "DecodeRaw": "out_type says how to read the bytes",
    "ParseTensor": "out_type must match the serialized tensor",
    "RestoreV2": "its dtypes are the checkpoint's",
    "Restore": "its dtype is the checkpoint's",
    "RestoreSlice": "its dtype is the checkpoint's",
    "StackPopV2": "elem_type must match what was pushed",
    "TensorArrayReadV3": "its dtype must match what was written",
    "TensorArrayGatherV3": "its dtype must match what was written",
    "TensorArrayConcatV3": "its dtype must match what was written",
    "QueueDequeueV2": "its types are the queue's",
    "QueueDequeueManyV2": "its types are the queue's",
    "_Recv": "its type is the matching _Send's",
    "_HostRecv": "its type is the matching _Send's",
    "_Send": "its type is the matching _Recv's",
}

# Matrix multiplies and convolutions, forward and backprop: the compute-heavy
# ops mixed precision is for. What the FLOP share counts (inspect/flops.py) and
# what the report's summary line names first (report.RewriteReport.summary_line).
MATRIX_OPS = frozenset({
    "MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum",
    "Conv2D", "Conv2DBackpropInput", "Conv2DBackpropFilter", "Conv3D",
    "Conv3DBackpropInputV2", "Conv3DBackpropFilterV2", "DepthwiseConv2dNative",
    "DepthwiseConv2dNativeBackpropInput", "DepthwiseConv2dNativeBackpropFilter",
})

# -- what a fusing compiler (XLA) does with each op: see rewrite/runtime_cost.py --

# A fused batch normalisation and its gradient: one cuDNN kernel on the executor,
# but XLA lowers them to BatchNormTraining / BatchNormGrad, which XLA:GPU expands
# into reductions and element-wise ops that fuse with their neighbours (the H100
# programs of ResNet-50, MobileNetV2 and EfficientNetB0: BUILD_NOTES.md, session
# 26). So under XLA they are reductions, not library kernels.
FUSED_BATCH_NORM_OPS = frozenset({
    "FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3", "FusedBatchNormGrad",
    "FusedBatchNormGradV2", "FusedBatchNormGradV3",
})

# Ops that run as a library kernel (cuDNN, cuBLAS) or a kernel of their own
# under XLA: element-wise neighbours do not fuse into them, so their inputs and
# outputs are written to and read from memory (materialised). Calls and loops
# are boundaries too (runtime_cost treats every op with a called function so).
LIBRARY_KERNEL_OPS = (_FLOAT16_ALLOW | _BFLOAT16_ALLOW | frozenset({
    "Conv2DBackpropInputV2",
    "Gather", "GatherV2", "GatherNd", "ResourceGather", "ScatterNd",
    "TensorScatterUpdate", "TensorScatterAdd", "UnsortedSegmentSum",
    "SparseSegmentSum", "SparseSegmentMean", "TopK", "TopKV2", "Cumsum", "Cumprod",
    "CudnnRNN", "CudnnRNNV3", "MatrixInverse", "Cholesky", "Qr", "Svd",
})) - FUSED_BATCH_NORM_OPS

# Reductions: a fusing compiler fuses their element-wise producers into them
# (an input fusion) but writes their result to memory. Pools and the softmax
# family reduce too.
REDUCTION_KERNEL_OPS = STATISTIC_REDUCTIONS | frozenset({
    "Max", "Min", "All", "Any", "ArgMax", "ArgMin", "BiasAddGrad", "Softmax",
    "LogSoftmax", "SoftmaxCrossEntropyWithLogits",
    "SparseSoftmaxCrossEntropyWithLogits", "MaxPool", "MaxPoolV2", "MaxPoolGrad",
    "MaxPoolGradV2", "AvgPool", "AvgPoolGrad", "MaxPool3D", "AvgPool3D",
    "MaxPool3DGrad", "AvgPool3DGrad", "Bincount", "SegmentSum",
}) | FUSED_BATCH_NORM_OPS

# Ops that launch no kernel of their own on a GPU: values that already sit in
# memory (weights, constants, fed values) and host-side bookkeeping.
NO_KERNEL_OPS = frozenset({
    "Const", "HostConst", "Placeholder", "PlaceholderWithDefault", "_Arg", "_Retval",
    "VarHandleOp", "ReadVariableOp", "VariableV2", "Variable", "NoOp",
})

# Ops that only move, select or repeat the elements of their one float input
# (the other inputs are indices, shapes or permutations). Casting to 16-bit
# commutes with them exactly, so ``tfamp export`` stores a weight in 16-bit
# when it reaches 16-bit ops only through these and a Cast, and retypes them.
VALUE_COPIES = frozenset({
    "Identity", "Snapshot", "Reshape", "Transpose", "Squeeze", "ExpandDims",
    "Gather", "GatherV2", "GatherNd", "StridedSlice", "Slice", "Tile", "BroadcastTo",
})
