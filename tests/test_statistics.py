"""Normalisation in 16-bit: statistics stay float32, the activation path does not.

A reduction on the deny list (Mean, Sum) whose output is a small statistic of
its input accumulates in float32, and only ops as small as its output (the
statistics) stay float32 after it; the big normalise / scale / shift / ReLU /
residual Add chain and its gradient are decided by the usual rules, and the
small statistics are what gets cast. The ops that compute the values a
variance reduces (SquaredDifference, Square) stay float32 with it.
"""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tfamp
from tests.graphs import run_graph_def
from tfamp.rewrite import reasons as rk

REDUCTIONS = {"Mean", "Sum"}
CENTRING = {"Sub", "SquaredDifference"}  # x - mean: float32 with the mean
# Element-wise ops of the normalise chain (and its gradient) that a big tensor flows through.
CHAIN_OPS = {"Mul", "AddV2", "Sub", "Relu", "ReluGrad", "RealDiv"}
B, H, W, C = 4, 6, 6, 8
ACTIVATION = B * H * W * C
BIG_BATCH = 16384  # (traced only: 4.7M-element activations)
RNG = np.random.default_rng(0)


@pytest.fixture
def separate_ops(monkeypatch):
    """The batch normalisation left as its separate ops, as where fuse_norm's pattern
    does not match (a channel axis it does not know, a normalisation in a function
    body): the colouring of the moments and the normalise chain is what is tested."""
    from tfamp.rewrite import pipeline
    monkeypatch.setattr(pipeline, "fuse_batch_norms", lambda *args, **kwargs: None)


def _rewrite(fn, specs, device_type="GPU", runtime="auto"):
    """(original GraphDef, rewritten GraphDef, report) of `fn` traced with shapes."""
    concrete = tf.function(fn, autograph=False).get_concrete_function(*specs)
    graph_def = concrete.graph.as_graph_def(add_shapes=True)
    outputs = [t.name for t in concrete.graph.outputs]
    new_graph_def, report = tfamp.rewrite_graph_def(
        graph_def, tfamp.AmpConfig(dtype="float16", device_type=device_type,
                                   runtime=runtime),
        outputs=outputs)
    assert tfamp.check_graph_def(new_graph_def) == []
    return graph_def, new_graph_def, report


def _elements(graph_def):
    """node name -> elements of its output 0 (None where unknown)."""
    sizes = {}
    for node in graph_def.node:
        shapes = node.attr["_output_shapes"].list.shape if "_output_shapes" in node.attr else []
        if not shapes or shapes[0].unknown_rank or any(d.size < 0 for d in shapes[0].dim):
            sizes[node.name] = None
        else:
            sizes[node.name] = math.prod(d.size for d in shapes[0].dim)
    return sizes


def _consumers(graph_def):
    found = {}
    for node in graph_def.node:
        for name in node.input:
            found.setdefault(name.lstrip("^").split(":")[0], []).append(node)
    return found


def _input_dtype(graph_def, node_name, index=0):
    """The dtype a node's input `index` arrives in, in a rewritten graph."""
    nodes = {n.name: n for n in graph_def.node}
    source = nodes[nodes[node_name].input[index].split(":")[0]]
    if source.op == "Cast":
        return tf.as_dtype(source.attr["DstT"].type).name
    return tf.as_dtype(source.attr["T"].type).name


