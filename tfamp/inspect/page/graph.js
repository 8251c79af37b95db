(function () {
'use strict';

var NODE_W = 156, NODE_H = 38, CAST_W = 46, CAST_H = 18, IO_W = 150, IO_H = 22;
var GROUP_W = 184, GROUP_H = 52, PAD = 12, HEAD = 24, ROW_GAP = 34, COL_GAP = 16;
var DUMMY_W = 2, BUDGET = 150, MAX_DUMMIES = 12000, OPEN_PANELS = 12, MAX_ROW_W = 2400;

var D, S, CATS, CAT = {}, bodies = [], bodyByName = {}, selected = null;
var matchList = [], matchPos = -1, filterKey = null, filterStyle = null, drag = null;

function $(id) { return document.getElementById(id); }

function fail(message) {
  var box = $('error');
  box.hidden = false;
  box.textContent = 'tfamp report: the page failed to render: ' + message;
  var status = $('status');
  status.textContent = 'Error: ' + message;
  status.setAttribute('data-state', 'error');
}

window.addEventListener('error', function (ev) {
  fail((ev.message || 'script error') + (ev.lineno ? ' (line ' + ev.lineno + ')' : ''));
});

function esc(text) {
  return String(text).replace(/&/g, '&amp;').replace(/</g, '&lt;').replace(/>/g, '&gt;')
    .replace(/"/g, '&quot;');
}

function clip(text, max) {
  return text.length > max ? text.slice(0, max - 1) + '\u2026' : text;
}

function lastPart(name) {
  var i = name.lastIndexOf('/');
  return i < 0 || i === name.length - 1 ? name : name.slice(i + 1);
}

function plural(count, word) { return count + ' ' + word + (count === 1 ? '' : 's'); }

function fmt(v) { return Math.round(v * 10) / 10; }

function el(tag, cls, text) {
  var e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined && text !== null) e.textContent = text;
  return e;
}

function shortType(dtype) {
  return {float16: 'f16', bfloat16: 'bf16', float32: 'f32'}[dtype] || dtype;
}

/* ---------------------------------------------------------------- layout */

/* Layered layout of items with sizes w[i] x h[i] and edges [[a, b]], top to bottom.
   Returns top-left x, y per item, the size, and for long edges the points of
   their dummy nodes ({pts: [[x, top, bottom]], rev}). Items without edges are
   laid out in a grid below. */
function layered(w, h, edges) {
  var m = w.length, i, j, k, L, v, it;
  var res = {x: new Float64Array(m), y: new Float64Array(m), routes: new Array(edges.length),
    width: 0, height: 0};
  if (!m) return res;
  var deg = new Int32Array(m), outE = [];
  for (i = 0; i < m; i++) outE.push([]);
  for (k = 0; k < edges.length; k++) {
    deg[edges[k][0]]++; deg[edges[k][1]]++; outE[edges[k][0]].push(k);
  }
  // Break cycles: reverse the back edges of a depth-first search.
  var rev = new Uint8Array(edges.length), state = new Uint8Array(m);
  for (i = 0; i < m; i++) {
    if (state[i]) continue;
    var stack = [i], ptr = [0];
    state[i] = 1;
    while (stack.length) {
      v = stack[stack.length - 1];
      var p = ptr[ptr.length - 1];
      if (p < outE[v].length) {
        ptr[ptr.length - 1]++;
        var ek = outE[v][p], t = edges[ek][1];
        if (state[t] === 1) rev[ek] = 1;
        else if (!state[t]) { state[t] = 1; stack.push(t); ptr.push(0); }
      } else {
        state[v] = 2; stack.pop(); ptr.pop();
      }
    }
  }
  var src = new Int32Array(edges.length), dst = new Int32Array(edges.length);
  var outs = [], ins = [];
  for (i = 0; i < m; i++) { outs.push([]); ins.push([]); }
  for (k = 0; k < edges.length; k++) {
    src[k] = rev[k] ? edges[k][1] : edges[k][0];
    dst[k] = rev[k] ? edges[k][0] : edges[k][1];
    outs[src[k]].push(k); ins[dst[k]].push(k);
  }
  // Longest-path layers, then sources (constants, variables) next to their first use.
  var indeg = new Int32Array(m), order = [], layer = new Int32Array(m);
  for (k = 0; k < edges.length; k++) indeg[dst[k]]++;
  for (i = 0; i < m; i++) if (!indeg[i]) order.push(i);
  for (j = 0; j < order.length; j++) {
    v = order[j];
    for (k = 0; k < outs[v].length; k++) {
      var tk = dst[outs[v][k]];
      if (layer[tk] < layer[v] + 1) layer[tk] = layer[v] + 1;
      if (--indeg[tk] === 0) order.push(tk);
    }
  }
  for (j = 0; j < order.length; j++) {
    v = order[j];
    if (ins[v].length || !outs[v].length) continue;
    var lo = Infinity;
    for (k = 0; k < outs[v].length; k++) lo = Math.min(lo, layer[dst[outs[v][k]]]);
    layer[v] = lo - 1;
  }
  // Wide layers (many independent nodes) wrap onto several rows.
  var rank = new Int32Array(m), byLayer = [], top = 0;
  for (j = 0; j < order.length; j++) rank[order[j]] = j;
  for (i = 0; i < m; i++) {
    if (!deg[i]) continue;
    top = Math.max(top, layer[i]);
    (byLayer[layer[i]] = byLayer[layer[i]] || []).push(i);
  }
  var shift = 0;
  for (L = 0; L <= top; L++) {
    var members = byLayer[L] || [], rowW = 0, sub = 0;
    var key = members.map(function (x) {
      var s = 0;
      ins[x].forEach(function (q) { s += rank[src[q]]; });
      return ins[x].length ? s / ins[x].length : rank[x];
    });
    var idx = members.map(function (x, q) { return q; });
    idx.sort(function (a1, a2) {
      return key[a1] - key[a2] || rank[members[a1]] - rank[members[a2]];
    });
    idx.forEach(function (q) {
      var x = members[q];
      if (rowW > 0 && rowW + w[x] > MAX_ROW_W) { sub++; rowW = 0; }
      layer[x] = L + shift + sub;
      rowW += w[x] + COL_GAP;
    });
    shift += sub;
  }
  // Dummy nodes on long edges, so they route between the nodes of the rows they cross.
  var span = 0;
  for (k = 0; k < edges.length; k++) span += Math.max(0, layer[dst[k]] - layer[src[k]] - 1);
  var useDummies = span <= MAX_DUMMIES;
  var nodeW = Array.prototype.slice.call(w), nodeL = Array.prototype.slice.call(layer);
  var total = m, chains = new Array(edges.length), links = [];
  for (k = 0; k < edges.length; k++) {
    var chain = [], prev = src[k];
    if (useDummies) {
      for (L = layer[src[k]] + 1; L < layer[dst[k]]; L++) {
        chain.push(total); nodeW.push(DUMMY_W); nodeL.push(L); total++;
      }
    }
    chains[k] = chain;
    for (j = 0; j < chain.length; j++) { links.push([prev, chain[j]]); prev = chain[j]; }
    links.push([prev, dst[k]]);
  }
  var up = [], down = [];
  for (i = 0; i < total; i++) { up.push([]); down.push([]); }
  for (k = 0; k < links.length; k++) {
    down[links[k][0]].push(links[k][1]); up[links[k][1]].push(links[k][0]);
  }
  var maxL = -1;
  for (i = 0; i < total; i++) if ((i >= m || deg[i]) && nodeL[i] > maxL) maxL = nodeL[i];
  var rows = [];
  for (L = 0; L <= maxL; L++) rows.push([]);
  // Initial order within rows: depth-first from the sources.
  var seen = new Uint8Array(total);
  function visit(s) {
    var st = [s];
    while (st.length) {
      var x = st.pop();
      if (seen[x]) continue;
      seen[x] = 1;
      rows[nodeL[x]].push(x);
      for (var q = down[x].length - 1; q >= 0; q--) if (!seen[down[x][q]]) st.push(down[x][q]);
    }
  }
  for (j = 0; j < order.length; j++) if (deg[order[j]] && !up[order[j]].length) visit(order[j]);
  for (i = 0; i < m; i++) if (deg[i] && !seen[i]) visit(i);
  for (i = m; i < total; i++) if (!seen[i]) visit(i);
  // Fewer crossings: a few barycenter sweeps down and up.
  var pos = new Float64Array(total);
  function reindex(r) { for (var q = 0; q < r.length; q++) pos[r[q]] = q; }
  rows.forEach(reindex);
  function sweep(r, nb) {
    var keyed = r.map(function (x) {
      var a = nb[x];
      if (!a.length) return [pos[x], x];
      var s = 0;
      for (var q = 0; q < a.length; q++) s += pos[a[q]];
      return [s / a.length, x];
    });
    keyed.sort(function (p1, p2) { return p1[0] - p2[0] || pos[p1[1]] - pos[p2[1]]; });
    for (var q = 0; q < r.length; q++) r[q] = keyed[q][1];
    reindex(r);
  }
  for (it = 0; it < 4; it++) {
    for (L = 1; L <= maxL; L++) sweep(rows[L], up);
    for (L = maxL - 1; L >= 0; L--) sweep(rows[L], down);
  }
  // Rows' heights and tops.
  var rowH = [], rowY = [], y0 = 0;
  for (L = 0; L <= maxL; L++) {
    var hh = 0;
    for (j = 0; j < rows[L].length; j++) if (rows[L][j] < m) hh = Math.max(hh, h[rows[L][j]]);
    rowH.push(hh); rowY.push(y0); y0 += hh + ROW_GAP;
  }
  // x: each row placed as close as possible to the mean of its neighbours, keeping
  // its order (isotonic regression by pool-adjacent-violators).
  var cx = new Float64Array(total);
  function gap(a, b) { return a >= m || b >= m ? 8 : COL_GAP; }
  rows.forEach(function (r) {
    var x = 0;
    for (var q = 0; q < r.length; q++) {
      cx[r[q]] = x + nodeW[r[q]] / 2;
      x += nodeW[r[q]] + (q + 1 < r.length ? gap(r[q], r[q + 1]) : 0);
    }
  });
  function placeRow(r, nb1, nb2) {
    var n = r.length;
    if (!n) return;
    var off = new Float64Array(n), tg = new Float64Array(n), wt = new Float64Array(n), q, u;
    for (q = 0; q < n; q++) {
      var x = r[q];
      if (q) off[q] = off[q - 1] + (nodeW[r[q - 1]] + nodeW[x]) / 2 + gap(r[q - 1], x);
      var s = 0, c = 0;
      for (u = 0; u < nb1[x].length; u++) { s += cx[nb1[x][u]]; c++; }
      if (nb2) for (u = 0; u < nb2[x].length; u++) { s += cx[nb2[x][u]]; c++; }
      wt[q] = c ? c * (x >= m ? 2 : 1) : 0.02;
      tg[q] = (c ? s / c : cx[x]) - off[q];
    }
    var bs = [], bw = [], bn = [];
    for (q = 0; q < n; q++) {
      bs.push(wt[q] * tg[q]); bw.push(wt[q]); bn.push(1);
      while (bs.length > 1 &&
             bs[bs.length - 2] / bw[bw.length - 2] > bs[bs.length - 1] / bw[bw.length - 1]) {
        var s1 = bs.pop(), w1 = bw.pop(), n1 = bn.pop();
        bs[bs.length - 1] += s1; bw[bw.length - 1] += w1; bn[bn.length - 1] += n1;
      }
    }
    var at = 0;
    for (var b = 0; b < bs.length; b++) {
      var z = bs[b] / bw[b];
      for (q = 0; q < bn[b]; q++, at++) cx[r[at]] = z + off[at];
    }
  }
  for (it = 0; it < 5; it++) {
    for (L = 1; L <= maxL; L++) placeRow(rows[L], up);
    for (L = maxL - 1; L >= 0; L--) placeRow(rows[L], down);
  }
  for (L = 0; L <= maxL; L++) placeRow(rows[L], up, down);
  var minX = Infinity, maxX = -Infinity;
  rows.forEach(function (r) {
    r.forEach(function (x) {
      minX = Math.min(minX, cx[x] - nodeW[x] / 2); maxX = Math.max(maxX, cx[x] + nodeW[x] / 2);
    });
  });
  if (!isFinite(minX)) { minX = 0; maxX = 0; }
  for (L = 0; L <= maxL; L++) {
    rows[L].forEach(function (x) {
      if (x >= m) return;
      res.x[x] = cx[x] - w[x] / 2 - minX;
      res.y[x] = rowY[L] + (rowH[L] - h[x]) / 2;
    });
  }
  for (k = 0; k < edges.length; k++) {
    if (chains[k].length || rev[k]) {
      res.routes[k] = {rev: !!rev[k], pts: chains[k].map(function (d) {
        return [cx[d] - minX, rowY[nodeL[d]], rowY[nodeL[d]] + rowH[nodeL[d]]];
      })};
    }
  }
  var width = maxX - minX, height = maxL >= 0 ? y0 - ROW_GAP : 0;
  // Items without edges at this level: a grid underneath.
  var iso = [];
  for (i = 0; i < m; i++) if (!deg[i]) iso.push(i);
  if (iso.length) {
    var cw = 0;
    iso.forEach(function (x) { cw = Math.max(cw, w[x]); });
    var cols = Math.max(1, Math.min(iso.length,
      Math.floor((Math.max(width, 1100) + COL_GAP) / (cw + COL_GAP))));
    var gy = maxL >= 0 ? height + ROW_GAP : 0;
    for (j = 0; j < iso.length; j += cols) {
      var line = iso.slice(j, j + cols), lh = 0;
      line.forEach(function (x) { lh = Math.max(lh, h[x]); });
      line.forEach(function (x, q) {
        res.x[x] = q * (cw + COL_GAP) + (cw - w[x]) / 2;
        res.y[x] = gy + (lh - h[x]) / 2;
      });
      gy += lh + COL_GAP;
    }
    width = Math.max(width, cols * (cw + COL_GAP) - COL_GAP);
    height = gy - COL_GAP;
  }
  res.width = width; res.height = height;
  return res;
}

/* ------------------------------------------------------------------ bodies */

function Body(raw, index) {
  var self = this, n = raw.items.length, G = raw.groups.length + 1, i, g, p;
  this.index = index; this.name = raw.name; this.shown = raw.shown || raw.name;
  this.items = raw.items; this.n = n; this.G = G;
  var total = this.total = n + G;
  this.label = ['']; this.full = ['']; this.part = [0];
  var parent = this.parent = new Int32Array(total);
  for (i = 0; i < n; i++) parent[i] = n + raw.member[i] + 1;
  parent[n] = -1;
  raw.groups.forEach(function (gr, k) {
    self.label.push(gr[0]); self.full.push(gr[2]); self.part.push(gr[3]);
    parent[n + k + 1] = n + gr[1] + 1;
  });
  var depth = this.depth = new Int32Array(total);
  for (g = 1; g < G; g++) depth[n + g] = depth[parent[n + g]] + 1;
  for (i = 0; i < n; i++) depth[i] = depth[parent[i]] + 1;
  var kids = this.kids = [];
  for (g = 0; g < G; g++) kids.push([]);
  for (g = 1; g < G; g++) kids[parent[n + g] - n].push(n + g);
  for (i = 0; i < n; i++) kids[parent[i] - n].push(i);
  var nc = CATS.length;
  this.count = new Int32Array(G); this.casts = new Int32Array(G);
  this.cats = new Int32Array(G * nc);
  this.byName = {}; this.lower = [];
  this.catTotals = new Int32Array(nc);
  for (i = 0; i < n; i++) {
    var it = this.items[i], c = it[2];
    this.catTotals[c]++;
    if (it[1] === 0) this.byName[it[0]] = i;
    this.lower.push(it[0].toLowerCase());
    for (p = parent[i]; p >= 0; p = parent[p]) {
      this.count[p - n]++; this.cats[(p - n) * nc + c]++;
      if (it[1] === 1) this.casts[p - n]++;
    }
  }
  var E = raw.edges, ne = E.length / 2;
  this.ne = ne;
  this.eSrc = new Int32Array(ne); this.eDst = new Int32Array(ne);
  this.eCont = new Int32Array(ne); this.eA = new Int32Array(ne); this.eB = new Int32Array(ne);
  this.e16 = new Uint8Array(ne);
  this.preds = []; this.succs = []; this.levelList = [];
  for (i = 0; i < n; i++) { this.preds.push([]); this.succs.push([]); }
  var levelKey = [];
  for (g = 0; g < G; g++) { this.levelList.push([]); levelKey.push(new Map()); }
  var k16src = {f16: 1, cast16: 1}, k16dst = {f16: 1, cast32: 1};
  for (var k = 0; k < ne; k++) {
    var u = E[2 * k], v = E[2 * k + 1], a = u, b = v;
    this.eSrc[k] = u; this.eDst[k] = v;
    this.preds[v].push(u); this.succs[u].push(v);
    this.e16[k] = k16src[CATS[this.items[u][2]][0]] && k16dst[CATS[this.items[v][2]][0]] ? 1 : 0;
    while (parent[a] !== parent[b]) {
      if (depth[a] >= depth[b]) a = parent[a]; else b = parent[b];
    }
    if (a === b) { this.eCont[k] = -1; continue; }
    var cg = parent[a] - n, key = a * total + b;
    if (!levelKey[cg].has(key)) { levelKey[cg].set(key, 1); this.levelList[cg].push([a, b]); }
    this.eCont[k] = cg; this.eA[k] = a; this.eB[k] = b;
  }
  this.expanded = new Uint8Array(G);
  this.match = new Uint8Array(n);
  this.scale = 0; this.rendered = false; this.open = true;
  this.callers = [];
}

Body.prototype.setDefault = function () {
  var ex = this.expanded, n = this.n, kids = this.kids;
  ex.fill(0); ex[0] = 1;
  var visible = kids[0].length, queue = [];
  function push(g) { kids[g].forEach(function (id) { if (id >= n) queue.push(id - n); }); }
  push(0);
  for (var q = 0; q < queue.length; q++) {
    var g = queue[q], extra = kids[g].length - 1;
    if (visible + extra <= BUDGET) { ex[g] = 1; visible += extra; push(g); }
  }
};

Body.prototype.computeHidden = function () {
  var n = this.n, parent = this.parent, ex = this.expanded;
  var hid = this.hid = new Int32Array(this.total).fill(-1);
  function set(id) {
    var p = parent[id];
    hid[id] = hid[p] >= 0 ? hid[p] : (ex[p - n] ? -1 : p);
  }
  for (var g = 1; g < this.G; g++) set(n + g);
  for (var i = 0; i < n; i++) set(i);
};

Body.prototype.rep = function (id) { return this.hid[id] >= 0 ? this.hid[id] : id; };

Body.prototype.itemSize = function (id) {
  if (id >= this.n) return [GROUP_W, GROUP_H];
  var kind = this.items[id][1];
  if (kind === 0) return [NODE_W, NODE_H];
  if (kind === 1) return [CAST_W, CAST_H];
  return [IO_W, IO_H];
};

Body.prototype.layout = function () {
  var self = this, n = this.n, total = this.total;
  var X = this.X = new Float64Array(total), Y = this.Y = new Float64Array(total);
  var W = this.W = new Float64Array(total), H = this.H = new Float64Array(total);
  this.routes = []; this.origin = [];
  function lay(g) {
    var ids = self.kids[g], w = [], h = [], local = new Map();
    ids.forEach(function (id, q) {
      local.set(id, q);
      if (id >= n && self.expanded[id - n]) {
        var s = lay(id - n);
        W[id] = Math.max(s[0] + 2 * PAD, 110 + 6.5 * self.label[id - n].length);
        H[id] = s[1] + HEAD + PAD;
      } else {
        var z = self.itemSize(id);
        W[id] = z[0]; H[id] = z[1];
      }
      w.push(W[id]); h.push(H[id]);
    });
    var list = self.levelList[g];
    var res = layered(w, h, list.map(function (e) { return [local.get(e[0]), local.get(e[1])]; }));
    ids.forEach(function (id, q) { X[id] = res.x[q]; Y[id] = res.y[q]; });
    var routes = new Map();
    list.forEach(function (e, q) {
      if (res.routes[q]) routes.set(e[0] * total + e[1], res.routes[q]);
    });
    self.routes[g] = routes;
    return [res.width, res.height];
  }
  function place(g, ox, oy) {
    self.origin[g] = [ox, oy];
    self.kids[g].forEach(function (id) {
      X[id] += ox; Y[id] += oy;
      if (id >= n && self.expanded[id - n]) place(id - n, X[id] + PAD, Y[id] + HEAD);
    });
  }
  var size = lay(0);
  place(0, PAD, PAD);
  this.width = size[0] + 2 * PAD; this.height = size[1] + 2 * PAD;
};

Body.prototype.groupHasMatch = function () {
  var n = this.n, has = new Uint8Array(this.G);
  for (var i = 0; i < n; i++) {
    if (!this.match[i]) continue;
    for (var p = this.parent[i]; p > n && !has[p - n]; p = this.parent[p]) has[p - n] = 1;
  }
  return has;
};

Body.prototype.nodeMarkup = function (id) {
  var it = this.items[id], kind = it[1], cat = CATS[it[2]], w = this.W[id], h = this.H[id];
  var cls = 'n c-' + cat[0] + (kind === 1 ? ' cast' : kind > 1 ? ' io' : '') +
    (this.match[id] ? ' match' : '') + (isSelected(this, id) ? ' sel' : '');
  var tip = it[0] + '\n' + (kind === 0 ? S[it[3]] + ': ' + shortNames(S[it[5]]) : S[it[5]]);
  var s = '<g class="' + cls + '" data-node="' + id + '" transform="translate(' +
    fmt(this.X[id]) + ',' + fmt(this.Y[id]) + ')"><title>' + esc(tip) + '</title>';
  if (kind === 0) {
    var badge = cat[0] === 'f16' ? shortType(D.dtype) : cat[0] === 'nofloat' ||
      cat[0] === 'unknown' ? '' : 'f32';
    s += '<rect class="b" width="' + w + '" height="' + h + '" rx="5" fill="' + cat[2] + '"/>' +
      '<text class="op" x="8" y="15" fill="' + cat[3] + '">' + esc(clip(S[it[3]], 18)) +
      '</text><text class="nm" x="8" y="30" fill="' + cat[3] + '">' +
      esc(clip(lastPart(it[0]), 25)) + '</text>';
    if (badge) {
      s += '<text class="bd" x="' + (w - 6) + '" y="13" text-anchor="end" fill="' + cat[3] +
        '">' + badge + '</text>';
    }
  } else if (kind === 1) {
    s += '<rect class="b" width="' + w + '" height="' + h + '" rx="9" fill="' + cat[2] + '"/>' +
      '<text x="' + w / 2 + '" y="12.5" text-anchor="middle">\u2192' +
      esc(shortType(it[7][2])) + '</text>';
  } else {
    s += '<rect class="b" width="' + w + '" height="' + h + '" rx="11" fill="#fff"/>' +
      '<text x="' + w / 2 + '" y="14.5" text-anchor="middle">' +
      esc((kind === 2 ? 'in: ' : 'out: ') + clip(it[0], 21)) + '</text>';
  }
  return s + '</g>';
};

Body.prototype.groupName = function (g) {
  return this.full[g] + '/' + (this.part[g] ? ' ' + this.label[g] : '');
};

Body.prototype.shortLabel = function (g, max) {
  return this.part[g] ? clip(this.label[g], max + 1) : clip(this.label[g], max - 1) + '/';
};

Body.prototype.groupMarkup = function (id, match) {
  var g = id - this.n, w = this.W[id], h = this.H[id], nc = CATS.length, total = this.count[g];
  var casts = this.casts[g], ops = total - casts, conv = this.cats[g * nc + CAT.f16];
  var line = plural(ops, 'op') + (conv ? ', ' + conv + ' \u2192 ' + shortType(D.dtype) : '') +
    (casts ? ', ' + plural(casts, 'cast') : '');
  var s = '<g class="grp' + (match ? ' match' : '') + '" data-group="' + id +
    '" transform="translate(' + fmt(this.X[id]) + ',' + fmt(this.Y[id]) + ')"><title>' +
    esc(this.groupName(g) + '\n' + line + '\nclick to expand') + '</title>' +
    '<rect class="gs" x="4" y="4" width="' + w + '" height="' + h + '" rx="7"/>' +
    '<rect class="gb" width="' + w + '" height="' + h + '" rx="7"/>' +
    '<text class="gl" x="9" y="17">' + esc('\u25B8 ' + this.shortLabel(g, 25)) +
    '</text><text class="gc" x="9" y="31">' + esc(line) + '</text>';
  var x = 9, bw = w - 18;
  for (var c = 0; c < nc; c++) {
    var k = this.cats[g * nc + c];
    if (!k) continue;
    var sw = bw * k / total;
    s += '<rect x="' + fmt(x) + '" y="' + (h - 14) + '" width="' + fmt(Math.max(sw, 0.5)) +
      '" height="7" fill="' + CATS[c][2] + '"/>';
    x += sw;
  }
  return s + '<rect x="9" y="' + (h - 14) + '" width="' + fmt(bw) +
    '" height="7" fill="none" stroke="rgba(0,0,0,.25)"/></g>';
};

Body.prototype.frameMarkup = function (id) {
  var g = id - this.n, x = fmt(this.X[id]), y = fmt(this.Y[id]), w = fmt(this.W[id]);
  return '<g class="gf"><rect class="gfr" x="' + x + '" y="' + y + '" width="' + w +
    '" height="' + fmt(this.H[id]) + '" rx="8"/><g class="gh" data-ghead="' + id +
    '"><title>' + esc(this.groupName(g) + ' - click to collapse') + '</title><rect x="' + x +
    '" y="' + y + '" width="' + w + '" height="' + (HEAD - 4) + '" rx="8"/><text x="' +
    (this.X[id] + 9) + '" y="' + (this.Y[id] + 14) + '">' +
    esc('\u25BE ' + this.shortLabel(g, 200) + '   (' + this.count[g] + ')') + '</text></g></g>';
};

function edgePath(x1, y1, x2, y2, route, ox, oy) {
  var pts = [[x1, y1, 0]];
  if (route) {
    var list = route.rev ? route.pts.slice().reverse() : route.pts;
    list.forEach(function (p) {
      var a = route.rev ? p[2] : p[1], b = route.rev ? p[1] : p[2];
      pts.push([p[0] + ox, a + oy, 0]); pts.push([p[0] + ox, b + oy, 1]);
    });
  }
  pts.push([x2, y2, 0]);
  var d = 'M' + fmt(x1) + ',' + fmt(y1);
  for (var i = 1; i < pts.length; i++) {
    var a0 = pts[i - 1], b0 = pts[i];
    if (b0[2]) { d += 'L' + fmt(b0[0]) + ',' + fmt(b0[1]); continue; }
    var dy = Math.max(18, Math.abs(b0[1] - a0[1]) / 2);
    d += 'C' + fmt(a0[0]) + ',' + fmt(a0[1] + dy) + ' ' + fmt(b0[0]) + ',' + fmt(b0[1] - dy) +
      ' ' + fmt(b0[0]) + ',' + fmt(b0[1]);
  }
  return d;
}

Body.prototype.render = function () {
  var n = this.n, total = this.total, out = [], k, g, i;
  this.computeHidden();
  this.layout();
  var hasMatch = this.groupHasMatch();
  for (g = 1; g < this.G; g++) {
    if (this.hid[n + g] < 0 && this.expanded[g]) out.push(this.frameMarkup(n + g));
  }
  var seen = new Map();
  for (k = 0; k < this.ne; k++) {
    if (this.eCont[k] < 0) continue;
    var ru = this.rep(this.eSrc[k]), rv = this.rep(this.eDst[k]);
    if (ru === rv) continue;
    var key = ru * total + rv, ent = seen.get(key);
    if (ent) { ent.count++; ent.h16 = ent.h16 && this.e16[k]; continue; }
    seen.set(key, {ru: ru, rv: rv, k: k, count: 1, h16: this.e16[k]});
  }
  var self = this;
  seen.forEach(function (e) {
    var cont = self.eCont[e.k], route = self.routes[cont].get(self.eA[e.k] * total + self.eB[e.k]);
    var o = self.origin[cont];
    var d = edgePath(self.X[e.ru] + self.W[e.ru] / 2, self.Y[e.ru] + self.H[e.ru],
      self.X[e.rv] + self.W[e.rv] / 2, self.Y[e.rv], route, o[0], o[1]);
    var sw = e.count > 1 ? ' style="stroke-width:' +
      fmt(Math.min(1.2 + Math.log(e.count) / Math.LN2 * 0.7, 5)) + '"' : '';
    out.push('<path class="e' + (e.h16 ? ' h16' : '') + '" data-f="' + e.ru + '" data-t="' +
      e.rv + '" d="' + d + '"' + sw + '/>');
  });
  var drawn = 0;
  for (i = 0; i < n; i++) {
    if (this.hid[i] < 0) { out.push(this.nodeMarkup(i)); drawn++; }
  }
  for (g = 1; g < this.G; g++) {
    if (this.hid[n + g] < 0 && !this.expanded[g]) out.push(this.groupMarkup(n + g, hasMatch[g]));
  }
  this.drawn = drawn;
  if (!this.scale) {
    var avail = Math.max(300, this.canvas.clientWidth - 4);
    this.scale = Math.max(0.8, Math.min(1, avail / this.width));
  }
  this.svg.setAttribute('viewBox', '0 0 ' + fmt(this.width) + ' ' + fmt(this.height));
  this.applyScale();
  this.svg.innerHTML = out.join('');
  if (!this.rendered) this.scrollToStart();
  this.rendered = true;
  if (selected && selected.body === this) highlightEdges(this, selected.id);
};

/* Shows the top of the drawing: scrolls right to where its first rows start. */
Body.prototype.scrollToStart = function () {
  var c = this.canvas, limit = c.clientHeight / this.scale, left = Infinity;
  for (var id = 0; id < this.total; id++) {
    var visible = id < this.n ? this.hid[id] < 0 : id > this.n && this.hid[id] < 0 &&
      !this.expanded[id - this.n];
    if (visible && this.Y[id] < limit) left = Math.min(left, this.X[id]);
  }
  c.scrollTop = 0;
  c.scrollLeft = isFinite(left) ? Math.max(0, left * this.scale - 16) : 0;
};

Body.prototype.applyScale = function () {
  this.svg.setAttribute('width', fmt(this.width * this.scale));
  this.svg.setAttribute('height', fmt(this.height * this.scale));
};

Body.prototype.zoom = function (factor, px, py) {
  var c = this.canvas;
  if (px === undefined) { px = c.clientWidth / 2; py = c.clientHeight / 2; }
  var gx = (c.scrollLeft + px) / this.scale, gy = (c.scrollTop + py) / this.scale;
  this.scale = Math.max(0.05, Math.min(3, this.scale * factor));
  this.applyScale();
  c.scrollLeft = gx * this.scale - px; c.scrollTop = gy * this.scale - py;
};

Body.prototype.fit = function () {
  var c = this.canvas, maxH = window.innerHeight * 0.74;
  this.scale = Math.max(0.05, Math.min(1, (c.clientWidth - 4) / this.width,
    (maxH - 4) / this.height));
  this.applyScale();
};

Body.prototype.centerOn = function (id) {
  var c = this.canvas;
  c.scrollLeft = (this.X[id] + this.W[id] / 2) * this.scale - c.clientWidth / 2;
  c.scrollTop = (this.Y[id] + this.H[id] / 2) * this.scale - c.clientHeight / 2;
};

Body.prototype.setOpen = function (open) {
  this.open = open;
  this.panel.classList.toggle('folded', !open);
  this.foldButton.textContent = open ? '\u25BE' : '\u25B8';
  if (open && !this.rendered) this.render();
};

Body.prototype.applyMatches = function () {
  if (!this.rendered) return;
  var self = this, has = this.groupHasMatch();
  this.svg.querySelectorAll('[data-node]').forEach(function (e) {
    e.classList.toggle('match', !!self.match[+e.getAttribute('data-node')]);
  });
  this.svg.querySelectorAll('[data-group]').forEach(function (e) {
    e.classList.toggle('match', !!has[+e.getAttribute('data-group') - self.n]);
  });
};

/* --------------------------------------------------------------- selection */

function isSelected(body, id) { return selected && selected.body === body && selected.id === id; }

function highlightEdges(body, id) {
  body.svg.querySelectorAll('path.e.hl').forEach(function (e) { e.classList.remove('hl'); });
  if (body.hid[id] >= 0) return;
  body.svg.querySelectorAll('path[data-f="' + id + '"],path[data-t="' + id + '"]')
    .forEach(function (e) { e.classList.add('hl'); });
}

function select(body, id) {
  if (selected && selected.body.rendered) {
    selected.body.svg.querySelectorAll('.n.sel').forEach(function (e) {
      e.classList.remove('sel');
    });
    selected.body.svg.querySelectorAll('path.e.hl').forEach(function (e) {
      e.classList.remove('hl');
    });
  }
  selected = {body: body, id: id};
  if (body.rendered) {
    var e = body.svg.querySelector('[data-node="' + id + '"]');
    if (e) e.classList.add('sel');
    highlightEdges(body, id);
  }
  showDetails(body, id);
}

function reveal(body, id) {
  var n = body.n, changed = false;
  for (var p = body.parent[id]; p > n; p = body.parent[p]) {
    if (!body.expanded[p - n]) { body.expanded[p - n] = 1; changed = true; }
  }
  if (!body.open) body.setOpen(true);
  if (changed || !body.rendered) body.render();
  select(body, id);
  body.panel.scrollIntoView({block: 'start'});
  body.centerOn(id);
  var e = body.svg.querySelector('[data-node="' + id + '"]');
  if (e) {
    e.classList.remove('flash');
    void e.getBoundingClientRect();
    e.classList.add('flash');
  }
}

function showPanel(body) {
  if (!body.open) body.setOpen(true);
  body.panel.scrollIntoView({block: 'start'});
}

/* ----------------------------------------------------------------- details */

function link(text, onclick) {
  var a = el('a', 'mono', text);
  a.href = '#';
  a.addEventListener('click', function (ev) { ev.preventDefault(); onclick(); });
  return a;
}

function nodeLink(body, id) {
  var it = body.items[id];
  var text = it[1] === 2 ? 'argument ' + it[0] : it[1] === 3 ? 'result ' + it[0] : it[0];
  return link(text, function () { reveal(body, id); });
}

// A reason names called functions in quotes: show them by their labels.
function shortNames(text) {
  return text.replace(/'([^']+)'/g, function (m, name) {
    var body = bodyByName[name];
    return body && body.shown !== name ? "'" + body.shown + "'" : m;
  });
}

