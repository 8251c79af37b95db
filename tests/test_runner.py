"""tfamp.function / rewrite_concrete_function: rewritten graphs run on the live state.

What these tests pin down:

* a rewritten training step updates the real model variables, the optimizer's
  iteration counter and its Adam slots (the very same Python objects), and
  leaves every variable float32;
* callers see the original output structure and dtypes;
* one rewrite (and one report) per concrete function: a new input signature
  retraces, the same signature does not;
* the decorator forms, wrapping an existing tf.function, and per-instance
  method binding;
* reports of a MatMul step, and their JSON round trip;
* the rewritten math really is 16-bit (close to, but not equal to, float32);
* ``rewrite_concrete_function(check=True)`` validates and runs;
* a clear TypeError for something that is not callable.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

import tfamp
import tfamp.runtime.runner

DTYPES = ["float16", "bfloat16"]


# --------------------------------------------------------------------------- helpers


def _data(n=64, features=8, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    y = (2.0 * x[:, :1] - x[:, 1:2] + 0.5).astype("float32")
    return x, y


def _mlp(features=8, hidden=32, build=True):
    kwargs = {"input_shape": (features,)} if build else {}
    return keras.Sequential([
        keras.layers.Dense(hidden, activation="relu", **kwargs),
        keras.layers.Dense(1),
    ])


def _train_step(model, opt, lossf):
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = lossf(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss
    return step


def _snapshot(variables):
    return [np.array(v.numpy(), copy=True) for v in variables]


def _adam_slots(opt):
    return [v for v in opt.variables if v is not opt.iterations]


def _float_variables_are_float32(variables):
    return {v.name: v.dtype.name for v in variables
            if v.dtype.is_floating and v.dtype != tf.float32}


# --------------------------------------------------------------------------- training step


@pytest.mark.parametrize("dtype", DTYPES)
def test_training_step_updates_live_model_and_optimizer(dtype):
    keras.utils.set_random_seed(0)
    model = _mlp()
    opt = keras.optimizers.Adam(1e-2)
    opt.build(model.trainable_variables)  # slots exist now: compare before/after
    lossf = keras.losses.MeanSquaredError()
    x, y = _data()

    model_vars = list(model.variables)
    opt_vars = list(opt.variables)
    slots = _adam_slots(opt)
    assert len(slots) == 2 * len(model.trainable_variables)  # m and v per variable
    model_before = _snapshot(model_vars)
    slots_before = _snapshot(slots)
    assert int(opt.iterations) == 0

    step = tfamp.function(_train_step(model, opt, lossf),
                          config=tfamp.AmpConfig(dtype=dtype), check=True)
    n_steps = 4
    losses = [float(step(x, y)) for _ in range(n_steps)]

    # One rewrite, run n_steps times, on the same objects.
    assert len(step.reports) == 1
    assert all(a is b for a, b in zip(model.variables, model_vars, strict=True))
    assert all(a is b for a, b in zip(opt.variables, opt_vars, strict=True))
    # The rewritten graph captures the live variables' handles, not copies.
    concrete = step.get_concrete_function(x, y)
    captured = {id(t) for t in concrete.captured_inputs}
    for var in model.trainable_variables + slots + [opt.iterations]:
        assert id(var.handle) in captured, var.name

    assert int(opt.iterations) == n_steps
    for var, before in zip(model_vars, model_before, strict=True):
        assert not np.allclose(var.numpy(), before), f"{var.name} was not updated"
    for var, before in zip(slots, slots_before, strict=True):
        assert not np.array_equal(var.numpy(), before), f"Adam slot {var.name} was not updated"
        assert np.any(var.numpy() != 0), var.name

    assert all(np.isfinite(losses)), losses
    assert losses[-1] < losses[0], losses


def test_training_step_tracks_float32_training():
    """The 16-bit step follows float32 Adam closely from the same initial weights."""
    x, y = _data()

    def run(make_step):
        keras.utils.set_random_seed(0)
        model = _mlp()
        opt = keras.optimizers.Adam(1e-2)
        step = make_step(_train_step(model, opt, keras.losses.MeanSquaredError()))
        return np.array([float(step(x, y)) for _ in range(5)]), model

    reference, model32 = run(tf.function)
    mixed, model16 = run(lambda fn: tfamp.function(fn, check=True))
    print("float32 losses", reference, "\nfloat16 losses", mixed)
    np.testing.assert_allclose(mixed, reference, rtol=1e-2)
    assert not np.array_equal(mixed, reference)  # 16-bit math did run
    for a, b in zip(model16.variables, model32.variables, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=2e-2)


def test_training_step_creating_variables_on_first_call():
    """An unbuilt model and a fresh optimizer create their variables while tracing."""
    keras.utils.set_random_seed(0)
    model = _mlp(build=False)
    opt = keras.optimizers.Adam(1e-2)
    step = tfamp.function(_train_step(model, opt, keras.losses.MeanSquaredError()),
                          check=True)
    x, y = _data()
    first = float(step(x, y))
    assert model.built and len(model.trainable_variables) == 4
    weights = _snapshot(model.trainable_variables)
    for _ in range(3):
        last = float(step(x, y))
    assert len(step.reports) == 1
    assert int(opt.iterations) == 4
    assert step.reports[0].converted.get("MatMul", 0) >= 1
    for var, before in zip(model.trainable_variables, weights, strict=True):
        assert not np.allclose(var.numpy(), before), var.name
    assert last < first


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_variables_stay_float32(dtype):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.layers.Dense(32, input_shape=(8,)),
        keras.layers.BatchNormalization(momentum=0.5),
        keras.layers.ReLU(),
        keras.layers.Dropout(0.2),
        keras.layers.Dense(1),
    ])
    opt = keras.optimizers.Adam(1e-2)
    step = tfamp.function(_train_step(model, opt, keras.losses.MeanSquaredError()),
                          config=tfamp.AmpConfig(dtype=dtype), check=True)
    x, y = _data()
    moving = [v for v in model.non_trainable_variables]
    assert moving, "BatchNormalization should have moving statistics"
    moving_before = _snapshot(moving)
    for _ in range(3):
        step(x, y)

    assert _float_variables_are_float32(model.variables) == {}
    assert _float_variables_are_float32(opt.variables) == {}
    assert all(v.dtype == tf.float32 for v in model.variables)
    assert opt.iterations.dtype == tf.int64
    assert all(v.dtype == tf.float32 for v in _adam_slots(opt))
    # Non-trainable state updated by the (rewritten) graph's side effects too.
    for var, before in zip(moving, moving_before, strict=True):
        assert not np.allclose(var.numpy(), before), f"{var.name} was not updated"
    assert int(opt.iterations) == 3


# --------------------------------------------------------------------------- outputs


@pytest.mark.parametrize("dtype", DTYPES)
def test_output_structure_and_dtypes_are_preserved(dtype):
    w = tf.Variable(tf.random.stateless_normal([8, 8], seed=[1, 2]))

    def fn(x):
        h = tf.matmul(x, w)
        return {
            "logits": h,
            "label": tf.argmax(h, axis=1, output_type=tf.int32),
            "pair": (tf.reduce_sum(h), tf.shape(x)),
            "wide": tf.cast(tf.matmul(h, w), tf.float64),
            "half": tf.cast(x, tf.float16),
            "input": x,
        }

    x = tf.random.stateless_normal([4, 8], seed=[3, 4])
    expected = tf.function(fn)(x)
    got = tfamp.function(fn, config=tfamp.AmpConfig(dtype=dtype), check=True)(x)

    tf.nest.assert_same_structure(got, expected)
    assert isinstance(got["pair"], tuple)
    assert tf.nest.map_structure(lambda t: t.dtype, got) == \
        tf.nest.map_structure(lambda t: t.dtype, expected)
    assert got["logits"].dtype == tf.float32
    assert got["label"].dtype == tf.int32
    assert got["pair"][1].dtype == tf.int32
    assert got["wide"].dtype == tf.float64
    assert got["half"].dtype == tf.float16
    np.testing.assert_array_equal(got["pair"][1].numpy(), [4, 8])
    np.testing.assert_array_equal(got["input"].numpy(), x.numpy())
    scale = float(tf.reduce_max(tf.abs(expected["logits"])))
    np.testing.assert_allclose(got["logits"].numpy(), expected["logits"].numpy(),
                               atol=3e-2 * scale)


@pytest.mark.parametrize("dtype", DTYPES)
def test_explicit_cast_to_16_bit_of_converted_op(dtype):
    """A user's tf.cast to the target type reads the 16-bit value directly.

    Regression: it used to get a tfamp Cast to float32 in front of it, a
    float16 -> float32 -> float16 round trip that check=True rejected.
    """
    w = tf.Variable(tf.ones([4, 4]))

    def fn(x):
        h = tf.nn.relu(tf.matmul(x, w))
        return h, tf.cast(h, dtype)

    fn16 = tfamp.function(fn, config=tfamp.AmpConfig(dtype=dtype), check=True)
    h, h16 = fn16(tf.ones([2, 4]))
    assert h.dtype == tf.float32 and h16.dtype == tf.as_dtype(dtype)
    np.testing.assert_allclose(tf.cast(h16, tf.float32).numpy(), np.full([2, 4], 4.0))
    [report] = fn16.reports
    assert not any(c.dst_dtype == "float32" and "Cast" in c.consumers for c in report.casts)


def test_tuple_output_with_python_constant_and_int32():
    def fn(x):
        y = tf.matmul(x, x, transpose_b=True)
        return y, tf.size(y), 3

    x = tf.ones([3, 5])
    got = tfamp.function(fn, check=True)(x)
    expected = tf.function(fn)(x)
    assert isinstance(got, tuple) and len(got) == 3
    assert [t.dtype for t in got] == [t.dtype for t in expected]
    assert got[0].dtype == tf.float32 and got[1].dtype == tf.int32
    np.testing.assert_allclose(got[0].numpy(), np.full([3, 3], 5.0))
    assert int(got[1]) == 9 and int(got[2]) == 3


def test_function_without_outputs_still_runs_its_side_effects():
    w = tf.Variable(tf.ones([4, 4]))
    total = tf.Variable(0.0)

    @tfamp.function(check=True)
    def accumulate(x):
        total.assign_add(tf.reduce_sum(tf.matmul(x, w)))

    assert accumulate(tf.ones([2, 4])) is None
    assert accumulate(tf.ones([2, 4])) is None
    assert float(total) == pytest.approx(64.0)
    assert accumulate.reports[0].converted.get("MatMul") == 1


# --------------------------------------------------------------------------- retracing


def test_new_input_signature_retraces_and_adds_a_report():
    w = tf.Variable(tf.ones([8, 8]))
    fn = tfamp.function(lambda x: tf.matmul(x, w), check=True)

    fn(tf.ones([4, 8]))
    fn(tf.zeros([4, 8]))
    fn(np.ones([4, 8], np.float32))
    assert len(fn.reports) == 1

    out = fn(tf.ones([6, 8]))  # a new fixed batch size: a new concrete function
    assert out.shape == (6, 8) and out.dtype == tf.float32
    assert len(fn.reports) == 2
    fn(tf.ones([6, 8]))
    fn(tf.ones([4, 8]))
    assert len(fn.reports) == 2
    assert all(r.converted.get("MatMul") == 1 for r in fn.reports)


def test_repeated_calls_take_the_fast_path_and_run_the_rewritten_graph(monkeypatch):
    """After a signature's first call, a call canonicalises its arguments once and
    runs the rewritten trace directly (no get_concrete_function, no structured
    re-binding); the result is still the 16-bit one, and a new signature still
    takes the full path (trace, rewrite, report)."""
    fn = tfamp.function(lambda x: tf.matmul(x, x))
    x = tf.fill([2, 2], 1.0 + 2.0 ** -12)  # float16 rounds it to 1.0
    assert float(fn(x)[0, 0]) == 2.0  # float32 would give 2.00098
    full_path = []
    original = tfamp.runtime.runner.RewrittenFunction.get_concrete_function
    monkeypatch.setattr(tfamp.runtime.runner.RewrittenFunction, "get_concrete_function",
                        lambda self, *a, **k: full_path.append(1) or original(self, *a, **k))
    for _ in range(3):
        assert float(fn(x)[0, 0]) == 2.0
    assert float(fn(x=tf.fill([2, 2], 3.0))[1, 1]) == 18.0  # by keyword
    assert not full_path and len(fn.reports) == 1
    out = fn(tf.fill([3, 3], 1.0 + 2.0 ** -12))
    assert float(out[0, 0]) == 3.0 and len(full_path) == 1 and len(fn.reports) == 2


def test_new_input_dtype_retraces_and_adds_a_report():
    fn = tfamp.function(lambda x: tf.matmul(x, x), check=True)
    assert fn(tf.ones([3, 3])).dtype == tf.float32
    out = fn(tf.ones([3, 3], tf.float64))
    assert out.dtype == tf.float64
    np.testing.assert_array_equal(out.numpy(), np.full([3, 3], 3.0))
    assert len(fn.reports) == 2
    assert fn.reports[0].converted == {"MatMul": 1}
    assert fn.reports[1].converted == {}  # float64 math is never touched
    fn(tf.ones([3, 3], tf.float64))
    assert len(fn.reports) == 2


def test_input_signature_with_unknown_batch_is_rewritten_once():
    w = tf.Variable(tf.ones([8, 2]))
    fn = tfamp.function(lambda x: tf.matmul(x, w),
                        input_signature=[tf.TensorSpec([None, 8], tf.float32)], check=True)
    assert fn(tf.ones([2, 8])).shape == (2, 2)
    assert fn(tf.ones([7, 8])).shape == (7, 2)
    assert len(fn.reports) == 1


# --------------------------------------------------------------------------- decorator forms


def test_bare_decorator():
    @tfamp.function
    def double_matmul(x):
        return tf.matmul(x, x) * 2.0

    out = double_matmul(tf.eye(3))
    np.testing.assert_allclose(out.numpy(), 2.0 * np.eye(3))
    assert isinstance(double_matmul, tfamp.runtime.runner.RewrittenFunction)
    assert double_matmul.__name__ == "double_matmul"
    assert double_matmul.config == tfamp.AmpConfig()
    assert [r.dtype for r in double_matmul.reports] == ["float16"]
    assert double_matmul.reports[0].converted.get("MatMul") == 1


def test_decorator_with_bfloat16_config():
    @tfamp.function(config=tfamp.AmpConfig(dtype="bfloat16"), check=True)
    def square(x):
        return tf.matmul(x, x)

    np.testing.assert_allclose(square(tf.eye(4)).numpy(), np.eye(4))
    assert square.config.dtype == "bfloat16"
    assert [r.dtype for r in square.reports] == ["bfloat16"]
    assert square.reports[0].converted.get("MatMul") == 1


def test_rewrite_function_is_tfamp_function():
    cfg = tfamp.AmpConfig(dtype="bfloat16")
    fn = tfamp.rewrite_function(lambda x: tf.matmul(x, x), cfg, check=True)
    fn(tf.ones([2, 2]))
    assert fn.config is cfg
    assert fn.reports[0].dtype == "bfloat16"


def test_wrapping_an_existing_tf_function():
    calls = []

    @tf.function
    def original(x):
        calls.append(1)  # counts traces
        return tf.matmul(x, x)

    wrapped = tfamp.function(original, check=True)
    x = tf.eye(3) * 2.0
    np.testing.assert_allclose(wrapped(x).numpy(), 4.0 * np.eye(3))
    wrapped(x)
    assert len(calls) == 1
    assert len(wrapped.reports) == 1
    # The wrapped tf.function itself is untouched: still float32 math.
    np.testing.assert_allclose(original(x).numpy(), 4.0 * np.eye(3))
    assert len(calls) == 1  # same trace reused by the original
    assert wrapped.python_function is original.python_function


class _Scaler(tf.Module):
    def __init__(self, scale):
        super().__init__()
        self.w = tf.Variable(tf.eye(4) * scale)
        self.calls = tf.Variable(0)

    @tfamp.function(config=tfamp.AmpConfig(dtype="bfloat16"), check=True)
    def __call__(self, x):
        self.calls.assign_add(1)
        return tf.matmul(x, self.w)

    @tfamp.function
    def shifted(self, x):
        return tf.matmul(x, self.w) + 1.0


def test_method_decorator_binds_per_instance():
    a, b = _Scaler(2.0), _Scaler(3.0)
    x = tf.ones([2, 4])
    np.testing.assert_allclose(a(x).numpy(), np.full([2, 4], 2.0))
    np.testing.assert_allclose(b(x).numpy(), np.full([2, 4], 3.0))
    np.testing.assert_allclose(a(x).numpy(), np.full([2, 4], 2.0))
    assert (int(a.calls), int(b.calls)) == (2, 1)

    a.w.assign(tf.eye(4) * 5.0)  # the rewritten graph reads the live variable
    np.testing.assert_allclose(a(x).numpy(), np.full([2, 4], 5.0))
    np.testing.assert_allclose(b(x).numpy(), np.full([2, 4], 3.0))

    assert a.__call__ is a.__call__  # bound once per instance
    assert a.__call__ is not b.__call__
    assert len(a.__call__.reports) == 1 and len(b.__call__.reports) == 1
    assert a.__call__.reports[0].dtype == "bfloat16"
    assert a.__call__.reports[0].converted.get("MatMul") == 1
    assert _Scaler.__call__.reports == []  # the unbound descriptor never traced

    np.testing.assert_allclose(b.shifted(x).numpy(), np.full([2, 4], 4.0))
    assert b.shifted.reports[0].dtype == "float16"
    # The module still tracks exactly its own variables.
    assert {id(v) for v in a.variables} == {id(a.w), id(a.calls)}


# --------------------------------------------------------------------------- reports


def test_report_of_matmul_step_and_json_round_trip():
    keras.utils.set_random_seed(0)
    model = _mlp()
    opt = keras.optimizers.Adam(1e-2)
    step = tfamp.function(_train_step(model, opt, keras.losses.MeanSquaredError()),
                          check=True)
    step(*_data())
    [report] = step.reports

    assert isinstance(report, tfamp.RewriteReport)
    assert report.dtype == "float16"
    assert "step" in report.function
    assert report.converted["MatMul"] >= 1
    assert report.casts_inserted > 0
    assert report.casts_inserted == len(report.casts)
    # (the mean's gradient Tile is left to the Mul that broadcasts: see test_hoist)
    dropped = sum(1 for e in report.broadcast_edits if e["edit"] == "dropped")
    assert report.nodes_after == report.nodes_before + report.casts_inserted - dropped
    assert len(report.nodes) == report.nodes_before - dropped
    assert all(c.dst_dtype in ("float16", "float32") for c in report.casts)
    matmuls = [n for n in report.nodes if n.op == "MatMul"]
    assert matmuls and all(n.function == "" for n in matmuls)
    assert report.node(matmuls[0].name).converted
    with pytest.raises(KeyError):
        report.node("no/such/node")
    assert "MatMul" in report.summary_line()

    data = json.loads(report.to_json())
    assert data == json.loads(json.dumps(report.to_dict()))
    assert data["converted"] == report.converted
    assert data["casts_inserted"] == report.casts_inserted
    assert data["dtype"] == "float16"
    assert len(data["nodes"]) == len(report.nodes)
    rebuilt = tfamp.RewriteReport.from_dict(data)
    assert rebuilt.to_dict() == report.to_dict()
    assert rebuilt.nodes == report.nodes and rebuilt.casts == report.casts


# --------------------------------------------------------------------------- numerics


_TOLERANCE = {"float16": 1e-2, "bfloat16": 5e-2}


@pytest.mark.parametrize("dtype", DTYPES)
def test_inference_outputs_close_to_float32_but_not_identical(dtype):
    rng = np.random.default_rng(0)
    w1 = tf.Variable(rng.normal(size=(256, 256)).astype("float32") / 16)
    w2 = tf.Variable(rng.normal(size=(256, 64)).astype("float32") / 16)
    b2 = tf.Variable(rng.normal(size=(64,)).astype("float32"))

    def infer(x):
        return tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2) + b2

    x = tf.constant(rng.normal(size=(128, 256)).astype("float32"))
    reference = tf.function(infer)(x).numpy()
    rewritten = tfamp.function(infer, config=tfamp.AmpConfig(dtype=dtype), check=True)
    out = rewritten(x).numpy()

    assert out.dtype == np.float32 and out.shape == reference.shape
    assert rewritten.reports[0].converted.get("MatMul") == 2
    scale = np.abs(reference).max()
    max_rel = np.abs(out - reference).max() / scale
    print(f"{dtype}: max |error| / max |ref| = {max_rel:.2e}")
    assert max_rel <= _TOLERANCE[dtype]
    np.testing.assert_allclose(out, reference, rtol=_TOLERANCE[dtype],
                               atol=_TOLERANCE[dtype] * scale)
    assert not np.array_equal(out, reference), "outputs bit-identical: no 16-bit math ran"
    # Clearly more than float32 rounding noise.
    assert np.abs(out - reference).mean() / np.abs(reference).mean() > 1e-5


# ------------------------------------------------------------------ rewrite_concrete_function


def test_rewrite_concrete_function_with_check(check_calls):
    checked = check_calls

    w = tf.Variable(tf.random.stateless_normal([16, 16], seed=[0, 1]))
    counter = tf.Variable(0)

    @tf.function
    def layer(x):
        counter.assign_add(1)
        return {"y": tf.nn.relu(tf.matmul(x, w)), "n": tf.shape(x)[0]}

    x = tf.random.stateless_normal([4, 16], seed=[2, 3])
    concrete = layer.get_concrete_function(tf.TensorSpec([4, 16], tf.float32))
    new_cf, report = tfamp.rewrite_concrete_function(
        concrete, tfamp.AmpConfig(), check=True)
    assert len(checked) == 1
    assert tfamp.check_graph_def(checked[0]) == []

    assert report.converted.get("MatMul") == 1
    assert report.casts_inserted > 0
    assert "layer" in report.function
    out = new_cf(x)
    expected = concrete(x)
    assert set(out) == {"y", "n"}
    assert out["y"].dtype == tf.float32 and out["n"].dtype == tf.int32
    np.testing.assert_allclose(out["y"].numpy(), expected["y"].numpy(), rtol=1e-2, atol=1e-2)
    assert int(out["n"]) == 4
    assert int(counter) == 2  # the rewritten function updated the live variable
    # The graph it runs is sound (its library lives in the eager context).
    assert tfamp.check_graph_def(new_cf.graph.as_graph_def()) == []

    new_cf2, _ = tfamp.rewrite_concrete_function(concrete, tfamp.AmpConfig(), check=False)
    assert len(checked) == 1  # check=False skips validation
    new_cf2(x)
    assert int(counter) == 3


def test_rewrite_concrete_function_default_config_and_training_step():
    keras.utils.set_random_seed(0)
    model = _mlp()
    opt = keras.optimizers.Adam(1e-2)
    x, y = _data()
    step = tf.function(_train_step(model, opt, keras.losses.MeanSquaredError()))
    concrete = step.get_concrete_function(x, y)
    new_cf, report = tfamp.rewrite_concrete_function(concrete, check=True)
    assert report.dtype == "float16"
    weights = _snapshot(model.trainable_variables)
    loss = new_cf(tf.constant(x), tf.constant(y))
    assert loss.dtype == tf.float32 and np.isfinite(float(loss))
    assert int(opt.iterations) == 1
    for var, before in zip(model.trainable_variables, weights, strict=True):
        assert not np.allclose(var.numpy(), before), var.name


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("not_callable", [42, "train_step", [lambda x: x]])
def test_not_callable_raises_type_error(not_callable):
    with pytest.raises(TypeError, match=r"expects a Python function or a tf\.function") as info:
        tfamp.function(not_callable)
    assert type(not_callable).__name__ in str(info.value)
    with pytest.raises(TypeError, match="expects a Python function"):
        tfamp.rewrite_function(not_callable)
    with pytest.raises(TypeError, match="expects a Python function"):
        tfamp.function(config=tfamp.AmpConfig())(not_callable)


def test_tf_function_options_for_existing_tf_function_raise_type_error():
    with pytest.raises(TypeError, match="jit_compile"):
        tfamp.function(tf.function(lambda x: x), jit_compile=True)


def test_a_function_traced_again_alike_logs_its_summary_once(caplog):
    """keras.io's forwardforward traces one tf.function per label value: the
    same rewrite, so the same line, 11 times. Once at INFO; a trace rewritten
    otherwise is said again."""
    import logging

    @tfamp.function
    def shifted(x, k):
        return tf.matmul(x, x) + float(k)

    x = tf.ones([4, 4])
    with caplog.at_level(logging.DEBUG, logger="tfamp"):
        for k in (1, 2, 3):
            shifted(x, k)
        shifted(tf.ones([4, 4, 4]), 1)  # another shape: another estimate, another line
    summaries = [r for r in caplog.records
                 if r.getMessage().startswith("tfamp: shifted: 2 ops -> float16")]
    assert [r.levelno for r in summaries] == [logging.INFO, logging.DEBUG, logging.DEBUG,
                                              logging.INFO], [r.getMessage() for r in summaries]
    assert summaries[1].getMessage().endswith("(traced again, rewritten alike)")
    assert len(shifted._logged) == 2
