"""Reason kinds: the structured name of *why* a node was converted or kept.

Every decision carries a human sentence (``reason``) and one of these kinds
(``kind``). The sentence is for people; the kind is what reports group by
(``RewriteReport.kept_fp32``), what the HTML page colours by and what tests
assert on. The kept-float32 strings are the ones ``tfamp inspect`` has always
printed ("deny list", "no 16-bit kernel", ...), so its summaries read the same.
"""

from __future__ import annotations

# The node attribute tfamp's loss-scale code sets on every op it creates
# (``keras/scale_update.loss_scale_ops``); such nodes are kept float32.
LOSS_SCALE_ATTR = "_tfamp_loss_scale"

# -- converted to 16-bit ------------------------------------------------------
KIND_ALLOW = "allow list"  # on the allow list: always converted
KIND_BETWEEN = "between 16-bit ops"  # infer/clear on a path between 16-bit ops
KIND_AFTER_16BIT = "after a 16-bit op"  # infer op right after one, saving casts
KIND_NEXT_TO_16BIT = "next to a 16-bit op"  # clear op following a neighbour
KIND_CAST_RETARGETED = "Cast retargeted"  # an existing Cast meets 16-bit directly
KIND_COMBINES_STATISTICS = "combines statistics"  # LayerNorm's full-size scale/shift
KIND_BOUNDED_FOR_16BIT = "bounded, read in 16-bit"  # exp(x - max(x)) for a 16-bit matmul
KIND_ACCUMULATES_FP32 = "accumulates in float32"  # a GPU Mean / XLA gradient Sum reading 16-bit
KIND_BOUNDARY = "boundary group"  # a loop/call/TensorList value 16-bit on every side

# -- kept float32 -------------------------------------------------------------
KIND_DENY_LIST = "deny list"  # on the deny list
KIND_DOWNSTREAM_OF_DENY = "downstream of a deny op"  # deny spread to it
KIND_STATISTIC = "float32 statistic"  # a small tensor computed from a float32 reduction
KIND_CENTRED = "centred on a float32 statistic"  # x - mean, kept with the mean
KIND_VARIABLE_UPDATE = "a variable's new value"  # old * m + x * (1 - m), read to assign
KIND_OFF_DEVICE = "placed off the target device"  # pinned to another device type (CPU)
KIND_NO_KERNEL = "no 16-bit kernel"  # OpDef or (its device's) kernels refuse 16-bit
KIND_USER_OVERRIDE = "user override"  # name matches AmpConfig.keep_fp32
KIND_POSITIONS = "positions and constants"  # allow op on no float data: RoPE's angles
KIND_TIED_VOCABULARY = "tied output layer"  # bfloat16: hidden @ table^T, table looked up too
KIND_BEYOND_RANGE = "reads a value past the 16-bit range"  # a mask's -1e9 sentinel
KIND_LOSS_SCALE = "loss-scale machinery"  # seed, unscaling, finiteness check, scale update
KIND_GRAPH_OUTPUT = "graph output"  # callers rely on the output's dtype
KIND_VARIABLE = "variable op"  # variables (resource or ref) and their reads
KIND_FUNCTION_CALL = "function call"  # a call keeps its callee's signature
KIND_TENSOR_LIST = "TensorList element type"  # element_dtype kept with its whole list
KIND_TF1_FRAME = "TF1 loop frame"  # a TF1 loop frame kept float32 as a whole
KIND_NO_NEIGHBOUR = "no 16-bit neighbour"  # infer/clear with nothing 16-bit around
KIND_RUN_TIME_SCALE = "scaled by a run-time value"  # e.g. gradient unscaling: float32
KIND_FEWER_BYTES = "fewer bytes in float32"  # next to 16-bit, but converting moves more bytes
KIND_DATA_BOUND = "dtype bound to data"  # Const, PyFunc, ...: see oplists.DATA_BOUND_OPS
KIND_INVALID_GRAPH = "would make an invalid graph"  # the pass's self-check pinned it
KIND_UNKNOWN_INPUT = "input of unknown type"  # an input's producer has no OpDef
KIND_UNKNOWN_OP = "unknown op"  # no OpDef: left exactly as it is
KIND_UNLISTED = "unlisted"  # on no list: never converted
KIND_NO_FLOAT = "no float math"  # no float32 tensors at all
KIND_OTHER = "other"  # only from reports written before kinds were recorded

CONVERTED_KINDS = frozenset({
    KIND_ALLOW, KIND_BETWEEN, KIND_AFTER_16BIT, KIND_NEXT_TO_16BIT, KIND_CAST_RETARGETED,
    KIND_BOUNDARY, KIND_ACCUMULATES_FP32, KIND_COMBINES_STATISTICS, KIND_BOUNDED_FOR_16BIT,
})
