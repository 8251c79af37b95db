"""Colouring across function and loop boundaries (tfamp/rewrite/boundaries.py).

Each case builds a tiny graph with one kind of boundary, rewrites it, and
asserts: the dtypes on every side of the boundary agree (and are 16-bit where
the case expects it), ``check_graph_def`` finds nothing, and the rewritten graph
computes what the float32 graph computes within 16-bit tolerance.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import full_type_pb2, graph_pb2

import tfamp
from tests.graphs import rewrite, run_graph_def, trace
from tfamp.rewrite import boundaries
from tfamp.rewrite.graph import build_view, dtype_name


@pytest.fixture(autouse=True)
def _written_record_is_exact(verify_written_record):
    """Every rewrite here also checks the record the self-check relies on."""


M = tf.TensorSpec([4, 4], tf.float32)
DT_FLOAT = tf.float32.as_datatype_enum


def _rng_feeds(*names, scale=0.5):
    rng = np.random.default_rng(0)
    return {n: (rng.normal(size=(4, 4)) * scale).astype("float32") for n in names}


def _fdef(graph_def, name):
    return next(f for f in graph_def.library.function if f.signature.name == name)


def _calls(graph_def, ops):
    """(body name, NodeDef) of every node of one of `ops`, top graph and library."""
    found = [("", n) for n in graph_def.node if n.op in ops]
    for f in graph_def.library.function:
        found += [(f.signature.name, n) for n in f.node_def if n.op in ops]
    return found


def _types(attr_value):
    return [dtype_name(t) for t in attr_value.list.type]


def _sig(fdef, side):
    args = fdef.signature.input_arg if side == "in" else fdef.signature.output_arg
    return [dtype_name(a.type) for a in args]


def _list_groups_agree(graph_def):
    """Every TensorList group of `graph_def` has one element type."""
    analysis = boundaries._Analysis(build_view(graph_def), tfamp.AmpConfig(), set())
    for group in analysis.groups:
        if group.kind != "list":
            continue
        dtypes = {analysis.bodies[b].nodes[n].node_def.attr["element_dtype"].type
                  for _, b, n, _ in group.members}
        assert len(dtypes) == 1, (group.members, dtypes)


# -- TF2 control flow: table of tiny graphs ---------------------------------------------


def loop_matmul_tanh(x, w):
    def body(i, h):
        return i + 1, tf.tanh(tf.matmul(h, w, name="body_mm"), name="body_tanh")
    return tf.while_loop(lambda i, h: i < 3, body, (tf.constant(0), x))[1]


def cond_matmul_both(x, w, flag):
    return tf.cond(flag, lambda: tf.matmul(x, w, name="then_mm"),
                   lambda: tf.matmul(w, x, name="else_mm"))


def case_matmul_all(x, w, index):
    return tf.switch_case(index, [lambda: tf.matmul(x, w), lambda: tf.matmul(w, x),
                                  lambda: tf.matmul(x, x)])


def loop_with_exp_state(x, w):
    # The carried value goes through Exp (deny) every iteration: it stays float32.
    def body(i, h):
        return i + 1, tf.exp(tf.matmul(h, w) * 0.01)
    return tf.while_loop(lambda i, h: i < 3, body, (tf.constant(0), x))[1]


@dataclasses.dataclass
class Case:
    name: str
    fn: Callable
    specs: tuple
    feeds: dict
    call_ops: tuple  # op types of the boundary node
    type_attr: str  # "T" (While) or "Tin" (If)
    sixteen: dict[int, bool]  # float32 slot index -> expected to go 16-bit
    output: str = "Identity:0"


CASES = [
    Case("while: MatMul+Tanh on the carried state", loop_matmul_tanh, (M, M),
         _rng_feeds("x", "w"), ("While", "StatelessWhile"), "T", {3: True, 4: True}),
    Case("if: MatMul in both branches", cond_matmul_both, (M, M, tf.TensorSpec([], tf.bool)),
         {**_rng_feeds("x", "w"), "flag": np.array(True)}, ("If", "StatelessIf"), "Tin",
         {0: True, 1: True}),
    Case("case: MatMul in every branch", case_matmul_all, (M, M, tf.TensorSpec([], tf.int32)),
         {**_rng_feeds("x", "w"), "index": np.array(1, dtype="int32")}, ("Case", "StatelessCase"),
         "Tin", {0: True, 1: True}),
    # h: a Cast per iteration either way (before MatMul or after Exp): float32;
    # w is loop-invariant and only feeds MatMul: 16-bit.
    Case("while: Exp on the carried state keeps it float32", loop_with_exp_state, (M, M),
         _rng_feeds("x", "w"), ("While", "StatelessWhile"), "T", {3: False, 4: True}),
]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_boundary_slots_agree_on_every_side(case, dtype):
    graph_def, new_graph_def, _ = rewrite(case.fn, *case.specs, dtype=dtype)  # checks validity
    (where, call), = _calls(new_graph_def, case.call_ops)
    assert where == ""
    old_call = next(n for n in graph_def.node if n.name == call.name)
    float_slots = [k for k, t in enumerate(old_call.attr[case.type_attr].list.type)
                   if t == DT_FLOAT]
    assert float_slots == sorted(case.sixteen)
    new_types = _types(call.attr[case.type_attr])
    for k, sixteen in case.sixteen.items():
        assert new_types[k] == (dtype if sixteen else "float32"), k
    # Every function the call runs sees the same types at its arguments.
    functions = [v.func.name for k, v in call.attr.items() if v.HasField("func")]
    for name in functions:
        assert _sig(_fdef(new_graph_def, name), "in") == new_types
    got = run_graph_def(new_graph_def, case.feeds, [case.output])[0]
    want = run_graph_def(graph_def, case.feeds, [case.output])[0]
    np.testing.assert_allclose(got, want, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_loop_carried_state_needs_no_cast_inside_the_body(dtype):
    graph_def, new_graph_def, report = rewrite(loop_matmul_tanh, M, M, dtype=dtype)
    (_, loop), = _calls(new_graph_def, ("While", "StatelessWhile"))
    body = _fdef(new_graph_def, loop.attr["body"].func.name)
    cond = _fdef(new_graph_def, loop.attr["cond"].func.name)
    assert _types(loop.attr["T"])[3] == dtype  # (i, max_iter, ..., h, w): h is index 3
    assert _sig(body, "in")[3] == _sig(body, "out")[3] == _sig(cond, "in")[3] == dtype
    assert not [n for n in body.node_def if n.op == "Cast"]
    assert all(c.function == "" for c in report.casts)  # once, before/after the loop
    # Fixed signatures (the rule before boundaries.py) need Casts in the body.
    old = _rewrite_with_fixed_signatures(graph_def, dtype)
    assert [c for c in old.casts if c.function == body.signature.name]


def _rewrite_with_fixed_signatures(graph_def, dtype, outputs=("Identity:0",)):
    """The report of a rewrite with no boundary group turned 16-bit."""
    saved = boundaries._MAX_ROUNDS
    boundaries._MAX_ROUNDS = 0  # solve() then keeps every boundary float32
    try:
        return tfamp.rewrite_graph_def(graph_def, tfamp.AmpConfig(dtype=dtype),
                                       outputs=list(outputs))[1]
    finally:
        boundaries._MAX_ROUNDS = saved


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_call_that_only_moves_values_stays_float32(dtype):
    """pix2pix's tf.data augmentation (tensorflow/docs), under TFAMP_ENABLE: a
    tf.cond around a flip, no matrix op anywhere. The cond's argument and its
    result each paid off while the other was 16-bit (one saved the other's Cast
    in each branch), so both went 16-bit: two Casts where none were needed, the
    values rounded to 16 bits and 70000 turned into inf."""
    def flip_sometimes(x, flip):
        return tf.cond(flip, lambda: tf.reverse(x, [1]), lambda: tf.identity(x))

    graph_def, new_graph_def, report = rewrite(
        flip_sometimes, tf.TensorSpec([1, 3]), tf.TensorSpec([], tf.bool), dtype=dtype)
    assert not report.casts and not any(n.converted for n in report.nodes)
    assert new_graph_def == graph_def
    x = np.array([[0.1, 7e4, 1.0001]], np.float32)
    got = run_graph_def(new_graph_def, {"x": x, "flip": True}, ["Identity:0"])[0]
    np.testing.assert_array_equal(got, x[:, ::-1])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_differentiated_function_without_a_matrix_op_stays_float32(dtype):
    """Generated program 65000198 (tests/progen/regressions): a nested tf.function
    with a tape of its own and an inference batch norm, differentiated by the
    step, no matrix op. Its forward function's
    results and its backward function's arguments meet in the caller; each group
    paid off while the others were 16-bit, so 102 ops went bfloat16 for nothing.
    The groups now must reach a 16-bit computation."""
    scale, offset = tf.Variable(tf.ones([2])), tf.Variable(tf.zeros([2]))
    mean, variance = tf.Variable(tf.zeros([2])), tf.Variable(tf.ones([2]))

    @tf.function
    def inner(h):
        with tf.GradientTape() as tape:
            tape.watch(h)
            total = tf.reduce_sum(tf.square(h)) * 0.5
        h = h + 0.5 * tape.gradient(total, h)
        normed = tf.compat.v1.nn.fused_batch_norm(
            tf.reshape(h, [-1, 2, 4, 2]), scale, offset, mean=mean, variance=variance,
            is_training=False)[0]
        return tf.reshape(normed, [-1, 4])

    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(inner(x))
        return loss, tape.gradient(loss, x)

    _, _, report = rewrite(step, M, dtype=dtype)
    assert not [n.name for n in report.nodes if n.converted] and not report.casts


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_call_whose_branches_multiply_still_goes_16bit_together(dtype):
    """The coupled check weighs a call's groups together; where a branch holds a
    MatMul, 16-bit arguments still save its Casts (the If's Tin goes 16-bit)."""
    _, new_graph_def, _ = rewrite(cond_matmul_both, M, M, tf.TensorSpec([], tf.bool),
                                  dtype=dtype)
    (_, call), = _calls(new_graph_def, ("If", "StatelessIf"))
    assert _types(call.attr["Tin"]) == [dtype, dtype]


def test_a_graph_output_from_a_call_keeps_its_dtype():
    # The If's own output is named a graph output: its Tout stays float32
    # (one Cast in each branch); its arguments may still go 16-bit.
    graph_def, _, _ = trace(cond_matmul_both, M, M, tf.TensorSpec([], tf.bool))
    (_, old_call), = _calls(graph_def, ("If", "StatelessIf"))
    for outputs, tout in (([f"{old_call.name}:0"], "float32"), (["Identity:0"], "float16")):
        new_graph_def, _ = tfamp.rewrite_graph_def(graph_def, outputs=outputs)
        assert not tfamp.check_graph_def(new_graph_def)
        (_, call), = _calls(new_graph_def, ("If", "StatelessIf"))
        assert _types(call.attr["Tout"]) == [tout]
        assert _types(call.attr["Tin"]) == ["float16", "float16"]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_statistic_a_forward_function_returns_for_its_gradient(dtype):
    # Issue 28.2: the forward function of `inner` returns its Sum for the
    # gradient; while its result's group was tried 16-bit, the statistic rules
    # looked up that result's pseudo-slot ("<ret sum>") as a node: KeyError.
    w = tf.Variable(np.eye(8, dtype="float32") / 4)

    @tf.function
    def inner(a):
        h = tf.matmul(a, w)
        return h * tf.reduce_sum(h, axis=-1, keepdims=True)

    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.matmul(inner(x), w))
        return tape.gradient(loss, w)

    x = tf.constant(np.arange(64, dtype="float32").reshape(8, 8) % 5 / 4)
    _, new_graph_def, report = rewrite(step, tf.TensorSpec([8, 8]), dtype=dtype)
    forward = [f for f in new_graph_def.library.function if "sum" in f.ret]
    assert len(forward) == 1 and forward[0].signature.name.startswith("__forward_inner")
    assert report.converted.get("MatMul")
    rewritten = tfamp.rewrite_function(step, tfamp.AmpConfig(dtype=dtype))
    np.testing.assert_allclose(rewritten(x), tf.function(step)(x), rtol=2e-2, atol=1e-3)