function functionLink(name) {
  var body = bodyByName[name];
  if (!body) return el('span', 'mono', name);
  var a = link(body.shown || '(top graph)', function () { showPanel(body); });
  if (body.shown !== name) a.title = name;
  return a;
}

function nodeList(body, ids) {
  var ul = el('ul');
  ids.slice(0, 40).forEach(function (id) {
    var li = el('li');
    li.appendChild(nodeLink(body, id));
    ul.appendChild(li);
  });
  if (ids.length > 40) ul.appendChild(el('li', null, '\u2026 ' + (ids.length - 40) + ' more'));
  return ul;
}

function showDetails(body, id) {
  var box = $('details'), it = body.items[id], cat = CATS[it[2]], kind = it[1];
  box.textContent = '';
  box.appendChild(el('div', 'dname', it[0]));
  var table = el('table');
  function row(key, value) {
    var tr = el('tr'), v = el('td', 'v');
    tr.appendChild(el('td', 'k', key));
    if (typeof value === 'string') v.textContent = value; else v.appendChild(value);
    tr.appendChild(v);
    table.appendChild(tr);
  }
  row('Function', functionLink(body.name));
  if (kind === 0) {
    row('Op', S[it[3]]);
    row('List', S[it[4]] || '-');
    row('Decision', cat[0] === 'f16' ? 'converted: computes in ' + D.dtype :
      cat[0] === 'nofloat' ? 'unchanged: no float32 tensors' :
      cat[0] === 'unknown' ? 'not in the report' : 'stays float32');
    var chip = el('span');
    var swatch = el('span', 'chip');
    swatch.style.background = cat[2];
    chip.appendChild(swatch);
    chip.appendChild(document.createTextNode(cat[1]));
    row('Category', chip);
    row('Reason', shortNames(S[it[5]]));
    var cause = S[it[6]];
    row('Cause', !cause ? '-' : body.byName[cause] !== undefined ?
      nodeLink(body, body.byName[cause]) : el('span', 'mono', cause));
    if (it[7] && it[7].length) {
      var calls = el('div');
      it[7].forEach(function (f, q) {
        if (q) calls.appendChild(document.createTextNode(', '));
        calls.appendChild(functionLink(f));
      });
      row('Calls', calls);
    }
  } else if (kind === 1) {
    var info = it[7];
    row('Op', 'Cast inserted by tfamp');
    row('Converts', info[1] + ' \u2192 ' + info[2]);
    var srcName = info[0].split(':')[0];
    row('Reads', body.byName[srcName] !== undefined ?
      link(info[0], function () { reveal(body, body.byName[srcName]); }) :
      el('span', 'mono', info[0]));
    row('Feeds', el('span', 'mono', info[3].join(', ')));
  } else {
    row('Kind', kind === 2 ? 'function argument' : 'function result');
    row('Type', S[it[5]]);
  }
  if (body.preds[id].length) row('Inputs', nodeList(body, body.preds[id]));
  if (body.succs[id].length) row('Consumers', nodeList(body, body.succs[id]));
  box.appendChild(table);
}

