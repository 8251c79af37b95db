"""Is 16-bit worth it here, and why? One line from a rewrite report's figures.

``verdict_of(report)`` gathers its inputs from report fields only
(``VerdictInputs.from_report``): the estimated traffic before and after, the
Cast bytes, the matrix FLOPs in 16-bit when the report carries them, the
batch size, what was converted and why ops stayed float32. A new estimate
(an XLA-fused traffic figure, a kernel-launch cost) plugs in by adding a field
to ``VerdictInputs`` and reading it in ``from_report``; ``judge`` prefers the
fused figure to the unfused one when it is there.

It lives beside ``report.py`` (not in ``inspect/``) because the log line
(``RewriteReport.summary_line``) and the report's JSON carry it, and
``rewrite/`` does not import ``inspect/``.

The rules (``ratio`` = 16-bit bytes / float32 bytes; ``flop_share`` = share of
matrix/convolution FLOPs in 16-bit, or of converted allow-list ops when
FLOPs were not counted):

* nothing converted, or no allow-list (matrix) op converted: not worth it;
* ratio <= WORTH_RATIO and flop_share >= HALF: worth it (fewer bytes and the
  matrix math on 16-bit units);
* ratio > 1: float16 moves more bytes than float32 -- the gain is the matrix
  math alone; suggest bfloat16 (float16 only), a larger batch when Casts of
  weights are a large share (they cost the same at any batch), and the
  biggest reason ops stayed float32 that a user can change (deny list, deny
  spread, keep_fp32, placement);
* otherwise marginal, with the same suggestions;
* unknown traffic (no shapes): judged on the matrix share alone.

Where a size is unknown (the batch), the report's share is the one as that size
grows (``traffic_share``: the terms that grow with it decide), and the share
with each unknown size at ``TYPICAL_SIZE`` (``traffic_share_typical``). Where
the two differ by ``SHARES_DIFFER`` or more, the step's big tensors are
constants of it (a graph network's whole graph, read through a batch of node
indices): the verdict is taken at the typical size and the line gives both.

When the report carries the runtime cost estimates (``rewrite.runtime_cost``:
bytes plus kernel launches, for the executor or XLA, whichever the Casts were
placed for), that share takes the place of the byte ratio in these rules and
the line says so; the unfused byte ratio is still given.
"""

from __future__ import annotations

import dataclasses
from typing import Any

WORTH_RATIO = 0.9    # at most 90% of float32's bytes: a real memory saving
HALF = 0.5           # at least half of the matrix work in 16-bit
CAST_SHARE = 0.1     # Casts above 10% of the 16-bit bytes: a larger batch dilutes them

# The size each unknown dimension is given for the share "at a typical size"
# (Keras's default batch), and how far apart the two shares must be to be told.
TYPICAL_SIZE = 32
SHARES_DIFFER = 0.05
LARGE = "at large sizes"

YES, MARGINAL, NO, UNKNOWN = "yes", "marginal", "no", "unknown"


