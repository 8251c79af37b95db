"""Command line: the options, the run over models x modes, the table and the JSON.

    python -m benchmarks.h100_program [--models resnet50,bert] [--dtypes float16]
        [--batch N] [--work DIR] [--json FILE] [--jax-python PATH] [--calibrate]
        [--agreement] [--kit DIR]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import warnings

from benchmarks.h100_program import (
    agreement,
    cache,
    estimate,
    hlo_reader,
    kit,
    plan,
    programs,
    toolchain,
)
from benchmarks.h100_program.plan import DEFAULT_BATCH, MODEL_LABELS, MODELS

log = logging.getLogger("h100_program")

DTYPE_ALIASES = {"float16": "float16", "fp16": "float16", "f16": "float16", "half": "float16",
                 "bfloat16": "bfloat16", "bf16": "bfloat16"}
MEASURED = os.path.join(cache.HERE, "data", "h100_measured.json")
CANNOT_SEE = ("Counts (kernels, bytes, conditionals, memory) are facts of the compiled "
              "program. Not seen without a GPU: autotuning (convolution algorithms and gemm "
              "tilings are chosen on the device), the extra kernels cuDNN launches inside one "
              "convolution, and time: 'est ms' is a fitted estimate, not a measurement.")


def _comma_list(kind: str, allowed, aliases=None):
    def parse(text: str) -> tuple[str, ...]:
        out = []
        for item in (s.strip() for s in text.split(",")):
            name = (aliases or {}).get(item.lower(), item.lower())
            if name not in allowed:
                raise argparse.ArgumentTypeError(
                    f"unknown {kind} {item!r}; expected a comma-separated list of "
                    f"{', '.join(allowed)} (e.g. {allowed[0]},{allowed[-1]})")
            if name not in out:
                out.append(name)
        return tuple(out)
    return parse


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.h100_program",
        description="The H100 program of Keras 3 training steps, compiled without a GPU: "
                    "float32, Keras's mixed policy and tfamp side by side.",
        epilog=CANNOT_SEE)
    p.add_argument("--models", type=_comma_list("model", MODELS), default=MODELS,
                   help=f"comma-separated, default all: {','.join(MODELS)}")
    p.add_argument("--dtypes", type=_comma_list("dtype", plan.DTYPES, DTYPE_ALIASES),
                   default=plan.DTYPES, help="comma-separated, default float16,bfloat16")
    p.add_argument("--batch", type=_positive_int, default=None,
                   help="one batch size for every model (default: each model's measured one: "
                        + ", ".join(f"{m} {b}" for m, b in DEFAULT_BATCH.items()) + ")")
    p.add_argument("--work", default=cache.DEFAULT_WORK,
                   help="cache folder: the JAX venv and every program "
                        f"(default {cache.DEFAULT_WORK})")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results here")
    p.add_argument("--jax-python", default=None, metavar="PATH",
                   help=f"python of an existing venv with JAX {toolchain.JAX_VERSION} and its "
                        "CUDA plugin (default: make one under --work on first use)")
    p.add_argument("--calibrate", action="store_true",
                   help="compile the programs of the measured H100 rows and rewrite "
                        "data/h100_calibration.json from them")
    p.add_argument("--agreement", action="store_true",
                   help="also compile tfamp with its Casts placed for the executor and compare "
                        "tfamp's own XLA cost estimate of every program with the compiled one "
                        "(ranking and share of float32's; fits the price of a kernel); with "
                        "every model and dtype, rewrites data/h100_agreement.json")
    p.add_argument("--kit", default=None, metavar="DIR",
                   help="also write the run's Keras and tfamp programs (gzipped) and a go.sh "
                        "that times them on a lent GPU into DIR, a git-ignored folder of the "
                        "checkout (kit.py says how a call uses it)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="also log how long each export and compile took")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = parser()
    args = p.parse_args(argv)
    if args.json:
        folder = os.path.dirname(os.path.abspath(args.json))
        if not os.path.isdir(folder):
            p.error(f"--json: folder {folder!r} does not exist; create it or pick another path")
    if args.kit and args.calibrate:
        p.error("--kit: the kit is made from a run's programs, not from --calibrate; "
                "leave one of them out")
    if args.kit and os.path.exists(args.kit) and not os.path.isdir(args.kit):
        p.error(f"--kit: {args.kit!r} is a file; expected a folder (made if missing)")
    if args.jax_python and not os.path.exists(args.jax_python):
        p.error(f"--jax-python: {args.jax_python!r} does not exist; expected the python of a "
                f"venv with jax=={toolchain.JAX_VERSION} (or leave it out)")
    return args


# -- one program --------------------------------------------------------------------------------

def measure(layout, model: str, batch: int, mode: plan.Mode, pythons, device) -> dict:
    """Export, compile and read one program; a failure is a row that says where its log is."""
    row = {"model": model, "batch": batch, "mode": mode.name, "label": mode.label,
           "program": plan.tag(model, batch, mode)}
    try:
        hlo = programs.export(layout, model, batch, mode, pythons[0])
        opt_path, info = programs.compile_h100(layout, model, batch, mode, hlo, pythons[1])
    except (programs.ProgramError, OSError) as err:
        row["error"] = str(err)
        log.error("%s", err)
        return row
    with open(opt_path) as f:
        features = hlo_reader.step_features(hlo_reader.read_program(f.read()))
    row.update(features.to_dict())
    row["temp_bytes"] = info["memory"]["temp_size_in_bytes"]
    row["terms"] = estimate.program_terms(features, device)
    row["optimized_hlo"] = opt_path
    row["hlo"] = hlo
    return row


def _layout(args, tfpy: str, need_tfamp: bool) -> cache.Layout:
    facts = toolchain.project_facts(tfpy)
    sources = cache.hash_tree(facts["tfamp_dir"]) if need_tfamp else None
    checkout = os.path.join(programs.REPO_ROOT, "tfamp")
    if need_tfamp and os.path.isdir(checkout) and cache.hash_tree(checkout) != sources:
        warnings.warn(f"the tfamp that TFAMP_ENABLE=1 loads ({facts['tfamp_dir']}) differs from "
                      f"this checkout's ({checkout}); tfamp's programs are compiled from the "
                      "installed one. Run `bash scripts/setup.sh` to install the checkout's.",
                      stacklevel=2)
    return cache.Layout(args.work, facts["keras"], sources)


def _pythons(args, layout) -> tuple[str, str]:
    jaxpy = (toolchain.check_jax_python(args.jax_python) if args.jax_python
             else toolchain.jax_python(layout.jax_venv))
    return sys.executable, jaxpy


def _device() -> estimate.Device:
    with open(cache.TARGET) as f:
        return estimate.read_device(f.read())


# -- calibration --------------------------------------------------------------------------------

def _measured_ms(entry) -> tuple[float, float]:
    ms = entry["ms"]
    return (float(ms), float(ms)) if isinstance(ms, (int, float)) else (float(ms[0]), float(ms[1]))


def calibrate(args) -> int:
    """Compiles the measured rows' programs and rewrites data/h100_calibration.json.

    A tfamp row is rebuilt only from the tfamp it was measured with (its sources hash);
    otherwise the row already in the calibration file is kept as it is.
    """
    with open(MEASURED) as f:
        measured = json.load(f)
    try:
        kept = {(r["source"], r["program"]): r for r in estimate.load_calibration()["rows"]}
    except estimate.CalibrationError:
        kept = {}
    layout = _layout(args, sys.executable, need_tfamp=True)
    pythons, device = _pythons(args, layout), _device()
    rows = []
    for entry in measured["rows"]:
        source = measured["sources"][entry["source"]]
        mode = plan.MODES[entry["mode"]]
        name = plan.tag(entry["model"], entry["batch"], mode)
        if source["keras"] != layout.keras_version:
            log.warning("%s (%s) ran Keras %s; this Python has Keras %s: calibrating with "
                        "today's program", name, entry["source"], source["keras"],
                        layout.keras_version)
        if mode.side == "tfamp" and source.get("tfamp_sources") != layout.tfamp_sources:
            if (entry["source"], name) in kept:
                rows.append(kept[entry["source"], name])
            else:
                log.warning("%s (%s) was measured with tfamp %s, not the installed %s: "
                            "left out", name, entry["source"], source.get("tfamp_sources"),
                            layout.tfamp_sources)
            continue
        row = measure(layout, entry["model"], entry["batch"], mode, pythons, device)
        if "error" in row:
            return 1
        low, high = _measured_ms(entry)
        rows.append({"program": name, "source": entry["source"],
                     "measured_ms": round((low + high) / 2, 3), "measured_range": [low, high],
                     "terms": row["terms"], "kernels": row["kernels"],
                     "GB": round(row["bytes"] / 1e9, 3),
                     **({"tfamp_sources": layout.tfamp_sources} if mode.side == "tfamp" else {})})
    data = {"sources": measured["sources"], "keras": layout.keras_version,
            "target": os.path.basename(cache.TARGET), "target_key": layout.target_key,
            "rows": rows}
    with open(estimate.CALIBRATION, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    print(f"wrote {estimate.CALIBRATION}: {len(rows)} rows")
    print(render_calibration(calibration_report(data)))
    return 0


def calibration_report(data: dict) -> dict:
    """The fit on the calibration rows, each row's error by it, and leave-one-out errors."""
    rows = data["rows"]
    model = estimate.fit(rows)
    in_fit = estimate.relative_errors(model, rows)
    held_out = estimate.leave_one_out(rows)
    return {
        "coefficients": model.coefficients, "described": model.describe(), "model": model,
        "rows": [{"program": r["program"], "source": r["source"],
                  "measured_ms": r["measured_ms"],
                  "estimate_ms": round(model.predict(r["terms"]), 2),
                  "error": round(e, 4), "leave_one_out_error": round(h, 4)}
                 for r, e, h in zip(rows, in_fit, held_out, strict=True)],
        "mean_abs_error": sum(abs(e) for e in in_fit) / len(rows),
        "max_abs_error": max(abs(e) for e in in_fit),
        "mean_abs_leave_one_out_error": sum(abs(h) for h in held_out) / len(rows),
        "max_abs_leave_one_out_error": max(abs(h) for h in held_out),
        "keras": data["keras"], "sources": sorted({r["source"] for r in rows}),
    }