function showGroupDetails(body, id) {
  var box = $('details'), g = id - body.n, nc = CATS.length;
  box.textContent = '';
  box.appendChild(el('div', 'dname', body.groupName(g)));
  box.appendChild(el('div', null, body.count[g] + ' nodes in this name scope' +
    (body.name ? ' of ' + body.shown : ' of the top graph')));
  var ul = el('ul');
  for (var c = 0; c < nc; c++) {
    var k = body.cats[g * nc + c];
    if (!k) continue;
    var li = el('li'), sw = el('span', 'chip');
    sw.style.background = CATS[c][2];
    li.appendChild(sw);
    li.appendChild(document.createTextNode(CATS[c][1] + ': ' + k));
    ul.appendChild(li);
  }
  box.appendChild(ul);
}

/* ------------------------------------------------------------------ search */

function runSearch() {
  var q = $('search').value.trim().toLowerCase();
  matchList = []; matchPos = -1;
  bodies.forEach(function (body) {
    body.match.fill(0);
    if (q) {
      for (var i = 0; i < body.n; i++) {
        if (body.lower[i].indexOf(q) >= 0) { body.match[i] = 1; matchList.push([body, i]); }
      }
    }
    body.applyMatches();
  });
  $('scount').textContent = q ? matchList.length + ' match' + (matchList.length === 1 ? '' : 'es')
    : '';
  var box = $('results');
  box.textContent = '';
  if (!q) { box.style.display = 'none'; return; }
  matchList.slice(0, 200).forEach(function (m, q2) {
    var row = el('div', 'res');
    row.appendChild(el('span', 'rn', m[0].items[m[1]][0]));
    row.appendChild(el('span', 'rf', (m[0].name ? 'function ' + m[0].shown : 'top graph') +
      (m[0].items[m[1]][1] === 0 ? ' \u00b7 ' + S[m[0].items[m[1]][3]] : '')));
    row.addEventListener('mousedown', function (ev) {
      ev.preventDefault();
      matchPos = q2;
      reveal(m[0], m[1]);
      box.style.display = 'none';
    });
    box.appendChild(row);
  });
  if (matchList.length > 200) {
    box.appendChild(el('div', 'more', (matchList.length - 200) + ' more: refine the search'));
  }
  if (!matchList.length) box.appendChild(el('div', 'more', 'No node name contains that text.'));
  box.style.display = 'block';
}

