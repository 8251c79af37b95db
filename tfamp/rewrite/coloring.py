"""Which ops compute in 16-bit, and why: ``color(view, config) -> Coloring``.

Pure analysis: nothing is edited here. Decisions are made per *type slot* (a
node and one of its type attributes, e.g. FusedBatchNormV3's ``T`` but not its
float32-only ``U``) and connected along data edges, following the order of
grappler's AMP pass:

1. allow-list slots go 16-bit;
2. deny spreads forward from deny ops through infer ops and through clear ops
   that lead to a deny or infer op, except after a statistic (a deny
   reduction whose output is much smaller than its input): there float32
   spreads only through ops as small as the statistic, and holds the few big
   ops whose numerics need it (x - mean up to its scaling; a broadcast sum up
   to its division); the other big ops that read a statistic are left to the
   rules below (see _propagate_deny);
3. infer and clear slots on a path between two 16-bit slots go 16-bit;
4. an infer slot fed by a 16-bit slot goes 16-bit where that moves fewer bytes
   (with tensor shapes; else where it needs fewer casts);
5. clear slots next to 16-bit slots follow them, unless (with shapes) that
   moves more bytes, e.g. a Cast moved onto a larger tensor; a chain that
   combines statistics and weights into a big tensor for a 16-bit op
   (LayerNorm's scale and shift) goes 16-bit where that moves fewer bytes;
   so does an Exp that cannot exceed 1 (a softmax written out) with the free
   ops after it, where only 16-bit ops read the result;
   these repeat until nothing changes (a few rounds at most);
6. a GPU Mean nothing is centred on reads its 16-bit input as it is;
7. an existing Cast to float32 that feeds only 16-bit slots casts to 16-bit
   instead, so no second Cast is needed.

Each library function is coloured on its own. Call sites (While, If, Case,
PartitionedCall, ...) and TensorList element types keep their float32 types
unless ``boundaries.solve`` decides that a whole group of slots that must agree
(a loop-carried value in the loop, its cond and body; a function argument at
every caller; every op on one TensorList; a TF1 loop frame) goes 16-bit
together. It passes those decisions to each body as ``BodyOverrides``: 16-bit
arguments and results, forced 16-bit slots, and slots held at float32.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Iterable, Mapping
from typing import NamedTuple

from tensorflow.core.framework import types_pb2
from tensorflow.python.framework import dtypes

from tfamp.config import AmpConfig
from tfamp.oplists import (
    BFLOAT16_SAFE_PRODUCTS,
    BOUNDING_OPS,
    BROADCAST_OPS,
    CENTRING_OPS,
    DATA_BOUND_OPS,
    FLOAT32_ACCUMULATING_ON_GPU,
    FLOAT32_ACCUMULATING_UNDER_XLA,
    FUSED_NORMALISATION_OPS,
    GROWING_INVERSES,
    GROWING_OPS,
    INEXACT_16BIT_KERNELS,
    INVERSE_GRADIENTS,
    METADATA_OPS,
    RANGE_DENIED_REDUCTIONS,
    SIZE_KEEPING_COPIES,
    STATISTIC_REDUCTIONS,
)
from tfamp.rewrite import (
    boundaries,
    compiled,
    kernels,
    runtime_cost,
    scopes,
    tied_output,
    value_ranges,
)
from tfamp.rewrite import reasons as rk
from tfamp.rewrite.graph import (
    DT_BFLOAT16,
    DT_FLOAT,
    DT_HALF,
    Body,
    GraphView,
    TensorRef,
    dtype_name,
    scalar_constant,
    variable_key,
)
from tfamp.rewrite.shapes import Bytes, TensorShapes, format_elements
from tfamp.rewrite.traffic import CONSTANT_OPS, NO_COPY_OPS
from tfamp.rewrite.value_ranges import REAL_TYPES

# Type attributes that do not change on their own, whatever list the op is on.
# A TensorList's element type must agree with every op that touches the list,
# and lists flow through loop boundaries into other functions: boundaries.solve
# lifts this for a whole list (every op on it, in every function) at once.
# Ops that scale a tensor by another; with a scalar operand known only at run
# time they stay float32 after a 16-bit op (see _BodyColoring._run_time_scale).
SCALING_OPS = frozenset({"Mul", "MulNoNan", "RealDiv", "Div", "DivNoNan", "TruncateDiv"})
# Variables and their reads (resource and TF1 reference variables).
VARIABLE_OPS = frozenset({"ReadVariableOp", "VariableV2", "Variable"})
# Where a run-time scalar may come from: a variable, or a value fed at run time.
VARIABLE_READ_OPS = VARIABLE_OPS | {"Placeholder", "PlaceholderWithDefault"}
# How a scalar may be derived from such a value on its way to a scaling op.
SCALAR_ARITHMETIC_OPS = frozenset({
    "Identity", "Cast", "Reciprocal", "Inv", "RealDiv", "Div", "DivNoNan", "Mul",
    "Neg", "Sqrt", "Rsqrt", "Pow", "AddV2", "Add", "Sub", "Maximum", "Minimum",
    "Reshape", "Squeeze", "ExpandDims", "StopGradient"})

FIXED_TYPE_ATTRS = {
    op: frozenset({"element_dtype"}) for op in (
        "EmptyTensorList", "TensorListConcat", "TensorListConcatLists",
        "TensorListConcatV2", "TensorListElementShape", "TensorListFromTensor",
        "TensorListGather", "TensorListGetItem", "TensorListPopBack",
        "TensorListPushBack", "TensorListPushBackBatch", "TensorListReserve",
        "TensorListResize", "TensorListScatter", "TensorListScatterV2",
        "TensorListScatterIntoExistingList", "TensorListSetItem",
        "TensorListSplit", "TensorListStack",
    )
}



# Rounds of (infer after 16-bit, clear propagation); each is linear.
_MAX_ROUNDS = 4
# Largest chain of infer/clear ops after a 16-bit op judged as one region.
_MAX_REGION = 32
# Most ops from a variable's read to its new value that _hold_variable_updates
# keeps float32 (a moving average takes two or three: moving * m + x * (1 - m)).
_MOVING_AVERAGE_OPS = 6
# A reduction's output is a statistic when its input has at least this many
# times its elements (a BatchNorm's mean over N x H x W; a GroupNorm's
# gradient summed over a batch of 2). Safety does not rest on the ratio (the
# rules after a statistic hold what needs float32); it only tells the small
# tensors that stay float32 with a statistic from the big ones that read it.
_STATISTIC_RATIO = 2


class Decision(NamedTuple):
    """What colouring decided for one node.

    A NamedTuple rather than a frozen dataclass: the pass makes one per node of
    every body it colours, and a frozen dataclass takes several times as long
    to build (about 10 ms per 10,000 nodes).

    Attributes:
      list: "allow", "infer", "deny", "clear" or "unlisted".
      converted: True if the node now computes in the 16-bit type.
      reason: a short sentence, e.g. "deny: downstream of Exp 'loss/Exp'".
      converted_attrs: the type attributes switched to 16-bit.
      cause: the node that made the decision (a deny root, a 16-bit
        neighbour), or "" when the node decided on its own.
      kind: what kind of reason it is, one of the ``tfamp.rewrite.reasons``
        ``KIND_*`` constants (e.g. "deny list").
    """

    list: str
    converted: bool
    reason: str
    converted_attrs: tuple[str, ...] = ()
    cause: str = ""
    kind: str = ""


@dataclasses.dataclass
class Coloring:
    """Decisions for every node of every body, keyed by (function, node name)."""

    target: int
    decisions: dict[tuple[str, str], Decision]
    # function name -> its new signature types where they change (boundaries.py).
    signatures: dict[str, boundaries.SignatureTypes] = dataclasses.field(default_factory=dict)
    # new function name -> the function it copies (callers that disagree, boundaries.py)
    clones: dict[str, str] = dataclasses.field(default_factory=dict)
    # call site (body, node, attribute, index in a function list) -> the copy it calls
    call_targets: dict[tuple[str, str, str, int], str] = dataclasses.field(default_factory=dict)

    @functools.cached_property
    def converted_by_body(self) -> dict[str, dict[str, tuple[str, ...]]]:
        """function -> {node: its type attributes now 16-bit}, converted nodes only,
        in decision order (what Cast insertion and the traffic estimate walk)."""
        by_body: dict[str, dict[str, tuple[str, ...]]] = {}
        for (function, node), decision in self.decisions.items():
            if decision.converted_attrs:
                by_body.setdefault(function, {})[node] = decision.converted_attrs
        return by_body


def color(view: GraphView, config: AmpConfig,
          outputs: Iterable[str] = (),
          keep: Mapping[tuple[str, str], tuple[str, str]] | None = None,
          shapes: TensorShapes | None = None,
          runtime: str | None = None,
          input_magnitudes: Mapping[str, float] | None = None) -> Coloring:
    """Decides, for every node of `view`, whether it computes in 16-bit.

    Args:
      view: the graph and its function library (see ``graph.build_view``).
      config: target dtype, op lists, overrides.
      outputs: tensor names ("node:0") of the top graph whose dtype callers
        rely on; their producers keep their types.
      keep: (function, node) -> (reason, kind) for nodes that must stay
        float32: an edit's own float32 nodes (``node_edits.EditedGraph``) and
        those the pass's self-check found would make an invalid graph.
      shapes: tensor shapes (``shapes.tensor_shapes``). Where known, the choices
        the rules leave open go to the option that moves fewer bytes; without
        them, to the one with fewer Casts.
      runtime: "executor" or "xla", what a Cast costs in those choices
        (``runtime_cost``: a launch on the executor; nothing next to an
        element-wise op under XLA); None resolves ``config.runtime`` ("auto"
        is the executor here: the caller knows whether XLA compiles).
      input_magnitudes: top-graph Placeholder -> the largest magnitude of what
        it is fed, where known (``pipeline.rewrite_graph_def``): one past the
        16-bit range is a sentinel, as a constant's is.

    Returns:
      A Coloring with one Decision per node.
    """
    runtime = runtime_cost.resolve_runtime(runtime or config.runtime)
    pinned_outputs = {_parse_tensor_name(name) for name in outputs}
    keep = keep or {}
    # boundaries.solve colours a body once per set of overrides it weighs (an
    # LSTM step's loop bodies dozens of times); what does not depend on the
    # overrides is worked out once per body (see _Skeleton).
    skeletons: dict[str, _Skeleton] = {}
    # The bodies XLA compiles, whose ops need XLA kernels for their types too.
    xla_compiled = compiled.xla_compiled(view, runtime)

    def color_body(body: Body, overrides: boundaries.BodyOverrides):
        body_pins = pinned_outputs if not body.is_function else set()
        original = boundaries.original_function_name(body.name)
        body_keep = {node: why for (fn, node), why in keep.items()
                     if boundaries.original_function_name(fn) == original}
        counts = {}
        if shapes is not None:  # (a copy of a function has its original's shapes)
            counts = shapes.counts(body.name if shapes.shapes.get(body.name) else original,
                                   body)
        body_coloring = _BodyColoring(body, config, body_pins, body_keep, counts,
                                      overrides, skeletons, runtime,
                                      original in xla_compiled,
                                      {} if body.is_function else input_magnitudes)
        decisions = body_coloring.run()
        denied = {(body_coloring.slot_node[s], body_coloring.slot_attr[s]): reason
                  for s, (reason, _, _) in body_coloring.deny.items()}
        hard = {slot: why for slot, (why, _) in body_coloring.hard_blocked.items()}
        return (decisions, {**denied, **hard, **body_coloring.boundary_blocked},
                body_coloring.ranged_members())

    solution = boundaries.solve(view, config, pinned_outputs, color_body, xla_compiled)
    return Coloring(target=config.target_enum, decisions=solution.decisions,
                    signatures=solution.signatures, clones=solution.clones,
                    call_targets=solution.call_targets)


def _parse_tensor_name(name: str) -> TensorRef:
    node, _, index = name.partition(":")
    return TensorRef(node, int(index) if index else 0)


@dataclasses.dataclass
class _Skeleton:
    """A body's slots before boundary overrides, and its slot edges as keys.

    The same body, config, pins and `keep` give the same slots, blocks and
    edges; only ``_make_boundary_slots`` (and so the pseudo-slots edges may
    reach) depends on the overrides. Read-only once made: each colouring
    copies what it changes.
    """

    body: Body
    slot_node: list[str]
    slot_attr: list[str]
    slot_list: list[str]
    slot_index: dict[tuple[str, str], int]
    blocked: dict[int, tuple[str, str]]
    node_blocks: dict[str, tuple[str, str]]
    hard_blocked: dict[tuple[str, str], tuple[str, str]]
    # Every data edge into a slotted node that can link two slots, in the
    # order _connect meets them: (consumer slot key, producer slot key); a
    # key may name a pseudo-slot that only some overrides create. None until
    # a second colouring of the body needs them.
    edges: list[tuple[tuple[str, str], tuple[str, str]]] | None = None
    # slot -> its deny decision where the op's range makes it a deny op
    # (value_ranges.rsqrt_overflow)
    range_denied: dict[int, tuple[str, str, str]] | None = None
    # tensor -> the constant past the 16-bit range it carries (value_ranges.sentinels)
    sentinel_carrying: dict | None = None


class _BodyColoring:
    """Colours one body. Slots are ints; slot i is (node, type attribute)."""

    def __init__(self, body: Body, config: AmpConfig, pinned: set[TensorRef],
                 keep: Mapping[str, tuple[str, str]] | None = None,
                 counts: dict | None = None,
                 overrides: boundaries.BodyOverrides | None = None,
                 skeletons: dict[str, _Skeleton] | None = None,
                 runtime: str = "executor", xla_compiled: bool = False,
                 input_magnitudes: Mapping[str, float] | None = None):
        self.body = body
        # Placeholder -> the largest magnitude it is fed, where known (a capture)
        self.input_magnitudes = input_magnitudes or {}
        self.runtime = runtime
        # Whether XLA compiles the body: its ops need XLA kernels for their types.
        self.xla_compiled = xla_compiled
        # What a Cast costs beyond its bytes in the byte choices (_costs): a
        # launch, in byte-equivalents; under XLA none next to an element-wise
        # op (see runtime_cost), where _fusible says which nodes are.
        self.launch_bytes = runtime_cost.MODELS[runtime].launch_bytes
        self._fusible: dict[str, int] | None = {} if runtime == "xla" else None
        self.overrides = overrides or boundaries.BodyOverrides()
        self.forced: dict[int, tuple[str, str, str]] = {}  # slot -> (reason, cause, kind)
        self.keep = keep or {}
        # tensor -> its elements (shapes.elements_of), None where unknown
        self.counts = counts or {}
        # slot -> (why float32, cause, kind), for slots the byte count kept float32
        self.kept: dict[int, tuple[str, str, str]] = {}
        self._refs_by_slot: dict[int, tuple[list[TensorRef], list[TensorRef]]] = {}
        # result tensor -> the dtypes (16-bit?) its results leave in
        self._ret_wants: dict[TensorRef, set[bool]] = {}
        for ret, (ref, _, _) in body.rets.items():
            self._ret_wants.setdefault(ref, set()).add(ret in self.overrides.rets)
        self._order: list[int] | None = None
        self._infer_slots: list[int] | None = None  # infer-list slots, in _order
        self._neighbours: list[list[int]] | None = None  # fanin + fanout of each slot
        self.config = config
        self.lists = config.op_lists
        self.target = config.target_enum
        self.target_name = dtype_name(self.target)
        # Whether a chain after a 16-bit op may take in arithmetic on variable
        # reads (an optimizer's moment and weight updates): in bfloat16 only,
        # see _region_stops_at.
        # Under XLA the update is one fusion from the float32 variables to
        # their float32 assignments: 16-bit arithmetic inside it saves nothing.
        self.regions_read_variables = self.target == DT_BFLOAT16 and runtime != "xla"
        self.keep_patterns = [re.compile(p) for p in config.keep_fp32]
        self.device_type = kernels.resolve_device_type(config.device_type)
        self.slot_node: list[str] = []
        self.slot_attr: list[str] = []
        self.slot_list: list[str] = []
        self.slot_index: dict[tuple[str, str], int] = {}
        # Reasons are (sentence, kind) pairs; kinds are tfamp.rewrite.reasons.KIND_*.
        self.blocked: dict[int, tuple[str, str]] = {}  # slot -> why it cannot be 16-bit
        # node -> why none of it can be 16-bit; ("", "") when nothing blocks it
        self.node_blocks: dict[str, tuple[str, str]] = {}
        # (node, type attribute) -> (reason, kind): blocks boundaries cannot lift
        self.hard_blocked: dict[tuple[str, str], tuple[str, str]] = {}
        # (op, type attribute, device) -> _attr_block's answer
        self._attr_blocks: dict[tuple[str, str, str], tuple[str, str]] = {}
        # (id of input port list, id of output port list) -> "resource", "ref" or ""
        self._variable_ports: dict[tuple[int, int], str] = {}
        # tensor -> the constant past the 16-bit range it carries (value_ranges.sentinels)
        self._sentinel_carrying: dict[TensorRef, float] = {}
        skeleton = skeletons.get(body.name) if skeletons is not None else None
        if skeleton is None or skeleton.body is not body:
            self._make_slots(pinned)
            skeleton = _Skeleton(
                body, list(self.slot_node), list(self.slot_attr), list(self.slot_list),
                dict(self.slot_index), dict(self.blocked), self.node_blocks,
                self.hard_blocked, range_denied=self._range_denied,
                sentinel_carrying=self._sentinel_carrying)
            if skeletons is not None:
                skeletons[body.name] = skeleton
            fresh = True
        else:
            fresh = False
            self.slot_node = list(skeleton.slot_node)
            self.slot_attr = list(skeleton.slot_attr)
            self.slot_list = list(skeleton.slot_list)
            self.slot_index = dict(skeleton.slot_index)
            self.blocked = dict(skeleton.blocked)
            self.node_blocks = skeleton.node_blocks
            self.hard_blocked = skeleton.hard_blocked
            self._range_denied = skeleton.range_denied or {}
            self._sentinel_carrying = skeleton.sentinel_carrying or {}
        base_slots = len(self.slot_node)
        # tensors carrying a sentinel from another body (_boundary_sentinels), and
        # the slots it blocks here: (node, type attribute) -> why
        self._boundary_carrying: dict[TensorRef, float] = {}
        self.boundary_blocked: dict[tuple[str, str], str] = {}
        self._make_boundary_slots()
        self.fanin: list[list[int]] = [[] for _ in self.slot_node]
        self.fanout: list[list[int]] = [[] for _ in self.slot_node]
        added_nodes = set(self.slot_node[base_slots:]).difference(skeleton.slot_node)
        if fresh or any(name in body.nodes for name in added_nodes):
            # (a forced slot on a node that had none has no edges in the keys)
            self._connect()
        else:
            if skeleton.edges is None:  # a body coloured once never needs them
                skeleton.edges = self._edge_keys(skeleton.slot_node)
            self._connect(skeleton.edges)
        self.allow: dict[int, tuple[str, str, str]] = {}  # slot -> (reason, cause, kind)
        self.deny: dict[int, tuple[str, str, str]] = {}
        # slot -> the op whose range holds it float32 (an Rsqrt past the 16-bit
        # range, here or in another body): the range-denied roots and what they hold
        self.range_held: dict[int, str] = {}
        self._ranged_args: dict[str, str] = {}  # float32 argument -> the same, for its readers
        self._range_readers: dict[int, str] = {}  # other slots reading such an argument
        self._statistics: list[int] = []  # deny reductions with a small output
        self._centring: set[int] = set()  # ... whose result is subtracted from big tensors
        self._bounded: set[int] = set()  # statistics within their input's range (means)
        self._bounded_exps: list[int] | None = None  # (_add_bounded_exps)
        # FusedBatchNorm nodes in training mode: their "U" outputs are
        # statistics, held as a Mean's are where the lists hold a Mean (float16;
        # bfloat16 has float32's range, and Mean and Sum are infer there, except
        # under XLA: _xla_statistics).
        self._fused_normalisations = [
            name for name, node in body.nodes.items()
            if node.op in FUSED_NORMALISATION_OPS and node.node_def.attr["is_training"].b
        ] if body.ops & FUSED_NORMALISATION_OPS else []

    # -- building -------------------------------------------------------------

    def _make_slots(self, pinned: set[TensorRef]) -> None:
        pinned_nodes = {ref.node for ref in pinned}
        self._range_denied: dict[int, tuple[str, str, str]] = {}  # (value_ranges.rsqrt_overflow)
        list_of = self.lists.list_of
        slot_node, slot_attr, slot_list = self.slot_node, self.slot_attr, self.slot_list
        slot_index, node_blocks = self.slot_index, self.node_blocks
        # Only a body with TF1 reference variables has ref ports to look for
        # on every input (port lists are shared: see graph._PortResolver).
        self._has_ref_ports = any(
            port.is_ref for ports in {id(n.outputs): n.outputs
                                      for n in self.body.nodes.values()}.values()
            for port in ports)
        node_block_of, attr_block, blocked = self._node_block, self._attr_block, self.blocked
        attr_blocks = self._attr_blocks
        positions: dict[str, bool] = {}  # node -> computes from positions only?
        sentinel_readers, self._sentinel_carrying = value_ranges.sentinels(
            self.body, float(dtypes.as_dtype(self.target).max), self.input_magnitudes)
        tied = (tied_output.tied_vocabulary_products(self.body)
                if self.target == DT_BFLOAT16 else {})
        no_block = ("", "")
        for name, node in self.body.nodes.items():
            list_name = list_of(node.op)
            if list_name != "clear" and node.op in SIZE_KEEPING_COPIES and value_ranges.copies(
                    self.body, self.counts, node):
                list_name = "clear"
            elif list_name == "deny" and node.op == "Exp" and value_ranges.exp_bound(
                    self.body, node) is not None:
                list_name = "infer"
            overflow = (value_ranges.rsqrt_overflow(self.body, self.counts, node, self.target)
                        if node.op in GROWING_INVERSES else "")
            if overflow:
                list_name = "deny"
            attrs = node.float_type_attrs
            call_block = self._call_block(node) if node.called_functions else no_block
            node_block = node_blocks[name] = node_block_of(name, node, call_block)
            for attr in attrs:
                slot = len(slot_node)
                slot_node.append(name)
                slot_attr.append(attr)
                slot_list.append(list_name)
                slot_index[(name, attr)] = slot
                if overflow:
                    self._range_denied[slot] = (f"deny: {overflow}", "", rk.KIND_DENY_LIST)
                if node_block[0]:
                    block = node_block
                else:  # (_attr_block's cache, looked up here: every float slot)
                    block = attr_blocks.get((node.op, attr, node.node_def.device))
                    if block is None:
                        block = attr_block(node, attr)
                    beyond = None if block[0] else sentinel_readers.get(name)
                    if beyond is not None:
                        block = (
                            f"stays float32: reads {beyond:.3g} (a constant, such as a "
                            f"mask's sentinel), past {self.target_name}'s largest value "
                            f"{float(dtypes.as_dtype(self.target).max):.5g}: in "
                            f"{self.target_name} it is inf, and a softmax row of -inf (a "
                            f"padded query's) is NaN", rk.KIND_BEYOND_RANGE)
                    if not block[0] and list_name == "allow" and self._on_positions(
                            name, positions):
                        block = (
                            f"stays float32: computes from positions, indices and constants "
                            f"only (no float input, no variable), such as a rotary "
                            f"embedding's angles; {self.target_name} would round positions "
                            f"above {_EXACT_INTEGERS[self.target]} and the angles' phase",
                            rk.KIND_POSITIONS)
                    if not block[0] and list_name == "allow" and name in tied:
                        block = (
                            f"stays float32: a product of a tied output layer "
                            f"(hidden @ table^T, or one of its gradients), whose table "
                            f"{tied[name]!r} also reads; the gradient it carries back is "
                            f"a small difference of large sums, which bfloat16's "
                            f"rounding of the table and the logits' gradient spoils, "
                            f"and Keras's bfloat16 policy computes it in float32 too",
                            rk.KIND_TIED_VOCABULARY)
                if block[0]:
                    blocked[slot] = block
                    # Blocks boundaries.solve may lift for a whole group: a
                    # call's signature, a TensorList's element type.
                    if block not in (call_block, self._fixed_block(node, attr)):
                        self.hard_blocked[(name, attr)] = block
            if name not in pinned_nodes:
                continue
            for index, port in enumerate(node.outputs):
                if TensorRef(name, index) in pinned and port.type_attr in attrs:
                    slot = self.slot_index[(name, port.type_attr)]
                    self.blocked.setdefault(slot, (
                        "kept float32: a graph output keeps its dtype", rk.KIND_GRAPH_OUTPUT))
                    self.hard_blocked[(name, port.type_attr)] = self.blocked[slot]

    def _add_slot(self, name: str, attr: str, list_name: str) -> int:
        slot = len(self.slot_node)
        self.slot_node.append(name)
        self.slot_attr.append(attr)
        self.slot_list.append(list_name)
        self.slot_index[(name, attr)] = slot
        return slot

    def _make_boundary_slots(self) -> None:
        """Applies boundaries.solve's decisions (see BodyOverrides).

        Forced slots are 16-bit seeds; 16-bit arguments and results get
        pseudo-slots (named ``boundaries.arg_slot_name(...)``) so edges to them
        take part in the passes like edges to any 16-bit op.
        """
        ov = self.overrides
        for node, attr, reason in ov.blocked:
            slot = self.slot_index.get((node, attr))
            if slot is not None:
                self.blocked[slot] = (reason, rk.KIND_TF1_FRAME)
        for node, attr, reason in ov.forced:
            slot = self.slot_index.get((node, attr))
            if slot is None:  # a type attribute with no float port (EmptyTensorList)
                slot = self._add_slot(node, attr, "boundary")
            self.blocked.pop(slot, None)
            self.slot_list[slot] = "boundary"
            self.forced[slot] = (reason, "", rk.KIND_BOUNDARY)
        for arg in sorted(ov.args):
            slot = self._add_slot(boundaries.arg_slot_name(arg), "T", "boundary")
            self.forced[slot] = (f"argument {arg!r} arrives {self.target_name}", "",
                                 rk.KIND_BOUNDARY)
        for ret in sorted(ov.rets):
            slot = self._add_slot(boundaries.ret_slot_name(ret), "T", "boundary")
            self.forced[slot] = (f"result {ret!r} leaves {self.target_name}", "",
                                 rk.KIND_BOUNDARY)
        if any(kind == boundaries.SENTINEL for _, _, kind, _ in ov.ranged):
            self._boundary_sentinels()

    def _boundary_sentinels(self) -> None:
        """What reads a tensor that carries a constant past the 16-bit range from
        another body (BodyOverrides.ranged, kind SENTINEL: an additive mask,
        ``(1 - mask) * -1e9``, computed outside a loop or function and read
        inside) stays float32, as the constant's readers do in its own body
        (value_ranges.sentinels): in 16-bit it is -inf, and a fully masked softmax
        row NaN."""
        nodes, args = self.body.nodes, self._args_by_slot_name()
        seeds: dict[TensorRef, float] = {}
        causes: dict[float, str] = {}
        for node, attr, kind, cause in self.overrides.ranged:
            if kind != boundaries.SENTINEL:
                continue
            value = boundaries.sentinel_value(cause)
            causes.setdefault(value, cause)
            if node in args:
                seeds[TensorRef(args[node], 0, is_arg=True)] = value
            elif node in nodes:
                for index, port in enumerate(nodes[node].outputs):
                    if port.type_attr == attr:
                        seeds[TensorRef(node, index)] = value
        if not seeds:
            return
        readers, self._boundary_carrying = value_ranges.walk_sentinels(self.body, seeds)
        largest = float(dtypes.as_dtype(self.target).max)
        for name, value in readers.items():
            for attr in nodes[name].float_type_attrs:
                slot = self.slot_index.get((name, attr))
                if slot is None or slot in self.blocked or slot in self.forced:
                    continue
                why = (f"stays float32: reads {causes[value]}, such as a mask's sentinel, "
                       f"past {self.target_name}'s largest value {largest:.5g}: in "
                       f"{self.target_name} it is inf, and a softmax row of -inf (a padded "
                       f"query's) is NaN")
                self.blocked[slot] = (why, rk.KIND_BEYOND_RANGE)
                self.boundary_blocked[(name, attr)] = why

    def _args_by_slot_name(self) -> dict[str, str]:
        """Pseudo-slot name (boundaries.arg_slot_name, as BodyOverrides names
        arguments) -> the body's argument."""
        return {boundaries.arg_slot_name(arg): arg for arg in self.body.arg_dtypes}

    def _node_block(self, name: str, node, call_block: tuple[str, str]) -> tuple[str, str]:
        """(why no slot of `node` can be 16-bit, reason kind), or ("", "").

        `call_block` is ``_call_block(node)``."""
        if name in self.keep:
            return self.keep[name]
        if rk.LOSS_SCALE_ATTR in node.node_def.attr:
            return ("kept float32: part of the loss-scale machinery (the scale, its seed and "
                    "update, unscaling, the finiteness check) reads float32 values",
                    rk.KIND_LOSS_SCALE)
        for pattern in self.keep_patterns:
            if pattern.search(name):
                return (f"kept float32: name matches keep_fp32 pattern {pattern.pattern!r}",
                        rk.KIND_USER_OVERRIDE)
        if not node.known_op:
            return f"unknown op {node.op!r}: no OpDef, left as it is", rk.KIND_UNKNOWN_OP
        if call_block[0]:
            return call_block
        # Nodes with the same ports share their port lists (graph._PortResolver):
        # look at each pair of lists once. (Keyed by id: the lists live as long
        # as the body.)
        key = (id(node.inputs), id(node.outputs))
        variable = self._variable_ports.get(key)
        if variable is None:
            ports = node.inputs + node.outputs
            variable = self._variable_ports[key] = (
                "resource" if any(p.dtype == types_pb2.DT_RESOURCE for p in ports)
                else "ref" if any(p.is_ref for p in ports) else "")
        if variable == "resource":
            return ("variable op: master weights and their reads stay float32",
                    rk.KIND_VARIABLE)
        if variable == "ref":
            return ("variable op (TF1 reference variable): master weights and their "
                    "reads stay float32", rk.KIND_VARIABLE)
        nodes = self.body.nodes
        for ref, _ in node.data_inputs:
            producer = None if ref.is_arg else nodes.get(ref.node)
            if producer is not None and ref.index < len(producer.outputs):
                if self._has_ref_ports and producer.outputs[ref.index].is_ref:
                    return (f"variable op: reads reference variable {ref.node!r}; master "
                            f"weights and their reads stay float32", rk.KIND_VARIABLE)
                continue
            if self.body.producer_port(ref) is None:  # (an argument, or unknown)
                return f"input {ref.node!r} has no known type: left float32", rk.KIND_UNKNOWN_INPUT
        if node.op in DATA_BOUND_OPS and self.lists.list_of(node.op) != "unlisted":
            return (f"kept as it is: {node.op}'s dtype is bound to its data "
                    f"({DATA_BOUND_OPS[node.op]})", rk.KIND_DATA_BOUND)
        device = node.node_def.device
        if device and self.device_type == "GPU" and node.float_type_attrs:
            # grappler leaves nodes off the target device alone too: a node
            # pinned to the CPU in a GPU graph would need a CPU 16-bit kernel,
            # slow where there is one at all.
            placed = kernels.node_device_type(device, "GPU")
            if placed != "GPU":
                return (f"placed on {device!r} ({placed}), off the target GPU: left "
                        f"as it is", rk.KIND_OFF_DEVICE)
        return "", ""

    @staticmethod
    def _call_block(node) -> tuple[str, str]:
        if not node.called_functions:
            return "", ""
        called = ", ".join(repr(f) for f in dict.fromkeys(node.called_functions))
        return (f"calls {called}: its signature is kept and the body is "
                f"rewritten on its own", rk.KIND_FUNCTION_CALL)

    @staticmethod
    def _fixed_block(node, attr: str) -> tuple[str, str]:
        if attr not in FIXED_TYPE_ATTRS.get(node.op, ()):
            return "", ""
        return (f"{attr} stays float32: a TensorList's element type must "
                f"match every op that touches the list", rk.KIND_TENSOR_LIST)

    def _attr_block(self, node, attr: str) -> tuple[str, str]:
        """(why type attribute `attr` of `node` cannot be 16-bit, kind), or ("", "")."""
        device = node.node_def.device
        # The answer depends only on the op, the attribute and the device; the
        # kernel registry is slow to ask and a step has thousands of alike nodes.
        key = (node.op, attr, device)
        if key not in self._attr_blocks:
            self._attr_blocks[key] = self._attr_block_of(node, attr, device)
        return self._attr_blocks[key]

    def _attr_block_of(self, node, attr: str, device: str) -> tuple[str, str]:
        base_attr = attr.split("[")[0]
        if not kernels.opdef_allows(node.op, base_attr, self.target):
            return (f"{node.op}'s OpDef does not allow {self.target_name} for {base_attr}",
                    rk.KIND_NO_KERNEL)
        device_type = kernels.node_device_type(device, self.device_type)
        missing = kernels.missing_kernel(node.op, base_attr, self.target, device_type,
                                         self.xla_compiled)
        if missing:
            where = f" on its device {device!r}" if device else ""
            if missing != device_type:
                where += ", and XLA compiles this function"
            return (f"no {self.target_name} {missing} kernel "
                    f"for {node.op} ({base_attr}){where}", rk.KIND_NO_KERNEL)
        inexact = INEXACT_16BIT_KERNELS.get(node.op)
        if inexact and not self.xla_compiled:
            return (f"no exact {self.target_name} kernel for {node.op}: TensorFlow's "
                    f"{inexact} (XLA's is exact: jit_compile keeps it 16-bit)",
                    rk.KIND_NO_KERNEL)
        return self._fixed_block(node, attr)

    def _edge_keys(self, base_slot_node: list[str]
                   ) -> list[tuple[tuple[str, str], tuple[str, str]]]:
        """The slot edges as keys, given the slots before boundary slots
        (see _Skeleton.edges)."""
        edges = []
        slotted = set(base_slot_node)
        for name, node in self.body.nodes.items():
            if name not in slotted:
                continue
            inputs = node.inputs
            for index, (ref, _) in enumerate(node.data_inputs):
                dst_key = (name, inputs[index].type_attr if index < len(inputs) else None)
                if ref.is_arg:
                    edges.append((dst_key, (boundaries.arg_slot_name(ref.node), "T")))
                    continue
                port = self.body.producer_port(ref)
                if port is not None and port.dtype == DT_FLOAT:
                    edges.append((dst_key, (ref.node, port.type_attr)))
        return edges

    def _connect(self, edge_keys=None) -> None:
        if edge_keys is not None:  # the same edges, as _edge_keys found them
            slot_index, fanin, fanout = self.slot_index, self.fanin, self.fanout
            for dst_key, src_key in edge_keys:
                dst = slot_index.get(dst_key)
                if dst is not None:
                    src = slot_index.get(src_key)
                    if src is not None:
                        fanout[src].append(dst)
                        fanin[dst].append(src)
            self._connect_rets()
            return
        # Most nodes of a training step have no float slot (variable reads, shape
        # arithmetic, integer ops): only edges into a slot can connect two.
        slotted = set(self.slot_node)
        nodes, slot_index, fanin, fanout = self.body.nodes, self.slot_index, self.fanin, self.fanout
        for name, node in nodes.items():
            if name not in slotted:
                continue
            inputs = node.inputs
            for index, (ref, _) in enumerate(node.data_inputs):
                dst_attr = inputs[index].type_attr if index < len(inputs) else None
                dst = slot_index.get((name, dst_attr))
                if dst is None:
                    continue
                if ref.is_arg:
                    src = slot_index.get((boundaries.arg_slot_name(ref.node), "T"))
                    if src is not None:
                        fanout[src].append(dst)
                        fanin[dst].append(src)
                    continue
                # (Body.producer_port, written out: this visits every edge)
                producer = nodes.get(ref.node)
                if producer is None or ref.index >= len(producer.outputs):
                    continue
                port = producer.outputs[ref.index]
                if port.dtype != DT_FLOAT:
                    continue
                src = slot_index.get((ref.node, port.type_attr))
                if src is not None:
                    fanout[src].append(dst)
                    fanin[dst].append(src)
        self._connect_rets()

    def _connect_rets(self) -> None:
        for ret in self.overrides.rets:
            dst = self.slot_index[(boundaries.ret_slot_name(ret), "T")]
            ref = self.body.rets[ret][0]
            if ref.is_arg:
                src = self.slot_index.get((boundaries.arg_slot_name(ref.node), "T"))
            else:
                port = self.body.producer_port(ref)
                src = self.slot_index.get((ref.node, port.type_attr)) if port else None
            if src is not None:
                self.fanout[src].append(dst)
                self.fanin[dst].append(src)

    # -- the passes -----------------------------------------------------------

    def run(self) -> dict[tuple[str, str], Decision]:
        can = self._candidate
        for slot, list_name in enumerate(self.slot_list):
            if list_name == "allow" and can(slot):
                self.allow[slot] = (
                    f"allow: compute-heavy, runs in {self.target_name}", "", rk.KIND_ALLOW)
        self.allow.update(self.forced)
        self._propagate_deny()
        self._hold_variable_updates()
        self._add_between_allow()
        self._hold_sums_read_by_reductions()
        # Infer after 16-bit and clear propagation feed each other (an infer op
        # whose clear neighbour goes 16-bit later now has two 16-bit inputs):
        # repeat both until nothing changes (at most a few rounds).
        for _ in range(_MAX_ROUNDS):
            before = len(self.allow)
            self._add_infer_after_allow()
            self._add_statistic_readers()
            self._add_bounded_exps()
            self._propagate_through_clear()
            if len(self.allow) == before:
                break
        self._read_16bit_statistics()
        self._read_cast_products()
        self._retarget_casts()
        return self._decisions()

    def _candidate(self, slot: int) -> bool:
        return slot not in self.blocked

    def _on_positions(self, name: str, positions: dict[str, bool]) -> bool:
        """Does node `name` compute from positions, indices and constants only:
        is every float tensor it reads derived from constants, `Range`s and
        integer tensors (cast), never from a float argument or placeholder, a
        variable, a random op or a call?

        Such values do not depend on the step's data, and they are often large
        exact numbers: a rotary embedding's angles are positions x inverse
        frequencies (keras-hub computes them in float32 on purpose, then casts
        cos and sin), where float16 rounds the angle of position 255 by 0.1 rad,
        turns every position past 65504 into inf (NaN after cos), and bfloat16
        rounds positions above 256. They are small (no batch axis), so float32
        costs nothing that matters. `positions`: the answers so far (node ->
        bool), filled in; a body's slots are made once (_Skeleton), so once.
        """
        if name in positions:
            return positions[name]
        nodes, arg_dtypes, producer_port = (
            self.body.nodes, self.body.arg_dtypes, self.body.producer_port)

        def float_inputs(node):
            """The producers of `node`'s float inputs, or None if one rules it out."""
            found = []
            for ref, _ in node.data_inputs:
                if ref.is_arg:
                    dtype = arg_dtypes.get(ref.node)
                else:
                    port = producer_port(ref)
                    dtype = None if port is None else port.dtype
                if dtype is None or dtype in _OPAQUE_TYPES:
                    return None
                if dtype not in REAL_TYPES:
                    continue  # an integer or bool tensor: an index, whatever made it
                if ref.is_arg or positions.get(ref.node) is False or not (
                        ref.node in nodes and _may_compute_positions(nodes[ref.node])):
                    return None  # (a float argument: the step's data)
                found.append(ref.node)
            return found

        # Depth-first, one unknown input at a time (an input that rules the node
        # out is found before anything is walked); iterative: chains are long.
        stack, on_stack = [name], {name}
        while stack:
            current = stack[-1]
            node = nodes.get(current)
            inputs = (float_inputs(node) if node is not None and _may_compute_positions(node)
                      else None)
            result = inputs is not None
            if result:
                unknown = next((n for n in inputs if n not in positions), None)
                if unknown is not None and unknown not in on_stack:
                    stack.append(unknown)
                    on_stack.add(unknown)
                    continue
                result = unknown is None  # (an input on the stack: a cycle)
            positions[current] = result
            stack.pop()
            on_stack.discard(current)
        return positions[name]

    def _propagate_deny(self) -> None:
        """Deny ops stay float32, and so do the infer/clear ops downstream of them.

        Except after a statistic: a reduction (oplists.STATISTIC_REDUCTIONS)
        whose output is at least _STATISTIC_RATIO times smaller than its input
        accumulates in float32 (its input is cast to float32), and float32
        spreads from its output only through ops whose results are that small
        too (the mean's Reshape, var + eps, a moving-average update). An op
        that reads the statistic and writes a big tensor (x - mean,
        x * rsqrt(var + eps) * gamma, + beta, then ReLU and the residual Add)
        is left to the later rules, which cast the small statistic instead of
        the big activation. Why that is safe in 16-bit: BUILD_NOTES.md,
        "Session 7".
        """
        lists = self.slot_list
        roots = [s for s, ls in enumerate(lists) if ls in ("deny", "infer")]
        leads_to_deny_or_infer = set(_dfs(
            roots, self.fanin,
            lambda s: lists[s] == "clear"))
        for root in (s for s, ls in enumerate(lists) if ls == "deny"):
            root_node = self.body.nodes[self.slot_node[root]]
            if root in self._range_denied:
                self.deny.setdefault(root, self._range_denied[root])
            self.deny.setdefault(root, (
                f"deny: numerically risky in {self.target_name}", "", rk.KIND_DENY_LIST))
            cause = f"{root_node.op} {root_node.name!r}"
            reduced = self._statistic_input(root_node)
            if reduced is None:
                # (a range-denied root holds every infer/clear op after it up to an
                # allow op, clear ops that lead only to allow ops included: a ReLU's
                # gradient multiplies what it reads by 0, and inf * 0 is NaN)
                ranged = root in self._range_denied
                for slot in _dfs([root], self.fanout, lambda s, ranged=ranged: (
                        s not in self.deny and (ranged or s in leads_to_deny_or_infer)
                        and lists[s] in ("infer", "clear"))):
                    if slot != root:
                        self.deny[slot] = (f"deny: downstream of {cause}", root_node.name,
                                           rk.KIND_DOWNSTREAM_OF_DENY)
                    if ranged:
                        self.range_held[slot] = f"{cause} (in {self.body.name or 'the graph'!r})"
                if ranged and value_ranges.one_element_variance(self.body, self.counts, root_node):
                    self._hold_inverse_gradient(root, root_node, cause)
                continue
            self._add_statistic(root, root_node, reduced, leads_to_deny_or_infer, (
                f"deny: accumulates in float32; its output is a statistic of its "
                f"{format_elements(reduced)}-element input, so only ops as small "
                f"as it stay float32 after it", "", rk.KIND_DENY_LIST))
        self._hold_ranged_boundaries()
        self._xla_statistics(leads_to_deny_or_infer)
        # A fused normalisation's batch mean and variance (its float32 "U"
        # outputs) are statistics of its input too: where a Mean's are held,
        # and under XLA in bfloat16 as _xla_statistics holds a Mean's. Under
        # XLA the layer's own ops compute y from them (fuse_norm's statistics
        # edit), and they are bounded as the Means they replace: what reads the
        # variance is small up to the Rsqrt (whose own range rule holds it).
        mean_denied = self.lists.list_of("Mean") == "deny"
        xla = self._fusible is not None
        if not (mean_denied or (self.target == DT_BFLOAT16 and xla)):
            return
        for name in self._fused_normalisations:
            root = self.slot_index.get((name, "U"))
            root_node = self.body.nodes[name]
            reduced = self.counts.get(root_node.data_inputs[0][0])
            if root is not None and reduced is not None:
                self._after_statistic(root, root_node, reduced, leads_to_deny_or_infer,
                                      ranges=mean_denied, bounded=xla)

    def _hold_inverse_gradient(self, root: int, root_node, cause: str) -> None:
        """What computes the gradient an Rsqrt over one element receives stays
        float32, up to the next allow op.

        Its gradient is ``sum(dy * x) - sum(dy * mean)`` (through ``x * inv`` and
        ``mean * inv``), 0 exactly in float32 where x is its own mean, and
        RsqrtGrad multiplies it by ``-inv^3 / 2`` (5e8 at eps 1e-6). With one term
        in 16 bits and the other in float32 the difference is a rounding error
        that the 5e8 took past float16's range, and the variance's gradient (inf)
        times ``x - mean`` (0) made the input's gradient NaN: measured with an
        unknown batch, once a broadcast gradient's Sums were copies
        (``shapes.broadcast_sum_counts``). The forward hold (``_propagate_deny``) does not
        reach these ops: they read dy and the forward values, not the Rsqrt. The
        walk goes against the data from RsqrtGrad's gradient input, not into the
        values the Rsqrt is computed from, through ops no bigger than the
        normalised tensor (BUILD_NOTES.md, session 39)."""
        nodes, lists = self.body.nodes, self.slot_list
        starts = []
        for consumer, index in self.body.consumers.get(TensorRef(root_node.name, 0), ()):
            node = nodes[consumer]
            if index == 0 and node.op in INVERSE_GRADIENTS and len(node.data_inputs) > 1:
                slot = self._slot_of(node.data_inputs[1][0])
                if slot is not None:
                    starts.append(slot)
        if not starts:
            return
        forward = set(_dfs([root], self.fanin, lambda s: True))
        size = self.counts.get(TensorRef(root_node.name, 0))

        def enter(s):
            return (s not in forward and s not in self.deny and lists[s] in ("infer", "clear")
                    and self._no_bigger(s, size))
        for slot in _dfs([s for s in starts if enter(s)], self.fanin, enter):
            self.deny[slot] = (f"deny: feeds the gradient of {cause}, which that gradient "
                               f"multiplies by inv^3 / 2", root_node.name,
                               rk.KIND_DOWNSTREAM_OF_DENY)

    def _hold_ranged_boundaries(self) -> None:
        """What reads a boundary value that another body holds float32 for its
        range (BodyOverrides.ranged: an l2 normalisation's rsqrt, 1e6 on a
        zero row, that a loop pushes to its accumulator and the gradient loop
        pops, or a forward function returns to the gradient function) stays
        float32 up to the next allow op, as it does in that body: the gradient
        multiplies it by dy, and a ReLU's gradient that by 0 (inf * 0 is NaN).
        """
        if not self.overrides.ranged:
            return
        lists, nodes = self.slot_list, self.body.nodes
        args = self._args_by_slot_name()
        for node, attr, kind, cause in self.overrides.ranged:
            if kind != boundaries.RANGE_HOLD:
                continue
            slot = self.slot_index.get((node, attr))
            if slot is not None:
                starts = [slot]
            elif node in args:  # (a float32 argument has no slot: its readers')
                starts = []
                for consumer, index in self.body.consumers.get(
                        TensorRef(args[node], 0, is_arg=True), ()):
                    inputs = nodes[consumer].inputs
                    reader = (self.slot_index.get((consumer, inputs[index].type_attr))
                              if index < len(inputs) else None)
                    if reader is None:
                        continue
                    if lists[reader] in ("infer", "clear"):
                        starts.append(reader)
                    else:  # (a call passing it on: its group carries it too)
                        self._range_readers.setdefault(reader, cause)
                self._ranged_args[args[node]] = cause
            else:
                continue
            for held in _dfs(starts, self.fanout, lambda s: (
                    s not in self.deny and lists[s] in ("infer", "clear"))):
                self.deny.setdefault(held, (
                    f"deny: carries the value of {cause}, held float32 for its range",
                    "", rk.KIND_DOWNSTREAM_OF_DENY))
                self.range_held.setdefault(held, cause)

    def ranged_members(self) -> dict[tuple, tuple[str, str]]:
        """The boundary members that carry a value this body keeps float32 for its
        range (see boundaries._Solver.spread_range_holds), each -> (kind, cause):

        * boundaries.RANGE_HOLD: the slots an rsqrt past the range holds, the
          slots that read them (a TensorList push, a call's argument), and the
          results that return them; the cause names the rsqrt;
        * boundaries.SENTINEL: the slots that read a tensor carrying a constant
          past the range (a mask's -1e9: a loop's or a call's argument), and the
          results that return one; the cause names the value.
        """
        members: dict[tuple, tuple[str, str]] = {}
        slot_node, slot_attr, slot_index = self.slot_node, self.slot_attr, self.slot_index
        carrying = {**self._sentinel_carrying, **self._boundary_carrying}
        if carrying:
            nodes = self.body.nodes
            for ref, value in carrying.items():
                cause = boundaries.sentinel_cause(value, self.body.name)
                for consumer, index in self.body.consumers.get(ref, ()):
                    inputs = nodes[consumer].inputs
                    if index < len(inputs) and (consumer, inputs[index].type_attr) in slot_index:
                        members.setdefault(("slot", consumer, inputs[index].type_attr),
                                           (boundaries.SENTINEL, cause))
            for ret, (ref, _, _) in self.body.rets.items():
                if ref in carrying:
                    members.setdefault(("ret", ret), (boundaries.SENTINEL,
                                                      boundaries.sentinel_cause(
                                                          carrying[ref], self.body.name)))
        if not self.range_held and not self._ranged_args:
            return members
        hold = boundaries.RANGE_HOLD
        for slot, cause in self._range_readers.items():
            members[("slot", slot_node[slot], slot_attr[slot])] = (hold, cause)
        for slot, cause in self.range_held.items():
            for reached in (slot, *self.fanout[slot]):
                members.setdefault(("slot", slot_node[reached], slot_attr[reached]),
                                   (hold, cause))
        for ret, (ref, _, _) in self.body.rets.items():
            if ref.is_arg:
                cause = self._ranged_args.get(ref.node)
            else:
                port = self.body.producer_port(ref)
                slot = slot_index.get((ref.node, port.type_attr)) if port else None
                cause = None if slot is None else self.range_held.get(slot)
            if cause is not None:
                members.setdefault(("ret", ret), (hold, cause))
        return members

    def _xla_statistics(self, leads_to_deny_or_infer: set[int]) -> None:
        """Under XLA, in bfloat16, a Mean or Sum that reduces a big tensor to a
        small statistic accumulates in float32 as in float16 (where these ops
        are on the deny list), and the small statistics after it stay float32.

        bfloat16 has float32's range, so these ops are on its infer list, and
        a reduction of a bfloat16 tensor was a bfloat16 op: XLA accumulates it
        in float32 anyway, but rounds the result to bfloat16 in a kernel of its
        own (a BatchNorm's batch mean, once per layer), and a product it reduces
        (a BatchNorm's gamma gradient, dy * x) was written to memory in
        bfloat16 and read again (BUILD_NOTES.md, session 15). Read in float32,
        the Cast of its input fuses into the reduction: no bytes, and one kernel
        where there were two. Under TensorFlow's executor the Cast would be a
        kernel writing a float32 copy of the big input, so nothing changes there.

        Only the statistic rules apply (_after_statistic without the range
        holds): bfloat16 cannot overflow where float32 does not.
        """
        if self.target != DT_BFLOAT16 or self._fusible is None:
            return
        lists = self.slot_list
        for root, list_name in enumerate(lists):
            if (list_name != "infer" or root in self.deny or root in self.blocked
                    or root in self.allow):
                continue
            root_node = self.body.nodes[self.slot_node[root]]
            if root_node.op not in RANGE_DENIED_REDUCTIONS:
                continue
            reduced = self._statistic_input(root_node)
            if reduced is None:
                continue
            self._add_statistic(root, root_node, reduced, leads_to_deny_or_infer, (
                f"float32 under XLA: accumulates in float32, its output a statistic of its "
                f"{format_elements(reduced)}-element input; XLA fuses the Cast of its input "
                f"into it", "", rk.KIND_STATISTIC), ranges=False)

    def _add_statistic(self, root: int, root_node, reduced: tuple[int, int],
                       leads_to_deny_or_infer: set[int], decision: tuple[str, str, str],
                       ranges: bool = True) -> None:
        """`root` (a slot of `root_node`) is a float32 statistic of its `reduced`-
        element input, for `decision` (reason, cause, kind): the rules after it apply."""
        self._statistics.append(root)
        self.deny[root] = decision
        self._after_statistic(root, root_node, reduced, leads_to_deny_or_infer, ranges=ranges)

    def _hold_variable_updates(self) -> None:
        """A variable's new whole value computed from its own read stays float32
        from the read to the assignment (``AssignVariableOp``).

        That is an exponential moving average: a BatchNorm's moving mean in
        Keras 3, ``moving * 0.99 + mean * 0.01``. Computed in 16 bits, the new
        value is rounded to 16 bits at every step, and a step smaller than half
        a 16-bit spacing of the value is lost: with bfloat16's 8 bits a moving
        mean of 2.9 stops moving 0.8 short of its target (BUILD_NOTES.md,
        session 14; Keras 3 under XLA, where the batch mean is bfloat16). Here
        only the ops that carry the old value to the new one stay float32; the
        increment (``mean * 0.01``) may still be 16-bit: its rounding error is
        2^-9 of one step's change, which the float32 value does not accumulate.
        An update by ``AssignAdd``/``AssignSub`` adds its increment in float32
        already, as the variable is float32.
        """
        nodes = self.body.nodes
        writes: dict[str, list] = {}
        reads: dict[str, list[TensorRef]] = {}
        for name, node in nodes.items():
            if node.op == "AssignVariableOp" and len(node.data_inputs) > 1:
                writes.setdefault(variable_key(nodes, node.data_inputs[0][0]), []).append(
                    node.data_inputs[1][0])
            elif node.op == "ReadVariableOp" and node.data_inputs:
                reads.setdefault(variable_key(nodes, node.data_inputs[0][0]), []).append(
                    TensorRef(name, 0))
        if not writes:
            return
        lists, deny = self.slot_list, self.deny
        for key, values in writes.items():
            sources = reads.get(key)
            if not sources:
                continue
            value_slots = [s for s in map(self._slot_of, values) if s is not None]
            values_set = set(value_slots)
            readers = sorted({dst for ref in sources
                              for consumer, index in self.body.consumers.get(ref, ())
                              for dst in [self._input_slot(consumer, index)]
                              if dst is not None})

            size = self.counts.get(sources[0])

            def free(s, values_set=values_set, size=size):
                return s in values_set or (lists[s] in ("infer", "clear") and s not in deny
                                           and self._no_bigger(s, size))
            # What the read reaches through a few infer/clear ops no bigger than
            # the variable (a moving average's; walked forward from the read,
            # not back from the assigned value, whose inputs may be a whole
            # backward pass; and not through the activations a weight's read
            # reaches, a LayerNorm's gamma the whole residual stream) ...
            reached = _reach(readers, self.fanout, free, _MOVING_AVERAGE_OPS)
            # ... and, of that, what leads on to the assigned value.
            upstream = set(_dfs(value_slots, self.fanin,
                                lambda s, reached=reached, free=free: s in reached and free(s)))
            start = [r for r in readers if r in upstream]
            for slot in _dfs(start, self.fanout, upstream.__contains__):
                if slot not in deny and slot not in self.blocked:
                    deny[slot] = (
                        f"float32: computes a new value of the float32 variable read by "
                        f"{sources[0].node!r} from its old one (a moving average); in "
                        f"{self.target_name} an update below half a 16-bit step of the "
                        f"value would be lost", sources[0].node, rk.KIND_VARIABLE_UPDATE)

    def _no_bigger(self, slot: int, size: tuple[int, int] | None) -> bool:
        """Are `slot`'s outputs no bigger than a variable of `size` elements
        (unknown sizes: yes, the walk's depth bounds it)?"""
        if size is None:
            return True
        for ref in self._slot_refs(slot)[1]:
            elements = self.counts.get(ref)
            if elements is None:
                continue
            if elements[0] > size[0] or (elements[0] == size[0] and elements[1] > size[1]):
                return False
        return True

    def _slot_of(self, ref: TensorRef) -> int | None:
        """The slot of the float tensor `ref` (None: not a float op's output)."""
        if ref.is_arg:
            return None
        port = self.body.producer_port(ref)
        return None if port is None else self.slot_index.get((ref.node, port.type_attr))

    def _input_slot(self, consumer: str, index: int) -> int | None:
        node = self.body.nodes.get(consumer)
        if node is None or index >= len(node.inputs):
            return None
        return self.slot_index.get((consumer, node.inputs[index].type_attr))

    def _after_statistic(self, root: int, root_node, reduced: tuple[int, int],
                         leads_to_deny_or_infer: set[int], ranges: bool = True,
                         bounded: bool = False) -> None:
        """The rules after a statistic (`root`, a slot of `root_node`, whose input
        has `reduced` elements): see _propagate_deny. `ranges`: also hold what
        could leave float16's range (a sum's broadcast), unless the statistic is
        `bounded` (within its input's range, as _bounded_statistic says of a Mean)."""
        lists = self.slot_list
        cause = f"{root_node.op} {root_node.name!r}"
        statistics = _dfs([root], self.fanout, lambda s: (
            s not in self.deny and s in leads_to_deny_or_infer
            and lists[s] in ("infer", "clear") and self._small_next_to(s, reduced)))
        for slot in statistics:
            if slot != root:
                self.deny[slot] = (
                    f"float32 statistic: computed from {cause}, a float32 reduction; "
                    f"small, so it is cast where a {self.target_name} op reads it",
                    root_node.name, rk.KIND_STATISTIC)
        self._hold_centring(statistics, reduced, root_node.name)
        if not ranges:  # (bfloat16: every statistic is within its range)
            self._bounded.update(statistics)
            return
        if bounded or self._bounded_statistic(root_node):
            self._bounded.update(statistics)
            return
        means = self._divided_by_count(root_node, statistics, reduced)
        self._bounded.update(means)
        self._hold_broadcast_sums([s for s in statistics if s not in means],
                                  reduced, root_node.name)

    def _bounded_statistic(self, node) -> bool:
        """Does a statistic reduction's result lie within its input's range?

        A mean does, unless what it averages can outgrow the input (a mean of
        squares: a variance). A sum, a product or a norm does not: a sum of
        100,000 float16 gradients may be far past 65504 where no term is.
        """
        if node.op != "Mean":
            return False
        source = self.body.nodes.get(node.data_inputs[0][0].node)
        return source is None or source.op not in GROWING_OPS

    def _divided_by_count(self, root_node, statistics: list[int],
                          reduced: tuple[int, int]) -> set[int]:
        """The statistics of a sum that come after its division by its number of
        terms (or more): a RealDiv by a scalar constant >= N, a Mul by one of at
        most 1/N, and what follows them. sum / N is a mean, back in its terms'
        range (the broadcast sum's hold below then has nothing to hold: where
        the division ran after the broadcast, ``hoist`` moved it before)."""
        result = self.counts.get(TensorRef(root_node.name, 0))
        if (root_node.op not in STATISTIC_REDUCTIONS or reduced[0] or result is None
                or result[0] or not result[1]):
            return set()
        terms = reduced[1] / result[1]
        members = set(statistics)
        nodes, slot_node = self.body.nodes, self.slot_node
        divisions = [s for s in statistics
                     if _scales_down_by(nodes[slot_node[s]], nodes, terms)]
        if not divisions:
            return set()
        return set(_dfs(divisions, self.fanout, lambda s: s in members))

    def _hold_broadcast_sums(self, statistics: list[int], reduced: tuple[int, int],
                             root: str) -> None:
        """Big ops that read an unbounded statistic (a sum: see _bounded_statistic)
        stay float32: through copies (Tile, Reshape: oplists.BROADCAST_OPS) up to and
        including the first op that computes with it (a RealDiv by N brings a
        sum back to a mean's range). Casting the sum itself to float16 could
        overflow; the result of that op is as safe to cast as the values it
        came from."""
        nodes, slot_node, deny, lists = self.body.nodes, self.slot_node, self.deny, self.slot_list
        stack = list(statistics)
        while stack:
            current = stack.pop()
            for slot in self.fanout[current]:
                if (slot in deny or slot in self.blocked
                        or lists[slot] not in ("infer", "clear")
                        or self._small_next_to(slot, reduced)):
                    continue
                deny[slot] = (
                    f"reads a float32 sum from {root!r} (a sum may exceed "
                    f"{self.target_name}'s range where its terms do not): float32 until "
                    f"it is scaled back", root, rk.KIND_STATISTIC)
                if nodes[slot_node[slot]].op in BROADCAST_OPS:
                    stack.append(slot)

    def _hold_centring(self, statistics: list[int], reduced: tuple[int, int],
                       root: str) -> None:
        """x - s stays float32 where s is one of `statistics` (float32) and the
        result is big (oplists.CENTRING_OPS; why: BUILD_NOTES.md, Session 7).

        Slots of the "boundary" list are not looked at: their dtype is the
        boundary group's (boundaries.solve), and a function argument's or
        result's slot is no node (a statistic returned by a forward function
        for its gradient feeds ``<ret sum>``)."""
        nodes, slot_node, deny, lists = self.body.nodes, self.slot_node, self.deny, self.slot_list
        for stat in statistics:
            for slot in self.fanout[stat]:
                if (slot in deny or slot in self.blocked or lists[slot] == "boundary"
                        or nodes[slot_node[slot]].op not in CENTRING_OPS
                        or self._small_next_to(slot, reduced)):
                    continue
                self._centring.add(statistics[0])
                deny[slot] = (
                    f"centred on float32 statistic {slot_node[stat]!r}: in "
                    f"{self.target_name} its rounding would be one error shared by every "
                    f"element, which sums of the result add up", root, rk.KIND_CENTRED)
                # x - mean rounded to 16-bit is no better: x lies on float16's
                # coarse grid and the mean does not, so every element rounds
                # alike. Once scaled (Mul, RealDiv) the roundings differ.
                for scaled in self.fanout[slot]:
                    if (scaled not in deny and scaled not in self.blocked
                            and lists[scaled] != "boundary"
                            and nodes[slot_node[scaled]].op in SCALING_OPS
                            and not self._small_next_to(scaled, reduced)):
                        deny[scaled] = (
                            f"scales {slot_node[slot]!r}, centred on a float32 statistic: "
                            f"computed in float32 and rounded once, after scaling",
                            root, rk.KIND_CENTRED)

    def _read_16bit_statistics(self) -> None:
        """A statistic reduction whose kernel accumulates in float32 anyway reads
        its 16-bit input as it is, instead of through a Cast of that input to
        float32. Only in float16 on a GPU, and never a reduction that centres
        a tensor (x - mean): rounded to float16 its result would be one error
        shared by every element of x - mean (see _hold_centring). Its small
        consumers (the statistics) stay float32 and cast its result.

        - A Mean (oplists.FLOAT32_ACCUMULATING_ON_GPU): TensorFlow's GPU kernel
          and XLA both accumulate it in float32, and a mean lies within its
          input's range, so it cannot overflow; it is rounded to float16 once.
        - Under XLA, a Sum whose result is a weight's gradient
          (oplists.FLOAT32_ACCUMULATING_UNDER_XLA, _is_weight_gradient): XLA
          accumulates it in float32 and rounds once, as a 16-bit MatMul or
          convolution weight gradient is rounded, and an overflow there is a
          gradient overflow, which the loss scale sees and answers. Keeping it
          float32 costs a float32 copy of its input; under XLA that copy is a
          kernel of its own where the input comes from a matrix product (a
          BatchMatMul's per-example weight gradients).
        """
        if self.target != DT_HALF:
            return
        for slot in self._statistics:
            node = self.body.nodes[self.slot_node[slot]]
            if slot in self.blocked or slot in self._centring:
                continue
            if node.op in FLOAT32_ACCUMULATING_ON_GPU:
                why = ("its GPU kernel accumulates in float32 and a mean stays within its "
                       "input's range")
            elif (node.op in FLOAT32_ACCUMULATING_UNDER_XLA and self.runtime == "xla"
                    and self._is_weight_gradient(node)):
                why = ("XLA accumulates it in float32, and its result is a weight's gradient, "
                       "rounded once like a 16-bit weight gradient, where the loss scale "
                       "sees an overflow")
            else:
                continue
            if kernels.node_device_type(node.node_def.device, self.device_type) != "GPU":
                continue
            source = node.data_inputs[0][0]
            if not self._ref_is_16bit(source):
                continue
            self.deny.pop(slot, None)
            self.allow[slot] = (
                f"{node.op}: reads the {self.target_name} value of {source.node!r} as it is; "
                f"{why}", source.node, rk.KIND_ACCUMULATES_FP32)

    def _read_cast_products(self) -> None:
        """Under XLA, in bfloat16, a product downstream of a deny op computes in
        bfloat16 where every op that reads it reads bfloat16 (through a Cast)
        or is a reduction to a weight's gradient: a classifier's loss gradient,
        (softmax - onehot) * dloss, read by its MatMul gradients and its
        BiasAddGrad.

        Kept float32, the product is written in float32 and converted by a
        kernel of its own (XLA does not fuse that convert into the softmax's
        fusion), and the bias gradient reads the float32 copy: even a
        BiasAddGrad that reads the Cast reads it, since XLA removes a float32 ->
        16-bit -> float32 round trip. In bfloat16 the product is written once,
        in bfloat16, as in Keras's program (MobileNetV2's and ResNet-50's H100
        programs: 0.26 MB less temporary memory, BUILD_NOTES.md, session 16).
        Why the values are as good: oplists.BFLOAT16_SAFE_PRODUCTS. The weight
        gradient sums read the bfloat16 product as it is: XLA sums in float32
        and rounds once (oplists.FLOAT32_ACCUMULATING_UNDER_XLA).
        """
        if self.runtime != "xla" or self.target != DT_BFLOAT16:
            return
        nodes, consumers, slot_index = self.body.nodes, self.body.consumers, self.slot_index
        returned = {ref for ref, _, _ in self.body.rets.values()}
        for slot, (_, cause, kind) in list(self.deny.items()):
            node = nodes[self.slot_node[slot]]
            if (kind != rk.KIND_DOWNSTREAM_OF_DENY or node.op not in BFLOAT16_SAFE_PRODUCTS
                    or slot in self.blocked):
                continue
            outputs = self._slot_refs(slot)[1]
            if len(outputs) != 1 or outputs[0] in returned:
                continue
            readers = [(c, slot_index.get((c, nodes[c].inputs[i].type_attr)))
                       for c, i in consumers.get(outputs[0], ())
                       if i < len(nodes[c].inputs) and not self._follows_any_dtype(c, i)]
            sixteen = [r for _, r in readers if r in self.allow]
            sums = [r for c, r in readers
                    if r is not None and r not in self.allow and r not in self.blocked
                    and nodes[c].op in FLOAT32_ACCUMULATING_UNDER_XLA
                    and self._is_weight_gradient(nodes[c])]
            if not sixteen or len(sixteen) + len(sums) != len(readers):
                continue
            del self.deny[slot]
            self.allow[slot] = (
                f"{node.op}: computes in bfloat16 after {cause!r}: every op that reads it "
                f"reads bfloat16, and a product of bfloat16-rounded inputs is as close as "
                f"a rounded float32 product; XLA then writes it once, in bfloat16",
                cause, rk.KIND_AFTER_16BIT)
            for r in sums:
                self.deny.pop(r, None)
                self.kept.pop(r, None)
                self.allow[r] = (
                    f"{nodes[self.slot_node[r]].op}: reads the bfloat16 product "
                    f"{node.name!r} as it is; XLA sums it in float32 and rounds its result, "
                    f"a weight's gradient, once", node.name, rk.KIND_ACCUMULATES_FP32)

    def _is_weight_gradient(self, node) -> bool:
        """Is `node` a gradient op whose result, through views (Reshape,
        Identity, ...) and sums of gradients (AddN: the tape adds up the
        gradients of a tensor read in several places, under no gradient
        scope), leaves the backward pass: read only by ops that are not
        gradient ops (the optimizer, the loss scale's check) or returned?
        Then it is a weight's gradient, not a step inside the backward pass."""
        if not scopes.is_gradient(node.name):
            return False
        nodes, consumers = self.body.nodes, self.body.consumers
        stack, seen = [TensorRef(node.name, 0)], set()
        while stack:
            ref = stack.pop()
            if ref in seen:
                continue
            seen.add(ref)
            for consumer, _ in consumers.get(ref, ()):
                reader = nodes[consumer]
                if reader.op in NO_COPY_OPS or reader.op == "AddN":
                    stack.extend(TensorRef(consumer, i) for i in range(len(reader.outputs)))
                elif scopes.is_gradient(consumer):
                    return False
        return True

    def _statistic_input(self, node) -> tuple[int, int] | None:
        """The elements of `node`'s input if it reduces it to a small statistic, else None."""
        if node.op not in STATISTIC_REDUCTIONS or not node.data_inputs:
            return None
        reduced = self.counts.get(node.data_inputs[0][0])
        result = self.counts.get(TensorRef(node.name, 0))
        if reduced is None or result is None or not _smaller(result, reduced):
            return None
        return reduced

    def _small_next_to(self, slot: int, reduced: tuple[int, int]) -> bool:
        """Are all of `slot`'s outputs known and _STATISTIC_RATIO times smaller
        than a reduction's input of `reduced` elements?"""
        outputs = self._slot_refs(slot)[1]
        counts = self.counts
        return bool(outputs) and all(
            counts.get(ref) is not None and _smaller(counts[ref], reduced) for ref in outputs)

    def _is_free(self, slot: int, lists: tuple[str, ...]) -> bool:
        # (_candidate written out: this runs for every neighbour looked at)
        return (self.slot_list[slot] in lists and slot not in self.blocked
                and slot not in self.deny and slot not in self.allow)

    def _add_between_allow(self) -> None:
        def free(s):
            return self._is_free(s, ("infer", "clear"))
        downstream = set(_dfs(list(self.allow), self.fanout, free))
        between = _dfs(list(self.allow), self.fanin, lambda s: s in downstream)
        for slot in between:
            if slot not in self.allow:
                list_name = self.slot_list[slot]
                self.allow[slot] = (
                    f"{list_name}: between {self.target_name} ops", "", rk.KIND_BETWEEN)

    def _hold_sums_read_by_reductions(self) -> None:
        """Under XLA, an element-wise op between 16-bit ops stays float32 where
        it combines a big float32 input with its 16-bit ones and a reduction
        reads its result (a BatchNorm's input gradient: the 16-bit direct term
        plus the float32 variance term, summed again for a convolution bias).

        Its bytes are the same either way (the Casts on both sides fuse into it,
        and what the 16-bit ops read is written once, in 16-bit). What differs
        is the reduction: reading a float32 value computed up to a convert,
        XLA computes it inside the reduction's fusion and merges that with the
        fusion writing the 16-bit copy (one kernel, as in Keras's own float32
        BatchNorm); reading the 16-bit result, XLA's performance model leaves
        the reduction a kernel of its own that reads it again (measured on
        ResNet-50's H100 program: BUILD_NOTES.md, session 12).
        """
        if self._fusible is None or not self.counts:
            return
        nodes, consumers, counts = self.body.nodes, self.body.consumers, self.counts
        for slot, (_, _, kind) in list(self.allow.items()):
            if kind != rk.KIND_BETWEEN or not self._fuses(self.slot_node[slot]):
                continue
            inputs, outputs = self._slot_refs(slot)
            if len(outputs) != 1 or counts.get(outputs[0]) is None:
                continue
            size = counts[outputs[0]]
            if not any(self._kind(c) == runtime_cost.REDUCTION
                       for c, _ in consumers.get(outputs[0], ())):
                continue
            wide = [ref for ref in inputs
                    if not ref.is_arg and nodes[ref.node].op not in CONSTANT_OPS
                    and not self._ref_is_16bit(ref) and counts.get(ref) is not None
                    and not _smaller(counts[ref], size)]
            if not wide:
                continue
            del self.allow[slot]
            self.blocked[slot] = ("", rk.KIND_FEWER_BYTES)
            self.kept[slot] = (
                f"{self.slot_list[slot]}: stays float32 between {self.target_name} ops: it "
                f"adds the float32 {wide[0].node!r} and a reduction reads it; under XLA the "
                f"reduction then fuses with it, where a {self.target_name} result would be "
                f"read again (same bytes either way)", wide[0].node, rk.KIND_FEWER_BYTES)

    def _add_infer_after_allow(self) -> None:
        if self._order is None:
            self._order = self._slot_order()
        order = self._order
        if self._infer_slots is None:
            self._infer_slots = sorted(
                (s for s, name in enumerate(self.slot_list) if name == "infer"),
                key=order.__getitem__)
        blocked, deny, allow = self.blocked, self.deny, self.allow
        infer_slots = [s for s in self._infer_slots
                       if s not in blocked and s not in deny and s not in allow]
        fanins = self.fanin
        for slot in infer_slots:
            fanin = fanins[slot]
            if any(s in deny for s in fanin):
                continue
            sixteen = [s for s in fanin if s in allow]
            if not sixteen:
                continue
            cause = self.slot_node[sixteen[0]]
            if self._fusible is not None and self._region_stops_at(slot):
                self.kept[slot] = (
                    f"infer: stays float32 after {self.target_name} op {cause!r}: it reads "
                    f"a variable, and under XLA an update from float32 variables to their "
                    f"float32 assignments is one fusion that 16-bit arithmetic would not "
                    f"make smaller", cause, rk.KIND_FEWER_BYTES)
                continue
            scale = self._run_time_scale(slot)
            if scale is not None:
                self.kept[slot] = (
                    f"infer: stays float32 after {self.target_name} op {cause!r}: it "
                    f"scales by {scale!r}, a value known only at run time (a loss "
                    f"scale or learning rate may leave {self.target_name}'s range)",
                    cause, rk.KIND_RUN_TIME_SCALE)
                continue
            by_bytes = self._cheaper_in_16bit(slot)
            if by_bytes is not None:
                convert, detail = by_bytes
            else:
                convert, detail = self._casts_if_16bit(slot) < self._casts_if_fp32(slot), ""
            if convert:
                why = f"converted: {detail}" if detail else "converting saves a cast"
                self.allow[slot] = (
                    f"infer: follows {self.target_name} op {cause!r}; {why}", cause,
                    rk.KIND_AFTER_16BIT)
            elif self._convert_region(slot, cause):
                continue
            elif detail:
                self.kept[slot] = (
                    f"infer: stays float32 after {self.target_name} op {cause!r}: "
                    f"{detail}", cause, rk.KIND_FEWER_BYTES)

    def _add_statistic_readers(self) -> None:
        """Ops that combine statistics into big tensors for a 16-bit op go 16-bit
        where that moves fewer bytes (needs shapes).

        A LayerNorm broadcasts its per-row statistics against its per-feature
        gamma and beta into full-size scale and shift tensors (gamma *
        rsqrt(var + eps), beta - mean * that) before the 16-bit x * scale +
        shift. Judged as one region with the free infer/clear ops before it,
        the region goes 16-bit if every float32 value it reads is a bounded
        statistic (kind "float32 statistic"), computed from one (an Rsqrt of
        var + eps), or a weight: values within float16's range. Anything else
        (a loss's gradient, a run-time scale) keeps the region float32.
        """
        if not self.counts:
            return
        blocked, deny, allow, fanouts = self.blocked, self.deny, self.allow, self.fanout
        for slot, list_name in enumerate(self.slot_list):
            if (list_name != "infer" or slot in blocked or slot in deny or slot in allow):
                continue
            sixteen = [s for s in fanouts[slot] if s in allow]
            if sixteen:
                self._convert_statistic_region(slot, self.slot_node[sixteen[0]])

    def _add_bounded_exps(self) -> None:
        """A bounded Exp (value_ranges.exp_bound), with the free infer/clear ops
        after it, goes 16-bit where only 16-bit ops read the result and that
        moves fewer bytes, even though what the Exp reads stays float32.

        A softmax written out, exp(x - m) with m the maximum or the logsumexp
        of x, keeps x - m float32 (it is centred on a float32 statistic:
        _hold_centring); its result feeds the 16-bit attention matmul (through
        an attention dropout's scaling and select, in training) and the 16-bit
        gradient product. Computed in float32, the probabilities are written in
        float32 and cast; in 16-bit, their float32 input is cast and they are
        written once in 16-bit. Rounding x - m to 16-bit costs exp(x - m) a
        relative error of at most |x - m| * 2^-11 (float16), and the
        probability an absolute one below 2^-11 / e, independent from element
        to element; an x - m past the 16-bit range is -inf, whose exp is 0 as
        the true value nearly is. An Exp of a value clipped to at most c
        (a graph attention's exp(clip(scores, -2, 2))) costs a relative error
        of at most c * 2^-11 the same way. The ops after the Exp are free
        infer/clear ops, which would follow it onto the path between 16-bit
        ops anyway."""
        nodes = self.body.nodes
        if self._bounded_exps is None:
            # (_make_slots made them infer where the lists say deny: value_ranges.exp_bound)
            deny_exp = self.lists.list_of("Exp") == "deny"
            self._bounded_exps = [
                slot for slot, name in enumerate(self.slot_node)
                if deny_exp and self.slot_list[slot] == "infer" and name in nodes
                and nodes[name].op == "Exp"]
        allow, fanouts, slot_node = self.allow, self.fanout, self.slot_node
        for slot in self._bounded_exps:
            if not self._is_free(slot, ("infer",)) or self._run_time_scale(slot) is not None:
                continue
            region = self._free_region(slot)
            members = set(region)
            # (a reader may be a function result's pseudo-slot: no node)
            readers = [s for member in region for s in fanouts[member]
                       if s not in members and (slot_node[s] not in nodes
                                                or nodes[slot_node[s]].op not in METADATA_OPS)]
            if not readers or not all(s in allow for s in readers):
                continue
            pays = self._region_pays(region)
            if pays is None:
                continue
            as16, as32 = pays
            cause = slot_node[readers[0]]
            why = (f"only {self.target_name} ops read it (first {cause!r}): "
                   f"{_format_bytes(as16)} instead of {_format_bytes(as32)}")
            for member in region:
                self.kept.pop(member, None)
                if member == slot:
                    bound = value_ranges.exp_bound(self.body, nodes[slot_node[slot]])
                    allow[member] = (f"infer: lies in [0, {bound:.3g}] and {why}", cause,
                                     rk.KIND_BOUNDED_FOR_16BIT)
                else:
                    allow[member] = (
                        f"{self.slot_list[member]}: between bounded Exp {slot_node[slot]!r} "
                        f"and {self.target_name} ops; {why}", slot_node[slot], rk.KIND_BETWEEN)

    def _convert_statistic_region(self, slot: int, cause: str) -> bool:
        if self._run_time_scale(slot) is not None or self._region_stops_at(slot):
            return False
        region, stack, seen = [], [slot], {slot}
        fanin, is_free = self.fanin, self._is_free
        while stack and len(region) < _MAX_REGION:
            current = stack.pop()
            region.append(current)
            for prev in fanin[current]:
                if (prev not in seen and is_free(prev, ("infer", "clear"))
                        and self._run_time_scale(prev) is None
                        and not self._region_stops_at(prev)):
                    seen.add(prev)
                    stack.append(prev)
        members = set(region)
        outside = {prev for member in region for prev in fanin[member]} - members
        found = False
        for prev in outside:
            if prev in self.allow:
                continue
            kind = self._statistic_kind(prev)
            if kind is None:
                return False
            found = found or kind
        if not found:
            return False
        pays = self._region_pays(region)
        if pays is None:
            return False
        as16, as32 = pays
        why = (f"combines float32 statistics for {self.target_name} op {cause!r}"
               + (f" with {len(region) - 1} op(s) before it" if len(region) > 1 else "")
               + f": {_format_bytes(as16)} instead of {_format_bytes(as32)}")
        for member in region:
            self.kept.pop(member, None)
            self.allow[member] = (f"{self.slot_list[member]}: {why}", cause,
                                  rk.KIND_COMBINES_STATISTICS)
        return True

    def _region_pays(self, region: list[int]) -> tuple[Bytes, Bytes] | None:
        """(bytes all 16-bit, bytes all float32) if converting `region` moves fewer bytes."""
        costs = self._costs(region)
        if costs is None:
            return None
        (as16, _), (as32, _) = costs
        return (as16, as32) if as16 < as32 else None

    def _statistic_kind(self, slot: int, depth: int = 4) -> bool | None:
        """True if `slot` holds a bounded statistic (a mean: see _bounded_statistic)
        or a value computed from bounded statistics and weights only, False for
        a weight (a variable read, through Reshape/Identity) or a constant, None
        for anything else (a sum, a variance as it is, a loss's gradient)."""
        if slot in self.deny:
            return True if slot in self._bounded else None
        node = self.body.nodes.get(self.slot_node[slot])
        if node is None:
            return None
        if node.op in VARIABLE_OPS or node.op == "Const":
            return False
        if node.op in BOUNDING_OPS and self.fanin[slot] and all(
                self.deny.get(prev, ("", "", ""))[2] == rk.KIND_STATISTIC
                for prev in self.fanin[slot]):
            return True  # (rsqrt(var + eps) <= 1/sqrt(eps) whatever var is)
        if depth == 0 or self.slot_list[slot] not in ("unlisted", "clear", "infer"):
            return None
        inputs = [self._statistic_kind(prev, depth - 1) for prev in self.fanin[slot]]
        if not inputs or any(kind is None for kind in inputs):
            return None
        return any(inputs)

    # -- regions: a chain after a 16-bit op, judged as a whole -----------------

    def _convert_region(self, slot: int, cause: str) -> bool:
        """Converts `slot` and the free infer/clear ops after it if, together, that
        moves fewer bytes (one op alone may not pay for its Casts, a chain does:
        LayerNorm's Sub/Mul/Square after a 16-bit MatMul). Returns True if done."""
        if self._region_stops_at(slot):
            return False
        region = self._free_region(slot)
        if len(region) < 2:
            return False
        pays = self._region_pays(region)
        if pays is None:
            return False
        as16, as32 = pays
        why = (f"follows {self.target_name} op {cause!r} with {len(region) - 1} more "
               f"op(s) after it: together {_format_bytes(as16)} instead of "
               f"{_format_bytes(as32)}")
        for member in region:
            self.kept.pop(member, None)
            self.allow[member] = (f"{self.slot_list[member]}: {why}", cause,
                                  rk.KIND_AFTER_16BIT)
        return True

    def _free_region(self, slot: int) -> list[int]:
        """`slot` and the free infer/clear slots downstream of it (at most _MAX_REGION)."""
        region, stack, seen = [], [slot], {slot}
        fanout, fanin, deny, is_free = self.fanout, self.fanin, self.deny, self._is_free
        while stack and len(region) < _MAX_REGION:
            current = stack.pop()
            region.append(current)
            for nxt in fanout[current]:
                if (nxt not in seen and is_free(nxt, ("infer", "clear"))
                        and not any(s in deny for s in fanin[nxt])
                        and self._run_time_scale(nxt) is None
                        and not self._region_stops_at(nxt)):
                    seen.add(nxt)
                    stack.append(nxt)
        return region

    def _region_stops_at(self, slot: int) -> bool:
        """Does a region stop at `slot`: does it read a variable (directly or
        through an Identity) in float16?

        Such ops are how optimizers update master weights and their slots
        (Adam's ``g - m``, ``g * g``). In float16 regions stop there: a squared
        gradient of 1e-4 is below float16's smallest subnormal, so the second
        moment would flush to zero. In bfloat16 (float32's range) they may
        join a region when that moves fewer bytes: the variables, and the
        assignments that update them, stay float32, so only the increment is
        computed with 8 bits of mantissa, an error of about 2^-9 of one step's
        update that the float32 variable does not accumulate as rounding.
        """
        if self.regions_read_variables:
            return False  # (bfloat16 on the executor)
        for ref, _ in self.body.nodes[self.slot_node[slot]].data_inputs:
            node = self.body.nodes.get(ref.node)
            if node is not None and node.op == "Identity" and node.data_inputs:
                node = self.body.nodes.get(node.data_inputs[0][0].node)
            if node is not None and node.op in VARIABLE_OPS:
                return True
        return False

    def _costs(self, region: list[int]):
        """((Bytes, [elements of each Cast]) if every slot of `region` is 16-bit,
        the same if all are float32), or None if a size is unknown. One walk for
        both options; a region of one slot is a single op's choice.

        Each option counts the slots' own reads and writes at its width (an edge
        inside the region once); a Cast on an input is paid by the option that
        disagrees with the producer unless another consumer of the tensor needs
        the same Cast anyway (a region member has the option's dtype); a Cast on
        an output by the option that disagrees with a consumer outside. What
        a Cast costs depends on the runtime (``runtime_cost``): its bytes and a
        launch (``launch_bytes``) on the executor; under XLA the same where it
        would be a kernel of its own, nothing where an element-wise op on
        either side absorbs it (``_fuses``).
        """
        # (Helpers written out: this runs for every choice the rules leave open.)
        fuses = self._fuses if self._fusible is not None else None
        launched16 = launched32 = 0
        members = set(region)
        slot_index, consumers_of, rets = self.slot_index, self.body.consumers, self._ret_wants
        nodes, allow, counts = self.body.nodes, self.allow, self.counts
        refs_by_slot, slot_node, args16 = self._refs_by_slot, self.slot_node, self.overrides.args
        sums32: dict[int, int] = {}
        sums16: dict[int, int] = {}
        casts32: list[tuple[int, int]] = []
        casts16: list[tuple[int, int]] = []
        for slot in region:
            name = slot_node[slot]
            input_refs, output_refs = refs_by_slot.get(slot) or self._slot_refs(slot)
            # (outputs nothing reads are written by neither option's choice)
            outputs = [ref for ref in output_refs if consumers_of.get(ref) or ref in rets]
            # Under XLA an element-wise op reads its inputs at the width they
            # were written with whatever it computes in (a Cast on the way fuses
            # into it), and writes memory only for an output a boundary reads
            # (runtime_cost): only that output's width differs between options.
            inside = fuses is not None and fuses(name)
            for ref in (*input_refs, *outputs):  # the slot's own reads and writes
                elements = counts.get(ref)
                if elements is None:
                    return None
                if inside and (ref.node != name or self._fused_with(ref)):
                    continue
                degree, count = elements
                sums32[degree] = sums32.get(degree, 0) + count * 4
                sums16[degree] = sums16.get(degree, 0) + count * 2
            for ref in input_refs:
                elements = counts[ref]
                degree, count = elements
                if ref.is_arg:  # (_ref_is_16bit, with the producer slot found once)
                    have16 = ref.node in args16
                else:  # the producer's slot (its output port's type attribute)
                    producer_node = nodes.get(ref.node)
                    producer = None
                    if producer_node is not None and ref.index < len(producer_node.outputs):
                        producer = slot_index.get(
                            (ref.node, producer_node.outputs[ref.index].type_attr))
                    if producer in members:
                        continue
                    have16 = producer in allow
                # The option that disagrees with the producer pays for a Cast,
                # unless another consumer needs the same Cast anyway: a region
                # member (either option's dtype) or a slot already of that dtype.
                shared = False
                for c, i in consumers_of.get(ref, ()):
                    if c == name:
                        continue
                    inputs = nodes[c].inputs
                    if i >= len(inputs):
                        if have16:  # (an input without a port reads float32)
                            shared = True
                            break
                        continue
                    s = slot_index.get((c, inputs[i].type_attr))
                    if s in members or (s in allow) != have16:
                        shared = True
                        break
                if not shared:
                    # (a Cast of a constant folds away before the step runs)
                    paid = (fuses is None or not (fuses(name) or fuses(ref))) and not (
                        not ref.is_arg and nodes[ref.node].op in CONSTANT_OPS)
                    if have16:
                        casts32.append(elements)
                        if paid:
                            sums32[degree] = sums32.get(degree, 0) + count * 6
                            launched32 += 1
                    else:
                        casts16.append(elements)
                        if paid:
                            sums16[degree] = sums16.get(degree, 0) + count * 6
                            launched16 += 1
            for ref in outputs:
                elements = counts[ref]
                degree, count = elements
                # does each consumer outside want 16-bit? -> do all that want
                # it absorb a Cast (XLA: element-wise)?
                wants = dict.fromkeys(rets.get(ref, ()), False)
                for c, i in consumers_of.get(ref, ()):
                    inputs = nodes[c].inputs  # the consumer's slot
                    consumer = slot_index.get((c, inputs[i].type_attr)) \
                        if i < len(inputs) else None
                    if consumer not in members and not self._follows_any_dtype(c, i):
                        want16 = consumer in allow
                        absorbs = fuses is not None and fuses(c)
                        wants[want16] = wants.get(want16, True) and absorbs
                paid = fuses is None or not fuses(name)
                for want16, absorbed in wants.items():
                    width = 2 if want16 else 4
                    sums32[degree] = sums32.get(degree, 0) + count * width
                    sums16[degree] = sums16.get(degree, 0) + count * width
                    cast_paid = paid and not absorbed
                    if want16:  # the float32 option casts to 16-bit for it
                        casts32.append(elements)
                        if cast_paid:
                            sums32[degree] = sums32.get(degree, 0) + count * (4 + width)
                            launched32 += 1
                    else:
                        casts16.append(elements)
                        if cast_paid:
                            sums16[degree] = sums16.get(degree, 0) + count * (2 + width)
                            launched16 += 1
        launch = self.launch_bytes
        if launched16 or launched32:
            sums16[0] = sums16.get(0, 0) + launch * launched16
            sums32[0] = sums32.get(0, 0) + launch * launched32
        return (Bytes.of_sums(sums16), casts16), (Bytes.of_sums(sums32), casts32)

    def _fused_with(self, ref: TensorRef) -> bool:
        """Under XLA, does an element-wise op's output `ref` stay inside fusions:
        read only by element-wise ops and reductions (which fuse their
        producers), and no result?"""
        if ref in self._ret_wants:
            return False
        for consumer, _ in self.body.consumers.get(ref, ()):
            if not (self._fuses(consumer) or self._kind(consumer) == runtime_cost.REDUCTION):
                return False
        return True

    def _fuses(self, where: str | TensorRef) -> bool:
        """Under XLA, does a Cast on an edge at this node (or produced tensor)
        fuse into it: is it element-wise (runtime_cost.op_kind), looking
        through views (Identity, Reshape) to what they pass along?"""
        if isinstance(where, TensorRef):
            if where.is_arg:
                return False
            where = where.node
        return self._kind(where) == runtime_cost.ELEMENTWISE

    def _kind(self, name: str) -> int:
        """runtime_cost.op_kind of node `name`, a view taking its source's."""
        known = self._fusible.get(name)
        if known is not None:
            return known
        # (a view of a view ...)
        node = value_ranges.through_copies(self.body, TensorRef(name, 0), depth=4)
        kind = runtime_cost.PARAMETER if node is None else runtime_cost.op_kind(
            node.op, calls=bool(node.called_functions), sink=not node.outputs)
        self._fusible[name] = kind
        return kind

    def _run_time_scale(self, slot: int) -> str | None:
        """The node a scaling op's scalar operand comes from, if only known at run time.

        Mul/Div ops whose other operand is a scalar computed from a variable
        (a loss scale's reciprocal, a learning rate) or a function argument:
        its value is unknown here, and multiplying by 2^-15 in float16 flushes
        most values to zero. Gradient unscaling must happen in float32, so the
        "infer after a 16-bit op" extension stops there (grappler, converting
        infer ops only between 16-bit ops, never goes that far either).
        """
        name = self.slot_node[slot]
        node = self.body.nodes[name]
        if node.op not in SCALING_OPS:
            return None
        for ref, _ in node.data_inputs:
            if self.counts.get(ref) != (0, 1):
                continue
            source = self._scalar_source(ref)
            if source is not None:
                return source
        return None

    def _scalar_source(self, ref: TensorRef, depth: int = 6) -> str | None:
        """The variable read or argument a scalar `ref` is computed from, or None."""
        if ref.is_arg:
            return ref.node
        node = self.body.nodes.get(ref.node)
        if node is None or depth == 0:
            return None
        if node.op in VARIABLE_READ_OPS:
            return node.name
        if node.op not in SCALAR_ARITHMETIC_OPS:
            return None
        for source_ref, _ in node.data_inputs:
            source = self._scalar_source(source_ref, depth - 1)
            if source is not None:
                return source
        return None

    def _slot_order(self) -> list[int]:
        """Position of each slot in a producer-first order of the float edges.

        Kahn's algorithm on the slot graph (ints, no node-level refs): the
        order decisions along a chain need, at a fraction of the cost of
        ordering the whole body. Slots on cycles (TF1 loops) go last.
        """
        fanin, fanout = self.fanin, self.fanout
        indegree = [len(edges) for edges in fanin]
        ready = [s for s, deg in enumerate(indegree) if deg == 0]
        position = [-1] * len(indegree)
        count = 0
        while ready:
            slot = ready.pop()
            position[slot] = count
            count += 1
            for nxt in fanout[slot]:
                indegree[nxt] -= 1
                if indegree[nxt] == 0:
                    ready.append(nxt)
        for slot, pos in enumerate(position):
            if pos < 0:
                position[slot] = count
                count += 1
        return position

    # -- choices by bytes -----------------------------------------------------

    def _cheaper_in_16bit(self, slot: int, ties_convert: bool = False
                          ) -> tuple[bool, str] | None:
        """Does converting `slot` move fewer bytes, given its neighbours now?

        Compares the local traffic of the two options: the slot's own reads and
        writes at 2 or 4 bytes, plus the Casts each option needs on its inputs
        and outputs (a Cast another consumer already needs is free). Ties go
        by Cast count, then by `ties_convert`.

        Returns:
          (convert?, "a Cast of 64 elements instead of 524,288"), or None when
          a size is unknown (the caller falls back to counting Casts).
        """
        costs = self._costs([slot])
        if costs is None:
            return None
        (bytes16, casts16), (bytes32, casts32) = costs
        if bytes16 == bytes32:
            convert = len(casts16) < len(casts32) or (
                len(casts16) == len(casts32) and ties_convert)
        else:
            convert = bytes16 < bytes32
        chosen, other = (casts16, casts32) if convert else (casts32, casts16)
        if len(chosen) == 1 and len(other) == 1:
            detail = (f"a Cast of {format_elements(chosen[0])} elements instead of "
                      f"{format_elements(other[0])}")
        else:
            detail = f"{_describe_casts(chosen)} instead of {_describe_casts(other)}"
        return convert, detail

    def _slot_refs(self, slot: int) -> tuple[list[TensorRef], list[TensorRef]]:
        """(distinct input refs, output refs) of `slot`, cached per node.

        All slots of a node are filled in one pass over its ports: a node with a
        list type attribute (IdentityN with hundreds of T[k]) has a slot per
        element, so filtering its inputs per slot would be quadratic.
        """
        cached = self._refs_by_slot.get(slot)
        if cached is not None:
            return cached
        name = self.slot_node[slot]
        node = self.body.nodes[name]
        found: dict[int, tuple[list, list]] = {}
        slot_index = self.slot_index
        ports = node.inputs
        for i, (ref, _) in enumerate(node.data_inputs):
            if i < len(ports):
                s = slot_index.get((name, ports[i].type_attr))
                if s is not None:
                    found.setdefault(s, ([], []))[0].append(ref)
        for index, port in enumerate(node.outputs):
            s = slot_index.get((name, port.type_attr))
            if s is not None:
                found.setdefault(s, ([], []))[1].append(TensorRef(name, index))
        for s, (inputs, outputs) in found.items():
            self._refs_by_slot[s] = (list(dict.fromkeys(inputs)), outputs)
        return self._refs_by_slot.setdefault(slot, ([], []))

    def _follows_any_dtype(self, consumer: str, index: int) -> bool:
        """A free clear op that reads only metadata (Shape, ...) takes either dtype.

        It goes 16-bit for nothing once its producer does (clear propagation),
        so it neither needs a Cast nor reads any bytes.
        """
        node = self.body.nodes[consumer]
        if node.op not in METADATA_OPS or index >= len(node.inputs):
            return False
        slot = self.slot_index.get((consumer, node.inputs[index].type_attr))
        return slot is not None and (slot in self.allow or self._is_free(slot, ("clear",)))

    def _input_refs(self, slot: int) -> list[TensorRef]:
        return self._slot_refs(slot)[0]

    def _ref_is_16bit(self, ref: TensorRef) -> bool:
        if ref.is_arg:
            return ref.node in self.overrides.args
        slot = self._slot_of(ref)
        return slot is not None and slot in self.allow

    def _casts_if_fp32(self, slot: int) -> int:
        return sum(self._ref_is_16bit(ref) for ref in self._input_refs(slot))

    def _casts_if_16bit(self, slot: int) -> int:
        casts = sum(not self._ref_is_16bit(ref) for ref in self._input_refs(slot))
        name, attr = self.slot_node[slot], self.slot_attr[slot]
        consumers = (
            (consumer, in_index)
            for index, port in enumerate(self.body.nodes[name].outputs) if port.type_attr == attr
            for consumer, in_index in self.body.consumers.get(TensorRef(name, index), ()))
        # One shared cast back to float32 covers every float32 consumer.
        casts += any(
            self.slot_index.get((c, self.body.nodes[c].inputs[i].type_attr)) not in self.allow
            for c, i in consumers)
        return casts

    def _propagate_through_clear(self) -> None:
        """Clear slots next to 16-bit slots follow them, unless that moves more bytes.

        Grown outward from each 16-bit slot; each candidate is judged with its
        neighbours as decided so far, so along a chain of clear ops the Cast
        ends up on the smallest tensor. Without sizes every candidate follows
        (grappler's rule).
        """
        if self._neighbours is None:  # (edges do not change once connected)
            self._neighbours = [a + b for a, b in zip(self.fanin, self.fanout, strict=True)]
        neighbours = self._neighbours
        slot_list, blocked, deny, allow = self.slot_list, self.blocked, self.deny, self.allow
        for root in list(allow):
            cause = self.slot_node[root]
            stack = [root]
            while stack:
                current = stack.pop()
                for slot in neighbours[current]:
                    if (slot_list[slot] != "clear" or slot in blocked or slot in deny
                            or slot in allow):  # (not _is_free(slot, ("clear",)))
                        continue
                    verdict = self._cheaper_in_16bit(slot, ties_convert=True)
                    if verdict is not None and not verdict[0]:
                        self.kept[slot] = (
                            f"clear: stays float32 next to {self.target_name} op "
                            f"{cause!r}: {verdict[1]}", cause, rk.KIND_FEWER_BYTES)
                        continue
                    self.kept.pop(slot, None)
                    self.allow[slot] = (
                        f"clear: next to {self.target_name} op {cause!r}", cause,
                        rk.KIND_NEXT_TO_16BIT)
                    stack.append(slot)

    def _retarget_casts(self) -> None:
        """Existing Casts meet 16-bit neighbours directly instead of via another Cast.

        SrcT: a Cast reading a 16-bit value reads it as it is (the value is
        unchanged, so the result is too). DstT: a Cast to float32 whose consumers
        are all 16-bit casts straight to the 16-bit type.
        """
        if "Cast" not in self.body.ops:
            return
        nodes = self.body.nodes
        casts = {name for name, node in nodes.items() if node.op == "Cast"}
        for slot in [s for s, name in enumerate(self.slot_node) if name in casts]:
            name = self.slot_node[slot]
            node = nodes[name]
            if not self._candidate(slot) or slot in self.allow:
                continue
            if self.slot_attr[slot] == "SrcT":
                ref = node.data_inputs[0][0]
                if self._ref_is_16bit(ref):
                    self.allow[slot] = (
                        f"Cast: reads the {self.target_name} value of {ref.node!r} "
                        f"directly", ref.node, rk.KIND_CAST_RETARGETED)
                continue
            consumers = self.body.consumers.get(TensorRef(name, 0), [])
            if not consumers or any(
                    self.slot_index.get((c, self.body.nodes[c].inputs[i].type_attr))
                    not in self.allow for c, i in consumers):
                continue
            if any(ref == TensorRef(name, 0) for ref, _, _ in self.body.rets.values()):
                continue
            self.allow[slot] = (
                f"Cast: feeds only {self.target_name} ops, so it casts straight "
                f"to {self.target_name}", "", rk.KIND_CAST_RETARGETED)

    # -- result ---------------------------------------------------------------

    def _decisions(self) -> dict[tuple[str, str], Decision]:
        slots_of: dict[str, list[int]] = {}
        for slot, name in enumerate(self.slot_node):
            found = slots_of.get(name)
            if found is None:
                slots_of[name] = [slot]
            else:
                found.append(slot)
        decisions = {}
        body_name, allow, list_of = self.body.name, self.allow, self.lists.list_of
        deny, kept, blocked = self.deny, self.kept, self.blocked
        slot_attr = self.slot_attr
        new = tuple.__new__  # (Decision(...) without its Python-level __new__)
        # Decisions that depend on nothing but the op's list and a block are
        # shared (most of a training step: nodes without a slot, variable
        # reads, float32 ops with no 16-bit neighbour).
        shared: dict[tuple, Decision] = {}
        lists: dict[str, str] = {}
        node_blocks = self.node_blocks
        for name, node in self.body.nodes.items():
            op = node.op
            list_name = lists.get(op)
            if list_name is None:
                list_name = lists[op] = list_of(op)
            slots = slots_of.get(name)
            if slots is None:
                key = (list_name, node_blocks[name])
                decision = shared.get(key)
                if decision is None:
                    reason, cause, kind = self._fp32_reason(node, list_name, [])
                    decision = shared[key] = new(
                        Decision, (list_name, False, reason, (), cause, kind))
                decisions[(body_name, name)] = decision
                continue
            if list_name != self.slot_list[slots[0]] and self.slot_list[slots[0]] in (
                    "clear", "infer"):
                # (a reduction that copies, a bounded Exp: value_ranges)
                list_name = self.slot_list[slots[0]]
            converted = [s for s in slots if s in allow]
            if converted:
                reason, cause, kind = allow[converted[0]]
                if len(converted) < len(slots):
                    kept_attrs = [slot_attr[s] for s in slots if s not in allow]
                    reason += f" ({', '.join(kept_attrs)} stays float32)"
                decisions[(body_name, name)] = new(Decision, (
                    list_name, True, reason, tuple([slot_attr[s] for s in converted]),
                    cause, kind))
                continue
            primary = slots[0]
            own = deny.get(primary) or kept.get(primary)
            if own is not None:
                decisions[(body_name, name)] = new(Decision, (
                    list_name, False, own[0], (), own[1], own[2]))
                continue
            key = (list_name, blocked.get(primary), True)
            decision = shared.get(key)
            if decision is None:
                reason, cause, kind = self._fp32_reason(node, list_name, slots)
                decision = shared[key] = new(
                    Decision, (list_name, False, reason, (), cause, kind))
            decisions[(body_name, name)] = decision
        return decisions

    def _fp32_reason(self, node, list_name: str,
                     slots: list[int]) -> tuple[str, str, str]:
        """(reason, cause, kind) for a node none of whose slots went 16-bit."""
        if not slots:
            block, kind = self.node_blocks[node.name]
            if block and kind != rk.KIND_UNKNOWN_INPUT:
                return block, "", kind
            return "no float32 tensors to convert", "", rk.KIND_NO_FLOAT
        primary = slots[0]
        if primary in self.deny:
            return self.deny[primary]
        if primary in self.kept:
            return self.kept[primary]
        if primary in self.blocked:
            prefix = "" if list_name == "unlisted" else f"{list_name}: "
            block, kind = self.blocked[primary]
            return f"{prefix}{block}", "", kind
        if list_name == "infer":
            return (f"infer: stays float32, not between {self.target_name} ops", "",
                    rk.KIND_NO_NEIGHBOUR)
        if list_name == "clear":
            return (f"clear: stays float32, no {self.target_name} neighbour", "",
                    rk.KIND_NO_NEIGHBOUR)
        return "unlisted: stays float32", "", rk.KIND_UNLISTED


