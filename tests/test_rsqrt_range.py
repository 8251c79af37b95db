"""An rsqrt that can leave float16's range keeps its layer's arithmetic float32.

``tf.math.l2_normalize(x)`` is ``x * rsqrt(max(sum(x * x), 1e-12))``: for a row of
zeros (a ReLU's, a padded step's) the rsqrt is 1e6, past float16's 65504. Cast to
float16 for a 16-bit ``x * ...`` it became inf, and 0 * inf is NaN where float32
gives 0; its gradient, dy * 1e6, became inf where the ReLU's gradient multiplies
it by 0. An epsilon of 2.4e-10 or more bounds it.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from tests.graphs import decision, rewrite, run_graph_def
from tfamp.rewrite import reasons as rk

EYE = tf.constant(np.eye(8, dtype=np.float32))
X = np.random.default_rng(0).normal(size=(4, 8)).astype(np.float32)
X[1] = -np.abs(X[1])  # a row the ReLU makes zero
# (a fixed weighting: the squared norm of a normalised row is constant, its gradient 0)
C = tf.constant(np.random.default_rng(1).normal(size=(4, 8)).astype(np.float32))


def _l2_normalize(h):
    return tf.math.l2_normalize(h, axis=-1)


def _normalise(eps):
    def normalise(h):
        mean, var = tf.nn.moments(h, axes=[-1], keepdims=True)
        return (h - mean) * tf.math.rsqrt(var + eps)
    return normalise


def _step(layer):
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.matmul(layer(tf.nn.relu(tf.matmul(x, EYE))), EYE)
            loss = tf.reduce_sum(y * C)
        return y, tape.gradient(loss, x)
    return step


def _run(graph_def):
    return run_graph_def(graph_def, {"x": X}, ["Identity:0", "Identity_1:0"])


def _keras3_normalize(eps):
    """Keras 3's form (keras.ops.normalize, UnitNormalization): x * min(rsqrt(sum), 1/eps),
    with no epsilon inside: the rsqrt of a zero row is inf in float32 too."""
    def normalise(h):
        inv = tf.math.rsqrt(tf.reduce_sum(tf.square(h), axis=-1, keepdims=True))
        return h * tf.minimum(inv, 1.0 / eps)
    return normalise


@pytest.mark.parametrize("layer, reaches", [
    (_l2_normalize, "1e+06"), (_keras3_normalize(1e-12), "1e+12"),
    (_keras3_normalize(1e-7), "1e+07")], ids=["l2_normalize", "unit_norm", "ops_normalize"])
def test_a_zero_row_stays_finite_in_float16(layer, reaches):
    graph_def, new_graph_def, report = rewrite(_step(layer), tf.TensorSpec(X.shape),
                                               dtype="float16", device_type="CPU")
    rsqrt = decision(report, "Rsqrt")
    assert not rsqrt.converted and rsqrt.kind == rk.KIND_DENY_LIST, rsqrt
    assert reaches in rsqrt.reason and "65504" in rsqrt.reason, rsqrt.reason
    # the ReLU's gradient multiplies dy * 1e12 by 0: it reads float32
    assert not decision(report, "ReluGrad").converted
    want, got = _run(graph_def), _run(new_graph_def)
    for w, g in zip(want, got, strict=True):
        assert np.all(np.isfinite(w))
        assert np.all(np.isfinite(g)), g
        np.testing.assert_allclose(g, w, rtol=0.02, atol=0.02 * np.abs(w).max())
    assert report.converted.get("MatMul", 0) >= 2, report.converted  # the matmuls still are


@pytest.mark.parametrize("eps", [1e-3, 1e-12])
def test_a_variance_is_left_as_it_was(eps):
    """A variance is 0 only on a row of equal values (BUILD_NOTES.md, session 21), and
    Keras's LayerNorm epsilon (1e-3) bounds rsqrt(v + eps) by 31.6 anyway."""
    _, _, report = rewrite(_step(_normalise(eps)), tf.TensorSpec(X.shape),
                           dtype="float16", device_type="CPU")
    assert "deny" not in decision(report, "Rsqrt").reason


def test_a_clamp_that_bounds_it_changes_nothing():
    def normalise(h):
        inv = tf.math.rsqrt(tf.reduce_sum(tf.square(h), axis=-1, keepdims=True))
        return h * tf.minimum(inv, 1e3)

    _, _, report = rewrite(_step(normalise), tf.TensorSpec(X.shape),
                           dtype="float16", device_type="CPU")
    assert "deny" not in decision(report, "Rsqrt").reason


def test_an_epsilon_that_bounds_it_changes_nothing():
    def normalise(h):
        return h * tf.math.rsqrt(tf.reduce_sum(h * h, axis=-1, keepdims=True) + 1e-8)

    _, _, report = rewrite(_step(normalise), tf.TensorSpec(X.shape),
                           dtype="float16", device_type="CPU")
    assert "deny" not in decision(report, "Rsqrt").reason


def test_bfloat16_has_the_range():
    _, new_graph_def, report = rewrite(_step(_l2_normalize), tf.TensorSpec(X.shape),
                                       dtype="bfloat16", device_type="CPU")
    assert "deny" not in decision(report, "Rsqrt").reason
    assert all(np.all(np.isfinite(v)) for v in _run(new_graph_def))


