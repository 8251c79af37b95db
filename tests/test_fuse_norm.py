"""On TensorFlow's executor a batch normalisation is one FusedBatchNormV3.

Keras 3's BatchNormalization (tf.nn.moments + tf.nn.batch_normalization) is ten
ops and two float32 reductions of a float32 copy of the activation; the edit
(``tfamp.rewrite.fuse_norm``) makes it one fused kernel that reads the 16-bit
activation and accumulates in float32, and hands the batch statistics to
everything else that read them. The gradient the tape built is unchanged.
"""

from __future__ import annotations

import collections

import keras
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tfamp
from tests.graphs import run_graph_def
from tests.test_statistics import _residual_step
from tfamp.rewrite import reasons as rk
from tfamp.rewrite.fuse_norm import fuse_batch_norms
from tfamp.rewrite.graph import build_view
from tfamp.rewrite.shapes import tensor_shapes

B, H, W, C = 4, 6, 6, 8
RNG = np.random.default_rng(7)
OUTPUTS = ["out", "batch_mean", "batch_var", "d_w", "d_gamma", "d_beta"]


def _bn_step(epsilon=1e-3, scale=True, center=True):
    """conv -> moments + batch_normalization (as Keras 3 computes a training
    BatchNorm; without gamma / beta where `scale` / `center` is off) -> ReLU ->
    conv; returns the output, the batch statistics and the gradients of w, gamma
    and beta (zeros for one the layer does not use)."""
    def step(x, w, gamma, beta):
        with tf.GradientTape() as tape:
            tape.watch([w, gamma, beta])
            h = tf.nn.conv2d(x, w, 1, "SAME", name="conv")
            mean, var = tf.nn.moments(h, [0, 1, 2], keepdims=True)
            y = tf.nn.relu(tf.nn.batch_normalization(
                h, mean, var, beta if center else None, gamma if scale else None, epsilon))
            out = tf.nn.conv2d(y, w, 1, "SAME", name="conv_out")
            loss = tf.reduce_mean(tf.square(out))
        grads = tape.gradient(loss, [w, gamma, beta],
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return [out, tf.identity(mean), tf.identity(var)] + grads
    return step


def _trace(fn, specs):
    concrete = tf.function(fn, autograph=False).get_concrete_function(*specs)
    return (concrete.graph.as_graph_def(add_shapes=True),
            [t.name for t in concrete.graph.outputs])


def _values(mean=3.0):
    x = (mean + RNG.normal(size=(B, H, W, C))).astype("float32")
    w = (np.eye(C, dtype="float32")[None, None]
         + RNG.normal(scale=0.1, size=(1, 1, C, C)).astype("float32"))
    gamma = RNG.uniform(0.5, 1.5, size=C).astype("float32")
    beta = RNG.normal(size=C).astype("float32")
    return dict(zip(["x", "w", "gamma", "beta"], (x, w, gamma, beta), strict=True))


def _specs(values):
    return [tf.TensorSpec(v.shape) for v in values.values()]


@pytest.mark.parametrize("scale, center", [(True, True), (False, True), (True, False),
                                           (False, False)])
def test_the_edit_alone_computes_the_same_values_in_float32(scale, center):
    """fuse_batch_norms on the float32 graph: one FusedBatchNormV3, no squares,
    and every output (y, the biased batch variance, the gradients) equal to float32
    rounding; with and without gamma and beta."""
    values = _values()
    graph_def, outputs = _trace(_bn_step(scale=scale, center=center), _specs(values))
    view = build_view(graph_def)
    fused = fuse_batch_norms(graph_def, view, tensor_shapes(graph_def, view), outputs)
    assert fused is not None and len(fused.made) == 1
    ops = [n.op for n in fused.graph_def.node]
    assert ops.count("FusedBatchNormV3") == 1
    assert "SquaredDifference" not in ops
    moments = [n for n in fused.graph_def.node if n.name.startswith("moments/")]
    assert {n.op for n in moments if n.name in ("moments/mean", "moments/variance")} == {
        "Reshape"}  # (the statistics are views of the fused kernel's)
    assert [n.op for n in graph_def.node].count("SquaredDifference") == 1  # (input untouched)
    assert tfamp.check_graph_def(fused.graph_def) == []
    want = run_graph_def(graph_def, values, outputs)
    got = run_graph_def(fused.graph_def, values, outputs)
    for name, a, b in zip(OUTPUTS, got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * np.abs(b).max(),
                                   err_msg=name)


def test_float16_on_the_executor_reads_the_activation_once_and_matches_float32():
    values = _values(mean=30.0)  # (|mean| >> std: x - mean must not be rounded to 16-bit)
    graph_def, outputs = _trace(_bn_step(), _specs(values))
    new_graph_def, report = tfamp.rewrite_graph_def(
        graph_def, tfamp.AmpConfig(dtype="float16", device_type="GPU", runtime="executor"),
        outputs=outputs)
    assert tfamp.check_graph_def(new_graph_def) == []
    assert [e["edit"] for e in report.broadcast_edits].count("fused") == 1
    assert "1 batch normalisation (moments and normalise) computed as one FusedBatchNormV3" \
        in report.edits_line()
    fused = [n for n in new_graph_def.node if n.op == "FusedBatchNormV3"]
    assert len(fused) == 1
    assert fused[0].attr["T"].type == tf.float16.as_datatype_enum
    assert fused[0].attr["U"].type == tf.float32.as_datatype_enum
    by_name = {n.name: n for n in report.nodes}
    # The statistics are float32 statistics, and the gradient's x - mean stays
    # float32 on them (its rounding would be one error shared by every element).
    centred = [n for n in report.nodes if n.kind == rk.KIND_CENTRED]
    assert centred and all(not n.converted for n in centred)
    assert any(n.kind == rk.KIND_STATISTIC for n in by_name.values())
    got = run_graph_def(new_graph_def, values, outputs)
    want = run_graph_def(graph_def, values, outputs)
    for name, a, b in zip(OUTPUTS, got, want, strict=True):
        assert np.isfinite(a).all(), name
        np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-2 * np.abs(b).max(), err_msg=name)
    assert not np.array_equal(got[0], want[0])  # (16-bit math did run)