# -- one function, two callers -----------------------------------------------------------


@tf.function
def _shared(a, b):
    return a * b + 1.0


def two_disagreeing_callers(x, w):
    y = _shared(tf.matmul(x, w), w)  # 16-bit producer, 16-bit consumer
    z = _shared(tf.exp(x * 0.1), x)  # float32 producers (Exp is deny)
    return tf.matmul(y, w) + z


def two_agreeing_callers(x, w):
    return tf.matmul(_shared(tf.matmul(x, w), w), w) + tf.matmul(_shared(tf.matmul(w, x), x), w)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_callers_that_disagree_get_their_own_copy_of_the_body(dtype):
    graph_def, new_graph_def, report = rewrite(two_disagreeing_callers, M, M, dtype=dtype)
    calls = {n.name: n for _, n in _calls(new_graph_def, ("PartitionedCall",
                                                         "StatefulPartitionedCall"))}
    assert len(calls) == 2
    called = {name: n.attr["f"].func.name for name, n in calls.items()}
    original = next(n.attr["f"].func.name for n in graph_def.node if n.op.endswith("Call"))
    assert len(set(called.values())) == 2 and original in called.values()
    for name, node in calls.items():  # each call matches the function it calls
        fdef = _fdef(new_graph_def, called[name])
        assert _types(node.attr["Tin"]) == _sig(fdef, "in")
        assert _types(node.attr["Tout"]) == _sig(fdef, "out")
    sixteen = {name for name, n in calls.items() if _types(n.attr["Tin"]) == [dtype, dtype]}
    plain = {name for name, n in calls.items() if _types(n.attr["Tin"]) == ["float32"] * 2}
    assert len(sixteen) == len(plain) == 1
    assert called[next(iter(plain))] == original + "_tfamp_f32"
    assert len(new_graph_def.library.function) == len(graph_def.library.function) + 1
    copy_name = original + "_tfamp_f32"
    copied = [n for n in report.nodes if n.function == copy_name]
    assert copied and not any(n.converted for n in copied)  # reported, all float32
    assert report.nodes_after == len(report.nodes) + report.casts_inserted
    feeds = _rng_feeds("x", "w")
    np.testing.assert_allclose(run_graph_def(new_graph_def, feeds, ["Identity:0"])[0],
                               run_graph_def(graph_def, feeds, ["Identity:0"])[0],
                               rtol=3e-2, atol=3e-2)


