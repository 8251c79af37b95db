"""Where a step's GPU time goes, kernel by kernel: trace on a lent GPU, read the traces here.

Two halves, for the two machines:

* on the GPU machine (JAX 0.11.2, no TensorFlow)::

      JAX_PLATFORMS=cuda python profile_on_gpu.py trace --hlo DIR --programs TAG,... --out DIR

  compiles each program as ``time_on_gpu.py`` does, runs 5 warm-up steps, then traces
  ``--steps`` steps with ``jax.profiler`` into ``OUT/TAG/``;
* here (TensorFlow reads the XPlane files)::

      python -m benchmarks.h100_program.profile_on_gpu read DIR [--top 15]

  sums the GPU's kernel time per step by the categories of ``hlo_reader``, gives the median
  step's GPU span (first kernel's start to last kernel's end: what the GPU takes, without
  the host's time between steps) and lists each program's longest kernels (ms per step).

Kernel names in the trace are the fusions' names (XLA names a kernel after its fusion), so a
row can be looked up in the optimized HLO (``hlo_features.py``).
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import shutil
import statistics
import sys


def trace(argv) -> int:
    import jax

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from time_on_gpu import compile_one

    parser = argparse.ArgumentParser(prog="profile_on_gpu.py trace")
    parser.add_argument("--hlo", required=True)
    parser.add_argument("--programs", required=True)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    device = jax.devices()[0]
    for tag in args.programs.split(","):
        path = next(iter(glob.glob(os.path.join(args.hlo, tag + ".hlo.pb*"))), None)
        if path is None:
            print(f"profile_on_gpu: no {tag}.hlo.pb in {args.hlo}", file=sys.stderr)
            return 2
        row, step = compile_one(path, device)
        for _ in range(5):
            step()
        # one flat folder per program (the lent machine's results come back two levels deep)
        jax.profiler.start_trace(os.path.join("/tmp/profile_on_gpu", tag))
        for _ in range(args.steps):
            step()
        jax.profiler.stop_trace()
        found = glob.glob(os.path.join("/tmp/profile_on_gpu", tag, "**", "*.xplane.pb"),
                          recursive=True)
        os.makedirs(os.path.join(args.out, tag), exist_ok=True)
        shutil.copy(max(found, key=os.path.getmtime),
                    os.path.join(args.out, tag, tag + ".xplane.pb"))
        print(row, flush=True)
    return 0


def kernel_times(xplane_path: str) -> tuple[dict[str, float], int, list[float]]:
    """({kernel name: total microseconds}, launches, each step's GPU span in ms) on the first
    GPU plane of one trace. A step's span runs from its first kernel's start to its last
    kernel's end: the steps are told apart by the host's gap between them (over 1 ms)."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    with open(xplane_path, "rb") as f:
        space.ParseFromString(f.read())
    gpu = [p for p in space.planes if p.name.startswith("/device:GPU:")]
    if not gpu:
        raise ValueError(f"{xplane_path}: no /device:GPU plane (planes: "
                         f"{[p.name for p in space.planes]})")
    plane = gpu[0]
    times: dict[str, float] = collections.defaultdict(float)
    spans: list[tuple[int, int]] = []
    for line in plane.lines:
        base = line.timestamp_ns * 1000
        for event in line.events:
            name = plane.event_metadata[event.metadata_id].name
            times[name] += event.duration_ps / 1e6
            spans.append((base + event.offset_ps, base + event.offset_ps + event.duration_ps))
    spans.sort()
    steps: list[list[int]] = []
    last_end = None
    for start, end in spans:
        if last_end is None or start - last_end > 1e9:  # 1 ms in picoseconds
            steps.append([start, end])
        steps[-1][1] = max(steps[-1][1], end)
        last_end = end if last_end is None else max(last_end, end)
    return times, len(spans), [(end - start) / 1e9 for start, end in steps]


def read(argv) -> int:
    from benchmarks.h100_program.hlo_reader import category_of

    parser = argparse.ArgumentParser(prog="profile_on_gpu read")
    parser.add_argument("dir")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args(argv)
    programs = {}
    for tag in sorted(os.listdir(args.dir)):
        found = glob.glob(os.path.join(args.dir, tag, "**", "*.xplane.pb"), recursive=True)
        if found:
            programs[tag] = kernel_times(found[0])
    cats = ["conv/gemm", "elementwise-fusion", "convert-fusion", "reduce-fusion",
            "transpose/copy", "other"]
    print("| program | " + " | ".join(cats) + " | all kernels | GPU span | launches |")
    print("|---" * (len(cats) + 4) + "|")
    for tag, (times, launches, spans) in programs.items():
        per = collections.defaultdict(float)
        for name, us in times.items():
            per[category_of(name)] += us / args.steps / 1e3
        print(f"| {tag} | " + " | ".join(f"{per[c]:.2f}" for c in cats)
              + f" | {sum(per.values()):.2f} | {statistics.median(spans):.2f} | "
              f"{launches // args.steps} |")
    for tag, (times, _, _) in programs.items():
        print(f"\n{tag}: top {args.top} kernels, us per step")
        for name, us in sorted(times.items(), key=lambda kv: -kv[1])[:args.top]:
            print(f"  {us / args.steps:9.1f}  {name}")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ("trace", "read"):
        print(__doc__)
        return 2
    return (trace if argv[0] == "trace" else read)(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
