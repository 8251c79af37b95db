"""Is a (rewritten) graph sound? Edge dtypes, Cast round trips, and TF's importer.

``check_graph_def(graph_def) -> list[str]`` lists every problem found;
``assert_valid_graph_def`` raises ``GraphCheckError`` naming them. Tests run it on
every rewrite; ``tfamp.function`` runs it when debug checks are on.
``find_problems(view)`` is the structural part alone (no importer, cheap): the
rewrite runs it on every graph it returns.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf
from tensorflow.core.framework import graph_pb2
from tensorflow.python.framework import function_def_to_graph

from tfamp.rewrite.casts import full_type_mismatch, is_tfamp_cast
from tfamp.rewrite.graph import FLOAT_TYPES, Body, GraphView, build_view, dtype_name


class GraphCheckError(ValueError):
    """A rewritten graph failed ``check_graph_def``."""


@dataclasses.dataclass(frozen=True)
class Problem:
    """One defect found in a graph.

    Attributes:
      message: what is wrong, naming the body and the nodes.
      nodes: the (function, node name) pairs of the *original* nodes involved
        (a Cast tfamp inserted stands for the node it reads), so the pass can
        keep them float32; empty when no node can be blamed.
    """

    message: str
    nodes: tuple[tuple[str, str], ...] = ()


def check_graph_def(graph_def: graph_pb2.GraphDef, *, import_check: bool = True) -> list[str]:
    """Returns a list of problems in `graph_def` (empty when it is sound).

    `graph_def` is not modified (TensorFlow's importer edits the FunctionDefs it
    is given, so it imports a copy).

    Args:
      graph_def: the graph and its function library.
      import_check: also import the graph and every library function with
        TensorFlow's own importer (slower; catches what TF itself rejects).
    """
    problems = [p.message for p in find_problems(build_view(graph_def))]
    if import_check and not problems:
        copied = graph_pb2.GraphDef()
        copied.CopyFrom(graph_def)
        problems.extend(_import_problems(copied))
    return problems


def find_problems(view: GraphView, *, round_trips: bool = True) -> list[Problem]:
    """The structural problems of a graph, without TensorFlow's importer.

    Checks every edge's dtype against its consumer, every TensorList op's full
    type against its element type, every function result against its
    signature, every call's declared types against the function it calls,
    that TF1 loops keep the shape TensorFlow requires (a cycle only through a
    NextIteration -> Merge edge), and, with `round_trips`, that no Cast tfamp
    inserted undoes another Cast (x -> float16 -> back to x).

    Args:
      view: the graph's GraphView.
      round_trips: also look for Cast round trips.

    Returns:
      The problems found, in body order; empty when the graph is sound. For a
      view built with ``build_view(..., earlier=...)``, only those that may
      differ from the earlier graph's (see ``_touched``).
    """
    problems: list[Problem] = []
    bodies = {body.name: body for body in view.bodies}
    for body in view.bodies:
        touched = _touched(body)
        problems.extend(_edge_problems(body, touched))
        problems.extend(_full_type_problems(body, touched))
        if round_trips:
            problems.extend(_round_trip_problems(body, touched))
        problems.extend(_call_problems(
            body, view.signatures, bodies, None if view.edited_signatures else touched))
        problems.extend(_cycle_problems(body))
    return problems


def _touched(body: Body) -> set[str] | None:
    """The nodes whose checks may differ from the earlier graph's, or None for all.

    For a view built with ``build_view(..., earlier=...)``: the edited nodes
    and every node reading one. Each check below reads a node, its producers
    (and, for a Cast round trip, its producer's producer) and the signatures of
    the functions it calls; a node outside this set, with none of those
    edited, reads exactly what it read in the earlier graph and so finds
    exactly the problems (with the same messages) the earlier graph had. The
    pass ignores those anyway (it filters out the input's own problems by
    message), so leaving them out changes nothing it decides. Function
    results and TF1 cycles are always checked in full.
    """
    edited = body.edited
    if edited is None:
        return None
    touched = set(edited)
    if edited:
        for ref, uses in body.consumers.items():
            if ref.node in edited:
                touched.update(consumer for consumer, _ in uses)
    return touched


def assert_valid_graph_def(graph_def: graph_pb2.GraphDef) -> None:
    """Raises GraphCheckError listing every problem `check_graph_def` finds."""
    problems = check_graph_def(graph_def)
    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise GraphCheckError(f"{len(problems)} problem(s) in the graph:\n  {shown}{more}")


def _where(body: Body) -> str:
    return f"function {body.name!r}" if body.is_function else "top graph"


def _origin(body: Body, name: str) -> str | None:
    """The original node `name` stands for: a tfamp Cast stands for its source."""
    node = body.nodes.get(name)
    if node is not None and node.op == "Cast" and is_tfamp_cast(name):
        ref = node.data_inputs[0][0] if node.data_inputs else None
        return None if ref is None or ref.is_arg else ref.node
    return name


def _involved(body: Body, names) -> tuple[tuple[str, str], ...]:
    origins = (_origin(body, name) for name in names)
    return tuple(dict.fromkeys((body.name, n) for n in origins if n is not None))


def _edge_problems(body: Body, touched: set[str] | None = None) -> list[Problem]:
    problems = []
    for name, node in body.nodes.items():
        if touched is not None and name not in touched:
            continue
        for index, (ref, text) in enumerate(node.data_inputs):
            port = body.producer_port(ref)
            if port is None or index >= len(node.inputs):
                continue
            wanted = node.inputs[index].dtype
            if port.dtype != wanted:
                producer = [] if ref.is_arg else [ref.node]
                problems.append(Problem(
                    f"{_where(body)}: {node.op} {name!r} input {index} expects "
                    f"{dtype_name(wanted)} but {text!r} is {dtype_name(port.dtype)}",
                    _involved(body, [name, *producer])))
    for ret_name, (ref, text, dtype) in body.rets.items():
        port = body.producer_port(ref)
        if port is not None and port.dtype != dtype:
            problems.append(Problem(
                f"{_where(body)}: result {ret_name!r} is declared "
                f"{dtype_name(dtype)} but {text!r} is {dtype_name(port.dtype)}",
                () if ref.is_arg else _involved(body, [ref.node])))
    return problems


# Control-flow and call ops: which type-list attribute must match which side of
# each function they call ("in": the function's arguments, "out": its results).
_CALL_TYPES = {
    "While": {"cond": [("T", "in")], "body": [("T", "in"), ("T", "out")]},
    "StatelessWhile": {"cond": [("T", "in")], "body": [("T", "in"), ("T", "out")]},
    "If": {"then_branch": [("Tin", "in"), ("Tout", "out")],
           "else_branch": [("Tin", "in"), ("Tout", "out")]},
    "StatelessIf": {"then_branch": [("Tin", "in"), ("Tout", "out")],
                    "else_branch": [("Tin", "in"), ("Tout", "out")]},
    "Case": {"branches": [("Tin", "in"), ("Tout", "out")]},
    "StatelessCase": {"branches": [("Tin", "in"), ("Tout", "out")]},
    "PartitionedCall": {"f": [("Tin", "in"), ("Tout", "out")]},
    "StatefulPartitionedCall": {"f": [("Tin", "in"), ("Tout", "out")]},
}


def _full_type_problems(body: Body, touched: set[str] | None = None) -> list[Problem]:
    """A TensorList op whose full type disagrees with its element type: TensorFlow's
    type inference rejects the function at run time (a warning, "Type inference
    failed. This indicates an invalid graph that escaped type checking")."""
    return [Problem(f"{_where(body)}: {node.op} {name!r} has element_dtype "
                    f"{dtype_name(node.node_def.attr['element_dtype'].type)} but its "
                    f"experimental_type names another element type", _involved(body, [name]))
            for name, node in body.nodes.items()
            if (touched is None or name in touched) and "element_dtype" in node.node_def.attr
            and full_type_mismatch(node.node_def)]


def _call_problems(body: Body, signatures, bodies: dict[str, Body],
                   touched: set[str] | None = None) -> list[Problem]:
    """A call's declared types must equal its functions' signatures."""
    problems = []
    for name, node in body.nodes.items():
        if touched is not None and name not in touched:
            continue
        for func_attr, pairs in _CALL_TYPES.get(node.op, {}).items():
            value = node.node_def.attr.get(func_attr)
            if value is None:
                continue
            called = [value.func.name] if value.HasField("func") else [
                f.name for f in value.list.func]
            for function in called:
                signature = signatures.get(function)
                if signature is None:
                    continue
                for type_attr, side in pairs:
                    declared = list(node.node_def.attr[type_attr].list.type)
                    args = signature.input_arg if side == "in" else signature.output_arg
                    expected = [arg.type for arg in args]
                    if declared != expected:
                        problems.append(Problem(
                            f"{_where(body)}: {node.op} {name!r} declares {type_attr} "
                            f"{_types(declared)} but {function!r} "
                            f"{'takes' if side == 'in' else 'returns'} {_types(expected)}",
                            _involved(body, [name])
                            + _signature_nodes(bodies.get(function), side)))
    return problems


def _signature_nodes(callee: Body | None, side: str) -> tuple[tuple[str, str], ...]:
    """The nodes of `callee` that read its arguments ("in") or make its results."""
    if callee is None:
        return ()
    if side == "out":
        names = [ref.node for ref, _, _ in callee.rets.values() if not ref.is_arg]
    else:
        names = [consumer for ref, uses in callee.consumers.items() if ref.is_arg
                 for consumer, _ in uses]
    return _involved(callee, names)


def _cycle_problems(body: Body) -> list[Problem]:
    """A cycle is only allowed through a NextIteration -> Merge edge (TF1 loops).

    TensorFlow's importer orders nodes ignoring exactly those edges; a Cast
    between a NextIteration and its Merge leaves a cycle it rejects. A body
    without NextIteration nodes is not searched: its only cycles would be in
    the graph as it was given (tfamp only puts Casts on existing edges), and
    the importer check reports those.
    """
    if not any(node.op in _NEXT_ITERATION_OPS for node in body.nodes.values()):
        return []
    pending: dict[str, int] = {}
    users: dict[str, list[str]] = {}
    for name, node in body.nodes.items():
        count = 0
        for text in node.node_def.input:
            source = text.lstrip("^").split(":")[0]
            producer = body.nodes.get(source)
            if producer is None:
                continue  # a function argument, or a dangling input
            if node.op in _MERGE_OPS and producer.op in _NEXT_ITERATION_OPS:
                continue
            count += 1
            users.setdefault(source, []).append(name)
        pending[name] = count
    ready = [name for name, count in pending.items() if count == 0]
    placed = 0
    while ready:
        name = ready.pop()
        placed += 1
        for user in users.get(name, ()):
            pending[user] -= 1
            if pending[user] == 0:
                ready.append(user)
    if placed == len(body.nodes):
        return []
    stuck = _on_cycles({name for name, count in pending.items() if count > 0}, users)
    casts = [name for name in stuck
             if body.nodes[name].op == "Cast" and is_tfamp_cast(name)]
    # The Cast that breaks a loop is the one on its back edge, reading the
    # NextIteration; other Casts on the cycle are ordinary loop-body Casts.
    back_edge = [name for name in casts
                 if body.nodes.get(_origin(body, name) or "") is not None
                 and body.nodes[_origin(body, name)].op in _NEXT_ITERATION_OPS]
    casts = back_edge or casts
    blamed = casts or stuck
    involved = []
    for cast in casts:  # the Cast's source and the nodes reading the Cast
        involved.append(cast)
        involved.extend(user for user in users.get(cast, ()) if user in stuck)
    shown = ", ".join(repr(n) for n in blamed[:5])
    more = f" and {len(blamed) - 5} more" if len(blamed) > 5 else ""
    return [Problem(
        f"{_where(body)}: nodes in a cycle that is not a TF1 loop's "
        f"NextIteration -> Merge back edge: {shown}{more}",
        _involved(body, involved))]


def _on_cycles(stuck: set[str], users: dict[str, list[str]]) -> list[str]:
    """The nodes of `stuck` (left over by a topological sort) that lie on cycles.

    Nodes merely downstream of a cycle are peeled off from the far end: a node
    none of whose users is still left cannot be on a cycle.
    """
    left_users = {n: sum(u in stuck for u in users.get(n, ())) for n in stuck}
    producers: dict[str, list[str]] = {}
    for name in stuck:
        for user in users.get(name, ()):
            if user in stuck:
                producers.setdefault(user, []).append(name)
    ready = [n for n, count in left_users.items() if count == 0]
    removed = set()
    while ready:
        name = ready.pop()
        removed.add(name)
        for producer in producers.get(name, ()):
            left_users[producer] -= 1
            if left_users[producer] == 0:
                ready.append(producer)
    return sorted(stuck - removed)


_MERGE_OPS = frozenset({"Merge", "RefMerge"})
_NEXT_ITERATION_OPS = frozenset({"NextIteration", "RefNextIteration"})


def _types(dtypes) -> str:
    return "[" + ", ".join(dtype_name(t) for t in dtypes) + "]"


def _round_trip_problems(body: Body, touched: set[str] | None = None) -> list[Problem]:
    """Casts x -> y -> x where tfamp inserted at least one of the two.

    A user's own chain (a truncation through int32, a deliberate rounding
    through float16) is their program, not a defect of the rewrite.
    """
    problems = []
    for name, node in body.nodes.items():
        if node.op != "Cast" or not node.data_inputs:
            continue
        ref, _ = node.data_inputs[0]
        # (the Cast, its source Cast or the source's producer is edited)
        if touched is not None and name not in touched and ref.node not in touched:
            continue
        source = None if ref.is_arg else body.nodes.get(ref.node)
        if source is None or source.op != "Cast" or not source.data_inputs:
            continue
        if not (is_tfamp_cast(name) or is_tfamp_cast(source.name)):
            continue
        first = body.producer_port(source.data_inputs[0][0])
        out = node.outputs[0].dtype
        if first is not None and first.dtype == out and out in FLOAT_TYPES:
            problems.append(Problem(
                f"{_where(body)}: Cast round trip {dtype_name(out)} -> "
                f"{dtype_name(source.outputs[0].dtype)} -> {dtype_name(out)} "
                f"through {source.name!r} and {name!r}",
                _involved(body, [source.name, name])))
    return problems


def _import_problems(graph_def: graph_pb2.GraphDef) -> list[str]:
    problems = []
    with tf.Graph().as_default():
        try:
            tf.graph_util.import_graph_def(graph_def, name="")
        except (ValueError, tf.errors.OpError) as err:
            return [f"TensorFlow cannot import the graph: {err}"]
        for fdef in graph_def.library.function:
            try:
                function_def_to_graph.function_def_to_graph(fdef)
            except (ValueError, TypeError, tf.errors.OpError) as err:
                problems.append(
                    f"TensorFlow cannot import function {fdef.signature.name!r}: {err}")
    return problems