def _check_statistics_are_cast(graph_def, new_graph_def, report, forward_scope,
                               activation=None):
    """What every normalisation test asserts (see the module docstring)."""
    activation = activation or ACTIVATION
    sizes = _elements(graph_def)
    nodes = {n.name: n for n in graph_def.node}
    by_name = {n.name: n for n in report.nodes if not n.function}
    # 1. The big element-wise ops of the forward normalise chain are 16-bit.
    chain = [n for n in by_name.values()
             if n.op in CHAIN_OPS and forward_scope in n.name and "gradient" not in n.name
             and sizes.get(n.name) == activation]
    assert len(chain) >= 2, [n.name for n in chain]  # (at least the normalise Mul and Add)
    for n in chain:
        assert n.converted, (n.name, n.reason)
    # 2. Nothing is held float32 as "downstream of a deny op" (the statistics
    #    that are float32 say so with their own kind).
    assert not [n.name for n in by_name.values() if n.kind == rk.KIND_DOWNSTREAM_OF_DENY]
    assert any(n.kind == rk.KIND_STATISTIC for n in by_name.values())
    # 3. The variance: SquaredDifference and the Mean of it stay float32.
    squared = [n for n in by_name.values() if n.op == "SquaredDifference"]
    assert squared
    for n in squared:
        assert not n.converted, n.name
        for consumer in _consumers(graph_def)[n.name]:
            if consumer.op == "Mean":
                assert not by_name[consumer.name].converted
                assert _input_dtype(new_graph_def, consumer.name) == "float32"
    # 4. Gradient Sums of big tensors (beta and gamma gradients) read float32.
    sums = [n for n in by_name.values() if n.op == "Sum" and sizes.get(
        nodes[n.name].input[0].split(":")[0]) == activation]
    for n in sums:
        assert not n.converted and _input_dtype(new_graph_def, n.name) == "float32", n.name
    # 5. Casts to float16 are of small tensors (statistics, weights), never of
    #    an activation (the step's own input aside); Casts of an activation to
    #    float32 feed only reductions (directly, or through the op computing
    #    what is reduced), the ops that centre it on a float32 mean, and under
    #    XLA a sum of gradient terms a reduction reads (kept float32 so that the
    #    reduction fuses with it: test_a_sum_of_16bit_and_float32_terms_...).
    new_consumers = _consumers(new_graph_def)
    for cast in (n for n in new_graph_def.node if "tfamp_cast" in n.name):
        source = cast.input[0].split(":")[0]
        if nodes[source].op == "Placeholder" or forward_scope not in source:
            continue  # (the step's input; the loss's gradient)
        if cast.attr["DstT"].type == tf.float16.as_datatype_enum:
            # (or a big value computed in float32 on purpose and rounded once:
            # a centred value after its scaling, a sum after its division by N)
            assert (sizes.get(source) or 0) < activation or by_name[source].kind in (
                rk.KIND_CENTRED, rk.KIND_STATISTIC), (cast.name, by_name[source].kind)
        elif sizes.get(source) == activation:
            for consumer in new_consumers[cast.name]:
                held = by_name.get(consumer.name)
                assert consumer.op in REDUCTIONS | CENTRING or all(
                    c.op in REDUCTIONS for c in new_consumers[consumer.name]) or (
                        held is not None and held.kind == rk.KIND_FEWER_BYTES
                        and "a reduction reads it" in held.reason), (cast.name, consumer.name)


def _residual_step(flavour, fused=None):
    """A conv + BatchNorm(training=True) + ReLU + conv + BatchNorm + residual Add
    + ReLU step with its gradients, on `flavour`'s layers (Keras 3 or tf_keras)."""
    layers = flavour.layers
    kwargs = {} if fused is None else {"fused": fused}
    conv1 = layers.Conv2D(C, 3, padding="same", name="conv1")
    bn1 = layers.BatchNormalization(name="bn1", **kwargs)
    conv2 = layers.Conv2D(C, 3, padding="same", name="conv2")
    bn2 = layers.BatchNormalization(name="bn2", **kwargs)
    x0 = tf.zeros([B, H, W, C])
    bn2(conv2(bn1(conv1(x0))))  # (builds the weights outside the traced step)
    weights = [v for layer in (conv1, bn1, conv2, bn2) for v in layer.trainable_weights]

    def step(x):
        with tf.GradientTape() as tape:
            h = tf.nn.relu(bn1(conv1(x), training=True), name="relu1")
            h = bn2(conv2(h), training=True)
            y = tf.nn.relu(tf.add(h, x, name="residual"), name="relu2")
            loss = tf.reduce_mean(tf.square(y))
        return [loss] + tape.gradient(loss, weights)
    return step


@pytest.mark.parametrize("flavour", [keras, tf_keras], ids=["keras3", "tf_keras"])
def test_batchnorm_chain_is_16bit_and_statistics_are_cast(flavour, separate_ops):
    fused = None if flavour is keras else False  # (tf_keras's fused op: next test)
    step = _residual_step(flavour, fused=fused)
    # The separate ops (where they match, they are one FusedBatchNormV3:
    # test_fuse_norm.py).
    graph_def, new_graph_def, report = _rewrite(step, [tf.TensorSpec([B, H, W, C])],
                                                runtime="xla")
    _check_statistics_are_cast(graph_def, new_graph_def, report, "bn")
    by_name = {n.name: n for n in report.nodes if not n.function}
    for name in ("relu1", "residual", "relu2"):
        assert by_name[name].converted, by_name[name].reason


