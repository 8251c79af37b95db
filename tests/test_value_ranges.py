"""What value_ranges reads off the ops that compute a value, on tiny graphs.

Each case traces a few TensorFlow ops and asks one question of the op named
"target": is the Exp bounded (at most 1, whatever the input), can the Rsqrt
leave float16's range, which ops read a constant past it. The colouring's
tests (test_bounded_exp, test_l2_normalize, test_generated's masks) check what
the rewrite then does; these pin the recognisers themselves, near misses
included.
"""

from __future__ import annotations

import math

import pytest
import tensorflow as tf

from tfamp.rewrite import value_ranges
from tfamp.rewrite.graph import DT_BFLOAT16, DT_HALF, build_view

SPEC = tf.TensorSpec([4, 6], tf.float32)


def _top_body(fn):
    concrete = tf.function(fn, autograph=False).get_concrete_function(SPEC, SPEC)
    return build_view(concrete.graph.as_graph_def()).bodies[0]


def _target(body, op):
    hits = [node for name, node in body.nodes.items()
            if node.op == op and (name == "target" or name.endswith("/target"))]
    hits = hits or [node for node in body.nodes.values() if node.op == op]
    assert len(hits) == 1, [n.name for n in hits]
    return hits[0]


def _max(x, axis=-1, keepdims=True):
    return tf.reduce_max(x, axis=axis, keepdims=keepdims)


BOUNDED_EXPS = {  # case: (fn, the most the Exp can be, or None)
    # exp of minus something never negative (GELU's gradient: exp(-x^2))
    "minus a square": (lambda x, y: tf.exp(-tf.square(x), name="target"), 1.0),
    "minus an abs, through a reshape": (
        lambda x, y: tf.exp(tf.reshape(-tf.abs(x), [6, 4]), name="target"), 1.0),
    # x minus an upper bound of x
    "x - max(x)": (lambda x, y: tf.exp(x - _max(x), name="target"), 1.0),
    "x - stop_gradient(max(x))": (
        lambda x, y: tf.exp(x - tf.stop_gradient(_max(x)), name="target"), 1.0),
    "x - max over both axes": (lambda x, y: tf.exp(x - _max(x, [0, 1]), name="target"), 1.0),
    "x - logsumexp(x)": (
        lambda x, y: tf.exp(x - tf.reduce_logsumexp(x, axis=-1, keepdims=True),
                            name="target"), 1.0),
    # x clipped from above (keras.io's graph attention; a policy's log std)
    "clip_by_value(x, -2, 2)": (
        lambda x, y: tf.exp(tf.clip_by_value(x, -2.0, 2.0), name="target"), math.exp(2)),
    "minimum(x, 1), reshaped": (
        lambda x, y: tf.exp(tf.reshape(tf.minimum(x, 1.0), [6, 4]), name="target"), math.e),
    "ClipByValue(x, -20, 2)": (
        lambda x, y: tf.exp(tf.raw_ops.ClipByValue(t=x, clip_value_min=-20.0,
                                                   clip_value_max=2.0), name="target"),
        math.exp(2)),
    "maximum(minimum(x, 1), 2.5) (a floor above the ceiling)": (
        lambda x, y: tf.exp(tf.maximum(tf.minimum(x, 1.0), 2.5), name="target"), math.exp(2.5)),
    # near misses: unbounded, or bounded by something else
    "x": (lambda x, y: tf.exp(x, name="target"), None),
    "-x": (lambda x, y: tf.exp(-x, name="target"), None),
    "minus minus a square": (lambda x, y: tf.exp(tf.negative(-tf.square(x)), name="target"),
                             None),
    "x - max(y)": (lambda x, y: tf.exp(x - _max(y), name="target"), None),
    "x - min(x)": (lambda x, y: tf.exp(x - tf.reduce_min(x, -1, keepdims=True),
                                       name="target"), None),
    "x - mean(x)": (lambda x, y: tf.exp(x - tf.reduce_mean(x, -1, keepdims=True),
                                        name="target"), None),
    "x - max(x) without kept dimensions": (
        lambda x, y: tf.exp(tf.transpose(tf.transpose(x) - _max(x, -1, False)),
                            name="target"), None),
    "max(x) - x": (lambda x, y: tf.exp(_max(x) - x, name="target"), None),
    "x - max of a reshaped x": (
        lambda x, y: tf.exp(x - tf.reshape(_max(tf.reshape(x, [6, 4]), 0), [1, 4])[:, :1],
                            name="target"), None),
    "clip_by_value(x, -2, 10) (too big a ceiling)": (
        lambda x, y: tf.exp(tf.clip_by_value(x, -2.0, 10.0), name="target"), None),
    "maximum(x, -2) (a floor only)": (
        lambda x, y: tf.exp(tf.maximum(x, -2.0), name="target"), None),
    "minimum(x, y) (no constant)": (
        lambda x, y: tf.exp(tf.minimum(x, y), name="target"), None),
    "minimum(x, 2) + y": (
        lambda x, y: tf.exp(tf.minimum(x, 2.0) + y, name="target"), None),
}


