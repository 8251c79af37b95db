"""On a machine with a GPU and JAX 0.11.2 (no TensorFlow needed): time the benchmark's programs.

For calibrating the time estimate when a GPU is at hand. Takes the exported steps
(``TAG.hlo.pb`` from the benchmark's cache, copied over), makes the same two edits as
``compile_h100.py``, compiles each for the local GPU (with autotuning, as a user's run
would) and times it the way the team's H100 rows were timed: each step run on the same
inputs and waited for, 5 warm-up steps, the median of 30.

Inputs are made from the parameter shapes alone: float scalars 1.0 (learning rates, loss
scales: no overflow, so the step applies its update), other floats normal with standard
deviation 0.02 (weights, slots, images), integers and predicates zero (labels, token ids,
step counters). Values that make an update non-finite do not change which kernels run;
a skipped update would, so each row says whether the float weights changed.

    JAX_PLATFORMS=cuda python time_on_gpu.py --hlo DIR [--programs TAG,...] [--out FILE]
        [--rounds 4 --steps 15]   # each model's programs side by side, alternating

Plan a lent machine's minutes by the compiles: with autotuning one program took 8-25 s on
an H100 (session 18), but each of EfficientNetB0's Keras programs 136-138 s, and each of
MobileNetV2's 75-83 s (an H200, session 19; tfamp's 5-6 s after Keras's of the same dtype;
the LSTM's 1-7 s). The results file is rewritten after each
model, so a call that runs out of time still returns the models it finished.
"""

import argparse
import glob
import gzip
import json
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cuda")

import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from jax._src.interpreters import mlir  # noqa: E402
from jax._src.lib import _jax, xla_client  # noqa: E402
from jax._src.lib.mlir import ir  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compile_h100 import edit  # noqa: E402

jax.config.update("jax_enable_x64", True)  # TensorFlow's steps take s64 counters


def parameter_shapes(module) -> list[tuple[tuple[int, ...], np.dtype]]:
    """(shape, dtype) of each argument of the module's main function."""
    main = next(op for op in module.body.operations
                if ir.StringAttr(op.attributes["sym_name"]).value == "main")
    out = []
    for argument in main.regions[0].blocks[0].arguments:
        tensor = ir.RankedTensorType(argument.type)
        out.append((tuple(tensor.shape), _numpy_dtype(str(tensor.element_type))))
    return out


def _numpy_dtype(element: str) -> np.dtype:
    table = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16, "f64": np.float64,
             "i1": np.bool_, "i8": np.int8, "i32": np.int32, "i64": np.int64,
             "ui8": np.uint8, "ui32": np.uint32, "ui64": np.uint64}
    return np.dtype(table[element])


def synthetic(shape, dtype, rng) -> np.ndarray:
    if dtype.kind == "f" or dtype.name == "bfloat16":
        if not shape:
            return np.asarray(1.0, dtype=dtype)
        return rng.normal(0.0, 0.02, shape).astype(dtype)
    return np.zeros(shape, dtype=dtype)


def compile_one(path: str, device) -> tuple[dict, object]:
    """(its row so far: edits, compile time, whether the update ran; a step function)."""
    tag = os.path.basename(path).split(".hlo.pb")[0]
    row = {"program": tag}
    with (gzip.open if path.endswith(".gz") else open)(path, "rb") as f:
        stablehlo = _jax.mlir.hlo_to_stablehlo(f.read())
    started = time.perf_counter()
    with mlir.make_ir_context():
        module = ir.Module.parse(stablehlo)
        row.update(edit(module))
        shapes = parameter_shapes(module)
        executable = device.client.compile_and_load(
            module, executable_devices=xla_client.DeviceList((device,)),
            compile_options=xla_client.CompileOptions())
    row["compile_s"] = round(time.perf_counter() - started, 1)
    # (rows print per model; this line says where a call that ran out of time was)
    print(f"time_on_gpu: compiled {tag} in {row['compile_s']} s", file=sys.stderr, flush=True)
    rng = np.random.default_rng(0)
    host = [synthetic(shape, dtype, rng) for shape, dtype in shapes]
    buffers = [jax.device_put(v, device) for v in host]

    def step():
        outputs = executable.execute(buffers)
        for o in outputs:
            o.block_until_ready()
        return outputs

    # a skipped update passes the weights through: count float outputs equal to an input
    by_key = {}
    for value in host:
        if value.ndim >= 2 and value.dtype.kind == "f":
            by_key.setdefault((value.shape, value.dtype.str), []).append(value)
    weights = unchanged = 0
    for out in (np.asarray(o) for o in step()):
        candidates = by_key.get((out.shape, out.dtype.str))
        if candidates:
            weights += 1
            unchanged += any(np.array_equal(out, c) for c in candidates)
    row["weights_changed"] = f"{weights - unchanged}/{weights}"
    row["update_ran"] = bool(weights) and unchanged <= 0.1 * weights
    return row, step