def test_callers_that_agree_share_one_body():
    graph_def, new_graph_def, _ = rewrite(two_agreeing_callers, M, M)
    calls = [n for _, n in _calls(new_graph_def, ("PartitionedCall", "StatefulPartitionedCall"))]
    assert len(calls) == 2 and len({n.attr["f"].func.name for n in calls}) == 1
    assert len(new_graph_def.library.function) == len(graph_def.library.function)
    assert [_types(n.attr["Tin"]) for n in calls] == [["float16", "float16"]] * 2


# -- TensorList accumulators: forward loop and its gradient loop ------------------------


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_tensor_array_in_a_loop_and_its_gradient(dtype):
    w = tf.Variable(np.random.default_rng(1).normal(size=(4, 4)).astype("float32") * 0.5)

    def step(x):
        with tf.GradientTape() as tape:
            ta = tf.TensorArray(tf.float32, size=3)

            def body(i, h, ta):
                h = tf.tanh(tf.matmul(h, w))
                return i + 1, h, ta.write(i, h)

            _, _, ta = tf.while_loop(lambda i, *_: i < 3, body, (tf.constant(0), x, ta))
            loss = tf.reduce_sum(tf.square(ta.stack()))
        return loss, tape.gradient(loss, w)

    x = tf.constant(np.random.default_rng(0).normal(size=(4, 4)).astype("float32"))
    concrete = tf.function(step).get_concrete_function(x)
    graph_def = concrete.graph.as_graph_def()
    new_graph_def, report = tfamp.rewrite_graph_def(
        graph_def, tfamp.AmpConfig(dtype=dtype),
        outputs=[t.name for t in concrete.graph.outputs])
    assert not tfamp.check_graph_def(new_graph_def)
    _list_groups_agree(new_graph_def)
    pushed = [n for _, n in _calls(new_graph_def, ("TensorListPushBack",))]
    popped = [n for _, n in _calls(new_graph_def, ("TensorListPopBack",))]
    assert pushed and popped
    assert any(dtype_name(n.attr["element_dtype"].type) == dtype for n in pushed)
    assert any(dtype_name(n.attr["element_dtype"].type) == dtype for n in popped)
    rewritten = tfamp.function(step, config=tfamp.AmpConfig(dtype=dtype), check=True)
    loss, grad = rewritten(x)
    want_loss, want_grad = tf.function(step)(x)
    np.testing.assert_allclose(loss, want_loss, rtol=3e-2)
    np.testing.assert_allclose(grad, want_grad, rtol=5e-2, atol=5e-2 * np.abs(want_grad).max())
    # The lists' full types (TensorFlow's experimental_type) say the new element type
    # too: a While lowered to frames merges lists said to hold float32 and dtype,
    # and TensorFlow's type inference logged "Type inference failed" per function.
    typed = [n for _, n in _calls(new_graph_def, ("TensorListPushBack", "EmptyTensorList"))
             if n.HasField("experimental_type") and dtype_name(n.attr["element_dtype"].type)
             == dtype]
    assert typed
    for node_def in typed:
        assert str(node_def.experimental_type).count("TFT_FLOAT") == 0, node_def
    spoiled = graph_pb2.GraphDef()
    spoiled.CopyFrom(new_graph_def)
    node_def = next(n for _, n in _calls(spoiled, ("TensorListPushBack", "EmptyTensorList"))
                    if n.HasField("experimental_type")
                    and dtype_name(n.attr["element_dtype"].type) == dtype)
    # (as tfamp left it before: element_dtype retyped, the full type still float32)
    stack = [node_def.experimental_type]
    while stack:
        full = stack.pop()
        if full.type_id in (full_type_pb2.TFT_HALF, full_type_pb2.TFT_BFLOAT16):
            full.type_id = full_type_pb2.TFT_FLOAT
        stack.extend(full.args)
    problems = tfamp.check_graph_def(spoiled, import_check=False)
    assert any("experimental_type" in p for p in problems), problems


