"""A run's ranges together: ``RangeReport`` and what they mean for float16.

``RangeReport`` holds one ``TensorRange`` (``tfamp.numerics.ranges``) per
measured tensor and answers, for the whole run, the overflow head-room, the
loss scale tfamp recommends (``tfamp.numerics.advice``) and a sentence saying
so; it renders the text summary and its JSON.

JSON schema (``to_dict``): version, model, dtype, steps, loss_scale,
growth_interval, initial_scale, e_min, e_max, notes, tensors (name, layer,
kind, counts, zeros, nonfinite, tiny, max_abs, steps).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from tfamp.numerics.advice import advise, evidence, sufficient_scale
from tfamp.numerics.ranges import (
    BF16_MANTISSA_BITS,
    BF16_MAX,
    E_MAX,
    E_MIN,
    FP16_OVERFLOW_EXP,
    HEADROOM_BITS,
    KIND_LABELS,
    KINDS,
    MAX_SCALE_EXP,
    NEGLIGIBLE,
    NUM_BINS,
    SCHEMA_VERSION,
    TensorRange,
    format_pct,
    format_scale,
    scale_exponent,
)


@dataclasses.dataclass
class RangeReport:
    """Ranges of a model's tensors over a few steps, and what they mean for float16.

    Attributes:
      model: the model's name.
      steps: batches collected.
      loss_scale: the loss scale in force while collecting (None: no scaling).
      tensors: one TensorRange per measured tensor.
      notes: facts a reader must know (e.g. "subclassed model: weight
        gradients only").
      growth_interval, initial_scale: the dynamic loss-scale settings used for
        the "dynamic scaling reaches it after N steps" estimate.
    """

    model: str
    steps: int
    loss_scale: float | None
    tensors: list[TensorRange]
    notes: list[str] = dataclasses.field(default_factory=list)
    dtype: str = "float16"
    growth_interval: int = 2000
    initial_scale: float = 2.0**15

    # -- questions -----------------------------------------------------------

    def of_kind(self, kind: str) -> list[TensorRange]:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {list(KINDS)}, received {kind!r}")
        return [t for t in self.tensors if t.kind == kind]

    def tensor(self, name: str, kind: str) -> TensorRange:
        """The entry measuring `name` of `kind`."""
        for entry in self.tensors:
            if entry.name == name and entry.kind == kind:
                return entry
        known = sorted(t.name for t in self.tensors if t.kind == kind)
        raise KeyError(f"no {kind} entry named {name!r}; entries of that kind: {known}")

    def combined(self, kind: str) -> TensorRange:
        """All tensors of `kind` in one histogram (for the picture)."""
        entries = self.of_kind(kind)
        merged = TensorRange(f"all {KIND_LABELS[kind]}", "", kind, [0] * NUM_BINS, steps=0)
        for entry in entries:
            merged.merge(dataclasses.replace(entry, steps=0))
        merged.steps = self.steps
        return merged

    def gradients(self) -> list[TensorRange]:
        return [t for t in self.tensors if t.kind != "activation"]

    def highest_safe_scale(self) -> float:
        """The largest power of 2 that keeps every gradient's max * S below 65504 / 2.

        Capped at 2**MAX_SCALE_EXP; 1 if the gradients already leave no head-room
        (or are all zero).
        """
        tops = [t.max_exponent for t in self.gradients() if t.max_exponent is not None]
        if not tops:
            return 1.0
        k = FP16_OVERFLOW_EXP - 1 - HEADROOM_BITS - max(tops)
        return 2.0 ** min(max(k, 0), MAX_SCALE_EXP)

    def advice(self):
        """The one recommendation (``tfamp.numerics.advice.Advice``): scale, reasons, text."""
        return advise(self)

    def recommended_scale(self) -> float:
        """The scale the recommendation names (the table's "rec." column); 1 without
        gradients."""
        scale = self.advice().scale
        return 1.0 if scale is None else scale

    def smallest_sufficient_scale(self, threshold: float = NEGLIGIBLE) -> float | None:
        """The smallest power of 2 (up to the highest safe scale) at which no gradient
        counted as evidence (``advice.evidence``) loses more than `threshold` of its
        values; None if even that one does not."""
        return sufficient_scale(evidence(self), self.highest_safe_scale(), threshold)

    def dynamic_steps_to(self, scale: float) -> tuple[int, str]:
        """How dynamic loss scaling gets from `initial_scale` to `scale`.

        Returns:
          (steps, "skipped") when it must halve (each overflowing step is
          skipped), (steps, "good") when it must grow (one doubling per
          `growth_interval` good steps), (0, "") when it starts there.
        """
        diff = scale_exponent(scale) - scale_exponent(self.initial_scale)
        if diff < 0:
            return -diff, "skipped"
        if diff > 0:
            return diff * self.growth_interval, "good"
        return 0, ""

    def worst_gradient(self) -> TensorRange | None:
        """The evidence gradient losing the largest share at scale 1 (ties: activation
        gradients); rounding-level and all-zero gradients are not evidence."""
        candidates = evidence(self)
        if not candidates:
            return None
        return max(candidates, key=lambda t: (t.underflow_share(1.0),
                                              t.kind == "activation_gradient", t.nonzero))

    def recommendation(self) -> str:
        """One actionable sentence about loss scaling for this model (``advice()``)."""
        return self.advice().sentence

    # -- rendering -----------------------------------------------------------

    def summary_text(self, advice=None) -> str:
        """The answer, for logs and the CLI: the recommendation first, then a few facts.

        The per-tensor table is ``table_text()`` (ranges.txt holds both).
        """
        advice = advice or self.advice()
        gradients = self.gradients()
        lines = [f"tfamp ranges: {self.model}, {self.steps} step(s), {len(self.tensors)} "
                 f"tensors measured against float16's limits (0 below 2^-24, max 65504)",
                 "  recommendation: " + advice.sentence]
        if gradients:
            counted = [t for t in gradients if t.nonzero and t.name not in advice.ignored]
            rec = advice.scale or 1.0
            losing = {s: sum(t.underflow_share(s) > NEGLIGIBLE for t in counted)
                      for s in (1.0, rec)}
            lines.append(f"  gradients losing more than {format_pct(NEGLIGIBLE)} of their "
                         f"values to 0: {losing[1.0]} of {len(counted)} at scale 1, "
                         f"{losing[rec]} at {format_scale(rec)} (recommended)")
        if advice.ignored:
            names = sorted(advice.ignored)
            shown = ", ".join(repr(n) for n in names[:4]) + (", ..." if len(names) > 4 else "")
            lines.append(f"  not counted: {len(names)} gradient(s) zero or at rounding "
                         f"level, zero in exact arithmetic ({shown})")
        if self.loss_scale is not None:
            lines.append(f"  loss scale while collecting: {format_scale(self.loss_scale)}")
        for note in self.notes:
            lines.append(f"  note: {note}")
        return "\n".join(lines)

    def table_text(self, advice=None) -> str:
        """The per-tensor table (shares lost at scale 1, now and at the recommended scale)."""
        advice = advice or self.advice()
        recommended = advice.scale or 1.0
        current = self.loss_scale
        lines = [f"per-tensor ranges ({self.model}; shares of nonzero values; "
                 f"'*': not counted, see above)"]
        scale_cols = [("scale 1", 1.0)]
        if current is not None and current != 1.0:
            scale_cols.append((f"now {format_scale(current).split(' ')[0]}", current))
        scale_cols.append((f"rec. {format_scale(recommended).split(' ')[0]}", recommended))
        for kind in KINDS:
            entries = self.of_kind(kind)
            if not entries:
                continue
            lines.append(f"  {KIND_LABELS[kind]} (share of nonzero values below 2^-24 "
                         f"{'/ above 65504 ' if kind == 'activation' else ''}in float16):")
            width = max(len(t.name) for t in entries) + 1
            if kind == "activation":
                lines.append(f"    {'tensor':<{width}}  {'underflow':>10}  {'overflow':>10}  "
                             f"{'max |x|':>10}  {'zeros':>6}")
                for t in entries:
                    lines.append(f"    {t.name:<{width}}  {format_pct(t.underflow_share()):>10}  "
                                 f"{format_pct(t.overflow_share()):>10}  {t.max_abs:>10.3g}  "
                                 f"{format_pct(_zero_share(t)):>6}")
                continue
            header = "  ".join(f"{label:>10}" for label, _ in scale_cols)
            lines.append(f"    {'tensor':<{width}}  {header}  {'room@rec.':>10}  "
                         f"{'max |g|':>10}  {'bf16 uf':>7}")
            for t in entries:
                shares = "  ".join(f"{format_pct(t.underflow_share(s)):>10}"
                                   for _, s in scale_cols)
                room = t.headroom_bits(recommended)
                room_text = "-" if room is None else f"2^{room}"
                name = t.name + ("*" if t.name in advice.ignored else "")
                lines.append(f"    {name:<{width}}  {shares}  {room_text:>10}  "
                             f"{t.max_abs:>10.3g}  {format_pct(t.bf16_underflow_share()):>7}")
        if self.gradients():
            lines.append("  room@rec.: doublings of the recommended scale left before the "
                         "largest value overflows float16")
        lines.append(f"  bfloat16: same range as float32 ({BF16_MAX:.3g}), "
                     f"{BF16_MANTISSA_BITS}-bit precision; 'bf16 uf' = values below 2^-126")
        return "\n".join(lines)

    def full_text(self) -> str:
        """Summary, then the table (what ranges.txt holds)."""
        advice = self.advice()
        return self.summary_text(advice) + "\n\n" + self.table_text(advice)

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": SCHEMA_VERSION, "model": self.model, "dtype": self.dtype,
            "steps": self.steps, "loss_scale": self.loss_scale,
            "growth_interval": self.growth_interval, "initial_scale": self.initial_scale,
            "e_min": E_MIN, "e_max": E_MAX, "notes": list(self.notes),
            **self._advice_fields(),
            "tensors": [t.to_dict() for t in self.tensors],
        }

    def _advice_fields(self) -> dict[str, Any]:
        advice = self.advice()
        return {"recommended_scale": 1.0 if advice.scale is None else advice.scale,
                "recommendation": advice.sentence, "advice_kind": advice.kind,
                "negligible_share": NEGLIGIBLE, "keep_fp32": list(advice.keep_fp32),
                "not_counted": dict(advice.ignored)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RangeReport:
        """Reads `to_dict` output back (derived fields are recomputed)."""
        if data.get("version") != SCHEMA_VERSION or (data.get("e_min"), data.get("e_max")) \
                != (E_MIN, E_MAX):
            raise ValueError(
                f"expected a tfamp range report version {SCHEMA_VERSION} with exponents "
                f"{E_MIN}..{E_MAX}, received version {data.get('version')!r} with "
                f"{data.get('e_min')!r}..{data.get('e_max')!r}")
        tensors = [TensorRange(**t) for t in data["tensors"]]
        return cls(model=data["model"], steps=data["steps"], loss_scale=data["loss_scale"],
                   tensors=tensors, notes=list(data.get("notes", ())),
                   dtype=data.get("dtype", "float16"),
                   growth_interval=data.get("growth_interval", 2000),
                   initial_scale=data.get("initial_scale", 2.0**15))


def _zero_share(t: TensorRange) -> float:
    return t.zeros / t.total if t.total else 0.0