@pytest.mark.parametrize("device_type, converted, kind", [
    ("GPU", True, rk.KIND_ACCUMULATES_FP32), ("CPU", False, rk.KIND_DENY_LIST)])
def test_a_mean_reads_16bit_only_where_its_kernel_accumulates_in_float32(
        device_type, converted, kind):
    """A global average pool (a Mean nothing is centred on) reads float16 on a GPU;
    the BatchNorm means, which centre their input, stay float32 everywhere (on the
    executor they come from the fused kernel, in float32: test_fuse_norm.py)."""
    conv = keras.layers.Conv2D(C, 3, padding="same", name="conv")
    bn = keras.layers.BatchNormalization(name="bn")
    dense = keras.layers.Dense(3, name="head")
    x0 = tf.zeros([B, H, W, C])
    dense(tf.reduce_mean(bn(conv(x0)), axis=[1, 2]))
    weights = [v for layer in (conv, bn, dense) for v in layer.trainable_weights]

    def step(x):
        with tf.GradientTape() as tape:
            pooled = tf.reduce_mean(tf.nn.relu(bn(conv(x), training=True)), axis=[1, 2],
                                    name="pool")
            loss = tf.reduce_mean(tf.square(dense(pooled)))
        return [loss] + tape.gradient(loss, weights)

    _, new_graph_def, report = _rewrite(step, [tf.TensorSpec([B, H, W, C])], device_type)
    pool = next(n for n in report.nodes if n.name == "pool")
    assert (pool.converted, pool.kind) == (converted, kind), pool.reason
    assert _input_dtype(new_graph_def, "pool") == ("float16" if converted else "float32")
    bn_mean = next(n for n in report.nodes if n.name.endswith("moments/mean"))
    assert not bn_mean.converted, bn_mean.reason
    fused = [n for n in new_graph_def.node if n.op == "FusedBatchNormV3"]
    assert len(fused) == 1  # (the executor: one fused kernel, statistics in float32)
    assert fused[0].attr["U"].type == tf.float32.as_datatype_enum
    assert bn_mean.kind == rk.KIND_STATISTIC and bn_mean.op == "Reshape", bn_mean.reason


def test_tf_keras_fused_batchnorm_still_computes_in_16bit():
    step = _residual_step(tf_keras, fused=True)
    _, _, report = _rewrite(step, [tf.TensorSpec([B, H, W, C])])
    fused = [n for n in report.nodes if n.op.startswith("FusedBatchNorm")]
    assert fused and all(n.converted for n in fused)


@pytest.mark.parametrize("norm", ["layer", "group"])
def test_layer_and_group_norm_chain_is_16bit(norm):
    dense = keras.layers.Dense(C, name="dense")
    layer = (keras.layers.LayerNormalization(name="norm") if norm == "layer"
             else keras.layers.GroupNormalization(groups=2, name="norm"))
    out = keras.layers.Dense(C, name="out")
    x0 = tf.zeros([1, H * W, C])
    out(layer(dense(x0)))
    weights = [v for lay in (dense, layer, out) for v in lay.trainable_weights]

    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(out(layer(dense(x)))))
        return [loss] + tape.gradient(loss, weights)

    # (A large batch: on TensorFlow's executor a Cast's launch costs about
    # 10 MB of traffic, more than 16-bit saves on a few thousand elements.)
    batch = BIG_BATCH
    graph_def, new_graph_def, report = _rewrite(step, [tf.TensorSpec([batch, H * W, C])])
    _check_statistics_are_cast(graph_def, new_graph_def, report, "norm",
                               activation=batch * H * W * C)
    if norm == "layer":
        # The full-size scale and shift (per-row statistics times per-feature
        # gamma and beta) are built in 16-bit from the cast statistics.
        combined = [n for n in report.nodes if n.kind == rk.KIND_COMBINES_STATISTICS]
        assert {n.op for n in combined} >= {"Mul", "AddV2"}, combined