# -- TF1 loops (control flow v1) ---------------------------------------------------------


def _tf1_loop(deny_before_loop: bool):
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.disable_control_flow_v2()
        try:
            x = tf.compat.v1.placeholder(tf.float32, [4, 4], name="x")
            w = tf.compat.v1.placeholder(tf.float32, [4, 4], name="w")
            init = tf.exp(x * 0.1) if deny_before_loop else x
            _, out = tf.compat.v1.while_loop(
                lambda i, h: i < 3, lambda i, h: (i + 1, tf.matmul(h * 0.5, w)),
                (tf.constant(0), init))
            tf.identity(out, name="out")
        finally:
            tf.compat.v1.enable_control_flow_v2()
    return graph.as_graph_def()


def _run_v1(graph_def, feeds):
    with tf.Graph().as_default() as graph:
        tf.graph_util.import_graph_def(graph_def, name="")
        with tf.compat.v1.Session(graph=graph) as session:
            return session.run("out:0", {f"{k}:0": v for k, v in feeds.items()})


@pytest.mark.parametrize("deny_before_loop,frame_dtype", [(False, "float16"),
                                                         (True, "float32")])
def test_tf1_loop_frame_has_one_dtype(deny_before_loop, frame_dtype):
    graph_def = _tf1_loop(deny_before_loop)
    new_graph_def, report = tfamp.rewrite_graph_def(graph_def, outputs=["out:0"])
    assert not tfamp.check_graph_def(new_graph_def)  # imports: no Cast on the back edge
    frame = [n for n in new_graph_def.node if n.op in ("Enter", "Merge", "Switch",
                                                       "NextIteration", "Exit")
             and n.attr["T"].type in (DT_FLOAT, tf.float16.as_datatype_enum)
             and n.name.startswith("while/") and "MatMul" not in n.name]
    assert {n.op for n in frame} == {"Enter", "Merge", "Switch", "NextIteration", "Exit"}
    assert {dtype_name(n.attr["T"].type) for n in frame} == {frame_dtype}
    assert report.node("while/MatMul").converted
    frame_kept = report.kept_fp32.get("TF1 loop frame", 0)
    assert frame_kept > 0 if frame_dtype == "float32" else frame_kept == 0
    feeds = _rng_feeds("x", "w")
    np.testing.assert_allclose(_run_v1(new_graph_def, feeds), _run_v1(graph_def, feeds),
                               rtol=2e-2, atol=2e-2)


