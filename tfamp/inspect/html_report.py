"""A self-contained HTML page of what a rewrite did: ``render_html(report, graph_def)``.

The page draws every body (the top graph first, then each library function) as
a layered graph, each op coloured by its decision: converted to 16-bit, or the
kind of reason it stayed float32 (``NodeReport.kind``). Inserted Casts are
small nodes on the edges they bridge. Nodes are grouped into collapsible boxes
by name scope; a search box finds nodes by name and a click shows the report's
reason for a node.

Python prepares the data (categories, name-scope groups, edges with the Casts
spliced in) and embeds it as JSON; the page's JavaScript (``page/graph.js``,
with ``graph.css`` and the skeleton ``graph.html``, inlined by
``tfamp.inspect.page``) lays it out and draws it as SVG. The page needs no
network access and no files besides itself, and is plain ASCII.
"""

from __future__ import annotations

import json
import re
from typing import Any

from tfamp.inspect import page
from tfamp.inspect.names import short_function_names
from tfamp.inspect.overview import overview
from tfamp.rewrite.reasons import KIND_NO_FLOAT, KIND_OTHER, KIND_UNKNOWN_OP, KIND_UNLISTED
from tfamp.rewrite.report import RewriteReport

# (key, legend label, fill colour, text colour). The "f16" label gets the dtype.
CATEGORIES: tuple[tuple[str, str, str, str], ...] = (
    ("f16", "converted to 16-bit", "#2e9d57", "#ffffff"),
    ("deny", "float32: deny list", "#d9453d", "#ffffff"),
    ("downstream", "float32: downstream of a deny op", "#f3a35c", "#1d1d1d"),
    ("neighbour", "float32: no 16-bit neighbour", "#a9cdea", "#1d1d1d"),
    ("bytes", "float32: fewer bytes moved that way", "#9bc49b", "#1d1d1d"),
    ("unlisted", "float32: unlisted op", "#d8cce8", "#1d1d1d"),
    ("kernel", "float32: no 16-bit kernel", "#8660b8", "#ffffff"),
    ("override", "float32: user override (keep_fp32)", "#e07bc0", "#1d1d1d"),
    ("output", "float32: graph output", "#35b7c4", "#1d1d1d"),
    ("variable", "float32: variable op", "#d8bb8a", "#1d1d1d"),
    ("call", "float32: function call", "#4f74a6", "#ffffff"),
    ("tensorlist", "float32: TensorList element type", "#b5b43a", "#1d1d1d"),
    ("statistic", "float32: a statistic of a float32 reduction (or centred on one)",
     "#c9a27e", "#1d1d1d"),
    ("lossscale", "float32: loss-scale machinery", "#5c5c5c", "#ffffff"),
    ("device", "float32: placed off the target device", "#8f8f52", "#ffffff"),
    ("other", "float32: other reason", "#f0d565", "#1d1d1d"),
    ("nofloat", "no float math (not a float op)", "#e4e4e4", "#3a3a3a"),
    ("unknown", "not in the report", "#ffffff", "#3a3a3a"),
    ("cast16", "inserted Cast to 16-bit", "#17622f", "#ffffff"),
    ("cast32", "inserted Cast to float32", "#7a2b85", "#ffffff"),
    ("io", "function argument / result", "#ffffff", "#3a3a3a"),
)
_CATEGORY_INDEX = {key: index for index, (key, _, _, _) in enumerate(CATEGORIES)}

_KIND_CATEGORY = {
    "deny list": "deny",
    "downstream of a deny op": "downstream",
    "no 16-bit kernel": "kernel",
    "user override": "override",
    "graph output": "output",
    "variable op": "variable",
    "function call": "call",
    "TensorList element type": "tensorlist",
    "no 16-bit neighbour": "neighbour",
    "fewer bytes in float32": "bytes",
    "float32 statistic": "statistic",
    "centred on a float32 statistic": "statistic",
    "loss-scale machinery": "lossscale",
    "placed off the target device": "device",
}

# A name scope with fewer items than this is drawn as its items, not as a box.
_MIN_GROUP = 3

# A scope (or body) with more direct items than this is split into parts of
# consecutive nodes (at most _MAX_PARTS), so no box is too big to draw quickly.
_MAX_DIRECT = 150
_MAX_PARTS = 40
_MIN_PART = 60