def test_an_open_batch_is_fused_and_its_variance_unbiased_where_the_step_runs():
    """Traced with an open batch (a custom loop's input_signature, Keras's retrace
    for a last, smaller batch): fused, (n - 1) / n computed from x's size, the
    same values as the separate ops for two batch sizes."""
    values = _values()
    specs = _specs(values)
    specs[0] = tf.TensorSpec([None, H, W, C])
    graph_def, outputs = _trace(_bn_step(), specs)
    view = build_view(graph_def)
    fused = fuse_batch_norms(graph_def, view, tensor_shapes(graph_def, view), outputs)
    assert fused is not None and len(fused.made) == 1
    assert tfamp.check_graph_def(fused.graph_def) == []
    for batch in (B, 1):
        inputs = dict(values, x=values["x"][:batch])
        want = run_graph_def(graph_def, inputs, outputs)
        got = run_graph_def(fused.graph_def, inputs, outputs)
        for name, a, b in zip(OUTPUTS, got, want, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * np.abs(b).max(),
                                       err_msg=f"{name}, batch {batch}")


def test_under_xla_only_the_statistics_are_fused():
    """Under XLA the fused op computes the batch statistics and y stays the
    layer's own x * inv + shift, which XLA fuses into its readers (a smaller H100
    program: BUILD_NOTES.md, session 27); float32's values within 16-bit, run by
    TensorFlow's kernels and compiled by XLA."""
    values = _values(mean=30.0)
    graph_def, outputs = _trace(_bn_step(), _specs(values))
    new_graph_def, report = tfamp.rewrite_graph_def(
        graph_def, tfamp.AmpConfig(dtype="float16", device_type="GPU", runtime="xla"),
        outputs=outputs)
    assert report.runtime == "xla"
    assert [e["edit"] for e in report.broadcast_edits].count("fused statistics") == 1
    assert "the batch statistics of 1 batch normalisation (moments) computed by one " \
        "FusedBatchNormV3" in report.edits_line()
    ops = collections.Counter(n.op for n in new_graph_def.node)
    assert ops["FusedBatchNormV3"] == 1 and ops["SquaredDifference"] == 0
    by_name = {n.name: n for n in new_graph_def.node}
    assert by_name["batchnorm/mul"].op == "Mul"  # (x * inv: still the layer's)
    assert by_name["batchnorm/add_1"].op in ("Add", "AddV2")
    want = run_graph_def(graph_def, values, outputs)
    for jit_compile in (False, True):
        got = run_graph_def(new_graph_def, values, outputs, jit_compile=jit_compile)
        for name, a, b in zip(OUTPUTS, got, want, strict=True):
            np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-2 * np.abs(b).max(),
                                       err_msg=f"{name}, jit_compile={jit_compile}")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_under_xla_the_statistics_and_the_centring_stay_float32(dtype):
    """The shift, x - s and the fused op's sums are float32 (XLA fuses the Cast of
    x into the sums), and so are the statistics and the gradient's x - mean in
    bfloat16 too: rounded to 16-bit, x - mean would carry one error shared by
    every element (session 26's fused op left it bfloat16 under XLA)."""
    values = _values(mean=30.0)
    graph_def, outputs = _trace(_bn_step(), _specs(values))
    new_graph_def, report = tfamp.rewrite_graph_def(
        graph_def, tfamp.AmpConfig(dtype=dtype, device_type="GPU", runtime="xla"),
        outputs=outputs)
    by_name = {n.name: n for n in report.nodes}
    fused = "batchnorm/add_1/tfamp_batch_norm"
    for name in (f"{fused}/shift_value", f"{fused}/shift", f"{fused}/shifted", fused,
                 "moments/mean", "moments/variance", "gradient_tape/moments/sub"):
        assert not by_name[name].converted, (name, by_name[name].reason)
    assert by_name[f"{fused}/shifted"].kind == rk.KIND_CENTRED
    assert by_name["gradient_tape/moments/sub"].kind == rk.KIND_CENTRED
    nodes = {n.name: n for n in new_graph_def.node}
    assert nodes[fused].attr["T"].type == tf.float32.as_datatype_enum
    assert by_name["batchnorm/add_1"].converted  # (y itself is 16-bit)