def test_a_reduction_that_keeps_its_size_is_a_copy():
    """A Mean over an axis of one element copies its input: a clear op (no
    deny spreads from it), exact in 16-bit; the Add after it runs in 16-bit
    between the two MatMuls, and so does the reduction. (TensorFlow's
    gradients of broadcasting ops sum over no axis at all.)"""
    def fn(x, w):
        y = tf.matmul(x, w, name="mm")
        m = tf.reduce_mean(tf.reshape(y, [4, 4, 1]), axis=2, name="same_size")  # 16 -> 16
        return tf.matmul(tf.add(m, 1.0, name="after"), w, name="mm2")

    spec = tf.TensorSpec([4, 4])
    graph_def, new_graph_def, report = _rewrite(fn, [spec, spec])
    by_name = {n.name: n for n in report.nodes}
    assert by_name["same_size"].list == "clear" and by_name["same_size"].converted
    assert by_name["after"].converted, by_name["after"].reason
    x = RNG.standard_normal((4, 4)).astype(np.float32)
    want, = run_graph_def(graph_def, {"x": x, "w": x}, ["Identity:0"])
    got, = run_graph_def(new_graph_def, {"x": x, "w": x}, ["Identity:0"])
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())


def _residual_gradient(x, w, u):
    """A residual add of two same-shaped branches and its gradient: with an unknown
    batch, TensorFlow sums dy over BroadcastGradientArgs' axes (none at run time)."""
    with tf.GradientTape() as tape:
        tape.watch([w, u])
        y = tf.add(tf.matmul(x, w, name="left"), tf.matmul(x, u, name="right"), name="res")
        loss = tf.reduce_sum(tf.matmul(y, w, name="head") * 1e-3)
    return tape.gradient(loss, [w, u])


def test_a_broadcast_gradients_sum_over_no_axis_is_a_copy_with_an_unknown_batch():
    """keras.io's residual blocks fed by tf.data without drop_remainder (batch None):
    the Sum's result has no static shape, and it was held float32 as a deny op, with
    every activation gradient behind it ("100% of float32's traffic" in float16)."""
    specs = [tf.TensorSpec([None, 8]), tf.TensorSpec([8, 8]), tf.TensorSpec([8, 8])]
    graph_def, new_graph_def, report = _rewrite(_residual_gradient, specs)
    sums = [n for n in report.nodes if n.op == "Sum" and "/res/" in n.name]
    assert len(sums) == 2 and all(n.list == "clear" and n.converted for n in sums), sums
    assert report.traffic_share is not None and report.traffic_share < 0.75, report.traffic_share
    x = RNG.standard_normal((5, 8)).astype(np.float32)
    w, u = (RNG.standard_normal((8, 8)).astype(np.float32) for _ in range(2))
    feeds = {"x": x, "w": w, "u": u}
    for want, got in zip(run_graph_def(graph_def, feeds, ["Identity:0", "Identity_1:0"]),
                         run_graph_def(new_graph_def, feeds, ["Identity:0", "Identity_1:0"]),
                         strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())


def test_a_layer_norms_backward_sum_is_a_statistic_with_an_unknown_batch():
    """Keras 3's LayerNorm, x * inv + (beta - mean * inv): the gradient of mean * inv
    for the mean sums dy * inv over the channels (BroadcastGradientArgs' axes). With an
    unknown batch its result had no size, so it was a plain deny op and the residual
    stream's gradient stayed float32 behind it (keras.io's miniature GPT); its size is
    the mean's, a small statistic: only what is as small stays float32 after it."""
    def fn(x, w, gamma):
        with tf.GradientTape() as tape:
            tape.watch([w, gamma])
            h = tf.matmul(x, w, name="proj")
            mean, var = tf.nn.moments(h, axes=[-1], keepdims=True)
            inv = tf.math.rsqrt(var + 1e-3) * gamma
            y = h * inv + (0.5 - mean * inv)
            loss = tf.reduce_sum(tf.matmul(y, w, name="head") * 1e-3)
        return tape.gradient(loss, [w, gamma])

    specs = [tf.TensorSpec([None, 64]), tf.TensorSpec([64, 64]), tf.TensorSpec([64])]
    graph_def, new_graph_def, report = _rewrite(fn, specs)
    [sum_for_mean] = [n for n in report.nodes if n.op == "Sum"
                      and n.name.startswith("gradient_tape/mul_") and n.name.endswith("/Sum")
                      and "statistic" in n.reason]
    assert sum_for_mean.list == "deny" and "statistic of its 64 x B" in sum_for_mean.reason
    assert not [n for n in report.nodes if not n.converted
                and f"downstream of Sum '{sum_for_mean.name}'" in n.reason
                and n.op in ("Mul", "AddV2", "AddN")]
    x = RNG.standard_normal((5, 64)).astype(np.float32)
    w = (RNG.standard_normal((64, 64)) / 8).astype(np.float32)
    feeds = {"x": x, "w": w, "gamma": np.ones(64, np.float32)}
    for want, got in zip(run_graph_def(graph_def, feeds, ["Identity:0", "Identity_1:0"]),
                         run_graph_def(new_graph_def, feeds, ["Identity:0", "Identity_1:0"]),
                         strict=True):
        np.testing.assert_allclose(got, want, rtol=3e-2, atol=3e-2 * np.abs(want).max())


