"""Which batch normalisations are one FusedBatchNormV3.

Keras 3's ``BatchNormalization`` (and tf_keras's with ``fused=False``) computes a
training batch's statistics with ``tf.nn.moments`` and normalises with
``tf.nn.batch_normalization``, as separate ops::

    mean = Mean(x, [0, 1, 2], keep_dims)            # moments
    var  = Mean(SquaredDifference(x, StopGradient(mean)), [0, 1, 2], keep_dims)
    inv  = Rsqrt(view(var) + eps) * gamma           # small, per channel (no gamma:
    y    = x * inv + (beta - view(mean) * inv)      #   the Rsqrt; no beta: -m * inv)

On TensorFlow's executor every one of them is a kernel, and in mixed precision
the two reductions must read x in float32 (a Cast of the 16-bit activation) and
the squares stay float32 (they overflow float16 past |x - mean| = 256). One
``FusedBatchNormV3(x, gamma, beta, is_training=True)`` computes the same y and
the same statistics: it reads x as it is (16-bit once coloured: the GPU kernel,
cuDNN's, and the CPU kernel accumulate in float32, ``U``) and writes 16-bit y.
The edit, made before colouring on the float32 graph:

* the ``FusedBatchNormV3`` node (named ``<y's node>/tfamp_batch_norm``) reads x,
  gamma and beta (reshaped to ``[C]``);
* y's node becomes an ``Identity`` of its output 0, so every reader of y reads it;
* the ``Mean`` nodes of the mean and the variance become ``Reshape``s of its
  batch mean and of its batch variance (which the kernel returns with Bessel's
  correction, n / (n - 1): multiplied back by (n - 1) / n), so everything else
  that reads the statistics (the moving averages, the gradient the tape built
  from them) reads the same values;
* the squares and ``x * inv`` (and ``beta - mean * inv`` and ``mean * inv``
  where nothing else reads them) are removed: nothing reads them any more.

The gradient is untouched: the tape computed it from the ops above, and it
reads x and the small per-channel tensors, which are all still there with the
same values. The statistics are the same sums in another order: equal to
float32 rounding, not bit-identical.

On TensorFlow's executor the fused op is one cuDNN kernel that writes y too.
Under XLA (Keras 3's ``jit_compile``) TensorFlow lowers it to BatchNormTraining,
which XLA expands into one pass of float32 sums (of x and of x squared) and the
element-wise normalisation: fewer kernels than the two passes of
``tf.nn.moments``. There the edit is smaller, the *statistics* edit:

* only the statistics come from the fused op, and y stays the pattern's own
  ``x * inv + shift``, which XLA fuses into the ops that read y (and recomputes
  in the backward from x, which the gradient keeps anyway). With y from the
  fused op, XLA kept more activations alive until the backward: EfficientNetB0's
  float16 step held 2.28 GB of temp memory where it holds 2.08 GB now, and every
  conv net's program moves fewer bytes (it launches a few more kernels, the
  shift's below: still 4-9% fewer than Keras's policy; BUILD_NOTES.md, session 27);
* XLA computes the variance as E[x^2] - E[x]^2, which cancels where the mean is
  large against the spread (a channel with mean 300 and spread 1: 48% error in
  float32; 0.6% at mean 30). The fused op reads x - s instead, s a value of x in
  each channel (x[0, H/2, W/2, :], behind a StopGradient): the variance does not
  change, the cancellation is that of (mean - s) against the spread, and the
  mean is the fused op's plus s;
* only in a graph that holds x's gradient already (a Keras step): the fused op
  has no gradient for its statistics, and y still reads them.

Either edit only where the shapes say it: x is a float32 4-D NHWC tensor with a
known channel count (the batch and spatial sizes may be open: (n - 1) / n is
then computed from x's size where the step runs), the reductions are over axes
0, 1 and 2 with ``keep_dims``, inv, gamma, beta and the mean broadcast per
channel, gamma and beta (where the layer has them) are variables or constants
(read through views), eps is a positive scalar constant (TensorFlow hands it to
cuDNN as it is, whose minimum, CUDNN_BN_MIN_EPSILON, is 0 since cuDNN 7.5: the
1.001e-5 floor of tf_keras's fused layer is older), no node of the pattern has a
control input or is waited on where it would be removed, the squares and
``x * inv`` are read by nothing else (the full edit removes them), and, in a
graph that does not hold x's gradient already (a forward that TensorFlow
differentiates later, through the fused op's gradient, which has none for the
statistics: the full edit only), the batch statistics are used only by the
pattern and the moving averages (``_statistics_contained``).
Top graph only (where a Keras step's layers run), and not one with TF1 loops.

``fuse_batch_norms(graph_def, view, shapes, outputs, runtime) -> EditedGraph | None``:
pure; None when nothing changes. Its ``made`` rows are (body, y's node, now an
Identity; the FusedBatchNormV3 node), reported as edit "fused", op "BatchNorm";
under XLA (body, the batch mean's node, now the fused op's mean plus s; the
FusedBatchNormV3 node), edit "fused statistics".
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from tensorflow.core.framework import attr_value_pb2, graph_pb2, types_pb2
from tensorflow.python.framework import tensor_util

from tfamp.oplists import METADATA_OPS
from tfamp.rewrite import reasons as rk
from tfamp.rewrite import scopes
from tfamp.rewrite.graph import Body, GraphView, TensorRef, scalar_constant
from tfamp.rewrite.node_edits import (
    TF1_FRAME_OPS,
    EditedGraph,
    add_output_shape,
    bool_attr,
    rewrite_node,
    type_attr,
)
from tfamp.rewrite.shapes import TensorShapes

_SUFFIX = "/tfamp_batch_norm"
_FLOAT, _INT32, _INT64 = (type_attr(t) for t in (
    types_pb2.DT_FLOAT, types_pb2.DT_INT32, types_pb2.DT_INT64))
_VIEWS = frozenset({"Identity", "Reshape", "Squeeze", "ExpandDims"})
_SOURCES = frozenset({"ReadVariableOp", "Const", "Placeholder"})
_ADDS = frozenset({"Add", "AddV2"})
# Readers where a use of the batch statistics ends harmlessly (_statistics_contained).
_CONTAINED_READERS = METADATA_OPS | {"StopGradient"}
_MAX_STATISTIC_USES = 64


@dataclasses.dataclass(frozen=True)
class _Match:
    """The nodes of one moments + batch_normalization pattern (module doc)."""

    x: str  # x's input string
    shape: tuple[int, int, int, int]  # N, H, W, C
    mean: str  # Mean of x
    variance: str  # Mean of the squares
    squares: str  # SquaredDifference(x, StopGradient(mean))
    normalised: str  # x * inv
    output: str  # x * inv + shift
    shift: str  # beta - mean * inv, or -mean * inv
    shifted_mean: str  # mean * inv, or -mean
    scale: str | None  # gamma's input string (None: no gamma, scale=False)
    offset: str | None  # beta's input string (None: no beta, center=False)
    epsilon: float
    removable: tuple[str, ...]  # nodes nothing reads once fused
    # (node, input index) of the ops that read only the shape of the squares or
    # of x * inv (a gradient with open sizes): x has that shape, they read x
    shape_readers: tuple[tuple[str, int], ...]


def fuse_batch_norms(graph_def: graph_pb2.GraphDef, view: GraphView, shapes: TensorShapes,
                     outputs: list[str], runtime: str = "executor") -> EditedGraph | None:
    """moments + batch_normalization become one FusedBatchNormV3, or under XLA
    (`runtime` "xla") the moments do (module doc)."""
    top = view.bodies[0]
    if top.ops & TF1_FRAME_OPS or "Mean" not in top.ops:
        return None
    fetched = {name.split(":")[0] for name in outputs}
    body_shapes = shapes.shapes.get(top.name, {})
    statistics_only = runtime == "xla"
    found = [m for m in (_match(top, body_shapes, fetched, name, statistics_only)
                         for name, node in top.nodes.items() if node.op == "Mean")
             if m is not None]
    if not found:
        return None
    new_graph_def = graph_pb2.GraphDef()
    new_graph_def.CopyFrom(graph_def)
    writer = _Writer(new_graph_def, body_shapes)
    for m in found:
        writer.fuse(m, statistics_only)
    for name in writer.removed:
        writer.written[name] = None
        for index in range(len(top.nodes[name].outputs)):
            writer.shapes.pop(TensorRef(name, index), None)
    kept = [n for n in new_graph_def.node if n.name not in writer.removed]
    del new_graph_def.node[:]
    new_graph_def.node.extend(kept)
    all_shapes = dict(shapes.shapes)
    all_shapes[top.name] = writer.shapes
    return EditedGraph(new_graph_def, {top.name: writer.written},
                       [(top.name, m.mean if statistics_only else m.output,
                         f"{m.output}{_SUFFIX}") for m in found],
                       TensorShapes(all_shapes),
                       edit="fused statistics" if statistics_only else "fused", op="BatchNorm",
                       float32={(top.name, node): why for node, why in writer.float32.items()})


class _Writer:
    """Writes the fused kernels into the copy of the graph (the top graph's
    NodeDefs), recording every NodeDef written and the new shapes."""

    def __init__(self, graph_def: graph_pb2.GraphDef, shapes: dict):
        self.graph_def = graph_def
        self.node_defs = {n.name: n for n in graph_def.node}
        self.shapes = dict(shapes)
        self.written: dict[str, object] = {}
        self.removed: set[str] = set()
        self.float32: dict[str, tuple[str, str]] = {}  # node -> (reason, kind)

    def fuse(self, m: _Match, statistics_only: bool) -> None:
        n, h, w, c = m.shape
        fused = f"{m.output}{_SUFFIX}"
        device = self.node_defs[m.output].device
        add, const = self._add, self._const
        const(f"{fused}/channels", np.array([c], np.int32))
        const(f"{fused}/statistic_shape", np.array([1, 1, 1, c], np.int32))
        const(f"{fused}/empty", np.zeros([0], np.float32))
        self._unbiased(m, fused, device)
        for role, source, missing in (("scale", m.scale, 1.0), ("offset", m.offset, 0.0)):
            if source is None:  # (a layer without gamma / beta: ones / zeros)
                const(f"{fused}/{role}", np.full([c], missing, np.float32))
            else:
                add(f"{fused}/{role}", "Reshape", {"T": _FLOAT, "Tshape": _INT32},
                    [source, f"{fused}/channels"], (c,), device=device)
        read = self._shifted(m, fused, device) if statistics_only else m.x
        add(fused, "FusedBatchNormV3", {
            "T": _FLOAT, "U": _FLOAT, "epsilon": attr_value_pb2.AttrValue(f=m.epsilon),
            "exponential_avg_factor": attr_value_pb2.AttrValue(f=1.0),
            "data_format": attr_value_pb2.AttrValue(s=b"NHWC"),
            "is_training": bool_attr(True)},
            [read, f"{fused}/scale", f"{fused}/offset", f"{fused}/empty", f"{fused}/empty"],
            m.shape, (c,), (c,), (c,), (c,), None, device=device)  # (reserve space 3: opaque)
        add(f"{fused}/biased_variance", "Mul", {"T": _FLOAT},
            [f"{fused}:2", f"{fused}/unbiased"], (c,), device=device)
        # The Means are views of the fused kernel's statistics (the mean of x - s
        # plus s, under XLA); y's node an Identity of its y (not under XLA).
        view = {"T": _FLOAT, "Tshape": _INT32}
        statistic_shape = (1, 1, 1, c)
        if statistics_only:
            add(f"{fused}/shifted_mean", "Reshape", view,
                [f"{fused}:1", f"{fused}/statistic_shape"], statistic_shape, device=device)
            self._rewrite(m.mean, "AddV2", {"T": _FLOAT},
                          [f"{fused}/shifted_mean", f"{fused}/shift"], statistic_shape)
        else:
            self._rewrite(m.mean, "Reshape", view, [f"{fused}:1", f"{fused}/statistic_shape"],
                          statistic_shape)
            self._rewrite(m.output, "Identity", {"T": _FLOAT}, [fused], tuple(m.shape))
        self._rewrite(m.variance, "Reshape", view,
                      [f"{fused}/biased_variance", f"{fused}/statistic_shape"], statistic_shape)
        self.removed.update(m.removable)
        for reader, index in m.shape_readers:
            reader_def = self.written[reader] = self.node_defs[reader]
            reader_def.input[index] = m.x

    def _shifted(self, m: _Match, fused: str, device: str) -> str:
        """x - s, s = x[0, H/2, W/2, :] (x[0, 0, 0, :] where H or W is open) behind a
        StopGradient: what the fused op reads under XLA (module doc)."""
        n, h, w, c = m.shape
        self._const(f"{fused}/shift_begin",
                    np.array([0, max(h, 0) // 2, max(w, 0) // 2, 0], np.int32))
        self._const(f"{fused}/shift_size", np.array([1, 1, 1, -1], np.int32))
        self._add(f"{fused}/shift_value", "Slice", {"T": _FLOAT, "Index": _INT32},
                  [m.x, f"{fused}/shift_begin", f"{fused}/shift_size"], (1, 1, 1, c),
                  device=device)
        self._add(f"{fused}/shift", "StopGradient", {"T": _FLOAT}, [f"{fused}/shift_value"],
                  (1, 1, 1, c), device=device)
        self._add(f"{fused}/shifted", "Sub", {"T": _FLOAT}, [m.x, f"{fused}/shift"],
                  tuple(m.shape), device=device)
        # All float32: XLA fuses the Cast of x into the sums; x - s rounded to
        # 16-bit would lose what the shift keeps (and a 16-bit s costs a Cast
        # kernel of its own in the compiled program).
        for node, why, kind in (
                (f"{fused}/shift_value", "the shift of a fused BatchNorm's statistics "
                 "(one value of x per channel)", rk.KIND_STATISTIC),
                (f"{fused}/shift", "the shift of a fused BatchNorm's statistics",
                 rk.KIND_STATISTIC),
                (f"{fused}/shifted", "x minus the shift, summed in float32 for a fused "
                 "BatchNorm's statistics", rk.KIND_CENTRED),
                (fused, "computes the batch statistics of x minus the shift in float32 "
                 "(XLA fuses the Cast of x into its sums; its y is not read)",
                 rk.KIND_CENTRED)):
            self.float32[node] = (f"kept float32: {why}", kind)
        return f"{fused}/shifted"

    def _unbiased(self, m: _Match, fused: str, device: str) -> None:
        """(n - 1) / n for n values per channel: the kernel's batch variance
        carries Bessel's correction n / (n - 1), the layer's does not."""
        n, h, w, c = m.shape
        if min(n, h, w) > 0:
            self._const(f"{fused}/unbiased", np.array((n * h * w - 1) / (n * h * w),
                                                      np.float32))
            return
        # An open size: 1 - C / size(x), computed where the step runs.
        self._add(f"{fused}/size", "Size", {"T": _FLOAT, "out_type": _INT64}, [m.x], (),
                  device=device)
        self._add(f"{fused}/samples", "Cast", {"SrcT": _INT64, "DstT": _FLOAT,
                                               "Truncate": bool_attr(False)},
                  [f"{fused}/size"], (), device=device)
        self._const(f"{fused}/one", np.array(1.0, np.float32))
        self._const(f"{fused}/channels_f", np.array(float(c), np.float32))
        self._add(f"{fused}/one_sample", "RealDiv", {"T": _FLOAT},
                  [f"{fused}/channels_f", f"{fused}/samples"], (), device=device)
        self._add(f"{fused}/unbiased", "Sub", {"T": _FLOAT},
                  [f"{fused}/one", f"{fused}/one_sample"], (), device=device)

    def _add(self, name: str, op: str, attrs: dict, inputs: list[str], *output_dims,
             device: str = "") -> None:
        node_def = self.graph_def.node.add()
        node_def.name = name
        node_def.device = device
        self._set(node_def, op, attrs, inputs, output_dims)

    def _const(self, name: str, value: np.ndarray) -> None:
        dtype = types_pb2.DT_INT32 if value.dtype == np.int32 else types_pb2.DT_FLOAT
        self._add(name, "Const", {"dtype": type_attr(dtype), "value": attr_value_pb2.AttrValue(
            tensor=tensor_util.make_tensor_proto(value))}, [], value.shape)

    def _rewrite(self, name: str, op: str, attrs: dict, inputs: list[str], dims) -> None:
        self._set(self.node_defs[name], op, attrs, inputs, (dims,))

    def _set(self, node_def, op: str, attrs: dict, inputs: list[str], output_dims) -> None:
        rewrite_node(node_def, op, attrs, inputs)
        for index, dims in enumerate(output_dims):
            add_output_shape(node_def, dims)
            if dims is not None:
                self.shapes[TensorRef(node_def.name, index)] = tuple(dims)
        self.written[node_def.name] = node_def


def _match(body: Body, shapes: dict, fetched: set[str], mean: str,
           statistics_only: bool) -> _Match | None:
    """The pattern whose mean is the Mean node `mean`, or None (module doc);
    `statistics_only`: the edit under XLA, which removes only the squares."""
    nodes, consumers = body.nodes, body.consumers
    node = nodes[mean]
    if not _reduces_nhw(body, node) or len(node.data_inputs) != 2:
        return None
    x, x_text = node.data_inputs[0]
    shape = shapes.get(x)
    port = body.producer_port(x)
    if (port is None or port.dtype != types_pb2.DT_FLOAT or shape is None or len(shape) != 4
            or shape[3] <= 0):
        return None  # (N, H and W may be open: then the step computes (n - 1) / n)
    if min(shape[:3]) >= 0 and math.prod(shape[:3]) < 2:
        return None  # (one value per channel: nothing to normalise)
    channels = shape[3]
    # The variance: Mean(SquaredDifference(x, StopGradient(mean))).
    squares = variance = None
    square_shape_readers: list[tuple[str, int]] = []
    for stop, _ in consumers.get(TensorRef(mean, 0), ()):
        if nodes[stop].op != "StopGradient":
            continue
        for candidate, index in consumers.get(TensorRef(stop, 0), ()):
            cand = nodes[candidate]
            if (cand.op == "SquaredDifference" and index == 1
                    and cand.data_inputs[0][0] == x):
                readers, shapes_only = _readers(body, candidate)
                if len(readers) == 1 and _reduces_nhw(body, nodes[readers[0]]):
                    squares, variance, square_shape_readers = (
                        candidate, readers[0], shapes_only)
    if squares is None:
        return None
    # The normalisation: x * inv + (beta - view(mean) * inv).
    for reader, _ in consumers.get(x, ()):
        normalised = nodes[reader]
        if normalised.op != "Mul" or len(normalised.data_inputs) != 2:
            continue
        refs = [ref for ref, _ in normalised.data_inputs]
        if refs.count(x) != 1:
            continue
        inv = refs[1 - refs.index(x)]
        found = _normalisation(body, shapes, reader, inv, mean, variance, channels)
        if found is None:
            continue
        output, shift, shifted_mean, scale, offset, epsilon = found
        # A graph without its own gradient of x will be differentiated later
        # (through the fused op's gradient, which has none for the statistics).
        differentiated = any(scopes.is_gradient(r) for r, _ in consumers.get(x, ()))
        if statistics_only:
            if not differentiated:
                return None  # (y reads the statistics, which would have no gradient)
            shape_readers, removable = square_shape_readers, [squares]
        else:
            shape_readers = square_shape_readers + _readers(body, reader)[1]
            removable = [squares, reader]
            if [c for c, _ in consumers.get(TensorRef(shift, 0), ())] == [output]:
                removable.append(shift)
                if [c for c, _ in consumers.get(TensorRef(shifted_mean, 0), ())] == [shift]:
                    removable.append(shifted_mean)
        pattern = [mean, variance, squares, reader, output, shift, shifted_mean]
        waiters = body.waiters()
        if (any(len(nodes[p].node_def.input) != len(nodes[p].data_inputs) for p in pattern)
                or any(r in waiters or r in fetched for r in removable)):
            return None
        if not differentiated and not _statistics_contained(
                body, (mean, variance), set(pattern), fetched):
            return None
        return _Match(x_text, tuple(shape), mean, variance, squares, reader, output,
                      shift, shifted_mean, scale, offset, epsilon, tuple(removable),
                      tuple(shape_readers))
    return None


def _normalisation(body: Body, shapes: dict, normalised: str, inv: TensorRef, mean: str,
                   variance: str, channels: int):
    """(y's node, shift, shifted mean, gamma, beta, eps) if `normalised` = x * inv
    is tf.nn.batch_normalization's with these statistics, else None. gamma and
    beta are input strings, or None where the layer has none (``scale=False``:
    inv is the Rsqrt itself; ``center=False``: the shift is -mean * inv)."""
    nodes = body.nodes
    readers = _readers(body, normalised)[0]
    if len(readers) != 1 or nodes[readers[0]].op not in _ADDS:
        return None
    output = readers[0]
    shift = _other_input(nodes[output], TensorRef(normalised, 0))
    if shift is None or shift.is_arg or nodes[shift.node].op not in ("Sub", "Mul"):
        return None
    offset = offset_text = None
    if nodes[shift.node].op == "Sub":  # beta - mean * inv
        (offset, offset_text), (shifted, _) = nodes[shift.node].data_inputs
        if shifted.is_arg or nodes[shifted.node].op != "Mul":
            return None
        mean_view = _other_input(nodes[shifted.node], inv)
    else:  # -mean * inv: the shift multiplies a Neg of the mean (shifted: that Neg)
        shifted = _other_input(nodes[shift.node], inv)
        if shifted is None or shifted.is_arg or nodes[shifted.node].op != "Neg":
            return None
        mean_view = nodes[shifted.node].data_inputs[0][0]
    if mean_view is None or _through_views(body, mean_view) != TensorRef(mean, 0):
        return None
    # inv = Rsqrt(view(variance) + eps) * gamma, or Rsqrt(view(variance) + eps)
    if inv.is_arg or nodes[inv.node].op not in ("Mul", "Rsqrt"):
        return None
    root = gamma = gamma_text = None
    if nodes[inv.node].op == "Rsqrt":
        root = inv
    else:
        for ref, text in nodes[inv.node].data_inputs:
            if not ref.is_arg and nodes[ref.node].op == "Rsqrt" and root is None:
                root = ref
            else:
                gamma, gamma_text = ref, text
        if root is None or gamma is None:
            return None
    (plus, _), = nodes[root.node].data_inputs
    if plus.is_arg or nodes[plus.node].op not in _ADDS:
        return None
    epsilon = None
    for ref, _ in nodes[plus.node].data_inputs:
        source = _through_views(body, ref)
        value = None if source.is_arg else scalar_constant(body.nodes.get(source.node))
        if value is not None:
            epsilon = value
        elif _through_views(body, ref) != TensorRef(variance, 0):
            return None
    if epsilon is None or not epsilon > 0:
        return None
    given = [ref for ref in (gamma, offset) if ref is not None]
    if not all(_per_channel(shapes.get(ref), channels) for ref in (inv, mean_view, *given)):
        return None
    if not all(_source(body, ref) for ref in given):
        return None
    return output, shift.node, shifted.node, gamma_text, offset_text, epsilon


def _statistics_contained(body: Body, statistics: tuple[str, ...], pattern: set[str],
                          fetched: set[str]) -> bool:
    """Does every use of the batch statistics end inside the pattern, behind a
    StopGradient, in a gradient op, in an op that reads only a shape, or in a
    variable assignment (the moving averages)?

    FusedBatchNormV3's registered gradient has none for its batch mean and
    variance: were a statistic used on some other differentiable path, a graph
    differentiated after the rewrite (a model called in a custom loop's step,
    ``keras/custom_loop.py``) would silently lose that part of the gradient."""
    nodes, consumers = body.nodes, body.consumers
    stack, seen = list(statistics), set(statistics)
    while stack:
        name = stack.pop()
        if name in fetched:
            return False
        readers = [reader for index in range(len(nodes[name].outputs))
                   for reader, _ in consumers.get(TensorRef(name, index), ())]
        if not readers and name not in statistics:
            return False  # (a loose end: a value nothing here accounts for)
        for reader in readers:
            node = nodes[reader]
            if (reader in pattern or reader in seen or node.op in _CONTAINED_READERS
                    or node.op.startswith("Assign") or scopes.is_gradient(reader)):
                continue
            if len(seen) >= _MAX_STATISTIC_USES:
                return False
            seen.add(reader)
            stack.append(reader)
    return True


def _readers(body: Body, name: str) -> tuple[list[str], list[tuple[str, int]]]:
    """(the nodes that read output 0 of `name`'s data, the (node, input index) of
    those that read only its shape)."""
    readers, shape_readers = [], []
    for reader, index in body.consumers.get(TensorRef(name, 0), ()):
        if body.nodes[reader].op in METADATA_OPS:
            shape_readers.append((reader, index))
        else:
            readers.append(reader)
    return readers, shape_readers


def _reduces_nhw(body: Body, node) -> bool:
    """A Mean with keep_dims over exactly axes 0, 1 and 2 of a 4-D input?"""
    if node.op != "Mean" or not node.node_def.attr["keep_dims"].b or len(node.data_inputs) != 2:
        return False
    axes = _constant(body, node.data_inputs[1][0])
    if axes is None or axes.ndim > 1:
        return False
    return sorted(int(a) % 4 for a in axes.reshape(-1)) == [0, 1, 2]


def _other_input(node, ref: TensorRef) -> TensorRef | None:
    refs = [r for r, _ in node.data_inputs]
    if len(refs) != 2 or refs.count(ref) != 1:
        return None
    return refs[1 - refs.index(ref)]


def _through_views(body: Body, ref: TensorRef) -> TensorRef:
    """The tensor `ref` is a view of (through Identity, Reshape, Squeeze, ExpandDims)."""
    for _ in range(8):
        node = None if ref.is_arg else body.nodes.get(ref.node)
        if node is None or node.op not in _VIEWS or not node.data_inputs:
            return ref
        ref = node.data_inputs[0][0]
    return ref


def _source(body: Body, ref: TensorRef) -> bool:
    """Is `ref` a variable's value, a constant or an argument, read through views?"""
    ref = _through_views(body, ref)
    return ref.is_arg or body.nodes[ref.node].op in _SOURCES


def _per_channel(shape, channels: int) -> bool:
    """[C] or [1, ..., 1, C]: broadcasts along the last axis of NHWC."""
    return (shape is not None and 1 <= len(shape) <= 4 and shape[-1] == channels
            and all(d == 1 for d in shape[:-1]))


def _constant(body: Body, ref: TensorRef) -> np.ndarray | None:
    node = None if ref.is_arg else body.nodes.get(ref.node)
    if node is None or node.op != "Const":
        return None
    return tensor_util.MakeNdarray(node.node_def.attr["value"].tensor)