def _timed(step, count: int) -> list[float]:
    times = []
    for _ in range(count):
        t = time.perf_counter()
        step()
        times.append((time.perf_counter() - t) * 1e3)
    return times


def time_one(path: str, device, steps: int, warmup: int) -> dict:
    row, step = compile_one(path, device)
    for _ in range(warmup):
        step()
    times = _timed(step, steps)
    row["ms_median"] = round(statistics.median(times), 3)
    row["ms_min"] = round(min(times), 3)
    return row


def time_alternating(paths: list[str], device, steps: int, warmup: int,
                     rounds: int) -> list[dict]:
    """One model's programs compiled together, then timed in `rounds` rounds of
    `steps` steps each, the order reversed every other round: a GPU's clocks and
    neighbours drift by several percent between calls, which a comparison made
    in one interleaved run does not see (session 13: rounds of one program
    differed by up to 2 ms)."""
    compiled = [compile_one(path, device) for path in paths]
    for _, step in compiled:
        for _ in range(warmup):
            step()
    times: list[list[float]] = [[] for _ in compiled]
    for r in range(rounds):
        order = range(len(compiled)) if r % 2 == 0 else reversed(range(len(compiled)))
        for i in order:
            times[i].extend(_timed(compiled[i][1], steps))
    rows = []
    for (row, _), ts in zip(compiled, times, strict=True):
        row["ms_median"] = round(statistics.median(ts), 3)
        row["ms_min"] = round(min(ts), 3)
        row["round_medians"] = [round(statistics.median(ts[i * steps:(i + 1) * steps]), 2)
                                for i in range(rounds)]
        rows.append(row)
    return rows


def model_of(tag: str) -> str:
    """'resnet50_b64' of 'resnet50_b64_tfamp_fp16': programs of one model and batch."""
    for mode in ("_fp32", "_keras_", "_tfamp_"):
        if mode in tag:
            return tag.split(mode)[0]
    return tag


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hlo", required=True, help="folder of TAG.hlo.pb (or .hlo.pb.gz) files")
    parser.add_argument("--programs", default="",
                        help="comma-separated TAGs to time, in this order (default: all, sorted)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", default="gpu_times.json")
    parser.add_argument("--rounds", type=int, default=1,
                        help="above 1: each model's programs timed together in this many "
                             "alternating rounds of --steps steps (a fair comparison)")
    args = parser.parse_args(argv)
    device = jax.devices()[0]
    found = {os.path.basename(f).split(".hlo.pb")[0]: f
             for f in glob.glob(os.path.join(args.hlo, "*.hlo.pb*"))}
    tags = [t for t in args.programs.split(",") if t] or sorted(found)
    missing = [t for t in tags if t not in found]
    if missing:
        parser.error(f"--programs: no TAG.hlo.pb in {args.hlo} for {missing}")
    files = [found[t] for t in tags]
    groups: dict[str, list[str]] = {}
    for tag, path in zip(tags, files, strict=True):
        groups.setdefault(model_of(tag) if args.rounds > 1 else tag, []).append(path)
    rows = []
    for group in groups.values():
        try:
            new_rows = ([time_one(group[0], device, args.steps, args.warmup)]
                        if args.rounds <= 1 else
                        time_alternating(group, device, args.steps, args.warmup, args.rounds))
        except Exception as err:  # keep timing the others; say what failed
            new_rows = [{"program": os.path.basename(path),
                         "error": f"{type(err).__name__}: {err}"[:800]} for path in group]
        for row in new_rows:
            rows.append(row)
            print(json.dumps(row), flush=True)
        with open(args.out, "w") as f:
            json.dump({"device": str(device), "jax": jax.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