# -- Keras LSTM / GRU training steps -----------------------------------------------------


def _keras_step(kind):
    import tf_keras as keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.layers.Input((10, 8)), getattr(keras.layers, kind)(16),
                              keras.layers.Dense(1)])
    optimizer = keras.optimizers.Adam(1e-2)

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss
    return step


def _loop_body_casts(graph_def, report):
    """Casts inserted in While bodies that run (called from the step), per iteration."""
    view = build_view(graph_def)
    analysis = boundaries._Analysis(view, tfamp.AmpConfig(), set())
    bodies = {fn for body, node, by_attr in analysis.calls
              if node.op in boundaries._WHILE_OPS and body.name not in analysis.hidden
              for fn in by_attr["body"]}
    assert len(bodies) == 2  # the forward loop and the gradient loop
    return sum(c.function in bodies for c in report.casts)


@pytest.mark.parametrize("kind,dtype", [
    ("LSTM", "float16"), ("LSTM", "bfloat16"), ("GRU", "float16"), ("GRU", "bfloat16")])
def test_keras_recurrent_training_step(kind, dtype):
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(4, 10, 8)).astype("float32"))
    y = tf.constant(rng.normal(size=(4, 1)).astype("float32"))
    reference = tf.function(_keras_step(kind))
    rewritten = tfamp.function(_keras_step(kind), config=tfamp.AmpConfig(dtype=dtype),
                               check=True)  # check_graph_def before running
    want = [float(reference(x, y)) for _ in range(5)]
    got = [float(rewritten(x, y)) for _ in range(5)]
    np.testing.assert_allclose(got, want, rtol=0.05)
    assert want[-1] < want[0] and got[-1] < got[0]  # it trains

    concrete = rewritten._tf_function.get_concrete_function(x, y)
    graph_def = concrete.graph.as_graph_def()
    report = rewritten.reports[0]
    outputs = [t.name for t in concrete.graph.outputs]
    before = _loop_body_casts(graph_def, _rewrite_with_fixed_signatures(graph_def, dtype, outputs))
    after = _loop_body_casts(graph_def, report)
    assert after < before / 3, (before, after)
    lists = [n for _, n in _calls(graph_def, ("TensorListPushBack",))]
    assert lists  # the forward loop keeps accumulators for the gradient loop


