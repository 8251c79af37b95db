"""RewrittenFunction around other functions: nested rewrites, XLA."""

import numpy as np
import tensorflow as tf

import tfamp
from tfamp.runtime.runner import RewrittenFunction


def test_function_that_only_calls_a_rewritten_one_is_not_rewritten_again(caplog):
    w = tf.Variable(tf.ones((4, 4)) / 3)
    inner = RewrittenFunction(tf.function(lambda x: tf.matmul(x, w)))
    outer = RewrittenFunction(tf.function(lambda x: inner(x) * 2.0))
    with caplog.at_level("INFO", logger="tfamp"):
        got = outer(tf.ones((2, 4)))
    assert outer.reports == []
    assert len(inner.reports) == 1 and inner.reports[0].converted == {"MatMul": 1}
    summaries = [r.getMessage() for r in caplog.records if " ops -> " in r.getMessage()]
    assert len(summaries) == 1, summaries
    # Still the rewritten inner body: float16-rounded, not the float32 value.
    want16 = 2.0 * tf.matmul(tf.ones((2, 4), tf.float16), tf.cast(w, tf.float16))
    np.testing.assert_array_equal(got.numpy(), tf.cast(want16, tf.float32).numpy())
    assert not np.array_equal(got.numpy(), (2.0 * tf.matmul(tf.ones((2, 4)), w)).numpy())


def test_function_with_its_own_matmul_around_a_rewritten_one_is_rewritten():
    w = tf.Variable(tf.ones((4, 4)))
    inner = RewrittenFunction(tf.function(lambda x: tf.matmul(x, w)))
    outer = RewrittenFunction(tf.function(lambda x: tf.matmul(inner(x), w)))
    outer(tf.ones((2, 4)))
    assert len(outer.reports) == 1 and outer.reports[0].converted.get("MatMul") == 1


def test_function_calling_a_plain_tf_function_is_rewritten_through_it():
    w = tf.Variable(tf.ones((4, 4)))
    inner = tf.function(lambda x: tf.matmul(x, w))
    outer = tfamp.function(lambda x: inner(x) * 2.0)
    outer(tf.ones((2, 4)))
    assert len(outer.reports) == 1 and outer.reports[0].converted.get("MatMul") == 1
