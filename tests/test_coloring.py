"""Colouring and cast placement on tiny graphs: a table of expected decisions."""

import dataclasses

import numpy as np
import pytest
import tensorflow as tf

import tfamp
from tests.graphs import decision, node_dtypes, rewrite, run_graph_def
from tfamp.rewrite import reasons as rk
from tfamp.rewrite.graph import dtype_name

M = tf.TensorSpec([4, 4], tf.float32)
V = tf.TensorSpec([4], tf.float32)
# Unknown rank: not even TensorFlow's shape inference gives sizes, so the
# choices the rules leave open go by Cast count (the cases that pin those rules;
# with sizes, a 4x4 graph's choices go by bytes).
U = tf.TensorSpec(None, tf.float32)


def deny_chain(x, w):
    y = tf.matmul(x, w, name="mm")
    e = tf.exp(y, name="exp")
    return tf.add(e, 1.0, name="after_exp")


def infer_between(x, w, b):
    h = tf.nn.bias_add(tf.matmul(x, w, name="mm1"), b, name="bias")
    return tf.matmul(h, w, name="mm2")


def clear_next_to_allow(x, w):
    h = tf.nn.relu(tf.matmul(x, w, name="mm"), name="relu")
    return tf.exp(h, name="exp")


def fan_out(x, w):
    y = tf.matmul(x, w, name="mm")
    return tf.exp(y, name="exp"), tf.math.log(y, name="log"), tf.sqrt(y, name="sqrt")


def infer_after_allow(x, w):
    y = tf.add(tf.matmul(x, w, name="mm1"), tf.matmul(w, x, name="mm2"), name="add")
    return tf.reduce_sum(y, name="sum")


def existing_cast(i, w):
    x = tf.cast(i, tf.float32, name="to_float")
    return tf.matmul(x, w, name="mm")


def user_cast_of_16bit(x, w):
    h = tf.nn.relu(tf.matmul(x, w, name="mm"), name="relu")
    return tf.cast(h, tf.float16, name="to_half"), tf.cast(h, tf.int32, name="to_int")


def identity_n(x, w):
    a, b = tf.identity_n([tf.matmul(x, w, name="mm1"), tf.matmul(w, x, name="mm2")],
                         name="pair")
    return tf.matmul(a, b, name="mm3")


def integer_and_bool(x, w):
    y = tf.matmul(x, w, name="mm")
    positive = tf.greater(y, 0.0, name="positive")
    count = tf.reduce_sum(tf.cast(positive, tf.int32, name="as_int"), name="count")
    return count, tf.argmax(y, axis=1, name="argmax")


def unlisted_op(x, w):
    return tf.atan(tf.matmul(x, w, name="mm"), name="atan")


def softmax_after_deny(x, w):
    y = tf.exp(tf.matmul(x, w, name="mm"), name="exp")
    r = tf.reshape(y, [4, 4], name="reshape")
    return tf.nn.softmax(r, name="softmax")


@dataclasses.dataclass
class Case:
    name: str
    fn: object
    specs: tuple
    # node name -> (converted, list, substring of reason)
    expect: dict
    casts: int
    config: dict = dataclasses.field(default_factory=dict)