def render_calibration(report: dict) -> str:
    lines = [f"Time estimate: ms = {report['described']}",
             f"fitted on {len(report['rows'])} step times measured on H100s (sources: "
             f"{', '.join(report['sources'])}; data/h100_measured.json says how); error on "
             f"those rows: mean {report['mean_abs_error']:.1%}, worst "
             f"{report['max_abs_error']:.1%}; each row predicted from a fit on the other "
             f"programs (leave-one-out): mean {report['mean_abs_leave_one_out_error']:.1%}, "
             f"worst {report['max_abs_leave_one_out_error']:.1%}.", "",
             "| measured program | source | H100 ms | est ms | error | leave-one-out |",
             "|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['program']} | {r['source']} | {r['measured_ms']:.1f} | "
                     f"{r['estimate_ms']:.1f} | {r['error']:+.1%} | "
                     f"{r['leave_one_out_error']:+.1%} |")
    return "\n".join(lines)


# -- the table ----------------------------------------------------------------------------------

def render_table(rows: list[dict]) -> str:
    head = ("| model | mode | kernels | GB at kernel boundaries | top-level conditionals | "
            "host syncs | convert fusions | temp GB | est ms | measured H100 ms (source) |")
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|"]
    last = None
    for r in rows:
        model = f"{MODEL_LABELS[r['model']]} b{r['batch']}" if r["model"] != last else ""
        last = r["model"]
        if "error" in r:
            lines.append(f"| {model} | {r['label']} | failed: {r['error']} ||||||||")
            continue
        measured = ("" if r.get("measured_ms") is None
                    else f"{r['measured_ms']:.1f} ({r['measured_source']})")
        lines.append(
            f"| {model} | {r['label']} | {r['kernels']} | {r['bytes'] / 1e9:.2f} | "
            f"{r['top_level_conditionals']} | {r['host_syncs']} | {r['convert_fusions']} | "
            f"{r['temp_bytes'] / 1e9:.2f} | {r['estimate_ms']:.1f} | {measured} |")
    return "\n".join(lines)