function nextMatch(step) {
  if (!matchList.length) return;
  matchPos = (matchPos + step + matchList.length) % matchList.length;
  var m = matchList[matchPos];
  reveal(m[0], m[1]);
  $('results').style.display = 'none';
  $('scount').textContent = (matchPos + 1) + ' of ' + matchList.length;
}

/* ------------------------------------------------------------------ legend */

function buildLegend() {
  var box = $('legend'), nc = CATS.length, totals = new Int32Array(nc);
  bodies.forEach(function (b) { for (var c = 0; c < nc; c++) totals[c] += b.catTotals[c]; });
  CATS.forEach(function (cat, c) {
    if (!totals[c] && cat[0] !== 'f16') return;
    var row = el('div', 'row'), sw = el('span', 'sw');
    if (cat[0] === 'cast16' || cat[0] === 'cast32') sw.className = 'sw cast';
    if (cat[0] === 'io' || cat[0] === 'unknown') sw.className = 'sw io';
    sw.style.background = cat[2];
    row.appendChild(sw);
    row.appendChild(el('span', 'lbl', cat[1]));
    row.appendChild(el('span', 'cnt', String(totals[c])));
    row.title = 'click to highlight these nodes';
    row.addEventListener('click', function () {
      var on = filterKey !== cat[0];
      box.querySelectorAll('.row.on').forEach(function (r) { r.classList.remove('on'); });
      filterKey = on ? cat[0] : null;
      document.body.classList.toggle('filtering', on);
      if (on) row.classList.add('on');
      filterStyle.textContent = on ? '.filtering .n.c-' + cat[0] + ' { opacity: 1; }' : '';
    });
    box.appendChild(row);
  });
  function lineRow(color, text) {
    var row = el('div', 'row'), line = el('span', 'line');
    line.style.borderTopColor = color;
    row.appendChild(line);
    row.appendChild(el('span', 'lbl', text));
    box.appendChild(row);
  }
  lineRow('#2e9d57', 'edge carrying a ' + D.dtype + ' tensor');
  lineRow('#9aa1b0', 'other edge');
  var grp = el('div', 'row'), gsw = el('span', 'sw');
  gsw.style.background = '#f4f6fb';
  gsw.style.borderColor = '#7d88a6';
  grp.appendChild(gsw);
  grp.appendChild(el('span', 'lbl', 'name scope (click to expand; bar = mix of decisions)'));
  box.appendChild(grp);
  box.appendChild(el('div', 'note', 'Badges: ' + shortType(D.dtype) +
    ' = runs in ' + D.dtype + ', f32 = kept float32.' +
    (D.hasGraph ? '' : ' No graph was given: only the edges through inserted Casts are drawn.')));
}