# Integers a 16-bit type holds exactly (its mantissa's bits + 1): positions above
# them round (float16: 2048; bfloat16: 256).
_EXACT_INTEGERS = {DT_HALF: 2048, DT_BFLOAT16: 256}
# Tensors that carry state or structure, not values: never positions.
_OPAQUE_TYPES = frozenset({types_pb2.DT_RESOURCE, types_pb2.DT_VARIANT})
# Ops whose float output is not a function of their inputs' values alone.
_NOT_POSITIONS = VARIABLE_READ_OPS | {
    "VarHandleOp", "ResourceGather", "TruncatedNormal", "StatelessTruncatedNormal",
    "StatelessTruncatedNormalV2", "ParameterizedTruncatedNormal", "Multinomial"}


def _may_compute_positions(node) -> bool:
    """Could `node`'s output be derived from positions and constants: a Const, or
    an op that computes from its inputs (no state, no randomness, no call, no
    placeholder)? Its inputs decide the rest (_BodyColoring._on_positions)."""
    if node.op == "Const":
        return True
    if (not node.data_inputs or node.op in _NOT_POSITIONS or node.called_functions
            or "Random" in node.op or not node.known_op):
        return False
    return True


def _scales_down_by(node, nodes: dict, terms: float) -> bool:
    """Is `node` x / c with a scalar constant c >= `terms`, or x * c with
    0 < |c| <= 1 / `terms`?"""
    if node.op not in ("RealDiv", "Mul") or len(node.data_inputs) != 2:
        return False
    values = [scalar_constant(nodes.get(ref.node)) for ref, _ in node.data_inputs]
    if node.op == "RealDiv":
        return values[1] is not None and values[1] >= terms * (1 - 1e-6)
    return any(v is not None and 0 < abs(v) <= (1 + 1e-6) / terms for v in values)


