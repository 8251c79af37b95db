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

import html
import re
from pathlib import Path

from tfamp.inspect.html_report import script_json
from tfamp.numerics.ranges import (
    E_MAX,
    E_MIN,
    FP16_NORMAL_EXP,
    FP16_OVERFLOW_EXP,
    FP16_SUBNORMAL_EXP,
    KIND_LABELS,
    MAX_SCALE_EXP,
    RangeReport,
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
    values = {"TITLE": html.escape(f"tfamp ranges: {report.model}"),
              "DATA": script_json(data)}
    return re.sub(r"%%(TITLE|DATA)%%", lambda m: values[m.group(1)], _TEMPLATE)


_TEMPLATE = r"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>%%TITLE%%</title>
<style>
* { box-sizing: border-box; }
body { margin: 0; color: #1f2430; background: #eef0f4;
  font: 13px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial,
    sans-serif; }
header { display: flex; align-items: center; gap: 18px; padding: 8px 16px;
  background: #22293d; color: #e9ecf5; }
header h1 { font-size: 16px; margin: 0; font-weight: 600; }
header h1 span { color: #9fb0d8; font-weight: 400; }
#controls { font-size: 12px; color: #c5cce0; display: flex; gap: 10px; align-items: center; }
#controls b { color: #fff; }
main { padding: 12px 16px; }
.rec { background: #fff; border-left: 4px solid #2f5bd3; padding: 8px 12px; margin: 0 0 12px;
  border-radius: 4px; }
.panel { background: #fff; border: 1px solid #d5d9e3; border-radius: 6px; padding: 8px 12px;
  margin-bottom: 14px; }
.panel h2 { font-size: 14px; margin: 0 0 6px; }
table { border-collapse: collapse; width: 100%; }
td, th { padding: 2px 8px; text-align: right; white-space: nowrap; font-size: 12px; }
th { color: #5a6275; font-weight: 600; border-bottom: 1px solid #e3e6ee; }
td.name, th.name { text-align: left; font-family: ui-monospace, Menlo, Consolas, monospace; }
td.bad { color: #c62a2f; font-weight: 600; }
.legend span { display: inline-block; margin-right: 14px; font-size: 12px; }
.legend i { display: inline-block; width: 12px; height: 12px; margin-right: 4px;
  vertical-align: -2px; border-radius: 2px; }
pre { background: #fff; border: 1px solid #d5d9e3; border-radius: 6px; padding: 8px 12px;
  overflow: auto; font-size: 11px; }
svg text { font-size: 10px; fill: #5a6275; }
</style></head>
<body>
<header><h1>tfamp ranges <span id="model"></span></h1>
<div id="controls">loss scale <input id="scale" type="range" min="0" max="24" step="1">
<b id="scalelabel"></b> <span id="lost"></span></div></header>
<main>
<div id="error" hidden></div>
<div id="status" data-state="loading"></div>
<p class="rec" id="rec"></p>
<div class="legend" id="legend"></div>
<div id="panels"></div>
<details><summary>text summary</summary><pre id="summary"></pre></details>
</main>
<script id="data" type="application/json">%%DATA%%</script>
<script>
"use strict";
(function () {
const D = JSON.parse(document.getElementById("data").textContent);
const NS = "http://www.w3.org/2000/svg";
const W = 520, H = 110, X0 = D.e_min + 20, X1 = D.e_max + 1;
const COLOURS = {activation_gradient: "#2f5bd3", weight_gradient: "#8e4ec6", activation: "#6b7280"};
function el(tag, attrs, parent) {
  const e = document.createElementNS(NS, tag);
  for (const k in attrs) e.setAttribute(k, attrs[k]);
  if (parent) parent.appendChild(e);
  return e;
}
function nonzero(t) { return t.counts.reduce((a, b) => a + b, 0); }
function below(t, exp, k) {
  const n = nonzero(t); if (!n) return 0;
  let s = 0;
  t.counts.forEach((c, i) => { if (D.e_min + i + 1 + k <= exp) s += c; });
  return s / n;
}
function over(t, k) {
  const n = nonzero(t); if (!n) return 0;
  let s = 0;
  t.counts.forEach((c, i) => { if (D.e_min + i + k >= D.limits.overflow) s += c; });
  return s / n;
}
// As ranges.format_pct: two decimals below 1%, so 0.12% never reads "0.1%" next to "<0.1%".
function pct(x) { return x === 0 ? "0%" : x < 0.0001 ? "<0.01%"
  : x < 0.01 ? (100 * x).toFixed(2) + "%" : (100 * x).toFixed(1) + "%"; }
function merge(list, name) {
  const m = {name: name, counts: new Array(D.e_max - D.e_min + 1).fill(0), max_abs: 0};
  for (const t of list) { t.counts.forEach((c, i) => { m.counts[i] += c; });
    m.max_abs = Math.max(m.max_abs, t.max_abs); }
  return m;
}
function sx(e) { return 30 + (e - X0) / (X1 - X0) * (W - 40); }
function chart(t, kind, k, parent, height) {
  const h = height || H;
  const svg = el("svg", {width: W, height: h + 16, viewBox: "0 0 " + W + " " + (h + 16),
                         preserveAspectRatio: "none", "class": "hist", "data-k": k}, parent);
  for (const s of D.spans) {
    const a = Math.max(s[2], X0), b = Math.min(s[3], X1);
    el("rect", {x: sx(a), y: 0, width: sx(b) - sx(a), height: h, fill: s[4],
                "fill-opacity": 0.15, "class": "span " + s[0]}, svg);
  }
  const n = nonzero(t) || 1;
  const peak = Math.max(...t.counts) / n || 1;
  t.counts.forEach((c, i) => {
    if (!c) return;
    const e = D.e_min + i + k;
    if (e + 1 <= X0 || e >= X1) return;
    const bh = (c / n) / peak * (h - 4);
    el("rect", {x: sx(e), y: h - bh, width: Math.max(1, sx(e + 1) - sx(e) - 0.5), height: bh,
                fill: COLOURS[kind], "class": "bar"}, svg);
  });
  for (const e of [D.limits.zero, D.limits.normal, D.limits.overflow]) {
    el("line", {x1: sx(e), x2: sx(e), y1: 0, y2: h, stroke: "#333",
                "stroke-dasharray": "3 2"}, svg);
  }
  for (let e = -40; e <= 20; e += 10) {
    const tx = el("text", {x: sx(e) - 8, y: h + 12}, svg); tx.textContent = "2^" + e;
  }
  return svg;
}
function render(k) {
  document.getElementById("scalelabel").textContent = "2^" + k + " (" + Math.pow(2, k) + ")";
  const panels = document.getElementById("panels");
  panels.textContent = "";
  const lost = [];
  for (const kind of ["activation_gradient", "weight_gradient", "activation"]) {
    const list = D.tensors.filter(t => t.kind === kind);
    if (!list.length) continue;
    const grad = kind !== "activation";
    const kk = grad ? k : 0;
    const panel = document.createElement("div");
    panel.className = "panel"; panel.dataset.kind = kind;
    const h2 = document.createElement("h2");
    h2.textContent = D.labels[kind] + (grad ? " at loss scale 2^" + k : " (not scaled)");
    panel.appendChild(h2);
    const all = merge(list, "all");
    if (grad) {  // per tensor, with the report's one threshold (as its recommendation)
      const counted = list.filter(t => nonzero(t) && !(t.name in D.not_counted));
      const losing = counted.filter(t => below(t, D.limits.zero, k) > D.negligible_share);
      lost.push(D.labels[kind] + ": " + losing.length + " of " + counted.length +
                " lose more than " + pct(D.negligible_share));
    }
    chart(all, kind, kk, panel, 130);
    const table = document.createElement("table");
    const head = grad ? ["tensor", "histogram", "lost at 1", "lost at 2^" + k,
                         "subnormal at 2^" + k, "overflow at 2^" + k, "max |g|"]
                      : ["tensor", "histogram", "lost (<2^-24)", "overflow (>65504)", "max |x|"];
    const tr = document.createElement("tr");
    head.forEach((h, i) => { const th = document.createElement("th");
      th.textContent = h; if (i === 0) th.className = "name"; tr.appendChild(th); });
    table.appendChild(tr);
    for (const t of list) {
      const row = document.createElement("tr"); row.dataset.name = t.name;
      const top = t.max_abs.toPrecision(3);
      const cells = grad ? [pct(below(t, D.limits.zero, 0)), pct(below(t, D.limits.zero, k)),
                            pct(below(t, D.limits.normal, k)), pct(over(t, k)), top]
                         : [pct(below(t, D.limits.zero, 0)), pct(over(t, 0)), top];
      const name = document.createElement("td"); name.className = "name";
      name.textContent = t.name + (t.name in D.not_counted ? " *" : "");
      if (t.name in D.not_counted) name.title = "not counted: " + D.not_counted[t.name];
      row.appendChild(name);
      const hc = document.createElement("td"); row.appendChild(hc);
      chart(t, kind, kk, hc, 28).setAttribute("width", 260);
      cells.forEach((c, i) => { const td = document.createElement("td"); td.textContent = c;
        const lostNow = grad && i === 1 && below(t, D.limits.zero, k) > D.negligible_share;
        if (lostNow || (i === (grad ? 3 : 1) && c !== "0%"))
          td.className = "bad";
        td.dataset.col = head[i + 2]; row.appendChild(td); });
      table.appendChild(row);
    }
    panel.appendChild(table);
    panels.appendChild(panel);
  }
  document.getElementById("lost").textContent = lost.join(", ");
  const st = document.getElementById("status");
  st.dataset.state = "ok"; st.dataset.k = k;
  st.dataset.bars = document.querySelectorAll("rect.bar").length;
}
try {
  document.getElementById("model").textContent = D.model + ", " + D.steps + " step(s)";
  document.getElementById("rec").textContent = "Recommendation: " + D.recommendation;
  document.getElementById("summary").textContent = D.summary;
  const legend = document.getElementById("legend");
  for (const s of D.spans) { const sp = document.createElement("span");
    const i = document.createElement("i"); i.style.background = s[4]; i.style.opacity = 0.5;
    sp.appendChild(i); sp.appendChild(document.createTextNode(s[1])); legend.appendChild(sp); }
  const slider = document.getElementById("scale");
  slider.max = D.limits.max_k;
  const start = Math.round(Math.log2(D.after_scale));
  const m = /k=(\d+)/.exec(location.hash);
  slider.value = m ? m[1] : start;
  slider.addEventListener("input", () => render(+slider.value));
  render(+slider.value);
} catch (err) {
  const e = document.getElementById("error"); e.hidden = false; e.textContent = String(err);
  document.getElementById("status").dataset.state = "error";
}
})();
</script>
</body></html>
"""