# The functions a call op's reason names (the graph's attributes say it better).
_CALLS = re.compile(r"calls ('.*'): its signature")

# Item kinds in the page data.
_OP, _CAST, _ARG, _RET = 0, 1, 2, 3


def node_category(node) -> str:
    """The colour category (a key of CATEGORIES) of one NodeReport."""
    if node.converted:
        return "f16"
    kind = node.kind
    if kind == KIND_NO_FLOAT:
        return "nofloat"
    if kind in (KIND_OTHER, KIND_UNLISTED, KIND_UNKNOWN_OP) and node.list == "unlisted":
        return "unlisted"
    return _KIND_CATEGORY.get(kind, "other")


def render_html(report: RewriteReport, graph_def=None, *, full_names: bool = False,
                flops=None) -> str:
    """A complete, self-contained HTML page showing what `report`'s rewrite did.

    Args:
      report: the RewriteReport (or its ``to_dict()`` form, e.g. loaded JSON).
      graph_def: the ORIGINAL GraphDef the report was made from, for the data
        edges. None (e.g. a report loaded from JSON) draws only the edges the
        inserted Casts imply; nodes are still coloured, grouped and searchable.
      full_names: label functions with their full graph names instead of the
        short ones (``__inference__wrapped_model_1428`` -> ``_wrapped_model``;
        see tfamp/inspect/names.py).
      flops: ``tfamp.inspect.flops.graph_def_flops(graph_def)`` if the caller
        has it (computed from `graph_def` otherwise), for the FLOP share.

    Returns:
      The page as a string (ASCII only): inline CSS, JavaScript and data, no
      external resources, so it works offline from a file:// URL.
    """
    if isinstance(report, dict):
        report = RewriteReport.from_dict(report)
    data = _page_data(report, graph_def, full_names=full_names)
    data["overview"] = overview(report, graph_def, flops)
    title = f"tfamp: {report.function or 'graph'} -> {report.dtype}"
    return page.assemble("graph", title=title, data_json=script_json(data))


def script_json(data: Any) -> str:
    """JSON safe inside <script>: no '<', '>' or '&' (so no '</script>', '<!--')."""
    text = json.dumps(data, ensure_ascii=True, separators=(",", ":"))
    return (text.replace("<", "\\u003c").replace(">", "\\u003e")
            .replace("&", "\\u0026"))


class _Strings:
    """Interns repeated strings (ops, reasons) into one table."""

    def __init__(self):
        self.table: list[str] = []
        self.index: dict[str, int] = {}

    def __call__(self, text: str) -> int:
        if text not in self.index:
            self.index[text] = len(self.table)
            self.table.append(text)
        return self.index[text]


class _BodyData:
    """Items (ops, casts, arguments, results), edges and scope groups of one body."""

    def __init__(self, name: str, strings: _Strings):
        self.name = name
        self.strings = strings
        self.items: list[list] = []
        self.keys: dict[tuple[int, str], int] = {}
        self.edges: dict[tuple[int, int], None] = {}  # ordered set

    def add(self, kind: int, name: str, category: str, op: str = "", list_: str = "",
            reason: str = "", cause: str = "", extra: Any = 0) -> int:
        key = (kind, name)
        if key in self.keys:
            return self.keys[key]
        s = self.strings
        self.keys[key] = len(self.items)
        self.items.append([name, kind, _CATEGORY_INDEX[category], s(op), s(list_),
                           s(reason), s(cause), extra])
        return self.keys[key]

    def op_item(self, name: str) -> int:
        """The item of op `name`, added as "not in the report" if it is unknown."""
        if (_OP, name) in self.keys:
            return self.keys[(_OP, name)]
        return self.add(_OP, name, "unknown", reason="not in the report")

    def _scope_name(self, item: list) -> str | None:
        """The name that places `item` in a name scope; None: the body itself.

        A Cast sits in its source's scope (not under the source's own name, where
        it would land in a different box than the node it reads).
        """
        name, kind = item[0], item[1]
        if kind == _OP:
            return name
        if kind != _CAST:
            return None
        source = item[7][0].split(":")[0]
        if (_OP, source) not in self.keys:
            return name.rsplit("/", 1)[-1]
        scope = source.rsplit("/", 1)[0] if "/" in source else ""
        return f"{scope}/{name.rsplit('/', 1)[-1]}" if scope else name.rsplit("/", 1)[-1]

    def to_json(self) -> dict:
        order = [self.keys.get((_OP, item[7][0].split(":")[0]), index) + 0.5
                 if item[1] == _CAST else index for index, item in enumerate(self.items)]
        groups, member = _scope_groups([self._scope_name(item) for item in self.items], order)
        flat_edges = [index for edge in self.edges for index in edge]
        return {"name": self.name, "items": self.items, "groups": groups,
                "member": member, "edges": flat_edges}


