"""The picture of a RangeReport: a PNG (matplotlib) and a self-contained HTML page.

Both draw log2 histograms of gradient magnitudes with float16's ranges shaded
(flushed to zero below 2^-24, subnormal 2^-24..2^-14, normal 2^-14..65504,
overflow above), before loss scaling and after it (multiplying by S = 2^k
shifts the histogram k bins to the right).

The PNG uses matplotlib's object API with the Agg canvas (no global backend
change, no display needed). The HTML page embeds the report as JSON and draws
SVG with inline JavaScript, with a slider for the loss scale; it needs no
network, no matplotlib and no other file.
"""

from __future__ import annotations

from pathlib import Path

from tfamp.inspect import page
from tfamp.inspect.html_report import script_json
from tfamp.numerics.range_report import RangeReport
from tfamp.numerics.ranges import (
    E_MAX,
    E_MIN,
    FP16_NORMAL_EXP,
    FP16_OVERFLOW_EXP,
    FP16_SUBNORMAL_EXP,
    KIND_LABELS,
    MAX_SCALE_EXP,
    TensorRange,
    format_scale,
    scale_exponent,
)

# (gid, label, x from, x to, colour): the float16 ranges on a log2 axis.
FP16_SPANS = (
    ("fp16_zero", "float16: flushed to 0", E_MIN, FP16_SUBNORMAL_EXP, "#e5484d"),
    ("fp16_subnormal", "float16 subnormal", FP16_SUBNORMAL_EXP, FP16_NORMAL_EXP, "#f5a524"),
    ("fp16_normal", "float16 normal", FP16_NORMAL_EXP, FP16_OVERFLOW_EXP, "#46a758"),
    ("fp16_overflow", "float16: inf", FP16_OVERFLOW_EXP, E_MAX + 1, "#e5484d"),
)
SERIES_COLOURS = {"activation_gradient": "#2f5bd3", "weight_gradient": "#8e4ec6",
                  "activation": "#6b7280"}


def after_scale(report: RangeReport) -> float:
    """The scale drawn in the "after" panel: the current one if it scales, else the
    recommended one."""
    if report.loss_scale is not None and report.loss_scale > 1:
        return float(report.loss_scale)
    return report.recommended_scale()


def plot_ranges(report: RangeReport, scale: float | None = None):
    """The figure: gradient histograms at scale 1 (top) and at `scale` (bottom).

    Args:
      report: the RangeReport.
      scale: the loss scale of the lower panel (default: ``after_scale``).

    Returns:
      a ``matplotlib.figure.Figure`` (Agg canvas attached). Each shaded float16
      range is an axvspan patch whose gid names it (FP16_SPANS).
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError("the range picture needs matplotlib: pip install "
                          "'tfamp[plot]' (or pip install matplotlib)") from err

    scale = after_scale(report) if scale is None else scale
    kinds = [k for k in ("activation_gradient", "weight_gradient") if report.of_kind(k)]
    figure = Figure(figsize=(10, 6.4 if kinds else 3.6), dpi=100)
    FigureCanvasAgg(figure)
    if kinds:
        axes = figure.subplots(2, 1, sharex=True)
        scales = (1.0, scale)
    else:  # forward activations only (SavedModel): nothing is loss-scaled
        axes = [figure.subplots(1, 1)]
        scales = (1.0,)
        kinds = ["activation"]
    for ax, panel_scale in zip(axes, scales, strict=True):
        k = scale_exponent(panel_scale)
        for gid, label, start, stop, colour in FP16_SPANS:
            span = ax.axvspan(start, stop, color=colour, alpha=0.13, label=label, lw=0)
            span.set_gid(gid)
        for kind in kinds:
            merged = report.combined(kind)
            shares = _shares(merged)
            lefts = [E_MIN + i + k for i in range(len(shares))]
            ax.bar(lefts, shares, width=1.0, align="edge", alpha=0.75,
                   color=SERIES_COLOURS[kind], label=KIND_LABELS[kind],
                   edgecolor="white", linewidth=0.3)
        for limit in (FP16_SUBNORMAL_EXP, FP16_NORMAL_EXP, FP16_OVERFLOW_EXP):
            ax.axvline(limit, color="#333333", lw=0.8, ls="--")
        lost = [f"{KIND_LABELS[kind]}: "
                f"{100 * report.combined(kind).underflow_share(panel_scale):.1f}%"
                for kind in kinds]
        title = ("before loss scaling (scale 1)" if k == 0 else
                 f"after loss scaling by {format_scale(panel_scale)}")
        if kinds == ["activation"]:
            title = "forward activations (not loss-scaled)"
        ax.set_title(f"{title} - lost to 0 in float16: {', '.join(lost) or 'n/a'}",
                     fontsize=10, loc="left")
        ax.set_ylabel("% of nonzero values")
        ax.set_xlim(E_MIN + 20, E_MAX + 1)
    axes[-1].set_xlabel(f"log2 |{'x' if kinds == ['activation'] else 'gradient'}|   "
                        f"(float16: 0 below 2^-24, subnormal to 2^-14, max 65504 ~ 2^16)")
    axes[0].legend(loc="upper left", fontsize=8, ncol=3)
    figure.suptitle(f"tfamp: magnitudes in {report.model!r} vs float16 "
                    f"({report.steps} step(s))", fontsize=12)
    figure.tight_layout()
    return figure


def _shares(entry: TensorRange) -> list[float]:
    total = entry.nonzero or 1
    return [100.0 * c / total for c in entry.counts]


def write_png(report: RangeReport, path: str | Path, scale: float | None = None):
    """Draws `plot_ranges` into a PNG file; returns the figure."""
    figure = plot_ranges(report, scale)
    figure.savefig(str(path), format="png")
    return figure


# ---------------------------------------------------------------- HTML page


def render_ranges_html(report: RangeReport) -> str:
    """A complete, self-contained HTML page (ASCII) of `report`.

    Per kind (activation gradients, weight gradients, forward activations):
    the combined histogram and one row per tensor, with the float16 ranges
    shaded, a slider for the loss scale, and the shares lost at that scale.
    """
    if isinstance(report, dict):
        report = RangeReport.from_dict(report)
    data = report.to_dict()
    data["after_scale"] = after_scale(report)
    data["spans"] = [list(span) for span in FP16_SPANS]
    data["limits"] = {"zero": FP16_SUBNORMAL_EXP, "normal": FP16_NORMAL_EXP,
                      "overflow": FP16_OVERFLOW_EXP, "max_k": MAX_SCALE_EXP}
    data["labels"] = KIND_LABELS
    data["summary"] = report.summary_text()
    return page.assemble("ranges", title=f"tfamp ranges: {report.model}",
                         data_json=script_json(data))