def test_a_broadcast_gradients_sum_over_a_broadcast_axis_stays_float32():
    """The operand a row vector, broadcast along the unknown batch: its Sum reduces
    over the batch, a float16 deny op. (TensorFlow computes such a Sum's axes at run
    time; one over no axis, as a residual add's is, is not told apart yet:
    BUILD_NOTES.md, session 38.)"""
    def fn(x, w, u):
        with tf.GradientTape() as tape:
            tape.watch([w, u])
            y = tf.add(tf.matmul(x, w, name="left"), u, name="res")  # u: [1, 8]
            loss = tf.reduce_sum(tf.matmul(y, w, name="head"))
        return tape.gradient(loss, [w, u])

    specs = [tf.TensorSpec([None, 8]), tf.TensorSpec([8, 8]), tf.TensorSpec([1, 8])]
    _, _, report = _rewrite(fn, specs)
    [bias_sum] = [n for n in report.nodes if n.op == "Sum" and "/res/" in n.name]
    assert bias_sum.list == "deny" and not bias_sum.converted, bias_sum  # over the batch


def test_a_sum_is_not_cast_to_16bit_before_it_is_scaled_back():
    """A broadcast sum (Tile of a Sum, then a division by a run-time count) stays
    float32 up to the division; a broadcast mean may be cast as it is."""
    def fn(x, w, count):
        y = tf.matmul(x, w, name="mm")
        total = tf.reduce_sum(y, axis=0, keepdims=True, name="total")
        spread = tf.tile(total, [64, 1], name="spread")
        scaled = tf.math.divide(spread, count, name="scaled")
        mean = tf.reduce_mean(y, axis=0, keepdims=True, name="mean")
        shifted = tf.add(tf.multiply(y, 2.0, name="twice"), tf.tile(mean, [64, 1], name="m64"),
                         name="shifted")
        return tf.matmul(tf.add(scaled, shifted, name="both"), w, name="mm2")

    spec = tf.TensorSpec([64, 16])
    _, _, report = _rewrite(fn, [spec, tf.TensorSpec([16, 16]), tf.TensorSpec([])])
    by_name = {n.name: n for n in report.nodes}
    for name in ("spread", "scaled"):
        assert not by_name[name].converted and by_name[name].kind == rk.KIND_STATISTIC, name
    for name in ("shifted", "both", "mm2"):
        assert by_name[name].converted, (name, by_name[name].reason)
    # (the mean's Tile is left to the Add, which broadcasts: see test_hoist)
    assert "m64" not in by_name and {(e["edit"], e["node"]) for e in report.broadcast_edits} == {
        ("dropped", "m64")}


@pytest.mark.parametrize("count", [64.0, 8.0])
def test_a_sum_divided_by_its_count_before_the_broadcast_is_a_mean(count):
    """With a constant count the division runs on the small sum (hoist), and
    the Add broadcasts it itself (the Tile is dropped). Divided by at least
    its 64 terms the sum is a mean, cast for the 16-bit Add; divided by fewer
    (8) it could still be past float16's range: the Add stays float32."""
    def fn(x, w):
        y = tf.matmul(x, w, name="mm")
        total = tf.reduce_sum(y, axis=0, keepdims=True, name="total")
        scaled = tf.math.divide(tf.tile(total, [64, 1], name="spread"), count, name="scaled")
        return tf.matmul(tf.add(scaled, tf.multiply(y, 2.0, name="twice"), name="both"), w,
                         name="mm2")

    spec = tf.TensorSpec([64, 16])
    graph_def, new_graph_def, report = _rewrite(fn, [spec, tf.TensorSpec([16, 16])])
    edits = {(e["edit"], e["node"], e["into"]) for e in report.broadcast_edits}
    assert edits == {("moved", "scaled", "spread"), ("dropped", "scaled", "both")}
    by_name = {n.name: n for n in report.nodes}
    assert "scaled" not in by_name and by_name["spread"].op == "RealDiv"
    assert by_name["spread"].kind == rk.KIND_STATISTIC and not by_name["spread"].converted
    assert by_name["both"].converted is (count == 64.0), by_name["both"].reason
    if count == 8.0:
        assert by_name["both"].kind == rk.KIND_STATISTIC
    x = RNG.standard_normal((64, 16)).astype(np.float32)
    w = RNG.standard_normal((16, 16)).astype(np.float32) / 4
    want = fn(tf.constant(x), tf.constant(w)).numpy()
    (got,) = run_graph_def(new_graph_def, {"x": x, "w": w}, ["Identity:0"])
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())