def measured_times(data: dict, layout: cache.Layout) -> dict[str, tuple[float, str]]:
    """(measured ms, source) of the programs this run compiles identically.

    Same Keras version; for tfamp's programs, the same tfamp sources too. Where several
    sources timed a program, the one listed last in the measured file (the latest) is
    shown, so that a table's rows come from one machine where they can.
    """
    order = list(data["sources"])
    times: dict[str, tuple[float, str]] = {}
    if data["keras"] != layout.keras_version:
        return times
    for r in sorted(data["rows"], key=lambda r: order.index(r["source"])):
        if "tfamp_sources" in r and r["tfamp_sources"] != layout.tfamp_sources:
            continue
        times[r["program"]] = (r["measured_ms"], r["source"])
    return times


def run(args) -> int:
    data = estimate.load_calibration()
    report = calibration_report(data)
    model = report.pop("model")
    layout = _layout(args, sys.executable, need_tfamp=True)
    measured = measured_times(data, layout)
    pythons, device = _pythons(args, layout), _device()
    rows = []
    for name in args.models:
        batch = args.batch or DEFAULT_BATCH[name]
        for mode in plan.modes_for(args.dtypes, alternatives=args.agreement):
            row = measure(layout, name, batch, mode, pythons, device)
            if "terms" in row:
                row["estimate_ms"] = round(model.predict(row["terms"]), 2)
                if row["program"] in measured:
                    row["measured_ms"], row["measured_source"] = measured[row["program"]]
            if args.agreement and "error" not in row:
                try:
                    row["tfamp_estimate"] = programs.tfamp_estimate(layout, name, batch, mode,
                                                                    pythons[0])
                except (programs.ProgramError, OSError) as err:
                    log.error("%s", err)
            rows.append(row)
    print(render_table(rows))
    print()
    agreed = None
    if args.agreement:
        from tfamp.rewrite.runtime_cost import XLA
        agreed = agreement.report(rows, XLA.launch_bytes)
        print(agreement.render(agreed))
        if set(args.models) == set(MODELS) and set(args.dtypes) == set(plan.DTYPES):
            agreement.save(rows, {"keras": layout.keras_version,
                                  "tfamp_sources": layout.tfamp_sources,
                                  "tfamp_launch_bytes": XLA.launch_bytes})
            print(f"wrote {agreement.DATA}")
        print()
    print(render_calibration(report))
    print()
    print(CANNOT_SEE)
    if args.kit:
        tags = kit.write(args.kit, rows)
        print(f"\nwrote {len(tags)} programs and go.sh to {args.kit} (on a lent GPU, from the "
              f"checkout's root: bash {os.path.join(args.kit, 'go.sh')} NAME [MODEL ...])")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": [{k: v for k, v in r.items() if k != "loops" or v} for r in rows],
                       "calibration": report, "keras": layout.keras_version,
                       "tfamp_sources": layout.tfamp_sources, "cannot_see": CANNOT_SEE,
                       **({"agreement": agreed} if agreed else {})},
                      f, indent=1, default=str)
    return 1 if any("error" in r for r in rows) else 0


def main(argv=None) -> int:
    args = parse_args(argv)
    # progress (what is exported, compiled, made) by default; -v adds each step's time
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    log.setLevel(logging.DEBUG if args.verbose else logging.INFO)
    try:
        return calibrate(args) if args.calibrate else run(args)
    except (toolchain.ToolchainError, estimate.CalibrationError, kit.KitError) as err:
        print(f"h100_program: error: {err}", file=sys.stderr)
        return 1