CASES = [
    Case("deny_propagates_through_infer", deny_chain, (M, M), {
        "mm": (True, "allow", "compute-heavy"),
        "exp": (False, "deny", "numerically risky"),
        "after_exp": (False, "infer", "deny: downstream of Exp 'exp'"),
    }, casts=3),  # x, w -> f16; mm -> f32 for exp
    Case("infer_between_allow_ops", infer_between, (M, M, V), {
        "mm1": (True, "allow", ""), "bias": (True, "infer", "between float16 ops"),
        "mm2": (True, "allow", ""),
    }, casts=4),  # x, w, b in; mm2 out (graph output keeps float32)
    Case("clear_follows_allow", clear_next_to_allow, (M, M), {
        "relu": (True, "clear", "next to float16 op 'mm'"),
        "exp": (False, "deny", ""),
    }, casts=3),
    Case("fan_out_shares_one_cast", fan_out, (U, U), {
        "mm": (True, "allow", ""), "exp": (False, "deny", ""),
        "log": (False, "infer", "not between"), "sqrt": (False, "infer", "not between"),
    }, casts=3),  # x, w in; ONE cast of mm shared by exp, log, sqrt
    Case("infer_after_allow_saves_a_cast", infer_after_allow, (M, M), {
        "add": (True, "infer", "follows float16 op"), "sum": (False, "deny", ""),
    }, casts=3),  # x, w in; add -> f32 for sum (instead of mm1 and mm2 -> f32)
    Case("existing_cast_is_retargeted", existing_cast, (tf.TensorSpec([4, 4], tf.int32), M), {
        "to_float": (True, "unlisted", "casts straight to float16"), "mm": (True, "allow", ""),
    }, casts=2),  # w in, mm out; no cast after to_float
    Case("existing_cast_reads_16bit_directly", user_cast_of_16bit, (M, M), {
        "to_half": (True, "unlisted", "reads the float16 value of 'relu' directly"),
        "to_int": (True, "unlisted", "reads the float16 value of 'relu' directly"),
    }, casts=2),  # x, w in; no float16 -> float32 -> float16 round trip
    Case("default_device_kernel_counts", identity_n, (M, M), {
        "pair": (True, "clear", "between float16 ops"),
    }, casts=3, config={"device_type": "CPU"}),  # x, w in; mm3 out
    Case("integer_and_bool_edges_untouched", integer_and_bool, (M, M), {
        "positive": (True, "clear", "next to float16 op 'mm'"),
        "as_int": (False, "unlisted", "no float32 tensors"),
        "count": (False, "deny", "no float32 tensors"),
        "argmax": (True, "clear", "next to float16 op"),
    }, casts=3),  # x, w and the constant 0.0 compared with mm (constants stay float32)
    Case("unlisted_stays_float32", unlisted_op, (M, M), {
        "atan": (False, "unlisted", "unlisted: stays float32"),
    }, casts=3),
    Case("softmax_downstream_of_deny_through_clear", softmax_after_deny, (M, M), {
        "reshape": (False, "clear", "deny: downstream of Exp 'exp'"),
        "softmax": (False, "infer", "deny: downstream of Exp 'exp'"),
    }, casts=3),
    Case("keep_fp32_override", infer_between, (U, U, U), {
        "mm2": (False, "allow", "keep_fp32 pattern 'mm2'"),
        "bias": (False, "infer", "not between"),
    }, casts=3, config={"keep_fp32": ("mm2",)}),
    Case("allow_remove", infer_between, (M, M, V), {
        "mm1": (False, "unlisted", ""), "mm2": (False, "unlisted", ""),
    }, casts=0, config={"allow_remove": ("MatMul",)}),
    Case("deny_add_moves_op", infer_between, (M, M, V), {
        "bias": (False, "deny", "numerically risky"),
    }, casts=5, config={"deny_add": ("BiasAdd",)}),  # x, w, mm1->32, bias->16, mm2->32
    Case("opdef_does_not_allow_16bit", lambda x, a: tf.math.betainc(a, a, x, name="bi"),
         (M, M), {"bi": (False, "allow", "OpDef does not allow float16")},
         casts=0, config={"allow_add": ("Betainc",)}),
    Case("no_16bit_kernel", lambda x, a: tf.math.igamma(a, x, name="ig"), (M, M), {
        "ig": (False, "allow", "no float16 CPU kernel for Igamma"),
    }, casts=0, config={"allow_add": ("Igamma",), "device_type": "CPU"}),
    Case("bfloat16_mean_is_infer", lambda x, w: tf.reduce_mean(
        tf.matmul(tf.matmul(x, w, name="mm1"), w, name="mm2"), name="mean"), (U, U), {
        "mean": (False, "infer", "not between bfloat16 ops"),
    }, casts=3, config={"dtype": "bfloat16"}),
    Case("float16_sum_is_deny", lambda x, w: tf.reduce_sum(
        tf.matmul(x, w, name="mm"), name="sum"), (M, M), {
        # (a sum of 16 values to one: a statistic, so only as-small ops stay float32 after it)
        "sum": (False, "deny", "deny: accumulates in float32"),
    }, casts=3),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_decisions_and_cast_count(case):
    _, new_graph_def, report = rewrite(case.fn, *case.specs, **case.config)
    for name, (converted, list_name, reason) in case.expect.items():
        node = decision(report, name)
        assert (node.converted, node.list) == (converted, list_name), node
        assert reason in node.reason, node
    assert report.casts_inserted == case.casts, [c.name for c in report.casts]
    assert report.nodes_after == report.nodes_before + report.casts_inserted
    assert sum(n.op == "Cast" for n in new_graph_def.node) >= report.casts_inserted


def test_fan_out_uses_a_single_shared_cast():
    _, _, report = rewrite(fan_out, M, M)
    from_mm = [c for c in report.casts if c.source in ("mm", "mm:0")]
    assert len(from_mm) == 1
    assert from_mm[0].dst_dtype == "float32"
    assert len(from_mm[0].consumers) == 3


def test_graph_outputs_keep_their_dtype():
    graph_def, new_graph_def, _ = rewrite(infer_between, M, M, V)
    assert node_dtypes(new_graph_def)["Identity"] == node_dtypes(graph_def)["Identity"]


def test_fused_batch_norm_computes_16bit_with_float32_statistics():
    def conv_bn(x, f, scale, offset):
        y = tf.nn.conv2d(x, f, 1, "SAME", name="conv")
        out = tf.raw_ops.FusedBatchNormV3(
            x=y, scale=scale, offset=offset, mean=tf.zeros([4]), variance=tf.ones([4]),
            is_training=True, name="bn")
        return tf.nn.conv2d(tf.nn.relu(out[0]), f, 1, "SAME", name="conv2"), out[1]

    specs = (tf.TensorSpec([2, 6, 6, 4]), tf.TensorSpec([3, 3, 4, 4]), V, V)
    _, new_graph_def, report = rewrite(conv_bn, *specs)
    bn = decision(report, "bn")
    assert bn.converted and "U stays float32" in bn.reason
    dtypes = node_dtypes(new_graph_def)["bn"]
    assert dtypes == {"T": "float16", "U": "float32"}


@pytest.mark.parametrize("dtype, runtime", [("bfloat16", "executor"), ("bfloat16", "xla"),
                                            ("float16", "xla")])
def test_a_moving_average_assigned_to_a_variable_is_computed_in_float32(dtype, runtime):
    """Keras 3's BatchNorm: moving = moving * 0.99 + mean * 0.01. The old-to-new
    path stays float32 (a 16-bit one loses steps below half a 16-bit spacing);
    the increment may be 16-bit. With assign_add the variable adds in float32."""
    moving = tf.Variable(tf.zeros([4]))
    counter = tf.Variable(tf.zeros([4]))

    def step(x, w):
        y = tf.matmul(x, w, name="mm")
        mean = tf.reduce_mean(y, axis=0, name="mean")
        old = tf.multiply(moving.read_value(), 0.99, name="old")
        new = tf.add(old, tf.multiply(mean, 0.01, name="increment"), name="new")
        moving.assign(new, name="assign")
        counter.assign_add(tf.multiply(mean, 0.5, name="delta"), name="count")
        return tf.matmul(y, w, name="mm2")

    _, new_graph_def, report = rewrite(step, M, M, dtype=dtype, runtime=runtime)
    dtypes = node_dtypes(new_graph_def)
    for name in ("old", "new"):
        node = decision(report, name)
        assert dtypes[node.name]["T"] == "float32", node
        # (Where the Mean is a float32 statistic, in float16 and in bfloat16
        # under XLA, its moving average is one of its float32 statistics.)
        if runtime == "executor":
            assert node.kind == "a variable's new value" and "moving average" in node.reason
    assert decision(report, "mm").converted and not decision(report, "assign").converted
    assert decision(report, "delta").kind != "a variable's new value"


@pytest.mark.parametrize("runtime", ["xla", "executor"])
def test_bfloat16_statistics_accumulate_in_float32_under_xla(runtime):
    """In bfloat16 a Mean or Sum of a big tensor is on the infer list. Under XLA
    it reads its input in float32 (XLA fuses the Cast into the reduction) and
    its small results stay float32, as a float16 statistic does: no kernel that
    rounds a BatchNorm's batch mean to bfloat16, and a product it sums (the
    gamma gradient's dy * x) fused into it rather than written in bfloat16.
    Under TensorFlow's executor the Cast would be a kernel of its own: no change."""
    def step(x, f):
        y = tf.nn.conv2d(x, f, 1, "SAME", name="conv")
        z = tf.nn.conv2d(y, f, 1, "SAME", name="conv2")
        mean = tf.reduce_mean(y, axis=[0, 1, 2], name="mean")
        moved = tf.multiply(mean, 0.1, name="moved")
        product = tf.multiply(y, z, name="product")
        gamma_grad = tf.reduce_sum(product, axis=[0, 1, 2], name="gamma_grad")
        return tf.nn.conv2d(tf.nn.relu(z), f, 1, "SAME", name="conv3"), moved, gamma_grad

    specs = (tf.TensorSpec([2, 8, 8, 4]), tf.TensorSpec([3, 3, 4, 4]))
    _, new_graph_def, report = rewrite(step, *specs, dtype="bfloat16", runtime=runtime)
    dtypes = node_dtypes(new_graph_def)
    xla = runtime == "xla"
    for name in ("mean", "moved", "gamma_grad", "product"):
        node = decision(report, name)
        assert node.converted is not xla, node
        assert (dtypes[node.name]["T"] == "float32") is xla, node
    assert decision(report, "conv").converted and decision(report, "conv3").converted
    if xla:
        assert "accumulates in float32" in decision(report, "mean").reason


@pytest.mark.parametrize("runtime", ["xla", "executor"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_bfloat16_loss_gradient_is_written_once_in_bfloat16_under_xla(dtype, runtime):
    """The loss gradient after a float32 softmax cross-entropy, (softmax -
    onehot) * dloss, is read by the classifier's MatMul gradient (16-bit) and
    its BiasAddGrad. Under XLA in bfloat16 the product computes in bfloat16 and
    the bias gradient reads it as it is, so nothing reads a float32 copy (in
    float32, XLA wrote the product in float32 and converted it in a kernel of
    its own: 0.26 MB of temporary memory on MobileNetV2's H100 program). In
    float16 the product stays float32: softmax - onehot rounded to float16
    before the loss scale multiplies it would lose its small probabilities."""
    def step(x, w, b, labels):
        with tf.GradientTape() as tape:
            tape.watch([w, b])
            logits = tf.nn.bias_add(tf.matmul(x, w, name="mm"), b, name="logits")
            loss = tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))
        return tape.gradient(loss, [w, b])

    specs = (tf.TensorSpec([64, 32]), tf.TensorSpec([32, 10]), tf.TensorSpec([10]),
             tf.TensorSpec([64], tf.int32))
    old, new, report = rewrite(step, *specs, dtype=dtype, runtime=runtime)
    product = next(n for n in report.nodes
                   if n.op == "Mul" and "SparseSoftmaxCrossEntropyWithLogits" in n.name)
    bias_grad = decision(report, "BiasAddGrad")
    changed = dtype == "bfloat16" and runtime == "xla"
    assert product.converted is changed and bias_grad.converted is changed, (product, bias_grad)
    dtypes = node_dtypes(new)
    assert dtypes[product.name]["T"] == ("bfloat16" if changed else "float32")
    if changed:
        assert "reads the bfloat16 product" in bias_grad.reason, bias_grad.reason
        readers = [n for n in new.node if any(i.split(":")[0] == product.name for i in n.input)]
        assert {r.op for r in readers} <= {"MatMul", "BiasAddGrad"}, readers
    rng = np.random.default_rng(0)
    inputs = {"x": rng.normal(size=(64, 32)).astype(np.float32),
              "w": rng.normal(0, 0.3, size=(32, 10)).astype(np.float32),
              "b": np.zeros(10, np.float32),
              "labels": rng.integers(0, 10, 64).astype(np.int32)}
    names = [t.name for t in tf.function(step).get_concrete_function(*specs).graph.outputs]
    for want, got in zip(run_graph_def(old, inputs, names), run_graph_def(new, inputs, names),
                         strict=True):
        np.testing.assert_allclose(got, want, rtol=0.03, atol=0.02 * np.abs(want).max())


@pytest.mark.parametrize("runtime", ["xla", "executor"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_an_allow_op_on_positions_and_constants_stays_float32(dtype, runtime):
    """A rotary embedding's angles (keras-hub's RotaryEmbedding, Llama, Gemma, ...):
    positions x inverse frequencies, an Einsum of a Range shifted by an integer
    cache index and of constants. In float16 the angle at position 255 was off by
    0.1 rad and every position past 65504 was inf (NaN after cos); bfloat16 rounded
    positions above 256. Such an op reads no float input and no variable, so it
    stays float32; the Einsum that applies the rotation to the data still converts."""
    seq, dim = 64, 16

    def step(x, start):
        positions = tf.range(seq, dtype=tf.float32) + tf.cast(start, tf.float32)
        inverse = 1.0 / (10000.0 ** (tf.range(0, dim, 2, dtype=tf.float32) / dim))
        angles = tf.einsum("i,j->ij", positions, inverse, name="angles")
        rotation = tf.concat([tf.cos(angles), tf.sin(angles)], axis=-1)
        return tf.einsum("bsd,sd->bs", x, rotation, name="applied")

    specs = (tf.TensorSpec([2, seq, dim]), tf.TensorSpec([], tf.int32))
    old, new, report = rewrite(step, *specs, dtype=dtype, runtime=runtime)
    angles, applied = decision(report, "angles/Einsum"), decision(report, "applied/Einsum")
    assert not angles.converted and angles.kind == rk.KIND_POSITIONS, angles
    assert "positions, indices and constants" in angles.reason, angles.reason
    assert applied.converted, applied
    assert node_dtypes(new)["angles/Einsum"]["T"] == "float32"
    x = np.random.default_rng(0).normal(size=(2, seq, dim)).astype(np.float32)
    names = [t.name for t in tf.function(step).get_concrete_function(*specs).graph.outputs]
    for start in (0, 70000):
        inputs = {"x": x, "start": np.int32(start)}
        (want,), (got,) = run_graph_def(old, inputs, names), run_graph_def(new, inputs, names)
        assert np.isfinite(got).all(), start
        np.testing.assert_allclose(got, want, rtol=0.05, atol=0.05 * np.abs(want).max())


def test_an_allow_op_reading_a_float_input_still_converts():
    """The same Einsum of positions with frequencies that are a float input (a
    step's data) is an ordinary allow op: the rule looks for no float input at
    all, not for a Range among them."""
    def step(frequencies):
        positions = tf.range(8, dtype=tf.float32)
        return tf.einsum("i,j->ij", positions, frequencies, name="angles")

    _, _, report = rewrite(step, tf.TensorSpec([4]), dtype="float16")
    assert decision(report, "angles/Einsum").converted


def test_a_weights_update_does_not_hold_the_activations_its_read_reaches():
    """A scale read into a big activation (a LayerNorm's gamma) reaches, through
    element-wise ops only, the backward ops that compute its own gradient: its
    new value is computed from its read, but that path is no moving average.
    Only the ops no bigger than the variable (the update itself) stay float32;
    before session 15 the activations and their gradients were held too."""
    gamma = tf.Variable(tf.ones([4]))

    def step(x, w):
        with tf.GradientTape() as tape:
            y = tf.matmul(x, w, name="mm")
            scaled = tf.multiply(y, gamma, name="scaled")
            residual = tf.add(scaled, y, name="residual")
            squared = tf.multiply(residual, residual, name="squared")
            loss = tf.reduce_sum(tf.matmul(squared, w, name="mm2"))
        grad = tape.gradient(loss, gamma)
        gamma.assign(tf.subtract(gamma.read_value(), grad * 0.01, name="updated"),
                     name="assign")
        return loss

    _, new_graph_def, report = rewrite(step, M, M, dtype="bfloat16", runtime="executor")
    dtypes = node_dtypes(new_graph_def)
    held = [n.name for n in report.nodes if n.kind == "a variable's new value"]
    assert "updated" in held and set(held) <= {"updated", "Identity"}, held  # (read_value)
    assert decision(report, "scaled").converted and decision(report, "residual").converted
    updated = decision(report, "updated")
    assert dtypes[updated.name]["T"] == "float32" and updated.kind == "a variable's new value"


def test_while_loop_body_is_rewritten_and_float_loop_state_goes_16bit():
    # Was "loop types kept" while function signatures were fixed; since
    # boundaries.py, loop-carried float32 values feeding only 16-bit math (h
    # and the loop-invariant w) are 16-bit in the loop, the counter is not.
    def loop(x, w):
        def body(i, h):
            return i + 1, tf.nn.relu(tf.matmul(h, w, name="body_mm"))
        return tf.while_loop(lambda i, h: i < 3, body, (tf.constant(0), x))[1]

    graph_def, new_graph_def, report = rewrite(loop, M, M)
    body_mm = decision(report, "body_mm", function=True)
    assert body_mm.converted
    while_node = next(n for n in report.nodes if n.op in ("While", "StatelessWhile"))
    assert while_node.converted and while_node.reason.startswith("boundary:")
    old_types = next(n.attr["T"].list.type for n in graph_def.node if n.name == while_node.name)
    new_types = next(n.attr["T"].list.type for n in new_graph_def.node
                     if n.name == while_node.name)
    assert [dtype_name(t) for t in new_types] == [
        dtype_name(t) if t != tf.float32.as_datatype_enum else "float16" for t in old_types]
    x = np.random.default_rng(0).normal(size=(4, 4)).astype("float32") * 0.3
    w = np.random.default_rng(1).normal(size=(4, 4)).astype("float32") * 0.3
    want = run_graph_def(graph_def, {"x": x, "w": w}, ["Identity:0"])[0]
    got = run_graph_def(new_graph_def, {"x": x, "w": w}, ["Identity:0"])[0]
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)


def test_nested_function_call_and_cond_bodies_are_rewritten():
    @tf.function
    def inner(x, w):
        return tf.matmul(x, w, name="inner_mm")

    def outer(x, w, flag):
        y = inner(x, w)
        return tf.cond(flag, lambda: tf.matmul(y, w, name="then_mm"), lambda: y * 2.0)

    _, _, report = rewrite(outer, M, M, tf.TensorSpec([], tf.bool))
    assert decision(report, "inner_mm", function=True).converted
    assert decision(report, "then_mm", function=True).converted
    calls = [n for n in report.nodes if n.op.endswith("PartitionedCall") or "If" in n.op]
    # A call is only retyped as part of a boundary group (boundaries.py); the
    # graph stays valid (rewrite() runs check_graph_def).
    assert calls and all(not n.converted or n.reason.startswith("boundary:") for n in calls)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_rewritten_outputs_match_float32_within_16bit_tolerance(dtype):
    rng = np.random.default_rng(0)
    feeds = {"x": rng.normal(size=(4, 4)).astype("float32"),
             "w": rng.normal(size=(4, 4)).astype("float32"),
             "b": rng.normal(size=(4,)).astype("float32")}
    graph_def, new_graph_def, _ = rewrite(infer_between, M, M, V, dtype=dtype)
    want = run_graph_def(graph_def, feeds, ["Identity:0"])[0]
    got = run_graph_def(new_graph_def, feeds, ["Identity:0"])[0]
    assert got.dtype == np.float32
    tolerance = {"float16": 1e-2, "bfloat16": 4e-2}[dtype]
    np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance * np.abs(want).max())
    assert not np.array_equal(got, want), "16-bit math should round differently"


@pytest.mark.parametrize("lookup,runtime", [("ResourceGather", "executor"),
                                            ("GatherV2", "xla")])
@pytest.mark.parametrize("dtype,tied", [("bfloat16", True), ("bfloat16", False),
                                        ("float16", True)])
def test_a_tied_output_layer_stays_float32_in_bfloat16(dtype, tied, lookup, runtime):
    """A tied output layer (keras-hub's ReversibleEmbedding: T5, GPT-2, Llama, ...)
    multiplies the hidden state by the embedding table that its input looks up.
    In bfloat16 that product and its two gradient products stay float32
    (keras-hub's T5: gradient cosine 0.988 against float32 before, 0.99995 now;
    Keras's bfloat16 policy computes them in float32 too), on the executor and
    under XLA; every other product stays 16-bit. An untied head, and float16,
    are converted as before."""
    vocab, width = 64, 16
    rng = np.random.default_rng(0)
    table = tf.Variable(rng.normal(size=(vocab, width)).astype(np.float32), name="table")
    hidden = tf.Variable(rng.normal(0, 0.3, size=(width, width)).astype(np.float32))
    untied = tf.Variable(rng.normal(0, 0.3, size=(width, vocab)).astype(np.float32))

    def step(ids, labels):
        with tf.GradientTape() as tape:
            if lookup == "ResourceGather":
                h = tf.nn.embedding_lookup(table, ids)
            else:
                h = tf.gather(tf.convert_to_tensor(table), ids)
            h = tf.nn.relu(tf.matmul(h, hidden, name="ff"))
            logits = (tf.matmul(h, table, transpose_b=True, name="head") if tied
                      else tf.matmul(h, untied, name="head"))
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))
        return tape.gradient(loss, [table, hidden] + ([] if tied else [untied]))

    specs = (tf.TensorSpec([8], tf.int32), tf.TensorSpec([8], tf.int32))
    old, new, report = rewrite(step, *specs, dtype=dtype, runtime=runtime)
    assert any(n.op == lookup for n in report.nodes), lookup
    head = decision(report, "head")
    gradients = [n for n in report.nodes
                 if n.op == "MatMul" and n.name.startswith("gradient_tape/head/")]
    assert len(gradients) == 2, gradients
    held = [n for n in [head, *gradients] if not n.converted]
    if dtype == "bfloat16" and tied:
        assert len(held) == 3, held
        assert all(n.kind == rk.KIND_TIED_VOCABULARY for n in held), held
        assert "tied output layer" in head.reason, head.reason
        # d(logits) reaches both gradient products in float32: no Cast of it to 16-bit
        dtypes = node_dtypes(new)
        assert all(dtypes[n.name]["T"] == "float32" for n in held)
        to_16bit = [c for c in report.casts if c.dst_dtype == dtype
                    and c.source not in {n.name for n in held}
                    and ("SparseSoftmaxCrossEntropyWithLogits" in c.source
                         or c.source.startswith("gradient_tape/head/"))]
        assert not to_16bit, to_16bit
        # without the gradient (a serving graph) the head is a 16-bit head like any other
        def forward(ids):
            return tf.matmul(tf.nn.embedding_lookup(table, ids), table, transpose_b=True,
                             name="head")
        _, _, served = rewrite(forward, specs[0], dtype=dtype, runtime=runtime)
        assert decision(served, "head").converted
    else:
        assert not held, held
    assert decision(report, "ff").converted
    ids, labels = (tf.constant(rng.integers(0, vocab, 8), tf.int32) for _ in range(2))
    wanted = tf.function(step)(ids, labels)
    got = tfamp.function(step, config=tfamp.AmpConfig(dtype=dtype, runtime=runtime))(ids, labels)
    for want, value in zip(wanted, got, strict=True):
        want, value = tf.convert_to_tensor(want).numpy(), tf.convert_to_tensor(value).numpy()
        assert value.dtype == np.float32
        np.testing.assert_allclose(value, want, rtol=0.05, atol=0.05 * np.abs(want).max())
