"""The mixed-precision pass: ``rewrite_graph_def(graph_def, config) -> (GraphDef, report)``."""

from __future__ import annotations

import collections
import dataclasses
import gc
import logging
from collections.abc import Iterable, Mapping

from tensorflow.core.framework import graph_pb2

from tfamp.config import AmpConfig
from tfamp.rewrite import reasons as rk
from tfamp.rewrite import runtime_cost
from tfamp.rewrite.casts import insert_casts
from tfamp.rewrite.check import GraphCheckError, Problem, find_problems
from tfamp.rewrite.coloring import color
from tfamp.rewrite.contract import contract_weight_gradients
from tfamp.rewrite.fuse_norm import fuse_batch_norms
from tfamp.rewrite.graph import FLOAT_TYPES, Body, TensorRef, build_view
from tfamp.rewrite.hoist import hoist_broadcasts
from tfamp.rewrite.report import NodeReport, RewriteReport
from tfamp.rewrite.shapes import Bytes, TensorShapes, tensor_shapes
from tfamp.rewrite.traffic import (
    body_weights,
    dead_nodes,
    estimate_traffic,
    estimate_traffic_before_after,
)
from tfamp.rewrite.verdict import TYPICAL_SIZE

log = logging.getLogger("tfamp")

# How many times the self-check may keep more nodes float32 and colour again
# before it gives up. Each round only adds nodes, so this bounds the work; one
# round has been enough for every defect seen so far.
_MAX_REPAIR_ROUNDS = 4


def rewrite_graph_def(
    graph_def: graph_pb2.GraphDef,
    config: AmpConfig | None = None,
    *,
    outputs: Iterable[str] | None = None,
    function_name: str = "",
    jit_compile: bool | None = None,
    input_magnitudes: Mapping[str, float] | None = None,
) -> tuple[graph_pb2.GraphDef, RewriteReport]:
    """Rewrites a graph and its function library to mixed precision.

    Pure: `graph_def` is never modified; the result is a new GraphDef.

    Args:
      graph_def: the graph, with the library functions it calls.
      config: what to do; ``AmpConfig()`` (float16, default lists) if None.
      outputs: tensor names ("node:0") of the top graph whose dtype callers
        rely on. None means every float tensor that nothing in the graph
        consumes.
      function_name: a name for the report (e.g. the tf.function's name).
      jit_compile: whether XLA compiles the graph (a tf.function's
        ``jit_compile``), if the caller knows; with ``config.runtime="auto"``
        it decides what a Cast costs (``runtime_cost``). None: the executor.
      input_magnitudes: top-graph Placeholder name -> the largest finite
        magnitude of the value it is fed, where the caller knows it (a
        tf.function's captured constants: TensorFlow captures an eager tensor
        of more than 128 elements as a placeholder, not a Const). Such a value
        past the 16-bit range (a precomputed attention bias of -1e9) is held
        as a constant's would be (``value_ranges.sentinels``).

    Tensor shapes are read from ``_output_shapes`` attributes (write them with
    ``graph.as_graph_def(add_shapes=True)``); where nodes lack them, TensorFlow's
    own shape inference supplies them (``shape_inference``: it imports the
    graph, which costs time on large graphs). With shapes, open choices go to
    the option that moves fewer bytes and the report carries the estimated
    float memory traffic per step before and after; where sizes stay unknown
    (a graph TensorFlow cannot import, unknown rank), choices go by Cast count
    and the traffic is None.

    Returns:
      (the rewritten GraphDef, a RewriteReport).

    Raises:
      GraphCheckError: the pass checks every graph it returns (edge dtypes,
        call signatures, TF1 loop shape; see ``check.find_problems``). Where a
        problem appears, the converted nodes involved are kept float32 (reason
        kind "would make an invalid graph") and the graph is coloured again;
        this error names the nodes if that does not help.

    Example:
      >>> import tensorflow as tf, tfamp
      >>> f = tf.function(lambda x: tf.matmul(x, x))
      >>> gd = f.get_concrete_function(tf.TensorSpec([2, 2])).graph.as_graph_def()
      >>> new_gd, report = tfamp.rewrite_graph_def(gd)
      >>> report.converted
      {'MatMul': 1}
    """
    if not isinstance(graph_def, graph_pb2.GraphDef):
        raise TypeError(
            f"rewrite_graph_def expects a tf.compat.v1.GraphDef, received "
            f"{type(graph_def).__name__}; for a tf.function use "
            f"fn.get_concrete_function(...).graph.as_graph_def().")
    input_magnitudes = _checked_magnitudes(input_magnitudes)
    config = config or AmpConfig()
    # The pass allocates many small objects and frees none until it returns; a
    # cyclic-GC sweep of the whole process in between costs more than the pass
    # itself (measured: 0.80 s -> 0.43 s for a ResNet-50 training step).
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _rewrite(graph_def, config, outputs, function_name,
                        runtime_cost.resolve_runtime(config.runtime, jit_compile),
                        input_magnitudes)
    finally:
        if gc_was_enabled:
            gc.enable()


