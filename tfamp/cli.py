"""The ``tfamp`` command line: argument parsing and rendering only.

Every user mistake ends as one ``tfamp: error: ...`` line on stderr and exit
status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

EXIT_USAGE = 2

_EPILOG = """examples:
  tfamp demo                          train a small CNN in fp32, float16 and bfloat16
  tfamp inspect graph.pb              what the rewrite does to a GraphDef
  tfamp inspect graph.pbtxt --dtype bfloat16 --format json
  tfamp inspect report.json           render a saved tfamp report again
  tfamp rewrite model.keras -o step_amp.pb   write the rewritten graph (for tfamp diff)
  tfamp export saved_model_dir -o served     a 16-bit SavedModel for serving, checked
  tfamp run train.py --epochs 3       run a script with mixed precision on
"""

_GRAPH_SUFFIXES = (".pb", ".pbtxt")


class UserError(Exception):
    """A mistake the user can fix; printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad option is one ``tfamp: error:`` line, not a usage block."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"tfamp: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="tfamp", description="Automatic mixed precision for TensorFlow by graph rewrite.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"tfamp {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    commands.required = True

    demo = commands.add_parser(
        "demo", help="train a small model in float32, float16 and bfloat16 and compare",
        epilog="example:\n  tfamp demo --steps 30",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    demo.add_argument("--steps", type=_positive_int, default=60, help="training steps (60)")
    demo.add_argument("--batch", type=_positive_int, default=32, help="batch size (32)")

    inspect = commands.add_parser(
        "inspect", help="show what the mixed-precision rewrite does to a graph",
        epilog="examples:\n  tfamp inspect model.keras                  # training step summary\n"
               "  tfamp inspect model.keras --graph predict --nodes --op MatMul\n"
               "  tfamp inspect model.keras --import official.nlp.modeling  # custom layers\n"
               "  tfamp inspect saved_model_dir --signature serving_default\n"
               "  tfamp inspect graph.pbtxt --why 'attn/Softmax'\n"
               "  tfamp inspect graph.pb --format html -o graph.html\n"
               "  tfamp inspect graph.pb --dtype bfloat16 --deny-add Tanh --format json\n"
               "  tfamp inspect report.json              # a TFAMP_REPORT_DIR report\n"
               "  tfamp inspect model.keras --batch-size 64   # trace at batch 64\n"
               "  tfamp inspect model.keras --ranges -o ranges   # gradients vs 16-bit limits",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_model_arguments(inspect)
    inspect.add_argument("--nodes", action="store_true", help="list every node")
    inspect.add_argument("--op", default="", help="with --nodes: only this op type")
    inspect.add_argument("--name", default="", help="with --nodes: names containing this")
    inspect.add_argument("--why", metavar="NODE",
                         help="explain the decision chain for one node (FUNCTION/NODE for "
                              "library functions)")
    inspect.add_argument("--full-names", action="store_true",
                         help="show function names as the graph has them (default: "
                              "shortened, e.g. __inference__wrapped_model_1428 -> "
                              "_wrapped_model)")
    inspect.add_argument("--ranges", action="store_true",
                         help="run a few synthetic batches and show where activations and "
                              "gradients sit against float16's limits; writes ranges.txt/"
                              ".json/.html/.png to -o DIR (default tfamp_ranges)")
    inspect.add_argument("--batches", type=_positive_int, default=3,
                         help="with --ranges: synthetic batches to run (3)")
    inspect.add_argument("--table", action="store_true",
                         help="with --ranges: also print the per-tensor table (always "
                              "written to ranges.txt)")
    inspect.add_argument("--format", choices=["text", "json", "html"], default="text")
    inspect.add_argument("-o", "--output", help="file to write (required with --format html)")

    rewrite = commands.add_parser(
        "rewrite", help="write the rewritten graph as a GraphDef (.pb or .pbtxt)",
        epilog="examples:\n  tfamp rewrite model.keras -o step_amp.pb\n"
               "  tfamp rewrite saved_model_dir --dtype bfloat16 -o serve_bf16.pbtxt\n"
               "  tfamp diff step.pb step_amp.pb        # with --original step.pb",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_model_arguments(rewrite, reports=False)
    rewrite.add_argument("-o", "--output", required=True, metavar="OUT",
                         help="the rewritten GraphDef: OUT.pb (binary) or OUT.pbtxt (text)")
    rewrite.add_argument("--original", metavar="FILE",
                         help="also write the graph as traced, before the rewrite (.pb or "
                              ".pbtxt), to compare with tfamp diff")

    diff = commands.add_parser(
        "diff", help="compare two GraphDefs: op counts, dtype changes, casts",
        epilog="examples:\n  tfamp diff before.pb after.pb\n"
               "  tfamp diff model.pbtxt model_amp.pbtxt --format json",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    diff.add_argument("before", help="a GraphDef file (.pb or .pbtxt)")
    diff.add_argument("after", help="a GraphDef file (.pb or .pbtxt)")
    diff.add_argument("--format", choices=["text", "json"], default="text")

    _add_export_command(commands)

    run = commands.add_parser(
        "run", help="run a Python script with mixed precision on (as TFAMP_ENABLE=1)",
        epilog="examples:\n  tfamp run train.py --epochs 3\n"
               "  TFAMP_DTYPE=bfloat16 tfamp run train.py",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    run.add_argument("--dtype", choices=["float16", "bfloat16"],
                     help="16-bit type (sets TFAMP_DTYPE for the script; default: "
                          "TFAMP_DTYPE, else float16)")
    run.add_argument("script", help="the Python script to run")
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    return parser


def _add_export_command(commands) -> None:
    export = commands.add_parser(
        "export", help="write a mixed-precision SavedModel for serving, checked against "
                       "float32",
        epilog="examples:\n  tfamp export saved_model_dir -o served_fp16\n"
               "  tfamp export model.keras -o served_bf16 --dtype bfloat16\n"
               "  tfamp export saved_model_dir -o served --inputs batch.npz --tolerance 0.02\n"
               "  tfamp export saved_model_dir -o served --format json --overwrite",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    export.add_argument("path", metavar="SRC",
                        help="a SavedModel directory or a Keras model file (.keras, .h5)")
    export.add_argument("-o", "--output", required=True, metavar="DST",
                        help="the SavedModel folder to write")
    export.add_argument("--signature", dest="signatures", action="append", default=[],
                        metavar="NAME", help="export this signature (repeatable; default: all)")
    export.add_argument("--inputs", action="append", default=[], metavar="FILE.npz",
                        help="a batch to check on, arrays keyed by input name (repeatable; "
                             "default: random inputs of the signature's shapes)")
    export.add_argument("--tolerance", type=_positive_float, metavar="REL",
                        help="largest relative error accepted per output (default: 0.0078 "
                             "for float16, 0.0625 for bfloat16)")
    export.add_argument("--overwrite", action="store_true",
                        help="replace DST if it is a SavedModel")
    export.add_argument("--batch-size", type=_positive_int, default=2, metavar="N",
                        help="open batch dimension of random inputs (2)")
    export.add_argument("--length", type=_positive_int, default=16, metavar="N",
                        help="other open dimensions of random inputs, e.g. sequence "
                             "length (16)")
    export.add_argument("--format", choices=["text", "json"], default="text")
    _add_import_option(export)
    _add_rewrite_options(export)


def _add_model_arguments(command, *, reports: bool = True) -> None:
    """The arguments of commands that read a model and rewrite it (inspect, rewrite)."""
    kinds = "a SavedModel directory, a Keras model file (.keras, .h5), a GraphDef (.pb, .pbtxt)"
    command.add_argument("path", help=kinds + (" or a tfamp JSON report" if reports else ""))
    command.add_argument("--signature", help="SavedModel signature (serving_default)")
    command.add_argument("--graph", choices=["train", "predict"],
                         help="Keras file: training step (default when saved compiled) or "
                              "forward pass")
    _add_import_option(command)
    _add_rewrite_options(command)
    command.add_argument("--batch-size", type=_positive_int, metavar="N",
                         help="trace a Keras file at batch N (default 8); also the batch "
                              "of --ranges' synthetic inputs")


def _add_import_option(command) -> None:
    command.add_argument("--import", dest="imports", action="append", default=[],
                         metavar="MODULE",
                         help="import MODULE first, e.g. the package that registers a Keras "
                              "file's custom layers (repeatable)")


def _add_rewrite_options(command) -> None:
    """The rewrite's settings (an AmpConfig): dtype, runtime, keep_fp32, op lists."""
    command.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    command.add_argument("--runtime", choices=["auto", "executor", "xla"], default="auto",
                         help="whose costs place the Casts: TensorFlow's executor (every op "
                              "a kernel) or XLA (element-wise ops fused); auto: xla for a "
                              "step compiled with jit_compile, else executor")
    command.add_argument("--keep-fp32", action="append", default=[], metavar="REGEX",
                         help="node names matching REGEX stay float32 (repeatable)")
    for list_name in ("allow", "infer", "deny", "clear"):
        for verb in ("add", "remove"):
            command.add_argument(f"--{list_name}-{verb}", default="", metavar="OPS",
                                 help=f"comma-separated op names to {verb} "
                                      f"{'to' if verb == 'add' else 'from'} the "
                                      f"{list_name} list")


def _version() -> str:
    from tfamp import __version__

    return __version__


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # exits 2 with a usage line on bad options
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    from tfamp._quiet import import_tensorflow_quietly

    import_tensorflow_quietly()
    if args.command != "run":
        from tfamp.runtime import startup

        startup.quiet_exit_notice()  # (a TFAMP_ENABLE the shell set is for scripts)
    from tfamp.inspect.graph_files import GraphFileError
    try:
        if args.command == "demo":
            from tfamp import demo

            return demo.main(steps=args.steps, batch=args.batch)
        if args.command == "inspect":
            return _inspect(args)
        if args.command == "rewrite":
            return _rewrite(args)
        if args.command == "run":
            return _run(args)
        if args.command == "diff":
            return _diff(args)
        if args.command == "export":
            return _export(args)
    except (UserError, GraphFileError) as err:
        print(f"tfamp: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    raise AssertionError(f"unhandled command {args.command!r}")


def _config_from_args(args):
    from tfamp.config import AmpConfig

    changes = {}
    for list_name in ("allow", "infer", "deny", "clear"):
        for verb in ("add", "remove"):
            text = getattr(args, f"{list_name}_{verb}")
            changes[f"{list_name}_{verb}"] = tuple(
                op.strip() for op in text.split(",") if op.strip())
    try:
        return AmpConfig(dtype=args.dtype, keep_fp32=tuple(args.keep_fp32),
                         runtime=args.runtime, **changes)
    except (ValueError, TypeError) as err:
        raise UserError(str(err)) from err


def _inspect(args) -> int:
    config = _config_from_args(args)
    _import_modules(args.imports)
    if args.ranges:
        return _inspect_ranges(args, config)
    if args.table:
        raise UserError("--table shows the per-tensor table of --ranges; add --ranges")
    if args.format == "html" and not args.output:
        raise UserError("--format html writes a page: give its path with -o FILE")
    loaded, _, report = _load_and_rewrite(args, config)
    if args.why:
        from tfamp.inspect.explain import UnknownNodeError, explain
        from tfamp.rewrite.graph import build_view

        view = build_view(loaded.graph_def) if loaded.graph_def is not None else None
        try:
            print("\n".join(explain(report, args.why, view, full_names=args.full_names)))
        except UnknownNodeError as err:
            raise UserError(str(err)) from None
        return 0
    if args.format == "json":
        _emit(report.to_json(), args.output)
        if args.output:
            print(f"wrote {args.output} (the report of {report.nodes_before} nodes); render "
                  f"it again with tfamp inspect {args.output}")
        return 0
    if args.format == "html":
        from tfamp.inspect.html_report import render_html

        Path(args.output).write_text(render_html(report, loaded.graph_def,
                                                 full_names=args.full_names,
                                                 flops=loaded.flops))
        print(f"wrote {args.output} ({report.nodes_before} nodes); open it in a browser")
        return 0
    text = render_summary(report, loaded)
    if args.nodes:
        text += "\n" + render_nodes(report, op=args.op, name=args.name,
                                     full_names=args.full_names)
    _emit(text, args.output)
    return 0


def _load_and_rewrite(args, config):
    """(Inspectable, rewritten GraphDef or None, report with FLOPs and batch size)."""
    from tfamp.inspect.graph_files import load_inspectable
    from tfamp.rewrite import rewrite_graph_def

    loaded = load_inspectable(Path(args.path), signature=args.signature, graph=args.graph,
                              batch_size=args.batch_size)
    if loaded.report is not None:
        return loaded, None, loaded.report
    try:
        new_graph_def, report = rewrite_graph_def(
            loaded.graph_def, config, outputs=loaded.outputs, function_name=loaded.name)
    except ValueError as err:  # a graph the pass cannot take (it says why)
        raise UserError(f"{args.path}: {err}") from None
    report.batch_size = loaded.batch_size
    report.matrix_flops = _matrix_flops(report, loaded)
    return loaded, new_graph_def, report


def _matrix_flops(report, loaded) -> dict[str, int] | None:
    """The report's matrix_flops field, from FLOPs counted on the loaded graph."""
    if loaded.flops is None:
        return None
    flops, unknown, degree = loaded.flops
    converted = {(n.function, n.name) for n in report.nodes if n.converted}
    return {"total": sum(flops.values()),
            "in_16bit": sum(v for key, v in flops.items() if key in converted),
            "degree": degree, "not_counted": unknown}


def _rewrite(args) -> int:
    config = _config_from_args(args)
    for path in filter(None, (args.output, args.original)):
        if Path(path).suffix.lower() not in _GRAPH_SUFFIXES:
            raise UserError(f"{path}: expected a GraphDef file name ending in .pb (binary) "
                            f"or .pbtxt (text), received {Path(path).suffix or 'no suffix'!r}")
    _import_modules(args.imports)
    if Path(args.path).suffix.lower() == ".json":
        raise UserError(f"{args.path} is a tfamp report, which holds no graph; expected a "
                        f"SavedModel directory, a Keras file or a GraphDef to rewrite")
    loaded, new_graph_def, report = _load_and_rewrite(args, config)
    _write_graph_def(new_graph_def, Path(args.output))
    written = [args.output]
    if args.original:
        _write_graph_def(loaded.graph_def, Path(args.original))
        written.append(args.original)
    print(report.summary_line())
    compare = (f"; compare: tfamp diff {args.original} {args.output}" if args.original else
               "")
    print(f"wrote {', '.join(written)}{compare}")
    return 0


def _write_graph_def(graph_def, path: Path) -> None:
    if path.suffix.lower() == ".pbtxt":
        path.write_text(str(graph_def))
    else:
        path.write_bytes(graph_def.SerializeToString())


def _import_modules(names: list[str]) -> None:
    """Imports each --import MODULE (the current directory is importable, as for python)."""
    import importlib

    if names and "" not in sys.path:
        sys.path.insert(0, "")
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as err:
            raise UserError(f"--import {name}: {err}; expected an importable module (check "
                            f"the spelling, the environment, or PYTHONPATH)") from err


def _inspect_ranges(args, config) -> int:
    from tfamp.keras.range_probe import collect_file_ranges
    from tfamp.numerics.monitor import DEFAULT_OUTPUT_DIR, write_outputs
    from tfamp.runtime import log_lines
    from tfamp.runtime.progress import Counter

    # Progress lines ("ranges: 1 of 3 done (12 s)") go to stderr through tfamp's logger.
    logging.getLogger("tfamp").setLevel(logging.INFO)
    log_lines.show()
    batch = args.batch_size or 8
    try:
        report = collect_file_ranges(Path(args.path), steps=args.batches,
                                     signature=args.signature, config=config,
                                     batch_size=batch,
                                     progress=Counter("ranges", args.batches).done)
    except (ValueError, OSError) as err:
        raise UserError(str(err).splitlines()[0]) from None
    written = write_outputs(report, args.output or DEFAULT_OUTPUT_DIR)
    if args.format == "json":
        print(report.to_json())
        return 0
    advice = report.advice()
    print(report.summary_text(advice))
    if args.table:
        print("\n" + report.table_text(advice))
    table = "" if args.table else " (the per-tensor table is in ranges.txt, or add --table)"
    print("wrote " + ", ".join(str(p) for p in written.values()) + table)
    return 0


def _emit(text: str, output: str | None) -> None:
    if output:
        Path(output).write_text(text + "\n")
    else:
        print(text)


def _export(args) -> int:
    from tfamp.serving.api import export
    from tfamp.serving.errors import ExportError

    config = _config_from_args(args)
    _import_modules(args.imports)
    try:
        report = export(args.path, args.output, config=config, signatures=args.signatures,
                        inputs=args.inputs, tolerance=args.tolerance,
                        overwrite=args.overwrite, batch_size=args.batch_size,
                        length=args.length)
    except ExportError as err:
        report = getattr(err, "report", None)
        if report is not None:
            print(report.to_json() if args.format == "json" else report.render_text())
        raise UserError(str(err)) from None
    print(report.to_json() if args.format == "json" else report.render_text())
    return 0


def _diff(args) -> int:
    from tfamp.inspect.graph_diff import diff_graph_defs
    from tfamp.inspect.graph_files import GraphFileError, load_inspectable

    graphs = []
    for path in (args.before, args.after):
        loaded = load_inspectable(Path(path))
        if loaded.graph_def is None:
            raise GraphFileError(f"{path} is a tfamp report; tfamp diff compares two "
                                 f"GraphDefs (.pb, .pbtxt)")
        graphs.append(loaded.graph_def)
    result = diff_graph_defs(*graphs)
    if args.format == "json":
        import json

        print(json.dumps(result.to_dict(), indent=1))
    else:
        print(result.render_text())
    return 0


def _run(args) -> int:
    import os
    import runpy

    script = Path(args.script)
    if not script.is_file():
        raise UserError(f"{script}: no such file; expected a Python script to run")
    os.environ["TFAMP_ENABLE"] = "1"
    if args.dtype:  # the script's TensorFlow reads it through tfamp.env, as TFAMP_DTYPE
        os.environ["TFAMP_DTYPE"] = args.dtype
    from tfamp.runtime import startup

    startup.activate()  # exits 2 with one line on an invalid TFAMP_* setting
    sys.argv = [str(script), *args.args]
    sys.path.insert(0, str(script.resolve().parent))
    runpy.run_path(str(script), run_name="__main__")
    return 0


def render_summary(report, loaded=None) -> str:
    lines = [report.summary_line(verdict=False),
             f"  verdict: {report.verdict.line}",
             f"  batch size: {_batch_text(report, loaded)}",
             f"  nodes: {report.nodes_before} before, {report.nodes_after} after",
             f"  casts inserted: {report.casts_inserted}"]
    if report.broadcast_edits:
        lines.append(f"  exact edits first: {report.edits_line()}")
    if report.converted:
        lines.append("  converted to " + report.dtype + ": " + ", ".join(
            f"{op} x{n}" for op, n in report.converted.items()))
    if report.kept_fp32:
        lines.append("  ops kept float32, by reason: " + ", ".join(
            f"{kind} x{n}" for kind, n in report.kept_fp32.items()))
    lines.append("  " + _flops_line(report))
    lines.append("  estimated float memory traffic per step: " + report.traffic_line())
    if report.runtime_estimates:
        lines.append("  estimated GPU cost per step (bytes + launches): "
                     + report.runtime_line())
    return "\n".join(lines)


def _batch_text(report, loaded) -> str:
    note = loaded.batch_note if loaded is not None else ""
    if report.batch_size is not None:
        return f"{report.batch_size}" + (f" ({note})" if note else "")
    if note:
        return note
    return "as recorded in the graph's shapes (a saved report or GraphDef)"


def _flops_line(report) -> str:
    from tfamp.rewrite.shapes import format_elements

    counted = report.matrix_flops
    head = f"matrix/convolution FLOPs in {report.dtype}:"
    if counted is None:
        return f"{head} unknown (the graph carries no shapes)"
    unknown = counted.get("not_counted", 0)
    not_counted = [f"{unknown} with unknown shapes"] if unknown else []
    if not counted["total"]:
        return f"{head} unknown; matrix ops not counted: {', '.join(not_counted) or 'none'}"
    tail = f"; matrix ops not counted: {', '.join(not_counted)}" if not_counted else ""
    share = counted["in_16bit"] / counted["total"]
    total = format_elements((counted["degree"], counted["total"]))
    return f"{head} {100 * share:.1f}% of {total} counted per step{tail}"


def render_nodes(report, *, op: str = "", name: str = "", full_names: bool = False) -> str:
    from tfamp.inspect.names import short_function_names, shorten_quoted
    from tfamp.rewrite.report import NO_FLOAT_MATH

    rows = [n for n in report.nodes
            if (not op or n.op == op) and (not name or name in n.name)]
    if not rows:
        raise UserError(
            f"no node matches op={op!r} name={name!r}; drop the filter or check "
            f"the spelling (the report has {len(report.nodes)} nodes)")
    shown = ({} if full_names else
             short_function_names(n.function for n in report.nodes if n.function))
    lines = []
    for n in rows:
        where = f"{shown.get(n.function, n.function)}/" if n.function else ""
        state = report.dtype if n.converted else (
            "-" if n.reason == NO_FLOAT_MATH else "float32")
        reason = shorten_quoted(n.reason, shown)
        lines.append(f"  {where}{n.name}  [{n.op}, {n.list}] -> {state}: {reason}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
