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
    # issue 20: the start scale already suffices, and it says so (no "reaches 2^18
    # after 6000 good steps" next to a 0% loss at 2^15)
    assert "recommendation: loss scaling is needed" in out and "already suffices" in out
    assert (tmp_path / "tfamp_demo_out" / "ranges" / "ranges.png").stat().st_size > 10_000


# ------------------------------------------------------- issue 20: answers

def test_version(capsys):
    import tfamp

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"tfamp {tfamp.__version__}"


def test_summary_has_a_verdict_and_a_batch_line(capsys, saved_model):
    code, out, _ = run(capsys, "inspect", str(saved_model))
    assert code == 0
    lines = out.splitlines()
    assert lines[1].startswith("  verdict: float16 ")
    assert lines[2] == ("  batch size: open (B) in the signature: FLOPs are per B, traffic "
                        "the share at large B (a signature exported at a fixed batch gives "
                        "bytes)")
    assert "of 32 x B counted per step" in out  # 2 * 4 * 4 per row
    # --batch-size sizes the open batch: FLOPs and bytes at 16 rows, no "large B".
    code, out, _ = run(capsys, "inspect", str(saved_model), "--batch-size", "16")
    assert code == 0
    assert "  batch size: 16 (given with --batch-size; the signature's open batch was " \
        "sized at it)" in out
    assert "of 512 counted per step" in out  # 32 per row x 16
    traffic = next(line for line in out.splitlines() if "memory traffic per step" in line)
    assert " B -> " in traffic and "large sizes" not in traffic, traffic
    code, out, _ = run(capsys, "inspect", str(saved_model), "--format", "json")
    data = json.loads(out)
    assert data["batch_size"] is None and data["matrix_flops"]["total"] == 32
    assert set(data["verdict"]) == {"worth", "ratio", "flop_share", "suggestions", "line"}


@pytest.mark.parametrize("argv, expected", [
    (["--batch-size", "4"], "--batch-size applies to Keras model files and SavedModels, "
                            "which are traced here; {path} is a GraphDef whose shapes are "
                            "fixed (trace it again at the batch you want)"),
    (["--why", "MatMul"], "'MatMul' is an op type, not a node name; expected a node name "
                          "such as 'mm'; list them all with --nodes --op MatMul"),
    (["--table"], "--table shows the per-tensor table of --ranges; add --ranges"),
    (["--batch-size", "0"], "argument --batch-size: expected a positive integer, got '0'"),
])
def test_issue_20_errors(capsys, graph_files, argv, expected):
    _, binary, _ = graph_files
    try:
        code, out, err = run(capsys, "inspect", str(binary), *argv)
    except SystemExit as exit_info:  # argparse's own errors
        code, err = exit_info.code, capsys.readouterr().err
    assert code == 2 and err.startswith("tfamp: error: ")
    assert expected.format(path=binary) in err and err.count("\n") == 1


def test_saved_model_with_a_fixed_batch_refuses_batch_size(capsys, tmp_path):
    class Fixed(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([2, 4])])
        def __call__(self, x):
            return tf.matmul(x, x, transpose_b=True)

    tf.saved_model.save(Fixed(), str(tmp_path / "fixed"))
    code, _, err = run(capsys, "inspect", str(tmp_path / "fixed"), "--batch-size", "8")
    assert code == 2 and "fixes its batch dimension already (inputs x: [2, 4]); drop " \
        "--batch-size" in err
    code, out, _ = run(capsys, "inspect", str(tmp_path / "fixed"))
    assert code == 0 and "  batch size: 2 (fixed by the signature)" in out


def test_batch_size_sizes_a_loop_state_and_its_list_of_time_steps(capsys, tmp_path):
    """A recurrent signature at --batch-size: the loop's state (a While's declared
    output_shapes), the time step read from a TensorList inside the body (an
    element shape given as a Const) and the time-major input are sized too,
    so every product is counted at the batch, none per B. Found on a Keras 3
    LSTM SavedModel: '10,304 x B' counted at --batch-size 32, the known
    products dropped."""
    class Recurrent(tf.Module):
        def __init__(self):
            self.w = tf.Variable(tf.fill([4, 4], 0.1))

        @tf.function(input_signature=[tf.TensorSpec([None, 5, 4])])
        def __call__(self, x):
            steps = tf.TensorArray(tf.float32, size=5).unstack(tf.transpose(x, [1, 0, 2]))
            _, h = tf.while_loop(
                lambda t, h: t < 5,
                lambda t, h: (t + 1, tf.tanh(tf.matmul(steps.read(t), self.w) + h)),
                [tf.constant(0), tf.zeros_like(x[:, 0])])
            return tf.matmul(h, self.w)

    tf.saved_model.save(Recurrent(), str(tmp_path / "recurrent"))
    code, out, _ = run(capsys, "inspect", str(tmp_path / "recurrent"), "--format", "json")
    assert code == 0
    per_row = json.loads(out)["matrix_flops"]["total"]
    assert per_row == 6 * 2 * 4 * 4  # five steps in the loop and the product after it
    code, out, _ = run(capsys, "inspect", str(tmp_path / "recurrent"), "--batch-size", "8")
    assert code == 0
    assert f"of {8 * per_row:,} counted per step" in out, out
    traffic = next(line for line in out.splitlines() if "memory traffic per step" in line)
    # (the input transposed to time-major holds the batch second: sized too)
    assert "x B" not in traffic and "large sizes" not in traffic, traffic
    assert "left out" not in traffic, traffic


