"""A self-contained HTML page of what a rewrite did: ``render_html(report, graph_def)``.

The page draws every body (the top graph first, then each library function) as
a layered graph, each op coloured by its decision: converted to 16-bit, or the
kind of reason it stayed float32 (``NodeReport.kind``). Inserted Casts are
small nodes on the edges they bridge. Nodes are grouped into collapsible boxes
by name scope; a search box finds nodes by name and a click shows the report's
reason for a node.

Python prepares the data (categories, name-scope groups, edges with the Casts
spliced in) and embeds it as JSON; inline JavaScript lays it out and draws it
as SVG. The page needs no network access and no files besides itself, and is
plain ASCII.
"""

from __future__ import annotations

import html
import json
import re
from typing import Any

from tfamp.inspect.names import short_function_names
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


def render_html(report: RewriteReport, graph_def=None, *, full_names: bool = False) -> str:
    """A complete, self-contained HTML page showing what `report`'s rewrite did.

    Args:
      report: the RewriteReport (or its ``to_dict()`` form, e.g. loaded JSON).
      graph_def: the ORIGINAL GraphDef the report was made from, for the data
        edges. None (e.g. a report loaded from JSON) draws only the edges the
        inserted Casts imply; nodes are still coloured, grouped and searchable.
      full_names: label functions with their full graph names instead of the
        short ones (``__inference__wrapped_model_1428`` -> ``_wrapped_model``;
        see tfamp/inspect/names.py).

    Returns:
      The page as a string (ASCII only): inline CSS, JavaScript and data, no
      external resources, so it works offline from a file:// URL.
    """
    if isinstance(report, dict):
        report = RewriteReport.from_dict(report)
    data = _page_data(report, graph_def, full_names=full_names)
    title = f"tfamp: {report.function or 'graph'} -> {report.dtype}"
    values = {
        "TITLE": html.escape(title),
        "DATA": script_json(data),
    }
    return re.sub(r"%%(TITLE|DATA)%%", lambda m: values[m.group(1)], _TEMPLATE)


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


_TEMPLATE = r"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>%%TITLE%%</title>
<style>
* { box-sizing: border-box; }
html, body { margin: 0; height: 100%; }
body {
  display: flex; flex-direction: column; color: #1f2430; background: #eef0f4;
  font: 13px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial,
    sans-serif;
}
header {
  display: flex; align-items: center; gap: 18px; padding: 8px 16px;
  background: #22293d; color: #e9ecf5; flex: none;
}
header h1 { font-size: 16px; margin: 0; font-weight: 600; white-space: nowrap; }
header h1 span { color: #9fb0d8; font-weight: 400; }
#summary { flex: 1; font-size: 12px; color: #c5cce0; min-width: 0; }
#summary b { color: #fff; }
#searchwrap { position: relative; }
#search {
  width: 300px; padding: 6px 10px; border-radius: 6px; border: 1px solid #55607d;
  background: #f7f8fc; font: inherit; color: #1f2430;
}
#scount { font-size: 12px; color: #c5cce0; margin-left: 8px; display: inline-block; width: 90px; }
#results {
  position: absolute; top: 34px; left: 0; width: 460px; max-height: 60vh; overflow: auto;
  background: #fff; color: #1f2430; border: 1px solid #c9cede; border-radius: 6px;
  box-shadow: 0 6px 24px rgba(0,0,0,.25); z-index: 20; display: none;
}
#results div.res { padding: 4px 10px; cursor: pointer; border-bottom: 1px solid #f0f1f5; }
#results div.res:hover, #results div.res.cur { background: #e8eefc; }
#results .rn { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 12px;
  word-break: break-all; }
#results .rf { display: block; font-size: 11px; color: #6b7386; }
#results .more { padding: 4px 10px; color: #6b7386; font-size: 12px; }
#error {
  background: #b3261e; color: #fff; padding: 8px 16px; font-weight: 600; white-space: pre-wrap;
  flex: none;
}
#wrap { flex: 1; display: flex; min-height: 0; }
#main { flex: 1; overflow: auto; padding: 12px 14px; min-width: 0; }
#side {
  width: 350px; flex: none; overflow: auto; background: #fff; border-left: 1px solid #d3d7e1;
  padding: 10px 14px;
}
#side h2 { font-size: 12px; text-transform: uppercase; letter-spacing: .06em; color: #6b7386;
  margin: 10px 0 6px; }
#status { font-size: 11px; color: #6b7386; margin: 0 2px 8px; }
.panel { background: #fff; border: 1px solid #d3d7e1; border-radius: 8px; margin-bottom: 14px;
  overflow: hidden; }
.phead {
  display: flex; align-items: center; gap: 10px; padding: 6px 10px; background: #f6f7fa;
  border-bottom: 1px solid #e3e6ed;
}
.panel.folded .phead { border-bottom: 0; }
.ptitle { font-weight: 600; font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 12px;
  word-break: break-all; }