def _checked_magnitudes(given) -> dict[str, float]:
    """`input_magnitudes` as {placeholder name: float}, or a clear error."""
    if given is None:
        return {}
    if not isinstance(given, Mapping):
        raise TypeError(f"input_magnitudes expects a mapping of placeholder names to "
                        f"numbers, received {type(given).__name__}; pass e.g. "
                        f"{{'bias': 1e9}}, or None")
    checked = {}
    for name, value in given.items():
        try:
            checked[str(name)] = abs(float(value))
        except (TypeError, ValueError):
            raise TypeError(f"input_magnitudes[{name!r}] expects a number (the largest "
                            f"magnitude that placeholder is fed), received "
                            f"{type(value).__name__} {value!r}") from None
    return checked


def _rewrite(graph_def, config, outputs, function_name, runtime, input_magnitudes):
    view = build_view(graph_def)
    _refuse_repeated_names(graph_def, view)
    if outputs is None:
        outputs = _unconsumed_float_outputs(view.bodies[0])
    shapes = tensor_shapes(graph_def, view)
    original = (view, shapes)
    nodes_before = view.node_count()
    # Exact edits first (a batch normalisation is one fused op, its statistics
    # only under XLA; per-example weight-gradient products summed are one MatMul; a
    # scaling of a broadcast runs on the small tensor): the colouring then
    # decides on the graph that will run.
    fused = fuse_batch_norms(graph_def, view, shapes, outputs, runtime)
    if fused is not None:
        graph_def = fused.graph_def
        view = build_view(graph_def, earlier=view, written=fused.written)
        shapes = fused.shapes
    contracted = contract_weight_gradients(graph_def, view, shapes, outputs)
    if contracted is not None:
        graph_def = contracted.graph_def
        view = build_view(graph_def, earlier=view, written=contracted.written)
        shapes = contracted.shapes
    reordered = [edit for edit in (fused, contracted) if edit is not None]
    hoisted = hoist_broadcasts(graph_def, view, shapes, outputs)
    if hoisted is not None:
        graph_def = hoisted.graph_def
        view = build_view(graph_def, earlier=view, written=hoisted.written)
        shapes = hoisted.shapes
    # (function, node) -> (reason, kind): an edit's own float32 nodes, then
    # what the self-check finds would make an invalid graph
    keep: dict[tuple[str, str], tuple[str, str]] = dict(fused.float32) if fused else {}
    known: set[str] | None = None  # the input's own problems, found lazily
    for round_ in range(_MAX_REPAIR_ROUNDS + 1):
        coloring = color(view, config, outputs, keep, shapes, runtime, input_magnitudes)
        new_graph_def, casts, written = insert_casts(graph_def, view, coloring)
        # The result is read again from the NodeDefs the Cast insertion wrote,
        # trusting nothing the colouring believes: ports and edges come from
        # those protos (every other NodeDef is the input's, copied: see
        # insert_casts; tests compare the record with the protos). The check
        # looks only at those NodeDefs and their neighbours: elsewhere it could
        # only find the input's own problems, which are ignored below (see
        # check._touched).
        new_view = build_view(new_graph_def, earlier=view, written=written)
        problems = find_problems(new_view)
        if problems and known is None:
            known = {p.message for p in find_problems(view)}
        problems = [p for p in problems if p.message not in (known or ())]
        if not problems:
            break
        added = _nodes_to_keep(problems, coloring, keep)
        if not added or round_ == _MAX_REPAIR_ROUNDS:
            raise _unrepairable(problems)
        log.info("tfamp: keeping %d node(s) float32 so the graph stays valid: %s",
                 len(added), ", ".join(repr(node) for _, node in list(added)[:5]))
        keep.update(added)
    traffic = _traffic_fields(view, shapes, coloring, new_graph_def, new_view, outputs,
                              (hoisted, bool(reordered), *original)
                              if hoisted is not None or reordered else None)
    traffic["runtime"] = runtime
    # Copies of functions whose callers disagree (boundaries.py) are reported
    # under their new names, after the original bodies.
    bodies = {body.name: body for body in view.bodies}
    reported = [(body.name, body) for body in view.bodies] + [
        (clone, bodies[original]) for clone, original in sorted(coloring.clones.items())]
    decisions = coloring.decisions
    report_of = NodeReport.of_fields
    nodes = []
    for function, body in reported:
        for name, node in body.nodes.items():
            d = decisions[(function, name)]
            nodes.append(report_of(name, function, node.op, d.list, d.converted,
                                   d.reason, d.cause, d.kind))
    report = RewriteReport(
        function=function_name, dtype=config.dtype,
        nodes_before=nodes_before,
        nodes_after=len(nodes) + len(casts),
        nodes=nodes, casts=casts, **traffic,
        broadcast_edits=[edit for made in (*reordered, hoisted) if made is not None
                         for edit in made.edits()])
    if log.isEnabledFor(logging.DEBUG):  # (walks every node)
        # What the INFO summary line does not say (callers log that line).
        kept = ", ".join(f"{kind} x{n}" for kind, n in report.kept_fp32.items()) or "none"
        converted = ", ".join(f"{op} x{n}" for op, n in report.converted.items()) or "none"
        log.debug("tfamp: %s: every op converted: %s; kept float32 by reason: %s; "
                  "estimated float traffic: %s", function_name or "graph", converted, kept,
                  report.traffic_line())
    return new_graph_def, report