def _smaller(elements: tuple[int, int], than: tuple[int, int]) -> bool:
    """Is a tensor of `elements` at least _STATISTIC_RATIO times smaller than one
    of `than`? Element counts are (unknown dimensions, known product); fewer
    unknown dimensions is smaller for a large unknown size."""
    if elements[0] != than[0]:
        return elements[0] < than[0]
    return elements[1] * _STATISTIC_RATIO <= than[1]


def _format_bytes(value: Bytes) -> str:
    """'12,288 bytes' or '256 x B + 64 bytes' (B: an unknown dimension)."""
    parts = []
    for degree, coeff in value.terms:
        parts.append(f"{coeff:,}" + ("" if degree == 0 else " x B" if degree == 1
                                     else f" x B^{degree}"))
    return (" + ".join(parts) or "0") + " bytes"


def _describe_casts(casts: list[tuple[int, int]]) -> str:
    """'no Cast', 'a Cast of 64 elements', 'Casts of 64 + 128 elements'."""
    if not casts:
        return "no Cast"
    sizes = " + ".join(format_elements(c) for c in casts)
    return f"a Cast of {sizes} elements" if len(casts) == 1 else f"Casts of {sizes} elements"


def _reach(roots: list[int], edges: list[list[int]], enter, depth: int) -> set[int]:
    """The slots `roots` reach through `edges` in at most `depth` steps, entering
    only slots for which `enter` is true (roots included)."""
    reached = {r for r in roots if enter(r)}
    frontier = list(reached)
    for _ in range(depth - 1):
        frontier = [n for s in frontier for n in edges[s] if n not in reached and enter(n)]
        if not frontier:
            break
        reached.update(frontier)
    return reached


def _dfs(roots: list[int], edges: list[list[int]], enter) -> list[int]:
    """Slots reachable from `roots` along `edges`, entering those `enter` accepts.

    The roots themselves are always visited and returned first.
    """
    seen = set(roots)
    order = list(roots)
    stack = list(roots)
    while stack:
        slot = stack.pop()
        for nxt in edges[slot]:
            if nxt not in seen and enter(nxt):
                seen.add(nxt)
                order.append(nxt)
                stack.append(nxt)
    return order
