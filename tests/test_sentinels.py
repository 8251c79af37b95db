"""An op that reads a constant past the 16-bit range stays float32.

A masked softmax marks what it may not attend to with a large negative constant:
Keras's ``Softmax`` layer picks -1e9 where the mask is False (``where(mask, x,
-1e9)``, in a float32 model's trace), a hand-written attention adds ``(1 - mask)
* -1e9``. In float16 -1e9 is -inf; a row the mask covers whole (a padded query, a
sample whose keys are all padding) is then all -inf, and its softmax NaN where
float32's is finite. Found by the program generator (25100146: Keras's
MultiHeadAttention with such a mask). The select, or the add, and the softmax
that reads it stay float32; the matrix products on either side stay 16-bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tfamp
from tests.graphs import decision, rewrite, run_graph_def
from tfamp.rewrite import reasons as rk

RNG = np.random.default_rng(0)
Q = RNG.normal(size=(2, 4, 8)).astype(np.float32)
MASK = np.ones((2, 4, 4), np.float32)
MASK[0] = 0.0  # the first sample's keys all padding: every row of it covered
MASK[1, :, 2] = 0.0
C = tf.constant(RNG.normal(size=(2, 4, 8)).astype(np.float32))


def _picked(scores, mask, sentinel):
    return tf.where(mask > 0.5, scores, sentinel)


def _added(scores, mask, sentinel):
    return scores + (1.0 - mask) * sentinel


def _step(masking, sentinel=-1e9):
    def step(q, mask):
        with tf.GradientTape() as tape:
            tape.watch(q)
            scores = tf.matmul(q, q, transpose_b=True)
            y = tf.matmul(tf.nn.softmax(masking(scores, mask, sentinel)), q)
            loss = tf.reduce_sum(y * C)
        return y, tape.gradient(loss, q)
    return step


def _run(graph_def):
    return run_graph_def(graph_def, {"q": Q, "mask": MASK}, ["Identity:0", "Identity_1:0"])


SPECS = (tf.TensorSpec(Q.shape), tf.TensorSpec(MASK.shape))


@pytest.mark.parametrize("masking", [_picked, _added])
def test_a_row_masked_whole_stays_finite_in_float16(masking):
    graph_def, new_graph_def, report = rewrite(_step(masking), *SPECS, dtype="float16",
                                               device_type="GPU")
    softmax = decision(report, "Softmax")
    assert not softmax.converted and softmax.kind == rk.KIND_BEYOND_RANGE, softmax
    assert "-1e+09" in softmax.reason or "1e+09" in softmax.reason, softmax.reason
    assert "65504" in softmax.reason, softmax.reason
    products = [n for n in report.nodes if n.op == "BatchMatMulV2"]
    assert products and all(n.converted for n in products), products
    want, got = _run(graph_def), _run(new_graph_def)
    for w, g in zip(want, got, strict=True):
        assert np.all(np.isfinite(w))
        assert np.all(np.isfinite(g)), g
        np.testing.assert_allclose(g, w, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("masking", [_picked, _added])
def test_bfloat16_holds_the_sentinel_and_keeps_the_softmax_16_bit(masking):
    _, _, report = rewrite(_step(masking), *SPECS, dtype="bfloat16", device_type="GPU")
    assert decision(report, "Softmax").kind != rk.KIND_BEYOND_RANGE


def test_float32_min_is_past_bfloat16_range_too():
    """tf.float32.min (-3.4028e38) rounds past bfloat16's largest value (3.3895e38)."""
    graph_def, new_graph_def, report = rewrite(
        _step(_picked, tf.float32.min), *SPECS, dtype="bfloat16", device_type="GPU")
    assert decision(report, "Softmax").kind == rk.KIND_BEYOND_RANGE
    for g in _run(new_graph_def):
        assert np.all(np.isfinite(g)), g


