"""An op in a function XLA compiles needs an XLA kernel for its type.

MaxPoolGradGrad has float16 and bfloat16 CPU and GPU kernels, but its XLA
kernel takes float32 only: made 16-bit inside a ``jit_compile=True`` function,
tf2xla refuses the function (generated program 12000569).
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import types_pb2

import tfamp
from tests.graphs import rewrite, run_graph_def
from tfamp.rewrite import compiled, kernels
from tfamp.rewrite import reasons as rk
from tfamp.rewrite.graph import build_view

FILTER = tf.constant(np.linspace(-1, 1, 8, dtype=np.float32).reshape(1, 1, 2, 4))
X = tf.TensorSpec([2, 4, 4, 2])


def _pool_grad_grad(x):
    """The input gradient of an input gradient through a max pool (MaxPoolGradGrad)."""
    with tf.GradientTape() as outer:
        outer.watch(x)
        with tf.GradientTape() as inner:
            inner.watch(x)
            y = tf.nn.max_pool2d(tf.nn.relu(tf.nn.conv2d(x, FILTER, 1, "SAME")), 2, 1, "SAME")
            s = tf.reduce_sum(tf.square(y))
        g = inner.gradient(s, x)
        t = tf.reduce_sum(g * g)
    return outer.gradient(t, x)


def _step(jit: bool):
    inner = tf.function(_pool_grad_grad, jit_compile=jit)
    return lambda x: inner(x) * 2.0


@pytest.mark.parametrize("dtype", [types_pb2.DT_HALF, types_pb2.DT_BFLOAT16])
def test_the_xla_kernel_is_asked_only_for_a_compiled_body(dtype):
    assert kernels.missing_kernel("MaxPoolGradGrad", "T", dtype, "CPU") == ""
    assert kernels.missing_kernel("MaxPoolGradGrad", "T", dtype, "CPU",
                                  compiled=True) == "XLA_CPU_JIT"
    assert kernels.missing_kernel("MaxPoolGradGrad", "T", dtype, "GPU",
                                  compiled=True) == "XLA_GPU_JIT"
    assert kernels.missing_kernel("MatMul", "T", dtype, "GPU", compiled=True) == ""


def test_the_compiled_bodies_are_the_jit_function_and_all_it_calls():
    graph_def = tf.function(_step(jit=True)).get_concrete_function(X).graph.as_graph_def()
    view = build_view(graph_def)
    found = compiled.xla_compiled(view, "executor")
    functions = {body.name for body in view.bodies if body.is_function}
    # The call site, the function and its gradient functions are marked; the
    # step around them is not.
    assert "" not in found
    assert found and found <= functions
    assert any("pool_grad_grad" in name for name in found), found
    assert compiled.xla_compiled(view, "xla") == functions | {""}
    not_compiled = tf.function(_step(jit=False)).get_concrete_function(X).graph.as_graph_def()
    assert compiled.xla_compiled(build_view(not_compiled), "executor") == frozenset()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_compiled_max_pool_grad_grad_stays_float32_and_runs(dtype):
    graph_def, new_graph_def, report = rewrite(_step(jit=True), X, dtype=dtype,
                                               device_type="CPU")
    grad_grads = [n for n in report.nodes if n.op == "MaxPoolGradGrad"]
    assert grad_grads and not any(n.converted for n in grad_grads), grad_grads
    for node in grad_grads:
        assert node.kind == rk.KIND_NO_KERNEL, node
        assert "XLA_CPU_JIT" in node.reason and "XLA compiles" in node.reason, node.reason
    assert report.converted.get("Conv2D"), report.converted  # the rest still is 16-bit
    x = np.random.default_rng(0).normal(size=X.shape).astype(np.float32)
    (got,) = run_graph_def(new_graph_def, {"x": x}, ["Identity:0"])
    (want,) = run_graph_def(graph_def, {"x": x}, ["Identity:0"])
    assert np.abs(want).max() > 1  # (the executor's kernels give zeros here; XLA's do not)
    np.testing.assert_allclose(got, want, rtol=0.05, atol=0.02 * np.abs(want).max())


def test_without_jit_the_max_pool_grad_grad_is_16bit():
    """The XLA check is what keeps it float32 above, not something else."""
    _, _, report = rewrite(_step(jit=False), X, dtype="float16", device_type="CPU")
    grad_grads = [n for n in report.nodes if n.op == "MaxPoolGradGrad"]
    assert grad_grads and all(n.converted for n in grad_grads), grad_grads


def test_the_report_says_so_for_a_whole_jit_step():
    """runtime "xla" (Keras 3's jit_compile step): every body is compiled."""
    graph_def = tf.function(_pool_grad_grad).get_concrete_function(X).graph.as_graph_def()
    _, report = tfamp.rewrite_graph_def(
        graph_def, tfamp.AmpConfig(device_type="GPU", runtime="xla"))
    grad_grad = next(n for n in report.nodes if n.op == "MaxPoolGradGrad")
    assert not grad_grad.converted and "XLA_GPU_JIT" in grad_grad.reason, grad_grad
