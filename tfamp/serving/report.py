"""ExportReport: what ``tfamp export`` did, for the command line (text), JSON and tests.

Schema (``to_dict``): source, source_kind, destination, written, dtype, tolerance,
signatures (per signature: name, inputs (how the check's inputs were made),
rewrite (the RewriteReport's summary figures and verdict), casts_inserted,
weight_casts_removed, casts_remaining, weight_casts_remaining (Casts that still
read a weight on every call), weights_16bit, weights_float32 (name, reason),
weight_bytes_before / weight_bytes_after, accuracy (rows of
``accuracy.OutputError``)), kept_fp32 (layers kept float32 for accuracy, with
pattern, reason and the step that found them), search (float32 range runs,
16-bit evaluations, rewrites), variables_bytes_before / _after (the
variables/ folders on disk), verdict (one line).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from tfamp.rewrite.report import RewriteReport, format_bytes
from tfamp.serving.accuracy import OutputError
from tfamp.serving.locate import Kept


@dataclasses.dataclass
class SignatureReport:
    """One exported signature."""

    name: str
    inputs: str
    rewrite: RewriteReport
    weight_casts_removed: int
    casts_remaining: int
    weight_casts_remaining: int
    weights_16bit: int
    weights_float32: list[tuple[str, str]]   # (variable name, reason)
    weight_bytes_before: int
    weight_bytes_after: int
    accuracy: list[OutputError]

    def to_dict(self) -> dict[str, Any]:
        report = self.rewrite
        return {
            "name": self.name, "inputs": self.inputs,
            "rewrite": {"converted": report.converted, "ops_converted": sum(
                report.converted.values()), "kept_fp32": report.kept_fp32,
                "casts_inserted": report.casts_inserted, "verdict": report.verdict.line},
            "casts_inserted": report.casts_inserted,
            "weight_casts_removed": self.weight_casts_removed,
            "casts_remaining": self.casts_remaining,
            "weight_casts_remaining": self.weight_casts_remaining,
            "weights_16bit": self.weights_16bit,
            "weights_float32": [{"name": n, "reason": r} for n, r in self.weights_float32],
            "weight_bytes_before": self.weight_bytes_before,
            "weight_bytes_after": self.weight_bytes_after,
            "accuracy": [row.to_dict() for row in self.accuracy],
        }


@dataclasses.dataclass
class ExportReport:
    """What one export did. See the module docstring for the schema."""

    source: str
    source_kind: str
    destination: str
    dtype: str
    tolerance: float
    signatures: list[SignatureReport]
    kept_fp32: list[Kept]
    search: dict[str, int]
    weight_bytes_before: int = 0   # every variable the signatures capture, once
    weight_bytes_after: int = 0
    written: bool = False
    variables_bytes_before: int = 0
    variables_bytes_after: int = 0
    source_note: str = ""

    @property
    def within_tolerance(self) -> bool:
        return all(row.within for s in self.signatures for row in s.accuracy)

    def verdict(self) -> str:
        """One line: written or not, weights, Casts, accuracy."""
        before, after = self.weight_bytes_before, self.weight_bytes_after
        worst = max((row.max_rel for s in self.signatures for row in s.accuracy), default=0.0)
        state = f"wrote {self.destination}" if self.written else "not written"
        kept = (f"; {len(self.kept_fp32)} layer{'s' if len(self.kept_fp32) != 1 else ''} "
                f"kept float32 for accuracy") if self.kept_fp32 else ""
        check = ("outputs within tolerance" if self.within_tolerance
                 else "outputs NOT within tolerance")
        return (f"tfamp export: {state}: {self.dtype}, weights {format_bytes(before)} -> "
                f"{format_bytes(after)}, {check} (max relative error {worst:.2%} <= "
                f"{self.tolerance:.2%}){kept}" if self.within_tolerance else
                f"tfamp export: {state}: {check} (max relative error {worst:.2%} > "
                f"{self.tolerance:.2%}){kept}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source, "source_kind": self.source_kind,
            "source_note": self.source_note, "destination": self.destination,
            "written": self.written, "dtype": self.dtype, "tolerance": self.tolerance,
            "within_tolerance": self.within_tolerance,
            "signatures": [s.to_dict() for s in self.signatures],
            "kept_fp32": [k.to_dict() for k in self.kept_fp32],
            "search": dict(self.search),
            "weight_bytes_before": self.weight_bytes_before,
            "weight_bytes_after": self.weight_bytes_after,
            "variables_bytes_before": self.variables_bytes_before,
            "variables_bytes_after": self.variables_bytes_after,
            "verdict": self.verdict(),
        }

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def render_text(self) -> str:
        """The report as ``tfamp export`` prints it."""
        lines = [self.verdict()]
        lines.append(f"  source: {self.source} ({self.source_kind}"
                     + (f"; {self.source_note}" if self.source_note else "") + ")")
        for s in self.signatures:
            report = s.rewrite
            converted = sum(report.converted.values())
            lines.append(f"  signature {s.name!r}:")
            lines.append(f"    verdict: {report.verdict.line}")
            if report.converted:
                lines.append(f"    ops converted to {self.dtype}: {converted} (" + ", ".join(
                    f"{op} x{n}" for op, n in list(report.converted.items())[:8])
                    + (", ..." if len(report.converted) > 8 else "") + ")")
            else:
                lines.append(f"    ops converted to {self.dtype}: none")
            lines.append(f"    casts: {report.casts_inserted} inserted by the rewrite, "
                         f"{s.weight_casts_removed} of them removed (their weights are stored "
                         f"in {self.dtype}), {s.casts_remaining} remain; Casts reading a "
                         f"weight on every call: {s.weight_casts_remaining}")
            lines.append(f"    weights: {format_bytes(s.weight_bytes_before)} -> "
                         f"{format_bytes(s.weight_bytes_after)} ({s.weights_16bit} stored in "
                         f"{self.dtype}, {len(s.weights_float32)} float32)")
            for name, reason in s.weights_float32[:5]:
                lines.append(f"      float32: {name}: {reason}")
            if len(s.weights_float32) > 5:
                lines.append(f"      ... and {len(s.weights_float32) - 5} more (see "
                             f"--format json)")
            lines.append(f"    checked on: {s.inputs}")
            lines.append("    output          max rel err  mean rel err  arg-max agree  "
                         "non-finite (fp32/new)  within")
            for row in s.accuracy:
                agree = "-" if row.argmax_agreement is None else f"{row.argmax_agreement:.1%}"
                lines.append(f"    {row.output:<15} {row.max_rel:>11.3%}  {row.mean_rel:>12.3%}  "
                             f"{agree:>13}  {row.nonfinite_fp32:>10}/{row.nonfinite_new:<10}  "
                             f"{'yes' if row.within else 'NO'}")
        if self.kept_fp32:
            lines.append("  kept float32 for accuracy:")
            for kept in self.kept_fp32:
                lines.append(f"    {kept.layer} ({kept.pattern}): {kept.reason} [{kept.step}]")
        lines.append(f"  search: {self.search.get('range_runs', 0)} float32 range run(s), "
                     f"{self.search.get('evaluations', 0)} 16-bit evaluation(s), "
                     f"{self.search.get('rewrites', 0)} rewrite(s)")
        if self.written:
            lines.append(f"  variables on disk: {format_bytes(self.variables_bytes_before)} -> "
                         f"{format_bytes(self.variables_bytes_after)}")
        lines.append(f"  tolerance: max relative error {self.tolerance:.2%} per output "
                     f"(--tolerance)")
        return "\n".join(lines)