@dataclasses.dataclass(frozen=True)
class VerdictInputs:
    """The figures a verdict reads (each None when the report does not have it)."""

    dtype: str
    converted: int                       # ops now in 16-bit
    matrix_converted: int                # allow-list (compute-heavy) ops now in 16-bit
    traffic_before: int | None = None    # bytes per step, float32
    traffic_after: int | None = None     # bytes per step, 16-bit
    traffic_share: float | None = None   # after / before for large unknown dimensions
    traffic_share_typical: float | None = None  # ... with them at TYPICAL_SIZE
    cast_bytes: int | None = None
    flop_share: float | None = None      # matrix FLOPs in 16-bit / all counted
    batch_size: int | None = None
    top_kept: tuple[str, int] | None = None  # (reason kind, count) keeping most ops float32
    # What a GPU pays (rewrite.runtime_cost): after / before of bytes plus kernel
    # launches, for the runtime the Casts were placed for ("executor" or "xla").
    cost_share: float | None = None
    cost_share_typical: float | None = None
    runtime: str = ""
    kept_float32: int | None = None      # ops left float32, for any reason

    @classmethod
    def from_report(cls, report) -> VerdictInputs:
        from tfamp.rewrite import reasons as rk

        flops = getattr(report, "matrix_flops", None) or {}
        total, in_16 = flops.get("total"), flops.get("in_16bit")
        actionable = (rk.KIND_DOWNSTREAM_OF_DENY, rk.KIND_DENY_LIST, rk.KIND_USER_OVERRIDE,
                      rk.KIND_OFF_DEVICE)
        # Only reasons a user can change (list options, keep_fp32, placement): the
        # statistics, outputs and loss-scale ops stay float32 by design.
        kept = [(k, n) for k, n in report.kept_fp32.items() if k in actionable]
        estimate = (getattr(report, "runtime_estimates", None) or {}).get(
            getattr(report, "runtime", ""), {})
        return cls(
            dtype=report.dtype,
            converted=sum(report.converted.values()),
            matrix_converted=sum(1 for n in report.nodes
                                 if n.converted and n.kind == rk.KIND_ALLOW),
            traffic_before=report.traffic_before_bytes,
            traffic_after=report.traffic_after_bytes,
            traffic_share=report.traffic_share,
            traffic_share_typical=getattr(report, "traffic_share_typical", None),
            cast_bytes=report.cast_bytes,
            flop_share=(in_16 / total) if total else None,
            batch_size=getattr(report, "batch_size", None),
            top_kept=kept[0] if kept else None,
            cost_share=estimate.get("share"),
            cost_share_typical=estimate.get("share_typical"),
            runtime=getattr(report, "runtime", ""),
            kept_float32=sum(report.kept_fp32.values()))


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Whether 16-bit pays here (`worth`: yes / marginal / no / unknown), the ratio
    it is based on, what to try, and the line that says so."""

    worth: str
    ratio: float | None
    flop_share: float | None
    suggestions: tuple[str, ...]
    line: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def format_bytes(value: int) -> str:
    """'2.90 GB', '12.0 MB', '512 B' (decimal units)."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            scaled = value / size
            return f"{scaled:.2f} {unit}" if scaled < 10 else f"{scaled:.1f} {unit}"
    return f"{value} B"


def verdict_of(report) -> Verdict:
    """The verdict for a RewriteReport (inputs from its fields only)."""
    return judge(VerdictInputs.from_report(report))


def judge(i: VerdictInputs) -> Verdict:
    """The verdict for `i` (see the module docstring for the rules)."""
    if i.converted == 0 and i.kept_float32 == 0:
        # (a tf.data-like step of integers and strings: TextVectorization's adapt_step)
        return Verdict(NO, None, i.flop_share, (), (
            f"{i.dtype} has nothing to do here: no op computes a floating-point value"))
    if i.converted == 0 or i.matrix_converted == 0:
        what = "nothing was converted" if i.converted == 0 else (
            "no matrix/convolution op was converted")
        return Verdict(NO, None, i.flop_share, (), (
            f"{i.dtype} is not worth it here: {what}, so no work moves to 16-bit units "
            f"(see the reasons ops stayed float32, or tfamp inspect --why NODE)"))
    ratio, large, figures = _figures(i)
    bytes_text = f" ({figures})" if figures else ""
    share = i.flop_share
    share_text = (f"{share:.0%} of the matrix FLOPs" if share is not None else
                  f"{i.matrix_converted} matrix/convolution ops")
    suggestions = _suggestions(i, ratio)
    if large is not None and large < ratio - SHARES_DIFFER:
        suggestions.insert(0, f"a larger batch ({large:.2f}x float32's {LARGE})")
    tail = ": try " + " / ".join(suggestions) if suggestions else ""
    if ratio is None:
        worth = YES if share is None or share >= HALF else MARGINAL
        return Verdict(worth, None, share, tuple(suggestions), (
            f"{i.dtype} runs {share_text} in 16-bit; memory traffic unknown (the graph "
            f"carries no shapes)" + ("" if worth == YES else tail)))
    if ratio <= WORTH_RATIO and (share is None or share >= HALF):
        return Verdict(YES, ratio, share, (), (
            f"{i.dtype} is worth it here: it {_moves(i, ratio)}"
            f"{bytes_text} and runs {share_text} in 16-bit"))
    if ratio > 1:
        more = "costs more" if i.cost_share is not None else "moves more bytes"
        head = (f"{i.dtype} {more} than float32 here{bytes_text}: only the "
                f"matrix math ({share_text}) gains")
        return Verdict(NO if (share is not None and share < HALF) else MARGINAL, ratio,
                       share, tuple(suggestions), head + tail)
    low_share = share is not None and share < HALF
    head = (f"{i.dtype} is marginal here: it {_moves(i, ratio)}{bytes_text}"
            + (f" and runs only {share_text} in 16-bit" if low_share else
               f"; the matrix math ({share_text}) gains"))
    return Verdict(MARGINAL, ratio, share, tuple(suggestions), head + tail)


