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
