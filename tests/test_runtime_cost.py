"""What a GPU pays per runtime (tfamp.rewrite.runtime_cost): launches and fusion."""

import json

import pytest
import tensorflow as tf

import tfamp
from tests.graphs import decision
from tfamp.rewrite import runtime_cost
from tfamp.rewrite.graph import build_view
from tfamp.rewrite.report import RewriteReport
from tfamp.rewrite.shapes import tensor_shapes
from tfamp.rewrite.traffic import body_weights, estimate_traffic

X = tf.TensorSpec([8, 16, 16, 8], tf.float16)  # 16,384 elements
W = tf.TensorSpec([3, 3, 8, 8], tf.float16)  # 576


def _estimate(fn, *specs):
    graph_def = tf.function(fn).get_concrete_function(*specs).graph.as_graph_def(
        add_shapes=True)
    view = build_view(graph_def)
    shapes = tensor_shapes(graph_def, view)
    return estimate_traffic(view, shapes, body_weights(view, shapes=shapes))


def _conv_cast_mean(x, w):
    y = tf.nn.conv2d(x, w, 1, "SAME", name="conv")
    return tf.reduce_mean(tf.cast(y, tf.float32, name="cast"), [0, 1, 2], name="mean")


def _conv_relu_cast_mean(x, w):
    y = tf.nn.relu(tf.nn.conv2d(x, w, 1, "SAME", name="conv"), name="relu")
    return tf.reduce_mean(tf.cast(y, tf.float32, name="cast"), [0, 1, 2], name="mean")


def test_xla_charges_a_cast_between_a_convolution_and_a_reduction():
    """conv -> Cast -> Mean: the Cast fuses with neither (a library kernel before
    it, a reduction after): its own kernel writes 4 bytes per element that the
    Mean reads back. Worked out by hand, bytes per element of the 16,384-element
    activation: x read by conv 2, conv writes 2 and the Cast reads 2, the Cast
    writes 4 and the Mean reads 4; plus w (576 x 2) and the mean (8 x 4)."""
    traffic = _estimate(_conv_cast_mean, X, W)
    assert traffic.fused_bytes() == 16384 * (2 + 2 + 2 + 4 + 4) + 576 * 2 + 8 * 4
    assert traffic.fused_kernels == 3  # conv, the Cast, mean
    assert traffic.kernels == 3  # the executor: one kernel per op


def test_xla_fuses_a_cast_next_to_an_element_wise_op():
    """conv -> Relu -> Cast -> Mean: Relu and the Cast fuse into the Mean's input
    fusion; nothing between conv and the Mean is written."""
    traffic = _estimate(_conv_relu_cast_mean, X, W)
    assert traffic.fused_bytes() == 16384 * (2 + 2 + 2) + 576 * 2 + 8 * 4
    assert traffic.fused_kernels == 2  # conv, mean (with Relu and the Cast in it)
    assert traffic.kernels == 4
    # The unfused estimate charges every tensor either way.
    assert traffic.total_bytes() > _estimate(_conv_cast_mean, X, W).total_bytes()


def _conv_plus_bias_map(x, w, p):
    y = tf.nn.conv2d(x, w, 1, "SAME", name="conv") + p  # AddV2: infer in float16
    return tf.identity(y, name="out")


SPECS32 = (tf.TensorSpec([8, 16, 16, 8]), tf.TensorSpec([3, 3, 8, 8]),
           tf.TensorSpec([8, 16, 16, 8]))


def test_each_runtime_decides_what_its_own_estimate_prefers():
    """An Add of a 16-bit conv output and a float32 input, read as float32: both
    options tie in bytes, the float32 one needs one Cast (the conv output) and
    the 16-bit one two. The executor pays a launch per Cast: float32. Under XLA
    every one of them fuses into the Add and the result is written float32
    either way: a tie, kept float32 with fewer Casts. And on each runtime's own
    estimate its decisions cost no more than the other runtime's."""
    graph_def = tf.function(_conv_plus_bias_map).get_concrete_function(
        *SPECS32).graph.as_graph_def(add_shapes=True)
    reports = {}
    for runtime in ("executor", "xla"):
        _, reports[runtime] = tfamp.rewrite_graph_def(
            graph_def, tfamp.AmpConfig(device_type="GPU", runtime=runtime),
            outputs=["out:0"])
        assert reports[runtime].runtime == runtime
        assert not decision(reports[runtime], "add").converted
    for runtime, other in (("executor", "xla"), ("xla", "executor")):
        own = reports[runtime].runtime_estimates[runtime]["cost_after"]
        assert own <= reports[other].runtime_estimates[runtime]["cost_after"]


def test_auto_follows_jit_compile():
    assert runtime_cost.resolve_runtime("auto", jit_compile=True) == "xla"
    assert runtime_cost.resolve_runtime("auto", jit_compile=None) == "executor"
    assert runtime_cost.resolve_runtime("executor", jit_compile=True) == "executor"
    fn = tfamp.function(lambda x: tf.nn.relu(tf.matmul(x, x)), jit_compile=True)
    fn.get_concrete_function(tf.TensorSpec([4, 4]))
    assert fn.reports[-1].runtime == "xla"
    plain = tfamp.function(lambda x: tf.nn.relu(tf.matmul(x, x)))
    plain.get_concrete_function(tf.TensorSpec([4, 4]))
    assert plain.reports[-1].runtime == "executor"


def test_invalid_runtime_is_refused():
    with pytest.raises(ValueError, match="runtime must be one of"):
        tfamp.AmpConfig(runtime="jit")


def test_both_estimates_in_report_json_and_summary():
    graph_def = tf.function(_conv_plus_bias_map).get_concrete_function(
        *SPECS32).graph.as_graph_def(add_shapes=True)
    _, report = tfamp.rewrite_graph_def(graph_def, tfamp.AmpConfig(device_type="GPU"),
                                        outputs=["out:0"])
    data = json.loads(report.to_json())
    assert data["runtime"] == "executor"
    for key, model in (("executor", runtime_cost.EXECUTOR), ("xla", runtime_cost.XLA)):
        est = data["runtime_estimates"][key]
        assert est["launch_bytes"] == model.launch_bytes
        assert est["cost_before"] == est["bytes_before"] + est["kernels_before"] * \
            model.launch_bytes
        assert est["cost_after"] == est["bytes_after"] + est["kernels_after"] * \
            model.launch_bytes
        assert est["share"] == pytest.approx(est["cost_after"] / est["cost_before"])
    line = report.summary_line()
    assert "GPU cost est. executor" in line and "XLA" in line
    assert "Casts placed for executor" in line
    assert RewriteReport.from_dict(data).runtime_estimates == data["runtime_estimates"]
    assert "XLA fused" in report.runtime_line()
    # An old report (no runtime keys) still loads and prints.
    old = {k: v for k, v in data.items() if k not in ("runtime", "runtime_estimates")}
    loaded = RewriteReport.from_dict(old)
    assert loaded.runtime_estimates == {} and loaded.runtime_sentence() == ""
