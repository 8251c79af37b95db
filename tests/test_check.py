"""check_graph_def finds each kind of defect it claims to (planted by hand)."""

import tensorflow as tf
from tensorflow.core.framework import types_pb2

import tfamp
from tests.graphs import trace

M = tf.TensorSpec([4, 4])


def matmul_relu(x, w):
    return tf.nn.relu(tf.matmul(x, w, name="mm"), name="relu")


def test_sound_graph_has_no_problems():
    graph_def, _, _ = trace(matmul_relu, M, M)
    assert tfamp.check_graph_def(graph_def) == []


def test_edge_dtype_mismatch_is_found():
    graph_def, _, _ = trace(matmul_relu, M, M)
    mm = next(n for n in graph_def.node if n.name == "mm")
    mm.attr["T"].type = types_pb2.DT_HALF  # retyped without casts on its edges
    problems = tfamp.check_graph_def(graph_def, import_check=False)
    assert any("MatMul 'mm' input 0 expects float16 but 'x' is float32" in p for p in problems)
    assert any("Relu 'relu' input 0 expects float32 but 'mm' is float16" in p for p in problems)


def test_cast_round_trip_inserted_by_tfamp_is_found():
    graph_def, _, _ = trace(
        lambda x: tf.cast(tf.cast(x, tf.float16, name="down"), tf.float32, name="up"), M)
    # Plant the first Cast under the name tfamp gives the Casts it inserts.
    planted = "x/tfamp_cast_0_to_f16"
    for node in graph_def.node:
        if node.name == "down":
            node.name = planted
        node.input[:] = [planted if i == "down" else i for i in node.input]
    problems = tfamp.check_graph_def(graph_def)
    assert len(problems) == 1 and "Cast round trip float32 -> float16 -> float32" in problems[0]
    assert planted in problems[0]


def test_a_users_own_cast_round_trip_is_not_a_problem():
    graph_def, _, _ = trace(lambda x: tf.cast(tf.cast(x, tf.float16), tf.float32), M)
    assert tfamp.check_graph_def(graph_def) == []


def test_loop_retyped_at_the_call_site_only_is_found():
    def loop(x):
        return tf.while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, v * 2.0), [0, x])[1]

    graph_def, _, _ = trace(loop, tf.TensorSpec([2]))
    node = next(n for n in graph_def.node if n.op in ("While", "StatelessWhile"))
    node.attr["T"].list.type[-1] = types_pb2.DT_BFLOAT16
    problems = tfamp.check_graph_def(graph_def, import_check=False)
    calls = [p for p in problems if "declares T" in p]
    assert len(calls) == 3, problems  # cond arguments, body arguments, body results
    assert "but 'while_cond" in calls[0] and "takes [int32, int32, int32, float32]" in calls[0]


def test_tensorflow_import_failure_is_reported():
    graph_def, _, _ = trace(matmul_relu, M, M)
    graph_def.node.add(name="dangling", op="Identity", input=["no_such_node"]).attr[
        "T"].type = types_pb2.DT_FLOAT
    problems = tfamp.check_graph_def(graph_def)
    assert problems and "cannot import" in problems[0]


def test_check_against_an_earlier_view_looks_only_where_nodedefs_differ():
    from tensorflow.core.framework import graph_pb2

    from tfamp.rewrite.check import find_problems
    from tfamp.rewrite.graph import build_view

    def two_chains(x, w):
        a = tf.nn.relu(tf.matmul(x, w, name="mm_a"), name="relu_a")
        b = tf.nn.relu(tf.matmul(x, w, name="mm_b"), name="relu_b")
        return a + b

    graph_def, _, _ = trace(two_chains, M, M)
    nodes = {n.name: n for n in graph_def.node}
    nodes["mm_a"].attr["T"].type = types_pb2.DT_HALF  # a defect of the input itself
    earlier = build_view(graph_def)
    edited = graph_pb2.GraphDef()
    edited.CopyFrom(graph_def)
    next(n for n in edited.node if n.name == "relu_b").attr["T"].type = types_pb2.DT_HALF
    full = [p.message for p in find_problems(build_view(edited))]
    view = build_view(edited, earlier=earlier)
    assert view.bodies[0].edited == {"relu_b"}
    found = [p.message for p in find_problems(view)]
    # The edited node's own edges and its consumer's are checked ...
    assert any("Relu 'relu_b' input 0 expects float16 but 'mm_b' is float32" in m for m in found)
    assert any("'relu_b' is float16" in m for m in found), found
    # ... and the input's own defect, untouched, is left out (the pass ignores it).
    assert not any("mm_a" in m for m in found) and any("mm_a" in m for m in full)
    assert set(found) <= set(full)


def test_a_graph_with_two_nodes_of_one_name_is_read_as_before():
    """build_view reads the top graph in one pass; with a repeated name it falls
    back to the general reader, where the last node of that name counts."""
    from tfamp.rewrite.graph import TensorRef, build_view

    graph_def, _, _ = trace(matmul_relu, M, M)
    first = next(n for n in graph_def.node if n.name == "relu")
    again = graph_def.node.add()
    again.CopyFrom(first)
    del again.input[:]
    again.input.append("x")
    body = build_view(graph_def).bodies[0]
    assert len(body.nodes) == len(graph_def.node) - 1
    assert [ref for ref, _ in body.nodes["relu"].data_inputs] == [TensorRef("x", 0)]
    assert ("relu", 0) in body.consumers[TensorRef("x", 0)]
    assert ("relu", 0) not in body.consumers.get(TensorRef("mm", 0), [])