/* ------------------------------------------------------------------- panels */

function buildPanel(body) {
  var panel = el('section', 'panel'), head = el('div', 'phead');
  panel.id = 'panel-' + body.index;
  var fold = el('button', 'fold', '\u25BE');
  fold.title = 'fold / unfold this panel';
  fold.addEventListener('click', function () { body.setOpen(!body.open); });
  head.appendChild(fold);
  var title = el('span', 'ptitle', body.name ? 'function ' + body.shown : 'Top graph');
  if (body.shown !== body.name) title.title = body.name;
  head.appendChild(title);
  var meta = el('span', 'pmeta'), ops = 0, casts = 0, conv = body.catTotals[CAT.f16];
  body.items.forEach(function (it) { if (it[1] === 0) ops++; else if (it[1] === 1) casts++; });
  meta.appendChild(document.createTextNode(plural(ops, 'op') + ', ' + conv + ' \u2192 ' +
    D.dtype + ', ' + plural(casts, 'cast')));
  if (body.callers.length) {
    meta.appendChild(document.createTextNode(' \u00b7 called by '));
    body.callers.slice(0, 3).forEach(function (c, q) {
      if (q) meta.appendChild(document.createTextNode(', '));
      var a = el('a', null, (c[0].name ? c[0].shown + ': ' : '') + c[0].items[c[1]][0]);
      a.href = '#';
      a.addEventListener('click', function (ev) { ev.preventDefault(); reveal(c[0], c[1]); });
      meta.appendChild(a);
    });
    if (body.callers.length > 3) meta.appendChild(document.createTextNode(', \u2026'));
  }
  head.appendChild(meta);
  [['Expand all', function () { body.expanded.fill(1); body.render(); }],
   ['Collapse all', function () { body.expanded.fill(0); body.expanded[0] = 1; body.render(); }],
   ['Default', function () { body.setDefault(); body.render(); }],
   ['\u2212', function () { body.zoom(1 / 1.25); }],
   ['+', function () { body.zoom(1.25); }],
   ['Fit', function () { body.fit(); }]].forEach(function (b) {
    var button = el('button', null, b[0]);
    button.addEventListener('click', function () { if (!body.open) body.setOpen(true); b[1](); });
    head.appendChild(button);
  });
  var canvas = el('div', 'canvas');
  var svg = document.createElementNS($('tfamp-defs').namespaceURI, 'svg');
  svg.setAttribute('class', 'graph');
  canvas.appendChild(svg);
  panel.appendChild(head);
  panel.appendChild(canvas);
  body.panel = panel; body.canvas = canvas; body.svg = svg; body.foldButton = fold;
  canvas.addEventListener('click', function (ev) {
    if (drag && drag.moved) return;
    var t = ev.target.closest('[data-node],[data-group],[data-ghead]');
    if (!t) return;
    if (t.hasAttribute('data-node')) { select(body, +t.getAttribute('data-node')); return; }
    var id = +(t.getAttribute('data-group') || t.getAttribute('data-ghead'));
    var expand = t.hasAttribute('data-group');
    var c = body.canvas, before = [body.X[id] * body.scale - c.scrollLeft,
      body.Y[id] * body.scale - c.scrollTop];
    body.expanded[id - body.n] = expand ? 1 : 0;
    body.render();
    c.scrollLeft = body.X[id] * body.scale - before[0];
    c.scrollTop = body.Y[id] * body.scale - before[1];
    showGroupDetails(body, id);
  });
  canvas.addEventListener('mousedown', function (ev) {
    if (ev.button !== 0) return;
    drag = {canvas: canvas, x: ev.clientX, y: ev.clientY, left: canvas.scrollLeft,
      top: canvas.scrollTop, moved: false};
  });
  canvas.addEventListener('wheel', function (ev) {
    if (!ev.ctrlKey) return;
    ev.preventDefault();
    var r = canvas.getBoundingClientRect();
    body.zoom(ev.deltaY < 0 ? 1.15 : 1 / 1.15, ev.clientX - r.left, ev.clientY - r.top);
  }, {passive: false});
  return panel;
}

