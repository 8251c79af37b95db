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


def test_a_precomputed_bias_captured_by_the_function_is_a_sentinel_too():
    """An attention bias made once, eagerly, outside the tf.function: TensorFlow
    captures a tensor of more than 128 elements as a placeholder, not a constant, so
    only its value says it holds -1e9. The runner reads the captured values
    (``runner.captured_magnitudes``); the rewrite takes them as ``input_magnitudes``."""
    q = np.random.default_rng(1).normal(size=(8, 32, 8)).astype(np.float32)
    valid = np.ones((8, 32), np.float32)
    valid[0] = 0.0  # the first sample's keys all padding
    bias = (1.0 - tf.constant(valid)[:, None, :]) * -1e9  # 256 elements: a placeholder

    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.matmul(tf.nn.softmax(tf.matmul(x, x, transpose_b=True) + bias), x)
            loss = tf.reduce_sum(y * y)
        return y, tape.gradient(loss, x)

    concrete = tf.function(step).get_concrete_function(tf.TensorSpec(q.shape))
    assert not any(n.op == "Const" and n.attr["value"].tensor.tensor_shape.dim
                   for n in concrete.graph.as_graph_def().node
                   if n.attr["dtype"].type == tf.float32.as_datatype_enum)
    rewritten, report = tfamp.rewrite_concrete_function(concrete,
                                                        tfamp.AmpConfig(dtype="float16"))
    softmax = decision(report, "Softmax")
    assert not softmax.converted and softmax.kind == rk.KIND_BEYOND_RANGE, softmax
    want, got = concrete(tf.constant(q)), rewritten(tf.constant(q))
    for w, g in zip(want, got, strict=True):
        assert np.all(np.isfinite(w.numpy()))
        assert np.all(np.isfinite(g.numpy())), g
    # the pure rewrite alone cannot know the value: told, it holds the same
    graph_def = concrete.graph.as_graph_def()
    outputs = [t.name for t in concrete.graph.outputs]
    _, blind = tfamp.rewrite_graph_def(graph_def, tfamp.AmpConfig(dtype="float16"),
                                       outputs=outputs)
    assert decision(blind, "Softmax").kind != rk.KIND_BEYOND_RANGE
    placeholder = next(internal.op.name for external, internal in concrete.graph.captures
                       if external.dtype == tf.float32)
    _, told = tfamp.rewrite_graph_def(graph_def, tfamp.AmpConfig(dtype="float16"),
                                      outputs=outputs, input_magnitudes={placeholder: 1e9})
    assert decision(told, "Softmax").kind == rk.KIND_BEYOND_RANGE


@pytest.mark.parametrize("given, said", [([1e9], "a mapping"), ({"bias": "big"}, "a number")])
def test_input_magnitudes_that_are_not_numbers_by_name_are_refused(given, said):
    graph_def = tf.function(lambda x: x * 2.0).get_concrete_function(
        tf.TensorSpec([2])).graph.as_graph_def()
    before = graph_def.SerializeToString()
    with pytest.raises(TypeError, match=said):
        tfamp.rewrite_graph_def(graph_def, input_magnitudes=given)
    assert graph_def.SerializeToString() == before
