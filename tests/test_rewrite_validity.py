"""The rewrite is valid on every graph: a table of graphs that used to go wrong.

Each case is a tiny TF1-style graph (built in a ``tf.Graph``, so names, devices,
reference variables and TF1 loops are exactly as written) with the dtypes and
reason kinds tfamp must give some of its nodes. Every case also asserts that the
rewritten graph is valid (``check_graph_def`` finds nothing and TensorFlow
imports it) and that it computes the original's result within 16-bit tolerance.
Facts ported from TensorFlow's public ``auto_mixed_precision_test.cc`` say so
in their case's comment.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.ops import control_flow_util

import tfamp
from tests.graphs import trace
from tfamp.rewrite import pipeline
from tfamp.rewrite import reasons as rk
from tfamp.rewrite.check import GraphCheckError
from tfamp.rewrite.graph import build_view, dtype_name
from tfamp.rewrite.report import NodeReport, RewriteReport, reason_kind


@pytest.fixture(autouse=True)
def _written_record_is_exact(verify_written_record):
    """Every rewrite here also checks the record the self-check relies on."""


RNG = np.random.default_rng(0)
CPU = "/device:CPU:0"
CPU_FULL = "/job:localhost/replica:0/task:0/device:CPU:0"


@dataclasses.dataclass
class Built:
    """A graph with what it takes to run it."""

    graph_def: tf.compat.v1.GraphDef
    feeds: dict[str, np.ndarray]
    fetches: list[str]
    init: list[str] = dataclasses.field(default_factory=list)
    # The tf.Graph it came from: alive, so PyFunc callbacks stay registered.
    graph: tf.Graph | None = None


def _tf1_graph(build: Callable[[], tuple[dict, list[str], list[str]]],
               control_flow_v2: bool = True) -> Built:
    old = control_flow_util.ENABLE_CONTROL_FLOW_V2
    control_flow_util.ENABLE_CONTROL_FLOW_V2 = control_flow_v2
    try:
        graph = tf.Graph()
        with graph.as_default():
            feeds, fetches, init = build()
    finally:
        control_flow_util.ENABLE_CONTROL_FLOW_V2 = old
    return Built(graph.as_graph_def(), feeds, fetches, init, graph)


def _placeholder(name: str, shape, scale: float = 1.0):
    value = (RNG.normal(size=shape) * scale).astype("float32")
    return tf.compat.v1.placeholder(tf.float32, shape, name=name), value


# -- graph builders -------------------------------------------------------------


def pinned_pool(device: str) -> Callable[[], Built]:
    """Conv3D -> MaxPool3D pinned to the CPU (float16 MaxPool3D: GPU kernel only)."""
    def build():
        x, xv = _placeholder("x", [1, 4, 4, 4, 2])
        f = tf.constant(RNG.normal(size=(2, 2, 2, 2, 2)).astype("float32"), name="f")
        conv = tf.nn.conv3d(x, f, [1] * 5, "SAME", name="conv")
        if device:
            with tf.device(device):
                pool = tf.nn.max_pool3d(conv, 2, 2, "VALID", name="pool")
        else:
            pool = tf.nn.max_pool3d(conv, 2, 2, "VALID", name="pool")
        tf.identity(pool, name="out")
        return {"x": xv}, ["out:0"], []
    return lambda: _tf1_graph(build)


def pinned_relu(device: str) -> Callable[[], Built]:
    """Conv3D -> Relu pinned to `device` -> Conv3D (Relu has a float16 CPU kernel)."""
    def build():
        x, xv = _placeholder("x", [1, 4, 4, 4, 2])
        f = tf.constant(RNG.normal(size=(2, 2, 2, 2, 2)).astype("float32"), name="f")
        conv = tf.nn.conv3d(x, f, [1] * 5, "SAME", name="conv")
        relu = tf.nn.relu(conv, name="relu")
        relu.op._set_device(device)  # (the string as written, not normalised by tf.device)
        conv2 = tf.nn.conv3d(relu, f, [1] * 5, "SAME", name="conv2")
        tf.identity(conv2, name="out")
        return {"x": xv}, ["out:0"], []
    return lambda: _tf1_graph(build)


def ref_variable() -> Built:
    """A TF1 reference variable (VariableV2 + its `read` Identity) feeding MatMul.

    Ported fact (PreserveIdentityAfterVariable): the Identity after the variable
    stays float32 while an Identity of a constant next to MatMul goes 16-bit.
    """
    def build():
        x, xv = _placeholder("x", [4, 4])
        v = tf.compat.v1.Variable(RNG.normal(size=(4, 4)).astype("float32"),
                                  use_resource=False, name="v")
        c = tf.identity(tf.constant(np.eye(4, dtype="float32"), name="c"), name="c_id")
        mm = tf.matmul(x, v, name="mm")
        mm2 = tf.matmul(x, c, name="mm2")
        tf.identity(mm, name="out1")
        tf.identity(mm2, name="out2")
        return {"x": xv}, ["out1:0", "out2:0"], [v.initializer.name]
    return _tf1_graph(build)


def tf1_loop_deny_entry() -> Built:
    """tf.compat.v1.while_loop (control flow v1) whose value enters through Exp.

    Ported fact (RecurrentEdgeColorMismatch): the Merge is float32 (deny reaches
    it from Exp through Enter), the MatMul in the body is float16, and the
    NextIteration on the back edge must stay float32 with its Merge; tfamp used
    to make it float16 and put a Cast on the back edge (TensorFlow: "nodes in a
    cycle").
    """
    def build():
        x, xv = _placeholder("x", [4, 4], scale=0.3)
        w = tf.constant(np.eye(4, dtype="float32") * 0.5, name="w")
        _, out = tf.compat.v1.while_loop(
            lambda i, v: i < 3, lambda i, v: (i + 1, tf.matmul(tf.sqrt(v), w)),
            [0, tf.exp(x)], name="loop")
        tf.identity(out, name="out")
        return {"x": xv}, ["out:0"], []
    return _tf1_graph(build, control_flow_v2=False)


def tf1_loop_matmul_relu() -> Built:
    """A control-flow-v1 loop with MatMul -> Relu in its body and nothing denied."""
    def build():
        x, xv = _placeholder("x", [4, 4])
        w = tf.constant(np.eye(4, dtype="float32") * 0.9, name="w")
        _, out = tf.compat.v1.while_loop(
            lambda i, v: i < 3, lambda i, v: (i + 1, tf.nn.relu(tf.matmul(v, w))),
            [0, x], name="loop")
        tf.identity(out, name="out")
        return {"x": xv}, ["out:0"], []
    return _tf1_graph(build, control_flow_v2=False)


def const_and_placeholder_with_default() -> Built:
    """A Const and a PlaceholderWithDefault feeding MatMul (listed by the user)."""
    def build():
        x, xv = _placeholder("x", [4, 4])
        c = tf.constant(RNG.normal(size=(4, 4)).astype("float32"), name="c")
        d = tf.compat.v1.placeholder_with_default(c, [4, 4], name="d")
        tf.identity(tf.matmul(x, d, name="mm"), name="out")
        return {"x": xv}, ["out:0"], []
    return _tf1_graph(build)


def py_func() -> Built:
    """A PyFunc (Tout float32: what the callable returns) feeding MatMul."""
    def build():
        x, xv = _placeholder("x", [4, 4])
        y = tf.compat.v1.py_func(lambda a: a * np.float32(2), [x], tf.float32, name="pyf")
        y.set_shape([4, 4])
        tf.identity(tf.matmul(y, x, name="mm"), name="out")
        return {"x": xv}, ["out:0"], []
    return _tf1_graph(build)


def already_16bit() -> Built:
    """Ported fact (AlreadyFp16): a user's own Casts around 16-bit math are kept."""
    def build():
        x, xv = _placeholder("x", [4, 4])
        half = tf.cast(x, tf.float16, name="cst1")
        relu = tf.nn.relu(tf.matmul(half, half, name="allow1"), name="clr1")
        back = tf.cast(relu, tf.float32, name="cst2")
        tf.identity(tf.nn.relu(back, name="clr2"), name="out")
        return {"x": xv}, ["out:0"], []
    return _tf1_graph(build)


def no_op_chain() -> Built:
    """Ported fact (NoOp): Exp -> Relu -> Sqrt -> Relu has nothing to convert."""
    def build():
        x, xv = _placeholder("x", [32])
        y = tf.nn.relu(tf.sqrt(tf.nn.relu(tf.exp(x, name="deny1"), name="clr1"),
                               name="infer1"), name="clr2")
        tf.identity(y, name="out")
        return {"x": xv}, ["out:0"], []
    return _tf1_graph(build)


def user_cast_chains() -> Built:
    """A truncation through int32 and a deliberate float16 rounding, both the user's."""
    def build():
        x, xv = _placeholder("x", [4, 4], scale=3.0)
        truncated = tf.cast(tf.cast(x, tf.int32, name="to_int"), tf.float32, name="from_int")
        rounded = tf.cast(tf.cast(x, tf.float16, name="to_half"), tf.float32, name="from_half")
        tf.identity(tf.matmul(truncated, rounded, name="mm"), name="out")
        return {"x": xv}, ["out:0"], []
    return _tf1_graph(build)


# -- the table ------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    name: str
    build: Callable[[], Built]
    dtypes: dict[str, str]  # node -> dtype of its first float type attribute after
    kinds: dict[str, str] = dataclasses.field(default_factory=dict)
    reason_has: dict[str, str] = dataclasses.field(default_factory=dict)
    config: dict = dataclasses.field(default_factory=dict)
    warns: tuple[str, ...] = ()  # ops the config must warn about (data-bound)
    runs: bool = True  # False: the rewritten graph needs a GPU kernel to run


CASES = [
    Case("cpu_pinned_node_in_gpu_graph", pinned_pool(CPU),
         dtypes={"conv": "float16", "pool": "float32"},
         kinds={"pool": rk.KIND_OFF_DEVICE},
         reason_has={"pool": CPU}, config={"device_type": "GPU"}),
    Case("cpu_pinned_node_full_device_name", pinned_pool(CPU_FULL),
         dtypes={"conv": "float16", "pool": "float32"},
         kinds={"pool": rk.KIND_OFF_DEVICE},
         reason_has={"pool": CPU_FULL}, config={"device_type": "GPU"}),
    # A node pinned to the CPU in a GPU graph stays as it is even where the CPU
    # has a 16-bit kernel (Relu), as grappler leaves nodes off its device alone;
    # every way of writing the CPU is read as the CPU.
    *(Case(f"cpu_pinned_relu_{label}_in_gpu_graph", pinned_relu(device),
           dtypes={"conv": "float16", "relu": "float32", "conv2": "float16"},
           kinds={"relu": rk.KIND_OFF_DEVICE}, reason_has={"relu": device},
           config={"device_type": "GPU"})
      for label, device in (("device", CPU), ("full_name", CPU_FULL),
                            ("short", "/cpu:0"), ("bare", "CPU:0"))),
    # Controls: pinned to a GPU, or in a CPU graph, the Relu is decided as before.
    Case("gpu_pinned_relu_in_gpu_graph", pinned_relu("/device:GPU:0"),
         dtypes={"conv": "float16", "relu": "float16", "conv2": "float16"},
         config={"device_type": "GPU"}, runs=False),
    Case("cpu_pinned_relu_in_cpu_graph", pinned_relu(CPU),
         dtypes={"conv": "float16", "relu": "float16", "conv2": "float16"},
         config={"device_type": "CPU"}),
    # Control: the same node unpinned is judged by the GPU's kernels and converts.
    Case("unpinned_node_in_gpu_graph", pinned_pool(""),
         dtypes={"conv": "float16", "pool": "float16"}, config={"device_type": "GPU"},
         runs=False),
    Case("unpinned_node_in_cpu_graph", pinned_pool(""),
         dtypes={"conv": "float16", "pool": "float32"},
         kinds={"pool": rk.KIND_NO_KERNEL}, config={"device_type": "CPU"}),
    Case("tf1_reference_variable", ref_variable,
         dtypes={"v": "float32", "v/read": "float32", "mm": "float16",
                 "c_id": "float16", "mm2": "float16"},
         kinds={"v": rk.KIND_VARIABLE, "v/read": rk.KIND_VARIABLE,
                "v/Assign": rk.KIND_VARIABLE},
         reason_has={"v/read": "reference variable 'v'"}),
    Case("tf1_loop_back_edge_kept_with_its_merge", tf1_loop_deny_entry,
         dtypes={"loop/Merge_1": "float32", "loop/MatMul": "float16",
                 "loop/NextIteration_1": "float32", "loop/Exit_1": "float32"},
         kinds={"loop/NextIteration_1": rk.KIND_TF1_FRAME},
         reason_has={"loop/NextIteration_1": "TF1 loop frame kept float32 as a whole"}),
    Case("tf1_loop_matmul_relu", tf1_loop_matmul_relu,
         dtypes={"loop/MatMul": "float16"}),
    Case("const_listed_by_user", const_and_placeholder_with_default,
         dtypes={"c": "float32", "d": "float32", "mm": "float16"},
         kinds={"c": rk.KIND_DATA_BOUND, "d": rk.KIND_DATA_BOUND},
         reason_has={"c": "value attribute", "d": "fed value"},
         config={"clear_add": ["Const", "PlaceholderWithDefault"]},
         warns=("Const", "PlaceholderWithDefault")),
    Case("py_func_listed_by_user", py_func,
         dtypes={"pyf": "float32", "mm": "float16"},
         kinds={"pyf": rk.KIND_DATA_BOUND}, reason_has={"pyf": "Python callable"},
         config={"infer_add": ["PyFunc"]}, warns=("PyFunc",)),
    Case("already_16bit", already_16bit,
         dtypes={"allow1": "float16", "clr1": "float16", "clr2": "float32"}),
    Case("no_op_chain", no_op_chain,
         dtypes={"deny1": "float32", "clr1": "float32", "infer1": "float32",
                 "clr2": "float32"}),
    Case("user_cast_chains", user_cast_chains,
         dtypes={"mm": "float16", "to_half": "float16"}),
]


def _first_float_dtype(graph_def, name: str) -> str:
    node = build_view(graph_def).bodies[0].nodes[name]
    for port in node.outputs + node.inputs:
        if port.type_attr and dtype_name(port.dtype) in ("float32", "float16", "bfloat16"):
            return dtype_name(port.dtype)
    raise AssertionError(f"{name!r} has no float type attribute")


def _run(graph_def, built: Built) -> list[np.ndarray]:
    graph = tf.Graph()
    with graph.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
    with tf.compat.v1.Session(graph=graph) as session:
        for op in built.init:
            session.run(op)
        return session.run(built.fetches, {f"{k}:0": v for k, v in built.feeds.items()})


def _config(case: Case) -> tfamp.AmpConfig:
    if case.warns:
        with pytest.warns(UserWarning) as record:
            config = tfamp.AmpConfig(**case.config)
        messages = [str(w.message) for w in record]
        for op in case.warns:
            assert any(f"{op!r} is ignored: its dtype is bound to its data" in m
                       for m in messages), messages
        return config
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return tfamp.AmpConfig(**case.config)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_rewrite_is_valid_with_expected_dtypes_and_numerics(case):
    built = case.build()
    before = built.graph_def.SerializeToString(deterministic=True)
    new_graph_def, report = tfamp.rewrite_graph_def(
        built.graph_def, _config(case), outputs=built.fetches)
    assert built.graph_def.SerializeToString(deterministic=True) == before, "input mutated"

    for name, dtype in case.dtypes.items():
        assert _first_float_dtype(new_graph_def, name) == dtype, (
            name, report.node(name).reason)
    for name, kind in case.kinds.items():
        assert report.node(name).kind == kind, (name, report.node(name).reason)
        assert not report.node(name).converted
    for name, text in case.reason_has.items():
        assert text in report.node(name).reason, report.node(name).reason

    assert tfamp.check_graph_def(new_graph_def) == []
    if not case.runs:
        return
    want = _run(built.graph_def, built)
    got = _run(new_graph_def, built)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype
        np.testing.assert_allclose(g, w, rtol=1e-2, atol=1e-2 * max(1.0, np.abs(w).max()))


def test_tf1_loop_frame_is_coloured_whole_without_the_self_check(monkeypatch):
    """The loop defect is gone by construction: a TF1 frame is one boundary group.

    With the self-check switched off, the frame (Merge, NextIteration, ...)
    still keeps one dtype, so the result imports (no Cast on the back edge).
    """
    built = tf1_loop_deny_entry()
    monkeypatch.setattr(pipeline, "find_problems", lambda view, **kw: [])
    new_graph_def, report = tfamp.rewrite_graph_def(built.graph_def, tfamp.AmpConfig(
        device_type="GPU"), outputs=built.fetches)
    back_edge = report.node("loop/NextIteration_1")
    assert not back_edge.converted and back_edge.kind == rk.KIND_TF1_FRAME
    assert report.node("loop/MatMul").converted
    assert tfamp.check_graph_def(new_graph_def) == []


def test_self_check_raises_naming_the_node_when_keeping_float32_does_not_help(monkeypatch):
    def matmul_relu():
        x, xv = _placeholder("x", [4, 4])
        tf.identity(tf.nn.relu(tf.matmul(x, x, name="mm"), name="relu"), name="out")
        return {"x": xv}, ["out:0"], []

    built = _tf1_graph(matmul_relu)
    real = pipeline.insert_casts

    def corrupting(graph_def, view, coloring):
        new_graph_def, casts, written = real(graph_def, view, coloring)
        relu = next(n for n in new_graph_def.node if n.name == "relu")
        relu.attr["T"].type = tf.bfloat16.as_datatype_enum  # no Cast on either edge
        written.setdefault("", {})["relu"] = relu  # a writer's bug, recorded as written
        return new_graph_def, casts, written

    monkeypatch.setattr(pipeline, "insert_casts", corrupting)
    with pytest.raises(GraphCheckError, match="Relu 'relu' input 0 expects bfloat16"):
        tfamp.rewrite_graph_def(built.graph_def, outputs=built.fetches)


def _graph_with_functions():
    @tf.function
    def step(x, w):
        y = tf.cond(tf.reduce_sum(x) > 0, lambda: tf.matmul(x, w), lambda: x - w)
        return tf.while_loop(lambda i, v: i < 2, lambda i, v: (i + 1, tf.nn.relu(v)),
                             [0, y])[1]

    spec = tf.TensorSpec([4, 4])
    graph_def = step.get_concrete_function(spec, spec).graph.as_graph_def()
    # FunctionDefs without argument attributes (hand-built, or from other tools):
    # TensorFlow's function_def_to_graph inserts an empty entry for each argument.
    for fdef in graph_def.library.function:
        fdef.ClearField("arg_attr")
    return graph_def


def test_check_graph_def_does_not_edit_its_input():
    graph_def = _graph_with_functions()
    assert len(graph_def.library.function) >= 3
    new_graph_def, _ = tfamp.rewrite_graph_def(graph_def)
    for checked in (graph_def, new_graph_def):
        before = checked.SerializeToString(deterministic=True)
        assert tfamp.check_graph_def(checked) == []
        assert checked.SerializeToString(deterministic=True) == before


def test_users_cast_chains_pass_check_true_at_run_time():
    @tfamp.function(check=True)
    def chains(x):
        truncated = tf.cast(tf.cast(x, tf.int32), tf.float32)
        rounded = tf.cast(tf.cast(x, tf.float16), tf.float32)
        return tf.matmul(truncated, rounded)

    x = tf.constant(RNG.normal(size=(4, 4)).astype("float32") * 3)
    want = tf.matmul(tf.cast(tf.cast(x, tf.int32), tf.float32),
                     tf.cast(tf.cast(x, tf.float16), tf.float32))
    np.testing.assert_allclose(chains(x), want, rtol=1e-2, atol=1e-2 * np.abs(want).max())


@pytest.mark.parametrize("variable, field, op", [
    ("TFAMP_ALLOWLIST_ADD", "allow_add", "EagerPyFunc"),
    ("TFAMP_CLEARLIST_ADD", "clear_add", "OptionalGetValue"),
    ("TFAMP_INFERLIST_ADD", "infer_add", "Const"),
])
def test_listing_a_data_bound_op_by_environment_warns(monkeypatch, variable, field, op):
    from tfamp import env

    monkeypatch.setenv(variable, op)
    with pytest.warns(UserWarning, match=f"{field}: '{op}' is ignored: its dtype is bound"):
        settings = env.settings_from_env()
    assert op in getattr(settings.config, field)


def test_denying_or_removing_a_data_bound_op_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tfamp.AmpConfig(deny_add=["Const"], clear_remove=["Identity"])


def test_kept_fp32_groups_by_the_recorded_kind():
    built = ref_variable()
    _, report = tfamp.rewrite_graph_def(built.graph_def, outputs=built.fetches)
    read = report.node("v/read")
    assert read.kind == rk.KIND_VARIABLE and read.list == "clear"
    relabelled = dataclasses.replace(read, kind=rk.KIND_USER_OVERRIDE)
    report.nodes[report.nodes.index(read)] = relabelled
    assert report.kept_fp32.get(rk.KIND_USER_OVERRIDE) == 1  # the field, not the sentence


def test_old_json_without_kinds_falls_back_to_the_sentence_parser():
    built = tf1_loop_deny_entry()
    _, report = tfamp.rewrite_graph_def(built.graph_def, outputs=built.fetches)
    data = report.to_dict()
    assert all("kind" in n for n in data["nodes"])
    for n in data["nodes"]:
        del n["kind"]
    old = RewriteReport.from_dict(data)
    for new_node, old_node in zip(report.nodes, old.nodes, strict=True):
        assert old_node.kind == reason_kind(new_node.reason)
        if new_node.kind != rk.KIND_INVALID_GRAPH:  # a kind the old sentences never had
            assert old_node.kind in (new_node.kind, rk.KIND_OTHER), new_node
    assert RewriteReport.from_dict(report.to_dict()).nodes == report.nodes
    assert NodeReport("n", "", "Exp", "deny", False, "deny: numerically risky").kind == (
        rk.KIND_DENY_LIST)


def test_an_edit_missing_from_the_written_record_is_caught(monkeypatch):
    """The record check above can fail: an unrecorded edit is an error."""
    from tests.conftest import checked_insert_casts
    from tfamp.rewrite import casts

    def sloppy(graph_def, view, coloring):
        new, records, written = casts.insert_casts(graph_def, view, coloring)
        node = next(n for n in new.node if n.name not in written.get("", {}))
        node.device = "/device:CPU:0"  # an edit the record does not name
        return new, records, written

    monkeypatch.setattr(pipeline, "insert_casts", checked_insert_casts(sloppy))
    graph_def, outputs, _ = trace(lambda x, w: tf.nn.relu(tf.matmul(x, w)),
                               tf.TensorSpec([4, 4]), tf.TensorSpec([4, 4]))
    with pytest.raises(AssertionError):
        tfamp.rewrite_graph_def(graph_def, outputs=outputs)