def _page_data(report: RewriteReport, graph_def, *, full_names: bool = False) -> dict:
    strings = _Strings()
    bodies: dict[str, _BodyData] = {"": _BodyData("", strings)}
    view = None
    if graph_def is not None:
        from tfamp.rewrite.graph import build_view

        view = build_view(graph_def)
        for body in view.bodies:
            bodies.setdefault(body.name, _BodyData(body.name, strings))
    for entry in report.nodes:
        bodies.setdefault(entry.function, _BodyData(entry.function, strings))
    for cast in report.casts:
        bodies.setdefault(cast.function, _BodyData(cast.function, strings))
    labels = short_function_names(bodies) if not full_names else {}

    for entry in report.nodes:
        called = _CALLS.search(entry.reason)
        bodies[entry.function].add(
            _OP, entry.name, node_category(entry), entry.op, entry.list, entry.reason,
            entry.cause, re.findall(r"'([^']+)'", called.group(1)) if called else 0)
    casts_by_body: dict[str, list] = {}
    for cast in report.casts:
        casts_by_body.setdefault(cast.function, []).append(cast)
        category = "cast32" if cast.dst_dtype == "float32" else "cast16"
        bodies[cast.function].add(
            _CAST, cast.name, category, "Cast",
            reason=f"inserted by tfamp: {cast.src_dtype} -> {cast.dst_dtype}",
            extra=[cast.source, cast.src_dtype, cast.dst_dtype, list(cast.consumers)])

    if view is not None:
        for body in view.bodies:
            _add_graph_edges(bodies[body.name], body, casts_by_body.get(body.name, []))
    for name, casts in casts_by_body.items():
        _splice_casts(bodies[name], casts, function=bool(name))

    kept = sum(report.kept_fp32.values())
    converted = sum(report.converted.values())
    return {
        "title": f"tfamp: {report.function or 'graph'} -> {report.dtype}",
        "summary": report.summary_line(),
        "verdict": report.verdict.line,
        "function": report.function,
        "dtype": report.dtype,
        "nodesBefore": report.nodes_before,
        "nodesAfter": report.nodes_after,
        "castCount": len(report.casts),
        "convertedCount": converted,
        "keptCount": kept,
        "converted": report.converted,
        "keptFp32": report.kept_fp32,
        "hasGraph": graph_def is not None,
        "categories": [
            [key, f"converted to {report.dtype}" if key == "f16" else label, fill, ink]
            for key, label, fill, ink in CATEGORIES],
        "strings": strings.table,
        "bodies": [{**body.to_json(), "shown": labels.get(name, name)}
                   for name, body in bodies.items()],
    }


def _add_graph_edges(data: _BodyData, body, casts) -> None:
    """Items for arguments and results and one edge per data input of `body`."""
    from tfamp.rewrite.graph import dtype_name

    for arg, dtype in body.arg_dtypes.items():
        data.add(_ARG, arg, "io", "argument", reason=f"function argument ({dtype_name(dtype)})")

    def node_item(name: str) -> int:
        if (_OP, name) not in data.keys and (_CAST, name) in data.keys:
            return data.keys[(_CAST, name)]  # a rewritten graph holds the Casts
        return data.op_item(name)

    def item_of(ref) -> int:
        if ref.is_arg:
            return data.add(_ARG, ref.node, "io", "argument", reason="function argument")
        return node_item(ref.node)

    for name, node in body.nodes.items():
        target = node_item(name)
        if node.called_functions and data.items[target][1] == _OP:
            data.items[target][7] = list(dict.fromkeys(node.called_functions))
        for ref, _ in node.data_inputs:
            source = item_of(ref)
            if source != target:
                data.edges[(source, target)] = None
    for ret, (ref, _, dtype) in body.rets.items():
        target = data.add(_RET, ret, "io", "result",
                          reason=f"function result ({dtype_name(dtype)})")
        data.edges[(item_of(ref), target)] = None


