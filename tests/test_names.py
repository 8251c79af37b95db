"""Short function names in ``tfamp inspect`` (text, --why, HTML) and --full-names."""

import json
import re

import pytest
import tensorflow as tf

import tfamp
from tfamp import cli
from tfamp.inspect.explain import explain, find_node
from tfamp.inspect.html_report import render_html
from tfamp.inspect.names import short_function_name, short_function_names, shorten_quoted


@pytest.mark.parametrize("full, short", [
    ("__inference__wrapped_model_1428", "_wrapped_model"),
    ("__inference_train_step_57", "train_step"),
    ("__inference___backward_one_step_on_data_120_161", "__backward_one_step_on_data"),
    ("__inference_lstm_body_12_tfamp3", "lstm_body"),
    ("while_body_88", "while_body"),
    ("plain", "plain"),
    ("__inference__123", "__inference__123"),  # nothing would be left: keep it
    ("_42", "_42"),  # nothing would be left: keep it
])
def test_short_function_name(full, short):
    assert short_function_name(full) == short


def test_short_names_that_would_collide_stay_full():
    names = ["__inference_step_12", "__inference_step_30", "__inference_loss_7", "body_3",
             "body"]
    assert short_function_names(names) == {
        "__inference_step_12": "__inference_step_12",
        "__inference_step_30": "__inference_step_30",
        "__inference_loss_7": "loss",
        "body_3": "body_3",  # 'body' is another function's name
        "body": "body",
    }


def test_shorten_quoted_only_touches_quoted_function_names():
    shown = {"__inference_f_12": "f"}
    assert shorten_quoted("calls '__inference_f_12': x __inference_f_12", shown) == (
        "calls 'f': x __inference_f_12")


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    class Model(tf.Module):
        def __init__(self):
            self.w = tf.Variable(tf.ones((4, 4)))

        @tf.function(input_signature=[tf.TensorSpec([2, 4])])
        def serve(self, x):
            return tf.nn.relu(tf.matmul(x, self.w, name="mm"), name="relu")

    folder = tmp_path_factory.mktemp("sm") / "model"
    module = Model()
    tf.saved_model.save(module, str(folder), signatures={"serving_default": module.serve})
    return folder


def test_inspect_shows_short_names_and_full_names_on_request(capsys, saved_model):
    # (Each in-process load renames the functions, so the digits vary.)
    assert cli.main(["inspect", str(saved_model), "--nodes", "--op", "MatMul"]) == 0
    short = capsys.readouterr().out.splitlines()[-1]
    assert short.startswith("  serve/mm  [MatMul, allow] -> float16")
    assert cli.main(["inspect", str(saved_model), "--nodes", "--op", "MatMul",
                     "--full-names"]) == 0
    full = capsys.readouterr().out.splitlines()[-1]
    assert re.match(r"  __inference_serve_\d+/mm  \[MatMul, allow\] -> float16", full), full

    assert cli.main(["inspect", str(saved_model), "--nodes", "--op",
                     "StatefulPartitionedCall"]) == 0
    assert "calls 'serve': its signature is kept" in capsys.readouterr().out


def test_why_accepts_and_shows_either_name(saved_model):
    from tfamp.inspect.graph_files import load_inspectable

    loaded = load_inspectable(saved_model)
    _, report = tfamp.rewrite_graph_def(loaded.graph_def, outputs=loaded.outputs)
    function = next(n.function for n in report.nodes if n.name == "mm")
    assert find_node(report, "serve/mm") is find_node(report, f"{function}/mm")
    assert explain(report, "serve/relu")[0] == "Relu 'serve/relu': list clear; runs in float16"
    assert explain(report, "serve/relu", full_names=True)[0] == (
        f"Relu '{function}/relu': list clear; runs in float16")


def test_html_labels_functions_short_unless_full_names(saved_model):
    from tfamp.inspect.graph_files import load_inspectable

    loaded = load_inspectable(saved_model)
    _, report = tfamp.rewrite_graph_def(loaded.graph_def, outputs=loaded.outputs)
    function = next(n.function for n in report.nodes if n.name == "mm")

    def bodies(html):
        data = json.loads(re.search(r'<script type="application/json" id="tfamp-data">(.*?)'
                                    r'</script>', html, re.S).group(1))
        return {b["name"]: b["shown"] for b in data["bodies"]}
    assert bodies(render_html(report, loaded.graph_def))[function] == "serve"
    assert bodies(render_html(report, loaded.graph_def, full_names=True))[function] == function