def test_variance_path_and_centring_stay_float32():
    """Square / SquaredDifference feeding a Mean stay float32 with the reduction, and
    so does x - mean up to its scaling; the normalised value goes on in 16-bit."""
    def fn(x, w):
        y = tf.matmul(x, w, name="mm")
        m = tf.reduce_mean(y, axis=0, keepdims=True, name="mean")
        v1 = tf.reduce_mean(tf.math.squared_difference(y, m, name="sqdiff"), axis=0, name="var1")
        v2 = tf.reduce_mean(tf.square(tf.subtract(y, m, name="centred"), name="sq"), axis=0,
                            name="var2")
        z = tf.multiply(tf.subtract(y, m, name="sub"), tf.math.rsqrt(v1 + v2 + 1e-3),
                        name="normalised")
        return tf.matmul(tf.nn.relu(z, name="relu"), w, name="mm2")

    spec = tf.TensorSpec([64, 16])
    _, new_graph_def, report = _rewrite(fn, [spec, tf.TensorSpec([16, 16])])
    by_name = {n.name: n for n in report.nodes}
    for name in ("sqdiff", "sq", "var1", "var2", "centred", "sub", "normalised"):
        assert not by_name[name].converted, (name, by_name[name].reason)
    for name in ("var1", "var2"):
        assert _input_dtype(new_graph_def, name) == "float32"
    for name in ("sqdiff", "sub", "normalised"):
        assert by_name[name].kind == rk.KIND_CENTRED, (name, by_name[name].kind)
    assert by_name["mm"].converted and by_name["mm2"].converted
    assert by_name["relu"].converted and _input_dtype(new_graph_def, "relu") == "float16"


def _bn_step(x, w, gamma, beta):
    """conv -> batch norm (moments, as Keras 3 computes it) -> ReLU -> conv, and gradients."""
    with tf.GradientTape() as tape:
        tape.watch([w, gamma, beta])
        h = tf.nn.conv2d(x, w, 1, "SAME", name="conv")
        mean, var = tf.nn.moments(h, [0, 1, 2], keepdims=True)
        y = tf.nn.relu(tf.nn.batch_normalization(h, mean, var, beta, gamma, 1e-3))
        out = tf.nn.conv2d(y, w, 1, "SAME", name="conv_out")
        loss = tf.reduce_mean(tf.square(out))
    return [out] + tape.gradient(loss, [w, gamma, beta])


@pytest.mark.parametrize("runtime, fused", [("executor", True), ("xla", True), ("xla", False)])
def test_batchnorm_step_matches_float32_where_squares_overflow_float16(runtime, fused,
                                                                       monkeypatch):
    """The fused kernel (16-bit on the executor; under XLA it sums x minus a
    shift in float32 and y is the layer's own 16-bit ops) and the separate
    statistics (where the fusion's pattern does not match)."""
    if not fused:
        from tfamp.rewrite import pipeline
        monkeypatch.setattr(pipeline, "fuse_batch_norms", lambda *args, **kwargs: None)
    # Activations of magnitude 100-200 with a few at +-400: (x - mean)^2 goes past
    # 65504 (a float16 variance would be inf), and so does x^2.
    x = RNG.uniform(100, 200, size=(B, H, W, C)).astype("float32")
    x[0, 0, 0, :] = 400.0
    x[1, 1, 1, :] = -400.0
    w = np.eye(C, dtype="float32")[None, None] + RNG.normal(
        scale=0.01, size=(1, 1, C, C)).astype("float32")
    gamma = RNG.uniform(0.5, 1.5, size=C).astype("float32")
    beta = RNG.normal(size=C).astype("float32")
    centred = x - x.mean(axis=(0, 1, 2))
    assert (centred ** 2).max() > 65504  # (the case this test is about)
    specs = [tf.TensorSpec(v.shape) for v in (x, w, gamma, beta)]
    graph_def, new_graph_def, report = _rewrite(_bn_step, specs, device_type="CPU",
                                                runtime=runtime)
    forward = [n for n in report.nodes if n.converted and "gradient" not in n.name and (
        n.op == "FusedBatchNormV3" or n.op in ("Mul", "AddV2") and "batchnorm" in n.name)]
    assert forward  # (the normalisation did go 16-bit)
    assert any(n.op == "FusedBatchNormV3" for n in forward) == (fused and runtime == "executor")
    assert any(n.op == "FusedBatchNormV3" for n in new_graph_def.node) == fused
    inputs = dict(zip(["x", "w", "gamma", "beta"], (x, w, gamma, beta), strict=True))
    outputs = [f"Identity{'_' + str(i) if i else ''}:0" for i in range(4)]
    want = run_graph_def(graph_def, inputs, outputs)
    got = run_graph_def(new_graph_def, inputs, outputs)
    for name, a, b in zip(["out", "d_w", "d_gamma", "d_beta"], got, want, strict=True):
        assert np.isfinite(a).all(), name
        np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-2 * np.abs(b).max(), err_msg=name)
    assert not np.array_equal(got[0], want[0])  # (16-bit math did run)