@pytest.mark.parametrize("case", sorted(BOUNDED_EXPS))
def test_exp_bound(case):
    fn, most = BOUNDED_EXPS[case]
    body = _top_body(fn)
    found = value_ranges.exp_bound(body, _target(body, "Exp"))
    assert found == (None if most is None else pytest.approx(most))


def _l2_normalize(x, y):
    return tf.math.l2_normalize(x, axis=-1)


def _normalised_by_variance(x, y):
    mean, variance = tf.nn.moments(x, axes=[-1], keepdims=True)
    return (x - mean) * tf.math.rsqrt(variance + 1e-3, name="target")


def _rsqrt_sum_large_eps(x, y):
    return x * tf.math.rsqrt(tf.reduce_sum(x * x, -1, keepdims=True) + 1e-4, name="target")


def _keras3_normalize(x, y):
    inverse = tf.math.rsqrt(tf.reduce_sum(x * x, -1, keepdims=True), name="target")
    return x * tf.minimum(inverse, 1e7)


RSQRTS = {  # case: (fn, leaves float16's range?, leaves bfloat16's?)
    "l2_normalize (eps 1e-12)": (_l2_normalize, True, False),
    "minimum(rsqrt(sum), 1e7) (Keras 3)": (_keras3_normalize, True, False),
    "a variance + 1e-3": (_normalised_by_variance, False, False),
    "a sum + 1e-4": (_rsqrt_sum_large_eps, False, False),
}


@pytest.mark.parametrize("case", sorted(RSQRTS))
@pytest.mark.parametrize("target", [DT_HALF, DT_BFLOAT16], ids=["float16", "bfloat16"])
def test_rsqrt_overflow(case, target):
    fn, half, bfloat = RSQRTS[case]
    body = _top_body(fn)
    why = value_ranges.rsqrt_overflow(body, {}, _target(body, "Rsqrt"), target)
    assert bool(why) is (half if target == DT_HALF else bfloat), why
    if why:
        assert "zero row" in why and "float32 up to the next allow op" in why


def _masked_scores(x, y):
    mask = tf.cast(y > 0, tf.float32)
    scores = tf.matmul(x, x, transpose_b=True)
    mask = tf.matmul(mask, mask, transpose_b=True)
    return tf.nn.softmax(tf.add(scores, (1.0 - tf.minimum(mask, 1.0)) * -1e9, name="target"))


def test_sentinels_follow_a_mask_constant_to_its_readers():
    body = _top_body(_masked_scores)
    added = _target(body, "AddV2")
    readers, carrying = value_ranges.sentinels(body, 65504.0, {})
    assert readers.get(added.name) == pytest.approx(1e9)
    assert any(ref.node == added.name for ref in carrying)  # (the sum carries it on)
    # bfloat16's range holds -1e9: nothing to follow
    assert value_ranges.sentinels(body, 3.39e38, {}) == ({}, {})


def test_sentinels_read_a_placeholder_fed_one():
    body = _top_body(lambda x, y: tf.add(x, y, name="target"))
    placeholders = [n for n, node in body.nodes.items() if node.op == "Placeholder"]
    readers, _ = value_ranges.sentinels(body, 65504.0, {placeholders[1]: 1e9})
    assert readers.get("target") == pytest.approx(1e9)  # (and what reads the sum)
    assert value_ranges.sentinels(body, 65504.0, {placeholders[1]: 1.0}) == ({}, {})