.pmeta { color: #6b7386; font-size: 12px; flex: 1; }
.pmeta a { color: #3657b3; }
.phead button {
  font: inherit; font-size: 12px; padding: 2px 8px; border: 1px solid #c9cede;
  border-radius: 5px; background: #fff; cursor: pointer; color: #1f2430;
}
.phead button:hover { background: #e8eefc; }
.phead button.fold { border: 0; background: none; font-size: 13px; width: 22px; padding: 0; }
.canvas { overflow: auto; max-height: 74vh; min-height: 60px; background: #fbfbfd; cursor: grab; }
.canvas.dragging { cursor: grabbing; }
.panel.folded .canvas { display: none; }
svg.graph { display: block; }
svg.graph text { font-family: system-ui, -apple-system, "Segoe UI", Roboto, Arial, sans-serif;
  pointer-events: none; }
.n, .grp, .gh { cursor: pointer; }
.n rect.b { stroke: rgba(20,25,40,.35); stroke-width: 1; }
.n .op { font-size: 11px; font-weight: 600; }
.n .nm { font-size: 10px; }
.n .bd { font-size: 9px; font-weight: 700; opacity: .8; }
.n.io rect.b { stroke: #8a93a8; stroke-dasharray: 3 2; }
.n.io text { font-size: 10px; fill: #3a3f4d; }
.n.cast text { font-size: 10px; font-weight: 700; fill: #fff; }
.n.unknown rect.b { stroke-dasharray: 4 3; }
.n:hover rect.b { stroke: #111; stroke-width: 2; }
.n.match rect.b, .grp.match rect.gb { stroke: #ff1493; stroke-width: 3.5; }
.n.sel rect.b { stroke: #111; stroke-width: 3; }
.n.flash rect.b { animation: flash 0.6s ease-in-out 3; }
@keyframes flash { 50% { stroke: #ff1493; stroke-width: 8; } }
.grp rect.gb { fill: #f4f6fb; stroke: #7d88a6; stroke-width: 1.4; }
.grp rect.gs { fill: #e2e6f0; stroke: #a3acc2; }
.grp:hover rect.gb { stroke: #22293d; stroke-width: 2; }
.grp .gl { font-size: 11px; font-weight: 700; fill: #22293d; }
.grp .gc { font-size: 10px; fill: #4d5568; }
.gf rect.gfr { fill: rgba(70,90,150,.045); stroke: #aab3ca; stroke-width: 1; }
.gh rect { fill: rgba(70,90,150,.11); }
.gh:hover rect { fill: rgba(70,90,150,.22); }
.gh text { font-size: 11px; font-weight: 600; fill: #2d3550; }
path.e { fill: none; stroke: #9aa1b0; stroke-width: 1.2; marker-end: url(#tfamp-ah); }
path.e.h16 { stroke: #2e9d57; marker-end: url(#tfamp-ah16); }
path.e.hl { stroke: #111; stroke-width: 2.4; marker-end: url(#tfamp-ahx); }
.legend .row { display: flex; align-items: center; gap: 8px; padding: 2px 4px; border-radius: 4px;
  cursor: pointer; font-size: 12px; }
.legend .row:hover { background: #eef2fb; }
.legend .row.on { background: #dfe7fb; font-weight: 600; }
.legend .sw { width: 26px; height: 14px; border-radius: 3px; border: 1px solid rgba(0,0,0,.3);
  flex: none; }
.legend .sw.cast { height: 10px; border-radius: 5px; }
.legend .sw.io { border-style: dashed; }
.legend .lbl { flex: 1; }
.legend .cnt { color: #6b7386; font-variant-numeric: tabular-nums; }
.legend .line { width: 26px; height: 0; border-top: 2px solid #9aa1b0; flex: none; }
.legend .note { font-size: 11px; color: #6b7386; padding: 4px 4px 0; }
#details { font-size: 12px; }
#details .hint { color: #6b7386; }
#details .dname { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 12px;
  font-weight: 600; word-break: break-all; margin-bottom: 6px; }
#details table { border-collapse: collapse; width: 100%; }
#details td { vertical-align: top; padding: 3px 4px; border-top: 1px solid #eef0f4; }
#details td.k { color: #6b7386; width: 78px; white-space: nowrap; }
#details td.v { word-break: break-word; }
#details .mono { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 11px;
  word-break: break-all; }
#details a { color: #3657b3; cursor: pointer; }
#details .chip { display: inline-block; width: 12px; height: 12px; border-radius: 3px;
  vertical-align: -2px; margin-right: 5px; border: 1px solid rgba(0,0,0,.3); }
#details ul { margin: 0; padding-left: 16px; }
.filtering .n { opacity: .13; }
.filtering .grp { opacity: .35; }
.filtering path.e { opacity: .2; }
</style>
</head>
<body>
<svg width="0" height="0" style="position:absolute" aria-hidden="true" id="tfamp-defs">
<defs>
<marker id="tfamp-ah" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7"
  orient="auto"><path d="M0,1 L10,5 L0,9 z" fill="#9aa1b0"/></marker>
<marker id="tfamp-ah16" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7"
  orient="auto"><path d="M0,1 L10,5 L0,9 z" fill="#2e9d57"/></marker>
<marker id="tfamp-ahx" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="5" markerHeight="5"
  orient="auto"><path d="M0,1 L10,5 L0,9 z" fill="#111"/></marker>
</defs>
</svg>
<header>
<h1>tfamp report <span id="htitle"></span></h1>
<div id="summary"></div>
<div id="searchwrap"><input id="search" type="search" autocomplete="off"
  placeholder="Search node name  (press / )"><span id="scount"></span>
<div id="results"></div></div>
</header>
<div id="error" hidden></div>
<div id="wrap">
<main id="main"><div id="status" data-state="loading">Loading&hellip;</div><div id="panels"></div>
</main>
<aside id="side">
<h2>Selected</h2>
<div id="details"><div class="hint">Click a node to see its decision and the reason. Click a
name-scope box to expand it, click an open box's header to collapse it. Drag to pan,
Ctrl+wheel to zoom.</div></div>
<h2>Legend</h2>
<div id="legend" class="legend"></div>
</aside>
</div>
<script type="application/json" id="tfamp-data">%%DATA%%</script>
<script>
(function () {
'use strict';

var NODE_W = 156, NODE_H = 38, CAST_W = 46, CAST_H = 18, IO_W = 150, IO_H = 22;
var GROUP_W = 184, GROUP_H = 52, PAD = 12, HEAD = 24, ROW_GAP = 34, COL_GAP = 16;
var DUMMY_W = 2, BUDGET = 150, MAX_DUMMIES = 12000, OPEN_PANELS = 12, MAX_ROW_W = 2400;

var D, S, CATS, CAT = {}, bodies = [], bodyByName = {}, selected = null;
var matchList = [], matchPos = -1, filterKey = null, filterStyle = null, drag = null;

function $(id) { return document.getElementById(id); }

function fail(message) {
  var box = $('error');
  box.hidden = false;
  box.textContent = 'tfamp report: the page failed to render: ' + message;
  var status = $('status');
  status.textContent = 'Error: ' + message;
  status.setAttribute('data-state', 'error');
}

window.addEventListener('error', function (ev) {
  fail((ev.message || 'script error') + (ev.lineno ? ' (line ' + ev.lineno + ')' : ''));
});

function esc(text) {
  return String(text).replace(/&/g, '&amp;').replace(/</g, '&lt;').replace(/>/g, '&gt;')
    .replace(/"/g, '&quot;');
}

function clip(text, max) {
  return text.length > max ? text.slice(0, max - 1) + '\u2026' : text;
}

function lastPart(name) {
  var i = name.lastIndexOf('/');
  return i < 0 || i === name.length - 1 ? name : name.slice(i + 1);
}

function plural(count, word) { return count + ' ' + word + (count === 1 ? '' : 's'); }

function fmt(v) { return Math.round(v * 10) / 10; }

function el(tag, cls, text) {
  var e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined && text !== null) e.textContent = text;
  return e;
}

function shortType(dtype) {
  return {float16: 'f16', bfloat16: 'bf16', float32: 'f32'}[dtype] || dtype;
}

/* ---------------------------------------------------------------- layout */

/* Layered layout of items with sizes w[i] x h[i] and edges [[a, b]], top to bottom.
   Returns top-left x, y per item, the size, and for long edges the points of
   their dummy nodes ({pts: [[x, top, bottom]], rev}). Items without edges are
   laid out in a grid below. */
function layered(w, h, edges) {
  var m = w.length, i, j, k, L, v, it;
  var res = {x: new Float64Array(m), y: new Float64Array(m), routes: new Array(edges.length),
    width: 0, height: 0};
  if (!m) return res;
  var deg = new Int32Array(m), outE = [];
  for (i = 0; i < m; i++) outE.push([]);
  for (k = 0; k < edges.length; k++) {
    deg[edges[k][0]]++; deg[edges[k][1]]++; outE[edges[k][0]].push(k);
  }
  // Break cycles: reverse the back edges of a depth-first search.
  var rev = new Uint8Array(edges.length), state = new Uint8Array(m);
  for (i = 0; i < m; i++) {
    if (state[i]) continue;
    var stack = [i], ptr = [0];
    state[i] = 1;
    while (stack.length) {
      v = stack[stack.length - 1];
      var p = ptr[ptr.length - 1];
      if (p < outE[v].length) {
        ptr[ptr.length - 1]++;
        var ek = outE[v][p], t = edges[ek][1];
        if (state[t] === 1) rev[ek] = 1;
        else if (!state[t]) { state[t] = 1; stack.push(t); ptr.push(0); }
      } else {
        state[v] = 2; stack.pop(); ptr.pop();
      }
    }
  }
  var src = new Int32Array(edges.length), dst = new Int32Array(edges.length);
  var outs = [], ins = [];
  for (i = 0; i < m; i++) { outs.push([]); ins.push([]); }
  for (k = 0; k < edges.length; k++) {
    src[k] = rev[k] ? edges[k][1] : edges[k][0];
    dst[k] = rev[k] ? edges[k][0] : edges[k][1];
    outs[src[k]].push(k); ins[dst[k]].push(k);
  }
  // Longest-path layers, then sources (constants, variables) next to their first use.
  var indeg = new Int32Array(m), order = [], layer = new Int32Array(m);
  for (k = 0; k < edges.length; k++) indeg[dst[k]]++;
  for (i = 0; i < m; i++) if (!indeg[i]) order.push(i);
  for (j = 0; j < order.length; j++) {
    v = order[j];
    for (k = 0; k < outs[v].length; k++) {
      var tk = dst[outs[v][k]];
      if (layer[tk] < layer[v] + 1) layer[tk] = layer[v] + 1;
      if (--indeg[tk] === 0) order.push(tk);
    }
  }
  for (j = 0; j < order.length; j++) {
    v = order[j];
    if (ins[v].length || !outs[v].length) continue;
    var lo = Infinity;
    for (k = 0; k < outs[v].length; k++) lo = Math.min(lo, layer[dst[outs[v][k]]]);
    layer[v] = lo - 1;
  }
  // Wide layers (many independent nodes) wrap onto several rows.
  var rank = new Int32Array(m), byLayer = [], top = 0;
  for (j = 0; j < order.length; j++) rank[order[j]] = j;
  for (i = 0; i < m; i++) {
    if (!deg[i]) continue;
    top = Math.max(top, layer[i]);
    (byLayer[layer[i]] = byLayer[layer[i]] || []).push(i);
  }
  var shift = 0;
  for (L = 0; L <= top; L++) {
    var members = byLayer[L] || [], rowW = 0, sub = 0;
    var key = members.map(function (x) {
      var s = 0;
      ins[x].forEach(function (q) { s += rank[src[q]]; });
      return ins[x].length ? s / ins[x].length : rank[x];
    });
    var idx = members.map(function (x, q) { return q; });
    idx.sort(function (a1, a2) {
      return key[a1] - key[a2] || rank[members[a1]] - rank[members[a2]];
    });
    idx.forEach(function (q) {
      var x = members[q];
      if (rowW > 0 && rowW + w[x] > MAX_ROW_W) { sub++; rowW = 0; }
      layer[x] = L + shift + sub;
      rowW += w[x] + COL_GAP;
    });
    shift += sub;
  }
  // Dummy nodes on long edges, so they route between the nodes of the rows they cross.
  var span = 0;
  for (k = 0; k < edges.length; k++) span += Math.max(0, layer[dst[k]] - layer[src[k]] - 1);
  var useDummies = span <= MAX_DUMMIES;
  var nodeW = Array.prototype.slice.call(w), nodeL = Array.prototype.slice.call(layer);
  var total = m, chains = new Array(edges.length), links = [];
  for (k = 0; k < edges.length; k++) {
    var chain = [], prev = src[k];
    if (useDummies) {
      for (L = layer[src[k]] + 1; L < layer[dst[k]]; L++) {
        chain.push(total); nodeW.push(DUMMY_W); nodeL.push(L); total++;
      }
    }
    chains[k] = chain;
    for (j = 0; j < chain.length; j++) { links.push([prev, chain[j]]); prev = chain[j]; }
    links.push([prev, dst[k]]);
  }
  var up = [], down = [];
  for (i = 0; i < total; i++) { up.push([]); down.push([]); }
  for (k = 0; k < links.length; k++) {
    down[links[k][0]].push(links[k][1]); up[links[k][1]].push(links[k][0]);
  }
  var maxL = -1;
  for (i = 0; i < total; i++) if ((i >= m || deg[i]) && nodeL[i] > maxL) maxL = nodeL[i];
  var rows = [];
  for (L = 0; L <= maxL; L++) rows.push([]);
  // Initial order within rows: depth-first from the sources.
  var seen = new Uint8Array(total);
  function visit(s) {
    var st = [s];
    while (st.length) {
      var x = st.pop();
      if (seen[x]) continue;
      seen[x] = 1;
      rows[nodeL[x]].push(x);
      for (var q = down[x].length - 1; q >= 0; q--) if (!seen[down[x][q]]) st.push(down[x][q]);
    }
  }
  for (j = 0; j < order.length; j++) if (deg[order[j]] && !up[order[j]].length) visit(order[j]);
  for (i = 0; i < m; i++) if (deg[i] && !seen[i]) visit(i);
  for (i = m; i < total; i++) if (!seen[i]) visit(i);
  // Fewer crossings: a few barycenter sweeps down and up.
  var pos = new Float64Array(total);
  function reindex(r) { for (var q = 0; q < r.length; q++) pos[r[q]] = q; }
  rows.forEach(reindex);
  function sweep(r, nb) {
    var keyed = r.map(function (x) {
      var a = nb[x];
      if (!a.length) return [pos[x], x];
      var s = 0;
      for (var q = 0; q < a.length; q++) s += pos[a[q]];
      return [s / a.length, x];
    });
    keyed.sort(function (p1, p2) { return p1[0] - p2[0] || pos[p1[1]] - pos[p2[1]]; });
    for (var q = 0; q < r.length; q++) r[q] = keyed[q][1];
    reindex(r);
  }
  for (it = 0; it < 4; it++) {
    for (L = 1; L <= maxL; L++) sweep(rows[L], up);
    for (L = maxL - 1; L >= 0; L--) sweep(rows[L], down);
  }
  // Rows' heights and tops.
  var rowH = [], rowY = [], y0 = 0;
  for (L = 0; L <= maxL; L++) {
    var hh = 0;
    for (j = 0; j < rows[L].length; j++) if (rows[L][j] < m) hh = Math.max(hh, h[rows[L][j]]);
    rowH.push(hh); rowY.push(y0); y0 += hh + ROW_GAP;
  }
  // x: each row placed as close as possible to the mean of its neighbours, keeping
  // its order (isotonic regression by pool-adjacent-violators).
  var cx = new Float64Array(total);
  function gap(a, b) { return a >= m || b >= m ? 8 : COL_GAP; }
  rows.forEach(function (r) {
    var x = 0;
    for (var q = 0; q < r.length; q++) {
      cx[r[q]] = x + nodeW[r[q]] / 2;
      x += nodeW[r[q]] + (q + 1 < r.length ? gap(r[q], r[q + 1]) : 0);
    }
  });
  function placeRow(r, nb1, nb2) {
    var n = r.length;
    if (!n) return;
    var off = new Float64Array(n), tg = new Float64Array(n), wt = new Float64Array(n), q, u;
    for (q = 0; q < n; q++) {
      var x = r[q];
      if (q) off[q] = off[q - 1] + (nodeW[r[q - 1]] + nodeW[x]) / 2 + gap(r[q - 1], x);
      var s = 0, c = 0;
      for (u = 0; u < nb1[x].length; u++) { s += cx[nb1[x][u]]; c++; }
      if (nb2) for (u = 0; u < nb2[x].length; u++) { s += cx[nb2[x][u]]; c++; }
      wt[q] = c ? c * (x >= m ? 2 : 1) : 0.02;
      tg[q] = (c ? s / c : cx[x]) - off[q];
    }
    var bs = [], bw = [], bn = [];
    for (q = 0; q < n; q++) {
      bs.push(wt[q] * tg[q]); bw.push(wt[q]); bn.push(1);
      while (bs.length > 1 &&
             bs[bs.length - 2] / bw[bw.length - 2] > bs[bs.length - 1] / bw[bw.length - 1]) {
        var s1 = bs.pop(), w1 = bw.pop(), n1 = bn.pop();
        bs[bs.length - 1] += s1; bw[bw.length - 1] += w1; bn[bn.length - 1] += n1;
      }
    }
    var at = 0;
    for (var b = 0; b < bs.length; b++) {
      var z = bs[b] / bw[b];
      for (q = 0; q < bn[b]; q++, at++) cx[r[at]] = z + off[at];
    }
  }
  for (it = 0; it < 5; it++) {
    for (L = 1; L <= maxL; L++) placeRow(rows[L], up);
    for (L = maxL - 1; L >= 0; L--) placeRow(rows[L], down);
  }
  for (L = 0; L <= maxL; L++) placeRow(rows[L], up, down);
  var minX = Infinity, maxX = -Infinity;
  rows.forEach(function (r) {
    r.forEach(function (x) {
      minX = Math.min(minX, cx[x] - nodeW[x] / 2); maxX = Math.max(maxX, cx[x] + nodeW[x] / 2);
    });
  });
  if (!isFinite(minX)) { minX = 0; maxX = 0; }
  for (L = 0; L <= maxL; L++) {
    rows[L].forEach(function (x) {
      if (x >= m) return;
      res.x[x] = cx[x] - w[x] / 2 - minX;
      res.y[x] = rowY[L] + (rowH[L] - h[x]) / 2;
    });
  }
  for (k = 0; k < edges.length; k++) {
    if (chains[k].length || rev[k]) {
      res.routes[k] = {rev: !!rev[k], pts: chains[k].map(function (d) {
        return [cx[d] - minX, rowY[nodeL[d]], rowY[nodeL[d]] + rowH[nodeL[d]]];
      })};
    }
  }
  var width = maxX - minX, height = maxL >= 0 ? y0 - ROW_GAP : 0;
  // Items without edges at this level: a grid underneath.
  var iso = [];
  for (i = 0; i < m; i++) if (!deg[i]) iso.push(i);
  if (iso.length) {
    var cw = 0;
    iso.forEach(function (x) { cw = Math.max(cw, w[x]); });
    var cols = Math.max(1, Math.min(iso.length,
      Math.floor((Math.max(width, 1100) + COL_GAP) / (cw + COL_GAP))));
    var gy = maxL >= 0 ? height + ROW_GAP : 0;
    for (j = 0; j < iso.length; j += cols) {
      var line = iso.slice(j, j + cols), lh = 0;
      line.forEach(function (x) { lh = Math.max(lh, h[x]); });
      line.forEach(function (x, q) {
        res.x[x] = q * (cw + COL_GAP) + (cw - w[x]) / 2;
        res.y[x] = gy + (lh - h[x]) / 2;
      });
      gy += lh + COL_GAP;
    }
    width = Math.max(width, cols * (cw + COL_GAP) - COL_GAP);
    height = gy - COL_GAP;
  }
  res.width = width; res.height = height;
  return res;
}

/* ------------------------------------------------------------------ bodies */

function Body(raw, index) {
  var self = this, n = raw.items.length, G = raw.groups.length + 1, i, g, p;
  this.index = index; this.name = raw.name; this.shown = raw.shown || raw.name;
  this.items = raw.items; this.n = n; this.G = G;
  var total = this.total = n + G;
  this.label = ['']; this.full = ['']; this.part = [0];
  var parent = this.parent = new Int32Array(total);
  for (i = 0; i < n; i++) parent[i] = n + raw.member[i] + 1;
  parent[n] = -1;
  raw.groups.forEach(function (gr, k) {
    self.label.push(gr[0]); self.full.push(gr[2]); self.part.push(gr[3]);
    parent[n + k + 1] = n + gr[1] + 1;
  });
  var depth = this.depth = new Int32Array(total);
  for (g = 1; g < G; g++) depth[n + g] = depth[parent[n + g]] + 1;
  for (i = 0; i < n; i++) depth[i] = depth[parent[i]] + 1;
  var kids = this.kids = [];
  for (g = 0; g < G; g++) kids.push([]);
  for (g = 1; g < G; g++) kids[parent[n + g] - n].push(n + g);
  for (i = 0; i < n; i++) kids[parent[i] - n].push(i);
  var nc = CATS.length;
  this.count = new Int32Array(G); this.casts = new Int32Array(G);
  this.cats = new Int32Array(G * nc);
  this.byName = {}; this.lower = [];
  this.catTotals = new Int32Array(nc);
  for (i = 0; i < n; i++) {
    var it = this.items[i], c = it[2];
    this.catTotals[c]++;
    if (it[1] === 0) this.byName[it[0]] = i;
    this.lower.push(it[0].toLowerCase());
    for (p = parent[i]; p >= 0; p = parent[p]) {
      this.count[p - n]++; this.cats[(p - n) * nc + c]++;
      if (it[1] === 1) this.casts[p - n]++;
    }
  }
  var E = raw.edges, ne = E.length / 2;
  this.ne = ne;
  this.eSrc = new Int32Array(ne); this.eDst = new Int32Array(ne);
  this.eCont = new Int32Array(ne); this.eA = new Int32Array(ne); this.eB = new Int32Array(ne);
  this.e16 = new Uint8Array(ne);
  this.preds = []; this.succs = []; this.levelList = [];
  for (i = 0; i < n; i++) { this.preds.push([]); this.succs.push([]); }
  var levelKey = [];
  for (g = 0; g < G; g++) { this.levelList.push([]); levelKey.push(new Map()); }
  var k16src = {f16: 1, cast16: 1}, k16dst = {f16: 1, cast32: 1};
  for (var k = 0; k < ne; k++) {
    var u = E[2 * k], v = E[2 * k + 1], a = u, b = v;
    this.eSrc[k] = u; this.eDst[k] = v;
    this.preds[v].push(u); this.succs[u].push(v);
    this.e16[k] = k16src[CATS[this.items[u][2]][0]] && k16dst[CATS[this.items[v][2]][0]] ? 1 : 0;
    while (parent[a] !== parent[b]) {
      if (depth[a] >= depth[b]) a = parent[a]; else b = parent[b];
    }
    if (a === b) { this.eCont[k] = -1; continue; }
    var cg = parent[a] - n, key = a * total + b;
    if (!levelKey[cg].has(key)) { levelKey[cg].set(key, 1); this.levelList[cg].push([a, b]); }
    this.eCont[k] = cg; this.eA[k] = a; this.eB[k] = b;
  }
  this.expanded = new Uint8Array(G);
  this.match = new Uint8Array(n);
  this.scale = 0; this.rendered = false; this.open = true;
  this.callers = [];
}

Body.prototype.setDefault = function () {
  var ex = this.expanded, n = this.n, kids = this.kids;
  ex.fill(0); ex[0] = 1;
  var visible = kids[0].length, queue = [];
  function push(g) { kids[g].forEach(function (id) { if (id >= n) queue.push(id - n); }); }
  push(0);
  for (var q = 0; q < queue.length; q++) {
    var g = queue[q], extra = kids[g].length - 1;
    if (visible + extra <= BUDGET) { ex[g] = 1; visible += extra; push(g); }
  }
};

Body.prototype.computeHidden = function () {
  var n = this.n, parent = this.parent, ex = this.expanded;
  var hid = this.hid = new Int32Array(this.total).fill(-1);
  function set(id) {
    var p = parent[id];
    hid[id] = hid[p] >= 0 ? hid[p] : (ex[p - n] ? -1 : p);
  }
  for (var g = 1; g < this.G; g++) set(n + g);
  for (var i = 0; i < n; i++) set(i);
};

Body.prototype.rep = function (id) { return this.hid[id] >= 0 ? this.hid[id] : id; };

Body.prototype.itemSize = function (id) {
  if (id >= this.n) return [GROUP_W, GROUP_H];
  var kind = this.items[id][1];
  if (kind === 0) return [NODE_W, NODE_H];
  if (kind === 1) return [CAST_W, CAST_H];
  return [IO_W, IO_H];
};

Body.prototype.layout = function () {
  var self = this, n = this.n, total = this.total;
  var X = this.X = new Float64Array(total), Y = this.Y = new Float64Array(total);
  var W = this.W = new Float64Array(total), H = this.H = new Float64Array(total);
  this.routes = []; this.origin = [];
  function lay(g) {
    var ids = self.kids[g], w = [], h = [], local = new Map();
    ids.forEach(function (id, q) {
      local.set(id, q);
      if (id >= n && self.expanded[id - n]) {
        var s = lay(id - n);
        W[id] = Math.max(s[0] + 2 * PAD, 110 + 6.5 * self.label[id - n].length);
        H[id] = s[1] + HEAD + PAD;
      } else {
        var z = self.itemSize(id);
        W[id] = z[0]; H[id] = z[1];
      }
      w.push(W[id]); h.push(H[id]);
    });
    var list = self.levelList[g];
    var res = layered(w, h, list.map(function (e) { return [local.get(e[0]), local.get(e[1])]; }));
    ids.forEach(function (id, q) { X[id] = res.x[q]; Y[id] = res.y[q]; });
    var routes = new Map();
    list.forEach(function (e, q) {
      if (res.routes[q]) routes.set(e[0] * total + e[1], res.routes[q]);
    });
    self.routes[g] = routes;
    return [res.width, res.height];
  }
  function place(g, ox, oy) {
    self.origin[g] = [ox, oy];
    self.kids[g].forEach(function (id) {
      X[id] += ox; Y[id] += oy;
      if (id >= n && self.expanded[id - n]) place(id - n, X[id] + PAD, Y[id] + HEAD);
    });
  }
  var size = lay(0);
  place(0, PAD, PAD);
  this.width = size[0] + 2 * PAD; this.height = size[1] + 2 * PAD;
};

Body.prototype.groupHasMatch = function () {
  var n = this.n, has = new Uint8Array(this.G);
  for (var i = 0; i < n; i++) {
    if (!this.match[i]) continue;
    for (var p = this.parent[i]; p > n && !has[p - n]; p = this.parent[p]) has[p - n] = 1;
  }
  return has;
};

Body.prototype.nodeMarkup = function (id) {
  var it = this.items[id], kind = it[1], cat = CATS[it[2]], w = this.W[id], h = this.H[id];
  var cls = 'n c-' + cat[0] + (kind === 1 ? ' cast' : kind > 1 ? ' io' : '') +
    (this.match[id] ? ' match' : '') + (isSelected(this, id) ? ' sel' : '');
  var tip = it[0] + '\n' + (kind === 0 ? S[it[3]] + ': ' + shortNames(S[it[5]]) : S[it[5]]);
  var s = '<g class="' + cls + '" data-node="' + id + '" transform="translate(' +
    fmt(this.X[id]) + ',' + fmt(this.Y[id]) + ')"><title>' + esc(tip) + '</title>';
  if (kind === 0) {
    var badge = cat[0] === 'f16' ? shortType(D.dtype) : cat[0] === 'nofloat' ||
      cat[0] === 'unknown' ? '' : 'f32';
    s += '<rect class="b" width="' + w + '" height="' + h + '" rx="5" fill="' + cat[2] + '"/>' +
      '<text class="op" x="8" y="15" fill="' + cat[3] + '">' + esc(clip(S[it[3]], 18)) +
      '</text><text class="nm" x="8" y="30" fill="' + cat[3] + '">' +
      esc(clip(lastPart(it[0]), 25)) + '</text>';
    if (badge) {
      s += '<text class="bd" x="' + (w - 6) + '" y="13" text-anchor="end" fill="' + cat[3] +
        '">' + badge + '</text>';
    }
  } else if (kind === 1) {
    s += '<rect class="b" width="' + w + '" height="' + h + '" rx="9" fill="' + cat[2] + '"/>' +
      '<text x="' + w / 2 + '" y="12.5" text-anchor="middle">\u2192' +
      esc(shortType(it[7][2])) + '</text>';
  } else {
    s += '<rect class="b" width="' + w + '" height="' + h + '" rx="11" fill="#fff"/>' +
      '<text x="' + w / 2 + '" y="14.5" text-anchor="middle">' +
      esc((kind === 2 ? 'in: ' : 'out: ') + clip(it[0], 21)) + '</text>';
  }
  return s + '</g>';
};

Body.prototype.groupName = function (g) {
  return this.full[g] + '/' + (this.part[g] ? ' ' + this.label[g] : '');
};

Body.prototype.shortLabel = function (g, max) {
  return this.part[g] ? clip(this.label[g], max + 1) : clip(this.label[g], max - 1) + '/';
};

Body.prototype.groupMarkup = function (id, match) {
  var g = id - this.n, w = this.W[id], h = this.H[id], nc = CATS.length, total = this.count[g];
  var casts = this.casts[g], ops = total - casts, conv = this.cats[g * nc + CAT.f16];
  var line = plural(ops, 'op') + (conv ? ', ' + conv + ' \u2192 ' + shortType(D.dtype) : '') +
    (casts ? ', ' + plural(casts, 'cast') : '');
  var s = '<g class="grp' + (match ? ' match' : '') + '" data-group="' + id +
    '" transform="translate(' + fmt(this.X[id]) + ',' + fmt(this.Y[id]) + ')"><title>' +
    esc(this.groupName(g) + '\n' + line + '\nclick to expand') + '</title>' +
    '<rect class="gs" x="4" y="4" width="' + w + '" height="' + h + '" rx="7"/>' +
    '<rect class="gb" width="' + w + '" height="' + h + '" rx="7"/>' +
    '<text class="gl" x="9" y="17">' + esc('\u25B8 ' + this.shortLabel(g, 25)) +
    '</text><text class="gc" x="9" y="31">' + esc(line) + '</text>';
  var x = 9, bw = w - 18;
  for (var c = 0; c < nc; c++) {
    var k = this.cats[g * nc + c];
    if (!k) continue;
    var sw = bw * k / total;
    s += '<rect x="' + fmt(x) + '" y="' + (h - 14) + '" width="' + fmt(Math.max(sw, 0.5)) +
      '" height="7" fill="' + CATS[c][2] + '"/>';
    x += sw;
  }
  return s + '<rect x="9" y="' + (h - 14) + '" width="' + fmt(bw) +
    '" height="7" fill="none" stroke="rgba(0,0,0,.25)"/></g>';
};

Body.prototype.frameMarkup = function (id) {
  var g = id - this.n, x = fmt(this.X[id]), y = fmt(this.Y[id]), w = fmt(this.W[id]);
  return '<g class="gf"><rect class="gfr" x="' + x + '" y="' + y + '" width="' + w +
    '" height="' + fmt(this.H[id]) + '" rx="8"/><g class="gh" data-ghead="' + id +
    '"><title>' + esc(this.groupName(g) + ' - click to collapse') + '</title><rect x="' + x +
    '" y="' + y + '" width="' + w + '" height="' + (HEAD - 4) + '" rx="8"/><text x="' +
    (this.X[id] + 9) + '" y="' + (this.Y[id] + 14) + '">' +
    esc('\u25BE ' + this.shortLabel(g, 200) + '   (' + this.count[g] + ')') + '</text></g></g>';
};

function edgePath(x1, y1, x2, y2, route, ox, oy) {
  var pts = [[x1, y1, 0]];
  if (route) {
    var list = route.rev ? route.pts.slice().reverse() : route.pts;
    list.forEach(function (p) {
      var a = route.rev ? p[2] : p[1], b = route.rev ? p[1] : p[2];
      pts.push([p[0] + ox, a + oy, 0]); pts.push([p[0] + ox, b + oy, 1]);
    });
  }
  pts.push([x2, y2, 0]);
  var d = 'M' + fmt(x1) + ',' + fmt(y1);
  for (var i = 1; i < pts.length; i++) {
    var a0 = pts[i - 1], b0 = pts[i];
    if (b0[2]) { d += 'L' + fmt(b0[0]) + ',' + fmt(b0[1]); continue; }
    var dy = Math.max(18, Math.abs(b0[1] - a0[1]) / 2);
    d += 'C' + fmt(a0[0]) + ',' + fmt(a0[1] + dy) + ' ' + fmt(b0[0]) + ',' + fmt(b0[1] - dy) +
      ' ' + fmt(b0[0]) + ',' + fmt(b0[1]);
  }
  return d;
}

Body.prototype.render = function () {
  var n = this.n, total = this.total, out = [], k, g, i;
  this.computeHidden();
  this.layout();
  var hasMatch = this.groupHasMatch();
  for (g = 1; g < this.G; g++) {
    if (this.hid[n + g] < 0 && this.expanded[g]) out.push(this.frameMarkup(n + g));
  }
  var seen = new Map();
  for (k = 0; k < this.ne; k++) {
    if (this.eCont[k] < 0) continue;
    var ru = this.rep(this.eSrc[k]), rv = this.rep(this.eDst[k]);
    if (ru === rv) continue;
    var key = ru * total + rv, ent = seen.get(key);
    if (ent) { ent.count++; ent.h16 = ent.h16 && this.e16[k]; continue; }
    seen.set(key, {ru: ru, rv: rv, k: k, count: 1, h16: this.e16[k]});
  }
  var self = this;
  seen.forEach(function (e) {
    var cont = self.eCont[e.k], route = self.routes[cont].get(self.eA[e.k] * total + self.eB[e.k]);
    var o = self.origin[cont];
    var d = edgePath(self.X[e.ru] + self.W[e.ru] / 2, self.Y[e.ru] + self.H[e.ru],
      self.X[e.rv] + self.W[e.rv] / 2, self.Y[e.rv], route, o[0], o[1]);
    var sw = e.count > 1 ? ' style="stroke-width:' +
      fmt(Math.min(1.2 + Math.log(e.count) / Math.LN2 * 0.7, 5)) + '"' : '';
    out.push('<path class="e' + (e.h16 ? ' h16' : '') + '" data-f="' + e.ru + '" data-t="' +
      e.rv + '" d="' + d + '"' + sw + '/>');
  });
  var drawn = 0;
  for (i = 0; i < n; i++) {
    if (this.hid[i] < 0) { out.push(this.nodeMarkup(i)); drawn++; }
  }
  for (g = 1; g < this.G; g++) {
    if (this.hid[n + g] < 0 && !this.expanded[g]) out.push(this.groupMarkup(n + g, hasMatch[g]));
  }
  this.drawn = drawn;
  if (!this.scale) {
    var avail = Math.max(300, this.canvas.clientWidth - 4);
    this.scale = Math.max(0.8, Math.min(1, avail / this.width));
  }
  this.svg.setAttribute('viewBox', '0 0 ' + fmt(this.width) + ' ' + fmt(this.height));
  this.applyScale();
  this.svg.innerHTML = out.join('');
  if (!this.rendered) this.scrollToStart();
  this.rendered = true;
  if (selected && selected.body === this) highlightEdges(this, selected.id);
};

/* Shows the top of the drawing: scrolls right to where its first rows start. */
Body.prototype.scrollToStart = function () {
  var c = this.canvas, limit = c.clientHeight / this.scale, left = Infinity;
  for (var id = 0; id < this.total; id++) {
    var visible = id < this.n ? this.hid[id] < 0 : id > this.n && this.hid[id] < 0 &&
      !this.expanded[id - this.n];
    if (visible && this.Y[id] < limit) left = Math.min(left, this.X[id]);
  }
  c.scrollTop = 0;
  c.scrollLeft = isFinite(left) ? Math.max(0, left * this.scale - 16) : 0;
};

Body.prototype.applyScale = function () {
  this.svg.setAttribute('width', fmt(this.width * this.scale));
  this.svg.setAttribute('height', fmt(this.height * this.scale));
};

Body.prototype.zoom = function (factor, px, py) {
  var c = this.canvas;
  if (px === undefined) { px = c.clientWidth / 2; py = c.clientHeight / 2; }
  var gx = (c.scrollLeft + px) / this.scale, gy = (c.scrollTop + py) / this.scale;
  this.scale = Math.max(0.05, Math.min(3, this.scale * factor));
  this.applyScale();
  c.scrollLeft = gx * this.scale - px; c.scrollTop = gy * this.scale - py;
};

Body.prototype.fit = function () {
  var c = this.canvas, maxH = window.innerHeight * 0.74;
  this.scale = Math.max(0.05, Math.min(1, (c.clientWidth - 4) / this.width,
    (maxH - 4) / this.height));
  this.applyScale();
};

Body.prototype.centerOn = function (id) {
  var c = this.canvas;
  c.scrollLeft = (this.X[id] + this.W[id] / 2) * this.scale - c.clientWidth / 2;
  c.scrollTop = (this.Y[id] + this.H[id] / 2) * this.scale - c.clientHeight / 2;
};

Body.prototype.setOpen = function (open) {
  this.open = open;
  this.panel.classList.toggle('folded', !open);
  this.foldButton.textContent = open ? '\u25BE' : '\u25B8';
  if (open && !this.rendered) this.render();
};

Body.prototype.applyMatches = function () {
  if (!this.rendered) return;
  var self = this, has = this.groupHasMatch();
  this.svg.querySelectorAll('[data-node]').forEach(function (e) {
    e.classList.toggle('match', !!self.match[+e.getAttribute('data-node')]);
  });
  this.svg.querySelectorAll('[data-group]').forEach(function (e) {
    e.classList.toggle('match', !!has[+e.getAttribute('data-group') - self.n]);
  });
};

/* --------------------------------------------------------------- selection */

function isSelected(body, id) { return selected && selected.body === body && selected.id === id; }

function highlightEdges(body, id) {
  body.svg.querySelectorAll('path.e.hl').forEach(function (e) { e.classList.remove('hl'); });
  if (body.hid[id] >= 0) return;
  body.svg.querySelectorAll('path[data-f="' + id + '"],path[data-t="' + id + '"]')
    .forEach(function (e) { e.classList.add('hl'); });
}

function select(body, id) {
  if (selected && selected.body.rendered) {
    selected.body.svg.querySelectorAll('.n.sel').forEach(function (e) {
      e.classList.remove('sel');
    });
    selected.body.svg.querySelectorAll('path.e.hl').forEach(function (e) {
      e.classList.remove('hl');
    });
  }
  selected = {body: body, id: id};
  if (body.rendered) {
    var e = body.svg.querySelector('[data-node="' + id + '"]');
    if (e) e.classList.add('sel');
    highlightEdges(body, id);
  }
  showDetails(body, id);
}

function reveal(body, id) {
  var n = body.n, changed = false;
  for (var p = body.parent[id]; p > n; p = body.parent[p]) {
    if (!body.expanded[p - n]) { body.expanded[p - n] = 1; changed = true; }
  }
  if (!body.open) body.setOpen(true);
  if (changed || !body.rendered) body.render();
  select(body, id);
  body.panel.scrollIntoView({block: 'start'});
  body.centerOn(id);
  var e = body.svg.querySelector('[data-node="' + id + '"]');
  if (e) {
    e.classList.remove('flash');
    void e.getBoundingClientRect();
    e.classList.add('flash');
  }
}

function showPanel(body) {
  if (!body.open) body.setOpen(true);
  body.panel.scrollIntoView({block: 'start'});
}

/* ----------------------------------------------------------------- details */

function link(text, onclick) {
  var a = el('a', 'mono', text);
  a.href = '#';
  a.addEventListener('click', function (ev) { ev.preventDefault(); onclick(); });
  return a;
}

function nodeLink(body, id) {
  var it = body.items[id];
  var text = it[1] === 2 ? 'argument ' + it[0] : it[1] === 3 ? 'result ' + it[0] : it[0];
  return link(text, function () { reveal(body, id); });
}

// A reason names called functions in quotes: show them by their labels.
function shortNames(text) {
  return text.replace(/'([^']+)'/g, function (m, name) {
    var body = bodyByName[name];
    return body && body.shown !== name ? "'" + body.shown + "'" : m;
  });
}

function functionLink(name) {
  var body = bodyByName[name];
  if (!body) return el('span', 'mono', name);
  var a = link(body.shown || '(top graph)', function () { showPanel(body); });
  if (body.shown !== name) a.title = name;
  return a;
}

function nodeList(body, ids) {
  var ul = el('ul');
  ids.slice(0, 40).forEach(function (id) {
    var li = el('li');
    li.appendChild(nodeLink(body, id));
    ul.appendChild(li);
  });
  if (ids.length > 40) ul.appendChild(el('li', null, '\u2026 ' + (ids.length - 40) + ' more'));
  return ul;
}

function showDetails(body, id) {
  var box = $('details'), it = body.items[id], cat = CATS[it[2]], kind = it[1];
  box.textContent = '';
  box.appendChild(el('div', 'dname', it[0]));
  var table = el('table');
  function row(key, value) {
    var tr = el('tr'), v = el('td', 'v');
    tr.appendChild(el('td', 'k', key));
    if (typeof value === 'string') v.textContent = value; else v.appendChild(value);
    tr.appendChild(v);
    table.appendChild(tr);
  }
  row('Function', functionLink(body.name));
  if (kind === 0) {
    row('Op', S[it[3]]);
    row('List', S[it[4]] || '-');
    row('Decision', cat[0] === 'f16' ? 'converted: computes in ' + D.dtype :
      cat[0] === 'nofloat' ? 'unchanged: no float32 tensors' :
      cat[0] === 'unknown' ? 'not in the report' : 'stays float32');
    var chip = el('span');
    var swatch = el('span', 'chip');
    swatch.style.background = cat[2];
    chip.appendChild(swatch);
    chip.appendChild(document.createTextNode(cat[1]));
    row('Category', chip);
    row('Reason', shortNames(S[it[5]]));
    var cause = S[it[6]];
    row('Cause', !cause ? '-' : body.byName[cause] !== undefined ?
      nodeLink(body, body.byName[cause]) : el('span', 'mono', cause));
    if (it[7] && it[7].length) {
      var calls = el('div');
      it[7].forEach(function (f, q) {
        if (q) calls.appendChild(document.createTextNode(', '));
        calls.appendChild(functionLink(f));
      });
      row('Calls', calls);
    }
  } else if (kind === 1) {
    var info = it[7];
    row('Op', 'Cast inserted by tfamp');
    row('Converts', info[1] + ' \u2192 ' + info[2]);
    var srcName = info[0].split(':')[0];
    row('Reads', body.byName[srcName] !== undefined ?
      link(info[0], function () { reveal(body, body.byName[srcName]); }) :
      el('span', 'mono', info[0]));
    row('Feeds', el('span', 'mono', info[3].join(', ')));
  } else {
    row('Kind', kind === 2 ? 'function argument' : 'function result');
    row('Type', S[it[5]]);
  }
  if (body.preds[id].length) row('Inputs', nodeList(body, body.preds[id]));
  if (body.succs[id].length) row('Consumers', nodeList(body, body.succs[id]));
  box.appendChild(table);
}

function showGroupDetails(body, id) {
  var box = $('details'), g = id - body.n, nc = CATS.length;
  box.textContent = '';
  box.appendChild(el('div', 'dname', body.groupName(g)));
  box.appendChild(el('div', null, body.count[g] + ' nodes in this name scope' +
    (body.name ? ' of ' + body.shown : ' of the top graph')));
  var ul = el('ul');
  for (var c = 0; c < nc; c++) {
    var k = body.cats[g * nc + c];
    if (!k) continue;
    var li = el('li'), sw = el('span', 'chip');
    sw.style.background = CATS[c][2];
    li.appendChild(sw);
    li.appendChild(document.createTextNode(CATS[c][1] + ': ' + k));
    ul.appendChild(li);
  }
  box.appendChild(ul);
}

/* ------------------------------------------------------------------ search */

function runSearch() {
  var q = $('search').value.trim().toLowerCase();
  matchList = []; matchPos = -1;
  bodies.forEach(function (body) {
    body.match.fill(0);
    if (q) {
      for (var i = 0; i < body.n; i++) {
        if (body.lower[i].indexOf(q) >= 0) { body.match[i] = 1; matchList.push([body, i]); }
      }
    }
    body.applyMatches();
  });
  $('scount').textContent = q ? matchList.length + ' match' + (matchList.length === 1 ? '' : 'es')
    : '';
  var box = $('results');
  box.textContent = '';
  if (!q) { box.style.display = 'none'; return; }
  matchList.slice(0, 200).forEach(function (m, q2) {
    var row = el('div', 'res');
    row.appendChild(el('span', 'rn', m[0].items[m[1]][0]));
    row.appendChild(el('span', 'rf', (m[0].name ? 'function ' + m[0].shown : 'top graph') +
      (m[0].items[m[1]][1] === 0 ? ' \u00b7 ' + S[m[0].items[m[1]][3]] : '')));
    row.addEventListener('mousedown', function (ev) {
      ev.preventDefault();
      matchPos = q2;
      reveal(m[0], m[1]);
      box.style.display = 'none';
    });
    box.appendChild(row);
  });
  if (matchList.length > 200) {
    box.appendChild(el('div', 'more', (matchList.length - 200) + ' more: refine the search'));
  }
  if (!matchList.length) box.appendChild(el('div', 'more', 'No node name contains that text.'));
  box.style.display = 'block';
}

function nextMatch(step) {
  if (!matchList.length) return;
  matchPos = (matchPos + step + matchList.length) % matchList.length;
  var m = matchList[matchPos];
  reveal(m[0], m[1]);
  $('results').style.display = 'none';
  $('scount').textContent = (matchPos + 1) + ' of ' + matchList.length;
}

/* ------------------------------------------------------------------ legend */

function buildLegend() {
  var box = $('legend'), nc = CATS.length, totals = new Int32Array(nc);
  bodies.forEach(function (b) { for (var c = 0; c < nc; c++) totals[c] += b.catTotals[c]; });
  CATS.forEach(function (cat, c) {
    if (!totals[c] && cat[0] !== 'f16') return;
    var row = el('div', 'row'), sw = el('span', 'sw');
    if (cat[0] === 'cast16' || cat[0] === 'cast32') sw.className = 'sw cast';
    if (cat[0] === 'io' || cat[0] === 'unknown') sw.className = 'sw io';
    sw.style.background = cat[2];
    row.appendChild(sw);
    row.appendChild(el('span', 'lbl', cat[1]));
    row.appendChild(el('span', 'cnt', String(totals[c])));
    row.title = 'click to highlight these nodes';
    row.addEventListener('click', function () {
      var on = filterKey !== cat[0];
      box.querySelectorAll('.row.on').forEach(function (r) { r.classList.remove('on'); });
      filterKey = on ? cat[0] : null;
      document.body.classList.toggle('filtering', on);
      if (on) row.classList.add('on');
      filterStyle.textContent = on ? '.filtering .n.c-' + cat[0] + ' { opacity: 1; }' : '';
    });
    box.appendChild(row);
  });
  function lineRow(color, text) {
    var row = el('div', 'row'), line = el('span', 'line');
    line.style.borderTopColor = color;
    row.appendChild(line);
    row.appendChild(el('span', 'lbl', text));
    box.appendChild(row);
  }
  lineRow('#2e9d57', 'edge carrying a ' + D.dtype + ' tensor');
  lineRow('#9aa1b0', 'other edge');
  var grp = el('div', 'row'), gsw = el('span', 'sw');
  gsw.style.background = '#f4f6fb';
  gsw.style.borderColor = '#7d88a6';
  grp.appendChild(gsw);
  grp.appendChild(el('span', 'lbl', 'name scope (click to expand; bar = mix of decisions)'));
  box.appendChild(grp);
  box.appendChild(el('div', 'note', 'Badges: ' + shortType(D.dtype) +
    ' = runs in ' + D.dtype + ', f32 = kept float32.' +
    (D.hasGraph ? '' : ' No graph was given: only the edges through inserted Casts are drawn.')));
}

/* ------------------------------------------------------------------- panels */

function buildPanel(body) {
  var panel = el('section', 'panel'), head = el('div', 'phead');
  panel.id = 'panel-' + body.index;
  var fold = el('button', 'fold', '\u25BE');
  fold.title = 'fold / unfold this panel';
  fold.addEventListener('click', function () { body.setOpen(!body.open); });
  head.appendChild(fold);
  var title = el('span', 'ptitle', body.name ? 'function ' + body.shown : 'Top graph');
  if (body.shown !== body.name) title.title = body.name;
  head.appendChild(title);
  var meta = el('span', 'pmeta'), ops = 0, casts = 0, conv = body.catTotals[CAT.f16];
  body.items.forEach(function (it) { if (it[1] === 0) ops++; else if (it[1] === 1) casts++; });
  meta.appendChild(document.createTextNode(plural(ops, 'op') + ', ' + conv + ' \u2192 ' +
    D.dtype + ', ' + plural(casts, 'cast')));
  if (body.callers.length) {
    meta.appendChild(document.createTextNode(' \u00b7 called by '));
    body.callers.slice(0, 3).forEach(function (c, q) {
      if (q) meta.appendChild(document.createTextNode(', '));
      var a = el('a', null, (c[0].name ? c[0].shown + ': ' : '') + c[0].items[c[1]][0]);
      a.href = '#';
      a.addEventListener('click', function (ev) { ev.preventDefault(); reveal(c[0], c[1]); });
      meta.appendChild(a);
    });
    if (body.callers.length > 3) meta.appendChild(document.createTextNode(', \u2026'));
  }
  head.appendChild(meta);
  [['Expand all', function () { body.expanded.fill(1); body.render(); }],
   ['Collapse all', function () { body.expanded.fill(0); body.expanded[0] = 1; body.render(); }],
   ['Default', function () { body.setDefault(); body.render(); }],
   ['\u2212', function () { body.zoom(1 / 1.25); }],
   ['+', function () { body.zoom(1.25); }],
   ['Fit', function () { body.fit(); }]].forEach(function (b) {
    var button = el('button', null, b[0]);
    button.addEventListener('click', function () { if (!body.open) body.setOpen(true); b[1](); });
    head.appendChild(button);
  });
  var canvas = el('div', 'canvas');
  var svg = document.createElementNS($('tfamp-defs').namespaceURI, 'svg');
  svg.setAttribute('class', 'graph');
  canvas.appendChild(svg);
  panel.appendChild(head);
  panel.appendChild(canvas);
  body.panel = panel; body.canvas = canvas; body.svg = svg; body.foldButton = fold;
  canvas.addEventListener('click', function (ev) {
    if (drag && drag.moved) return;
    var t = ev.target.closest('[data-node],[data-group],[data-ghead]');
    if (!t) return;
    if (t.hasAttribute('data-node')) { select(body, +t.getAttribute('data-node')); return; }
    var id = +(t.getAttribute('data-group') || t.getAttribute('data-ghead'));
    var expand = t.hasAttribute('data-group');
    var c = body.canvas, before = [body.X[id] * body.scale - c.scrollLeft,
      body.Y[id] * body.scale - c.scrollTop];
    body.expanded[id - body.n] = expand ? 1 : 0;
    body.render();
    c.scrollLeft = body.X[id] * body.scale - before[0];
    c.scrollTop = body.Y[id] * body.scale - before[1];
    showGroupDetails(body, id);
  });
  canvas.addEventListener('mousedown', function (ev) {
    if (ev.button !== 0) return;
    drag = {canvas: canvas, x: ev.clientX, y: ev.clientY, left: canvas.scrollLeft,
      top: canvas.scrollTop, moved: false};
  });
  canvas.addEventListener('wheel', function (ev) {
    if (!ev.ctrlKey) return;
    ev.preventDefault();
    var r = canvas.getBoundingClientRect();
    body.zoom(ev.deltaY < 0 ? 1.15 : 1 / 1.15, ev.clientX - r.left, ev.clientY - r.top);
  }, {passive: false});
  return panel;
}

/* --------------------------------------------------------------------- main */

/* Options after '#', joined by '&': 'expand-all' opens every scope and panel,
   'fit' zooms every panel to fit, 'find=NAME' selects a node (e.g.
   report.html#find=dense_1/MatMul). */
function hashOptions() {
  var opts = {};
  location.hash.slice(1).split('&').forEach(function (part) {
    if (!part) return;
    var i = part.indexOf('='), value = i < 0 ? '' : part.slice(i + 1);
    try { value = decodeURIComponent(value); } catch (e) { /* keep it as written */ }
    opts[i < 0 ? part : part.slice(0, i)] = value;
  });
  return opts;
}

function main() {
  var t0 = Date.now();
  D = JSON.parse($('tfamp-data').textContent);
  S = D.strings; CATS = D.categories;
  CATS.forEach(function (c, i) { CAT[c[0]] = i; });
  filterStyle = document.createElement('style');
  document.head.appendChild(filterStyle);
  document.title = D.title;
  $('htitle').textContent = (D.function || 'graph') + ' \u2192 ' + D.dtype;
  var summary = $('summary');
  [[D.convertedCount, ' ops \u2192 ' + D.dtype + ', '], [D.castCount, ' casts inserted, '],
   [D.keptCount, ' listed ops kept float32 \u00b7 '],
   [D.nodesBefore, ' nodes before, '], [D.nodesAfter, ' after']].forEach(function (p) {
    summary.appendChild(el('b', null, String(p[0])));
    summary.appendChild(document.createTextNode(p[1]));
  });
  summary.title = D.summary;
  bodies = D.bodies.map(function (raw, i) { return new Body(raw, i); });
  bodies.forEach(function (b) { bodyByName[b.name] = b; });
  bodies.forEach(function (b) {
    b.items.forEach(function (it, i) {
      if (it[1] === 0 && it[7] && it[7].length) {
        it[7].forEach(function (f) { if (bodyByName[f]) bodyByName[f].callers.push([b, i]); });
      }
    });
  });
  var opts = hashOptions(), expandAll = 'expand-all' in opts;
  var panels = $('panels');
  bodies.forEach(function (b) { panels.appendChild(buildPanel(b)); });
  var totalItems = 0, drawn = 0, open = 0;
  bodies.forEach(function (b, i) {
    totalItems += b.n;
    if (expandAll) b.expanded.fill(1); else b.setDefault();
    b.open = expandAll || i < OPEN_PANELS;
    b.panel.classList.toggle('folded', !b.open);
    b.foldButton.textContent = b.open ? '\u25BE' : '\u25B8';
    if (b.open) { b.render(); drawn += b.drawn; open++; }
  });
  buildLegend();
  var search = $('search');
  search.addEventListener('input', function () {
    clearTimeout(search.timer);
    search.timer = setTimeout(runSearch, 120);
  });
  search.addEventListener('keydown', function (ev) {
    if (ev.key === 'Enter') { runSearch(); nextMatch(ev.shiftKey ? -1 : 1); ev.preventDefault(); }
    if (ev.key === 'Escape') { search.value = ''; runSearch(); }
  });
  search.addEventListener('focus', function () { if (search.value) runSearch(); });
  search.addEventListener('blur', function () {
    setTimeout(function () { $('results').style.display = 'none'; }, 150);
  });
  document.addEventListener('keydown', function (ev) {
    if (ev.key === '/' && document.activeElement !== search) {
      ev.preventDefault(); search.focus();
    }
  });
  window.addEventListener('mousemove', function (ev) {
    if (!drag) return;
    var dx = ev.clientX - drag.x, dy = ev.clientY - drag.y;
    if (!drag.moved && Math.abs(dx) + Math.abs(dy) > 4) {
      drag.moved = true; drag.canvas.classList.add('dragging');
    }
    if (drag.moved) {
      drag.canvas.scrollLeft = drag.left - dx; drag.canvas.scrollTop = drag.top - dy;
      ev.preventDefault();
    }
  });
  window.addEventListener('mouseup', function () {
    if (!drag) return;
    var d = drag;
    d.canvas.classList.remove('dragging');
    setTimeout(function () { if (drag === d) drag = null; }, 0);
  });
  if ('fit' in opts) bodies.forEach(function (b) { if (b.rendered) b.fit(); });
  if (opts.find) {
    search.value = opts.find;
    runSearch();
    $('results').style.display = 'none';
    var exact = null;
    bodies.some(function (b) {
      if (b.byName[opts.find] !== undefined) exact = [b, b.byName[opts.find]];
      return exact;
    });
    matchPos = -1;
    matchList.forEach(function (m, q) {
      if (exact && m[0] === exact[0] && m[1] === exact[1]) matchPos = q - 1;
    });
    nextMatch(1);
  }
  drawn = 0; open = 0;
  bodies.forEach(function (b) { if (b.rendered) { drawn += b.drawn; open++; } });
  var status = $('status');
  status.textContent = 'Rendered ' + drawn + ' nodes (of ' + totalItems + ') in ' + open +
    ' of ' + bodies.length + ' panels in ' + (Date.now() - t0) + ' ms' +
    (drawn < totalItems ? '; the rest are inside collapsed name scopes or folded panels.' : '.');
  status.setAttribute('data-state', 'ok');
  status.setAttribute('data-drawn', String(drawn));
  status.setAttribute('data-total', String(totalItems));
}

try {
  main();
} catch (e) {
  fail(String(e && e.message || e));
  console.error('tfamp report error: ' + (e && e.stack || e));
}
})();
</script>
</body>
</html>
"""