@pytest.mark.parametrize("sentinel", [-3e4, -np.inf])
def test_a_sentinel_float16_holds_changes_nothing(sentinel):
    """-3e4 (Keras's own float16 sentinel) fits; -inf is -inf in float32 too."""
    _, _, report = rewrite(_step(_picked, sentinel), *SPECS, dtype="float16",
                           device_type="GPU")
    assert decision(report, "Softmax").converted
    assert all(n.kind != rk.KIND_BEYOND_RANGE for n in report.nodes)


@pytest.mark.parametrize("keras_name", ["tf_keras", "keras"])
def test_keras_multi_head_attention_with_a_padded_sample(keras_name):
    """What the generator found: the layer's own masked softmax (both Kerases)."""
    keras = pytest.importorskip(keras_name)
    tf.keras.utils.set_random_seed(0)
    layer = keras.layers.MultiHeadAttention(2, 4)
    x = tf.constant(RNG.normal(size=(2, 4, 8)).astype(np.float32))
    mask = tf.constant(MASK > 0.5)
    layer(x, x, attention_mask=mask)

    @tf.function
    def step(x, mask):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, x, attention_mask=mask)
            loss = tf.reduce_sum(y * C)
        return y, tape.gradient(loss, x)

    concrete = step.get_concrete_function(x, mask)
    rewritten, report = tfamp.rewrite_concrete_function(
        concrete, tfamp.AmpConfig(dtype="float16", device_type="GPU"))
    assert any(n.kind == rk.KIND_BEYOND_RANGE for n in report.nodes)
    assert any(n.op == "Softmax" and not n.converted for n in report.nodes)
    for w, g in zip(concrete(x, mask), rewritten(x, mask), strict=True):
        assert np.all(np.isfinite(g.numpy())), g
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=5e-2, atol=5e-2)


def _bias_outside(where):
    """The additive mask computed once, outside the body that reads it: a `while_loop`
    over two attention steps, or a function (inside an XLA-compiled one)."""
    def step(q, mask):
        with tf.GradientTape() as tape:
            tape.watch(q)
            bias = (1.0 - mask) * -1e9

            def attend(h):
                scores = tf.matmul(h, h, transpose_b=True) + bias
                return tf.matmul(tf.nn.softmax(scores), h)

            if where == "while_loop":
                _, y = tf.while_loop(lambda i, h: i < 2, lambda i, h: (i + 1, attend(h)),
                                     [tf.constant(0), q])
            else:
                inner = tf.function(attend, autograph=False)
                y = tf.function(lambda h: inner(h), jit_compile=True)(q)
            loss = tf.reduce_sum(y * C)
        return y, tape.gradient(loss, q)
    return step


@pytest.mark.parametrize("where", ["while_loop", "nested_functions"])
def test_a_sentinel_from_another_body_is_held_there_too(where):
    """The bias crosses into the body as an argument, not a constant: what reads it
    there stays float32 (it was cast to float16, -inf, and the first sample's rows
    NaN), as the select or add and its softmax do in the constant's own body."""
    graph_def, new_graph_def, report = rewrite(_bias_outside(where), *SPECS,
                                               dtype="float16", device_type="GPU")
    held = [n for n in report.nodes
            if n.function and n.op == "Softmax" and n.kind == rk.KIND_BEYOND_RANGE]
    assert held and not any(n.converted for n in held), held
    assert all("1e+09" in n.reason and "65504" in n.reason for n in held), held
    want, got = _run(graph_def), _run(new_graph_def)
    for w, g in zip(want, got, strict=True):
        assert np.all(np.isfinite(w))
        assert np.all(np.isfinite(g)), g
        np.testing.assert_allclose(g, w, rtol=3e-2, atol=3e-2 * np.abs(w).max())
    _, _, report = rewrite(_bias_outside(where), *SPECS, dtype="bfloat16", device_type="GPU")
    assert all(n.kind != rk.KIND_BEYOND_RANGE for n in report.nodes)
