"""The first non-finite op: a planted float16 overflow is named with its fix; nothing changes."""

from __future__ import annotations

import re
import warnings
from unittest import mock

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

import tfamp
from tfamp.config import AmpConfig
from tfamp.keras import lifecycle
from tfamp.keras.overflow_locator import locate_keras_nonfinite
from tfamp.numerics import nonfinite


def overflow_model(batch_norm: bool = False):
    """Dense -> exp -> Dense. The Dense output is exactly 12 for all-ones inputs:
    exp(12) = 162755 is finite in float32 and inf in float16 (max 65504)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    h = keras.layers.Dense(8, name="boost", kernel_initializer=keras.initializers.Constant(3.0))(
        inputs)
    if batch_norm:
        h = keras.layers.BatchNormalization(name="bn", center=False, scale=False)(h)
        h = keras.layers.Lambda(lambda t: t + 12.0, name="shift")(h)
    h = keras.layers.Lambda(lambda t: tf.exp(t), name="expo")(h)
    out = keras.layers.Dense(1, name="head",
                             kernel_initializer=keras.initializers.Constant(1e-6))(h)
    model = keras.Model(inputs, out, name="planted")
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    return model


X = np.ones((16, 4), "float32")
Y = np.zeros((16, 1), "float32")
EXP_16BIT = AmpConfig(allow_add=["Exp"])  # Exp forced onto the allow list


def test_planted_exp_overflow_is_named_with_its_fix():
    model = overflow_model()
    found = locate_keras_nonfinite(model, X, Y, config=EXP_16BIT)
    assert found is not None
    assert (found.node, found.op, found.phase) == ("planted/expo/Exp", "Exp", "forward")
    assert found.layer == "planted/expo" and found.value == "inf"
    assert found.ran_16bit and found.dtype == "float16" and not found.inserted_cast
    [source] = found.inputs
    assert source.tensor == "planted/boost/BiasAdd:0" and source.dtype == "float16"
    assert source.max_abs == pytest.approx(12.0) and source.nonfinite == 0
    assert found.fix_env == "TFAMP_KEEP_FP32='planted/expo/'"
    assert found.fix_api == "AmpConfig(keep_fp32=['planted/expo/'])"
    # Exp was put on the allow list by the user: the op-list fix is to drop it there.
    assert "allow_add=[]" in found.fix_oplist_api and "Exp" in found.fix_oplist_api
    assert "Exp 'planted/expo/Exp'" in found.describe()
    # The suggested keep_fp32 pattern removes this overflow; exp(12) in float32 is
    # then too big for the Cast to float16 in front of the head, the next finding,
    # and its fix (which keeps the first one) leaves every value finite.
    fixed = EXP_16BIT.replace(keep_fp32=(found.keep_fp32,))
    second = locate_keras_nonfinite(model, X, Y, config=fixed)
    assert second is not None and second.inserted_cast and second.layer == "planted/head"
    assert second.fix_api == "AmpConfig(keep_fp32=['planted/expo/', 'planted/head/'])"
    both = EXP_16BIT.replace(keep_fp32=("planted/expo/", "planted/head/"))
    assert locate_keras_nonfinite(model, X, Y, config=both) is None


def test_locating_raises_nothing_tensorflow_would_log(capfd):
    """CheckNumerics that stopped the step made TensorFlow log "Local rendezvous is
    aborting ... tfamp_check" on stderr for every look: harmless, but alarming in a
    training log. The flags are read in one finishing run now."""
    found = locate_keras_nonfinite(overflow_model(), X, Y, config=EXP_16BIT)
    assert found is not None and found.node == "planted/expo/Exp"
    err = capfd.readouterr().err
    assert "tfamp_check" not in err and "rendezvous" not in err, err


def test_an_op_that_fails_on_the_infs_values_is_still_located():
    """An index made from the inf (a gather at int(inf)) makes the whole run fail:
    the CheckNumerics path stops the step at the inf before that op runs."""
    def step(x):
        y = tf.exp(x * 12.0)  # 162755: inf in float16
        index = tf.cast(tf.reduce_max(y) / 1e6, tf.int32)  # 0 in float32; int(inf) in float16
        return tf.gather(tf.ones([4]), index) * tf.reduce_sum(y)

    concrete = tf.function(step).get_concrete_function(tf.TensorSpec([4, 4], tf.float32))
    checked = mock.Mock(wraps=nonfinite._first_checked)
    with mock.patch.object(nonfinite, "_first_checked", checked):
        found = nonfinite.locate_nonfinite(concrete, (tf.ones([4, 4]),),
                                           AmpConfig(allow_add=["Exp", "Mul"]))
    assert checked.called  # (the flags' run failed at the gather)
    assert found is not None and found.op == "Exp" and found.ran_16bit, found


def test_value_too_big_for_an_inserted_cast_names_the_cast_and_its_consumer():
    # Default lists: Exp stays float32 and gives 162755; tfamp's Cast to float16
    # in front of the converted head MatMul is where inf first appears.
    model = overflow_model()
    found = locate_keras_nonfinite(model, X, Y, config=AmpConfig())
    assert found is not None and found.inserted_cast
    assert found.node.startswith("planted/expo/Exp/tfamp_cast_")
    assert found.feeds[0] == "planted/head/MatMul" and found.layer == "planted/head"
    assert found.inputs[0].dtype == "float32"
    assert found.inputs[0].max_abs == pytest.approx(np.exp(12.0), rel=1e-5)
    assert found.fix_oplist_api == "AmpConfig(deny_add=['MatMul'])"


def test_the_locator_judges_the_graph_the_rewritten_step_runs(monkeypatch):
    """A LayerNorm over one feature (keras.io's timeseries Transformer normalises its
    single input channel): its output is its offset, and the gradient through the
    variance is a cancellation that is exact in float32 and, in 16-bit, a rounding
    residual times (1e-6)^-1.5. At scale 2048 the rewritten step's gradients are not
    finite. The locator rewrote the graph without its traced shapes, which decides
    otherwise, found every value finite there, and so the fallback had no layer to move.
    (Since session 38 the rewrite keeps a normalisation over one element float32; the
    rule is switched off here to keep the 16-bit cancellation this test needs.)"""
    import keras as keras3

    from tfamp.rewrite import value_ranges
    monkeypatch.setattr(value_ranges, "one_element_variance", lambda body, counts, node: "")

    keras3.utils.set_random_seed(0)
    rng = np.random.RandomState(1234)
    x, y = rng.randn(8, 16, 1).astype("float32"), (rng.rand(8) < 0.5).astype("int64")
    inputs = keras3.Input((16, 1))
    h = keras3.layers.MultiHeadAttention(key_dim=8, num_heads=2)(inputs, inputs)
    h = keras3.layers.Flatten()(keras3.layers.LayerNormalization(epsilon=1e-6)(h) + inputs)
    model = keras3.Model(inputs, keras3.layers.Dense(2, activation="softmax")(h))
    loss_fn = keras3.losses.SparseCategoricalCrossentropy()

    def step(x, y, scale):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True)) * scale
        return tape.gradient(loss, model.trainable_variables)

    args = (tf.constant(x), tf.constant(y), tf.constant(2048.0))
    ran = tfamp.function(step)(*args)
    assert not all(np.all(np.isfinite(g.numpy())) for g in ran)
    found = nonfinite.locate_nonfinite(tf.function(step).get_concrete_function(*args), args,
                                       loss_scale=2048.0)
    assert found is not None and found.phase == "backward", found
    assert "layer_normalization" in found.layer and found.layer.endswith("/moments"), \
        found.describe()


@pytest.mark.parametrize("jit", [False, True])
def test_the_locator_places_casts_as_the_models_step_does(jit, monkeypatch):
    """A model compiled with jit_compile runs tfamp's XLA placement; the locator's own
    trace is not compiled, so it asks for that placement (an explicit runtime stays)."""
    seen = []
    real = nonfinite.locate_nonfinite
    monkeypatch.setattr(nonfinite, "locate_nonfinite",
                        lambda concrete, args, config, **kw: seen.append(config.runtime)
                        or real(concrete, args, config, **kw))
    model = overflow_model()
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse", jit_compile=jit)
    assert locate_keras_nonfinite(model, X, Y, config=EXP_16BIT) is not None
    assert locate_keras_nonfinite(model, X, Y,
                                  config=EXP_16BIT.replace(runtime="executor")) is not None
    assert seen == ["xla" if jit else "auto", "executor"]


def test_finite_step_returns_none():
    model = overflow_model()
    assert locate_keras_nonfinite(model, X * 0.1, Y, config=EXP_16BIT) is None


def test_localising_changes_no_variable():
    model = overflow_model(batch_norm=True)
    model.optimizer.build(model.trainable_variables)
    tracked = [*model.variables, *model.optimizer.variables]
    before = [v.numpy().copy() for v in tracked]
    found = locate_keras_nonfinite(model, X + np.arange(16)[:, None], Y, config=EXP_16BIT,
                                   loss_scale=1024.0)
    assert found is not None and found.op == "Exp" and found.loss_scale == 1024.0
    after = [v.numpy() for v in tracked]
    for variable, old, new in zip(tracked, before, after, strict=True):
        np.testing.assert_array_equal(old, new, err_msg=variable.name)


def fit_until_stuck(model) -> str:
    """Enables `model` with a tiny dynamic scale, fits until it sticks at the floor,
    checks nothing moved; returns the one stuck-at-floor warning. The float32 fallback
    is off here: it would move the overflowing layers (tests/test_fallback.py)."""
    tfamp.enable(model, config=EXP_16BIT, initial_scale=2.0, min_scale=1.0)
    weights = [v.numpy().copy() for v in model.trainable_variables]
    with warnings.catch_warnings(record=True) as caught, mock.patch.object(
            lifecycle.ModelPrecision, "_fallback_after_call", lambda *args: False):
        warnings.simplefilter("always")
        model.fit(X, Y, batch_size=16, epochs=5, verbose=0)
    stuck = [w for w in caught if "stuck at its floor" in str(w.message)]
    assert len(stuck) == 1, [str(w.message) for w in caught]
    assert float(np.asarray(model.optimizer.loss_scale)) == 1.0
    assert int(np.asarray(model.optimizer.skipped_steps)) == 5
    for old, variable in zip(weights, model.trainable_variables, strict=True):
        np.testing.assert_array_equal(old, np.asarray(variable))
    return str(stuck[0].message)


def test_stuck_at_floor_warning_names_the_op():
    message = fit_until_stuck(overflow_model())
    assert "Localised: first non-finite value (inf) comes from Exp 'planted/expo/Exp'" in message
    assert "TFAMP_KEEP_FP32='planted/expo/'" in message


@pytest.mark.parametrize("name, scope", [
    ("model/dense_3/MatMul", "model/dense_3"),
    ("gradient_tape/model/dense_3/MatMul/MatMul_1", "model/dense_3"),
    ("gradients/dense/BiasAdd_grad/BiasAddGrad", "dense"),
    ("loss", ""),
])
def test_layer_scopes(name, scope):
    """The layer a forward or gradient op belongs to (gradient names:
    tests/test_scopes.py)."""
    assert nonfinite._layer_scope(name) == scope


FORWARD = {"m_1/gap_1/Mean", "m_1/dense_1/MatMul", "m_1/dense_1/MatMul/ReadVariableOp",
           "dense/BiasAdd"}


@pytest.mark.parametrize("name, scope", [
    ("gradient_tape/m_1/dense_1/MatMul/MatMul_1", "m_1/dense_1"),
    # TensorFlow's Mean gradient sits in the layer's scope, not under "Mean/": it
    # once gave the parent ("m_1": the whole model moved to float32)
    ("gradient_tape/m_1/gap_1/Tile", "m_1/gap_1"),
    ("gradient_tape/replica_1/m_1/gap_1/truediv", "m_1/gap_1"),
    ("gradients/dense/BiasAdd_grad/BiasAddGrad", "dense"),
])
def test_layer_scopes_from_the_graph(name, scope):
    assert nonfinite._layer_scope(name, FORWARD) == scope


def test_instrumented_graph_checks_every_float_output_in_order():
    @tf.function
    def f(x):
        return tf.exp(tf.matmul(x, x)) + 1.0

    concrete = f.get_concrete_function(tf.TensorSpec([2, 2]))
    graph_def = concrete.graph.as_graph_def()
    from tfamp.rewrite.graph import build_view

    body = build_view(graph_def).bodies[0]
    new, checked = nonfinite._instrument(graph_def, body)
    names = [name for name, _ in checked]
    assert names.index("MatMul") < names.index("Exp") < names.index("add")
    checks = {n.name: n for n in new.node if n.op == "CheckNumericsV2"}
    assert len(checks) == len(checked)
    by_name = {n.name: n for n in new.node}
    # consumers read the checked tensor, so a failing op cannot be overtaken
    assert by_name["Exp"].input[0].startswith("tfamp_nonfinite_check/")
    # the input GraphDef is not modified
    assert not any(n.op == "CheckNumericsV2" for n in graph_def.node)


def test_ops_in_no_layer_scope_move_by_their_names_every_call_together():
    """A style-transfer loss: Gram matrices of an image variable the step takes as an
    argument, in no layer's scope ('MatMul', 'MatMul_1', ...: one function called per
    feature map), past 65504 in float16. The keep_fp32 pattern for an op in no scope
    named its type ('^MatMul$'), which keeps only the node literally named so: the
    second then "still computes in float16" and nothing moved. It names the node now,
    every call of it (its ``_<n>`` suffix, as a layer's every call), and its gradient:
    keras.io's script has ten such MatMuls, past the fallback's 4 layers one by one.
    The variable argument is bound to its handle where the locator runs the step (it
    raised before)."""
    from tfamp.keras import fallback, overflow_locator

    image = tf.Variable(np.full((4, 8), 300.0, np.float32))
    reference = tf.constant(np.full((4, 8), 200.0, np.float32))

    def step(image, reference):
        with tf.GradientTape() as tape:
            gram = tf.matmul(image, image, transpose_a=True)
            target = tf.matmul(reference, reference, transpose_a=True)
            loss = tf.reduce_sum(tf.square(gram - target)) * 1e-12
        return tape.gradient(loss, image)

    with overflow_locator.step_locator(step, (image, reference), {}) as locate:
        decision = fallback.decide_with(locate, AmpConfig())
    assert decision.kind == fallback.MOVED, decision
    assert decision.findings[0].node in ("MatMul", "MatMul_1"), decision.findings
    pattern = nonfinite.top_scope_keep_pattern(decision.findings[0].node)
    assert decision.patterns[0] == pattern == nonfinite.top_scope_keep_pattern("MatMul")
    assert not any(f.op == "MatMul" for f in decision.findings[1:]), decision.findings
    pattern = re.compile(pattern)
    assert pattern.search("MatMul") and pattern.search("MatMul_1")
    assert pattern.search("gradient_tape/MatMul_1_grad/MatMul")
    assert not pattern.search("MatMulX") and not pattern.search("dense/MatMul")
    np.testing.assert_array_equal(image.numpy(), 300.0)
