"""Which ops compute in 16-bit, and why: ``color(view, config) -> Coloring``.

Pure analysis: nothing is edited here. Decisions are made per *type slot* (a
node and one of its type attributes, e.g. FusedBatchNormV3's ``T`` but not its
float32-only ``U``) and connected along data edges, following the order of
grappler's AMP pass:

1. allow-list slots go 16-bit;
2. deny spreads forward from deny ops through infer ops and through clear ops
   that lead to a deny or infer op;
3. infer and clear slots on a path between two 16-bit slots go 16-bit;
4. an infer slot fed by a 16-bit slot goes 16-bit where that needs fewer casts;
5. clear slots next to 16-bit slots follow them;
6. an existing Cast to float32 that feeds only 16-bit slots casts to 16-bit
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
import re
from collections.abc import Iterable

from tensorflow.core.framework import types_pb2

from tfamp.rewrite import boundaries, kernels
from tfamp.config import AmpConfig
from tfamp.rewrite.graph import DT_FLOAT, Body, GraphView, TensorRef, dtype_name

# Type attributes that do not change on their own, whatever list the op is on.
# A TensorList's element type must agree with every op that touches the list,
# and lists flow through loop boundaries into other functions: boundaries.solve
# lifts this for a whole list (every op on it, in every function) at once.
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


@dataclasses.dataclass(frozen=True)
class Decision:
    """What colouring decided for one node.

    Attributes:
      list: "allow", "infer", "deny", "clear" or "unlisted".
      converted: True if the node now computes in the 16-bit type.
      reason: a short sentence, e.g. "deny: downstream of Exp 'loss/Exp'".
      converted_attrs: the type attributes switched to 16-bit.
      cause: the node that made the decision (a deny root, a 16-bit
        neighbour), or "" when the node decided on its own.
    """

    list: str
    converted: bool
    reason: str
    converted_attrs: tuple[str, ...] = ()
    cause: str = ""


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

    def converted_attrs(self, function: str, node: str) -> tuple[str, ...]:
        return self.decisions[(function, node)].converted_attrs


def color(view: GraphView, config: AmpConfig,
          outputs: Iterable[str] = ()) -> Coloring:
    """Decides, for every node of `view`, whether it computes in 16-bit.

    Args:
      view: the graph and its function library (see ``graph.build_view``).
      config: target dtype, op lists, overrides.
      outputs: tensor names ("node:0") of the top graph whose dtype callers
        rely on; their producers keep their types.

    Returns:
      A Coloring with one Decision per node.
    """
    pinned_outputs = {_parse_tensor_name(name) for name in outputs}

    def color_body(body: Body, overrides: boundaries.BodyOverrides):
        body_pins = pinned_outputs if not body.is_function else set()
        body_coloring = _BodyColoring(body, config, body_pins, overrides)
        decisions = body_coloring.run()
        denied = {(body_coloring.slot_node[s], body_coloring.slot_attr[s]): reason
                  for s, (reason, _) in body_coloring.deny.items()}
        return decisions, {**denied, **body_coloring.hard_blocked}

    solution = boundaries.solve(view, config, pinned_outputs, color_body)
    return Coloring(target=config.target_enum, decisions=solution.decisions,
                    signatures=solution.signatures, clones=solution.clones,
                    call_targets=solution.call_targets)


def _parse_tensor_name(name: str) -> TensorRef:
    node, _, index = name.partition(":")
    return TensorRef(node, int(index) if index else 0)


class _BodyColoring:
    """Colours one body. Slots are ints; slot i is (node, type attribute)."""

    def __init__(self, body: Body, config: AmpConfig, pinned: set[TensorRef],
                 overrides: boundaries.BodyOverrides | None = None):
        self.body = body
        self.overrides = overrides or boundaries.BodyOverrides()
        self.forced: dict[int, tuple[str, str]] = {}  # slot -> (reason, cause)
        self.config = config
        self.lists = config.op_lists
        self.target = config.target_enum
        self.target_name = dtype_name(self.target)
        self.keep_patterns = [re.compile(p) for p in config.keep_fp32]
        self.device_type = kernels.resolve_device_type(config.device_type)
        self.slot_node: list[str] = []
        self.slot_attr: list[str] = []
        self.slot_list: list[str] = []
        self.slot_index: dict[tuple[str, str], int] = {}
        self.blocked: dict[int, str] = {}  # slot -> why it cannot be 16-bit
        self.node_blocks: dict[str, str] = {}  # node -> why none of it can be 16-bit
        self.hard_blocked: dict[tuple[str, str], str] = {}  # blocks boundaries cannot lift
        self._make_slots(pinned)
        self._make_boundary_slots()
        self.fanin: list[list[int]] = [[] for _ in self.slot_node]
        self.fanout: list[list[int]] = [[] for _ in self.slot_node]
        self._connect()
        self.allow: dict[int, tuple[str, str]] = {}  # slot -> (reason, cause)
        self.deny: dict[int, tuple[str, str]] = {}

    # -- building -------------------------------------------------------------

    def _make_slots(self, pinned: set[TensorRef]) -> None:
        for name, node in self.body.nodes.items():
            list_name = self.lists.list_of(node.op)
            attrs = []
            for port in node.inputs + node.outputs:
                if port.dtype == DT_FLOAT and port.type_attr and port.type_attr not in attrs:
                    attrs.append(port.type_attr)
            node_block = self.node_blocks[name] = self._node_block(name, node)
            for attr in attrs:
                slot = len(self.slot_node)
                self.slot_node.append(name)
                self.slot_attr.append(attr)
                self.slot_list.append(list_name)
                self.slot_index[(name, attr)] = slot
                block = node_block or self._attr_block(node, attr)
                if block:
                    self.blocked[slot] = block
                    # Blocks boundaries.solve may lift for a whole group: a
                    # call's signature, a TensorList's element type.
                    if block not in (self._call_block(node), self._fixed_block(node, attr)):
                        self.hard_blocked[(name, attr)] = block
            for index, port in enumerate(node.outputs):
                if TensorRef(name, index) in pinned and port.type_attr in attrs:
                    slot = self.slot_index[(name, port.type_attr)]
                    self.blocked.setdefault(
                        slot, "kept float32: a graph output keeps its dtype")
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
                self.blocked[slot] = reason
        for node, attr, reason in ov.forced:
            slot = self.slot_index.get((node, attr))
            if slot is None:  # a type attribute with no float port (EmptyTensorList)
                slot = self._add_slot(node, attr, "boundary")
            self.blocked.pop(slot, None)
            self.slot_list[slot] = "boundary"
            self.forced[slot] = (reason, "")
        for arg in sorted(ov.args):
            slot = self._add_slot(boundaries.arg_slot_name(arg), "T", "boundary")
            self.forced[slot] = (f"argument {arg!r} arrives {self.target_name}", "")
        for ret in sorted(ov.rets):
            slot = self._add_slot(boundaries.ret_slot_name(ret), "T", "boundary")
            self.forced[slot] = (f"result {ret!r} leaves {self.target_name}", "")

    def _node_block(self, name: str, node) -> str:
        for pattern in self.keep_patterns:
            if pattern.search(name):
                return f"kept float32: name matches keep_fp32 pattern {pattern.pattern!r}"
        if not node.known_op:
            return f"unknown op {node.op!r}: no OpDef, left as it is"
        call_block = self._call_block(node)
        if call_block:
            return call_block
        if any(p.dtype == types_pb2.DT_RESOURCE for p in node.inputs + node.outputs):
            return "variable op: master weights and their reads stay float32"
        for ref, _ in node.data_inputs:
            if self.body.producer_port(ref) is None:
                return f"input {ref.node!r} has no known type: left float32"
        return ""

    @staticmethod
    def _call_block(node) -> str:
        if not node.called_functions:
            return ""
        called = ", ".join(repr(f) for f in dict.fromkeys(node.called_functions))
        return (f"calls {called}: its signature is kept and the body is "
                f"rewritten on its own")

    @staticmethod
    def _fixed_block(node, attr: str) -> str:
        if attr not in FIXED_TYPE_ATTRS.get(node.op, ()):
            return ""
        return (f"{attr} stays float32: a TensorList's element type must "
                f"match every op that touches the list")

    def _attr_block(self, node, attr: str) -> str:
        base_attr = attr.split("[")[0]
        if not kernels.opdef_allows(node.op, base_attr, self.target):
            return f"{node.op}'s OpDef does not allow {self.target_name} for {base_attr}"
        if not kernels.has_kernel(node.op, base_attr, self.target, self.device_type):
            return (f"no {self.target_name} {self.device_type} kernel "
                    f"for {node.op} ({base_attr})")
        return self._fixed_block(node, attr)

    def _connect(self) -> None:
        for name, node in self.body.nodes.items():
            for index, (ref, _) in enumerate(node.data_inputs):
                dst_attr = node.inputs[index].type_attr if index < len(node.inputs) else None
                dst = self.slot_index.get((name, dst_attr))
                if dst is None:
                    continue
                if ref.is_arg:
                    src = self.slot_index.get((boundaries.arg_slot_name(ref.node), "T"))
                    if src is not None:
                        self.fanout[src].append(dst)
                        self.fanin[dst].append(src)
                    continue
                port = self.body.producer_port(ref)
                src = self.slot_index.get((ref.node, port.type_attr)) if port else None
                if src is not None and port.dtype == DT_FLOAT:
                    self.fanout[src].append(dst)
                    self.fanin[dst].append(src)
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
                self.allow[slot] = (f"allow: compute-heavy, runs in {self.target_name}", "")
        self.allow.update(self.forced)
        self._propagate_deny()
        self._add_between_allow()
        self._add_infer_after_allow()
        self._propagate_through_clear()
        self._retarget_casts()
        return self._decisions()

    def _candidate(self, slot: int) -> bool:
        return slot not in self.blocked

    def _propagate_deny(self) -> None:
        lists = self.slot_list
        roots = [s for s, ls in enumerate(lists) if ls in ("deny", "infer")]
        leads_to_deny_or_infer = set(_dfs(
            roots, self.fanin,
            lambda s: lists[s] == "clear"))
        for root in (s for s, ls in enumerate(lists) if ls == "deny"):
            root_node = self.body.nodes[self.slot_node[root]]
            self.deny.setdefault(root, (f"deny: numerically risky in {self.target_name}", ""))
            cause = f"{root_node.op} {root_node.name!r}"
            for slot in _dfs([root], self.fanout, lambda s: (
                    s not in self.deny and s in leads_to_deny_or_infer
                    and lists[s] in ("infer", "clear"))):
                if slot != root:
                    self.deny[slot] = (f"deny: downstream of {cause}", root_node.name)

    def _is_free(self, slot: int, lists: tuple[str, ...]) -> bool:
        return (self.slot_list[slot] in lists and self._candidate(slot)
                and slot not in self.deny and slot not in self.allow)

    def _add_between_allow(self) -> None:
        def free(s):
            return self._is_free(s, ("infer", "clear"))
        downstream = set(_dfs(list(self.allow), self.fanout, free))
        between = _dfs(list(self.allow), self.fanin, lambda s: s in downstream)
        for slot in between:
            if slot not in self.allow:
                list_name = self.slot_list[slot]
                self.allow[slot] = (f"{list_name}: between {self.target_name} ops", "")

    def _add_infer_after_allow(self) -> None:
        order = {name: i for i, name in enumerate(self.body.topological_order())}
        infer_slots = sorted(
            (s for s in range(len(self.slot_node)) if self._is_free(s, ("infer",))),
            key=lambda s: order[self.slot_node[s]])
        for slot in infer_slots:
            fanin = self.fanin[slot]
            if any(s in self.deny for s in fanin):
                continue
            sixteen = [s for s in fanin if s in self.allow]
            if not sixteen:
                continue
            if self._casts_if_16bit(slot) < self._casts_if_fp32(slot):
                cause = self.slot_node[sixteen[0]]
                self.allow[slot] = (
                    f"infer: follows {self.target_name} op {cause!r}; "
                    f"converting saves a cast", cause)

    def _input_refs(self, slot: int) -> list[TensorRef]:
        node = self.body.nodes[self.slot_node[slot]]
        attr = self.slot_attr[slot]
        return list(dict.fromkeys(
            ref for i, (ref, _) in enumerate(node.data_inputs)
            if i < len(node.inputs) and node.inputs[i].type_attr == attr))

    def _ref_is_16bit(self, ref: TensorRef) -> bool:
        if ref.is_arg:
            return ref.node in self.overrides.args
        port = self.body.producer_port(ref)
        if port is None or port.type_attr is None:
            return False
        slot = self.slot_index.get((ref.node, port.type_attr))
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
        neighbours = [a + b for a, b in zip(self.fanin, self.fanout, strict=True)]
        for root in list(self.allow):
            cause = self.slot_node[root]
            for slot in _dfs([root], neighbours, lambda s: self._is_free(s, ("clear",))):
                if slot not in self.allow:
                    self.allow[slot] = (
                        f"clear: next to {self.target_name} op {cause!r}", cause)

    def _retarget_casts(self) -> None:
        """Existing Casts meet 16-bit neighbours directly instead of via another Cast.

        SrcT: a Cast reading a 16-bit value reads it as it is (the value is
        unchanged, so the result is too). DstT: a Cast to float32 whose consumers
        are all 16-bit casts straight to the 16-bit type.
        """
        for slot, name in enumerate(self.slot_node):
            node = self.body.nodes.get(name)
            if node is None or node.op != "Cast" or not self._candidate(slot) or slot in self.allow:
                continue
            if self.slot_attr[slot] == "SrcT":
                ref = node.data_inputs[0][0]
                if self._ref_is_16bit(ref):
                    self.allow[slot] = (
                        f"Cast: reads the {self.target_name} value of {ref.node!r} "
                        f"directly", ref.node)
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
                f"to {self.target_name}", "")

    # -- result ---------------------------------------------------------------

    def _decisions(self) -> dict[tuple[str, str], Decision]:
        slots_of: dict[str, list[int]] = {}
        for slot, name in enumerate(self.slot_node):
            slots_of.setdefault(name, []).append(slot)
        decisions = {}
        for name, node in self.body.nodes.items():
            list_name = self.lists.list_of(node.op)
            slots = slots_of.get(name, [])
            converted = [s for s in slots if s in self.allow]
            if converted:
                reason, cause = self.allow[converted[0]]
                kept = [self.slot_attr[s] for s in slots if s not in self.allow]
                if kept:
                    reason += f" ({', '.join(kept)} stays float32)"
                decisions[(self.body.name, name)] = Decision(
                    list_name, True, reason,
                    tuple(self.slot_attr[s] for s in converted), cause)
                continue
            reason, cause = self._fp32_reason(node, list_name, slots)
            decisions[(self.body.name, name)] = Decision(list_name, False, reason, (), cause)
        return decisions

    def _fp32_reason(self, node, list_name: str, slots: list[int]) -> tuple[str, str]:
        if not slots:
            block = self.node_blocks[node.name]
            if block and not block.startswith("input "):
                return block, ""
            return "no float32 tensors to convert", ""
        primary = slots[0]
        if primary in self.deny:
            return self.deny[primary]
        if primary in self.blocked:
            prefix = "" if list_name == "unlisted" else f"{list_name}: "
            return f"{prefix}{self.blocked[primary]}", ""
        if list_name == "infer":
            return f"infer: stays float32, not between {self.target_name} ops", ""
        if list_name == "clear":
            return f"clear: stays float32, no {self.target_name} neighbour", ""
        return "unlisted: stays float32", ""


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