def _splice_casts(data: _BodyData, casts, function: bool) -> None:
    """Puts each Cast between its source and its consumers.

    With a graph the direct edge source -> consumer is replaced by source -> Cast
    -> consumer; without one these are the only edges drawn.
    """
    wired = {item for edge in data.edges for item in edge}
    for cast in casts:
        cast_item = data.keys[(_CAST, cast.name)]
        if cast_item in wired:
            continue  # the graph already holds this Cast (a rewritten graph)
        source_name = cast.source.split(":")[0]
        if (_OP, source_name) in data.keys or (_CAST, source_name) in data.keys:
            source = data.keys.get((_OP, source_name), data.keys.get((_CAST, source_name)))
        elif function and ":" not in cast.source:
            source = data.add(_ARG, source_name, "io", "argument", reason="function argument")
        else:
            source = data.op_item(source_name)
        for consumer in cast.consumers:
            if consumer.startswith("<ret ") and consumer.endswith(">"):
                target = data.add(_RET, consumer[5:-1], "io", "result", reason="function result")
            else:
                target = data.op_item(consumer)
            data.edges.pop((source, target), None)
            data.edges[(cast_item, target)] = None
        data.edges[(source, cast_item)] = None


def _scope_groups(names: list[str | None],
                  order: list[float] | None = None) -> tuple[list[list], list[int]]:
    """Collapsible name-scope groups for items named `names` (None: no scope).

    A group holds the items whose names share a path prefix ("dense_1/..."). A
    scope with fewer than _MIN_GROUP items is no group; a scope that only holds
    one sub-scope merges with it ("gradient_tape/sequential"). A scope with more
    than _MAX_DIRECT items directly in it gets "part" groups of items that are
    consecutive in `order` (graph order: nodes made together).

    Returns:
      (groups as [label, parent group index or -1, full scope path, is_part],
      parents before children, and each item's group index, -1 for the body).
    """
    root: dict = {"children": {}, "items": []}
    for index, name in enumerate(names):
        node = root
        if name is not None:
            for part in name.split("/")[:-1]:
                node = node["children"].setdefault(part, {"children": {}, "items": []})
        node["items"].append(index)

    def count(node) -> int:
        node["count"] = len(node["items"]) + sum(count(c) for c in node["children"].values())
        return node["count"]

    count(root)
    groups: list[list] = []
    member = [-1] * len(names)

    def place(node, group: int, path: str) -> None:
        for index in node["items"]:
            member[index] = group
        for part, child in node["children"].items():
            label, child_path = part, f"{path}/{part}" if path else part
            while not child["items"] and len(child["children"]) == 1:
                (sub, only), = child["children"].items()
                if only["count"] < _MIN_GROUP:
                    break
                label, child_path, child = f"{label}/{sub}", f"{child_path}/{sub}", only
            if child["count"] < _MIN_GROUP:
                place(child, group, child_path)
                continue
            groups.append([label, group, child_path, 0])
            place(child, len(groups) - 1, child_path)

    place(root, -1, "")

    direct: dict[int, list[int]] = {}
    for index, group in enumerate(member):
        if names[index] is not None:
            direct.setdefault(group, []).append(index)
    for group, items in direct.items():
        if len(items) <= _MAX_DIRECT:
            continue
        if order is not None:
            items.sort(key=lambda index: order[index])
        size = max(_MIN_PART, -(-len(items) // _MAX_PARTS))
        chunks = [items[start:start + size] for start in range(0, len(items), size)]
        path = groups[group][2] if group >= 0 else ""
        for number, chunk in enumerate(chunks, 1):
            first, last = (_short(names[chunk[0]]), _short(names[chunk[-1]]))
            groups.append([f"part {number}/{len(chunks)}: {first} .. {last}", group, path, 1])
            for index in chunk:
                member[index] = len(groups) - 1
    return groups, member


def _short(name: str) -> str:
    last = name.rsplit("/", 1)[-1]
    return last if len(last) <= 16 else last[:15] + "~"