def _figures(i: VerdictInputs) -> tuple[float | None, float | None, str]:
    """(the share judged, the share at large sizes where that is another, the
    figures behind them in words). The cost share (bytes + launches) takes the
    place of the byte share where the report has it; the bytes are still said."""
    known = bool(i.traffic_before) and i.traffic_after is not None
    if known:
        ratio, large = i.traffic_after / i.traffic_before, None
        where = f"({format_bytes(i.traffic_after)} vs {format_bytes(i.traffic_before)})"
    else:
        ratio, where = at_size(i.traffic_share, i.traffic_share_typical)
        large = None if where == LARGE else i.traffic_share
    if ratio is None:
        return None, None, ""
    if i.cost_share is None:
        return ratio, large, where[1:-1] if known else f"{ratio:.0%} of float32's {where}"
    cost, cost_where = at_size(i.cost_share, i.cost_share_typical, "{:.2f}x")
    runtime = "under XLA" if i.runtime == "xla" else "on the executor"
    bytes_where = (f" {where}" if known or large is None else
                   f", {i.traffic_share:.2f}x {LARGE}")
    return cost, None if cost_where == LARGE else i.cost_share, (
        f"est. GPU cost {runtime}, bytes + kernel launches"
        + ("" if cost_where == LARGE else f", {cost_where}")
        + f"; {ratio:.2f}x the bytes{bytes_where}")


def at_size(share: float | None, typical: float | None,
            form: str = "{:.0%}") -> tuple[float | None, str]:
    """(the share to judge by, where it holds) from the share as unknown sizes
    grow and the one with them at TYPICAL_SIZE (see the module docstring):
    (share, LARGE) where the two agree, else (typical, "at 32 for each unknown
    size, ... at large sizes")."""
    if share is None or typical is None or abs(typical - share) < SHARES_DIFFER:
        return share, LARGE
    return typical, (f"at {TYPICAL_SIZE} for each unknown size, "
                     f"{form.format(share)} {LARGE}")


def _moves(i: VerdictInputs, ratio: float) -> str:
    if i.cost_share is not None:
        return f"costs {ratio:.2f}x float32's"
    return f"moves {ratio:.2f}x float32's bytes"


def _suggestions(i: VerdictInputs, ratio: float | None) -> list[str]:
    found = []
    if i.dtype == "float16":
        found.append("bfloat16 (--dtype bfloat16)")
    if (i.cast_bytes and i.traffic_after and ratio is not None
            and i.cast_bytes > CAST_SHARE * i.traffic_after):
        now = f" than {i.batch_size}" if i.batch_size else ""
        found.append(f"a larger batch{now} (Casts are {i.cast_bytes / i.traffic_after:.0%} "
                     f"of the bytes; those of weights cost the same at any batch)")
    if i.top_kept is not None:
        kind, count = i.top_kept
        found.append(f"fewer ops kept float32 ({kind}: {count} ops; see --nodes and "
                     f"--why NODE)")
    return found