/* --------------------------------------------------------------------- main */

/* Options after '#', joined by '&': 'expand-all' opens every scope and panel,
   'fit' zooms every panel to fit, 'find=NAME' selects a node (e.g.
   report.html#find=dense_1/MatMul). */
function hashOptions() {
  var opts = {};
  location.hash.slice(1).split('&').forEach(function (part) {
    if (!part) return;
    var i = part.indexOf('='), value = i < 0 ? '' : part.slice(i + 1);
    try { value = decodeURIComponent(value); } catch (e) { /* keep it as written */ }
    opts[i < 0 ? part : part.slice(0, i)] = value;
  });
  return opts;
}

/* -------------------------------------------------------------- overview */

var OVERVIEW_ROWS = 25;

function layerTable(rows) {
  var table = el('table');
  var head = el('tr');
  ['Layer', '16-bit ops', 'float32 ops', 'why float32', 'Casts'].forEach(function (h) {
    head.appendChild(el('th', null, h));
  });
  table.appendChild(head);
  rows.forEach(function (r) {
    var tr = el('tr', 'layer');
    tr.title = 'Find the ops of ' + r[0] + ' in the graph below';
    var why = Object.keys(r[3]).map(function (k) { return k + ' \u00d7' + r[3][k]; });
    tr.appendChild(el('td', null, r[0]));
    tr.appendChild(el('td', 'num', String(r[1])));
    tr.appendChild(el('td', 'num', String(r[2])));
    tr.appendChild(el('td', null, why.join(', ') || '\u2014'));
    tr.appendChild(el('td', 'num', String(r[4])));
    tr.addEventListener('click', function () {
      var search = $('search');
      search.value = r[0] === '(top level)' ? '' : r[0] + '/';
      runSearch();
      if (matchList.length) { matchPos = -1; nextMatch(1); }
    });
    table.appendChild(tr);
  });
  return table;
}

