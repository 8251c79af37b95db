"""RewriteReport: what a rewrite did and why. Feeds the log line, CLI and tests.

JSON-serialisable (``to_dict`` / ``from_dict``) with a stable schema:
function, dtype, nodes_before, nodes_after, casts_inserted, converted (op type
-> count), kept_fp32 (reason kind -> count), nodes (one per node of the graph
the colouring saw: the original's, less the broadcasts ``broadcast_edits`` dropped; each
with its reason sentence and reason ``kind``, see ``tfamp.rewrite.reasons``),
casts (one per inserted Cast), and the estimated float memory traffic per step
(traffic_before_bytes, traffic_after_bytes, cast_bytes: ints, or None when
shapes are unknown; traffic_note says what was unknown or approximated;
traffic_share is after / before, for large sizes where a dimension is unknown;
traffic_share_typical the same with each unknown dimension at
``verdict.TYPICAL_SIZE``, None where none is unknown).
What a GPU pays, per runtime (``tfamp.rewrite.runtime_cost``): runtime, the one
whose costs placed the Casts ("executor" or "xla"), and runtime_estimates,
{"executor": {...}, "xla": {...}}, each with bytes_before / bytes_after (the
executor: every tensor; XLA: the tensors materialised at fusion boundaries),
kernels_before / kernels_after, launch_bytes (what one launch is counted as),
cost_before / cost_after (bytes + kernels x launch_bytes) and share (cost after
/ before; None where unknown; share_typical: at the typical size, as
traffic_share_typical). broadcast_edits: the exact edits made
before colouring (``fuse_norm``, ``contract``, ``hoist`` in ``tfamp.rewrite``), each
{"edit", "function", "node", "op", "into"}: "fused" (``tfamp.rewrite.fuse_norm``,
on the executor), the normalised output ``node`` of a BatchNorm (op "BatchNorm") is
now an Identity of the FusedBatchNormV3 ``into``; "fused statistics" (the same,
under XLA), the batch mean ``node`` of a BatchNorm and its variance are now the
statistics of the FusedBatchNormV3 ``into``, which reads x minus one of its values;
"contracted", the ``Sum`` ``node``
of per-example products is now one MatMul and the BatchMatMulV2 ``into`` the
Reshape of its first operand; "moved", a
scaling ``node`` (its ``op``: a RealDiv/Mul/Neg by a scalar) now runs on the small
tensor in node ``into`` and ``node`` broadcasts the result; "dropped", the broadcast
``node`` (``op`` Tile/BroadcastTo) is gone and ``into``, an op that broadcasts, reads its input.
Reports saved before ``kind``, the traffic, the runtime keys or the edits
existed still load (with None / empty values for those keys).
Optional: matrix_flops (total, in_16bit, degree, not_counted; set by ``tfamp
inspect``, which counts them on the live graph), batch_size (the batch the graph
was traced at, when known) and the derived verdict (``tfamp.rewrite.verdict``: is
16-bit worth it here, one line).
"""

from __future__ import annotations

import collections
import dataclasses
import json
from typing import Any

from tfamp.oplists import MATRIX_OPS, METADATA_OPS
from tfamp.rewrite import reasons as rk
from tfamp.rewrite.casts import CastRecord
from tfamp.rewrite.verdict import LARGE, TYPICAL_SIZE, at_size, format_bytes  # (the verdict's too)

SCHEMA_VERSION = 1
NO_FLOAT_MATH = "no float32 tensors to convert"


@dataclasses.dataclass(frozen=True)
class NodeReport:
    """The decision for one original node.

    `kind` is one of the ``tfamp.rewrite.reasons`` ``KIND_*`` constants. Reports
    saved before kinds were recorded have none; it is then derived from the
    reason sentence (``reason_kind``).
    """

    name: str
    function: str  # library function it lives in; "" for the top graph
    op: str
    list: str
    converted: bool
    reason: str
    cause: str = ""
    kind: str = ""

    def __post_init__(self) -> None:
        if not self.kind:
            object.__setattr__(self, "kind", reason_kind(self.reason))

    @classmethod
    def of_fields(cls, name: str, function: str, op: str, list: str,  # noqa: A002
                  converted: bool, reason: str, cause: str, kind: str) -> NodeReport:
        """NodeReport(name, ..., kind) for a non-empty `kind`, made faster.

        A frozen dataclass sets each field through object.__setattr__; the
        pass makes one report per node (about 6 ms per 10,000 nodes saved by
        filling the instance dict at once; the result is equal in every way).
        """
        if not kind:
            return cls(name, function, op, list, converted, reason, cause, kind)
        report = object.__new__(cls)
        object.__setattr__(report, "__dict__", {
            "name": name, "function": function, "op": op, "list": list,
            "converted": converted, "reason": reason, "cause": cause, "kind": kind})
        return report


