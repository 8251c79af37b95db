"""The tfamp command line: inspect output and every user error as one clean line."""

import json
import re
import subprocess
import sys

import pytest
import tensorflow as tf

from tfamp import cli


@pytest.fixture(scope="module")
def graph_files(tmp_path_factory):
    def model(x, w):
        return tf.exp(tf.nn.relu(tf.matmul(x, w, name="mm"), name="relu"), name="exp")

    concrete = tf.function(model).get_concrete_function(
        tf.TensorSpec([2, 2]), tf.TensorSpec([2, 2]))
    graph_def = concrete.graph.as_graph_def()
    folder = tmp_path_factory.mktemp("graphs")
    binary = folder / "model.pb"
    binary.write_bytes(graph_def.SerializeToString())
    text = folder / "model.pbtxt"
    text.write_text(str(graph_def))
    return folder, binary, text


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_inspect_binary_and_text_agree(capsys, graph_files):
    _, binary, text = graph_files
    code, out_binary, _ = run(capsys, "inspect", str(binary), "--format", "json")
    assert code == 0
    code, out_text, _ = run(capsys, "inspect", str(text), "--format", "json")
    assert code == 0
    a, b = json.loads(out_binary), json.loads(out_text)
    assert a["converted"] == b["converted"] == {"MatMul": 1, "Relu": 1}
    assert {n["name"]: n["converted"] for n in a["nodes"]}["exp"] is False


def test_inspect_nodes_filter_and_reasons(capsys, graph_files):
    _, binary, _ = graph_files
    code, out, _ = run(capsys, "inspect", str(binary), "--nodes", "--op", "Exp")
    assert code == 0
    assert "exp  [Exp, deny] -> float32: deny: numerically risky in float16" in out
    assert "mm  [MatMul" not in out


def test_inspect_renders_a_saved_report(capsys, graph_files, tmp_path):
    _, binary, _ = graph_files
    _, out, _ = run(capsys, "inspect", str(binary), "--format", "json")
    saved = tmp_path / "report.json"
    saved.write_text(out)
    code, again, _ = run(capsys, "inspect", str(saved), "--format", "json")
    assert code == 0 and json.loads(again) == json.loads(out)


def test_list_changes_reach_the_rewrite(capsys, graph_files):
    _, binary, _ = graph_files
    _, out, _ = run(capsys, "inspect", str(binary), "--format", "json", "--deny-add", "Relu")
    assert json.loads(out)["converted"] == {"MatMul": 1}


def _graph_with_a_repeated_name() -> bytes:
    graph_def = tf.function(lambda x: tf.nn.relu(x, name="relu")).get_concrete_function(
        tf.TensorSpec([2], tf.float32)).graph.as_graph_def()
    graph_def.node.add().CopyFrom(next(n for n in graph_def.node if n.name == "relu"))
    return graph_def.SerializeToString()


@pytest.mark.parametrize("make, expected", [
    (lambda d: d / "missing.pb", "no such file"),
    (lambda d: _write(d / "empty.pb", b""), "is empty"),
    (lambda d: _write(d / "junk.pb", b"\xff\xff\xff\xff\x0f garbage"), "not a binary GraphDef"),
    (lambda d: _write(d / "junk.pbtxt", b"node { name: "), "not a text GraphDef"),
    (lambda d: _write(d / "model.onnx", b"x"), "unknown kind of file '.onnx'"),
    (lambda d: _write(d / "bad.json", b"{not json"), "not valid JSON"),
    (lambda d: _write(d / "other.json", b'{"a": 1}'), "not a tfamp report"),
    (lambda d: _write(d / "twice.pb", _graph_with_a_repeated_name()),
     "the top graph has more than one node named 'relu'"),
])
def test_bad_files_give_one_line_and_exit_2(capsys, tmp_path, make, expected):
    code, out, err = run(capsys, "inspect", str(make(tmp_path)))
    assert code == 2 and out == ""
    assert err.startswith("tfamp: error: ") and expected in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_truncated_binary_graph_def(capsys, graph_files, tmp_path):
    _, binary, _ = graph_files
    data = binary.read_bytes()
    cut = _write(tmp_path / "cut.pb", data[: len(data) - 7])
    code, _, err = run(capsys, "inspect", str(cut))
    assert code == 2 and "tfamp: error:" in err and "truncated" in err


def test_unknown_op_in_list_option(capsys, graph_files):
    _, binary, _ = graph_files
    code, _, err = run(capsys, "inspect", str(binary), "--allow-add", "Matmul")
    assert code == 2
    assert "'Matmul' is not a registered TensorFlow op; did you mean 'MatMul'?" in err