def test_a_loop_named_in_keep_fp32_keeps_its_types_on_every_side():
    graph_def, new_graph_def, report = rewrite(loop_matmul_tanh, M, M, keep_fp32=["^while$"])
    (_, loop), = _calls(new_graph_def, ("While", "StatelessWhile"))
    old = next(n for n in graph_def.node if n.name == loop.name)
    assert _types(loop.attr["T"]) == _types(old.attr["T"])
    body = _fdef(new_graph_def, loop.attr["body"].func.name)
    assert _sig(body, "in") == _sig(_fdef(graph_def, loop.attr["body"].func.name), "in")
    assert report.node("while/body_mm", body.signature.name).converted  # the body still is


def _many_values_through_a_cond(n: int, inside: str):
    """`n` float32 values, each from a MatMul, passed through one tf.cond whose
    branch uses each with a MatMul (16-bit on both sides) or an Exp (float32
    inside), as a loss-scaled step passes every gradient into apply-or-skip."""

    def fn(x, flag):
        values = [tf.matmul(x * float(k + 1), x) for k in range(n)]

        def use():
            op = tf.matmul if inside == "matmul" else (lambda a, b: tf.exp(a) + b)
            return tf.add_n([op(v, x) for v in values])

        return tf.cond(flag, use, lambda: tf.add_n(values))

    return fn


