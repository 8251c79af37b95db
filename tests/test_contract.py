"""Per-example weight-gradient products summed over the batch are one MatMul
(tfamp.rewrite.contract): an edit made before colouring.

A dense layer on a 3-D input (Keras 3's EinsumDense) is a BatchMatMulV2 that
broadcasts the kernel; TensorFlow's gradient for the kernel is one product per
example, then a Sum over the batch. The edit computes the same sum as one
MatMul of the flattened operands: equal to float32 rounding (another order),
and never writing the [batch, d, f] tensor.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

import tfamp
from tests.graphs import run_graph_def
from tfamp.rewrite.contract import contract_weight_gradients
from tfamp.rewrite.graph import build_view
from tfamp.rewrite.shapes import tensor_shapes
from tfamp.rewrite.traffic import body_weights, estimate_traffic

RNG = np.random.default_rng(5)
BATCH, SEQ, WIDTH, UNITS = 4, 6, 8, 5
VALUES = {"x": RNG.standard_normal((BATCH, SEQ, WIDTH)).astype(np.float32),
          "kernel": RNG.standard_normal((WIDTH, UNITS)).astype(np.float32) / 3,
          "kernel2": RNG.standard_normal((UNITS, 3)).astype(np.float32) / 3}
SPECS = [tf.TensorSpec(v.shape) for v in VALUES.values()]


def _step(x, kernel, kernel2):
    """Two dense layers on a 3-D input; gradients for both kernels and x."""
    with tf.GradientTape() as tape:
        tape.watch([x, kernel, kernel2])
        h = tf.nn.relu(tf.matmul(x, kernel, name="dense1"))
        y = tf.matmul(h, kernel2, name="dense2")
        loss = tf.reduce_mean(tf.square(y))
    dx, dk, dk2 = tape.gradient(loss, [x, kernel, kernel2])
    return (tf.identity(loss, name="loss"), tf.identity(dx, name="dx"),
            tf.identity(dk, name="dk"), tf.identity(dk2, name="dk2"))


def _traced(fn, specs):
    concrete = tf.function(fn, autograph=False).get_concrete_function(*specs)
    return concrete.graph.as_graph_def(add_shapes=True), [t.name for t in concrete.graph.outputs]


def _contract(graph_def, outputs):
    view = build_view(graph_def)
    return contract_weight_gradients(graph_def, view, tensor_shapes(graph_def, view), outputs)


def test_kernel_gradients_become_one_matmul_with_the_same_values():
    graph_def, outputs = _traced(_step, SPECS)
    contracted = _contract(graph_def, outputs)
    assert contracted is not None and len(contracted.made) == 2
    assert tfamp.check_graph_def(contracted.graph_def) == []
    before = {n.name: n for n in graph_def.node}
    after = {n.name: n for n in contracted.graph_def.node}
    for _, total, product in contracted.made:
        assert (before[total].op, before[product].op) == ("Sum", "BatchMatMulV2")
        assert (after[total].op, after[product].op) == ("MatMul", "Reshape")
        assert after[total].attr["transpose_a"].b
    # No per-example kernel product (adj_x: x' g per example) is summed any more.
    assert not [n for n in contracted.graph_def.node if n.op == "Sum"
                and after[n.input[0].split(":")[0]].op == "BatchMatMulV2"
                and after[n.input[0].split(":")[0]].attr["adj_x"].b]
    want = run_graph_def(graph_def, VALUES, outputs)
    got = run_graph_def(contracted.graph_def, VALUES, outputs)
    for w, g in zip(want, got):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_what_is_not_a_sum_over_examples_stays():
    """A product read twice, a Sum that keeps its dims, a Sum over only some
    batch axes (4-D input), and one fetched product are left alone; the
    control, a plain sum over examples, is contracted."""
    def fn(x, kernel, kernel2):
        x4 = tf.reshape(x, [2, 2, SEQ, WIDTH])
        per_example = tf.matmul(x4, tf.ones([2, 2, SEQ, UNITS]), adjoint_a=True,
                                name="per_example")  # [2, 2, WIDTH, UNITS]
        partial = tf.reduce_sum(per_example, axis=0, name="partial")  # one batch axis
        kept = tf.reduce_sum(per_example, axis=[0, 1], keepdims=True, name="kept")
        twice = tf.matmul(x, tf.ones([BATCH, SEQ, UNITS]), adjoint_a=True, name="twice")
        summed = tf.reduce_sum(twice, axis=0, name="summed")
        fetched = tf.matmul(x, tf.ones([BATCH, SEQ, 3]), adjoint_a=True, name="fetched")
        control = tf.reduce_sum(tf.matmul(x, tf.ones([BATCH, SEQ, 2]), adjoint_a=True,
                                          name="control"), axis=0, name="control_sum")
        return (partial, kept, summed, tf.identity(twice, name="also"),
                tf.reduce_sum(fetched, axis=0, name="fetched_sum"), fetched, control)

    graph_def, outputs = _traced(fn, SPECS)
    contracted = _contract(graph_def, outputs)
    assert [c[1:] for c in contracted.made] == [("control_sum", "control")]


def test_the_rewrite_reports_it_and_counts_before_from_the_graph_as_given():
    graph_def, outputs = _traced(_step, SPECS)
    view = build_view(graph_def)
    shapes = tensor_shapes(graph_def, view)
    original = estimate_traffic(view, shapes, body_weights(view, shapes=shapes),
                                outputs=outputs)
    new_graph_def, report = tfamp.rewrite_graph_def(
        graph_def, tfamp.AmpConfig(device_type="GPU"), outputs=outputs)
    assert [e["edit"] for e in report.broadcast_edits].count("contracted") == 2
    assert report.traffic_before_bytes == original.total_bytes()
    assert report.traffic_after_bytes < report.traffic_before_bytes
    xla = report.runtime_estimates["xla"]
    assert (xla["bytes_before"], xla["kernels_before"]) == (original.fused_bytes(),
                                                            original.fused_kernels)
    assert "2 weight-gradient sums over examples computed as one MatMul each" in (
        report.edits_line())
    # The contraction is a 16-bit MatMul now, read by float32 where it must be.
    nodes = {n.name: n for n in new_graph_def.node}
    for edit in report.broadcast_edits:
        if edit["edit"] == "contracted":
            assert nodes[edit["node"]].attr["T"].type == tf.float16.as_datatype_enum
    want = run_graph_def(graph_def, VALUES, outputs)
    got = run_graph_def(new_graph_def, VALUES, outputs)
    for w, g in zip(want, got):
        np.testing.assert_allclose(g, w, rtol=2e-2, atol=2e-2 * np.abs(w).max())


def test_under_xla_every_product_is_contracted_as_on_the_executor():
    """Session 17 left the smallest product per-example under XLA, to keep XLA:GPU's
    layout of BERT's residual stream row-major (148 kernels fewer); that program measured
    7-9% slower on an H200 than the one with every product contracted (session 19), so
    both runtimes contract them all, and the report's rows and line say so."""
    graph_def, outputs = _traced(_step, SPECS)
    want = run_graph_def(graph_def, VALUES, outputs)
    for runtime in ("xla", "executor"):
        new_graph_def, report = tfamp.rewrite_graph_def(
            graph_def, tfamp.AmpConfig(device_type="GPU", runtime=runtime), outputs=outputs)
        contracted = [e for e in report.broadcast_edits if e["edit"] == "contracted"]
        assert len(contracted) == 2, runtime
        assert {e["edit"] for e in report.broadcast_edits} <= {"contracted", "moved", "dropped"}
        nodes = {n.name: n for n in new_graph_def.node}
        assert {nodes[e["node"]].op for e in contracted} == {"MatMul"}
        assert {nodes[e["into"]].op for e in contracted} == {"Reshape"}
        assert "per-example" not in report.edits_line()
        got = run_graph_def(new_graph_def, VALUES, outputs)
        for w, g in zip(want, got, strict=True):
            np.testing.assert_allclose(g, w, rtol=2e-2, atol=2e-2 * np.abs(w).max())
