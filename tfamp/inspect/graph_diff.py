"""What differs between two GraphDefs: op counts, node dtypes, Casts (``tfamp diff``)."""

from __future__ import annotations

import collections
import dataclasses

from tensorflow.core.framework import graph_pb2

from tfamp.rewrite.graph import build_view, dtype_name


@dataclasses.dataclass
class GraphDiff:
    """The differences; node keys are "node" or "function/node"."""

    op_counts: dict[str, tuple[int, int]]  # op type -> (before, after), changed only
    dtype_changes: list[tuple[str, str, str, str]]  # (node, op, attr, "before -> after")
    casts_added: list[str]
    casts_removed: list[str]

    def to_dict(self) -> dict:
        return {
            "op_counts": {op: {"before": b, "after": a} for op, (b, a) in self.op_counts.items()},
            "dtype_changes": [{"node": n, "op": op, "attr": attr, "change": change}
                              for n, op, attr, change in self.dtype_changes],
            "casts_added": self.casts_added,
            "casts_removed": self.casts_removed,
        }

    def render_text(self) -> str:
        lines = ["op counts (before -> after):"]
        if not self.op_counts:
            lines.append("  no change")
        for op, (before, after) in self.op_counts.items():
            lines.append(f"  {op} {after - before:+d} ({before} -> {after})")
        lines.append(f"nodes whose dtype changed: {len(self.dtype_changes)}")
        lines.extend(f"  {node} ({op}): {attr} {change}"
                     for node, op, attr, change in self.dtype_changes)
        lines.append(f"casts added: {len(self.casts_added)}")
        lines.extend(f"  {name}" for name in self.casts_added)
        lines.append(f"casts removed: {len(self.casts_removed)}")
        lines.extend(f"  {name}" for name in self.casts_removed)
        return "\n".join(lines)


def diff_graph_defs(before: graph_pb2.GraphDef, after: graph_pb2.GraphDef) -> GraphDiff:
    """Compares two graphs (and their function libraries) node by node."""
    old, new = _index(before), _index(after)
    counts_old = collections.Counter(node.op for node in old.values())
    counts_new = collections.Counter(node.op for node in new.values())
    op_counts = {op: (counts_old[op], counts_new[op])
                 for op in sorted(set(counts_old) | set(counts_new))
                 if counts_old[op] != counts_new[op]}
    changes = []
    for key in sorted(set(old) & set(new)):
        old_types, new_types = _type_attrs(old[key]), _type_attrs(new[key])
        for attr in sorted(set(old_types) & set(new_types)):
            if old_types[attr] != new_types[attr]:
                changes.append((key, new[key].op, attr,
                                f"{old_types[attr]} -> {new_types[attr]}"))
    casts_added = sorted(k for k in set(new) - set(old) if new[k].op == "Cast")
    casts_removed = sorted(k for k in set(old) - set(new) if old[k].op == "Cast")
    return GraphDiff(op_counts, changes, casts_added, casts_removed)


def _index(graph_def: graph_pb2.GraphDef) -> dict:
    nodes = {}
    for body in build_view(graph_def).bodies:
        for name, node in body.nodes.items():
            nodes[f"{body.name}/{name}" if body.is_function else name] = node
    return nodes


def _type_attrs(node) -> dict[str, str]:
    return {port.type_attr: dtype_name(port.dtype)
            for port in node.inputs + node.outputs if port.type_attr}
