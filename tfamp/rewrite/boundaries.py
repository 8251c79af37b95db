"""Colouring across function and loop boundaries, valid by construction.

Some type slots live in several places at once and must hold one dtype:

* a loop-carried value of ``While``/``StatelessWhile``: the loop's ``T[i]``
  (its input i and output i), cond's argument i, body's argument i and body's
  result i;
* an argument or result of ``If``/``Case``/``PartitionedCall``/
  ``StatefulPartitionedCall``: the caller's ``Tin[k]``/``Tout[k]`` and argument
  or result k of every function it may call; a function called from several
  sites joins them all;
* the element type of a TensorList: every op that touches the list, followed
  through variant edges, loops and calls (the forward loop's accumulators and
  the gradient loop that pops them);
* a TF1 loop frame: ``Enter``/``Merge``/``Switch``/``NextIteration``/``Exit``
  joined by data edges (a Cast between ``NextIteration`` and ``Merge`` makes
  the graph unimportable).

Such *groups* are found with a union-find over members (``("arg", fn, name)``,
``("ret", fn, name)``, ``("slot", body, node, type_attr)``). A group goes 16-bit
as a whole or not at all; a group with any member that cannot change (a
function whose signature the runtime relies on, a graph output, a missing
kernel, a variant that reaches an op tfamp does not follow, a slot that deny
propagation reaches while every boundary is float32) stays float32.

``solve`` chooses the groups: colour every body with float32 boundaries, turn
to 16-bit every open group (later rounds: every open group with a 16-bit
neighbour), re-colour, and drop each group whose bodies do not need fewer
Casts with it 16-bit than with it float32 (each body re-coloured both ways;
Casts weighted by loop depth, since a Cast in a loop body runs on every
iteration); repeat to a fixpoint, at most ``_MAX_ROUNDS`` times. Bodies
receive the result as ``BodyOverrides``; casts.py retypes signatures and call
sites and puts Casts where a group meets a float32 neighbour (for a loop, once
before or after it rather than on every iteration).

Callers that disagree: every call site after the first of a shared function
gets its own copy of the body while solving; copies coloured exactly like the
original are merged back, the rest are kept as ``<fn>_tfamp_<f16|bf16|f32>``.
Functions tagged ``api_implements`` (Keras LSTM/GRU, swapped by grappler's
implementation selector) keep their signature and are never copied; the
loops inside them are free.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
from collections.abc import Callable

from tensorflow.core.framework import types_pb2
from tensorflow.python.framework import op_def_registry

from tfamp.config import AmpConfig
from tfamp.rewrite import kernels
from tfamp.rewrite.graph import DT_FLOAT, Body, GraphView, TensorRef, dtype_name

log = logging.getLogger("tfamp")

DT_VARIANT = types_pb2.DT_VARIANT
# A Cast inside a loop body runs once per iteration; with the trip count
# unknown, a loop is assumed to run this many times.
LOOP_WEIGHT = 100
_MAX_ROUNDS = 6
# Up to this many groups in the plan, each is weighed exactly (its bodies
# re-coloured without it). Beyond it (Keras 3's loss-scaled step passes every
# gradient and weight into the apply-or-skip branch: 200+ groups into a body
# of 8,000 nodes), re-colouring once per group costs minutes; the local
# estimate (``_Solver.cost``) prunes the plan first, with one colouring per
# round, until at most this many groups are left to weigh exactly.
_EXACT_GROUPS = 16
# ... and only when weighing them exactly would re-colour more nodes than this
# (a group re-colours the bodies it touches). A Keras 3 LSTM step's loop
# carries 20+ groups through small bodies: weighed exactly, the coupled ones
# (h and c) stay 16-bit together, where the local estimate, which sees one
# group at a time, turned them all down (float16 traffic 74% -> 97% of float32).
_EXACT_WORK = 200_000

# Call ops and the attributes naming the functions they call, and how their
# type attributes map onto the functions' signatures.
_WHILE_OPS = frozenset({"While", "StatelessWhile"})
_CALL_OPS = {
    "While": ("cond", "body"), "StatelessWhile": ("cond", "body"),
    "If": ("then_branch", "else_branch"), "StatelessIf": ("then_branch", "else_branch"),
    "Case": ("branches",), "StatelessCase": ("branches",),
    "PartitionedCall": ("f",), "StatefulPartitionedCall": ("f",),
}
# Function attributes that tie a signature to code outside this graph: the
# implementation selector swaps a call for another function with the same tag.
_SIGNATURE_FIXING_ATTRS = frozenset({"api_implements"})
# TF1 control-flow ops that must agree with the loop frame they are part of.
_TF1_FRAME_OPS = frozenset({
    "Enter", "RefEnter", "Exit", "RefExit", "Merge", "RefMerge", "Switch",
    "RefSwitch", "NextIteration", "RefNextIteration",
})
# Ops that pass a variant (TensorList) through unchanged, element type included.
_VARIANT_PASSTHROUGH = frozenset({"Identity", "IdentityN", "StopGradient", "Snapshot",
                                  "ZerosLike", "OnesLike"})

Member = tuple  # ("arg", fn, name) | ("ret", fn, name) | ("slot", body, node, attr)

# Kinds of value a body keeps float32 for its range that a group may carry into
# another body (BodyOverrides.ranged): an rsqrt past the 16-bit range, whose
# readers are held up to the next allow op (coloring._hold_ranged_boundaries),
# and a constant past it, whose readers stay float32 (coloring._boundary_sentinels).
RANGE_HOLD = "range"
SENTINEL = "sentinel"


@dataclasses.dataclass(frozen=True)
class BodyOverrides:
    """What ``solve`` decided for one body, for ``coloring._BodyColoring``.

    Attributes:
      args: argument names that arrive in the 16-bit type.
      rets: result names that leave in the 16-bit type.
      forced: (node, type attribute, reason) slots that are 16-bit.
      blocked: (node, type attribute, reason) slots held at float32.
      ranged: (node, type attribute, kind, cause) boundary values that carry a
        value another body keeps float32 for its range, such as a loop's
        accumulator popped in the gradient loop: kind RANGE_HOLD, an l2
        normalisation's rsqrt (1e6 on a zero row: ``value_ranges.rsqrt_overflow``),
        its readers held float32 as in that body; kind SENTINEL, a constant
        past the range (a mask's -1e9; the cause starts with its magnitude), its
        readers float32. An argument is ``(arg_slot_name(arg), "T", kind, cause)``.
    """

    args: frozenset[str] = frozenset()
    rets: frozenset[str] = frozenset()
    forced: tuple[tuple[str, str, str], ...] = ()
    blocked: tuple[tuple[str, str, str], ...] = ()
    ranged: tuple[tuple[str, str, str, str], ...] = ()


@dataclasses.dataclass(frozen=True)
class SignatureTypes:
    """A function's new argument and result dtypes (only those that change)."""

    args: dict[str, int]
    rets: dict[str, int]


_COPY_SUFFIX = re.compile(r"_tfamp_(copy\d+|f16|bf16|f32)(_\d+)?$")


def original_function_name(name: str) -> str:
    """The library function a copy made here was made from (`name` itself otherwise)."""
    return _COPY_SUFFIX.sub("", name)


def sentinel_cause(value: float, body_name: str) -> str:
    """The cause of a SENTINEL member: the constant's magnitude first, which
    ``sentinel_value`` reads back in the body that receives it."""
    return f"{value:.3g} (a constant from {body_name or 'the graph'!r})"


def sentinel_value(cause: str) -> float:
    """The magnitude a ``sentinel_cause`` names."""
    return float(cause.split(" ", 1)[0])


def arg_slot_name(arg: str) -> str:
    """The name of the pseudo-slot that stands for a 16-bit argument."""
    return f"<arg {arg}>"


def ret_slot_name(ret: str) -> str:
    """The name of the pseudo-slot that stands for a 16-bit result."""
    return f"<ret {ret}>"


@dataclasses.dataclass
class Group:
    """Slots that must hold one dtype.

    Attributes:
      kind: "call" (loop-carried value, call argument or result), "list"
        (TensorList element type) or "tf1" (TF1 loop frame).
      members: its members (see the module docstring).
      block: why it must stay float32, or "" if it may go 16-bit.
    """

    kind: str
    members: list[Member]
    block: str = ""

    def describe(self) -> str:
        for member in self.members:
            if member[0] == "slot":
                _, body, node, attr = member
                where = f" in {body!r}" if body else ""
                return f"{node!r} {attr}{where}"
        _, fn, name = self.members[0]
        return f"{self.members[0][0]} {name!r} of {fn!r}"


class _UnionFind:
    def __init__(self):
        self.parent: dict = {}

    def find(self, item):
        self.parent.setdefault(item, item)
        root = item
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[item] != root:
            self.parent[item], item = root, self.parent[item]
        return root

    def union(self, a, b) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[ra] = rb

    def classes(self) -> list[list]:
        result: dict = {}
        for item in self.parent:
            result.setdefault(self.find(item), []).append(item)
        return list(result.values())


# -- finding groups ---------------------------------------------------------------


Site = tuple  # (body, node, function attribute, index in a list of functions)


@functools.cache
def _has_func_attrs(op: str) -> bool:
    """False if `op`'s OpDef has no function-valued attribute (most ops)."""
    op_def = op_def_registry.get(op)
    return op_def is None or any(a.type in ("func", "list(func)") for a in op_def.attr)


def _called(body_name: str, node, targets: dict[Site, str]) -> list[tuple[str, str]]:
    """(attribute, function name) for every function attribute of `node`.

    `targets` redirects call sites to clones (see ``_clone_call_sites``).
    """
    result = []
    if not _has_func_attrs(node.op):
        return result
    for attr_name, value in node.node_def.attr.items():
        funcs = [value.func.name] if value.HasField("func") else [f.name for f in value.list.func]
        for index, fn in enumerate(funcs):
            result.append((attr_name, targets.get((body_name, node.name, attr_name, index), fn)))
    return result


class _Analysis:
    """Groups, their blocks and the loop weight of every body."""

    def __init__(self, view: GraphView, config: AmpConfig, pinned: set[TensorRef],
                 targets: dict[Site, str] | None = None,
                 xla_compiled: frozenset[str] = frozenset()):
        self.view = view
        self.xla_compiled = xla_compiled
        self.targets = targets or {}
        self.config = config
        self.target = config.target_enum
        self.device_type = kernels.resolve_device_type(config.device_type)
        self.keep_patterns = [re.compile(p) for p in config.keep_fp32]
        self.bodies = {b.name: b for b in view.bodies}
        self.functions = {b.name: b for b in view.bodies if b.is_function}
        self.pinned = pinned
        # function -> why its signature must stay as it is
        self.fixed: dict[str, str] = {}
        # function -> why nothing crossing its boundary (variants included) may change
        self.hidden: dict[str, str] = {}
        self.calls: list[tuple[Body, object, dict[str, list[str]]]] = []
        self._find_calls()
        self.weight = self._weights()
        self.in_frame = {body.name: _tf1_frame_nodes(body) for body in view.bodies}
        self.groups: list[Group] = []
        # (body, OptionalFromValue) -> the (body, OptionalGetValue)s that unwrap
        # what it wraps, across calls (a cond's branch and its gradient branch)
        self.optional_links: dict[tuple[str, str], list[tuple[str, str]]] = {}
        self._call_groups()
        self._list_groups()
        self._tf1_groups()
        self.group_of: dict[Member, int] = {}
        for index, group in enumerate(self.groups):
            if not group.block and not any(m[1] in self.reached for m in group.members):
                group.block = "its functions are not run from this graph"
            for member in group.members:
                self.group_of[member] = index

    def _find_calls(self) -> None:
        called_known: set[str] = set()
        edges: dict[str, set[str]] = {}
        # (Without library functions no call can matter: skip the walk.)
        for body in self.view.bodies if self.functions else ():
            out = edges.setdefault(body.name, set())
            for node in body.nodes.values():
                if node.op in self.functions:
                    out.add(node.op)
                    self.hidden.setdefault(
                        node.op, f"called directly as an op by {node.name!r}")
                called = _called(body.name, node, self.targets)
                if not called:
                    continue
                out.update(fn for _, fn in called)
                known = _CALL_OPS.get(node.op, ())
                by_attr: dict[str, list[str]] = {}
                for attr_name, fn in called:
                    if fn not in self.functions:
                        continue
                    if attr_name in known:
                        by_attr.setdefault(attr_name, []).append(fn)
                        called_known.add(fn)
                    else:
                        self.hidden.setdefault(
                            fn, f"called by {node.op} {node.name!r} ({attr_name})")
                if by_attr:
                    self.calls.append((body, node, by_attr))
        for name, body in self.functions.items():
            if name not in called_known:
                self.hidden.setdefault(name, "not called from this graph")
            fixing = body.function_attrs & _SIGNATURE_FIXING_ATTRS
            if fixing:
                self.fixed[name] = (f"function {name!r} has {sorted(fixing)[0]}: the "
                                    f"implementation selector relies on its signature")
        for name, why in self.hidden.items():
            self.fixed.setdefault(name, why)
        self.reached = {""}
        stack = [""]
        while stack:
            for fn in edges.get(stack.pop(), ()):
                if fn in self.functions and fn not in self.reached:
                    self.reached.add(fn)
                    stack.append(fn)

    def _weights(self) -> dict[str, int]:
        # The top graph and functions nothing here calls (run by the runtime,
        # if at all) are roots.
        weight = {"": 1} | {name: 1 for name in self.hidden}
        for _ in range(len(self.view.bodies) + 1):
            changed = False
            for body, node, by_attr in self.calls:
                if body.name not in weight:
                    continue
                for fns in by_attr.values():
                    factor = LOOP_WEIGHT if node.op in _WHILE_OPS else 1
                    for fn in fns:
                        w = weight[body.name] * factor
                        if weight.get(fn, 0) < w:
                            weight[fn] = w
                            changed = True
            if not changed:
                break
        return weight

    def _slot_block(self, body: Body, node, attr: str) -> str:
        for pattern in self.keep_patterns:
            if pattern.search(node.name):
                return f"{node.name!r} matches keep_fp32 pattern {pattern.pattern!r}"
        base = attr.split("[")[0]
        if not kernels.opdef_allows(node.op, base, self.target):
            return f"{node.op}'s OpDef does not allow {dtype_name(self.target)} for {base}"
        device_type = kernels.node_device_type(node.node_def.device, self.device_type)
        missing = kernels.missing_kernel(
            node.op, base, self.target, device_type,
            original_function_name(body.name) in self.xla_compiled)
        if missing:
            return f"no {dtype_name(self.target)} {missing} kernel for {node.op} ({base})"
        if not body.is_function:
            for index, port in enumerate(node.outputs):
                if port.type_attr == attr and TensorRef(node.name, index) in self.pinned:
                    return f"{node.name!r} output {index} is a graph output"
        return ""

    def _call_groups(self) -> None:
        uf = _UnionFind()
        blocks: dict[Member, str] = {}
        for body, node, by_attr in self.calls:
            fns = [fn for fns in by_attr.values() for fn in fns]
            is_while = node.op in _WHILE_OPS
            for port in node.inputs:
                if port.dtype != DT_FLOAT or port.type_attr is None:
                    continue
                slot: Member = ("slot", body.name, node.name, port.type_attr)
                uf.find(slot)
                k = _list_index(port.type_attr)
                if k is None:
                    continue
                for fn in fns:
                    args = list(self.functions[fn].arg_dtypes)
                    if k >= len(args):
                        blocks[slot] = f"{node.name!r} does not match {fn!r}'s signature"
                        continue
                    uf.union(slot, ("arg", fn, args[k]))
                if is_while:
                    rets = list(self.functions[by_attr["body"][0]].rets)
                    if k < len(rets):
                        uf.union(slot, ("ret", by_attr["body"][0], rets[k]))
            if is_while:
                continue
            for port in node.outputs:
                if port.dtype != DT_FLOAT or port.type_attr is None:
                    continue
                slot = ("slot", body.name, node.name, port.type_attr)
                uf.find(slot)
                k = _list_index(port.type_attr)
                for fn in fns:
                    rets = list(self.functions[fn].rets)
                    if k is None or k >= len(rets):
                        blocks[slot] = f"{node.name!r} does not match {fn!r}'s signature"
                        continue
                    uf.union(slot, ("ret", fn, rets[k]))
        for members in uf.classes():
            block = ""
            for member in members:
                block = blocks.get(member) or self._member_block(member)
                if block:
                    break
            self.groups.append(Group("call", members, block))

    def _member_block(self, member: Member) -> str:
        if member[0] in ("arg", "ret"):
            fn, name = member[1], member[2]
            dtypes = (self.functions[fn].arg_dtypes if member[0] == "arg"
                      else {r: d for r, (_, _, d) in self.functions[fn].rets.items()})
            if dtypes.get(name) != DT_FLOAT:
                return f"{member[0]} {name!r} of {fn!r} is not float32"
            return self.fixed.get(fn, "")
        _, body_name, node_name, attr = member
        body = self.bodies[body_name]
        return self._slot_block(body, body.nodes[node_name], attr)

    def _list_groups(self) -> None:
        """TensorLists: follow variant values; every op on one list agrees. And
        optionals, for range holds only (``optional_links``)."""
        self._optional_ends: dict = {}  # variant value -> [(body, Optional op)]
        if not any(op.startswith(("TensorList", "EmptyTensorList", "Optional"))
                   for body in self.view.bodies for op in body.ops):
            return
        uf = _UnionFind()
        blocked_values: dict = {}
        element_slots: dict = {}  # value key -> [slot members]

        def value(body: Body, ref: TensorRef):
            if ref.is_arg:
                return ("arg", body.name, ref.node)
            return ("t", body.name, ref.node, ref.index)

        for body in self.view.bodies:
            for ret, (ref, _, dtype) in body.rets.items():
                if dtype == DT_VARIANT:
                    uf.union(("ret", body.name, ret), value(body, ref))
            for arg, dtype in body.arg_dtypes.items():
                if dtype == DT_VARIANT and body.name in self.hidden:
                    blocked_values[("arg", body.name, arg)] = self.hidden[body.name]
            for node in body.nodes.values():
                self._variant_node(body, node, uf, value, blocked_values, element_slots)
        for body, node, by_attr in self.calls:
            self._variant_call(body, node, by_attr, uf, value)
        self._join_wrapped_variants(uf, value)
        ends: dict = {}
        for key, found in self._optional_ends.items():
            ends.setdefault(uf.find(key), []).extend(found)
        for found in ends.values():
            gets = [(b, n.name) for b, n in found if n.op == "OptionalGetValue"]
            for b, n in found:
                if n.op == "OptionalFromValue" and gets:
                    self.optional_links[(b, n.name)] = gets
        for members in uf.classes():
            slots = [m for key in members for m in element_slots.get(key, ())]
            if not slots:
                continue
            nodes = [self.bodies[b].nodes[n] for _, b, n, _ in slots]
            dtypes = {node.node_def.attr["element_dtype"].type for node in nodes}
            if DT_FLOAT not in dtypes:
                continue
            block = next((blocked_values[k] for k in members if k in blocked_values), "")
            if not block and dtypes != {DT_FLOAT}:
                block = "the list also holds other element types"
            for member in slots:
                if block:
                    break
                block = self._member_block(member)
            self.groups.append(Group("list", slots, block))

    def _join_wrapped_variants(self, uf, value) -> None:
        """An optional whose contents are a variant (a nested cond: the outer branch
        wraps the inner If's optionals in its own for the outer gradient branch,
        which unwraps them and hands them to the inner gradient If): what goes in
        at an OptionalFromValue and comes out of its OptionalGetValue is one value.
        Joined until nothing changes (one round per level of nesting)."""
        while True:
            ends: dict = {}
            for key, found in self._optional_ends.items():
                ends.setdefault(uf.find(key), []).extend(found)
            joined = False
            for found in ends.values():
                for from_body, from_node in found:
                    if from_node.op != "OptionalFromValue":
                        continue
                    for index, (ref, _) in enumerate(from_node.data_inputs):
                        if (index >= len(from_node.inputs)
                                or from_node.inputs[index].dtype != DT_VARIANT):
                            continue
                        source = value(self.bodies[from_body], ref)
                        for get_body, get_node in found:
                            if (get_node.op != "OptionalGetValue"
                                    or index >= len(get_node.outputs)
                                    or get_node.outputs[index].dtype != DT_VARIANT):
                                continue
                            out = value(self.bodies[get_body], TensorRef(get_node.name, index))
                            if uf.find(source) != uf.find(out):
                                uf.union(source, out)
                                joined = True
            if not joined:
                return

    def _variant_node(self, body, node, uf, value, blocked_values, element_slots) -> None:
        out_refs = [TensorRef(node.name, i) for i, p in enumerate(node.outputs)
                    if p.dtype == DT_VARIANT]
        in_refs = [ref for i, (ref, _) in enumerate(node.data_inputs)
                   if i < len(node.inputs) and node.inputs[i].dtype == DT_VARIANT]
        for ref in out_refs:
            uf.find(value(body, ref))
            if body.name == "" and ref in self.pinned:
                blocked_values[value(body, ref)] = "a graph output"
        if not in_refs and not out_refs:
            return
        if node.op.startswith("TensorList") or node.op == "EmptyTensorList":
            keys = [value(body, r) for r in in_refs + out_refs]
            for key in keys[1:]:
                uf.union(keys[0], key)
            if "element_dtype" in node.node_def.attr and keys:
                element_slots.setdefault(keys[0], []).append(
                    ("slot", body.name, node.name, "element_dtype"))
            return
        if node.op == "AddN":  # adds lists element-wise: one element type throughout
            keys = [value(body, r) for r in in_refs + out_refs]
            for key in keys[1:]:
                uf.union(keys[0], key)
            return
        if node.op in _VARIANT_PASSTHROUGH:
            for index, port in enumerate(node.outputs):
                if port.dtype == DT_VARIANT and index < len(node.data_inputs):
                    uf.union(value(body, TensorRef(node.name, index)),
                             value(body, node.data_inputs[index][0]))
            return
        if node.op in _CALL_OPS:
            return  # joined in _variant_call
        if node.op in ("OptionalFromValue", "OptionalGetValue"):
            # (followed for range holds only: cond_v2 hands a branch's
            # intermediates to its gradient branch wrapped in optionals)
            key = (value(body, TensorRef(node.name, 0)) if node.op == "OptionalFromValue"
                   else value(body, node.data_inputs[0][0]) if node.data_inputs else None)
            if key is not None:
                uf.find(key)
                self._optional_ends.setdefault(key, []).append((body.name, node))
        why = f"a variant reaches {node.op} {node.name!r}"
        for ref in in_refs:
            blocked_values[value(body, ref)] = why
            uf.find(value(body, ref))
        for ref in out_refs:
            blocked_values.setdefault(value(body, ref), why)

    def _variant_call(self, body, node, by_attr, uf, value) -> None:
        fns = [fn for fns in by_attr.values() for fn in fns]
        is_while = node.op in _WHILE_OPS
        for index, port in enumerate(node.inputs):
            if port.dtype != DT_VARIANT or index >= len(node.data_inputs):
                continue
            k = _list_index(port.type_attr or "")
            here = value(body, node.data_inputs[index][0])
            if k is None:
                continue
            for fn in fns:
                args = list(self.functions[fn].arg_dtypes)
                if k < len(args):
                    uf.union(here, ("arg", fn, args[k]))
            if is_while:
                fn = by_attr["body"][0]
                rets = list(self.functions[fn].rets)
                if k < len(rets):
                    uf.union(here, ("ret", fn, rets[k]))
                uf.union(here, value(body, TensorRef(node.name, k)))
        if is_while:
            return
        for index, port in enumerate(node.outputs):
            if port.dtype != DT_VARIANT:
                continue
            k = _list_index(port.type_attr or "")
            for fn in fns:
                rets = list(self.functions[fn].rets)
                if k is not None and k < len(rets):
                    uf.union(value(body, TensorRef(node.name, index)), ("ret", fn, rets[k]))

    def _tf1_groups(self) -> None:
        for body in self.view.bodies:
            uf = _UnionFind()
            for node in body.nodes.values():
                if node.op not in _TF1_FRAME_OPS:
                    continue
                for index, (ref, _) in enumerate(node.data_inputs):
                    if index >= len(node.inputs) or ref.is_arg:
                        continue
                    port, producer = node.inputs[index], body.nodes.get(ref.node)
                    if (producer is None or producer.op not in _TF1_FRAME_OPS
                            or port.type_attr is None or port.dtype != DT_FLOAT):
                        continue
                    out = producer.outputs[ref.index]
                    uf.union(("slot", body.name, node.name, port.type_attr),
                             ("slot", body.name, producer.name, out.type_attr))
            for members in uf.classes():
                block = ""
                for member in members:
                    block = self._member_block(member)
                    if block:
                        break
                self.groups.append(Group("tf1", members, block))


def _list_index(type_attr: str) -> int | None:
    """2 for "T[2]" / "Tin[2]" / "Tout[2]", None for a plain attribute."""
    if not type_attr.endswith("]"):
        return None
    return int(type_attr[type_attr.index("[") + 1:-1])


# -- choosing groups ----------------------------------------------------------------


class _Solver:
    def __init__(self, analysis: _Analysis, color_body: Callable):
        self.a = analysis
        self.color_body = color_body
        self.target = analysis.target
        self.cache: dict = {}  # (body, overrides) -> (decisions, denied slots)
        self.cast_counts: dict = {}  # (body, overrides) -> Casts needed
        self.decisions: dict = {}
        self.denied: dict = {}  # (body, node, attr) -> why it must stay float32 (see solve)
        # Members whose value a body keeps float32 for its range (color_body's
        # third result) -> (kind, cause), and the groups that carry such a
        # value: (group, kind) -> cause.
        self.ranged_members: dict[Member, tuple[str, str]] = {}
        self.ranged: dict[tuple[int, str], str] = {}
        self.ranged_kinds: dict[int, list[tuple[str, str]]] = {}  # group -> [(kind, cause)]
        # body -> [(node, type attribute, kind, cause)]: optionals' contents (optional_links)
        self.ranged_unwrapped: dict[str, set[tuple[str, str, str, str]]] = {}
        self.by_body: dict[str, list[int]] = {}  # body -> groups with a member there
        for index, group in enumerate(analysis.groups):
            for body in dict.fromkeys(m[1] for m in group.members):
                self.by_body.setdefault(body, []).append(index)

    def overrides(self, body: Body, plan: set[int]) -> BodyOverrides:
        args, rets, forced, blocked, ranged = set(), set(), [], [], []
        target = dtype_name(self.target)
        for index in self.by_body.get(body.name, ()):
            group = self.a.groups[index]
            on = index in plan
            carried = self.ranged_kinds.get(index, ())
            for member in group.members:
                if carried and member[1] == body.name and member[0] != "ret":
                    node, attr = ((arg_slot_name(member[2]), "T") if member[0] == "arg"
                                  else member[2:])
                    ranged.extend((node, attr, kind, cause) for kind, cause in carried)
                if member[0] != "slot" and member[1] == body.name and on:
                    (args if member[0] == "arg" else rets).add(member[2])
                elif member[0] == "slot" and member[1] == body.name:
                    _, _, node, attr = member
                    if on:
                        forced.append((node, attr, _reason(group, target)))
                    elif group.kind == "tf1":
                        why = group.block or f"{target} would not need fewer Casts"
                        blocked.append((node, attr, f"TF1 loop frame kept float32 "
                                                    f"as a whole: {why}"))
        ranged.extend(self.ranged_unwrapped.get(body.name, ()))
        return BodyOverrides(frozenset(args), frozenset(rets), tuple(sorted(forced)),
                             tuple(sorted(blocked)), tuple(sorted(set(ranged))))

    def _colored(self, body: Body, plan: set[int]):
        """(decisions, denied slots, range-held members) for `body` under `plan`,
        cached."""
        key = (body.name, self.overrides(body, plan))
        if key not in self.cache:
            self.cache[key] = self.color_body(body, key[1])
        return self.cache[key]

    def _casts(self, body: Body, plan: set[int]) -> int:
        """Casts `body` needs under `plan`, cached.

        Counted only when a group is weighed (``weighted_casts``): a graph
        without boundary groups never needs it, and counting walks every edge.
        """
        key = (body.name, self.overrides(body, plan))
        if key not in self.cast_counts:
            decisions, _, _ = self._colored(body, plan)
            self.cast_counts[key] = _count_casts(body, decisions, key[1], self.target,
                                                 self.a.in_frame[body.name])
        return self.cast_counts[key]

    def weighted_casts(self, index: int, plan: set[int]) -> int:
        """Loop-weighted Casts in the bodies group `index` touches, under `plan`."""
        names = dict.fromkeys(m[1] for m in self.a.groups[index].members)
        return sum(self.a.weight.get(name, 1) * self._casts(self.a.bodies[name], plan)
                   for name in names)

    def weighing_work(self, plan: set[int]) -> int:
        """Nodes re-coloured to weigh every group of `plan` exactly (an upper bound)."""
        return sum(len(self.a.bodies[name].nodes)
                   for index in plan
                   for name in dict.fromkeys(m[1] for m in self.a.groups[index].members))

    def pays_off(self, index: int, plan: set[int]) -> bool:
        """True if group `index` in 16-bit needs fewer (weighted) Casts than float32."""
        return (self.weighted_casts(index, plan)
                < self.weighted_casts(index, plan - {index}))

    def grounded(self, plan: set[int]) -> set[int]:
        """The groups of `plan` whose 16-bit values reach a 16-bit computation.

        Under `plan`'s colouring (``color_all``), every converted node is joined
        to the converted producers it reads in 16 bits, to the 16-bit groups whose
        slot, argument or result it is, and a group to all its members; a node on
        the allow list, or one reading a value the input already held in 16 bits,
        grounds what it is joined to. A group joined to no such node holds values
        in 16 bits for nothing: only ops that follow their neighbours (clear,
        infer) and other such groups keep it there. Each group weighed alone
        paid off while the others were 16-bit (a call's argument and its result
        save each other's Casts), so the Cast counts cannot see it."""
        sixteen = (types_pb2.DT_HALF, types_pb2.DT_BFLOAT16)
        member_group = {m: i for i in plan for m in self.a.groups[i].members}
        uf, seeds = _UnionFind(), []
        for body in self.a.view.bodies:
            overrides = self.overrides(body, plan)
            for name, node in body.nodes.items():
                decision = self.decisions.get((body.name, name))
                if decision is None or not decision.converted_attrs:
                    continue
                item = ("node", body.name, name)
                uf.find(item)
                if decision.list == "allow":
                    seeds.append(item)
                for attr in decision.converted_attrs:
                    group = member_group.get(("slot", body.name, name, attr))
                    if group is not None:
                        uf.union(item, ("group", group))
                for index, (ref, _) in enumerate(node.data_inputs):
                    if (index >= len(node.inputs)
                            or node.inputs[index].type_attr not in decision.converted_attrs):
                        continue
                    if ref.is_arg:
                        group = member_group.get(("arg", body.name, ref.node))
                        if group is not None and ref.node in overrides.args:
                            uf.union(item, ("group", group))
                        elif body.arg_dtypes.get(ref.node) in sixteen:
                            seeds.append(item)
                        continue
                    port = body.producer_port(ref)
                    producer = self.decisions.get((body.name, ref.node))
                    if port is None:
                        continue
                    if producer is not None and port.type_attr in producer.converted_attrs:
                        uf.union(item, ("node", body.name, ref.node))
                    elif port.dtype in sixteen:
                        seeds.append(item)
            for ret, (ref, _, _) in body.rets.items():
                group = member_group.get(("ret", body.name, ret))
                if group is None or ret not in overrides.rets:
                    continue
                if ref.is_arg:
                    source = member_group.get(("arg", body.name, ref.node))
                    if source is not None and ref.node in overrides.args:
                        uf.union(("group", group), ("group", source))
                else:
                    uf.union(("group", group), ("node", body.name, ref.node))
        roots = {uf.find(seed) for seed in seeds}
        return {i for i in plan if uf.find(("group", i)) in roots}

    def color_all(self, plan: set[int]) -> dict:
        decisions, denied, ranged = {}, {}, {}
        for body in self.a.view.bodies:
            body_decisions, body_denied, body_ranged = self._colored(body, plan)
            decisions.update(body_decisions)
            denied.update({(body.name, *slot): why for slot, why in body_denied.items()})
            ranged.update({(kind, body.name, *rest): cause
                           for (kind, *rest), cause in body_ranged.items()})
        self.decisions = decisions
        self.denied = denied
        self.ranged_members = ranged
        return decisions

    def spread_range_holds(self, plan: set[int]) -> dict:
        """Holds a value that one body keeps float32 for its range wherever a
        boundary group carries it: the group's members in other bodies hold
        their readers float32 too (``BodyOverrides.ranged``), and what those
        hold may reach further groups (a forward function's result, the call's
        output, the gradient function's argument; an optional that cond_v2
        hands to the gradient branch, ``optional_links``): re-coloured until
        nothing is added. A graph without such a value (most) is coloured once.
        Returns the last colouring's decisions.
        """
        decisions = self.color_all(plan)
        while True:  # (each round adds a group or an optional's contents: finitely many)
            added, unwrapped = {}, False
            for member, (kind, cause) in self.ranged_members.items():
                index = self.a.group_of.get(member)
                if index is not None and (index, kind) not in self.ranged:
                    added.setdefault((index, kind), cause)
                component = _list_index(member[3]) if member[0] == "slot" else None
                for body, node in self.a.optional_links.get(member[1:3], ()):
                    entry = (node, f"output_types[{component}]", kind, cause)
                    if component is not None and entry not in self.ranged_unwrapped.get(
                            body, ()):
                        self.ranged_unwrapped.setdefault(body, set()).add(entry)
                        unwrapped = True
            if not added and not unwrapped:
                break
            self.ranged.update(added)
            for (index, kind), cause in added.items():
                self.ranged_kinds.setdefault(index, []).append((kind, cause))
            decisions = self.color_all(plan)
        return decisions

    # -- cost of a group given the current colouring --------------------------------

    def _converted(self, body: str, node: str) -> tuple[str, ...]:
        return self.decisions[(body, node)].converted_attrs

    def _producer_dtype(self, body: Body, ref: TensorRef, plan: set[int]) -> int | None:
        if ref.is_arg:
            dtype = body.arg_dtypes.get(ref.node)
            group = self.a.group_of.get(("arg", body.name, ref.node))
            return self.target if group in plan and group is not None else dtype
        port = body.producer_port(ref)
        if port is None:
            return None
        return self.target if port.type_attr in self._converted(body.name, ref.node) \
            else port.dtype

    def _producer_member(self, body: Body, ref: TensorRef) -> Member | None:
        if ref.is_arg:
            return ("arg", body.name, ref.node)
        port = body.producer_port(ref)
        return ("slot", body.name, ref.node, port.type_attr) if port else None

    def _consumer_dtypes(self, body: Body, ref: TensorRef, group: int,
                         plan: set[int]) -> set[int]:
        wanted = set()
        for consumer, index in body.consumers.get(ref, ()):
            node = body.nodes[consumer]
            if index >= len(node.inputs):
                continue
            port = node.inputs[index]
            if self.a.group_of.get(("slot", body.name, consumer, port.type_attr)) == group:
                continue
            wanted.add(self.target if port.type_attr in self._converted(body.name, consumer)
                       else port.dtype)
        for ret, (ret_ref, _, dtype) in body.rets.items():
            if ret_ref != ref:
                continue
            ret_group = self.a.group_of.get(("ret", body.name, ret))
            if ret_group == group:
                continue
            wanted.add(self.target if ret_group in plan and ret_group is not None else dtype)
        return wanted

    def cost(self, index: int, plan: set[int]) -> tuple[int, int]:
        """(Casts if the group is 16-bit, Casts if float32), loop-weighted.

        A local estimate with every neighbour as coloured now; it picks
        candidates. Whether a group stays 16-bit is decided by ``pays_off``,
        which re-colours its bodies (neighbours that follow the group move
        Casts rather than remove them).
        """
        group = self.a.groups[index]
        cost16 = cost32 = 0

        def add_producer(body, ref, weight):
            nonlocal cost16, cost32
            member = self._producer_member(body, ref)
            if member is not None and self.a.group_of.get(member) == index:
                return
            dtype = self._producer_dtype(body, ref, plan)
            cost16 += weight * (dtype == DT_FLOAT)
            cost32 += weight * (dtype == self.target)

        def add_consumers(body, ref, weight):
            nonlocal cost16, cost32
            wanted = self._consumer_dtypes(body, ref, index, plan)
            cost16 += weight * (DT_FLOAT in wanted)
            cost32 += weight * (self.target in wanted)

        for member in group.members:
            body = self.a.bodies[member[1]]
            weight = self.a.weight.get(body.name, 1)
            if member[0] == "arg":
                add_consumers(body, TensorRef(member[2], 0, is_arg=True), weight)
            elif member[0] == "ret":
                add_producer(body, body.rets[member[2]][0], weight)
            else:
                node = body.nodes[member[2]]
                inside = weight * (LOOP_WEIGHT if group.kind == "tf1" else 1)
                in_weight = weight if node.op in ("Enter", "RefEnter") else inside
                out_weight = weight if node.op in ("Exit", "RefExit") else inside
                for i, (ref, _) in enumerate(node.data_inputs):
                    if i < len(node.inputs) and node.inputs[i].type_attr == member[3]:
                        add_producer(body, ref, in_weight)
                for i, port in enumerate(node.outputs):
                    if port.type_attr == member[3]:
                        add_consumers(body, TensorRef(node.name, i), out_weight)
        return cost16, cost32

    def has_16bit_neighbour(self, index: int, plan: set[int]) -> bool:
        return self.cost(index, plan)[1] > 0


def _tf1_frame_nodes(body: Body) -> frozenset[str]:
    """Nodes inside a TF1 loop frame: reached from an Enter without passing an Exit."""
    seen: set[str] = set()
    if "Enter" not in body.ops and "RefEnter" not in body.ops:
        return frozenset()
    stack = [name for name, node in body.nodes.items() if node.op in ("Enter", "RefEnter")]
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        if body.nodes[name].op in ("Exit", "RefExit"):
            continue
        for ref in body.output_refs(name):
            stack.extend(c for c, _ in body.consumers.get(ref, ()) if c not in seen)
    return frozenset(seen)


def _count_casts(body: Body, decisions: dict, overrides: BodyOverrides, target: int,
                 in_frame: frozenset[str] = frozenset()) -> int:
    """Casts casts.insert_casts puts in `body` (one per tensor and dtype).

    A Cast feeding a node inside a TF1 loop frame counts LOOP_WEIGHT times.
    """
    arg_dtypes = {a: target if a in overrides.args else d for a, d in body.arg_dtypes.items()}

    def new_dtype(ref: TensorRef):
        if ref.is_arg:
            return arg_dtypes.get(ref.node)
        port = body.producer_port(ref)
        if port is None:
            return None
        converted = decisions[(body.name, ref.node)].converted_attrs
        return target if port.type_attr in converted else port.dtype

    needed: dict[tuple[TensorRef, int], int] = {}
    for name, node in body.nodes.items():
        converted = decisions[(body.name, name)].converted_attrs
        weight = LOOP_WEIGHT if name in in_frame and node.op not in ("Enter", "RefEnter") else 1
        for index, (ref, _) in enumerate(node.data_inputs):
            if index >= len(node.inputs) or body.producer_port(ref) is None:
                continue
            port = node.inputs[index]
            wanted = target if port.type_attr in converted else port.dtype
            if new_dtype(ref) != wanted:
                needed[(ref, wanted)] = max(weight, needed.get((ref, wanted), 0))
    for ret, (ref, _, dtype) in body.rets.items():
        wanted = target if ret in overrides.rets else dtype
        if body.producer_port(ref) is not None and new_dtype(ref) != wanted:
            needed.setdefault((ref, wanted), 1)
    return sum(needed.values())


def _reason(group: Group, target: str) -> str:
    what = {"call": "a value crossing a call or loop boundary",
            "list": "a TensorList's elements",
            "tf1": "a TF1 loop frame"}[group.kind]
    return (f"boundary: {what}, {target} on every side "
            f"(every producer and consumer agrees)")


@dataclasses.dataclass
class Solution:
    """What ``solve`` decided.

    Attributes:
      decisions: (function, node) -> Decision, clones included.
      signatures: function -> its changed argument/result dtypes.
      clones: new function name -> the library function it copies.
      call_targets: call site (body, node, attribute, index) -> the clone it
        now calls.
    """

    decisions: dict
    signatures: dict[str, SignatureTypes]
    clones: dict[str, str]
    call_targets: dict[Site, str]


def _clone_call_sites(view: GraphView) -> tuple[GraphView, dict[str, str], dict[Site, str]]:
    """Gives every call site after the first of a shared function its own copy.

    Only functions whose every reference is a known call op (While, If,
    Case, PartitionedCall, ...) and whose signature nothing outside relies on.
    ``solve`` merges copies that end up coloured like the original back.
    """
    sites: dict[str, list[Site]] = {}
    unclonable: set[str] = set()
    functions = {b.name: b for b in view.bodies if b.is_function}
    if not functions:
        return view, {}, {}
    for body in view.bodies:
        for node in body.nodes.values():
            if node.op in functions:
                unclonable.add(node.op)
            if not _has_func_attrs(node.op):
                continue
            known = _CALL_OPS.get(node.op, ())
            for attr_name, value in node.node_def.attr.items():
                funcs = ([value.func.name] if value.HasField("func")
                         else [f.name for f in value.list.func])
                for index, fn in enumerate(funcs):
                    sites.setdefault(fn, []).append((body.name, node.name, attr_name, index))
                    if attr_name not in known:
                        unclonable.add(fn)
    clones: dict[str, str] = {}
    targets: dict[Site, str] = {}
    bodies = list(view.bodies)
    for fn, fn_sites in sites.items():
        body = functions.get(fn)
        if (body is None or fn in unclonable or len(fn_sites) < 2
                or body.function_attrs & _SIGNATURE_FIXING_ATTRS):
            continue
        for k, site in enumerate(fn_sites[1:], start=1):
            clone = f"{fn}_tfamp_copy{k}"
            clones[clone] = fn
            targets[site] = clone
            bodies.append(dataclasses.replace(body, name=clone))
    if not clones:
        return view, {}, {}
    signatures = dict(view.signatures)
    signatures.update({c: view.signatures[fn] for c, fn in clones.items()})
    return GraphView(bodies=bodies, signatures=signatures), clones, targets


def _merge_clones(solution: Solution, view: GraphView, target: int) -> Solution:
    """Drops copies coloured like their original; names the rest.

    A kept copy is ``<fn>_tfamp_<f16|bf16>`` when its signature has 16-bit
    types, ``<fn>_tfamp_f32`` when it keeps float32 ones.
    """
    if not solution.clones:
        return solution
    nodes = {b.name: list(b.nodes) for b in view.bodies}
    taken = set(nodes)
    short = {"float16": "f16", "bfloat16": "bf16"}[dtype_name(target)]

    def result(name: str):
        types = solution.signatures.get(name, SignatureTypes({}, {}))
        return (tuple(sorted(types.args.items())), tuple(sorted(types.rets.items())),
                tuple(solution.decisions[(name, n)].converted_attrs
                      for n in nodes[solution.clones.get(name, name)]))

    renamed: dict[str, str] = {}
    for clone, fn in solution.clones.items():
        key = result(clone)
        if key == result(fn):
            renamed[clone] = fn
            continue
        twin = next((new for old, new in renamed.items()
                     if solution.clones.get(old) == fn and new != fn and result(old) == key), None)
        if twin is None:
            # Named after its signature: 16-bit somewhere, or all float32.
            tag = short if key[0] or key[1] else "f32"
            twin, suffix = f"{fn}_tfamp_{tag}", 2
            while twin in taken:
                twin, suffix = f"{fn}_tfamp_{tag}_{suffix}", suffix + 1
            taken.add(twin)
        renamed[clone] = twin
    kept = {new: solution.clones[old] for old, new in renamed.items()
            if new != solution.clones[old]}
    decisions = {}
    for (name, node), decision in solution.decisions.items():
        if name in renamed:
            if renamed[name] in kept:
                decisions[(renamed[name], node)] = decision
        else:
            decisions[(name, node)] = decision
    signatures = {}
    for name, types in solution.signatures.items():
        if name not in renamed:
            signatures[name] = types
        elif renamed[name] in kept:
            signatures[renamed[name]] = types
    call_targets = {site: renamed[c] for site, c in solution.call_targets.items()
                    if renamed[c] != solution.clones[c]}
    return Solution(decisions, signatures, kept, call_targets)


def solve(view: GraphView, config: AmpConfig, pinned: set[TensorRef],
          color_body: Callable[[Body, BodyOverrides], tuple],
          xla_compiled: frozenset[str] = frozenset()) -> Solution:
    """Chooses which boundary groups go 16-bit and colours every body.

    Args:
      view: the graph and its library.
      config: the rewrite settings.
      pinned: top-graph tensors whose dtype callers rely on.
      color_body: colours one body under given overrides; returns its
        decisions keyed by (function, node) and the slots that must stay
        float32 whatever the boundaries ({(node, type attribute): reason}:
        reached by deny propagation, or blocked for their own reasons), and
        the boundary members that carry a value it keeps float32 for its
        range ({("slot", node, type attribute) | ("ret", name): (kind, cause)}).
      xla_compiled: the names of the bodies XLA compiles (``compiled``), whose
        ops need XLA kernels for their types too.

    Returns:
      A Solution: decisions for every node, new signature types, and the
      copies of functions whose callers disagree.
    """
    original_view = view
    view, clones, targets = _clone_call_sites(view)
    analysis = _Analysis(view, config, pinned, targets, xla_compiled)
    solver = _Solver(analysis, color_body)
    plan: set[int] = set()
    decisions = solver.spread_range_holds(plan)
    for group in analysis.groups:
        # Deny propagation reaches a group's slots (a TF1 frame downstream of
        # Exp, a loop fed by one), or a slot is blocked for its own reasons (no
        # kernel, keep_fp32, a graph output): the group stays float32.
        denied = [solver.denied[m[1:]] for m in group.members
                  if m[0] == "slot" and m[1:] in solver.denied]
        if denied and not group.block:
            group.block = denied[0]
    open_groups = [i for i, g in enumerate(analysis.groups) if not g.block]
    rejected: set[int] = set()
    for round_ in range(_MAX_ROUNDS):
        # First every open group (coupled groups, such as an LSTM's h and c,
        # only pay off together), then those next to a 16-bit slot.
        grow = {i for i in open_groups if i not in plan and i not in rejected
                and (round_ == 0 or solver.has_16bit_neighbour(i, plan))}
        if not grow:
            break
        plan |= grow
        for _ in range(_MAX_ROUNDS):
            decisions = solver.color_all(plan)
            if len(plan) > _EXACT_GROUPS and solver.weighing_work(plan) > _EXACT_WORK:
                costs = {i: solver.cost(i, plan) for i in plan}
                drop = {i for i, (c16, c32) in costs.items() if c16 >= c32}
                if drop:
                    plan -= drop
                    rejected |= drop
                    continue
                if solver.weighing_work(plan) > _EXACT_WORK:
                    break  # every group pays off by the estimate: keep them
            drop = {i for i in plan if not solver.pays_off(i, plan)}
            if not drop:
                break
            plan -= drop
            rejected |= drop
        else:
            decisions = solver.color_all(plan)
    # Each group above paid off while the others were 16-bit; those that reach no
    # 16-bit computation go (a tf.cond around a flip, no matrix op anywhere: its
    # argument and its result each saved the other's Casts, and the values were
    # rounded to 16 bits for nothing; a nested function's forward and backward
    # functions, the same across the caller).
    if plan:
        solver.color_all(plan)
        plan &= solver.grounded(plan)
    decisions = solver.color_all(plan)
    signatures: dict[str, SignatureTypes] = {}
    for index in sorted(plan):
        for member in analysis.groups[index].members:
            if member[0] == "slot":
                continue
            types = signatures.setdefault(member[1], SignatureTypes({}, {}))
            (types.args if member[0] == "arg" else types.rets)[member[2]] = solver.target
    if plan:
        log.debug("tfamp boundaries: %d of %d groups 16-bit: %s", len(plan),
                  len(analysis.groups),
                  ", ".join(analysis.groups[i].describe() for i in sorted(plan)))
    solution = Solution(decisions, signatures, clones, targets)
    return _merge_clones(solution, original_view, solver.target)
