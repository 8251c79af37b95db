"""Which weights ``tfamp export`` stores in 16-bit, and the edit that stores them so.

A weight (a variable the signature captures) is stored in 16-bit when every read
of it, in every body, reaches the rest of the graph only through Casts to the
16-bit type, possibly after ops that merely copy its elements
(``oplists.VALUE_COPIES``, e.g. an embedding's Gather): the reads and copies are
retyped and those Casts removed, so nothing casts the weight on each call. Any
other reader (a float32 op, a graph output, an op that takes the resource
itself) keeps it float32, and is named as the reason.

Pure: ``plan_weights`` reads a rewritten GraphDef, ``store_16bit`` returns an
edited copy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from tensorflow.core.framework import graph_pb2, types_pb2
from tensorflow.python.framework import op_def_registry

from tfamp.oplists import VALUE_COPIES
from tfamp.rewrite.graph import Body, GraphView, TensorRef, build_view, dtype_name
from tfamp.serving.dataflow import Flow

# Ops that read a variable's value; the attribute that holds the value's dtype.
READ_OPS = {"ReadVariableOp": "dtype", "ResourceGather": "dtype",
            "ResourceGatherNd": "dtype"}
# Ops that take a variable's handle but not its value's dtype.
SHAPE_ONLY = frozenset({"VariableShape"})


@dataclasses.dataclass(frozen=True)
class WeightPlan:
    """The decision for one captured variable of one signature's graph.

    Attributes:
      placeholder: the captured placeholder's node name in the top graph.
      to_16bit: stored in the 16-bit type.
      reason: why (e.g. "read by float32 Mul 'model/scale/mul'").
      retype: (body, node, type attribute) of each read and copy to retype.
      casts: (body, Cast node) of each Cast to remove.
      read_by: the first node that reads it ("" if none), to name it by.
    """

    placeholder: str
    to_16bit: bool
    reason: str
    retype: tuple[tuple[str, str, str], ...] = ()
    casts: tuple[tuple[str, str], ...] = ()
    read_by: str = ""


def plan_weights(graph_def: graph_pb2.GraphDef, placeholders: Iterable[str],
                 outputs: Iterable[str], target: int,
                 view: GraphView | None = None) -> dict[str, WeightPlan]:
    """Which of the captured variables `placeholders` can be stored as `target`.

    Args:
      graph_def: a signature's graph, rewritten by tfamp.
      placeholders: node names of the top-graph placeholders that capture variables.
      outputs: the graph's output tensor names ("Identity:0").
      target: types_pb2.DT_HALF or DT_BFLOAT16.
      view: `graph_def`'s GraphView, if already built.

    Returns:
      placeholder -> WeightPlan. Variables whose reads share a node (a function
      called with several of them) are decided together.
    """
    view = view or build_view(graph_def)
    flow = Flow(view)
    outputs = {o if ":" in o else f"{o}:0" for o in outputs}
    plans = {name: _plan_one(flow, name, outputs, target) for name in placeholders}
    # A read node reached from several variables must keep one dtype for all.
    holders: dict[tuple[str, str], set[str]] = {}
    for name, plan in plans.items():
        for body, node, _ in plan.retype:
            holders.setdefault((body, node), set()).add(name)
    changed = True
    while changed:
        changed = False
        for sharing in holders.values():
            kept = [n for n in sharing if not plans[n].to_16bit]
            for name in sharing:
                if plans[name].to_16bit and kept:
                    plans[name] = dataclasses.replace(
                        plans[name], to_16bit=False, retype=(), casts=(),
                        reason=f"shares a read with {kept[0]!r}, which stays float32")
                    changed = True
    return plans


def _plan_one(flow: Flow, placeholder: str, outputs: set[str], target: int) -> WeightPlan:
    uses = flow.uses("", TensorRef(placeholder, 0))
    plan = _decide(flow, placeholder, uses, outputs, target)
    return dataclasses.replace(plan, read_by=uses.reads[0].node if uses.reads else "")


def _decide(flow: Flow, placeholder: str, uses, outputs: set[str], target: int) -> WeightPlan:
    for (function, index), sites in uses.entries.items():
        others = [s for s in flow.call_sites(function) if s not in sites]
        if others:
            return WeightPlan(placeholder, False,
                              f"function {function!r} also takes another resource as "
                              f"argument {index} (at {others[0][1]!r})")
    retype: list[tuple[str, str, str]] = []
    casts: list[tuple[str, str]] = []
    for use in uses.reads:
        body = flow.bodies[use.body]
        node = body.nodes[use.node]
        if node.op in SHAPE_ONLY:
            continue
        attr = READ_OPS.get(node.op)
        if attr is None or use.index != 0:
            return WeightPlan(placeholder, False, f"its handle is used by {node.op} "
                                                  f"{use.node!r}")
        if node.node_def.attr[attr].type != types_pb2.DT_FLOAT:
            return WeightPlan(placeholder, False, f"not a float32 weight "
                              f"({dtype_name(node.node_def.attr[attr].type)})")
        found = _copies_and_casts(body, use.node, attr, outputs if not use.body else set(),
                                  target)
        if isinstance(found, str):
            return WeightPlan(placeholder, False, found)
        retype.extend((use.body, name, a) for name, a in found[0])
        casts.extend((use.body, name) for name in found[1])
    if not casts:
        return WeightPlan(placeholder, False, "no 16-bit op reads it")
    return WeightPlan(placeholder, True, f"every read is cast to {dtype_name(target)}",
                      tuple(retype), tuple(casts))


def _copies_and_casts(body: Body, read: str, attr: str, outputs: set[str], target: int
                      ) -> tuple[list[tuple[str, str]], list[str]] | str:
    """([(node, type attr) to retype], [Casts to remove]) below one read, or why not."""
    returned = {ref for ref, _, _ in body.rets.values()}
    retype = [(read, attr)]
    casts = []
    pending = [read]
    while pending:
        name = pending.pop()
        ref = TensorRef(name, 0)
        if ref in returned or f"{name}:0" in outputs:
            return f"{name!r} is an output of {'its function' if body.is_function else 'the graph'}"
        for consumer, index in body.consumers.get(ref, ()):
            node = body.nodes[consumer]
            if node.op == "Cast":
                if node.node_def.attr["DstT"].type != target:
                    return f"cast to {dtype_name(node.node_def.attr['DstT'].type)} by {consumer!r}"
                if f"{consumer}:0" in outputs:
                    return f"its Cast {consumer!r} is an output of the graph"
                casts.append(consumer)
            elif node.op in VALUE_COPIES and index == 0 and _one_float_input(node):
                type_attr = node.outputs[0].type_attr if node.outputs else None
                if type_attr is None or "[" in type_attr:
                    return f"copied by {node.op} {consumer!r}, which cannot be retyped"
                retype.append((consumer, type_attr))
                pending.append(consumer)
            else:
                return f"read by float32 {node.op} {consumer!r}"
    return retype, casts


def _one_float_input(node) -> bool:
    return sum(1 for port in node.inputs if port.dtype == types_pb2.DT_FLOAT) == 1


def store_16bit(graph_def: graph_pb2.GraphDef, plans: Iterable[WeightPlan], target: int
                ) -> graph_pb2.GraphDef:
    """A copy of `graph_def` with the planned reads retyped and their Casts removed."""
    new = graph_pb2.GraphDef()
    new.CopyFrom(graph_def)
    retype: dict[str, dict[str, str]] = {}
    casts: dict[str, set[str]] = {}
    for plan in plans:
        if plan.to_16bit:
            for body, node, attr in plan.retype:
                retype.setdefault(body, {})[node] = attr
            for body, node in plan.casts:
                casts.setdefault(body, set()).add(node)
    _edit_body(new.node, None, retype.get("", {}), casts.get("", set()), target)
    for fdef in new.library.function:
        name = fdef.signature.name
        if name in retype or name in casts:
            _edit_body(fdef.node_def, fdef, retype.get(name, {}), casts.get(name, set()), target)
    return new


def _edit_body(node_defs, fdef, retype: dict[str, str], casts: set[str], target: int) -> None:
    for node_def in node_defs:
        attr = retype.get(node_def.name)
        if attr is not None:
            node_def.attr[attr].type = target
    if not casts:
        return
    # What each removed Cast's output is replaced by: the tensor the Cast read.
    replace: dict[str, str] = {}
    sources: dict[str, str] = {}
    for node_def in node_defs:
        if node_def.name in casts:
            source = next(i for i in node_def.input if not i.startswith("^"))
            sources[node_def.name] = source
            if fdef is None:
                replace[node_def.name] = replace[f"{node_def.name}:0"] = source
            else:
                out = op_def_registry.get("Cast").output_arg[0].name
                replace[f"{node_def.name}:{out}:0"] = source
    for node_def in node_defs:
        for i, text in enumerate(node_def.input):
            if text.startswith("^"):
                if text[1:] in sources:
                    node_def.input[i] = "^" + sources[text[1:]].split(":")[0]
            elif text in replace:
                node_def.input[i] = replace[text]
    if fdef is not None:
        for key, value in list(fdef.ret.items()):
            if value in replace:
                fdef.ret[key] = replace[value]
    kept = [n for n in node_defs if n.name not in casts]
    del node_defs[:]
    node_defs.extend(kept)


def weight_casts(graph_def: graph_pb2.GraphDef) -> list[tuple[str, str]]:
    """(body, Cast node) of every Cast that reads a variable's value on each call.

    A Cast whose input comes from a ReadVariableOp / ResourceGather, directly or
    through ops that only copy elements (``oplists.VALUE_COPIES``).
    """
    view = build_view(graph_def)
    found = []
    for body in view.bodies:
        for name, node in body.nodes.items():
            if node.op != "Cast" or not node.data_inputs:
                continue
            ref, _ = node.data_inputs[0]
            while not ref.is_arg and ref.node in body.nodes:
                producer = body.nodes[ref.node]
                if producer.op in READ_OPS:
                    found.append((body.name, name))
                    break
                if producer.op not in VALUE_COPIES or not producer.data_inputs:
                    break
                ref, _ = producer.data_inputs[0]
    return found