def test_a_product_whose_rows_tensorflow_cannot_infer_counts_its_kernel_size(capsys, tmp_path):
    """A Dense on a sequence of open length reshapes its input to a computed shape,
    which TensorFlow records as [-1, -1]; the contracted size is the kernel's.
    Counted as 64 x B^2 before (2 x 32 x one unknown for the contracted 16)."""
    class OnASequence(tf.Module):
        def __init__(self):
            self.w = tf.Variable(tf.fill([16, 32], 0.1))

        @tf.function(input_signature=[tf.TensorSpec([None, None, 16])])
        def __call__(self, x):
            return tf.tensordot(x, self.w, [[2], [0]])

    tf.saved_model.save(OnASequence(), str(tmp_path / "sequence"))
    code, out, _ = run(capsys, "inspect", str(tmp_path / "sequence"))
    assert code == 0
    assert "of 1,024 x B counted per step" in out, out  # 2 x 16 x 32 per position


def test_batch_size_edits_only_constants_that_are_element_shapes():
    from tensorflow.python.framework import tensor_util

    from tfamp.inspect.fixed_batch import at_batch

    graph_def = tf.compat.v1.GraphDef()
    for name in ("own", "shared"):
        const = graph_def.node.add(name=name, op="Const")
        const.attr["dtype"].type = tf.int32.as_datatype_enum
        const.attr["value"].tensor.CopyFrom(tensor_util.make_tensor_proto([-1, 4], tf.int32))
    graph_def.node.add(name="list", op="TensorListReserve", input=["own", "n"])
    graph_def.node.add(name="other_list", op="TensorListReserve", input=["shared", "n"])
    graph_def.node.add(name="reshape", op="Reshape", input=["x", "shared"])
    before = graph_def.SerializeToString()
    sized = {n.name: tensor_util.MakeNdarray(n.attr["value"].tensor).tolist()
             for n in at_batch(graph_def, 8).node if n.op == "Const"}
    assert sized == {"own": [8, 4], "shared": [-1, 4]}  # a Reshape's -1 means "the rest"
    assert graph_def.SerializeToString() == before


def test_json_output_file_says_wrote_and_rerenders_with_its_flops_line(capsys, graph_files,
                                                                        tmp_path):
    _, binary, _ = graph_files
    saved = tmp_path / "report.json"
    code, out, _ = run(capsys, "inspect", str(binary), "--format", "json", "-o", str(saved))
    assert code == 0
    assert out == (f"wrote {saved} (the report of 6 nodes); render it again with tfamp "
                   f"inspect {saved}\n")
    _, direct, _ = run(capsys, "inspect", str(binary))
    _, again, _ = run(capsys, "inspect", str(saved))
    flops = [line for line in direct.splitlines() if line.startswith("  matrix/convolution")]
    assert flops == [line for line in again.splitlines() if line.startswith("  matrix/convolution")]
    assert "100.0% of 16 counted per step" in flops[0]


def test_rewrite_writes_a_graph_that_diff_reads(capsys, graph_files, tmp_path):
    _, binary, _ = graph_files
    out_pb, out_txt = tmp_path / "amp.pb", tmp_path / "amp.pbtxt"
    code, out, _ = run(capsys, "rewrite", str(binary), "-o", str(out_pb))
    assert code == 0 and out.splitlines()[-1] == f"wrote {out_pb}"
    assert out.startswith("tfamp: model: 2 ops -> float16")
    code, out, _ = run(capsys, "rewrite", str(binary), "-o", str(out_txt), "--dtype",
                       "bfloat16", "--original", str(tmp_path / "orig.pbtxt"))
    assert code == 0 and out.splitlines()[-1].endswith(
        f"compare: tfamp diff {tmp_path / 'orig.pbtxt'} {out_txt}")
    code, out, _ = run(capsys, "diff", str(binary), str(out_pb), "--format", "json")
    assert code == 0 and sorted(d["node"] for d in json.loads(out)["dtype_changes"]) == [
        "mm", "relu"]
    assert "DT_BFLOAT16" in out_txt.read_text()


