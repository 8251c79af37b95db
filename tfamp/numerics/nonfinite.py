"""The first op of a traced step that produced an inf or nan: ``locate_nonfinite``.

How: the traced step (forward and backward, no optimizer update) is rewritten
exactly as tfamp would rewrite it, then a ``CheckNumericsV2`` node is placed
after every float output of the top graph and every consumer is rewired to
read the checked tensor. A consumer therefore cannot run before its inputs
were checked, so the check that fails names an op whose inputs were all
finite: the origin, in execution order, not one of the many ops the inf
spread to. A second run of the same rewritten graph fetches that op's inputs
for their magnitudes.

Why not ``tf.debugging.enable_check_numerics``: it instruments ops through op
callbacks while Python traces them, i.e. the float32 graph before tfamp's
rewrite; the ops that overflow are the 16-bit ones only the rewritten GraphDef
has. The same kernel (CheckNumericsV2) is inserted into that GraphDef instead.

Nothing changes: the graph applies no gradients (the Keras entry point,
``tfamp.keras.overflow_locator``, restores the model's non-trainable and
metric variables afterwards: BatchNorm statistics update in a training-mode
forward pass). A step traced under a tf.distribute strategy names its other
replicas' ops ``replica_<n>/...``: the layer scope leaves that prefix out, so
a ``keep_fp32`` pattern covers every replica.

An inf the float32 step makes on purpose and tames later (Keras 3 normalises
with ``minimum(rsqrt(sum(x * x)), 1e12)``: the rsqrt of a zero row is inf) is
no origin: where the first inf/nan found computed in float32, the float32 step
runs once more with a finiteness flag for every output, and if its results are
finite, every value it has non-finite is looked past.

Limits: ops inside library functions (loop bodies, nested calls) are checked
only through the call op's outputs.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import graph_pb2, types_pb2

from tfamp.config import AmpConfig
from tfamp.numerics.run_graph import run_imported
from tfamp.rewrite.graph import FLOAT_TYPES, TensorRef, build_view, dtype_name
from tfamp.rewrite.scopes import GRADIENT_PREFIXES, is_gradient
from tfamp.runtime.runner import rewritten_graph_def

log = logging.getLogger("tfamp")

_CHECK_PREFIX = "tfamp_nonfinite_check"
_MESSAGE = re.compile(r"tfamp_check:(\d+)")
_SIXTEEN_BIT = (types_pb2.DT_HALF, types_pb2.DT_BFLOAT16)
_SKIPPED_OPS = frozenset({"Const", "Placeholder"})  # a constant inf is intentional
_counter = itertools.count()


@dataclasses.dataclass(frozen=True)
class InputMagnitude:
    """An input of the failing op: its dtype and largest / smallest nonzero |x|."""

    tensor: str
    dtype: str
    max_abs: float
    min_nonzero_abs: float
    nonfinite: int


@dataclasses.dataclass(frozen=True)
class NonFiniteOp:
    """The first op that produced an inf or nan, and what to change.

    Attributes:
      node: node name in the (rewritten) graph; op: its op type.
      output: the output index that was not finite; value: "inf", "nan" or both.
      phase: "forward" or "backward" (gradient ops; an inserted Cast: the op it feeds).
      layer: the name scope of the forward op (without "gradient_tape/").
      dtype: the dtype of that output in the rewritten graph.
      ran_16bit: True if the op computed in float16/bfloat16.
      inserted_cast: True if the op is a Cast tfamp inserted (the value did not
        fit the 16-bit type); `feeds` then names the converted ops it feeds.
      inputs: magnitudes of its data inputs.
      loss_scale: the loss scale the step ran with.
      keep_fp32: the keep_fp32 pattern that keeps this layer float32.
      fix_env / fix_api: the same fix as TFAMP_* settings and as AmpConfig
        arguments; fix_oplist_env / fix_oplist_api: the op-list alternative.
    """

    node: str
    op: str
    output: int
    value: str
    phase: str
    layer: str
    dtype: str
    ran_16bit: bool
    inserted_cast: bool
    feeds: tuple[str, ...]
    inputs: tuple[InputMagnitude, ...]
    loss_scale: float
    keep_fp32: str
    fix_env: str
    fix_api: str
    fix_oplist_env: str
    fix_oplist_api: str

    def describe(self) -> str:
        """A few sentences for logs and warnings."""
        what = (f"tfamp's Cast to {self.dtype} of '{self.node.rsplit('/tfamp_cast_', 1)[0]}' "
                f"(feeding {', '.join(self.feeds) or 'nothing'})" if self.inserted_cast
                else f"{self.op} '{self.node}'")
        where = f"layer/scope '{self.layer}'" if self.layer else "the top scope"
        inputs = "; ".join(
            f"{i.tensor} ({i.dtype}) max |x| {i.max_abs:.4g}, min nonzero {i.min_nonzero_abs:.3g}"
            for i in self.inputs) or "none"
        text = (f"first non-finite value ({self.value}) comes from {what} in the {self.phase} "
                f"pass, {where}, computing in {self.dtype}"
                f"{' (16-bit)' if self.ran_16bit else ''} at loss scale {self.loss_scale:g}; "
                f"its inputs: {inputs}.")
        if self.ran_16bit:
            text += (f" Fix: keep it float32 with {self.fix_env} or {self.fix_api}; or "
                     f"{self.fix_oplist_env} / {self.fix_oplist_api}.")
        else:
            text += (" It ran in float32, so 16-bit is not the cause: check the data, the "
                     "learning rate and the loss scale.")
        return text

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def locate_nonfinite(concrete, args, config: AmpConfig | None = None, *,
                     loss_scale: float = 1.0,
                     scope_pattern: Callable[[str], str] | None = None) -> NonFiniteOp | None:
    """Runs a traced step once, rewritten by tfamp, and finds the first inf/nan op.

    Args:
      concrete: a ConcreteFunction computing forward and backward (it must not
        update variables: compute gradients, do not apply them).
      args: the arguments to call it with (the same structure it was traced for).
      config: the rewrite settings (``AmpConfig()`` if None).
      loss_scale: recorded in the answer (the step's own scale is in `args`).
      scope_pattern: the keep_fp32 pattern for a layer scope (default: the scope
        itself, escaped, then "/"); Keras's names every call of the layer.

    Returns:
      the origin, or None if every value was finite.

    Example:
      >>> step = tf.function(loss_and_grads).get_concrete_function(x, y)
      >>> found = locate_nonfinite(step, (x, y), AmpConfig(allow_add=["Exp"]))
      >>> print(found.describe())
    """
    config = config or AmpConfig()
    # The graph a run of the rewrite executes (its shapes decide by bytes): a rewrite
    # of the bare graph decides otherwise and may not overflow where the step does.
    rewritten, _ = rewritten_graph_def(concrete, config)
    body = build_view(rewritten).bodies[0]
    # (a distributed batch's values, a ragged tensor's parts: the trace's flat inputs)
    flat_args = [a for a in tf.nest.flatten(args, expand_composites=True) if a is not None]
    first = _first_nonfinite(concrete, rewritten, body, flat_args, frozenset())
    if first is None:
        return None
    node, port, value = first
    if body.nodes[node].outputs[port].dtype not in _SIXTEEN_BIT:
        # A float32 op: an inf the float32 step makes too and then tames (Keras 3's
        # minimum(rsqrt(sum), 1e12) of a zero row) is no origin, where the float32
        # step's results are finite: look past every such value.
        intended = _float32_nonfinite(concrete, flat_args)
        if intended and (node, port) in intended:
            first = _first_nonfinite(concrete, rewritten, body, flat_args, intended)
            if first is None:
                return None
            node, port, value = first
    node_def = body.nodes[node].node_def
    input_names = [i if ":" in i else f"{i}:0" for i in node_def.input
                   if not i.startswith("^")]
    # Values only: a resource or variant handle (a variable an op reads) has no array.
    input_names = [i for i in input_names if _fetchable(body, i)]
    input_values = run_imported(concrete, rewritten, input_names, flat_args) \
        if input_names else []
    inputs = tuple(_magnitude(name, value_)
                   for name, value_ in zip(input_names, input_values, strict=True))
    dtype = body.nodes[node].outputs[port].dtype
    inserted = "/tfamp_cast_" in node
    feeds = tuple(sorted({consumer for consumer, _ in body.consumers.get(
        _ref(node, port), ())}, key=lambda n: (is_gradient(n), n))) if inserted else ()
    scope_source = feeds[0] if inserted and feeds else node
    layer = _layer_scope(scope_source, {_REPLICA_PREFIX.sub("", n) for n in body.nodes})
    op = body.nodes[feeds[0]].op if inserted and feeds else body.nodes[node].op
    return NonFiniteOp(
        node=node, op=body.nodes[node].op, output=port, value=value,
        phase="backward" if is_gradient(scope_source) else "forward", layer=layer,
        dtype=dtype_name(dtype), ran_16bit=dtype in _SIXTEEN_BIT, inserted_cast=inserted,
        feeds=feeds, inputs=inputs, loss_scale=float(loss_scale),
        **_fixes(layer, op, config, scope_pattern, _REPLICA_PREFIX.sub("", scope_source)))


# ------------------------------------------------------------------ helpers


def _first_nonfinite(concrete, graph_def: graph_pb2.GraphDef, body, flat_args: list,
                     skip: frozenset[tuple[str, int]]) -> tuple[str, int, str] | None:
    """(node, output, "inf" / "nan" / "nan and inf") of the first float output of
    `graph_def`'s top graph, in execution order, that is not finite (outputs in
    `skip` are not checked), or None.

    One run computes every output's flags in the graph: the first non-finite one
    in a topological order has only finite ancestors, so it is an origin. Where
    that run raises (an op that errors on a value the inf/nan made: an index
    cast from NaN), ``CheckNumericsV2`` after every output stops the step at the
    first one instead; TensorFlow then logs its "Local rendezvous is aborting"
    warning, so it is only the fallback.
    """
    tensors = _float_outputs(body, skip)
    if not tensors:
        return None
    try:
        nan, inf = _nan_inf_flags(concrete, graph_def, tensors, flat_args)
    except tf.errors.OpError:  # (the checks stop the step before such an op runs)
        return _first_checked(concrete, graph_def, body, flat_args, skip)
    for (node, port), has_nan, has_inf in zip(tensors, nan, inf, strict=True):
        if has_nan or has_inf:
            return node, port, ("nan and inf" if has_nan and has_inf
                                else "nan" if has_nan else "inf")
    return None


def _nan_inf_flags(concrete, graph_def: graph_pb2.GraphDef, tensors: list[tuple[str, int]],
                   flat_args: list, results: tuple[str, ...] = ()) -> tuple[np.ndarray, ...]:
    """(any NaN, any inf) per tensor of `tensors` and then of `results`, from one run."""
    fetches = [f"{name}:{port}" for name, port in tensors] + list(results)
    (flags,) = run_imported(concrete, graph_def, fetches, flat_args, post=lambda values: [
        tf.stack([tf.stack([tf.reduce_any(tf.math.is_nan(v)), tf.reduce_any(tf.math.is_inf(v))])
                  for v in values], axis=1)])
    return flags[0], flags[1]


def _first_checked(concrete, graph_def: graph_pb2.GraphDef, body, flat_args: list,
                   skip: frozenset[tuple[str, int]]) -> tuple[str, int, str] | None:
    """``_first_nonfinite`` by a CheckNumericsV2 after every float output."""
    instrumented, checked = _instrument(graph_def, body, skip)
    try:
        run_imported(concrete, instrumented, [t.name for t in concrete.graph.outputs],
                     flat_args)
        return None
    except tf.errors.InvalidArgumentError as err:
        found = _MESSAGE.search(err.message or "")
        if found is None:
            raise
        node, port = checked[int(found.group(1))]
        return node, port, ("nan and inf" if "NaN" in err.message and "Inf" in err.message
                            else "nan" if "NaN" in err.message else "inf")


def _float32_nonfinite(concrete, flat_args: list) -> frozenset[tuple[str, int]]:
    """The top graph's float outputs that are inf/nan in the float32 step itself
    while every float result of the step is finite: values the step makes on
    purpose and tames later (rsqrt(0) = inf, clamped by a minimum). Empty where a
    result is not finite: then the step overflows in float32, and its first
    inf/nan is the origin to report."""
    graph_def = concrete.graph.as_graph_def()
    body = build_view(graph_def).bodies[0]
    tensors = _float_outputs(body, frozenset())
    results = tuple(t.name for t in concrete.graph.outputs if t.dtype.is_floating)
    if not tensors:
        return frozenset()
    nan, inf = _nan_inf_flags(concrete, graph_def, tensors, flat_args, results)
    bad = nan | inf
    if bad[len(tensors):].any():
        return frozenset()
    return frozenset(t for t, wrong in zip(tensors, bad[:len(tensors)], strict=True) if wrong)


def _float_outputs(body, skip: frozenset[tuple[str, int]]) -> list[tuple[str, int]]:
    """(node, output) of every float output of the top graph, in execution order."""
    outputs = []
    for name in body.topological_order():
        node = body.nodes[name]
        if node.op in _SKIPPED_OPS:
            continue
        outputs += [(name, port) for port, out in enumerate(node.outputs)
                    if out.dtype in FLOAT_TYPES and (name, port) not in skip]
    return outputs


def _instrument(graph_def: graph_pb2.GraphDef, body,
                skip: frozenset[tuple[str, int]] = frozenset()
                ) -> tuple[graph_pb2.GraphDef, list[tuple[str, int]]]:
    """A copy with CheckNumericsV2 after every float output (but those in `skip`),
    consumers rewired."""
    new = graph_pb2.GraphDef()
    new.CopyFrom(graph_def)
    checked = _float_outputs(body, skip)
    check_of = {key: f"{_CHECK_PREFIX}/{index}" for index, key in enumerate(checked)}
    for node_def in new.node:
        for i, text in enumerate(node_def.input):
            if text.startswith("^"):
                continue
            source, _, port = text.partition(":")
            key = (source, int(port) if port else 0)
            if key in check_of:
                node_def.input[i] = check_of[key]
    for index, (name, port) in enumerate(checked):
        check = new.node.add()
        check.name = check_of[(name, port)]
        check.op = "CheckNumericsV2"
        check.input.append(name if port == 0 else f"{name}:{port}")
        check.attr["T"].type = body.nodes[name].outputs[port].dtype
        check.attr["message"].s = f"tfamp_check:{index}".encode()
        if body.nodes[name].node_def.device:
            check.device = body.nodes[name].node_def.device
    return new, checked


def _magnitude(name: str, value: np.ndarray) -> InputMagnitude:
    array = np.asarray(value)
    dtype = str(array.dtype)
    if array.dtype.kind not in "fc":
        return InputMagnitude(name, dtype, float("nan"), float("nan"), 0)
    a = np.abs(array.astype(np.float64)).ravel()
    finite = a[np.isfinite(a)]
    nonzero = finite[finite > 0]
    return InputMagnitude(
        name, dtype, float(finite.max()) if finite.size else float("nan"),
        float(nonzero.min()) if nonzero.size else 0.0, int(a.size - finite.size))


def _fetchable(body, tensor: str) -> bool:
    source, _, port = tensor.rpartition(":")
    node = body.nodes.get(source)
    if node is None or int(port) >= len(node.outputs):
        return True  # unknown here: let the run say
    return node.outputs[int(port)].dtype not in (types_pb2.DT_RESOURCE, types_pb2.DT_VARIANT)


def _ref(node: str, port: int) -> TensorRef:
    return TensorRef(node, port)


_REPLICA_PREFIX = re.compile(r"^replica_\d+/")


def _layer_scope(name: str, forward_ops=None) -> str:
    """The name scope of the forward op: gradient ops are named
    "gradient_tape/<forward op>/<gradient op>" ("gradients/<op>_grad/..." in TF1),
    so they lose one more part; a replica's copy ("replica_1/...",
    "gradient_tape/replica_1/...") is named for every replica.

    `forward_ops`: the graph's op names (replica prefixes left out), where known.
    Some gradients sit in the forward op's scope itself, not under its name
    (TensorFlow's Mean gradient: ".../global_average_pooling2d_1/Tile" for
    ".../global_average_pooling2d_1/Mean"): where the part before the gradient
    op's own name is no op, it is that scope.
    """
    name = _REPLICA_PREFIX.sub("", name)
    if is_gradient(name):
        for prefix in GRADIENT_PREFIXES:
            name = name.removeprefix(prefix)
        name = _REPLICA_PREFIX.sub("", name)  # "gradient_tape/replica_1/..."
        name = name.rsplit("/", 1)[0] if "/" in name else name
        if forward_ops is not None and name.removesuffix("_grad") not in forward_ops:
            return name
    return name.rsplit("/", 1)[0] if "/" in name else ""


def top_scope_keep_pattern(node: str) -> str:
    """The keep_fp32 pattern for a node in no name scope: every call of its op there
    (the name with or without TensorFlow's ``_<n>`` suffix, as ``call_scopes`` names a
    layer's every call) and their gradients' ops. A style loss's Gram matrices are one
    function called once per feature map: 'MatMul', 'MatMul_1', ... move together.

    Example:
      >>> top_scope_keep_pattern("MatMul_1")
      '^(gradient_tape/)?MatMul(_\\d+)?(_grad)?(/|$)'
    """
    base = _CALL_SUFFIX.fullmatch(node)
    name = base.group(1) if base is not None else node
    return rf"^(gradient_tape/)?{re.escape(name)}(_\d+)?(_grad)?(/|$)"


# (``call_scopes``' rule for a layer's calls; that module is a layer above this one)
_CALL_SUFFIX = re.compile(r"(.+?)_\d+")


def scope_keep_pattern(scope: str) -> str:
    """The keep_fp32 pattern for one name scope as it is (the scope, escaped, then "/")."""
    return f"{re.escape(scope)}/"


def shell_quoted(value: str) -> str:
    """`value` in single quotes, as a shell reads it back unchanged (a keep_fp32
    regex's backslashes included, which Python's repr would double)."""
    return "'" + value.replace("'", "'\"'\"'") + "'"


def _fixes(layer: str, op: str, config: AmpConfig,
           scope_pattern: Callable[[str], str] | None = None, node: str = "") -> dict[str, str]:
    if not layer:
        # An op in no name scope: its every call there and their gradients, by the
        # node's name, not its type (``top_scope_keep_pattern``).
        pattern = top_scope_keep_pattern(node or op)
    else:
        pattern = (scope_pattern or scope_keep_pattern)(layer)
    keep = [*config.keep_fp32, pattern]
    fix_env = f"TFAMP_KEEP_FP32={shell_quoted(','.join(keep))}"
    fix_api = f"AmpConfig(keep_fp32={keep!r})"
    if op in config.allow_add:
        rest = [o for o in config.allow_add if o != op]
        oplist_env = (f"TFAMP_ALLOWLIST_ADD={','.join(rest)!r}" if rest
                      else "unset TFAMP_ALLOWLIST_ADD")
        oplist_api = f"AmpConfig(allow_add={rest!r})  # drop {op!r}"
    else:
        deny = [*config.deny_add, op] if op not in config.deny_add else list(config.deny_add)
        oplist_env = f"TFAMP_DENYLIST_ADD={','.join(deny)!r}"
        oplist_api = f"AmpConfig(deny_add={deny!r})"
    return dict(keep_fp32=pattern, fix_env=fix_env, fix_api=fix_api,
                fix_oplist_env=oplist_env, fix_oplist_api=oplist_api)