def test_under_xla_a_mean_far_from_zero_keeps_its_variance():
    """XLA computes a fused batch variance as E[x^2] - E[x]^2, which cancels when
    the mean is large against the spread (here 3000 against 1: negative variances,
    then NaN, in the fused op compiled as it is). The edit gives the fused op
    x - s, s one value of x per channel, and adds s back to the mean: the
    statistics compiled by XLA are float32's, and so are y and the gradients as
    far as float32 itself agrees with them (its two runs below)."""
    values = _values(mean=3000.0)
    graph_def, outputs = _trace(_bn_step(), _specs(values))
    view = build_view(graph_def)
    fused = fuse_batch_norms(graph_def, view, tensor_shapes(graph_def, view), outputs,
                             runtime="xla")
    assert fused is not None and fused.edit == "fused statistics"
    assert tfamp.check_graph_def(fused.graph_def) == []
    want = run_graph_def(graph_def, values, outputs, jit_compile=True)
    got = run_graph_def(fused.graph_def, values, outputs, jit_compile=True)
    plain = run_graph_def(graph_def, values, outputs)  # (float32's own spread)
    for name, a, b, c in zip(OUTPUTS, got, want, plain, strict=True):
        assert np.isfinite(a).all(), name
        spread = np.abs(c - b).max()
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2 * spread + 1e-5 * np.abs(b).max(),
                                   err_msg=name)
    assert (got[2] > 0.5).all()  # (the variance is about 1 in every channel)


@pytest.mark.parametrize("flavour", [keras, tf_keras], ids=["keras3", "tf_keras"])
def test_keras_batchnorm_layers_are_fused(flavour):
    """Keras 3's BatchNormalization and tf_keras's with fused=False, in a residual
    step with their variables: both layers fused, their moving averages still read
    the batch statistics, no activation cast to float32 for them."""
    fused_kw = None if flavour is keras else False
    step = _residual_step(flavour, fused=fused_kw)
    concrete = tf.function(step, autograph=False).get_concrete_function(
        tf.TensorSpec([B, H, W, C]))
    graph_def = concrete.graph.as_graph_def(add_shapes=True)
    new_graph_def, report = tfamp.rewrite_graph_def(
        graph_def, tfamp.AmpConfig(dtype="float16", device_type="GPU", runtime="executor"),
        outputs=[t.name for t in concrete.graph.outputs])
    assert tfamp.check_graph_def(new_graph_def) == []
    fused = [n for n in new_graph_def.node if n.op == "FusedBatchNormV3"]
    assert len(fused) == 2 and all(
        n.attr["T"].type == tf.float16.as_datatype_enum for n in fused)
    nodes = {n.name: n for n in new_graph_def.node}
    assert not [n for n in new_graph_def.node if n.op == "SquaredDifference"]
    # Each moving average still reads the batch statistics (through the Means,
    # now views of the fused kernel's outputs).
    assigns = [n for n in new_graph_def.node if n.op in ("AssignVariableOp", "AssignSubVariableOp")
               and "bn" in n.name and "sgd" not in n.name]
    assert len(assigns) >= 4

    def reaches_fused(name, depth=8):
        node = nodes[name.split(":")[0].lstrip("^")]
        if node.op == "FusedBatchNormV3":
            return True
        return depth > 0 and any(reaches_fused(i, depth - 1) for i in node.input
                                 if not i.startswith("^"))
    assert all(reaches_fused(a.input[1]) for a in assigns), [a.name for a in assigns]


