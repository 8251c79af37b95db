"""An Exp of minus something never negative lies in (0, 1]: not a deny op; nor is
the Exp of a softmax written out, exp(x - max(x)) or exp(x - logsumexp(x)).

TensorFlow's gradients of erf and erfc are exp(-square(x)): every GELU
(approximate=False) backward pass has one per layer. Exp is on the float16
deny list because exp(x) overflows float16 past x = 11.1; exp(-square(x))
cannot. It is an infer op there: it no longer holds what reads it in float32.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tfamp
from tests.graphs import decision, rewrite, run_graph_def
from tfamp.rewrite import reasons as rk

RNG = np.random.default_rng(11)
VALUES = {"x": RNG.standard_normal((16, 32)).astype(np.float32) * 2,
          "w1": RNG.standard_normal((32, 64)).astype(np.float32) / 6,
          "w2": RNG.standard_normal((64, 8)).astype(np.float32) / 8}


def _step(x, w1, w2):
    with tf.GradientTape() as tape:
        tape.watch([w1, w2])
        h = tf.nn.gelu(tf.matmul(x, w1, name="dense1"), approximate=False)
        y = tf.matmul(h, w2, name="dense2")
        # Two Exps that may overflow: of a plain value, of minus a signed one.
        grows = tf.matmul(tf.exp(y, name="plain_exp"), tf.transpose(w2), name="after_plain")
        signed = tf.matmul(tf.exp(-y, name="neg_exp"), tf.transpose(w2), name="after_neg")
        loss = tf.reduce_mean(tf.square(y)) + 1e-3 * tf.reduce_mean(grows + signed)
    return [loss] + tape.gradient(loss, [w1, w2])


def test_gelu_gradient_exp_is_16bit_and_unbounded_exps_stay_float32():
    concrete = tf.function(_step, autograph=False).get_concrete_function(
        *[tf.TensorSpec(v.shape) for v in VALUES.values()])
    graph_def = concrete.graph.as_graph_def(add_shapes=True)
    outputs = [t.name for t in concrete.graph.outputs]
    new_graph_def, report = tfamp.rewrite_graph_def(
        graph_def, tfamp.AmpConfig(dtype="float16", device_type="GPU"), outputs=outputs)
    assert tfamp.check_graph_def(new_graph_def) == []
    nodes = {n.name: n for n in graph_def.node}
    exps = {n.name: n for n in report.nodes if n.op == "Exp"}
    gelu = [name for name in exps if name.startswith("gradient_tape/")
            and nodes[nodes[name].input[0]].op == "Neg"
            and nodes[nodes[nodes[name].input[0]].input[0]].op == "Square"]
    assert gelu, sorted(exps)
    readers = {}
    for node in graph_def.node:
        for text in node.input:
            readers.setdefault(text.split(":")[0], []).append(node.name)
    by_name = {n.name: n for n in report.nodes}
    for name in gelu:
        assert exps[name].list == "infer" and exps[name].kind != "deny list", exps[name].reason
        # Nothing is held float32 by it: what reads it computes in 16-bit.
        assert not [n for n in report.nodes if n.cause == name and not n.converted]
        for reader in readers[name]:
            assert by_name[reader].converted, (reader, by_name[reader].reason)
    for name in ("plain_exp", "neg_exp"):
        assert exps[name].list == "deny" and not exps[name].converted, exps[name].reason
    want = run_graph_def(graph_def, VALUES, outputs)
    got = run_graph_def(new_graph_def, VALUES, outputs)
    for w, g in zip(want, got):
        np.testing.assert_allclose(g, w, rtol=2e-2, atol=2e-2 * np.abs(w).max())


# -- a softmax written out: exp(x - max(x)), Keras 3's exp(x - logsumexp(x)) ---------

ATTENTION = {"x": RNG.standard_normal((4, 3, 5, 8)).astype(np.float32),
             "wq": RNG.standard_normal((8, 8)).astype(np.float32) / 2,
             "wk": RNG.standard_normal((8, 8)).astype(np.float32) / 2,
             "wv": RNG.standard_normal((8, 8)).astype(np.float32) / 3}


def _two_axis_softmax(scores):
    """Keras 3's Softmax over two axes (MultiHeadAttention with attention_axes=(1, 2),
    keras.io's MobileViT): exp(x - logsumexp(x, keepdims=True))."""
    import keras
    return keras.layers.Softmax(axis=(3, 4))(scores)


