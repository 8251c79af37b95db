"""How long tfamp's rewrite takes as training-step graphs grow (a few hundred to ~100k nodes).

Traces Adam training steps of stacked Dense blocks, stacked Conv2D+BatchNorm
blocks and Keras' ResNet-50 (64x64x3, 10 classes, random weights), then times
``tfamp.rewrite_graph_def`` alone (best of --repeat, time.perf_counter) on each
GraphDef. The largest graphs (to ~99k nodes) are 2, 5 and 10 disjoint copies of
the ResNet-50 step in one GraphDef, because tracing ~100k nodes takes minutes
on 2 cores; ``--dense-depths 8,32,128,1024`` adds a genuinely deep 89k-node
Dense step (2 to 5 minutes of tracing on 2 cores, depending on load).
``tfamp.check_graph_def`` is timed separately and never counted in the
rewrite time. Prints one row per graph, a least-squares fit of time against
node count, and PASS/MISS for the target "ResNet-50 training step in under
--target seconds".

    python benchmarks/rewrite_scaling.py            # full run, a few minutes on 2 cores
    python benchmarks/rewrite_scaling.py --quick    # smoke run, under a minute
    python benchmarks/rewrite_scaling.py --json out/scaling.json
    python benchmarks/rewrite_scaling.py --dense-depths "" --conv-depths "" \
        --resnet-tiles "" --repeat 7                 # the ResNet-50 target alone

The "no-GC" columns repeat the timing with Python's garbage collector
switched off, to show how much of the rewrite time is collector work (it grows
with every live object in the process, including the traced Keras graph).
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402  (imports TensorFlow after the environment is set)
from _common import tf, tfamp  # noqa: E402

log = logging.getLogger("rewrite_scaling")

DEFAULT_DENSE = (8, 32, 128)
DEFAULT_TILES = (2, 5, 10)
DEFAULT_CONV = (4, 16, 64)
QUICK_DENSE = (4, 16, 64)
QUICK_CONV = (4, 16)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Time tfamp.rewrite_graph_def on training-step graphs of growing size.")
    parser.add_argument("--quick", action="store_true",
                        help=f"smaller graphs for a smoke run (Dense depths {QUICK_DENSE}, "
                             f"Conv depths {QUICK_CONV}, ResNet-50)")
    parser.add_argument("--dense-depths", type=_ints, default=None,
                        help=f"comma-separated Dense block counts (default {DEFAULT_DENSE}; "
                             f"about 87 nodes per block, ~1.2 ms per node to trace; "
                             f"\"\" for none)")
    parser.add_argument("--conv-depths", type=_ints, default=None,
                        help=f"comma-separated Conv2D+BatchNorm block counts "
                             f"(default {DEFAULT_CONV}; about 140 nodes per block; \"\" for none)")
    parser.add_argument("--no-resnet", action="store_true", help="skip ResNet-50")
    parser.add_argument("--resnet-tiles", type=_ints, default=None,
                        help=f"also rewrite K disjoint copies of the ResNet-50 step in one "
                             f"GraphDef, for each K (default {DEFAULT_TILES}: up to ~99k "
                             f"nodes without minutes of tracing; none with --quick)")
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    parser.add_argument("--repeat", type=int, default=3, help="timed rewrites per graph (best)")
    parser.add_argument("--no-gc-timing", dest="nogc", action="store_false",
                        help="skip the extra timing with the garbage collector off")
    parser.add_argument("--no-check", action="store_true", help="skip check_graph_def")
    parser.add_argument("--target", type=float, default=1.0,
                        help="seconds the ResNet-50 rewrite must beat (default 1.0)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    parser.add_argument("-v", "--verbose", action="store_true", help="progress on stderr")
    args = parser.parse_args(argv)
    if args.dense_depths is None:
        args.dense_depths = QUICK_DENSE if args.quick else DEFAULT_DENSE
    if args.resnet_tiles is None:
        args.resnet_tiles = () if args.quick else DEFAULT_TILES
    if args.conv_depths is None:
        args.conv_depths = QUICK_CONV if args.quick else DEFAULT_CONV
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    return args


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, e.g. 8,32,128; got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"depths must be positive, got {text!r}")
    return values


def cases(args) -> list[tuple[str, str, object]]:
    """(label, family, builder) for every graph to trace, smallest first within a family.

    ResNet-50 comes first: the process is then as fresh as a user's would be.
    Every traced graph leaves some objects behind in TensorFlow and Keras, and
    each full garbage collection during a rewrite scans all of them, so a
    ResNet-50 measured last would pay for the graphs measured before it.
    """
    result = []
    if not args.no_resnet:
        result.append(("resnet50", "resnet50", _common.resnet50))
    for depth in args.dense_depths:
        result.append((f"dense x{depth}", "dense", lambda d=depth: _common.dense_stack(d)))
    for depth in args.conv_depths:
        result.append((f"conv+bn x{depth}", "conv", lambda d=depth: _common.conv_bn_stack(d)))
    return result


def run_family(label: str, family: str, builder, args) -> list[dict]:
    """Traces one training step and measures it (and, for ResNet-50, its tiled copies).

    The model and traced function stay alive while their graph is rewritten, as
    they would in real use (the garbage collector's work grows with them).
    """
    start = time.perf_counter()
    model, x_shape, y_shape = builder()
    concrete = _common.train_step(model, x_shape, y_shape)
    graph_def = concrete.graph.as_graph_def()
    outputs = _common.output_names(concrete)
    trace_s = time.perf_counter() - start
    rows = [measure(label, family, graph_def, outputs, trace_s, args)]
    if family == "resnet50":
        for copies in args.resnet_tiles:
            start = time.perf_counter()
            tiled, tiled_outputs = _common.tile_graph_def(graph_def, copies, outputs)
            tile_s = time.perf_counter() - start
            rows.append(measure(f"resnet50 x{copies} tiled", "resnet50-tiled", tiled,
                                tiled_outputs, tile_s, args))
            del tiled
    del model, concrete, graph_def
    _common.release_graphs()
    return rows


def measure(label: str, family: str, graph_def, outputs, trace_s: float, args) -> dict:
    config = tfamp.AmpConfig(dtype=args.dtype)
    nodes = _common.node_count(graph_def)
    live_objects = len(gc.get_objects())  # what each full collection has to scan
    log.info("%s: %d nodes (made in %.1fs); rewriting", label, nodes, trace_s)

    def rewrite():
        return tfamp.rewrite_graph_def(graph_def, config, outputs=outputs, function_name="step")

    rewrite_s, rewrite_cpu_s, (new_graph_def, report) = _common.best_of(rewrite, args.repeat)
    nogc_s = float("nan")
    if args.nogc:
        nogc_s, _, _ = _common.best_of(rewrite, args.repeat, disable_gc=True)
    check_s, problems = float("nan"), None
    if not args.no_check:
        start = time.perf_counter()
        problems = tfamp.check_graph_def(new_graph_def)
        check_s = time.perf_counter() - start
    converted = report.converted
    row = {
        "graph": label, "family": family, "nodes": nodes,
        "top_nodes": len(graph_def.node), "functions": len(graph_def.library.function),
        "report_nodes_before": report.nodes_before, "nodes_after": report.nodes_after,
        "trace_s": trace_s, "rewrite_s": rewrite_s, "us_per_node": rewrite_s / nodes * 1e6,
        "rewrite_cpu_s": rewrite_cpu_s, "live_objects": live_objects,
        "rewrite_nogc_s": nogc_s, "us_per_node_nogc": nogc_s / nodes * 1e6,
        "casts": report.casts_inserted, "converted_ops": sum(converted.values()),
        "converted": converted, "check_s": check_s,
        "problems": None if problems is None else len(problems),
        "problem_examples": (problems or [])[:5],
    }
    if report.nodes_before != nodes:
        log.warning("%s: report.nodes_before=%d but the GraphDef has %d nodes",
                    label, report.nodes_before, nodes)
    return row


def fit(rows: list[dict], key: str = "rewrite_s") -> dict:
    """Least squares: time = a + b*nodes, and log(time) = c + k*log(nodes)."""
    rows = [r for r in rows if r[key] == r[key]]  # drop NaN (timing skipped)
    xs = [r["nodes"] for r in rows]
    ys = [r[key] for r in rows]
    result = {"points": len(rows)}
    if len(rows) < 2:
        return result
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    slope = sxy / sxx
    intercept = my - slope * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys, strict=True))
    lx = [math.log(x) for x in xs]
    ly = [math.log(y) for y in ys]
    mlx, mly = sum(lx) / n, sum(ly) / n
    exponent = (sum((a - mlx) * (b - mly) for a, b in zip(lx, ly, strict=True))
                / sum((a - mlx) ** 2 for a in lx))
    smallest = min(rows, key=lambda r: r["nodes"])
    largest = max(rows, key=lambda r: r["nodes"])
    result.update(
        slope_us_per_node=slope * 1e6, intercept_s=intercept,
        r_squared=1 - ss_res / ss_tot if ss_tot else 1.0,
        loglog_exponent=exponent,
        size_ratio=largest["nodes"] / smallest["nodes"],
        time_ratio=largest[key] / smallest[key],
        us_per_node_ratio=(largest[key] / largest["nodes"]) / (smallest[key] / smallest["nodes"]))
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(message)s", stream=sys.stderr)
    run_start = time.perf_counter()
    load_start = _common.load_average()
    rows = []
    for label, family, builder in cases(args):
        rows.extend(run_family(label, family, builder, args))

    print(f"tfamp rewrite scaling: {args.dtype}, rewrite time = best of {args.repeat} "
          f"(perf_counter), check_graph_def timed separately; "
          f"{os.cpu_count()} CPU cores, TensorFlow {tf.__version__}")
    print(f"load average (1/5/15 min) at start {load_start}, at end {_common.load_average()}")
    print("make s: trace (or tile) time; rewrite s / cpu s: best wall / CPU time of the "
          "rewrite; no-GC: same with gc disabled; live objs: objects the collector tracks "
          "before the rewrite; problems: check_graph_def on the result")
    headers = ["graph", "nodes", "fns", "make s", "rewrite s", "cpu s", "us/node",
               "no-GC s", "us/node no-GC", "live objs", "casts", "converted", "check s",
               "problems"]
    print(_common.table(headers, [[
        r["graph"], r["nodes"], r["functions"], r["trace_s"], r["rewrite_s"],
        r["rewrite_cpu_s"], r["us_per_node"],
        r["rewrite_nogc_s"], r["us_per_node_nogc"], f"{r['live_objects'] / 1e6:.2f}M",
        r["casts"], r["converted_ops"],
        r["check_s"], "-" if r["problems"] is None else r["problems"]] for r in rows]))

    fits = {}
    print()
    for key, what in (("rewrite_s", "wall"), ("rewrite_cpu_s", "CPU"),
                      ("rewrite_nogc_s", "wall, GC off")):
        scaling = fits[key] = fit(rows, key)
        if "slope_us_per_node" not in scaling:
            continue
        print(f"least squares ({what}) over {scaling['points']} graphs: seconds = "
              f"{scaling['intercept_s']:+.4f} + {scaling['slope_us_per_node']:.1f} us * nodes "
              f"(R^2 {scaling['r_squared']:.4f}); log-log exponent "
              f"{scaling['loglog_exponent']:.3f} (1 = linear); largest/smallest graph: "
              f"{scaling['size_ratio']:.0f}x nodes, {scaling['time_ratio']:.0f}x time, "
              f"{scaling['us_per_node_ratio']:.2f}x time per node")
    for r in rows:
        if r["problems"]:
            print(f"{r['graph']}: check_graph_def found {r['problems']} problem(s), e.g. "
                  f"{r['problem_examples'][0]}")

    target = None
    resnet = next((r for r in rows if r["family"] == "resnet50"), None)
    if resnet is not None:
        passed = resnet["rewrite_s"] < args.target
        target = {"seconds": args.target, "measured_s": resnet["rewrite_s"], "pass": passed}
        print(f"\ntarget: ResNet-50 training step ({resnet['nodes']} nodes) rewritten in "
              f"< {args.target:g} s: {resnet['rewrite_s']:.3f} s wall "
              f"({resnet['rewrite_cpu_s']:.3f} s CPU, {resnet['rewrite_nogc_s']:.3f} s with "
              f"GC off) -> {'PASS' if passed else 'MISS'}")
    total_s = time.perf_counter() - run_start
    print(f"total run time {total_s:.0f} s")
    if args.json:
        _common.write_json(args.json, {
            "benchmark": "rewrite_scaling", "environment": _common.environment(),
            "args": {k: v for k, v in vars(args).items() if k != "json"},
            "rows": rows, "fit": fits, "target": target, "total_s": total_s})
        print(f"figures written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