def _in_a_body(loop):
    """The l2 normalisation in another body: row by row inside a loop (`map_fn`, a
    while loop over TensorArrays, or a `while_loop` that writes each row to a
    TensorList), or in a function called from an XLA-compiled function."""
    def layer(h):
        if loop == "cond":
            return tf.cond(tf.reduce_sum(h) > -1e9, lambda: _l2_normalize(h), lambda: h * 2.0)
        if loop == "nested_cond":  # (the inner branch's optionals wrapped in the outer's)
            return tf.cond(tf.reduce_sum(h) > -1e9, lambda: tf.cond(
                tf.reduce_max(h) > -1e9, lambda: _l2_normalize(h), lambda: h * 2.0),
                lambda: h * 3.0)
        if loop == "nested_functions":
            inner = tf.function(_l2_normalize, autograph=False)
            return tf.function(lambda v: inner(v), jit_compile=True)(h)
        if loop == "map_fn":
            return tf.map_fn(lambda r: _l2_normalize(r[None, :])[0], h)
        rows = tf.TensorArray(tf.float32, size=X.shape[0])
        _, rows = tf.while_loop(
            lambda i, rows: i < X.shape[0],
            lambda i, rows: (i + 1, rows.write(i, _l2_normalize(h[i][None, :])[0])),
            [tf.constant(0), rows])
        return rows.stack()
    return layer


@pytest.mark.parametrize("loop", ["map_fn", "while_loop", "nested_functions", "cond",
                                  "nested_cond"])
def test_the_hold_follows_the_rsqrt_into_the_gradient_body(loop):
    """The gradient loop pops the forward's rsqrt (1e6 on the zero row) from the loop's
    accumulator in another body, or the gradient function receives it from the forward
    function through the calls around them: what reads it there stays float32 too (it
    was cast to float16, inf, and the input gradient NaN; generated programs 19000127,
    19000702, 19000849, 20000090)."""
    graph_def, new_graph_def, report = rewrite(_step(_in_a_body(loop)), tf.TensorSpec(X.shape),
                                               dtype="float16", device_type="CPU")
    forward = [n for n in report.nodes if n.op == "Rsqrt"]
    assert forward and not any(n.converted for n in forward), forward
    held = [n for n in report.nodes
            if n.function != forward[0].function and "carries the value of" in n.reason]
    assert held and not any(n.converted for n in held), held
    assert all("Rsqrt" in n.reason for n in held), [n.reason for n in held]
    want, got = _run(graph_def), _run(new_graph_def)
    for w, g in zip(want, got, strict=True):
        assert np.all(np.isfinite(w))
        assert np.all(np.isfinite(g)), g
        np.testing.assert_allclose(g, w, rtol=0.02, atol=0.02 * np.abs(w).max())


def test_a_loop_without_the_rsqrt_holds_nothing_across_it():
    def layer(h):
        return tf.map_fn(lambda r: tf.nn.relu(r) * 2.0, h)

    _, _, report = rewrite(_step(layer), tf.TensorSpec(X.shape), dtype="float16",
                           device_type="CPU")
    assert not any("carries the value of" in n.reason for n in report.nodes)


def _keras3_layer_norm(eps):
    """Keras 3's LayerNormalization arithmetic: x * inv + (beta - mean * inv)."""
    def normalise(h):
        mean, var = tf.nn.moments(h, axes=[-1], keepdims=True)
        inv = tf.math.rsqrt(var + eps) * 1.5  # (gamma)
        return h * inv + (0.25 - mean * inv)  # (beta)
    return normalise


def _one_channel_step(x):
    """A LayerNorm over one channel (keras.io's timeseries Transformer): its output is
    beta whatever x is, and x's gradient through it is 0."""
    with tf.GradientTape() as tape:
        tape.watch(x)
        h = tf.matmul(x, EYE)[:, :, None] * 3.0  # [4, 8, 1]: one channel
        y = tf.matmul(_keras3_layer_norm(1e-6)(h)[:, :, 0], EYE)
        loss = tf.reduce_sum(y * C)
    return y, tape.gradient(loss, x)


@pytest.mark.parametrize("batch", [4, None], ids=["batch", "unknown_batch"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_normalisation_over_one_element_stays_float32(dtype, batch):
    """In 16 bits beta - mean * inv rounds at the size of x * 1000 (inv = eps^-0.5), and
    that error was the output: 0.1 update cosine against float32 in bfloat16 on
    tests/patterns.py's one_channel_norm. Held float32, the products cancel as there."""
    graph_def, new_graph_def, report = rewrite(_one_channel_step,
                                               tf.TensorSpec((batch, X.shape[1])),
                                               dtype=dtype, device_type="CPU")
    rsqrt = decision(report, "Rsqrt")
    assert not rsqrt.converted and rsqrt.kind == rk.KIND_DENY_LIST, rsqrt
    assert "over one element" in rsqrt.reason and "1e+03" in rsqrt.reason, rsqrt.reason
    assert report.converted.get("MatMul", 0) >= 2, report.converted  # the matmuls still are
    # What computes the Rsqrt's own gradient (sum(dy * x) - sum(dy * mean), 0 in
    # float32, times inv^3 / 2) stays float32 too: with an unknown batch, where the
    # Sums between its terms are copies, one term in 16 bits made x's gradient NaN.
    feeding = [n for n in report.nodes if "feeds the gradient of Rsqrt" in n.reason]
    assert feeding and not any(n.converted for n in feeding), feeding
    (want_y, want_dx), (got_y, got_dx) = _run(graph_def), _run(new_graph_def)
    np.testing.assert_array_equal(want_y, np.full_like(want_y, want_y[0, 0]))  # beta's image
    np.testing.assert_allclose(got_y, want_y, rtol=1e-2, atol=1e-2 * np.abs(want_y).max())
    assert np.abs(got_dx).max() <= 1e-3 * max(np.abs(want_dx).max(), 1.0), got_dx


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_normalisation_over_many_elements_is_left_as_it_was(dtype):
    _, _, report = rewrite(_step(_keras3_layer_norm(1e-6)), tf.TensorSpec(X.shape),
                           dtype=dtype, device_type="CPU")
    assert "over one element" not in decision(report, "Rsqrt").reason
