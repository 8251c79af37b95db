"""The public API surface and config validation."""

import subprocess
import sys

import pytest
import tensorflow as tf

import tfamp
from tfamp.oplists import DEFAULT_OP_LISTS, OpLists


def test_every_public_name_resolves():
    assert sorted(tfamp.__all__) == sorted(tfamp._EXPORTS)
    for name in tfamp.__all__:
        assert getattr(tfamp, name) is not None


def test_importing_tfamp_does_not_import_tensorflow():
    code = "import sys, tfamp; print('tensorflow' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert result.stdout.strip() == "False", result.stderr


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_default_lists_are_disjoint_and_known_ops(dtype):
    from tensorflow.python.framework import op_def_registry

    lists = DEFAULT_OP_LISTS[dtype]
    assert lists.allow & lists.deny == frozenset()
    unknown = sorted(op for op in lists.all_ops() if op_def_registry.get(op) is None)
    # grappler's CUDA list names a few ops that the pip wheel does not register
    # (contrib and internal fused kernels); they are kept as harmless data.
    not_in_wheel = {"FastUnsortedSegmentMax", "FusedConv2DBiasActivation",
                    "FusedSparseConvGpuV2", "Mha", "MhaV2", "Pmlp", "Tmlp", "TmlpV2", "TmlpV3"}
    assert set(unknown) <= not_in_wheel, unknown
    assert {"MatMul", "Conv2D", "Einsum", "BatchMatMulV2"} <= lists.allow


def test_op_on_two_lists_is_rejected():
    with pytest.raises(ValueError, match="on both the 'allow' and the 'deny' list"):
        OpLists(allow=frozenset({"MatMul"}), infer=frozenset(),
                deny=frozenset({"MatMul"}), clear=frozenset())


def test_with_changes_moves_an_op_and_keeps_defaults():
    lists = DEFAULT_OP_LISTS["float16"].with_changes(deny_add=["Tanh"], allow_remove=["Einsum"])
    assert lists.list_of("Tanh") == "deny" and "Tanh" not in lists.infer
    assert lists.list_of("Einsum") == "unlisted"
    assert "MatMul" in lists.allow  # the rest of the defaults are still there


@pytest.mark.parametrize("kwargs, message", [
    ({"dtype": "float8"}, "dtype must be one of ['float16', 'bfloat16'], received 'float8'"),
    ({"allow_add": ("Matmul",)}, "did you mean 'MatMul'"),
    ({"allow_add": "MatMul"}, "received the string 'MatMul'"),
    ({"keep_fp32": ("dense[",)}, "keep_fp32 expects regular expressions"),
    ({"device_type": "TPU"}, "device_type must be one of"),
    ({"allow_add": ("Exp",), "deny_add": ("Exp",)}, "added to both"),
])
def test_config_errors_say_what_and_how(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message.replace("[", r"\[").replace(
            "(", r"\(")):
        tfamp.AmpConfig(**kwargs)


def test_rewrite_rejects_non_graph_def():
    with pytest.raises(TypeError, match="expects a tf.compat.v1.GraphDef"):
        tfamp.rewrite_graph_def("graph.pb")


def test_rewrite_refuses_repeated_node_names_and_keeps_the_input():
    graph_def = tf.function(lambda x: tf.nn.relu(x, name="relu")).get_concrete_function(
        tf.TensorSpec([2], tf.float32)).graph.as_graph_def()
    graph_def.node.add().CopyFrom(next(n for n in graph_def.node if n.name == "relu"))
    before = graph_def.SerializeToString()
    with pytest.raises(ValueError, match="the top graph has more than one node named 'relu'"):
        tfamp.rewrite_graph_def(graph_def)
    assert graph_def.SerializeToString() == before


def test_the_report_names_what_the_rewrite_holds_in_16_bits():
    """``RewriteReport.sixteen_bit_tensors`` (the start-scale probe asks it which
    values count): converted nodes, and float32 values cast to 16 bits at a
    boundary; a value that stays float32 everywhere is neither."""
    from tests.graphs import rewrite

    def step(x, w):
        h = tf.matmul(x, w, name="mm")  # allow: 16-bit
        e = tf.exp(h, name="ex")  # deny: float32, then cast for the next matmul
        return tf.matmul(e, w, name="mm2"), tf.reduce_sum(tf.exp(x, name="alone"))

    spec = tf.TensorSpec([4, 4], tf.float32)
    _, _, report = rewrite(step, spec, spec)
    sixteen = report.sixteen_bit_tensors()
    assert {"mm", "mm2"} <= sixteen, sixteen
    assert "ex:0" in sixteen and "ex" not in sixteen, sixteen
    assert not {"alone", "alone:0"} & sixteen, sixteen