@pytest.mark.parametrize("dtype", [tf.float32, tf.float16, tf.bfloat16])
def test_a_count_is_read_from_a_constant_of_any_float_type(dtype):
    """The divisor that makes a sum a mean is read by value, also from a 16-bit
    Const (which a GraphDef stores as its bits)."""
    from tfamp.rewrite.graph import build_view, scalar_constant

    graph_def = tf.function(lambda: tf.constant(1568.0, dtype, name="count")
                            ).get_concrete_function().graph.as_graph_def()
    node = build_view(graph_def).bodies[0].nodes["count"]
    assert scalar_constant(node) == 1568.0


def _dense_step():
    """A step with Sums in its backward pass that are no per-example products
    (tfamp.rewrite.contract makes those one MatMul): a bias added by
    broadcasting after a dense layer on a 3-D input (its gradient is a Sum of
    the 16-bit gradient the next layer's MatMul writes), a shift that goes
    through softplus first and is added twice (its two gradient Sums are
    added, then feed softplus's gradient: steps inside the backward pass), and
    a forward Sum. The weights are arguments (watched), so the graph runs
    without variables."""
    seq, width, units = 16, 8, 8

    def step(x, kernel, bias, head, raw_shift):
        weights = [kernel, bias, head, raw_shift]
        with tf.GradientTape() as tape:
            tape.watch(weights)
            h = tf.add(tf.matmul(x, kernel, name="proj"), bias, name="biased")
            shift = tf.nn.softplus(raw_shift)
            u = tf.add(tf.matmul(h, head, name="mix"), shift, name="shift_a")
            v = tf.add(tf.matmul(tf.nn.relu(u), head, name="mix2"), shift, name="shift_b")
            pooled = tf.reduce_sum(tf.nn.relu(v), axis=1, name="pooled_sum")
            out = tf.matmul(pooled, tf.transpose(kernel), name="out")
            loss = tf.reduce_mean(tf.square(out))
        return [loss] + tape.gradient(loss, weights)

    specs = [tf.TensorSpec([B, seq, width]), tf.TensorSpec([width, units]),
             tf.TensorSpec([units]), tf.TensorSpec([units, units]), tf.TensorSpec([units])]
    values = {"x": RNG.standard_normal((B, seq, width)).astype(np.float32),
              "kernel": RNG.standard_normal((width, units)).astype(np.float32) / 3,
              "bias": RNG.standard_normal((units,)).astype(np.float32),
              "head": RNG.standard_normal((units, units)).astype(np.float32) / 3,
              "raw_shift": RNG.standard_normal((units,)).astype(np.float32)}
    return step, specs, values