@pytest.mark.parametrize("change", ["epsilon fed", "open channels", "mul read elsewhere",
                                    "2-D input"])
def test_what_is_not_fused(change):
    """The edit needs the pattern exactly: anything else is left as it was."""
    def step(x, gamma, beta):
        epsilon = 1e-5
        if change == "epsilon fed":  # (a value known only at run time)
            epsilon = tf.reduce_min(tf.abs(gamma)) * 1e-5
        if change == "2-D input":
            x = tf.reshape(x, [-1, C])
        axes = [0] if change == "2-D input" else [0, 1, 2]
        mean, var = tf.nn.moments(x, axes, keepdims=True)
        inv = tf.math.rsqrt(var + epsilon) * gamma
        scaled = x * inv
        y = tf.nn.relu(scaled + (beta - mean * inv))
        return [y, scaled] if change == "mul read elsewhere" else [y]

    channels = None if change == "open channels" else C
    graph_def, outputs = _trace(step, [tf.TensorSpec([B, H, W, channels]),
                                       tf.TensorSpec([channels]), tf.TensorSpec([channels])])
    view = build_view(graph_def)
    assert fuse_batch_norms(graph_def, view, tensor_shapes(graph_def, view), outputs) is None
    # (and the same step with none of the changes is: epsilon 1e-5, below the
    # 1.001e-5 floor of tf_keras's fused layer, which cuDNN no longer needs)
    change = None
    graph_def, outputs = _trace(step, [tf.TensorSpec([B, H, W, C]), tf.TensorSpec([C]),
                                       tf.TensorSpec([C])])
    view = build_view(graph_def)
    assert fuse_batch_norms(graph_def, view, tensor_shapes(graph_def, view),
                            outputs) is not None


def _cnn_run(tiny: bool, enable: bool, jit_compile: bool = False
             ) -> tuple[np.ndarray, dict, list]:
    """A Keras 3 conv / BatchNorm / ReLU net trained 3 steps on TensorFlow's
    executor (or compiled by XLA): (weight change, last history values, reports)."""
    keras.utils.set_random_seed(3)
    inputs = keras.Input((H, W, 3))
    h = inputs
    for width in (8, 16):
        h = keras.layers.Conv2D(width, 3, padding="same", use_bias=False)(h)
        h = keras.layers.ReLU()(keras.layers.BatchNormalization()(h))
    outputs = keras.layers.Dense(2)(keras.layers.GlobalAveragePooling2D()(h))
    model = keras.Model(inputs, outputs)
    scale = 1e-6 if tiny else 1.0
    model.compile(optimizer=keras.optimizers.SGD(0.05 / scale), jit_compile=jit_compile,
                  loss=lambda y, p: scale * keras.losses.mean_squared_error(y, p))
    if enable:
        tfamp.enable(model)
    rng = np.random.default_rng(5)
    x = rng.normal(size=(3 * B, H, W, 3)).astype("float32")
    y = rng.normal(size=(3 * B, 2)).astype("float32")
    before = [np.array(v.numpy(), copy=True) for v in model.weights]
    history = model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    delta = np.concatenate([(np.asarray(v.numpy()) - w).ravel()
                            for v, w in zip(model.weights, before, strict=True)])
    reports = list(model.train_function.reports) if enable else []
    return delta, {k: float(v[-1]) for k, v in history.history.items()}, reports


@pytest.mark.parametrize("tiny", [False, True], ids=["normal", "tiny-loss"])
def test_keras3_fit_on_the_executor_trains_like_float32(tiny):
    """The whole path: tfamp.enable on a Keras 3 model compiled without XLA fuses
    its BatchNorms, and each weight's (and moving statistic's) change matches
    float32's; the tiny loss (x 1e-6, learning rate x 1e6) tells a loss-scaled
    run from an unscaled one, whose float16 gradients would underflow."""
    from tests.patterns import compare
    want, _, _ = _cnn_run(tiny, enable=False)
    got, history, reports = _cnn_run(tiny, enable=True)
    assert [e["edit"] for e in reports[0].broadcast_edits].count("fused") == 2
    assert reports[0].runtime == "executor"
    cosine, ratio = compare(want, got)
    assert cosine > 0.999 and abs(ratio - 1) < 0.01, (cosine, ratio)
    assert history["skipped_steps"] == 0