def _refuse_repeated_names(graph_def, view) -> None:
    """Raises ValueError if a body has two nodes of one name (the view keeps one)."""
    node_lists = {"": graph_def.node} | {
        f.signature.name: f.node_def for f in graph_def.library.function}
    for body in view.bodies:
        node_defs = node_lists[body.name]
        if len(body.nodes) == len(node_defs):
            continue
        repeated = [name for name, n in collections.Counter(
            n.name for n in node_defs).items() if n > 1]
        where = f"function {body.name!r}" if body.name else "the top graph"
        raise ValueError(
            f"rewrite_graph_def expects node names unique within a graph or function, "
            f"but {where} has more than one node named "
            f"{', '.join(repr(n) for n in repeated[:5])}; TensorFlow cannot import such a "
            f"graph either. Rename or remove the repeated nodes and rewrite again.")


def _nodes_to_keep(problems: list[Problem], coloring, keep: dict[tuple[str, str], tuple[str, str]]
                   ) -> dict[tuple[str, str], tuple[str, str]]:
    """The converted nodes each problem involves, with why they must stay float32."""
    added: dict[tuple[str, str], tuple[str, str]] = {}
    for problem in problems:
        for key in problem.nodes:
            decision = coloring.decisions.get(key)
            if decision is None or not decision.converted or key in keep or key in added:
                continue
            added[key] = (f"kept float32: would make an invalid graph ({problem.message})",
                          rk.KIND_INVALID_GRAPH)
    return added