function folded(label, content) {
  var d = el('details');
  d.appendChild(el('summary', null, label));
  d.appendChild(content);
  return d;
}

function buildOverview() {
  var O = D.overview, box = $('overview');
  if (!O) { box.hidden = true; return; }
  box.appendChild(el('h2', null, 'What changed, and why'));
  if (D.verdict) box.appendChild(el('p', 'verdict', D.verdict));
  var facts = el('ul', 'facts');
  function fact(label, text) {
    if (text === null || text === undefined || text === '') return;
    var li = el('li');
    li.appendChild(el('b', null, label + ': '));
    li.appendChild(document.createTextNode(text));
    facts.appendChild(li);
  }
  var pairs = function (list) {
    return list.map(function (p) { return p[0] + ' \u00d7' + p[1]; }).join(', ');
  };
  fact('Estimated float traffic per step', O.traffic);
  fact('Matrix FLOPs', O.flops);
  fact('Converted to ' + D.dtype, pairs(O.converted) || 'nothing');
  fact('Listed ops kept float32, by reason', pairs(O.kept) || 'none');
  box.appendChild(facts);
  var mixed = O.layers.filter(function (r) { return r[2] > 0; });
  var all16 = O.layers.filter(function (r) { return r[2] === 0; });
  box.appendChild(el('p', null, O.layersAll16 + ' of ' + O.layers.length +
    ' layers run every float op in ' + D.dtype + '; ' + mixed.length +
    ' keep some float32 (largest first; click a row to find it in the graph):'));
  if (mixed.length) {
    box.appendChild(layerTable(mixed.slice(0, OVERVIEW_ROWS)));
    if (mixed.length > OVERVIEW_ROWS) {
      box.appendChild(folded((mixed.length - OVERVIEW_ROWS) + ' more layers with float32 ops',
                             layerTable(mixed.slice(OVERVIEW_ROWS))));
    }
  }
  if (all16.length) {
    box.appendChild(folded(all16.length + ' groups with no float32 op', layerTable(all16)));
  }
}