@dataclasses.dataclass
class RewriteReport:
    """What one rewrite did. See the module docstring for the schema."""

    function: str
    dtype: str
    nodes_before: int
    nodes_after: int
    nodes: list[NodeReport]
    casts: list[CastRecord]
    traffic_before_bytes: int | None = None
    traffic_after_bytes: int | None = None
    cast_bytes: int | None = None
    traffic_note: str = ""
    # after / before; with unknown dimensions (e.g. the batch), the share for
    # large sizes (leading terms). None when shapes are unknown.
    traffic_share: float | None = None
    # ... with each unknown dimension at verdict.TYPICAL_SIZE (None when no
    # dimension is unknown). The verdict and the lines use it where it differs.
    traffic_share_typical: float | None = None
    runtime: str = ""
    runtime_estimates: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    broadcast_edits: list[dict[str, str]] = dataclasses.field(default_factory=list)
    # Matrix/convolution FLOPs per step, {"total", "in_16bit", "degree" (power of
    # an unknown batch B), "not_counted"}: filled in by tfamp inspect.
    matrix_flops: dict[str, int] | None = None
    batch_size: int | None = None

    @property
    def verdict(self):
        """Is 16-bit worth it here (``tfamp.rewrite.verdict.Verdict``), from this report."""
        from tfamp.rewrite.verdict import verdict_of

        return verdict_of(self)

    @property
    def casts_inserted(self) -> int:
        return len(self.casts)

    def sixteen_bit_tensors(self, function: str = "") -> frozenset[str]:
        """What the rewritten `function` ("" for the top graph) holds in 16 bits:
        the names of its converted nodes ("node") and the tensors it casts to
        16-bit ("node:port")."""
        sixteen = {"float16", "bfloat16"}
        converted = {n.name for n in self.nodes if n.function == function and n.converted}
        cast = {c.source if ":" in c.source else f"{c.source}:0" for c in self.casts
                if c.function == function and c.dst_dtype in sixteen}
        return frozenset(converted | cast)

    @property
    def converted(self) -> dict[str, int]:
        """Op type -> number of nodes of that type now computing in 16-bit. (A
        ``Shape`` that reads a 16-bit tensor has its type attribute changed, but
        computes nothing in 16 bits: metadata ops are not counted.)"""
        counts = collections.Counter(n.op for n in self.nodes
                                     if n.converted and n.op not in METADATA_OPS)
        return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))

    @property
    def kept_fp32(self) -> dict[str, int]:
        """Why listed ops with float32 data stayed float32: reason kind -> count."""
        counts = collections.Counter(
            n.kind for n in self.nodes
            if not n.converted and n.list != "unlisted" and n.kind != rk.KIND_NO_FLOAT)
        return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))

    def node(self, name: str, function: str = "") -> NodeReport:
        """The entry for node `name` (in library function `function`)."""
        for entry in self.nodes:
            if entry.name == name and entry.function == function:
                return entry
        where = f"function {function!r}" if function else "the top graph"
        raise KeyError(f"no node named {name!r} in {where} of this report")

    def summary_line(self, *, verdict: bool = True) -> str:
        """One line for logs, e.g. 'tfamp: step: 12 ops -> float16 (MatMul x6), ...'.

        Ends with the verdict ("; float16 is worth it here: ...") unless `verdict`
        is False (``tfamp inspect`` prints it on a line of its own).
        """
        converted = self.converted
        total = sum(converted.values())
        shown = _leading_op_types(converted)
        top = ", ".join(f"{op} x{converted[op]}" for op in shown)
        more = ", ..." if len(converted) > len(shown) else ""
        kept = sum(self.kept_fp32.values())
        name = self.function or "graph"
        detail = f" ({top}{more})" if total else ""
        traffic = ""
        if self.traffic_before_bytes is not None and self.traffic_after_bytes is not None:
            traffic = (f", est. float traffic {format_bytes(self.traffic_before_bytes)} -> "
                       f"{format_bytes(self.traffic_after_bytes)}")
        elif self.traffic_share is not None:
            share, sized = at_size(self.traffic_share, self.traffic_share_typical)
            traffic = f", est. float traffic {share:.0%} of float32's {sized}"
        line = (f"tfamp: {name}: {total} ops -> {self.dtype}{detail}, "
                f"{self.casts_inserted} casts, {kept} ops kept float32{traffic}")
        cost = self.runtime_sentence()
        if cost:
            line = f"{line}. {cost}"
        if verdict:
            line += f"{' ' if cost else '; '}{self.verdict.line}"
        return line

    def runtime_sentence(self) -> str:
        """'GPU cost est. executor 91%, XLA 64% of the original's; Casts placed
        for xla.' (what each runtime pays: runtime_estimates), or '' if unknown."""
        runtimes = (("executor", "executor"), ("xla", "XLA"))
        large = [(label, self.runtime_estimates.get(key, {}).get("share"))
                 for key, label in runtimes]
        if all(share is None for _, share in large):
            return ""
        sized = [(label, *self._cost_share(key)) for key, label in runtimes]

        def listed(shares) -> str:
            return ", ".join(f"{label} {'?' if share is None else f'{share:.0%}'}"
                             for label, share, *_ in shares)

        placed = f"; Casts placed for {self.runtime}" if self.runtime else ""
        if all(where == LARGE for *_, where in sized):
            return f"GPU cost est. {listed(large)} of the original's{placed}."
        typical = [(label, self.runtime_estimates.get(key, {}).get("share_typical"))
                   for key, label in runtimes]
        return (f"GPU cost est. {listed(typical)} of the original's at {TYPICAL_SIZE} for "
                f"each unknown size ({listed(large)} {LARGE}){placed}.")

    def _cost_share(self, key: str) -> tuple[float | None, str]:
        """(the cost share of runtime `key` to tell, where it holds: see verdict.at_size)."""
        est = self.runtime_estimates.get(key) or {}
        return at_size(est.get("share"), est.get("share_typical"))

    def edits_line(self) -> str:
        """What the exact edits before colouring did (``broadcast_edits``), e.g.
        '2 scalings (RealDiv x1, Mul x1) moved before their broadcasts; 1 broadcast
        (Tile x1) left to the op that reads it (values unchanged)', or ''."""
        phrases = []
        for edits, suffix in (
                ((("fused", "{n} batch normalisation{s} (moments and normalise) computed "
                            "as one FusedBatchNormV3{each}"),
                  ("fused statistics", "the batch statistics of {n} batch normalisation{s} "
                                       "(moments) computed by one FusedBatchNormV3{each}")),
                 " (the same statistics in another order)"),
                ((("contracted", "{n} weight-gradient sum{s} over examples computed as "
                                 "one MatMul{each}"),), " (the same sums in another order)"),
                ((("moved", "{n} scaling{s} ({ops}) moved before {its} broadcast{s}"),
                  ("dropped", "{n} broadcast{s} ({ops}) left to the op that reads {it}")),
                 " (values unchanged)")):
            parts = []
            for edit, text in edits:
                ops = collections.Counter(
                    e["op"] for e in self.broadcast_edits if e["edit"] == edit)
                n = sum(ops.values())
                if n:
                    parts.append(text.format(n=f"{n:,}", s="" if n == 1 else "s",
                                             each="" if n == 1 else " each",
                                             it="it" if n == 1 else "them",
                                             its="its" if n == 1 else "their", ops=", ".join(
                                                 f"{op} x{k}" for op, k in ops.most_common())))
            if parts:
                phrases.append("; ".join(parts) + suffix)
        return "; ".join(phrases)

    def runtime_line(self) -> str:
        """Per runtime, bytes + kernels before -> after and the cost share, e.g.
        'executor 67.9 GB + 6,996 kernels -> 57.9 GB + 7,530 (85%); XLA ...'."""
        parts = []
        for key, label in (("executor", "executor"), ("xla", "XLA fused")):
            est = self.runtime_estimates.get(key)
            if not est or est.get("bytes_before") is None or est.get("bytes_after") is None:
                share, sized = self._cost_share(key)
                parts.append(f"{label} " + ("unknown" if share is None else
                                            f"{share:.0%} of the original's"
                                            + ("" if sized == LARGE else f" {sized}")))
                continue
            share = est.get("share")
            parts.append(
                f"{label} {format_bytes(est['bytes_before'])} + {est['kernels_before']:,} "
                f"kernels -> {format_bytes(est['bytes_after'])} + {est['kernels_after']:,}"
                + ("" if share is None else f" ({share:.0%})"))
        text = "; ".join(parts)
        if self.runtime:
            text += f"; Casts placed for {self.runtime}"
        return text

    def traffic_line(self) -> str:
        """'2.90 GB -> 1.71 GB (Casts 12.0 MB)' or 'unknown (no shapes)'."""
        before, after = self.traffic_before_bytes, self.traffic_after_bytes
        if (before is None or after is None) and self.traffic_share is not None:
            notes = [n for n in self.traffic_note.split("; ") if n and n != "unknown dimensions"]
            share, sized = at_size(self.traffic_share, self.traffic_share_typical)
            where = ("for large sizes of the unknown dimensions" if sized == LARGE else
                     sized.replace(LARGE, "for large sizes"))
            return (f"{share:.0%} of float32's {where}" + "".join(f"; {n}" for n in notes))
        if before is None or after is None:
            return f"unknown ({self.traffic_note or 'no shapes'})"
        text = f"{format_bytes(before)} -> {format_bytes(after)}"
        if self.cast_bytes is not None:
            text += f" (Casts {format_bytes(self.cast_bytes)})"
        if self.traffic_note:
            text += f"; {self.traffic_note}"
        return text

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
            "traffic_before_bytes": self.traffic_before_bytes,
            "traffic_after_bytes": self.traffic_after_bytes,
            "cast_bytes": self.cast_bytes,
            "traffic_note": self.traffic_note,
            "traffic_share": self.traffic_share,
            "traffic_share_typical": self.traffic_share_typical,
            "matrix_flops": self.matrix_flops,
            "batch_size": self.batch_size,
            "verdict": self.verdict.to_dict(),  # derived; not read back
            "runtime": self.runtime,
            "runtime_estimates": self.runtime_estimates,
            "broadcast_edits": self.broadcast_edits,
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
                   for c in data["casts"]],
            traffic_before_bytes=data.get("traffic_before_bytes"),
            traffic_after_bytes=data.get("traffic_after_bytes"),
            cast_bytes=data.get("cast_bytes"),
            traffic_note=data.get("traffic_note", ""),
            traffic_share=data.get("traffic_share"),
            traffic_share_typical=data.get("traffic_share_typical"),
            runtime=data.get("runtime", ""),
            runtime_estimates=data.get("runtime_estimates") or {},
            broadcast_edits=data.get("broadcast_edits") or [],
            matrix_flops=data.get("matrix_flops"), batch_size=data.get("batch_size"))


