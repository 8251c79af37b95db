"""The H100 program benchmark's pieces that need neither JAX nor a compile.

The HLO reader on a small hand-written optimized module (kernels, bytes, flops, conditionals,
loops), the time estimate's fit on fixed numbers, the target description's rates, the
cache keys, and the command line's argument errors. ``benchmarks/h100_program`` itself
compiles with JAX in its own venv; nothing here starts it.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

import pytest

from benchmarks.h100_program import agreement, cache, cli, estimate, hlo_reader, kit, plan

# data/h100_tiny_step.opt.hlo.txt, written by hand: every launch site kind the reader knows,
# with the sizes worked out by hand in the tests.
# The conditional's "apply" branch computes; its "skip" branch only copies. One loop has a
# known trip count (5), one has none (TensorFlow's gradient loops): that one is taken to run
# 5 times, its condition 6 times, each a host sync.
TINY_HLO = os.path.join(os.path.dirname(__file__), "data", "h100_tiny_step.opt.hlo.txt")


@pytest.fixture(scope="module")
def features() -> hlo_reader.Features:
    with open(TINY_HLO) as f:
        return hlo_reader.step_features(hlo_reader.read_program(f.read()))


def _kernel(features, name):
    return next(k for k in features.step_kernels if k.name == name)


def test_reader_counts_each_launch_once_per_run(features):
    # entry: convert, reduce, gemm, conv, in-place update, row read, copy = 7;
    # apply branch: 2; known loop: 1 x 5; open loop: body 1 x 5 + condition 1 x 6
    assert features.kernels == 7 + 2 + 5 + 5 + 6
    assert features.kernels_by_category == {
        "convert-fusion": 1, "reduce-fusion": 1, "conv/gemm": 2,
        "elementwise-fusion": 2 + 2 + 5 + 5 + 6, "transpose/copy": 1}
    assert features.convert_fusions == 1
    assert "copy.5" not in {k.name for k in features.step_kernels}  # the skip branch's copy


def test_reader_conditionals_and_host_syncs(features):
    # one conditional (one sync) and the open loop's condition, read on the host 6 times
    assert features.top_level_conditionals == 1
    assert features.host_syncs == 1 + 6
    open_loop = next(loop for loop in features.loops if loop["name"] == "while.open")
    assert open_loop["trip_count"] is None and open_loop["assumed"] == 5
    assert _kernel(features, "loop_compare_fusion").times == 6
    # a loop with a known count runs without evaluating its condition
    assert "loop_compare_fusion.known" not in {k.name for k in features.step_kernels}


def test_reader_bytes_at_kernel_boundaries(features):
    assert _kernel(features, "convert_fusion").bytes == 64 * 32 * (4 + 2)
    assert _kernel(features, "input_reduce_fusion").bytes == 64 * 32 * 2 + 32 * 4
    # cuDNN's u8 workspace is not data: input + filter + output
    assert _kernel(features, "cudnn-conv.1").bytes == (8 * 8 * 8 * 4 + 3 * 3 * 4 * 16
                                                       + 8 * 6 * 6 * 16) * 2
    # updated in place: the update read and written, the index read, the buffer not
    assert _kernel(features, "loop_dynamic_update_slice_fusion").bytes == 16 * 4 + 4 + 16 * 4
    # a row read from a table: the row, not the table
    assert _kernel(features, "loop_dynamic_slice_fusion").bytes == 16 * 4 + 4 + 16 * 4
    assert _kernel(features, "copy.1").bytes == 2 * 64 * 16 * 2
    assert features.bytes == sum(k.bytes * k.times for k in features.step_kernels)


SLICED_AFTER_CONVERT = """HloModule sliced

%fused_slice (p: f16[64,8,8,32]) -> f32[1,1,1,32] {
  %p = f16[64,8,8,32]{3,2,1,0} parameter(0)
  %wide = f32[64,8,8,32]{3,2,1,0} convert(%p)
  ROOT %one = f32[1,1,1,32]{3,2,1,0} slice(%wide), slice={[0:1], [4:5], [4:5], [0:32]}
}