def test_rewrite_errors(capsys, graph_files, tmp_path):
    _, binary, _ = graph_files
    code, _, err = run(capsys, "rewrite", str(binary), "-o", str(tmp_path / "x.onnx"))
    assert code == 2 and err == (
        f"tfamp: error: {tmp_path / 'x.onnx'}: expected a GraphDef file name ending in .pb "
        f"(binary) or .pbtxt (text), received '.onnx'\n")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["rewrite", str(binary)])
    assert exit_info.value.code == 2
    assert "the following arguments are required: -o/--output" in capsys.readouterr().err
    report = tmp_path / "r.json"
    run(capsys, "inspect", str(binary), "--format", "json", "-o", str(report))
    code, _, err = run(capsys, "rewrite", str(report), "-o", str(tmp_path / "r.pb"))
    assert code == 2 and err == (
        f"tfamp: error: {report} is a tfamp report, which holds no graph; expected a "
        f"SavedModel directory, a Keras file or a GraphDef to rewrite\n")


def test_verdict_rules():
    from tfamp.rewrite.verdict import VerdictInputs, judge

    base = dict(dtype="float16", converted=10, matrix_converted=2)
    worse = judge(VerdictInputs(**base, traffic_before=2_020_000_000,
                                traffic_after=2_130_000_000, cast_bytes=400_000_000,
                                flop_share=1.0, batch_size=8,
                                top_kept=("downstream of a deny op", 34)))
    assert worse.worth == "marginal" and worse.ratio == pytest.approx(1.054, abs=1e-3)
    assert worse.line == (
        "float16 moves more bytes than float32 here (2.13 GB vs 2.02 GB): only the matrix "
        "math (100% of the matrix FLOPs) gains: try bfloat16 (--dtype bfloat16) / a larger "
        "batch than 8 (Casts are 19% of the bytes; those of weights cost the same at any "
        "batch) / fewer ops kept float32 (downstream of a deny op: 34 ops; see --nodes and "
        "--why NODE)")
    good = judge(VerdictInputs(**base, traffic_before=100, traffic_after=60, flop_share=0.98))
    assert good.worth == "yes" and good.line.startswith(
        "float16 is worth it here: it moves 0.60x float32's bytes (60 B vs 100 B)")
    nothing = judge(VerdictInputs(dtype="bfloat16", converted=3, matrix_converted=0))
    assert nothing.worth == "no" and "no matrix/convolution op was converted" in nothing.line
    share = judge(VerdictInputs(**base, traffic_share=0.68))
    assert share.worth == "yes" and "(68% of float32's at large sizes)" in share.line
    # The terms that grow with an unknown batch tie, the step's constants do not:
    # judged with each unknown size at 32, both said, a larger batch suggested.
    constants = judge(VerdictInputs(**base, traffic_share=0.68, traffic_share_typical=0.76,
                                    cost_share=0.68, cost_share_typical=2.2,
                                    runtime="executor"))
    assert constants.worth == "marginal" and constants.ratio == pytest.approx(2.2)
    assert constants.line.startswith(
        "float16 costs more than float32 here (est. GPU cost on the executor, bytes + kernel "
        "launches, at 32 for each unknown size, 0.68x at large sizes; 0.76x the bytes, "
        "0.68x at large sizes)"), constants.line
    assert constants.suggestions[0] == "a larger batch (0.68x float32's at large sizes)"
    close = judge(VerdictInputs(**base, traffic_share=0.68, traffic_share_typical=0.70))
    assert close.ratio == pytest.approx(0.68) and "for each unknown size" not in close.line


def test_verdict_is_in_the_log_line_and_verbosity_2_adds_the_breakdown(caplog, graph_files):
    import logging

    import tfamp

    _, binary, _ = graph_files
    graph_def = tf.compat.v1.GraphDef.FromString(binary.read_bytes())
    with caplog.at_level(logging.DEBUG, logger="tfamp"):
        _, report = tfamp.rewrite_graph_def(graph_def)
    # The line: what changed, the GPU cost sentence, then the verdict.
    assert report.summary_line().endswith(" " + report.verdict.line)
    assert report.runtime_sentence() in report.summary_line()
    lines = [r.getMessage() for r in caplog.records if r.name == "tfamp"]
    assert report.summary_line() not in lines  # the caller logs it, once
    assert any("every op converted: MatMul x1, Relu x1; kept float32 by reason:" in line
               for line in lines)