def _unrepairable(problems: list[Problem]) -> GraphCheckError:
    shown = "\n  ".join(p.message for p in problems[:10])
    nodes = sorted({node for p in problems for _, node in p.nodes})
    hint = (f" Keep them float32 with AmpConfig(keep_fp32=[...]) naming "
            f"{', '.join(repr(n) for n in nodes[:5])}, and please report this graph."
            if nodes else " Please report this graph.")
    return GraphCheckError(
        f"tfamp could not make a valid mixed-precision graph: keeping the nodes "
        f"involved float32 did not remove {len(problems)} problem(s):\n  {shown}\n"
        f"{hint.strip()}")


def _traffic_fields(view, shapes, coloring, new_graph_def, new_view, outputs,
                    original=None) -> dict:
    """traffic_before_bytes, traffic_after_bytes, cast_bytes and a note on what is unknown.

    `outputs`: the top graph's fetched tensors (what runs: ``dead_nodes``).
    `original`: (Hoisted or None, whether an edit changed kernels (fused,
    contracted), view, shapes of the graph as given) where the pass edited it
    before colouring: "before" is always the caller's graph."""
    if not shapes.any_known():
        return dict(traffic_note="no shapes")
    weights = body_weights(view, shapes=shapes)
    converted = {(function, node): attrs
                 for function, nodes in coloring.converted_by_body.items()
                 for node, attrs in nodes.items()}
    dead = dead_nodes(view.bodies[0], outputs)
    before, after = estimate_traffic_before_after(
        view, shapes, weights, converted, coloring.target, dead=dead)
    if original is not None:
        before = _before_the_edits(before, weights, outputs, dead, *original)
    if coloring.signatures or coloring.clones:
        # Boundary groups changed signatures or copied functions, which the
        # estimate from decisions does not model: measure the graph written.
        known = TensorShapes({**shapes.shapes, **{
            clone: shapes.shapes.get(original, {})
            for clone, original in coloring.clones.items()}})
        new_shapes = tensor_shapes(new_graph_def, new_view, fallback=known)
        after = estimate_traffic(new_view, new_shapes,
                                 body_weights(new_view, shapes=new_shapes), outputs=outputs)
    notes = []
    if (_grows(before) or _grows(after)) and _inputs_static(view, shapes):
        # Every argument has a static shape: an unknown dimension left is a size
        # computed from values (a sparse update's unique rows, a boolean mask's
        # count), bounded by the inputs, not a dimension that grows with them.
        # "For large sizes" would let those few tensors decide (an Embedding's
        # Adam update in float32 made BERT's step "100% of float32's").
        before, after = _fixed_part(before), _fixed_part(after)
        notes.append("float tensors of data-dependent size left out")
    if after.total is None:
        notes.append(f"shapes unknown for {after.unknown_tensors} of "
                     f"{after.unknown_tensors + after.known_tensors} float tensors")
    elif after.total_bytes() is None:
        notes.append("unknown dimensions")
    elif after.unknown_tensors:
        notes.append(f"{after.unknown_tensors} float tensors of unknown shape left out")
    if weights.not_static:
        notes.append(f"{len(weights.not_static)} loops without a static trip count "
                     f"counted once")
    return dict(traffic_before_bytes=before.total_bytes(),
                traffic_after_bytes=after.total_bytes(),
                cast_bytes=after.cast_bytes(), traffic_note="; ".join(notes),
                traffic_share=_share(before.total, after.total),
                traffic_share_typical=_share_at(before.total, after.total, TYPICAL_SIZE),
                runtime_estimates=_runtime_estimates(before, after))


def _inputs_static(view, shapes) -> bool:
    """Does every argument (Placeholder) of the top graph have a fully known shape?"""
    top = view.bodies[0]
    known = shapes.shapes.get(top.name, {})
    for name, node in top.nodes.items():
        if node.op == "Placeholder":
            shape = known.get(TensorRef(name, 0))
            if shape is None or any(d < 0 for d in shape):
                return False
    return True


