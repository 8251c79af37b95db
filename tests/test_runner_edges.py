"""RewrittenFunction around other functions: nested rewrites, XLA."""

import numpy as np
import pytest
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


def test_a_rewritten_function_called_in_another_trace_is_not_autograph_converted(
        monkeypatch):
    # A user's tf.function around a tfamp.function: autograph converted the call and,
    # through it, the whole rewrite pass (this test took 25-40 s on 2 cores).
    import inspect

    import tfamp.runtime.runner as runner

    frames = []
    real = runner.rewrite_graph_def

    def spy(*args, **kwargs):
        # (a function autograph converted runs as tf__<name> from a generated file)
        frames.extend((f.filename, f.function) for f in inspect.stack())
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "rewrite_graph_def", spy)
    w = tf.Variable(tf.ones((4, 4)))
    inner = RewrittenFunction(tf.function(lambda x: tf.matmul(x, w)))
    tf.function(lambda x: inner(x) * 2.0)(tf.ones((2, 4)))
    assert frames, "the inner function was not rewritten"
    assert any(name == "__call__" for _, name in frames)
    converted = {name for path, name in frames if "__autograph_generated" in path}
    assert not converted & {"tf____call__", "tf__spy"}, converted  # (spy: the pass)


def test_the_users_function_is_still_autograph_converted_inside_another_trace():
    w = tf.Variable(tf.ones((4, 4)))

    def body(x):
        y = tf.matmul(x, w)
        if tf.reduce_sum(y) > 0:  # a tensor condition: needs autograph in a graph
            y = y * 2.0
        else:
            y = y - 1.0
        for _ in tf.range(3):
            y = y + 1.0
        return y

    inner = RewrittenFunction(tf.function(body))
    outer = tf.function(lambda x: inner(x) + 0.0)
    assert outer(tf.ones((2, 4))).numpy()[0, 0] == 11.0  # 4 * 2 + 3
    assert outer(-tf.ones((2, 4))).numpy()[0, 0] == -2.0  # -4 - 1 + 3


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


def _xla_step_inputs():
    rng = np.random.default_rng(0)
    a = tf.constant(rng.normal(size=(64, 64)).astype("float32"))
    b = tf.Variable(rng.normal(size=(64, 64)).astype("float32"))
    return a, b


def test_tfamp_function_on_a_jit_compiled_tf_function_keeps_xla_and_runs_16_bit():
    a, b = _xla_step_inputs()
    original = tf.function(lambda x: tf.matmul(x, b), jit_compile=True)
    step = tfamp.function(original)
    got = step(a).numpy()
    want16 = tf.cast(tf.matmul(tf.cast(a, tf.float16), tf.cast(b, tf.float16)), tf.float32)
    np.testing.assert_array_equal(got, want16.numpy())
    assert not np.array_equal(got, tf.matmul(a, b).numpy())
    attrs = step.get_concrete_function(a).function_def.attr
    assert attrs["_XlaMustCompile"].b is True
    assert step.reports[0].converted == {"MatMul": 1}


def test_xla_really_compiles_the_rewritten_function():
    # An op XLA cannot compile: must-compile fails at run time, so the error
    # proves XLA is applied to the rewritten body (and its absence without jit).
    a, b = _xla_step_inputs()

    def body(x):
        return tf.strings.as_string(tf.matmul(x, b))[0, 0]
    assert tfamp.function(body)(a).dtype == tf.string
    jitted = tfamp.function(tf.function(body, jit_compile=True))
    with pytest.raises((tf.errors.InvalidArgumentError, tf.errors.UnimplementedError)):
        jitted(a)
    assert jitted.reports[0].converted == {"MatMul": 1}


def test_tf_keras_jit_compile_model_runs_its_xla_step_rewritten():
    import tf_keras as keras
    from tensorflow.python.eager import context

    keras.utils.set_random_seed(0)
    x = np.random.default_rng(0).normal(size=(64, 16)).astype("float32")
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse", jit_compile=True)
    tfamp.enable(model, verbose=False)
    history = model.fit(x, x[:, :1], epochs=2, batch_size=32, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    (_, rewritten, report, _), = model.train_function._rewritten.values()
    assert report.converted.get("MatMul", 0) >= 4
    # The XLA-compiled step Keras calls is the rewritten one: 16-bit MatMuls inside.
    calls = [n.attr["f"].func.name for n in rewritten.graph.as_graph_def().node
             if n.op == "StatefulPartitionedCall"]
    xla_bodies = [context.context().get_function_def(name) for name in calls]
    xla_bodies = [f for f in xla_bodies if f.attr["_XlaMustCompile"].b]
    assert len(xla_bodies) == 1
    half = [n.op for n in xla_bodies[0].node_def
            if n.op == "MatMul" and n.attr["T"].type == tf.float16.as_datatype_enum]
    assert len(half) >= 4