def test_bad_option_is_a_usage_error(capsys, graph_files):
    _, binary, _ = graph_files
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["inspect", str(binary), "--dtype", "float8"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("tfamp: error: argument --dtype: invalid choice: 'float8'")
    assert err.count("\n") == 1 and "see 'tfamp inspect --help'" in err


def test_console_entry_point_runs_as_module():
    result = subprocess.run([sys.executable, "-m", "tfamp", "--help"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0
    assert "tfamp inspect graph.pb" in result.stdout


def _write(path, data):
    path.write_bytes(data)
    return path


def test_diff_of_a_graph_and_its_rewrite(capsys, graph_files, tmp_path):
    import tensorflow as tf

    import tfamp

    _, binary, _ = graph_files
    graph_def = tf.compat.v1.GraphDef.FromString(binary.read_bytes())
    rewritten, report = tfamp.rewrite_graph_def(graph_def)
    after = _write(tmp_path / "after.pb", rewritten.SerializeToString())
    code, out, _ = run(capsys, "diff", str(binary), str(after), "--format", "json")
    assert code == 0
    diff = json.loads(out)
    assert diff["op_counts"] == {"Cast": {"before": 0, "after": report.casts_inserted}}
    assert sorted(d["node"] for d in diff["dtype_changes"]) == ["mm", "relu"]
    assert sorted(diff["casts_added"]) == sorted(c.name for c in report.casts)
    assert diff["casts_removed"] == []
    code, out, _ = run(capsys, "diff", str(binary), str(binary))
    assert code == 0 and "no change" in out and "nodes whose dtype changed: 0" in out


def test_why_explains_a_deny_chain(capsys, graph_files):
    _, binary, _ = graph_files
    code, out, _ = run(capsys, "inspect", str(binary), "--why", "relu", "--deny-add", "MatMul")
    assert code == 0
    assert "Relu 'relu': list clear; runs in float32" in out
    assert "because: deny: downstream of MatMul 'mm'" in out


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    class Module(tf.Module):
        def __init__(self):
            self.w = tf.Variable(tf.ones([4, 4]))

        @tf.function(input_signature=[tf.TensorSpec([None, 4])])
        def __call__(self, x):
            return tf.matmul(x, self.w)

    folder = tmp_path_factory.mktemp("sm") / "model"
    tf.saved_model.save(Module(), str(folder))
    return folder


@pytest.mark.parametrize("argv, expected", [
    (["--signature", "nope"], "has no signature 'nope'; available signatures: serving_default"),
    (["--graph", "train"], "--graph applies to Keras model files"),
    (["--why", "no_such_node"], "no node named 'no_such_node'"),
    (["--format", "html"], "--format html writes a page: give its path with -o FILE"),
])
def test_saved_model_errors(capsys, saved_model, argv, expected):
    code, _, err = run(capsys, "inspect", str(saved_model), *argv)
    assert code == 2 and err.startswith("tfamp: error: ") and expected in err


def test_saved_model_summary(capsys, saved_model):
    code, out, _ = run(capsys, "inspect", str(saved_model), "--format", "json")
    assert code == 0 and json.loads(out)["converted"]["MatMul"] == 1


def test_zip_named_pb_and_directory_without_model(capsys, tmp_path):
    code, _, err = run(capsys, "inspect", str(_write(tmp_path / "m.pb", b"PK\x03\x04rest")))
    assert code == 2 and "is a zip archive, not a binary GraphDef" in err
    code, _, err = run(capsys, "inspect", str(tmp_path))
    assert code == 2 and "is a directory without saved_model.pb" in err


def test_demo_runs_and_reports_rewrite_and_losses(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the demo writes its range picture under ./tfamp_demo_out
    code, out, _ = run(capsys, "demo", "--steps", "12", "--batch", "8")
    assert code == 0
    assert "What tfamp did to the training step (float16):" in out
    assert "Conv2D " in out and "allow: compute-heavy, runs in float16" in out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith("12 ")]
    assert len(rows) == 1 and len(rows[0]) == 4  # step, float32, float16, bfloat16
    losses = [float(v) for v in rows[0][1:]]
    assert max(losses) - min(losses) < 0.1 * losses[0]
    assert "loss scaling in the float16 run: dynamic" in out
    assert "All model variables stayed float32" in out
    assert re.search(r"estimated float memory traffic per step: [\d.]+ MB -> [\d.]+ MB", out)
    assert "recommendation: gradients of" in out
    assert (tmp_path / "tfamp_demo_out" / "ranges" / "ranges.png").stat().st_size > 10_000