%fused_both (q: f16[64,8,8,32]) -> (f32[1,1,1,32], f32[64,8,8,32]) {
  %q = f16[64,8,8,32]{3,2,1,0} parameter(0)
  %all = f32[64,8,8,32]{3,2,1,0} convert(%q)
  %part = f32[1,1,1,32]{3,2,1,0} slice(%all), slice={[0:1], [4:5], [4:5], [0:32]}
  ROOT %t = (f32[1,1,1,32]{3,2,1,0}, f32[64,8,8,32]{3,2,1,0}) tuple(%part, %all)
}

ENTRY %main (x: f16[64,8,8,32]) -> (f32[1,1,1,32], (f32[1,1,1,32], f32[64,8,8,32])) {
  %x = f16[64,8,8,32]{3,2,1,0} parameter(0)
  %loop_slice_fusion = f32[1,1,1,32]{3,2,1,0} fusion(%x), kind=kLoop, calls=%fused_slice
  %loop_convert_fusion = (f32[1,1,1,32]{3,2,1,0}, f32[64,8,8,32]{3,2,1,0}) fusion(%x), """ \
    """kind=kLoop, calls=%fused_both
  ROOT %r = (f32[1,1,1,32]{3,2,1,0}, (f32[1,1,1,32]{3,2,1,0}, f32[64,8,8,32]{3,2,1,0})) """ \
    """tuple(%loop_slice_fusion, %loop_convert_fusion)
}
"""


def test_reader_counts_a_slice_of_a_converted_operand_as_the_slice():
    """slice(convert(x)) inside a fusion reads the sliced elements (XLA emits the
    convert per output element), as slice(x) does; where the converted whole is
    used too, the whole is read. (fuse_norm's shift under XLA is such a slice.)"""
    features = hlo_reader.step_features(hlo_reader.read_program(SLICED_AFTER_CONVERT))
    sliced, both = (_kernel(features, n) for n in ("loop_slice_fusion", "loop_convert_fusion"))
    assert sliced.bytes == 32 * 4 + 32 * 4  # (32 read, as f32: the slice's size; 32 written)
    assert both.bytes == 64 * 8 * 8 * 32 * 2 + 32 * 4 + 64 * 8 * 8 * 32 * 4


def test_reader_matrix_flops_by_input_dtype(features):
    gemm, conv = _kernel(features, "gemm_fusion_dot"), _kernel(features, "cudnn-conv.1")
    assert (gemm.kind, gemm.flops, gemm.dtype) == ("gemm", 2 * 64 * 16 * 32, "f16")
    assert (conv.kind, conv.flops) == ("conv", 2 * (8 * 6 * 6 * 16) * (3 * 3 * 4))
    assert features.matrix_flops == {"f16": gemm.flops + conv.flops}
    assert _kernel(features, "convert_fusion").convert_only
    assert not _kernel(features, "input_reduce_fusion").convert_only


def test_estimate_terms_of_the_tiny_step(features):
    device = estimate.Device(bandwidth=1e12, matrix_flops={"f32": 1e12, "f16": 2e12})
    t = estimate.program_terms(features, device)
    assert (t["launches"], t["loop_launches"], t["host_syncs"]) == (7 + 2, 5 + 5 + 6, 7)
    # not conv/gemm: convert, reduce, in-place update, row read, copy, 2 in the apply branch,
    # 10 loop-body runs of a 32-float add, 6 runs of the open loop's compare (s32 in, pred out)
    memory = (64 * 32 * 6 + (64 * 32 * 2 + 128) + 132 + 132 + 4096 + 2 * 256 + 10 * 256
              + 6 * 5)
    assert t["memory_ms"] == pytest.approx(memory / 1e12 * 1e3)
    # both at their flops: the gemm's 65536 and the conv's 331776 at the f16 peak
    assert t["matrix_ms"] == pytest.approx((65536 + 331776) / 2e12 * 1e3)


def test_reader_rejects_text_without_an_entry():
    with pytest.raises(hlo_reader.HloReadError, match="no ENTRY computation"):
        hlo_reader.read_program("HloModule x\n\n%f (a: f32[]) -> f32[] {\n}\n")


# -- the time estimate --------------------------------------------------------------------------

def _rows(coefficients, table):
    return [{"program": f"p{i}", "terms": dict(zip(estimate.TERMS, t, strict=True)),
             "measured_ms": sum(c * v for c, v in zip(coefficients, t, strict=True))}
            for i, t in enumerate(table)]


FIXED_TERMS = [  # launches, loop_launches, memory_ms, matrix_ms, host_syncs
    (1000, 0, 10.0, 4.0, 0), (1300, 0, 6.0, 2.5, 1), (900, 0, 8.0, 5.0, 0),
    (600, 4200, 9.0, 6.0, 130), (1500, 0, 4.0, 3.0, 1), (1100, 0, 12.0, 1.0, 0),
    (2000, 0, 7.0, 7.0, 2), (700, 4100, 7.5, 5.5, 131)]
EXACT = (0.006, 0.0006, 1.5, 1.2, 0.05)


def test_fit_recovers_the_coefficients_of_exact_rows():
    rows = _rows(EXACT, FIXED_TERMS)
    model = estimate.fit(rows)
    for term, expected in zip(estimate.TERMS, EXACT, strict=True):
        assert model.coefficients[term] == pytest.approx(expected, rel=1e-9)
    assert max(abs(e) for e in estimate.leave_one_out(rows)) < 1e-9


def test_fit_keeps_every_coefficient_non_negative():
    # times that fall with more kernels: the unconstrained fit would price a launch below 0
    rows = _rows((0.0, 0.0, 1.0, 1.0, 0.0), FIXED_TERMS)
    for row in rows:
        row["measured_ms"] -= 0.0005 * row["terms"]["launches"]
    model = estimate.fit(rows)
    assert all(c >= 0 for c in model.coefficients.values())
    assert model.coefficients["launches"] == 0.0
    errors = estimate.relative_errors(model, rows)
    assert len(errors) == len(rows) and max(abs(e) for e in errors) > 0.01


def test_fit_needs_as_many_rows_as_terms():
    with pytest.raises(estimate.CalibrationError, match="at least 5"):
        estimate.fit(_rows(EXACT, FIXED_TERMS[:4]))


def test_target_description_rates():
    with open(cache.TARGET) as f:
        device = estimate.read_device(f.read())
    assert device.bandwidth == 3352320000000
    # H100 SXM dense tensor-core peaks: ~989 TFLOPS float16 / bfloat16, ~495 TF32
    assert device.peak("f16") == pytest.approx(989.1e12, rel=1e-3)
    assert device.peak("bf16") == device.peak("f16")
    assert device.peak("f32") == pytest.approx(494.6e12, rel=1e-3)


def test_calibration_file_matches_the_measured_rows():
    data = estimate.load_calibration()
    with open(cli.MEASURED) as f:
        measured = json.load(f)
    expected = {}
    for r in measured["rows"]:
        low, high = cli._measured_ms(r)
        expected[r["source"], plan.tag(r["model"], r["batch"], plan.MODES[r["mode"]])] = (
            (low + high) / 2)
    assert {(r["source"], r["program"]): r["measured_ms"] for r in data["rows"]} == (
        pytest.approx(expected))
    assert all(("tfamp_sources" in r) == ("_tfamp_" in r["program"]) for r in data["rows"])
    # what README and BUILD_NOTES state of the committed fit
    report = cli.calibration_report(data)
    assert report["mean_abs_error"] < 0.08 and report["max_abs_error"] < 0.30
    assert report["mean_abs_leave_one_out_error"] < 0.09
    assert report["max_abs_leave_one_out_error"] < 0.30


# -- modes, cache keys --------------------------------------------------------------------------

def test_modes_float32_first_then_keras_and_tfamp_per_dtype():
    names = [m.name for m in plan.modes_for(("bfloat16", "float16"))]
    assert names == ["fp32", "keras_mbf16", "tfamp_bf16", "keras_mf16", "tfamp_fp16"]
    env = plan.MODES["keras_mf16"].environment({"TFAMP_ENABLE": "1", "TFAMP_DTYPE": "x",
                                                "HOME": "/h"})
    assert not any(k.startswith("TFAMP_") for k in env) and env["HOME"] == "/h"
    env = plan.MODES["tfamp_bf16"].environment({})
    assert (env["TFAMP_ENABLE"], env["TFAMP_DTYPE"]) == ("1", "bfloat16")
    assert "TFAMP_RUNTIME" not in env


def test_agreement_adds_tfamp_placed_for_the_executor():
    names = [m.name for m in plan.modes_for(("float16",), alternatives=True)]
    assert names == ["fp32", "keras_mf16", "tfamp_fp16", "tfamp_fp16_exec"]
    env = plan.MODES["tfamp_fp16_exec"].environment({"TFAMP_RUNTIME": "xla"})
    assert (env["TFAMP_DTYPE"], env["TFAMP_RUNTIME"]) == ("float16", "executor")
    assert plan.MODES["tfamp_fp16_exec"].label == "tfamp float16 (placed for the executor)"


def test_a_tfamp_change_moves_only_tfamp_programs(tmp_path):
    package = tmp_path / "tfamp"
    package.mkdir()
    (package / "rewrite.py").write_text("A = 1\n")
    before = cache.Layout(str(tmp_path), "3.15.1", cache.hash_tree(str(package)))
    (package / "rewrite.py").write_text("A = 2\n")
    after = cache.Layout(str(tmp_path), "3.15.1", cache.hash_tree(str(package)))
    assert after.side_dir("keras") == before.side_dir("keras")
    assert after.side_dir("tfamp") != before.side_dir("tfamp")
    assert os.path.dirname(after.compiled("keras", "t")) == os.path.join(
        before.side_dir("keras"), f"h100-{before.target_key}")


# -- the command line ---------------------------------------------------------------------------

@pytest.mark.parametrize(("argv", "message"), [
    (["--models", "resnet"], "unknown model 'resnet'; expected a comma-separated list of "
                             "resnet50, mobilenetv2"),
    (["--dtypes", "float8"], "unknown dtype 'float8'"),
    (["--batch", "0"], "expected a positive whole number, got '0'"),
    (["--batch", "many"], "expected a positive whole number, got 'many'"),
    (["--json", "/no/such/folder/out.json"], "folder '/no/such/folder' does not exist"),
    (["--jax-python", "/no/such/python"], "'/no/such/python' does not exist"),
    (["--kit", "k", "--calibrate"], "--kit: the kit is made from a run's programs"),
    (["--kit", __file__], "is a file; expected a folder"),
])
def test_cli_argument_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        cli.parse_args(argv)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_reads_lists_and_aliases():
    args = cli.parse_args(["--models", "bert, lstm,bert", "--dtypes", "bf16", "--batch", "8"])
    assert (args.models, args.dtypes, args.batch) == (("bert", "lstm"), ("bfloat16",), 8)
    assert cli.parse_args([]).models == plan.MODELS


def test_measured_column_shows_only_the_programs_this_run_compiles():
    data = {"keras": "3.15.1", "sources": {"old": {}, "new": {}}, "rows": [
        {"program": "m_b8_fp32", "source": "new", "measured_ms": 10.0},
        {"program": "m_b8_fp32", "source": "old", "measured_ms": 12.0},
        {"program": "m_b8_tfamp_fp16", "source": "new", "measured_ms": 7.0,
         "tfamp_sources": "aaa"}]}
    layout = cache.Layout("/w", "3.15.1", "aaa")
    assert cli.measured_times(data, layout) == {"m_b8_fp32": (10.0, "new"),
                                                "m_b8_tfamp_fp16": (7.0, "new")}
    # another tfamp, another program; another Keras, other programs altogether
    assert cli.measured_times(data, cache.Layout("/w", "3.15.1", "bbb")) == {
        "m_b8_fp32": (10.0, "new")}
    assert cli.measured_times(data, cache.Layout("/w", "3.16.0", "aaa")) == {}


def _kit_rows(tmp_path) -> list[dict]:
    """A run's rows as ``cli.measure`` gives them: ResNet-50 in both dtypes (one of its
    programs failed), BERT in float16."""
    rows = []
    for model, dtypes in (("resnet50", plan.DTYPES), ("bert", ("float16",))):
        for mode in plan.modes_for(dtypes):
            name = plan.tag(model, 8, mode)
            hlo = tmp_path / f"{name}.hlo.pb"
            hlo.write_bytes(name.encode() * 3)
            rows.append({"model": model, "mode": mode.name, "program": name, "hlo": str(hlo)})
    rows[-1] = {**rows[-1], "error": "compile of bert_b8_tfamp_fp16 failed"}
    return rows


def test_kit_holds_the_mixed_programs_and_times_each_models_keras_first(tmp_path):
    """go.sh, run with stand-ins for nvidia-smi and python3, hands time_on_gpu.py each
    named model's programs in the run's order (Keras's of a dtype first)."""
    folder = tmp_path / "repo" / ".gpu"
    tags = kit.write(str(folder), _kit_rows(tmp_path))
    assert tags == ["resnet50_b8_keras_mf16", "resnet50_b8_tfamp_fp16", "resnet50_b8_keras_mbf16",
                    "resnet50_b8_tfamp_bf16", "bert_b8_keras_mf16"]
    for name in tags:
        with gzip.open(folder / "hlo" / f"{name}.hlo.pb.gz") as f:
            assert f.read() == name.encode() * 3
    assert sorted(os.listdir(folder / "hlo")) == sorted(f"{t}.hlo.pb.gz" for t in tags)
    assert (folder / ".gitignore").read_text().splitlines()[-1] == "*"
    bin_dir, out = tmp_path / "bin", tmp_path / "out"
    bin_dir.mkdir()
    out.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho GPU\n")
    (bin_dir / "python3").write_text('#!/bin/sh\necho "$PWD $*" > "$OUT/args"\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    (tmp_path / "repo" / "benchmarks" / "h100_program").mkdir(parents=True)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", OUT=str(out))
    done = subprocess.run(["bash", ".gpu/go.sh", "first", "bert", "resnet50"],
                          cwd=tmp_path / "repo", env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    where, *argv = (out / "args").read_text().split()
    assert where.endswith("benchmarks/h100_program") and argv[0] == "time_on_gpu.py"
    assert argv[argv.index("--programs") + 1] == ",".join(tags[-1:] + tags[:-1])
    assert argv[argv.index("--out") + 1] == f"{out}/first.json"
    assert argv[argv.index("--hlo") + 1] == str(folder / "hlo")
    done = subprocess.run(["bash", ".gpu/go.sh", "again", "lstm"], cwd=tmp_path / "repo",
                          env=env, capture_output=True, text=True)
    assert done.returncode == 2 and "no programs of lstm in this kit" in done.stderr


def test_kit_of_a_run_without_mixed_programs_says_why(tmp_path):
    rows = [r for r in _kit_rows(tmp_path) if r["mode"] == "fp32"]
    with pytest.raises(kit.KitError, match="compiled no Keras or tfamp program"):
        kit.write(str(tmp_path / "kit"), rows)


def test_table_keeps_a_failed_program_as_a_row():
    rows = [{"model": "bert", "batch": 32, "label": "float32", "error": "export failed, see x.log"},
            {"model": "bert", "batch": 32, "label": "tfamp float16", "kernels": 10,
             "bytes": 2e9, "top_level_conditionals": 0, "host_syncs": 0, "convert_fusions": 1,
             "temp_bytes": 1e9, "estimate_ms": 3.04, "measured_ms": 3.0,
             "measured_source": "new"}]
    table = cli.render_table(rows).splitlines()
    assert "failed: export failed, see x.log" in table[2]
    assert table[3] == "|  | tfamp float16 | 10 | 2.00 | 0 | 0 | 1 | 1.00 | 3.0 | 3.0 (new) |"


def test_a_python_without_jax_is_refused_with_the_fix(tmp_path):
    from benchmarks.h100_program import toolchain
    with pytest.raises(toolchain.ToolchainError,
                       match=r"should import jax 0\.11\.2 .*ModuleNotFoundError.*Leave the option"):
        toolchain.check_jax_python(sys.executable)  # the project's Python: no JAX there
    with pytest.raises(toolchain.ToolchainError, match="does not exist"):
        toolchain.check_jax_python(str(tmp_path / "python"))


def _xspace(path, plane_name="/device:GPU:0"):
    """Two steps of three kernels on one stream, 2 ms apart: (start us, duration us, name)."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    plane = space.planes.add(name=plane_name)
    for i, name in enumerate(["input_reduce_fusion_3", "loop_convert_fusion", "cudnn_conv"]):
        plane.event_metadata[i + 1].id = i + 1
        plane.event_metadata[i + 1].name = name
    line = plane.lines.add(name="Stream #14(Compute)", timestamp_ns=1000)
    for step_start in (0, 2500):  # us
        for start, duration, metadata in ((0, 10, 1), (12, 5, 2), (20, 30, 3)):
            line.events.add(metadata_id=metadata, offset_ps=(step_start + start) * 10**6,
                            duration_ps=duration * 10**6)
    with open(path, "wb") as f:
        f.write(space.SerializeToString())


def test_profile_reader_sums_kernels_and_splits_steps_at_host_gaps(tmp_path):
    from benchmarks.h100_program import profile_on_gpu

    _xspace(tmp_path / "t.xplane.pb")
    times, launches, spans = profile_on_gpu.kernel_times(str(tmp_path / "t.xplane.pb"))
    assert times == {"input_reduce_fusion_3": 20.0, "loop_convert_fusion": 10.0,
                     "cudnn_conv": 60.0}
    assert launches == 6
    assert spans == [0.05, 0.05]  # ms: first kernel's start to last kernel's end


def test_profile_reader_names_the_planes_it_found_without_a_gpu(tmp_path):
    from benchmarks.h100_program import profile_on_gpu

    _xspace(tmp_path / "t.xplane.pb", plane_name="/host:CPU")
    with pytest.raises(ValueError, match=r"no /device:GPU plane .*/host:CPU"):
        profile_on_gpu.kernel_times(str(tmp_path / "t.xplane.pb"))


def test_profile_table_per_category(tmp_path, capsys):
    from benchmarks.h100_program import profile_on_gpu

    (tmp_path / "m_tfamp_fp16").mkdir()
    _xspace(tmp_path / "m_tfamp_fp16" / "m_tfamp_fp16.xplane.pb")
    assert profile_on_gpu.main(["read", str(tmp_path), "--steps", "2", "--top", "1"]) == 0
    out = capsys.readouterr().out
    # conv/gemm 0.03 ms, element-wise 0, convert 0.005, reduce 0.01 per step; span 0.05; 3 launches
    assert "| m_tfamp_fp16 | 0.03 | 0.00 | 0.01 | 0.01 | 0.00 | 0.00 | 0.04 | 0.05 | 3 |" in out
    assert "30.0  cudnn_conv" in out


# -- tfamp's estimate against the compiled program ----------------------------------------------

def _row(model, mode, ms, fused_bytes, fused_kernels, compiled_bytes=None, kernels=None):
    return {"model": model, "mode": mode, "program": f"{model}_b1_{mode}", "label": mode,
            "estimate_ms": ms, "bytes": compiled_bytes or fused_bytes, "kernels": kernels or 1,
            "tfamp_estimate": {"fused_bytes": fused_bytes, "fused_kernels": fused_kernels}}


def _compiled_rows():
    # compiled time = bytes / 1e6 + 10 x kernels (ms): one kernel costs 10 MB of bytes
    def row(mode, mb, kernels):
        return _row("m", mode, mb + 10 * kernels, mb * 1e6, kernels)
    return [row("fp32", 1000, 10), row("keras_mf16", 560, 30), row("tfamp_fp16", 520, 20),
            row("tfamp_fp16_exec", 450, 45), {"model": "m", "mode": "keras_mbf16", "error": "x"}]


def test_agreement_learns_the_price_of_a_kernel():
    groups = agreement.groups(_compiled_rows())
    assert list(groups) == [("m", "float16")]  # a failed program is left out
    assert set(groups["m", "float16"]) == {"float32", "keras", "tfamp", "tfamp_exec"}
    assert agreement.fit_launch_bytes(groups) == pytest.approx(10e6, rel=0.06)  # (grid 2^1/8)
    cheap = agreement.summary(groups, 1e6)  # kernels priced 10x too low
    fitted = agreement.summary(groups, 10e6)
    assert fitted["share_error"] < 0.01 < cheap["share_error"]
    assert (fitted["agree_time"], fitted["pairs"]) == (3, 3)
    # at 1 MB per kernel, the executor's placement looks cheapest (495 MB) where it is the
    # dearest compiled (900 ms against keras's 860 and tfamp's 720)
    assert cheap["agree_time"] == 1
    rep = agreement.report(_compiled_rows(), 1_000_000)
    assert {tuple(d["pair"]) for d in rep["disagreements"]} == {("keras", "tfamp_exec"),
                                                               ("tfamp", "tfamp_exec")}
    assert "1 of 3 pairs ranked as the compiled time" in agreement.render(rep)


def test_agreement_counts_a_compiled_tie_as_agreement():
    rows = [_row("m", "fp32", 100, 100, 1), _row("m", "keras_mf16", 50, 60, 1),
            _row("m", "tfamp_fp16", 50.1, 50, 1)]
    (pair,) = agreement.pairs(agreement.groups(rows)["m", "float16"], 0)
    assert pair["compiled_time"] == 0 and pair["agrees_time"]


def test_tfamp_prices_a_kernel_as_the_compiled_programs_say():
    """runtime_cost.XLA carries the price the last --agreement run learned: fitted again
    on its stored rows (tfamp's estimate and the compiled program of 35 programs), within
    one step of the fit's grid, and at that price the estimate ranks at least 27 of the
    30 pairs of programs as their compiled step time does (28 on session 26's programs;
    27 on session 27's, where MobileNetV2 bfloat16's executor placement compiles 1.7%
    faster than the XLA placement and the estimate ranks it second)."""
    from tfamp.rewrite.runtime_cost import XLA
    data = agreement.load()
    groups = agreement.groups(data["rows"])
    assert len(groups) == 10  # five models x two dtypes
    fitted = agreement.fit_launch_bytes(groups)
    assert abs(XLA.launch_bytes / fitted - 1) < 2 ** (1 / 8) - 1, (
        f"tfamp prices an XLA kernel at {XLA.launch_bytes} bytes; the compiled programs "
        f"say {fitted}: set runtime_cost.XLA's launch_us to {fitted / XLA.bandwidth * 1e6:.2f}")
    at_tfamp = agreement.summary(groups, XLA.launch_bytes)
    assert at_tfamp["agree_time"] >= 27 and at_tfamp["pairs"] == 30, at_tfamp