@pytest.mark.parametrize("tiny", [False, True], ids=["normal", "tiny-loss"])
def test_keras3_fit_compiled_by_xla_trains_like_float32(tiny):
    """The same under jit_compile=True: TensorFlow lowers the fused op for XLA
    (BatchNormTraining), and the step's change of every variable, the moving
    statistics' included, matches float32's compiled step."""
    from tests.patterns import compare
    want, _, _ = _cnn_run(tiny, enable=False, jit_compile=True)
    got, history, reports = _cnn_run(tiny, enable=True, jit_compile=True)
    assert [e["edit"] for e in reports[0].broadcast_edits].count("fused statistics") == 2
    assert reports[0].runtime == "xla"
    cosine, ratio = compare(want, got)
    assert cosine > 0.999 and abs(ratio - 1) < 0.01, (cosine, ratio)
    assert history["skipped_steps"] == 0


@pytest.mark.parametrize("statistic_used", [False, True])
def test_a_forward_is_fused_only_if_nothing_else_differentiates_its_statistics(
        statistic_used):
    """A forward-only graph (a model called in a custom loop's step, which
    TensorFlow differentiates later through FusedBatchNormV3's own gradient, one
    with nothing for the batch statistics): fused, unless a statistic is also used
    on another path (that gradient would be lost)."""
    def forward(x, gamma, beta):
        mean, var = tf.nn.moments(x, [0, 1, 2], keepdims=True)
        y = tf.nn.relu(tf.nn.batch_normalization(x, mean, var, beta, gamma, 1e-3))
        return y + tf.reduce_mean(mean) if statistic_used else y

    graph_def, outputs = _trace(forward, [tf.TensorSpec([B, H, W, C]), tf.TensorSpec([C]),
                                          tf.TensorSpec([C])])
    view = build_view(graph_def)
    fused = fuse_batch_norms(graph_def, view, tensor_shapes(graph_def, view), outputs)
    assert (fused is None) == statistic_used


def _custom_loop_run(tiny: bool, enable: bool):
    """A Keras 3 conv / BatchNorm net trained 3 steps by the user's own
    tf.function step: its call is a nested rewritten forward (fused), which
    TensorFlow differentiates through FusedBatchNormV3's gradient. Returns the
    weight change (moving statistics included)."""
    keras.utils.set_random_seed(4)
    inputs = keras.Input((H, W, 3))
    h = keras.layers.Conv2D(8, 3, padding="same", use_bias=False)(inputs)
    h = keras.layers.ReLU()(keras.layers.BatchNormalization()(h))
    outputs = keras.layers.Dense(2)(keras.layers.GlobalAveragePooling2D()(h))
    model = keras.Model(inputs, outputs)
    scale = 1e-6 if tiny else 1.0
    optimizer = keras.optimizers.SGD(0.05 / scale)
    if enable:
        tfamp.enable(model, verbose=False)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = scale * tf.reduce_mean((model(x, training=True) - y) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
        return loss

    rng = np.random.default_rng(6)
    x = rng.normal(size=(B, H, W, 3)).astype("float32")
    y = rng.normal(size=(B, 2)).astype("float32")
    before = [np.array(v.numpy(), copy=True) for v in model.weights]
    for _ in range(3):
        step(x, y)
    graph_def = step.get_concrete_function(x, y).graph.as_graph_def()
    ops = [n.op for f in graph_def.library.function for n in f.node_def]
    fused = (ops.count("FusedBatchNormV3"), ops.count("FusedBatchNormGradV3"))
    delta = np.concatenate([(np.asarray(v.numpy()) - w).ravel()
                            for v, w in zip(model.weights, before, strict=True)])
    return delta, fused


@pytest.mark.parametrize("tiny", [False, True], ids=["normal", "tiny-loss"])
def test_a_custom_loop_differentiates_the_fused_forward_like_float32(tiny):
    from tests.patterns import compare
    want, _ = _custom_loop_run(tiny, enable=False)
    got, fused = _custom_loop_run(tiny, enable=True)
    # (the nested forward's BatchNorm, in the step's library, and its gradient)
    assert fused[0] >= 1 and fused[1] >= 1, fused
    cosine, ratio = compare(want, got)
    assert cosine > 0.999 and abs(ratio - 1) < 0.01, (cosine, ratio)