# How the sentences of converted nodes began, for reports saved without kinds.
_CONVERTED_PREFIXES = (
    ("allow: compute-heavy", rk.KIND_ALLOW), ("infer: between", rk.KIND_BETWEEN),
    ("clear: between", rk.KIND_BETWEEN), ("infer: follows", rk.KIND_AFTER_16BIT),
    ("clear: next to", rk.KIND_NEXT_TO_16BIT), ("Cast: ", rk.KIND_CAST_RETARGETED),
)


def reason_kind(reason: str) -> str:
    """Guesses the kind of a reason sentence, for reports saved without kinds.

    New reports record ``NodeReport.kind`` when the decision is made; this
    parser only reads old JSON files (it knows the sentences tfamp wrote then).
    """
    if reason == NO_FLOAT_MATH:
        return rk.KIND_NO_FLOAT
    for prefix, kind in _CONVERTED_PREFIXES:
        if reason.startswith(prefix):
            return kind
    if reason.startswith("unlisted: stays"):
        return rk.KIND_UNLISTED
    if reason.startswith("deny: downstream"):
        return rk.KIND_DOWNSTREAM_OF_DENY
    if reason.startswith("deny:"):
        return rk.KIND_DENY_LIST
    if "kernel" in reason or "OpDef does not allow" in reason:
        return rk.KIND_NO_KERNEL
    if "keep_fp32" in reason:
        return rk.KIND_USER_OVERRIDE
    if "graph output" in reason:
        return rk.KIND_GRAPH_OUTPUT
    if "variable op" in reason:
        return rk.KIND_VARIABLE
    if "calls " in reason:
        return rk.KIND_FUNCTION_CALL
    if "loop frame" in reason:
        return rk.KIND_TF1_FRAME
    if "TensorList" in reason:
        return rk.KIND_TENSOR_LIST
    if reason.startswith(("infer: stays float32 after", "clear: stays float32 next to")):
        return rk.KIND_FEWER_BYTES
    if reason.startswith(("infer: stays", "clear: stays")):
        return rk.KIND_NO_NEIGHBOUR
    return rk.KIND_OTHER


# Op types a summary line names (more where there are more kinds of matrix math).
_SUMMARY_OP_TYPES = 4


def _leading_op_types(converted: dict[str, int]) -> list[str]:
    """The converted op types a summary line names: every matrix multiply and
    convolution (oplists.MATRIX_OPS: what the user came for), then the most
    frequent others, up to four types in all. `converted` is ordered most
    frequent first; a convnet converts more Reshapes than Conv2Ds."""
    matrix = [op for op in converted if op in MATRIX_OPS]
    others = [op for op in converted if op not in MATRIX_OPS]
    return matrix + others[:max(0, _SUMMARY_OP_TYPES - len(matrix))]