def _grows(traffic) -> bool:
    return any(b is not None and any(d for d, _ in b.terms)
               for b in (traffic.total, traffic.cast, traffic.fused))


def _fixed_part(traffic):
    """`traffic` with only the terms that do not depend on an unknown dimension."""
    def fixed(b):
        return None if b is None else Bytes(tuple((d, c) for d, c in b.terms if d == 0))

    return dataclasses.replace(traffic, total=fixed(traffic.total), cast=fixed(traffic.cast),
                               fused=fixed(traffic.fused))


def _before_the_edits(before, weights, outputs, dead, hoisted, reordered, first_view,
                      first_shapes):
    """The traffic of the graph as given, from that of the edited graph (`dead`:
    its nodes that never run; an edited node keeps its name)."""
    # A fused batch norm or a contraction (`reordered`) changes kernels and what
    # the fused model materialises, and an edit of a node that never runs
    # changes nothing: measure the graph as given (only where one was made).
    delta = (None if reordered or hoisted is None
             or hoisted.touches(dead)
             else hoisted.traffic_delta(first_shapes))
    if delta is None or before.total is None:  # (sizes unknown: measure it)
        return estimate_traffic(first_view, first_shapes,
                                body_weights(first_view, shapes=first_shapes), outputs=outputs)
    total, kernels, tensors = before.total, before.kernels, before.known_tensors
    for body, (sums, removed) in delta.items():
        weight = weights.weights.get(body, 0)
        total = total + Bytes.of_sums({d: c * weight for d, c in sums.items()})
        kernels += removed * weight
        tensors += removed
    return dataclasses.replace(before, total=total, kernels=kernels, known_tensors=tensors)


def _runtime_estimates(before, after) -> dict[str, dict]:
    """Per runtime: bytes, kernels and their cost (bytes + launches) before and
    after, and the share after / before (see report.RewriteReport)."""
    estimates = {}
    for model in (runtime_cost.EXECUTOR, runtime_cost.XLA):
        fused = model is runtime_cost.XLA
        totals = [t.fused if fused else t.total for t in (before, after)]
        kernels = [t.fused_kernels if fused else t.kernels for t in (before, after)]
        costs = [None if total is None else total + Bytes.of_sums({0: model.launch_bytes * k})
                 for total, k in zip(totals, kernels, strict=True)]
        estimates[model.name] = {
            "bytes_before": None if totals[0] is None else totals[0].known(),
            "bytes_after": None if totals[1] is None else totals[1].known(),
            "kernels_before": kernels[0], "kernels_after": kernels[1],
            "launch_bytes": model.launch_bytes,
            "cost_before": None if costs[0] is None else costs[0].known(),
            "cost_after": None if costs[1] is None else costs[1].known(),
            "share": _share(costs[0], costs[1]),
            "share_typical": _share_at(costs[0], costs[1], TYPICAL_SIZE),
        }
    return estimates


def _share(before, after) -> float | None:
    """after / before; for sizes that grow with unknown dimensions, as they grow."""
    if before is None or after is None or not before.terms:
        return None
    degree, base = before.terms[0]  # highest degree first
    if base <= 0:
        return None
    top = dict(after.terms)
    if any(d > degree for d in top):
        return None  # (cannot happen: the rewrite changes dtypes, not shapes)
    return top.get(degree, 0) / base


def _share_at(before, after, size: int) -> float | None:
    """after / before with every unknown dimension at `size`; None where no
    term depends on one (the share is then exact) or where a figure is unknown."""
    if before is None or after is None or not any(d for d, _ in before.terms):
        return None
    base = before.at(size)
    return after.at(size) / base if base > 0 else None


def _unconsumed_float_outputs(body: Body) -> list[str]:
    names = []
    for name, node in body.nodes.items():
        for index, port in enumerate(node.outputs):
            if port.dtype in FLOAT_TYPES and TensorRef(name, index) not in body.consumers:
                names.append(f"{name}:{index}")
    return names
