"""Reads what ``tfamp inspect`` can be pointed at: GraphDef files and tfamp reports.

Each reader checks what it was given and raises ``GraphFileError`` saying what
was expected, what was found and what to do, never a bare protobuf error.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from google.protobuf import message, text_format
from tensorflow.core.framework import graph_pb2

from tfamp.report import RewriteReport


class GraphFileError(ValueError):
    """A path that cannot be read as a graph or report, with the reason."""


@dataclasses.dataclass
class Inspectable:
    """A graph to rewrite, or a report to render again."""

    name: str
    graph_def: graph_pb2.GraphDef | None = None
    report: RewriteReport | None = None


def load_inspectable(path: Path) -> Inspectable:
    """Reads `path` by its kind: .pb / .pbtxt GraphDef, or a .json tfamp report."""
    if not path.exists():
        raise GraphFileError(f"{path}: no such file or directory")
    if path.is_dir():
        raise GraphFileError(
            f"{path} is a directory; expected a GraphDef file (.pb, .pbtxt) or a "
            f"tfamp JSON report")
    suffix = path.suffix.lower()
    if suffix == ".json":
        return Inspectable(name=path.stem, report=read_report(path))
    if suffix == ".pbtxt":
        return Inspectable(name=path.stem, graph_def=read_graph_def_text(path))
    if suffix == ".pb":
        return Inspectable(name=path.stem, graph_def=read_graph_def_binary(path))
    raise GraphFileError(
        f"{path}: unknown kind of file {suffix or '(no extension)'!r}; expected .pb "
        f"(binary GraphDef), .pbtxt (text GraphDef) or .json (tfamp report)")


def read_graph_def_binary(path: Path) -> graph_pb2.GraphDef:
    data = path.read_bytes()
    if not data:
        raise GraphFileError(f"{path} is empty; expected a binary GraphDef")
    graph_def = graph_pb2.GraphDef()
    try:
        graph_def.ParseFromString(data)
    except message.DecodeError as err:
        raise GraphFileError(
            f"{path} is not a binary GraphDef ({err}); the file may be truncated or "
            f"of another kind (a text GraphDef should be named .pbtxt)") from err
    return _nonempty(graph_def, path)


def read_graph_def_text(path: Path) -> graph_pb2.GraphDef:
    try:
        text = path.read_text()
    except UnicodeDecodeError as err:
        raise GraphFileError(
            f"{path} is not text; a binary GraphDef should be named .pb") from err
    graph_def = graph_pb2.GraphDef()
    try:
        text_format.Parse(text, graph_def)
    except text_format.ParseError as err:
        raise GraphFileError(f"{path} is not a text GraphDef: {err}") from err
    return _nonempty(graph_def, path)


def _nonempty(graph_def: graph_pb2.GraphDef, path: Path) -> graph_pb2.GraphDef:
    if not graph_def.node and not graph_def.library.function:
        raise GraphFileError(f"{path} holds a GraphDef with no nodes; nothing to inspect")
    return graph_def


def read_report(path: Path) -> RewriteReport:
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise GraphFileError(f"{path} is not valid JSON ({err}); expected a tfamp report") from err
    if not isinstance(data, dict):
        raise GraphFileError(f"{path} holds JSON {type(data).__name__}; expected a tfamp "
                             f"report object")
    try:
        return RewriteReport.from_dict(data)
    except (TypeError, ValueError) as err:
        raise GraphFileError(f"{path}: {err}") from err