function main() {
  var t0 = Date.now();
  D = JSON.parse($('tfamp-data').textContent);
  S = D.strings; CATS = D.categories;
  CATS.forEach(function (c, i) { CAT[c[0]] = i; });
  filterStyle = document.createElement('style');
  document.head.appendChild(filterStyle);
  document.title = D.title;
  $('htitle').textContent = (D.function || 'graph') + ' \u2192 ' + D.dtype;
  var summary = $('summary');
  [[D.convertedCount, ' ops \u2192 ' + D.dtype + ', '], [D.castCount, ' casts inserted, '],
   [D.keptCount, ' listed ops kept float32 \u00b7 '],
   [D.nodesBefore, ' nodes before, '], [D.nodesAfter, ' after']].forEach(function (p) {
    summary.appendChild(el('b', null, String(p[0])));
    summary.appendChild(document.createTextNode(p[1]));
  });
  summary.title = D.summary;
  buildOverview();
  bodies = D.bodies.map(function (raw, i) { return new Body(raw, i); });
  bodies.forEach(function (b) { bodyByName[b.name] = b; });
  bodies.forEach(function (b) {
    b.items.forEach(function (it, i) {
      if (it[1] === 0 && it[7] && it[7].length) {
        it[7].forEach(function (f) { if (bodyByName[f]) bodyByName[f].callers.push([b, i]); });
      }
    });
  });
  var opts = hashOptions(), expandAll = 'expand-all' in opts;
  var panels = $('panels');
  bodies.forEach(function (b) { panels.appendChild(buildPanel(b)); });
  var totalItems = 0, drawn = 0, open = 0;
  bodies.forEach(function (b, i) {
    totalItems += b.n;
    if (expandAll) b.expanded.fill(1); else b.setDefault();
    b.open = expandAll || i < OPEN_PANELS;
    b.panel.classList.toggle('folded', !b.open);
    b.foldButton.textContent = b.open ? '\u25BE' : '\u25B8';
    if (b.open) { b.render(); drawn += b.drawn; open++; }
  });
  buildLegend();
  var search = $('search');
  search.addEventListener('input', function () {
    clearTimeout(search.timer);
    search.timer = setTimeout(runSearch, 120);
  });
  search.addEventListener('keydown', function (ev) {
    if (ev.key === 'Enter') { runSearch(); nextMatch(ev.shiftKey ? -1 : 1); ev.preventDefault(); }
    if (ev.key === 'Escape') { search.value = ''; runSearch(); }
  });
  search.addEventListener('focus', function () { if (search.value) runSearch(); });
  search.addEventListener('blur', function () {
    setTimeout(function () { $('results').style.display = 'none'; }, 150);
  });
  document.addEventListener('keydown', function (ev) {
    if (ev.key === '/' && document.activeElement !== search) {
      ev.preventDefault(); search.focus();
    }
  });
  window.addEventListener('mousemove', function (ev) {
    if (!drag) return;
    var dx = ev.clientX - drag.x, dy = ev.clientY - drag.y;
    if (!drag.moved && Math.abs(dx) + Math.abs(dy) > 4) {
      drag.moved = true; drag.canvas.classList.add('dragging');
    }
    if (drag.moved) {
      drag.canvas.scrollLeft = drag.left - dx; drag.canvas.scrollTop = drag.top - dy;
      ev.preventDefault();
    }
  });
  window.addEventListener('mouseup', function () {
    if (!drag) return;
    var d = drag;
    d.canvas.classList.remove('dragging');
    setTimeout(function () { if (drag === d) drag = null; }, 0);
  });
  if ('fit' in opts) bodies.forEach(function (b) { if (b.rendered) b.fit(); });
  if (opts.find) {
    search.value = opts.find;
    runSearch();
    $('results').style.display = 'none';
    var exact = null;
    bodies.some(function (b) {
      if (b.byName[opts.find] !== undefined) exact = [b, b.byName[opts.find]];
      return exact;
    });
    matchPos = -1;
    matchList.forEach(function (m, q) {
      if (exact && m[0] === exact[0] && m[1] === exact[1]) matchPos = q - 1;
    });
    nextMatch(1);
  }
  drawn = 0; open = 0;
  bodies.forEach(function (b) { if (b.rendered) { drawn += b.drawn; open++; } });
  var status = $('status');
  status.textContent = 'Rendered ' + drawn + ' nodes (of ' + totalItems + ') in ' + open +
    ' of ' + bodies.length + ' panels in ' + (Date.now() - t0) + ' ms' +
    (drawn < totalItems ? '; the rest are inside collapsed name scopes or folded panels.' : '.');
  status.setAttribute('data-state', 'ok');
  status.setAttribute('data-drawn', String(drawn));
  status.setAttribute('data-total', String(totalItems));
}

try {
  main();
} catch (e) {
  fail(String(e && e.message || e));
  console.error('tfamp report error: ' + (e && e.stack || e));
}
})();
