"""RewriteReport: what a rewrite did and why. Feeds the log line, CLI and tests.

JSON-serialisable (``to_dict`` / ``from_dict``) with a stable schema:
function, dtype, nodes_before, nodes_after, casts_inserted, converted (op type
-> count), kept_fp32 (reason kind -> count), nodes (one per original node) and
casts (one per inserted Cast).
"""

from __future__ import annotations

import collections
import dataclasses
import json
from typing import Any

from tfamp.rewrite.casts import CastRecord

SCHEMA_VERSION = 1
NO_FLOAT_MATH = "no float32 tensors to convert"


@dataclasses.dataclass(frozen=True)
class NodeReport:
    """The decision for one original node."""

    name: str
    function: str  # library function it lives in; "" for the top graph
    op: str
    list: str
    converted: bool
    reason: str
    cause: str = ""


@dataclasses.dataclass
class RewriteReport:
    """What one rewrite did. See the module docstring for the schema."""

    function: str
    dtype: str
    nodes_before: int
    nodes_after: int
    nodes: list[NodeReport]
    casts: list[CastRecord]

    @property
    def casts_inserted(self) -> int:
        return len(self.casts)

    @property
    def converted(self) -> dict[str, int]:
        """Op type -> number of nodes of that type now computing in 16-bit."""
        counts = collections.Counter(n.op for n in self.nodes if n.converted)
        return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))

    @property
    def kept_fp32(self) -> dict[str, int]:
        """Why listed ops with float32 data stayed float32: reason kind -> count."""
        counts = collections.Counter(
            reason_kind(n.reason) for n in self.nodes
            if not n.converted and n.list != "unlisted" and n.reason != NO_FLOAT_MATH)
        return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))

    def node(self, name: str, function: str = "") -> NodeReport:
        """The entry for node `name` (in library function `function`)."""
        for entry in self.nodes:
            if entry.name == name and entry.function == function:
                return entry
        where = f"function {function!r}" if function else "the top graph"
        raise KeyError(f"no node named {name!r} in {where} of this report")

    def summary_line(self) -> str:
        """One line for logs, e.g. 'tfamp: step: 12 ops -> float16 (MatMul x6), ...'."""
        converted = self.converted
        total = sum(converted.values())
        top = ", ".join(f"{op} x{count}" for op, count in list(converted.items())[:4])
        more = ", ..." if len(converted) > 4 else ""
        kept = sum(self.kept_fp32.values())
        name = self.function or "graph"
        detail = f" ({top}{more})" if total else ""
        return (f"tfamp: {name}: {total} ops -> {self.dtype}{detail}, "
                f"{self.casts_inserted} casts, {kept} ops kept float32")

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "function": self.function,
            "dtype": self.dtype,
            "nodes_before": self.nodes_before,
            "nodes_after": self.nodes_after,
            "casts_inserted": self.casts_inserted,
            "converted": self.converted,
            "kept_fp32": self.kept_fp32,
            "nodes": [dataclasses.asdict(n) for n in self.nodes],
            "casts": [c.to_dict() for c in self.casts],
        }

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RewriteReport:
        """Rebuilds a report from ``to_dict()`` output (e.g. a saved JSON file)."""
        missing = [k for k in ("function", "dtype", "nodes_before", "nodes_after",
                               "nodes", "casts") if k not in data]
        if missing:
            raise ValueError(
                f"not a tfamp report: keys {missing} are missing (expected the "
                f"JSON written by RewriteReport.to_json or TFAMP_REPORT_DIR)")
        return cls(
            function=data["function"], dtype=data["dtype"],
            nodes_before=data["nodes_before"], nodes_after=data["nodes_after"],
            nodes=[NodeReport(**n) for n in data["nodes"]],
            casts=[CastRecord(**{**c, "consumers": tuple(c["consumers"])})
                   for c in data["casts"]])


def reason_kind(reason: str) -> str:
    """Groups a reason sentence into a short kind, e.g. 'deny list'."""
    if reason.startswith("deny: downstream"):
        return "downstream of a deny op"
    if reason.startswith("deny:"):
        return "deny list"
    if "kernel" in reason or "OpDef does not allow" in reason:
        return "no 16-bit kernel"
    if "keep_fp32" in reason:
        return "user override"
    if "graph output" in reason:
        return "graph output"
    if "variable op" in reason:
        return "variable op"
    if "calls " in reason:
        return "function call"
    if "loop frame" in reason:
        return "TF1 loop frame"
    if "TensorList" in reason:
        return "TensorList element type"
    if reason.startswith(("infer: stays", "clear: stays")):
        return "no 16-bit neighbour"
    return "other"