def _two_axis_softmax_dropout(scores):
    """... and the attention dropout after it in training (Keras 3's: a scaling and a
    select between the Exp and the matmul; keras.io's MobileViT, dropout=0.1)."""
    return tf.nn.experimental.stateless_dropout(_two_axis_softmax(scores), rate=0.1,
                                                seed=[1, 2])


def _written_out(scores):
    shifted = tf.exp(scores - tf.reduce_max(scores, axis=(3, 4), keepdims=True))
    return shifted / tf.reduce_sum(shifted, axis=(3, 4), keepdims=True)


def _attention_step(softmax):
    def step(x, wq, wk, wv):
        with tf.GradientTape() as tape:
            tape.watch([wq, wk, wv])
            q, k, v = (tf.einsum("bpnc,cd->bpnd", x, w) for w in (wq, wk, wv))
            # scores[b, p, n, q, m]: (p, n) attends to (q, m), over two axes
            probs = softmax(tf.einsum("bpnd,bqmd->bpnqm", q, k))
            y = tf.einsum("bpnqm,bqmd->bpnd", probs, v)
            loss = tf.reduce_mean(tf.square(y))
        return [loss] + tape.gradient(loss, [wq, wk, wv])
    return step


@pytest.mark.parametrize("batch", [4, None], ids=["fixed", "unknown"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("softmax", [_two_axis_softmax, _two_axis_softmax_dropout, _written_out],
                         ids=["keras3_two_axes", "keras3_dropout", "written_out"])
def test_a_softmax_written_out_computes_its_probabilities_in_16bit(softmax, dtype, batch):
    specs = [tf.TensorSpec((batch, 3, 5, 8))] + [tf.TensorSpec((8, 8))] * 3
    graph_def, new_graph_def, report = rewrite(
        _attention_step(softmax), *specs, dtype=dtype, device_type="GPU")
    exps = [n for n in report.nodes if n.op == "Exp"]
    assert exps
    for exp in exps:  # (the logsumexp's inner one too, exp(x - max(x)), read by a Sum)
        assert exp.list == "infer", (exp.name, exp.reason)
    # the probabilities the attention matmul reads are the Exp's own 16-bit result
    outer = [n for n in exps if "ReduceLogSumExp" not in n.name]
    assert len(outer) == 1 and outer[0].converted, outer
    if softmax is not _written_out and dtype == "float16":
        # x - logsumexp stays float32 (centred on a float32 statistic); the Exp
        # reads it cast
        assert outer[0].kind == rk.KIND_BOUNDED_FOR_16BIT, outer[0].reason
    assert not [n for n in report.nodes if n.cause in {e.name for e in exps}
                and not n.converted and n.kind == rk.KIND_DOWNSTREAM_OF_DENY]
    outputs = ["Identity:0", "Identity_1:0", "Identity_2:0", "Identity_3:0"]
    want = run_graph_def(graph_def, ATTENTION, outputs)
    got = run_graph_def(new_graph_def, ATTENTION, outputs)
    tolerance = 2e-2 if dtype == "float16" else 6e-2
    for w, g in zip(want, got, strict=True):
        assert np.isfinite(g).all()
        np.testing.assert_allclose(g, w, rtol=tolerance, atol=tolerance * np.abs(w).max())


def _minus(bound):
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            h = tf.matmul(x, EYE8, name="before")
            p = tf.exp(h - bound(h), name="the_exp")
            loss = tf.reduce_sum(tf.matmul(p, EYE8, name="after"))
        return loss, tape.gradient(loss, x)
    return step


EYE8 = tf.constant(np.eye(8, dtype=np.float32))


def _misaligned_logsumexp(h):
    """log(sum(exp(h - max over both axes), over the last axis only)) + max: a row
    without the maximum sums to less than 1, its log is negative."""
    m = tf.reduce_max(h, axis=[0, 1], keepdims=True)
    return tf.math.log(tf.reduce_sum(tf.exp(h - m), axis=1, keepdims=True)) + m


@pytest.mark.parametrize("bound", [
    lambda h: tf.reduce_max(2.0 * h, axis=1, keepdims=True),  # the maximum of another tensor
    lambda h: tf.reduce_max(h, axis=1),  # no kept axis: [8, 8] - [8] lines up the wrong way
    lambda h: tf.reduce_min(h, axis=1, keepdims=True),  # a minimum
    lambda h: tf.reduce_mean(h, axis=1, keepdims=True),
    _misaligned_logsumexp,
], ids=["other_tensor", "no_keepdims", "min", "mean", "misaligned_logsumexp"])
def test_an_exp_minus_something_that_is_not_its_bound_stays_float32(bound):
    _, _, report = rewrite(_minus(bound), tf.TensorSpec((8, 8)), dtype="float16",
                           device_type="GPU")
    the_exp = decision(report, "the_exp")
    assert the_exp.list == "deny" and not the_exp.converted, the_exp.reason


def test_an_exp_minus_its_own_maximum_is_bounded():
    # (the same step as above with the right bound: the check above can fail)
    _, _, report = rewrite(_minus(lambda h: tf.reduce_max(h, axis=1, keepdims=True)),
                           tf.TensorSpec((8, 8)), dtype="float16", device_type="GPU")
    assert decision(report, "the_exp").list == "infer"


def test_a_bounded_exp_a_function_returns_rewrites():
    """Shrunk from the generator (56000191, session 40): the Exp's only reader was its
    function's result, a pseudo-slot with no node, and looking up that reader's op
    raised KeyError('<ret exp>')."""
    @tf.function
    def inner(h):
        return tf.exp(h - tf.reduce_max(h, axis=-1, keepdims=True), name="exp")

    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            p = inner(tf.matmul(x, EYE8))
            loss = tf.reduce_sum(tf.matmul(p, EYE8))
        return loss, tape.gradient(loss, x)

    x = RNG.standard_normal((4, 8)).astype(np.float32)
    for dtype in ("float16", "bfloat16"):
        graph_def, new_graph_def, report = rewrite(step, tf.TensorSpec((None, 8)),
                                                   dtype=dtype, device_type="GPU")
        exps = [n for n in report.nodes if n.op == "Exp" and n.function]
        assert exps and all(n.list == "infer" for n in exps), exps
        want = run_graph_def(graph_def, {"x": x}, ["Identity:0", "Identity_1:0"])
        got = run_graph_def(new_graph_def, {"x": x}, ["Identity:0", "Identity_1:0"])
        for w, g in zip(want, got, strict=True):
            np.testing.assert_allclose(g, w, rtol=3e-2, atol=3e-2 * np.abs(w).max())


# keys (q, m) = (2, 3..4) are padding for every query; query (0, 0) sees no key at all
MASK = np.ones((1, 3, 5, 3, 5), dtype=bool)
MASK[..., 2, 3:] = False
MASK[:, 0, 0] = False


def _masked_two_axis_softmax(scores):
    """Keras 3's Softmax over two axes with a mask: it adds (1 - mask) * -1e9 to the
    scores first (a sentinel float16 cannot hold), then exp(x - logsumexp(x))."""
    import keras
    return keras.layers.Softmax(axis=(3, 4))(scores, mask=tf.constant(MASK))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_masked_two_axis_softmax_gives_no_false_nan(dtype):
    """A query that sees no key must get float32's uniform row, not NaN. In float16 the
    scores carry the -1e9 sentinel, and what reads them stays float32 up to the
    probabilities (coloring's sentinel rule, which this rule does not override); in
    bfloat16, which holds -1e9, the probabilities are 16-bit."""
    specs = [tf.TensorSpec((None, 3, 5, 8))] + [tf.TensorSpec((8, 8))] * 3
    graph_def, new_graph_def, report = rewrite(
        _attention_step(_masked_two_axis_softmax), *specs, dtype=dtype, device_type="GPU")
    outer = [n for n in report.nodes if n.op == "Exp" and "ReduceLogSumExp" not in n.name]
    assert len(outer) == 1, outer
    if dtype == "float16":
        assert not outer[0].converted and outer[0].kind == rk.KIND_BEYOND_RANGE, outer
    else:
        assert outer[0].converted, outer
    outputs = ["Identity:0", "Identity_1:0", "Identity_2:0", "Identity_3:0"]
    want = run_graph_def(graph_def, ATTENTION, outputs)
    got = run_graph_def(new_graph_def, ATTENTION, outputs)
    tolerance = 2e-2 if dtype == "float16" else 6e-2
    for w, g in zip(want, got, strict=True):
        assert np.isfinite(w).all() and np.isfinite(g).all()
        np.testing.assert_allclose(g, w, rtol=tolerance, atol=tolerance * np.abs(w).max())


# -- an Exp of a clipped value: keras.io's graph attention, exp(clip(s, -2, 2)) -----

GAT_NODES, GAT_EDGES = 24, 96


def _gat_inputs():
    rng = np.random.default_rng(5)
    edges = np.stack([rng.integers(0, GAT_NODES, GAT_EDGES),
                      rng.integers(0, GAT_NODES, GAT_EDGES)], 1)
    edges[:GAT_NODES, 0] = np.arange(GAT_NODES)  # (every node has a neighbour)
    edges = edges[np.argsort(edges[:, 0], kind="stable")].astype(np.int32)
    return {"x": rng.standard_normal((GAT_NODES, 16)).astype(np.float32),
            "edges": edges,
            "w": (rng.standard_normal((16, 8)) / 4).astype(np.float32),
            "a": (rng.standard_normal((16, 1)) / 3).astype(np.float32)}


def _graph_attention_step(ceiling):
    """keras.io's GAT layer (examples/graph/gat_node_classification.py), its scores'
    clip ceiling a parameter, in a training step."""
    def step(x, edges, w, a):
        with tf.GradientTape() as tape:
            tape.watch([w, a])
            t = tf.matmul(x, w)
            pairs = tf.reshape(tf.gather(t, edges), (tf.shape(edges)[0], -1))
            scores = tf.squeeze(tf.nn.leaky_relu(tf.matmul(pairs, a)), -1)
            scores = tf.math.exp(tf.clip_by_value(scores, -2.0, ceiling), name="the_exp")
            total = tf.math.unsorted_segment_sum(scores, edges[:, 0],
                                                 tf.reduce_max(edges[:, 0]) + 1)
            total = tf.repeat(total, tf.math.bincount(edges[:, 0]))
            neighbours = tf.gather(t, edges[:, 1])
            weighted = tf.multiply(neighbours, (scores / total)[:, tf.newaxis], name="weighted")
            h = tf.math.unsorted_segment_sum(weighted, edges[:, 0], tf.shape(x)[0])
            loss = tf.reduce_mean(tf.square(tf.matmul(h, w, transpose_b=True)))
        return [loss] + tape.gradient(loss, [w, a])
    return step


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_an_exp_of_clipped_scores_computes_in_16bit(dtype):
    values = _gat_inputs()
    specs = [tf.TensorSpec(v.shape, tf.as_dtype(v.dtype)) for v in values.values()]
    graph_def, new_graph_def, report = rewrite(
        _graph_attention_step(2.0), *specs, dtype=dtype, device_type="GPU")
    the_exp = decision(report, "the_exp")
    assert the_exp.list == "infer" and the_exp.converted, the_exp.reason
    # nothing is held float32 by it (before: the weighted neighbours' product and
    # its gradient, "downstream of Exp")
    assert not [(n.name, n.reason) for n in report.nodes if n.cause == the_exp.name
                and not n.converted and n.kind == rk.KIND_DOWNSTREAM_OF_DENY]
    weighted = decision(report, "weighted")
    assert weighted.converted, weighted.reason
    # Outputs (loss, d/dw, d/da) against float32's, as errors relative to each
    # one's norm: within 16-bit rounding, and no worse than with the Exp kept
    # float32 (bfloat16's d/da is a small difference of large terms: 8% either way).
    _, kept_graph_def, _ = rewrite(_graph_attention_step(2.0), *specs, dtype=dtype,
                                   device_type="GPU", keep_fp32=["the_exp"])
    outputs = [f"Identity{suffix}:0" for suffix in ("", "_1", "_2")]
    want = run_graph_def(graph_def, values, outputs)
    got = run_graph_def(new_graph_def, values, outputs)
    kept = run_graph_def(kept_graph_def, values, outputs)
    tolerance = 1e-2 if dtype == "float16" else 4e-2
    for w, g, k in zip(want, got, kept, strict=True):
        assert np.isfinite(g).all()
        error, kept_error = (np.linalg.norm(v - w) / np.linalg.norm(w) for v in (g, k))
        assert error < max(tolerance, 1.25 * kept_error), (error, kept_error)


def test_an_exp_clipped_too_high_stays_float32():
    # exp(clip(s, -2, 10)) reaches 22026: past value_ranges.CLIPPED_EXP_MOST
    values = _gat_inputs()
    specs = [tf.TensorSpec(v.shape, tf.as_dtype(v.dtype)) for v in values.values()]
    _, _, report = rewrite(_graph_attention_step(10.0), *specs, dtype="float16",
                           device_type="GPU")
    the_exp = decision(report, "the_exp")
    assert the_exp.list == "deny" and not the_exp.converted, the_exp.reason