@pytest.mark.parametrize("runtime", ["xla", "executor"])
def test_a_weight_gradient_sum_reads_16bit_under_xla(runtime):
    """Under XLA (which accumulates a 16-bit Sum in float32) a Sum whose result
    is a weight's gradient reads its float16 input as it is; on the executor
    (TensorFlow's GPU Sum kernel for half accumulates in half) it reads a
    float32 Cast. Sums inside the backward pass (their sum goes on to
    softplus's gradient) and a forward Sum stay float32 on both."""
    step, specs, values = _dense_step()
    graph_def, new_graph_def, report = _rewrite(step, specs, runtime=runtime)
    sums = {n.name: n for n in report.nodes if n.op == "Sum"}
    # (TensorFlow's gradient names: the bias's Sum, the shift's two)
    weight_grads = ["gradient_tape/biased/Sum"]
    inner = ["gradient_tape/shift_a/Sum", "gradient_tape/shift_b/Sum"]
    assert set(weight_grads + inner) <= set(sums), sorted(sums)
    readers = _consumers(graph_def)
    nodes = {n.name: n for n in graph_def.node}
    # (the tape adds the shift's two gradients with an AddN under no gradient
    # scope; what reads the sum is softplus's gradient)
    added = {r.name for name in inner for view in readers[name] for r in readers[view.name]}
    assert [nodes[name].op for name in added] == ["AddN"], added
    # (a 16-bit input: only the rule keeps that Sum float32)
    source = nodes[inner[0]].input[0].split(":")[0]
    assert next(n for n in report.nodes if n.name == source).converted
    for name in weight_grads:
        node = sums[name]
        if runtime == "xla":
            assert node.converted and node.kind == rk.KIND_ACCUMULATES_FP32, node.reason
            assert _input_dtype(new_graph_def, name) == "float16"
        else:
            assert not node.converted and node.kind == rk.KIND_DENY_LIST, node.reason
            assert _input_dtype(new_graph_def, name) == "float32"
    for name in inner + ["pooled_sum"]:
        assert not sums[name].converted, (name, sums[name].reason)
        assert _input_dtype(new_graph_def, name) == "float32", name
    names = [t.name for t in tf.function(step, autograph=False).get_concrete_function(
        *specs).graph.outputs]
    want = run_graph_def(graph_def, values, names)
    got = run_graph_def(new_graph_def, values, names)
    for w, g in zip(want, got, strict=True):
        assert g.dtype == np.float32
        np.testing.assert_allclose(g, w, rtol=2e-2, atol=2e-2 * np.abs(w).max())


@pytest.mark.parametrize("runtime", ["xla", "executor"])
def test_a_sum_of_16bit_and_float32_terms_a_reduction_reads_stays_float32_under_xla(runtime):
    """A BatchNorm's input gradient in miniature: a 16-bit term plus a float32
    term centred on a statistic, read by a 16-bit MatMul (a convolution's
    gradients) and by a reduction (a convolution bias's gradient). Between
    16-bit ops it goes 16-bit on the executor; under XLA it stays float32 (the
    same bytes: the Casts fuse into it), so the reduction fuses with the kernel
    that writes the 16-bit copy instead of reading that copy again."""
    batch, width = 256, 64

    def step(x, w1, w2):
        direct = tf.nn.relu(tf.matmul(x, w1, name="first"), name="direct")
        centred = tf.subtract(x, tf.reduce_mean(x, axis=0), name="centred")
        combined = tf.add(direct, tf.multiply(centred, 0.5, name="term"), name="combined")
        return (tf.matmul(combined, w2, name="second"),
                tf.reduce_sum(combined, axis=0, name="bias_sum"))

    specs = [tf.TensorSpec([batch, width]), tf.TensorSpec([width, width]),
             tf.TensorSpec([width, width])]
    graph_def, new_graph_def, report = _rewrite(step, specs, runtime=runtime)
    by_name = {n.name: n for n in report.nodes}
    assert by_name["first"].converted and by_name["second"].converted
    assert by_name["direct"].converted and not by_name["term"].converted
    combined = by_name["combined"]
    if runtime == "xla":
        assert not combined.converted and combined.kind == rk.KIND_FEWER_BYTES, combined.reason
        assert "a reduction reads it" in combined.reason
        assert _input_dtype(new_graph_def, "second") == "float16"
    else:
        assert combined.converted and combined.kind == rk.KIND_BETWEEN, combined.reason
    values = {"x": RNG.standard_normal((batch, width)).astype(np.float32),
              "w1": RNG.standard_normal((width, width)).astype(np.float32) / 8,
              "w2": RNG.standard_normal((width, width)).astype(np.float32) / 8}
    names = [t.name for t in tf.function(step, autograph=False).get_concrete_function(
        *specs).graph.outputs]
    want = run_graph_def(graph_def, values, names)
    got = run_graph_def(new_graph_def, values, names)
    for w, g in zip(want, got, strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-2, atol=2e-2 * np.abs(w).max())
