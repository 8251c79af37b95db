"""Why did one node end up in 16-bit or float32? The chain behind ``tfamp inspect --why``."""

from __future__ import annotations

import collections
import difflib

from tfamp.inspect.names import short_function_names, shorten_quoted
from tfamp.rewrite.graph import GraphView
from tfamp.rewrite.report import NodeReport, RewriteReport


class UnknownNodeError(KeyError):
    """The report has no node of that name."""

    def __str__(self) -> str:
        return str(self.args[0])


def find_node(report: RewriteReport, name: str) -> NodeReport:
    """The node called `name` ("function/node" also accepted for library functions).

    The function may be given by its full or its short name (see names.py).
    """
    short = short_function_names(n.function for n in report.nodes if n.function)
    matches = [n for n in report.nodes
               if n.name == name or (n.function and name in (
                   f"{n.function}/{n.name}", f"{short[n.function]}/{n.name}"))]
    if len(matches) == 1:
        return matches[0]
    if len(matches) > 1:
        where = ", ".join(f"{n.function or 'top graph'}" for n in matches[:5])
        raise UnknownNodeError(
            f"node name {name!r} is in several places ({where}); qualify it as "
            f"FUNCTION/NODE")
    of_type = [n for n in report.nodes if n.op == name]
    if of_type:  # an op type, not a node name: name a few of its nodes
        shown = [f"{short[n.function]}/{n.name}" if n.function else n.name
                 for n in of_type[:3]]
        more = f" (and {len(of_type) - 3} more)" if len(of_type) > 3 else ""
        raise UnknownNodeError(
            f"{name!r} is an op type, not a node name; expected a node name such as "
            f"{', '.join(repr(n) for n in shown)}{more}; list them all with --nodes --op "
            f"{name}")
    hints = difflib.get_close_matches(name, [n.name for n in report.nodes], n=3)
    hint = f"; did you mean {', '.join(repr(h) for h in hints)}?" if hints else (
        "; list names with --nodes")
    raise UnknownNodeError(f"no node named {name!r} in this graph{hint}")


def explain(report: RewriteReport, name: str, view: GraphView | None = None, *,
            full_names: bool = False) -> list[str]:
    """Lines explaining the precision of node `name`, cause first.

    With the original graph's `view`, the path from the deciding node (a deny
    op, a 16-bit neighbour) to this node is spelled out op by op. Function
    names are shortened (names.py) unless `full_names`.
    """
    node = find_node(report, name)
    shown = ({} if full_names else
             short_function_names(n.function for n in report.nodes if n.function))

    def _label(entry: NodeReport) -> str:
        if not entry.function:
            return f"'{entry.name}'"
        return f"'{shown.get(entry.function, entry.function)}/{entry.name}'"

    state = report.dtype if node.converted else "float32"
    lines = [f"{node.op} {_label(node)}: list {node.list}; runs in {state}",
             f"  because: {shorten_quoted(node.reason, shown)}"]
    seen = {(node.function, node.name)}
    current = node
    while current.cause:
        cause = _lookup(report, current.function, current.cause)
        if cause is None or (cause.function, cause.name) in seen:
            break
        seen.add((cause.function, cause.name))
        path = _path(view, current.function, cause.name, current.name) if view else None
        if path and len(path) > 2:
            steps = " -> ".join(_step(report, current.function, n) for n in path)
            lines.append(f"  path: {steps}")
        cause_state = report.dtype if cause.converted else "float32"
        lines.append(f"  {cause.op} {_label(cause)} ({cause.list}, {cause_state}): "
                     f"{shorten_quoted(cause.reason, shown)}")
        current = cause
    return lines


def _lookup(report: RewriteReport, function: str, name: str) -> NodeReport | None:
    for entry in report.nodes:
        if entry.function == function and entry.name == name:
            return entry
    return None


def _step(report: RewriteReport, function: str, name: str) -> str:
    entry = _lookup(report, function, name)
    return f"{entry.op} '{name}' ({entry.list})" if entry else repr(name)


def _path(view: GraphView, function: str, source: str, target: str) -> list[str] | None:
    """Shortest data path source -> target in one body (breadth-first)."""
    body = next((b for b in view.bodies if b.name == function), None)
    if body is None or source not in body.nodes:
        return None
    previous = {source: None}
    queue = collections.deque([source])
    while queue:
        name = queue.popleft()
        if name == target:
            path = [name]
            while previous[path[-1]] is not None:
                path.append(previous[path[-1]])
            return path[::-1]
        for ref in body.output_refs(name):
            for consumer, _ in body.consumers.get(ref, ()):
                if consumer not in previous:
                    previous[consumer] = name
                    queue.append(consumer)
    return None
