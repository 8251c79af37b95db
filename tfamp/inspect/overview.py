"""What a rewrite changed, by Keras layer: the answer the HTML page opens on.

``overview(report, graph_def)`` condenses a RewriteReport into what a reader
asks first: the estimated traffic, the share of matrix FLOPs now 16-bit, which
op types were converted, why the rest stayed float32, and per Keras layer how
many of its float ops run 16-bit and what kept the others float32.

A node's layer is read from its name scope. Keras names a traced op
``<model>/<layer>/.../<op>`` and its gradient
``gradient_tape/<model>/<layer>/.../<op>/<gradient op>``; the optimizer's ops
sit under the optimizer's name. A leading scope holding two or more layers
with matrix or convolution ops is a model and is dropped, so the groups are
the layers (a backbone inside a task model too); a graph that is not Keras's
is grouped by its top-level scopes. Ops inside library functions (loop
bodies, a layer's own functions) are grouped by function. Variable reads and
the loss-scale machinery are float32 by design and not counted per layer.
"""

from __future__ import annotations

import collections
from typing import Any

from tfamp.inspect.names import short_function_names
from tfamp.rewrite.reasons import KIND_LOSS_SCALE, KIND_NO_FLOAT, KIND_VARIABLE
from tfamp.rewrite.report import RewriteReport
from tfamp.rewrite.scopes import forward_scope

# Float32 by design, not by a decision worth a reader's time: not counted per layer.
_NOT_COUNTED = frozenset({KIND_NO_FLOAT, KIND_VARIABLE, KIND_LOSS_SCALE})


def _scope_parts(name: str) -> list[str]:
    return name.split("/")[:-1]  # the last part is the op itself


def layer_of_names(nodes: list[tuple[str, str]]) -> dict[str, str]:
    """Node name -> the layer it belongs to ("" for top-level ops), for (name, op) pairs.

    A leading scope holding two or more sub-scopes with a matrix or convolution
    op is a model (Keras's model scope, a backbone inside a task model): it is
    dropped, repeatedly, so what remains first is the layer. An optimizer's
    scope holds no matrix op and stays one group.
    """
    from tfamp.oplists import MATRIX_OPS

    parts = {name: _scope_parts(forward_scope(name)[0]) for name, _ in nodes}
    ops = dict(nodes)
    while True:
        layers_with_math: dict[str, set[str]] = collections.defaultdict(set)
        for name, scope in parts.items():
            if len(scope) > 1 and ops[name] in MATRIX_OPS:
                layers_with_math[scope[0]].add(scope[1])
        models = {m for m, layers in layers_with_math.items() if len(layers) >= 2}
        nested = [name for name, scope in parts.items() if len(scope) > 1 and scope[0] in models]
        if not nested:
            break
        for name in nested:
            parts[name] = parts[name][1:]
    return {name: scope[0] if scope else "" for name, scope in parts.items()}


def overview(report: RewriteReport, graph_def=None, flops=None) -> dict[str, Any]:
    """The page's summary: traffic, FLOP share, op types, reasons, layers.

    Returns a JSON-ready dict: ``traffic`` (a line), ``flops`` (a line, or
    None when the graph is not given), ``converted`` ([op, count], most first),
    ``kept`` ([reason kind, count]), ``layers`` ([layer, 16-bit ops,
    float32 ops, {reason kind: count}, casts inserted], layers with float32
    float ops first, most first), ``layersAll16`` (how many layers run every
    float op in 16-bit).
    """
    float_nodes = [n for n in report.nodes if n.converted or (
        n.list != "unlisted" and n.kind not in _NOT_COUNTED)]
    layer_of = layer_of_names([(n.name, n.op) for n in float_nodes if not n.function]
                              + [(c.name, "Cast") for c in report.casts if not c.function])
    shown = short_function_names({n.function for n in report.nodes if n.function}
                                 | {c.function for c in report.casts if c.function})
    rows: dict[str, list] = {}

    def group(name: str, function: str, layers: dict[str, str]) -> str:
        if function:  # a library function's ops have no Keras scope of their own
            return f"(function {shown.get(function, function)})"
        return layers[name] or "(top level)"

    for node in float_nodes:
        key = group(node.name, node.function, layer_of)
        row = rows.setdefault(key, [0, 0, collections.Counter(), 0])
        if node.converted:
            row[0] += 1
        else:
            row[1] += 1
            row[2][node.kind] += 1
    for cast in report.casts:
        key = group(cast.name, cast.function, layer_of)
        rows.setdefault(key, [0, 0, collections.Counter(), 0])[3] += 1
    layers = [[name, n16, n32, dict(kinds.most_common()), casts]
              for name, (n16, n32, kinds, casts) in rows.items()]
    layers.sort(key=lambda r: (r[2] == 0, -r[2], -r[1], r[0]))
    return {
        "traffic": report.traffic_line(),
        "flops": _flops_line(report, graph_def, flops),
        "converted": list(map(list, report.converted.items())),
        "kept": list(map(list, report.kept_fp32.items())),
        "layers": layers,
        "layersAll16": sum(1 for r in layers if r[2] == 0 and r[1] > 0),
    }


def _flops_line(report: RewriteReport, graph_def, counted) -> str | None:
    from tfamp.inspect.flops import graph_def_flops, share_in_16bit

    if counted is None:
        if graph_def is None:
            return None
        counted = graph_def_flops(graph_def)
    flops, unknown, _ = counted
    share = share_in_16bit(flops, {(n.function, n.name) for n in report.nodes if n.converted})
    if share is None:
        return "no matrix or convolution op with known shapes"
    tail = f" ({unknown} matrix ops with unknown shapes not counted)" if unknown else ""
    return f"{100 * share:.1f}% of matrix/convolution FLOPs in {report.dtype}{tail}"
