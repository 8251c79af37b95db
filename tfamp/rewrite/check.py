"""Is a (rewritten) graph sound? Edge dtypes, Cast round trips, and TF's importer.

``check_graph_def(graph_def) -> list[str]`` lists every problem found;
``assert_valid_graph_def`` raises ``GraphCheckError`` naming them. Tests run it on
every rewrite; ``tfamp.function`` runs it when debug checks are on.
"""

from __future__ import annotations

import tensorflow as tf
from tensorflow.core.framework import graph_pb2
from tensorflow.python.framework import function_def_to_graph

from tfamp.rewrite.graph import FLOAT_TYPES, Body, build_view, dtype_name


class GraphCheckError(ValueError):
    """A rewritten graph failed ``check_graph_def``."""


def check_graph_def(graph_def: graph_pb2.GraphDef, *, import_check: bool = True) -> list[str]:
    """Returns a list of problems in `graph_def` (empty when it is sound).

    Args:
      graph_def: the graph and its function library.
      import_check: also import the graph and every library function with
        TensorFlow's own importer (slower; catches what TF itself rejects).
    """
    view = build_view(graph_def)
    problems: list[str] = []
    for body in view.bodies:
        problems.extend(_edge_problems(body))
        problems.extend(_round_trip_problems(body))
        problems.extend(_call_problems(body, view.signatures))
    if import_check and not problems:
        problems.extend(_import_problems(graph_def))
    return problems


def assert_valid_graph_def(graph_def: graph_pb2.GraphDef) -> None:
    """Raises GraphCheckError listing every problem `check_graph_def` finds."""
    problems = check_graph_def(graph_def)
    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise GraphCheckError(f"{len(problems)} problem(s) in the graph:\n  {shown}{more}")


def _where(body: Body) -> str:
    return f"function {body.name!r}" if body.is_function else "top graph"


def _edge_problems(body: Body) -> list[str]:
    problems = []
    for name, node in body.nodes.items():
        for index, (ref, text) in enumerate(node.data_inputs):
            port = body.producer_port(ref)
            if port is None or index >= len(node.inputs):
                continue
            wanted = node.inputs[index].dtype
            if port.dtype != wanted:
                problems.append(
                    f"{_where(body)}: {node.op} {name!r} input {index} expects "
                    f"{dtype_name(wanted)} but {text!r} is {dtype_name(port.dtype)}")
    for ret_name, (ref, text, dtype) in body.rets.items():
        port = body.producer_port(ref)
        if port is not None and port.dtype != dtype:
            problems.append(
                f"{_where(body)}: result {ret_name!r} is declared "
                f"{dtype_name(dtype)} but {text!r} is {dtype_name(port.dtype)}")
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


def _call_problems(body: Body, signatures) -> list[str]:
    """A call's declared types must equal its functions' signatures."""
    problems = []
    for name, node in body.nodes.items():
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
                        problems.append(
                            f"{_where(body)}: {node.op} {name!r} declares {type_attr} "
                            f"{_types(declared)} but {function!r} "
                            f"{'takes' if side == 'in' else 'returns'} {_types(expected)}")
    return problems


def _types(dtypes) -> str:
    return "[" + ", ".join(dtype_name(t) for t in dtypes) + "]"


def _round_trip_problems(body: Body) -> list[str]:
    problems = []
    for name, node in body.nodes.items():
        if node.op != "Cast" or not node.data_inputs:
            continue
        ref, _ = node.data_inputs[0]
        source = None if ref.is_arg else body.nodes.get(ref.node)
        if source is None or source.op != "Cast" or not source.data_inputs:
            continue
        first = body.producer_port(source.data_inputs[0][0])
        out = node.outputs[0].dtype
        if first is not None and first.dtype == out and out in FLOAT_TYPES:
            problems.append(
                f"{_where(body)}: Cast round trip {dtype_name(out)} -> "
                f"{dtype_name(source.outputs[0].dtype)} -> {dtype_name(out)} "
                f"through {source.name!r} and {name!r}")
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