@pytest.mark.parametrize("inside", ["matmul", "exp"])
def test_many_boundary_groups_are_pruned_by_estimate_not_one_colouring_each(
        inside, monkeypatch):
    """Beyond boundaries._EXACT_GROUPS groups the plan is pruned by the local
    estimate, one colouring per round, instead of re-colouring every body once
    per group: the values take the same side as when every group is weighed
    exactly, with at most one Cast more (the greedy order differs), at a fraction
    of the colourings."""
    n = boundaries._EXACT_GROUPS + 8
    fn = _many_values_through_a_cond(n, inside)
    specs = (tf.TensorSpec([4, 4]), tf.TensorSpec([], tf.bool))
    colourings = []
    solve = boundaries.solve

    def counting_solve(view, config, pinned, color_body, *rest):
        return solve(view, config, pinned,
                     lambda body, overrides: colourings.append(1) or color_body(body, overrides),
                     *rest)

    monkeypatch.setattr(boundaries, "solve", counting_solve)
    monkeypatch.setattr(boundaries, "_EXACT_WORK", 0)  # (this graph is small: force it)
    graph_def, new_graph_def, report = rewrite(fn, *specs)
    pruned = len(colourings)
    colourings.clear()
    monkeypatch.setattr(boundaries, "_EXACT_GROUPS", 10 ** 6)
    _, exact_graph_def, exact = rewrite(fn, *specs)
    assert colourings and pruned < len(colourings) / 4, (pruned, len(colourings))

    def crossing(graph_def):  # the dtypes of the cond's inputs
        (_, call), = _calls(graph_def, ("If", "StatelessIf"))
        return _types(call.attr["Tin"])

    if inside == "matmul":  # MatMul on both sides: every value crosses in float16
        assert sum(t == "float16" for t in crossing(new_graph_def)) >= n
    pairs = zip(crossing(new_graph_def), crossing(exact_graph_def), strict=True)
    assert sum(a != b for a, b in pairs) <= 1
    assert len(exact.casts) <= len(report.casts) <= len(exact.casts) + 1


def test_coupled_loop_groups_are_weighed_exactly_when_that_is_cheap(monkeypatch):
    """A Keras 3 LSTM step's loops carry 30-40 groups through small bodies. The
    local estimate sees one group at a time and turned down the coupled ones
    (h and c pay off only together); weighing them exactly costs little here,
    so the pruning is kept for plans whose exact weighing would re-colour more
    than boundaries._EXACT_WORK nodes (Keras 3 ResNet-50's 214 groups into an
    8,000-node branch)."""
    import keras  # (Keras 3)

    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((16,), dtype="int32"), keras.layers.Embedding(100, 32),
        keras.layers.LSTM(64, return_sequences=True), keras.layers.LSTM(64, return_sequences=True),
        keras.layers.Dense(100)])
    model.compile(optimizer="adam", jit_compile=False,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    spec = tf.TensorSpec([8, 16], tf.int32)
    model._symbolic_build(data_batch=(spec, spec))
    concrete = tf.function(lambda data: model.train_step(data)).get_concrete_function(
        (spec, spec))
    graph_def = concrete.graph.as_graph_def(add_shapes=True)
    outputs = [t.name for t in concrete.graph.outputs]
    config = tfamp.AmpConfig(device_type="GPU")
    _, exact = tfamp.rewrite_graph_def(graph_def, config, outputs=outputs)
    monkeypatch.setattr(boundaries, "_EXACT_WORK", 0)
    _, pruned = tfamp.rewrite_graph_def(graph_def, config, outputs=outputs)
    assert exact.traffic_share < pruned.traffic_share - 0.1, (exact.traffic_share,
                                                              pruned.traffic_share)
    assert exact.traffic_share < 0.8 and exact.casts_inserted <= pruned.casts_inserted
