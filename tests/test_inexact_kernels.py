"""Elu and Selu stay float32 where TensorFlow's own kernels run them.

TensorFlow's Elu and Selu kernels (one Eigen expression for CPU and GPU)
evaluate ``exp(x) - 1`` in the kernel's type: in float16 or bfloat16, exp(x)
just below 0 rounds to 1 and the result to 0. The program generator found it
(22000066: a SELU of small products, 7% off in float16). XLA lowers both ops
with expm1, exact to a rounding, so a body XLA compiles keeps them 16-bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from tests.graphs import decision, rewrite, run_graph_def
from tfamp.oplists import INEXACT_16BIT_KERNELS
from tfamp.rewrite import reasons as rk

# Inputs just below zero, where the 16-bit kernels cancel (and a few further out).
X = -np.concatenate([np.geomspace(1e-4, 1e-2, 12), [0.1, 0.5, 2.0, 5.0]]).astype(np.float32)
X = X.reshape(2, 8)
EYE = tf.constant(np.eye(8, dtype=np.float32))
ACTIVATIONS = {"Elu": tf.nn.elu, "Selu": tf.nn.selu}
UNIT_ROUNDOFF = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}


def _step(op: str, jit: bool):
    """matmul -> activation -> matmul: the activation sits between 16-bit ops."""
    activation = tf.function(ACTIVATIONS[op], jit_compile=True) if jit else ACTIVATIONS[op]
    return lambda x: tf.matmul(activation(tf.matmul(x, EYE)), EYE)


def _relative_error(graph_def, new_graph_def) -> float:
    (want,) = run_graph_def(graph_def, {"x": X}, ["Identity:0"])
    (got,) = run_graph_def(new_graph_def, {"x": X}, ["Identity:0"])
    return float(np.max(np.abs(got - want) / np.abs(want)))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("op", sorted(ACTIVATIONS))
def test_the_16bit_kernel_cancels_just_below_zero(op, dtype):
    """Why the rule exists: the kernel itself, on a value 16-bit holds well."""
    x = tf.cast(tf.constant(-1e-4 if dtype == "float16" else -1e-3), dtype)
    assert float(x) < 0 and float(ACTIVATIONS[op](tf.cast(x, tf.float32))) < 0
    assert float(ACTIVATIONS[op](x)) == 0.0
    assert op in INEXACT_16BIT_KERNELS


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("op", sorted(ACTIVATIONS))
def test_on_tensorflows_kernels_the_activation_stays_float32(op, dtype):
    graph_def, new_graph_def, report = rewrite(
        _step(op, jit=False), tf.TensorSpec(X.shape), dtype=dtype, device_type="CPU")
    node = decision(report, op)
    assert not node.converted and node.kind == rk.KIND_NO_KERNEL, node
    assert "exp(x) - 1" in node.reason and "jit_compile" in node.reason, node.reason
    assert report.converted.get("MatMul") == 2, report.converted  # its neighbours are 16-bit
    # Three roundings (two matmul outputs and the Cast into the activation) at most.
    assert _relative_error(graph_def, new_graph_def) < 4 * UNIT_ROUNDOFF[dtype]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("op", sorted(ACTIVATIONS))
def test_in_a_compiled_function_the_activation_is_16bit_and_exact(op, dtype):
    graph_def, new_graph_def, report = rewrite(
        _step(op, jit=True), tf.TensorSpec(X.shape), dtype=dtype, device_type="CPU")
    node = decision(report, op)
    assert node.converted, node
    assert _relative_error(graph_def, new_graph_def) < 4 * UNIT_ROUNDOFF[dtype]


def test_the_gradient_is_not_held_by_the_rule():
    """EluGrad / SeluGrad read the activation's output: no cancellation of their own
    beyond that output's rounding, so they keep their infer-list decisions."""
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.matmul(tf.nn.selu(tf.matmul(x, EYE)), EYE)
            loss = tf.reduce_sum(y * y)
        return tape.gradient(loss, x)

    _, _, report = rewrite(step, tf.TensorSpec(X.shape), dtype="float16", device_type="CPU")
    assert not decision(report, "Selu").converted
    grad = decision(report, "SeluGrad")
    assert grad.kind != rk.KIND_NO_KERNEL and "exp(x) - 1" not in grad.reason, grad
