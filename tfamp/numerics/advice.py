"""What a range report recommends: one loss-scale advice, consistent with its table.

``advise(report)`` reads a ``RangeReport`` and returns an ``Advice`` value:
the scale to use, whether dynamic scaling's start scale already suffices, the
layers to keep float32 when no scale is enough, which gradients were not
counted as evidence and why, and the one sentence that says so. The report's
table, JSON, HTML page and the CLI all take their "recommended" scale from
here, so they cannot disagree.

The rules, in order (``threshold`` is ``ranges.NEGLIGIBLE``, 0.1%, the one
threshold used everywhere: a tensor "loses" values when more than 0.1% of its
nonzero values fall below float16's smallest subnormal):

1. Evidence: gradients with nonzero values that are not rounding-level. A
   gradient that is zero in exact arithmetic (a bias feeding a BatchNorm in
   training mode, the beta of a BatchNorm whose output reaches another
   BatchNorm through linear layers) comes out of float32 as rounding noise,
   far below its layer's output gradient it is the sum of. Such a
   ``.../bias`` or ``.../beta`` gradient whose largest value is
   ``2**ROUNDING_GAP_BITS`` below the largest activation gradient of its layer
   is listed in ``ignored`` and decides nothing; an all-zero gradient is never
   evidence either.
2. ``ceiling``: the highest power of two keeping every gradient's largest
   value below 65504 / 2 (``RangeReport.highest_safe_scale``).
3. ``sufficient``: the smallest power of two up to the ceiling at which no
   evidence gradient loses more than the threshold.
4. No scaling needed (sufficient is 1) / the start scale suffices (sufficient
   <= start <= ceiling: say so, nothing to change) / dynamic scaling must grow
   or shrink to get there (say how many steps, and the fixed scale that avoids
   them) / nothing suffices (keep the worst layers float32 or use bfloat16).
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING

from tfamp.numerics.ranges import NEGLIGIBLE, TensorRange, format_pct, format_scale, scale_exponent

if TYPE_CHECKING:  # annotations only: the report module imports this one
    from tfamp.numerics.range_report import RangeReport

# A bias/beta gradient this many binades below its layer's output gradient is
# rounding noise of an exact zero: a sum of N float32 terms of size <= m that
# cancels exactly comes out near 2**-24 * sqrt(N) * m, while a real one is
# rarely below m / 64. 2**-12 leaves a wide margin on both sides.
ROUNDING_GAP_BITS = 12
# Names of per-channel offsets whose gradient is the sum of the layer's output
# gradient (Keras names them so in every layer that has one).
OFFSET_NAMES = ("bias", "beta")
MAX_KEEP_LAYERS = 3

NO_GRADIENTS = "no_gradients"
FORWARD_ONLY = "forward_only"
NO_SCALING_NEEDED = "no_scaling_needed"
START_SUFFICES = "start_suffices"
GROW_TO = "grow_to"
SHRINK_TO = "shrink_to"
KEEP_FP32 = "keep_fp32"


@dataclasses.dataclass(frozen=True)
class Advice:
    """The recommendation of one range report (structured; ``sentence`` renders it).

    Attributes:
      kind: one of the module's kind constants (NO_SCALING_NEEDED, ...).
      scale: the loss scale recommended (the "rec." column of the table); None
        when there are no gradients.
      start_scale: dynamic scaling's start scale the advice compares against.
      ceiling: highest scale with one bit of head-room for every gradient.
      sufficient: smallest scale at which no evidence gradient loses more than
        the threshold (None: none up to the ceiling).
      worst: the evidence gradient losing the largest share at scale 1.
      keep_fp32: keep_fp32 patterns for the layers still losing values at the
        ceiling (KEEP_FP32 only).
      ignored: {tensor name: why it is not evidence}.
      steps, step_kind: how dynamic scaling gets from the start to `scale`
        (steps, "good" or "skipped"); (0, "") when it starts there.
      sentence: the recommendation in words.
    """

    kind: str
    scale: float | None
    start_scale: float
    ceiling: float | None
    sufficient: float | None
    worst: str | None
    keep_fp32: tuple[str, ...]
    ignored: dict[str, str]
    steps: int
    step_kind: str
    sentence: str


def rounding_level(report: RangeReport) -> dict[str, str]:
    """Gradients that are not evidence: {name: why} (rule 1 of the module docstring)."""
    output_grads = {t.name: t for t in report.of_kind("activation_gradient")}
    ignored = {}
    for t in report.gradients():
        if not t.nonzero:
            ignored[t.name] = "all zero"
            continue
        if t.kind != "weight_gradient" or t.name.rsplit("/", 1)[-1] not in OFFSET_NAMES:
            continue
        output = output_grads.get(t.layer)
        top, output_top = t.max_exponent, output.max_exponent if output else None
        if output_top is not None and top is not None and (
                top <= output_top - ROUNDING_GAP_BITS):
            ignored[t.name] = (f"rounding-level: largest value 2^{top}, its layer's output "
                               f"gradient reaches 2^{output_top} (zero in exact arithmetic, "
                               f"e.g. an offset feeding a BatchNorm)")
    return ignored


def evidence(report: RangeReport, ignored: dict[str, str] | None = None) -> list[TensorRange]:
    """The gradients the advice is based on (nonzero, not rounding-level)."""
    ignored = rounding_level(report) if ignored is None else ignored
    return [t for t in report.gradients() if t.nonzero and t.name not in ignored]


def sufficient_scale(tensors: list[TensorRange], ceiling: float,
                     threshold: float = NEGLIGIBLE) -> float | None:
    """Smallest power of 2 up to `ceiling` at which no tensor loses more than `threshold`."""
    for k in range(0, scale_exponent(ceiling) + 1):
        if all(t.underflow_share(2.0**k) <= threshold for t in tensors):
            return 2.0**k
    return None


def advise(report: RangeReport) -> Advice:
    """The one recommendation for `report` (see the module docstring for the rules).

    Example:
      >>> advice = advise(report)
      >>> advice.kind, advice.scale, advice.sentence
      ('start_suffices', 32768.0, "loss scaling is needed, and ...")
    """
    start = float(report.initial_scale)
    ignored = rounding_level(report)
    base = dict(start_scale=start, ceiling=None, sufficient=None, worst=None, keep_fp32=(),
                ignored=ignored, steps=0, step_kind="")
    if not report.gradients():
        return Advice(kind=FORWARD_ONLY, scale=None, sentence=_forward_only(report), **base)
    tensors = evidence(report, ignored)
    if not tensors:
        return Advice(kind=NO_GRADIENTS, scale=None, sentence=(
            "no gradient with nonzero values beyond rounding level was measured; nothing "
            "to recommend (check that the loss depends on the weights)."), **base)
    ceiling = report.highest_safe_scale()
    sufficient = sufficient_scale(tensors, ceiling)
    worst = max(tensors, key=lambda t: (t.underflow_share(1.0),
                                        t.kind == "activation_gradient", t.nonzero))
    base.update(ceiling=ceiling, sufficient=sufficient, worst=worst.name)
    at_one = worst.underflow_share(1.0)
    lost_at_one = f"without scaling {worst.name!r} loses {format_pct(at_one)} of its values"
    if sufficient == 1.0:
        return Advice(kind=NO_SCALING_NEEDED, scale=1.0, sentence=(
            f"gradients fit float16 without loss scaling (at most {format_pct(at_one)} of "
            f"any gradient's values below 2^-24, {worst.name!r}); scaling is optional."),
            **base)
    if sufficient is None:
        losing = sorted((t for t in tensors if t.underflow_share(ceiling) > NEGLIGIBLE),
                        key=lambda t: -t.underflow_share(ceiling))
        layers = list(dict.fromkeys(t.layer for t in losing))[:MAX_KEEP_LAYERS]
        patterns = tuple(scope_pattern(layer) for layer in layers)
        top = losing[0]
        steps, how = report.dynamic_steps_to(ceiling)
        base.update(keep_fp32=patterns, steps=steps, step_kind=how)
        return Advice(kind=KEEP_FP32, scale=ceiling, sentence=(
            f"no loss scale is enough: even at {format_scale(ceiling)}, the highest with "
            f"head-room, {top.name!r} loses {format_pct(top.underflow_share(ceiling))} of "
            f"its values ({len(losing)} gradient(s) lose more than {format_pct(NEGLIGIBLE)}); "
            f"keep {'its layer' if len(layers) == 1 else 'those layers'} float32 "
            f"(keep_fp32={list(patterns)!r}) or use dtype='bfloat16'."), **base)
    if sufficient <= start <= ceiling:
        return Advice(kind=START_SUFFICES, scale=start, sentence=(
            f"loss scaling is needed ({lost_at_one}) and dynamic scaling's start scale "
            f"{format_scale(start)} already suffices: no gradient loses more than "
            f"{format_pct(NEGLIGIBLE)} there; nothing to change (any fixed scale from "
            f"{format_scale(sufficient)} to {format_scale(ceiling)} would do too)."), **base)
    steps, how = report.dynamic_steps_to(sufficient if start < sufficient else ceiling)
    base.update(steps=steps, step_kind=how)
    if start < sufficient:
        behind = max(tensors, key=lambda t: t.underflow_share(start))
        return Advice(kind=GROW_TO, scale=sufficient, sentence=(
            f"loss scaling is needed ({lost_at_one}); dynamic scaling starts at "
            f"{format_scale(start)}, where {behind.name!r} still loses "
            f"{format_pct(behind.underflow_share(start))}, and reaches "
            f"{format_scale(sufficient)} only after {steps} good steps: start there "
            f"(initial_scale={int(sufficient)}) or use a fixed scale of {int(sufficient)}."),
            **base)
    return Advice(kind=SHRINK_TO, scale=sufficient, sentence=(
        f"loss scaling is needed ({lost_at_one}); dynamic scaling's start scale "
        f"{format_scale(start)} overflows (the highest with head-room is "
        f"{format_scale(ceiling)}), so it skips {steps} steps halving it: use a fixed "
        f"scale of {int(sufficient)} (enough from {format_scale(sufficient)} on) or start "
        f"there (initial_scale={int(sufficient)})."), **base)


def _forward_only(report: RangeReport) -> str:
    acts = [t for t in report.of_kind("activation") if t.nonzero]
    if not acts:
        return "no nonzero values were measured; nothing to recommend."
    over = max(acts, key=lambda t: t.overflow_share())
    under = max(acts, key=lambda t: t.underflow_share())
    text = (f"no gradients were measured (forward pass only). Forward activations: at most "
            f"{format_pct(over.overflow_share())} above 65504 ({over.name!r}), at most "
            f"{format_pct(under.underflow_share())} below 2^-24 ({under.name!r}) in float16")
    if over.overflow_share() > 0:
        text += (f"; keep {over.name!r} float32 (keep_fp32=[{scope_pattern(over.layer)!r}]) "
                 f"or use bfloat16")
    return text + "."


def scope_pattern(layer: str) -> str:
    """A keep_fp32 regular expression matching a layer's forward and gradient nodes."""
    return f"(^|/){re.escape(layer)}/" if layer else ".*"
