"""Broadcasts wait (tfamp.rewrite.hoist): exact edits, made before colouring.

A scalar scaling of a broadcast (the Mean gradient's Tile then RealDiv by N,
the variance gradient's Mul by 2) moves before it; a broadcast read only by an
op that broadcasts is dropped. Both must give bit-identical values: the tests
run the float32 graph before and after the edits and compare exactly.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tfamp
from tests.graphs import run_graph_def
from tfamp.rewrite.graph import build_view
from tfamp.rewrite.hoist import hoist_broadcasts
from tfamp.rewrite.shapes import tensor_shapes
from tfamp.rewrite.traffic import body_weights, estimate_traffic

RNG = np.random.default_rng(3)
X = RNG.standard_normal((4, 5, 5, 6)).astype(np.float32) * 3 + 1
G = RNG.standard_normal((4, 5, 5, 6)).astype(np.float32)


def _moments_gradient(x, g):
    """d/dx of sum(g * batch-normalised x), normalised as tf.nn.moments does it
    (Keras 3's BatchNormalization): Mean gradients (Tile, RealDiv by N) and the
    SquaredDifference gradient (Mul by 2 under a control dependency)."""
    with tf.GradientTape() as tape:
        tape.watch(x)
        mean, variance = tf.nn.moments(x, axes=[0, 1, 2], keepdims=True)
        y = (x - mean) * tf.math.rsqrt(variance + 1e-3)
        loss = tf.reduce_sum(y * g)
    return tf.identity(tape.gradient(loss, x), name="dx")


def _traced(fn, *specs):
    concrete = tf.function(fn, autograph=False).get_concrete_function(*specs)
    return concrete.graph.as_graph_def(add_shapes=True), [t.name for t in concrete.graph.outputs]


def _hoist(graph_def, outputs):
    view = build_view(graph_def)
    return hoist_broadcasts(graph_def, view, tensor_shapes(graph_def, view), outputs)


SPEC = tf.TensorSpec(X.shape)


def test_mean_gradient_scalings_move_and_values_are_bit_identical():
    graph_def, outputs = _traced(_moments_gradient, SPEC, SPEC)
    hoisted = _hoist(graph_def, outputs)
    assert hoisted is not None
    moved = {(op, graph_def_op) for _, _, op, graph_def_op in hoisted.moves}
    assert {op for op, _ in moved} >= {"RealDiv", "Mul"}, hoisted.moves  # the chain moved
    assert tfamp.check_graph_def(hoisted.graph_def) == []
    nodes = {n.name: n for n in hoisted.graph_def.node}
    for _, scaling, _, broadcast in hoisted.moves:
        # the broadcast's node now scales the small tensor; the scaling's node broadcasts
        small = nodes[broadcast].attr["_output_shapes"].list.shape[0]
        assert [d.size for d in small.dim] == [1, 1, 1, 6], broadcast
    feeds = {"x": X, "g": G}
    (want,) = run_graph_def(graph_def, feeds, ["dx:0"])
    (got,) = run_graph_def(hoisted.graph_def, feeds, ["dx:0"])
    assert np.array_equal(got, want)
    # The view patched from the edits knows the same control edges as one
    # read afresh (the constant that waited on a moved node waits elsewhere).
    patched = build_view(hoisted.graph_def, earlier=build_view(graph_def),
                         written=hoisted.written).bodies[0]
    fresh = build_view(hoisted.graph_def).bodies[0]
    assert patched.edited and {k: sorted(v) for k, v in patched.waiters().items()} == {
        k: sorted(v) for k, v in fresh.waiters().items()}
    assert build_view(graph_def).bodies[0].waiters() != fresh.waiters()


def test_inside_a_library_function_readers_are_renamed():
    """In a FunctionDef a reader names an output argument ("node:z:0"); the
    moved nodes change op, so their readers and results are renamed."""
    inner = tf.function(_moments_gradient, autograph=False)

    def outer(x, g):
        return tf.identity(inner(x, g) * 2.0, name="out")

    graph_def, outputs = _traced(outer, SPEC, SPEC)
    hoisted = _hoist(graph_def, outputs)
    assert hoisted is not None and {body for body, *_ in hoisted.moves} != {""}
    assert tfamp.check_graph_def(hoisted.graph_def) == []
    feeds = {"x": X, "g": G}
    (want,) = run_graph_def(graph_def, feeds, ["out:0"])
    (got,) = run_graph_def(hoisted.graph_def, feeds, ["out:0"])
    assert np.array_equal(got, want)


def test_a_broadcast_read_by_a_broadcasting_op_is_dropped():
    graph_def, outputs = _traced(_tile_then_multiply, SPEC, SPEC)
    hoisted = _hoist(graph_def, outputs)
    assert [(d[1], d[2], d[3]) for d in hoisted.dropped] == [("spread", "Tile", "product")]
    assert "spread" not in {n.name for n in hoisted.graph_def.node}
    assert tfamp.check_graph_def(hoisted.graph_def) == []
    feeds = {"x": X, "g": G}
    (want,) = run_graph_def(graph_def, feeds, ["out:0"])
    (got,) = run_graph_def(hoisted.graph_def, feeds, ["out:0"])
    assert np.array_equal(got, want)


@pytest.mark.parametrize("case", ["fetched", "two_readers", "tensor_divisor", "runtime_divisor",
                                  "repeats_along_a_dim"])
def test_what_does_not_move(case):
    """The broadcast is an output, feeds two ops, is divided by a non-scalar or
    a run-time value, or (for the drop) really repeats its values along a
    dimension of size > 1 that a broadcasting op would not repeat."""
    def fn(x, n):
        row = tf.reduce_sum(x, axis=0, keepdims=True)
        if case == "repeats_along_a_dim":
            half = tf.reduce_sum(x, axis=[0, 1], keepdims=True)[..., :3]  # [1, 1, 5, 3]
            spread = tf.tile(tf.tile(half, [1, 1, 1, 2], name="pairs"), [4, 5, 1, 1],
                             name="spread")
            return tf.identity(tf.multiply(spread, x, name="product"), name="out")
        spread = tf.tile(row, [4, 1, 1, 1], name="spread")
        divisor = {"tensor_divisor": tf.fill([6], 4.0), "runtime_divisor": n}.get(case, 4.0)
        scaled = tf.math.divide(spread, divisor, name="scaled")
        if case == "two_readers":
            scaled = scaled + tf.reduce_max(spread)
        out = tf.identity(tf.reduce_max(scaled, axis=0) + 1.0, name="out")
        return (out, spread) if case == "fetched" else out

    graph_def, outputs = _traced(fn, SPEC, tf.TensorSpec([]))
    hoisted = _hoist(graph_def, outputs)
    if case == "repeats_along_a_dim":
        # "pairs" doubles the last dimension: only the outer Tile ("spread",
        # whose input has 1s where it repeats) may be left to the Mul.
        assert hoisted is not None and [d[1] for d in hoisted.dropped] == ["spread"]
        return
    assert hoisted is None or not any(m[1] == "scaled" for m in hoisted.moves)


def _tile_then_multiply(x, g):
    spread = tf.tile(tf.reduce_mean(x, axis=0, keepdims=True), [4, 1, 1, 1], name="spread")
    return tf.identity(tf.multiply(spread, g, name="product") + 1.0, name="out")


@pytest.mark.parametrize("fn", [_moments_gradient, _tile_then_multiply])
def test_report_counts_traffic_from_the_graph_as_given(fn):
    """'before' in the report (bytes, executor kernels, the fused figures) is
    the caller's float32 graph, not the edited one: the pass derives it from
    the edited graph's, which must agree with measuring the graph as given."""
    graph_def, outputs = _traced(fn, SPEC, SPEC)
    view = build_view(graph_def)
    shapes = tensor_shapes(graph_def, view)
    original = estimate_traffic(view, shapes, body_weights(view, shapes=shapes),
                                outputs=outputs)
    _, report = tfamp.rewrite_graph_def(graph_def, tfamp.AmpConfig(device_type="GPU"),
                                        outputs=outputs)
    assert report.broadcast_edits
    assert report.traffic_before_bytes == original.total_bytes()
    executor, xla = report.runtime_estimates["executor"], report.runtime_estimates["xla"]
    assert executor["bytes_before"] == original.total_bytes()
    assert executor["kernels_before"] == original.kernels
    assert (xla["bytes_before"], xla["kernels_before"]) == (original.fused_bytes(),
                                                            original.fused_kernels)
    assert report.nodes_before == view.node_count()
    roundtrip = tfamp.RewriteReport.from_dict(report.to_dict())
    assert roundtrip.broadcast_edits == report.broadcast_edits


def test_inspect_says_what_the_edits_did():
    from tfamp.cli import render_summary

    graph_def, outputs = _traced(_moments_gradient, SPEC, SPEC)
    _, report = tfamp.rewrite_graph_def(graph_def, tfamp.AmpConfig(device_type="GPU"),
                                        outputs=outputs)
    moved = [e for e in report.broadcast_edits if e["edit"] == "moved"]
    line = next(l for l in render_summary(report).splitlines() if "exact edits first" in l)
    assert f"{len(moved)} scalings (" in line and "moved before their broadcasts" in line
    assert line.endswith("(values unchanged)")
    assert tfamp.RewriteReport.from_dict(report.to_dict()).edits_line() == report.edits_line()