def test_summary_line_names_the_matrix_math_first():
    """Issue 28.8: a convnet converts more Reshapes than Conv2Ds; the line
    names every converted matrix/convolution op type, then the most frequent
    others (up to four types in all)."""
    import tfamp

    def convnet(x, k1, k2):
        h = tf.nn.relu(tf.nn.conv2d(x, k1, 1, "SAME"))
        for _ in range(3):
            h = tf.reshape(tf.transpose(tf.reshape(h, [2, 8, 8, 4]), [0, 2, 1, 3]), [2, 8, 8, 4])
            h = tf.tanh(h) * 0.5
        return tf.nn.conv2d(h, k2, 1, "SAME")

    concrete = tf.function(convnet).get_concrete_function(
        tf.TensorSpec([2, 8, 8, 3]), tf.TensorSpec([3, 3, 3, 4]), tf.TensorSpec([3, 3, 4, 4]))
    _, report = tfamp.rewrite_graph_def(concrete.graph.as_graph_def(add_shapes=True),
                                        outputs=[t.name for t in concrete.graph.outputs])
    converted = report.converted
    assert "Conv2D" not in list(converted)[:4]  # (fewer than four other op types)
    listed = re.search(r"ops -> float16 \((.*?)\), ", report.summary_line()).group(1)
    others = [op for op in converted if op != "Conv2D"][:3]
    assert listed == ", ".join(f"{op} x{converted[op]}" for op in ["Conv2D", *others]) + ", ..."
    assert listed.startswith("Conv2D x2, Reshape x6, ")


def test_the_summary_does_not_count_a_shape_as_an_op_in_16bit():
    """A Shape that reads a 16-bit tensor has its type changed but computes nothing
    in 16 bits (keras.io scripts' summaries listed dozens of them)."""
    import tfamp

    def dense(x, w):
        y = tf.nn.relu(tf.matmul(x, w))
        return tf.matmul(tf.reshape(y, tf.shape(y)), w)

    concrete = tf.function(dense).get_concrete_function(tf.TensorSpec([None, 8]),
                                                       tf.TensorSpec([8, 8]))
    _, report = tfamp.rewrite_graph_def(concrete.graph.as_graph_def(add_shapes=True),
                                        outputs=[t.name for t in concrete.graph.outputs])
    shapes = [n for n in report.nodes if n.op == "Shape"]
    assert shapes and all(n.converted for n in shapes), shapes  # (its T is 16-bit)
    assert "Shape" not in report.converted and report.converted["MatMul"] == 2
    total = int(re.search(r"(\d+) ops -> float16", report.summary_line()).group(1))
    assert total == sum(report.converted.values())


def test_no_gpu_notice_once_per_user(monkeypatch, tmp_path, caplog):
    import logging

    from tfamp.runtime import startup

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with caplog.at_level(logging.DEBUG, logger="tfamp"):
        startup._note_hardware()
        startup._note_hardware()
    notices = [r for r in caplog.records if "no GPU with fast 16-bit math" in r.getMessage()]
    if tf.config.list_physical_devices("GPU"):
        pytest.skip("a GPU is visible: no notice to show")
    assert [r.levelno for r in notices] == [logging.WARNING, logging.DEBUG]
    assert "Shown once on this machine" in notices[0].getMessage()
    assert (tmp_path / "tfamp" / "no_fast_gpu.shown").is_file()


def test_run_dtype_sets_the_scripts_dtype(tmp_path):
    import os
    from pathlib import Path

    script = tmp_path / "show.py"
    script.write_text("from tfamp.runtime import startup\n"
                      "print(startup._active.settings.config.dtype)\n")
    repo = str(Path(__file__).resolve().parent.parent)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TFAMP_")}
    env.update(PYTHONPATH=repo, TF_CPP_MIN_LOG_LEVEL="2", XDG_CACHE_HOME=str(tmp_path))
    result = subprocess.run([sys.executable, "-m", "tfamp", "run", "--dtype", "bfloat16",
                             str(script)], capture_output=True, text=True, timeout=300,
                            env=env, cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "bfloat16"


@pytest.mark.parametrize("runtime", ["executor", "xla"])
def test_runtime_flag_decides_whose_costs_place_the_casts(capsys, graph_files, runtime):
    _, binary, _ = graph_files
    code, out, _ = run(capsys, "inspect", str(binary), "--format", "json", "--runtime", runtime)
    assert code == 0 and json.loads(out)["runtime"] == runtime
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["inspect", str(binary), "--runtime", "gpu"])
    assert exit_info.value.code == 2 and "invalid choice: 'gpu'" in capsys.readouterr().err
