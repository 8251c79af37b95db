"""The HTML report page: its data and escaping, and that it renders in a real browser.

The browser tests load the page in headless Chromium (Debian's /usr/bin/chromium,
or $TEST_CHROMIUM) with --dump-dom and read back the DOM the page's JavaScript
built, plus Chromium's log of the page's console (JavaScript errors show there as
``CONSOLE(...)] "Uncaught ..."``). Without Chromium those tests FAIL, on purpose:
install it with ``apt-get install -y chromium``.
"""

from __future__ import annotations

import dataclasses
import html as html_lib
import json
import os
import re
import shutil
import subprocess
import urllib.parse
from pathlib import Path

import pytest
import tensorflow as tf
import tf_keras as keras
from tensorflow.core.framework import graph_pb2, types_pb2

import tfamp
from tfamp.inspect import html_report
from tfamp.inspect.html_report import node_category, render_html
from tfamp.rewrite.report import NodeReport, RewriteReport

CHROMIUM = os.environ.get("TEST_CHROMIUM", "/usr/bin/chromium")

# A node name that tries to end the data <script> element and inject markup.
EVIL = 'scope</script><img id="pwned" src=x onerror=alert(1)>&amp;\u00e9\u2028/MatMul'


# ------------------------------------------------------------------- graphs


def _train_step_graph(model, x_spec, y_spec):
    """(original GraphDef, report) of one Adam training step of `model`."""
    optimizer = keras.optimizers.Adam()

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
                y, logits, from_logits=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    concrete = step.get_concrete_function(x_spec, y_spec)
    graph_def = concrete.graph.as_graph_def()
    _, report = tfamp.rewrite_graph_def(
        graph_def, tfamp.AmpConfig(), outputs=[t.name for t in concrete.graph.outputs])
    return graph_def, report


@pytest.fixture(scope="module")
def small():
    """An LSTM + 2-layer MLP training step: a few hundred top-graph nodes, and
    library functions (the LSTM's bodies, its while loop, their gradients)."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.layers.LSTM(8, input_shape=(5, 8)),
        keras.layers.Dense(16, activation="relu"),
        keras.layers.Dense(4),
    ])
    return _train_step_graph(model, tf.TensorSpec([4, 5, 8]), tf.TensorSpec([4], tf.int64))


@pytest.fixture(scope="module")
def large():
    """A 36-layer MLP training step: more than 3000 nodes."""
    keras.utils.set_random_seed(0)
    layers = [keras.layers.Dense(8, activation="relu", input_shape=(8,))]
    layers += [keras.layers.Dense(8, activation="relu") for _ in range(34)]
    model = keras.Sequential(layers + [keras.layers.Dense(2)])
    return _train_step_graph(model, tf.TensorSpec([4, 8]), tf.TensorSpec([4], tf.int64))


def _evil_graph():
    """x -> MatMul (named EVIL) -> Exp (named 'out</script>'): one Cast each side."""
    graph_def = graph_pb2.GraphDef()

    def add(name, op, inputs=(), type_attr="T"):
        node = graph_def.node.add(name=name, op=op, input=list(inputs))
        node.attr[type_attr].type = types_pb2.DT_FLOAT
        return node

    add("x", "Placeholder", type_attr="dtype").attr["shape"].shape.unknown_rank = True
    add(EVIL, "MatMul", ["x", "x"])
    add("out</script>", "Exp", [EVIL])
    return graph_def


@pytest.fixture(scope="module")
def pages(small, large, tmp_path_factory):
    """The pages, written to files: name -> Path."""
    folder = tmp_path_factory.mktemp("pages")
    evil_graph = _evil_graph()
    _, evil_report = tfamp.rewrite_graph_def(evil_graph)
    from_json = RewriteReport.from_dict(json.loads(small[1].to_json()))
    paths = {}
    for name, html in [("small", render_html(small[1], small[0])),
                       ("large", render_html(large[1], large[0])),
                       ("evil", render_html(evil_report, evil_graph)),
                       ("no_graph", render_html(from_json))]:
        paths[name] = folder / f"{name}.html"
        paths[name].write_text(html, encoding="ascii")
    return paths


def page_data(html: str) -> dict:
    scripts = re.findall(r'<script type="application/json" id="tfamp-data">(.*?)</script>',
                         html, re.S)
    assert len(scripts) == 1
    return json.loads(scripts[0])


def body_edges(body: dict) -> set[tuple[str, str]]:
    names = [item[0] for item in body["items"]]
    pairs = body["edges"]
    return {(names[pairs[i]], names[pairs[i + 1]]) for i in range(0, len(pairs), 2)}


# --------------------------------------------------------------- page tests


def test_page_is_one_self_contained_ascii_file(small, pages):
    html = pages["small"].read_text(encoding="ascii")
    assert html.startswith("<!DOCTYPE html>")
    assert not re.search(r"https?:|ftp:|//[a-z0-9.-]+\.[a-z]{2,}/", html, re.I), \
        "the page must not reference anything on the network"
    assert not re.search(r"<(link|iframe|img|object|embed|base)\b", html, re.I)
    assert not re.search(r"<script[^>]*\bsrc\s*=", html, re.I)
    assert "@import" not in html and "@font-face" not in html
    assert all(u.startswith("url(#") for u in re.findall(r"url\([^)]*\)", html))
    assert html.count("<script") == 2 and html.count("</script>") == 2
    assert "<title>tfamp: graph -&gt; float16</title>" in html


def test_page_inlines_its_own_files_once(pages):
    """The page's style and script are package files (page/graph.css, graph.js),
    inlined whole; no slot of the skeleton is left behind."""
    from importlib import resources

    html = pages["small"].read_text(encoding="ascii")
    folder = resources.files("tfamp.inspect.page")
    for name in ("graph.css", "graph.js"):
        text = folder.joinpath(name).read_text(encoding="ascii")
        assert len(text) > 1000 and html.count(text) == 1, name
    assert not re.search(r"%%(TITLE|STYLE|DATA|SCRIPT)%%", html)


def test_page_data_matches_report(small, pages):
    graph_def, report = small
    data = page_data(pages["small"].read_text(encoding="ascii"))
    assert data["hasGraph"] and data["dtype"] == "float16"
    assert data["castCount"] == len(report.casts)
    bodies = {body["name"]: body for body in data["bodies"]}
    assert data["bodies"][0]["name"] == ""  # the top graph comes first
    assert len(bodies) > 3, "the LSTM brings library functions"
    strings, categories = data["strings"], [c[0] for c in data["categories"]]
    for entry in report.nodes:
        items = [i for i in bodies[entry.function]["items"] if i[0] == entry.name and i[1] == 0]
        assert len(items) == 1, entry
        name, _, category, op, list_, reason, cause, _ = items[0]
        assert (strings[op], strings[list_], strings[reason], strings[cause]) == (
            entry.op, entry.list, entry.reason, entry.cause)
        assert categories[category] == node_category(entry)
    for cast in report.casts:
        items = [i for i in bodies[cast.function]["items"] if i[0] == cast.name]
        assert len(items) == 1 and items[0][1] == 1
        assert items[0][7] == [cast.source, cast.src_dtype, cast.dst_dtype, list(cast.consumers)]
    # Edges come from the original graph, with each Cast spliced in.
    top = body_edges(bodies[""])
    for node in graph_def.node:
        for text in node.input:
            source = text.lstrip("^").split(":")[0]
            if text.startswith("^"):
                continue
            casts = [c.name for c in report.casts if c.function == ""
                     and c.source.split(":")[0] == source and node.name in c.consumers]
            if casts:
                assert (source, casts[0]) in top and (casts[0], node.name) in top
            else:
                assert (source, node.name) in top
    # Call ops know the functions they call (links between the panels).
    for graph_data in (data, page_data(render_html(report))):
        calls = [item for body in graph_data["bodies"] for item in body["items"]
                 if item[1] == 0 and strings[item[3]] in ("PartitionedCall", "While")]
        assert calls and all(item[7] and set(item[7]) <= set(bodies) for item in calls)
    # Functions have argument and result items, and edges from them.
    function = next(b for b in data["bodies"] if b["name"].startswith("while_body"))
    kinds = {item[1] for item in function["items"]}
    assert {0, 2, 3} <= kinds


def test_page_opens_on_an_overview_by_layer(small, pages):
    """The page's summary: traffic and FLOP lines, op types, reasons, and per Keras
    layer the 16-bit and float32 op counts, which add up to the report's."""
    graph_def, report = small
    data = page_data(pages["small"].read_text(encoding="ascii"))["overview"]
    assert data["traffic"] == report.traffic_line()
    assert re.match(r"\d+\.\d% of matrix/convolution FLOPs in float16", data["flops"])
    assert dict(data["converted"]) == report.converted
    assert dict(data["kept"]) == report.kept_fp32
    layers = {row[0]: row for row in data["layers"]}
    dense = [n.name for n in report.nodes if n.op == "MatMul" and n.converted
             and not n.function and not n.name.startswith("gradient_tape/")]
    # "<model>/<layer>/MatMul": the layer, not the model, is the group.
    for name in dense:
        assert name.split("/")[-2] in layers, (name, sorted(layers))
    assert sum(row[1] for row in data["layers"]) == sum(report.converted.values())
    assert sum(row[4] for row in data["layers"]) == len(report.casts)
    # Layers keeping float32 ops come first, the loss's deny ops among them.
    assert data["layers"][0][2] > 0
    kinds = set().union(*(row[3] for row in data["layers"]))
    assert "deny list" in kinds or any("deny" in k for k in kinds), kinds


def test_node_names_cannot_break_out_of_the_page():
    graph_def = _evil_graph()
    _, report = tfamp.rewrite_graph_def(graph_def)
    html = render_html(report, graph_def)
    assert html.count("</script>") == 2  # only the page's own two scripts end
    assert "<img" not in html and "\u2028" not in html and html.isascii()
    data = page_data(html)
    names = {item[0] for item in data["bodies"][0]["items"]}
    assert {EVIL, "out</script>", "x"} <= names
    casts = [c.name for c in report.casts]
    assert body_edges(data["bodies"][0]) == {
        ("x", casts[0]), (casts[0], EVIL), (EVIL, casts[1]), (casts[1], "out</script>")}
    # The title is escaped too.
    evil_report = dataclasses.replace(report, function="<b>f</b>")
    assert "<title>tfamp: &lt;b&gt;f&lt;/b&gt; -&gt; float16</title>" in render_html(evil_report)


def test_without_graph_only_cast_edges_are_drawn(small):
    _, report = small
    loaded = json.loads(report.to_json())
    data = page_data(render_html(loaded))  # a dict from a JSON file works too
    assert not data["hasGraph"]
    edges = set()
    for body in data["bodies"]:
        edges |= {(body["name"], a, b) for a, b in body_edges(body)}
    expected = set()
    for cast in report.casts:
        source = cast.source.split(":")[0]
        expected.add((cast.function, source, cast.name))
        for consumer in cast.consumers:
            target = consumer[5:-1] if consumer.startswith("<ret ") else consumer
            expected.add((cast.function, cast.name, target))
    assert edges == expected
    assert sum(len(b["items"]) for b in data["bodies"]) >= len(report.nodes) + len(report.casts)


def test_a_rewritten_graph_gives_the_same_drawing():
    graph_def = _evil_graph()
    new_graph_def, report = tfamp.rewrite_graph_def(graph_def)
    before = page_data(render_html(report, graph_def))["bodies"][0]
    after = page_data(render_html(report, new_graph_def))["bodies"][0]
    assert body_edges(before) == body_edges(after)
    assert before["items"] == after["items"]


def test_node_categories():
    def entry(reason, converted=False, list_="infer"):
        return NodeReport("n", "", "Op", list_, converted, reason)

    assert node_category(entry("allow: compute-heavy", True, "allow")) == "f16"
    assert node_category(entry("no float32 tensors to convert", list_="clear")) == "nofloat"
    assert node_category(entry("deny: numerically risky in float16", list_="deny")) == "deny"
    assert node_category(entry("deny: downstream of Exp 'e'")) == "downstream"
    assert node_category(entry("unlisted: stays float32", list_="unlisted")) == "unlisted"
    assert node_category(entry("infer: stays float32, not between float16 ops")) == "neighbour"
    assert node_category(entry("allow: no float16 CPU kernel for X (T)")) == "kernel"
    assert node_category(entry("kept float32: name matches keep_fp32 pattern 'x'")) == "override"
    assert node_category(entry("something new")) == "other"


def test_scope_groups():
    groups, member = html_report._scope_groups(
        ["a/b/c1", "a/b/c2", "a/b/c3", "a/d", "e", "f/g/h1", "p/q/r1", "p/q/r2", "p/q/r3", None])
    assert groups == [["a", -1, "a", 0], ["b", 0, "a/b", 0], ["p/q", -1, "p/q", 0]]
    assert member == [1, 1, 1, 0, -1, -1, 2, 2, 2, -1]
    # A scope too big to draw at once is split into parts of consecutive nodes.
    names = [f"big/n{i}" for i in range(400)]
    groups, member = html_report._scope_groups(names, list(range(400)))
    parts = [g for g in groups if g[3]]
    assert len(parts) == 7 and parts[0][0] == "part 1/7: n0 .. n59"
    assert all(g[1] == 0 for g in parts)
    assert member[0] == member[59] != member[60]


# ------------------------------------------------------------ browser tests


def chromium() -> str:
    """Chromium's path; FAILS the calling test (no skip) when it is not installed."""
    path = CHROMIUM if os.path.exists(CHROMIUM) else shutil.which("chromium")
    if not path:
        pytest.fail(f"Chromium not found at {CHROMIUM} or on PATH: the HTML report tests load "
                    f"the page in a real browser. Install it: apt-get install -y chromium",
                    pytrace=False)
    return path


def run_chromium(page: Path, tmp_path: Path, fragment: str = "",
                 screenshot: Path | None = None) -> subprocess.CompletedProcess:
    command = [
        chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
        "--no-first-run", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr",
        "--v=0", "--virtual-time-budget=10000", "--window-size=1400,900"]
    if screenshot:
        command.append(f"--screenshot={screenshot}")
    command += ["--dump-dom", page.as_uri() + fragment]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def load(page: Path, tmp_path: Path, fragment: str = "",
         screenshot: Path | None = None) -> str:
    """The DOM of `page` after its scripts ran; fails on any console message."""
    result = run_chromium(page, tmp_path, fragment, screenshot)
    assert result.returncode == 0, result.stderr[-3000:]
    console = [line for line in result.stderr.splitlines() if ":CONSOLE" in line]
    assert not console, "the page logged to the console (a JavaScript error?):\n" + \
        "\n".join(console)
    dom = result.stdout
    assert '<div id="error" hidden=""' in dom, "the page shows an error"
    return dom


def status(dom: str) -> dict:
    tag = re.search(r'<div id="status"[^>]*>', dom)
    assert tag, "no status element in the DOM"
    return dict(re.findall(r'([\w-]+)="([^"]*)"', tag.group(0)))


def drawn_nodes(dom: str) -> int:
    return len(re.findall(r'<g class="n [^"]*" data-node="\d+"', dom))


def test_browser_small_graph(small, pages, tmp_path):
    screenshot = tmp_path / "small.png"
    dom = load(pages["small"], tmp_path, screenshot=screenshot)
    state = status(dom)
    assert state["data-state"] == "ok", state
    assert int(state["data-drawn"]) == drawn_nodes(dom) >= 300
    _, report = small
    assert int(state["data-total"]) == (
        len(report.nodes) + len(report.casts) + _io_items(pages["small"]))
    for key in ("f16", "deny", "downstream", "variable", "nofloat", "cast16", "cast32"):
        assert f'<g class="n c-{key}' in dom, key
    assert dom.count('class="panel') > 3 and "function while_body" in dom
    assert 'class="e h16"' in dom  # 16-bit edges
    assert dom.count('class="legend"') == 1 and "float32: deny list" in dom
    assert screenshot.stat().st_size > 30_000, "the screenshot looks blank"
    overview = re.search(r'<section id="overview">(.*?)</section>', dom, re.S).group(1)
    assert "What changed, and why" in overview and "Estimated float traffic" in overview
    assert f'<p class="verdict">{html_lib.escape(small[1].verdict.line)}</p>' in overview
    assert overview.count('<tr class="layer"') == len(page_data(
        pages["small"].read_text(encoding="ascii"))["overview"]["layers"])
    print(f"\nscreenshot: {screenshot}")


def _io_items(page: Path) -> int:
    data = page_data(page.read_text(encoding="ascii"))
    return sum(1 for body in data["bodies"] for item in body["items"] if item[1] > 1)


def test_browser_search_and_details(small, pages, tmp_path):
    # Keras layer names depend on what else ran in this process: ask the report
    # for the second converted top-graph MatMul (the second Dense layer).
    matmuls = [n.name for n in small[1].nodes
               if n.op == "MatMul" and not n.function and n.converted
               and not n.name.startswith("gradient_tape/")]
    name = matmuls[1]
    dom = load(pages["small"], tmp_path,
               fragment="#find=" + urllib.parse.quote(name, safe=""))
    details = re.search(r'<div id="details">(.*?)</table>', dom, re.S).group(1)
    entry = small[1].node(name)
    assert f'<div class="dname">{name}</div>' in details
    assert entry.reason in details and entry.op in details and "converted" in details
    assert re.search(r'class="n c-f16 match sel[^"]*" data-node', dom)
    assert re.search(r'id="scount">\d+ of \d+<', dom)


def test_browser_large_graph(large, pages, tmp_path):
    _, report = large
    assert len(report.nodes) >= 3000
    dom = load(pages["large"], tmp_path)
    state = status(dom)
    assert state["data-state"] == "ok"
    assert int(state["data-total"]) >= 3000
    assert 20 <= drawn_nodes(dom) == int(state["data-drawn"]) <= 400, "collapsed by default"
    # The training step's top-level scopes (model, gradients, optimizer) show as
    # collapsed boxes; how many more depends on the layout budget.
    assert dom.count('<g class="grp') >= 3
    # Everything expanded still lays out and draws.
    dom = load(pages["large"], tmp_path, fragment="#expand-all")
    state = status(dom)
    assert state["data-state"] == "ok"
    assert drawn_nodes(dom) == int(state["data-drawn"]) == int(state["data-total"]) >= 3000


def test_browser_hostile_names_and_no_graph(pages, tmp_path):
    dom = load(pages["evil"], tmp_path)
    assert status(dom)["data-state"] == "ok" and drawn_nodes(dom) == 5
    assert '<img id="pwned"' not in dom and "&lt;img id=" in dom
    dom = load(pages["no_graph"], tmp_path)
    assert status(dom)["data-state"] == "ok" and drawn_nodes(dom) >= 300


# Appended to a copy of the page: clicks and types like a user, then records what
# the page showed in <body data-test="...">.
_INTERACTION_SCRIPT = """
<script>
window.addEventListener('load', function () {
  var out = [];
  function click(e) { e.dispatchEvent(new MouseEvent('click', {bubbles: true})); }
  function svg() { return document.querySelector('#panel-0 svg.graph'); }
  function count(sel) { return svg().querySelectorAll(sel).length; }
  function done() { document.body.setAttribute('data-test', out.join('|')); }
  try {
    var before = count('[data-node]');
    click(svg().querySelector('[data-group]'));
    out.push('expand=' + (count('[data-node]') > before));
    var frames = count('[data-ghead]');
    click(svg().querySelector('[data-ghead]'));
    out.push('collapse=' + (count('[data-ghead]') < frames));
    click(svg().querySelector('.n.c-deny'));
    out.push('selected=' + count('.n.sel'));
    out.push('reason=' + document.querySelector('#details table').textContent.indexOf('deny:'));
    var width = +svg().getAttribute('width');
    click(Array.prototype.filter.call(document.querySelectorAll('#panel-0 button'),
      function (b) { return b.textContent === '+'; })[0]);
    out.push('zoom=' + (+svg().getAttribute('width') > width));
    var search = document.getElementById('search');
    search.value = 'BiasAdd';
    search.dispatchEvent(new Event('input'));
    setTimeout(function () {
      out.push('results=' + document.querySelectorAll('#results .res').length);
      out.push('matches=' + count('.match'));
      search.dispatchEvent(new KeyboardEvent('keydown', {key: 'Enter', bubbles: true}));
      out.push('found=' + document.querySelector('#details .dname').textContent);
      done();
    }, 300);
  } catch (e) {
    out.push('error=' + e);
    done();
  }
});
</script>
</body>"""


def test_browser_interaction(pages, tmp_path):
    page = tmp_path / "interactive.html"
    html = pages["small"].read_text(encoding="ascii")
    page.write_text(html.replace("</body>", _INTERACTION_SCRIPT), encoding="ascii")
    dom = load(page, tmp_path)
    found = re.search(r'<body data-test="([^"]*)"', dom)
    assert found, "the interaction script did not finish"
    result = dict(part.split("=", 1) for part in found.group(1).split("|"))
    assert "error" not in result, result
    assert result["expand"] == result["collapse"] == result["zoom"] == "true", result
    assert result["selected"] == "1" and int(result["reason"]) >= 0, result
    assert int(result["results"]) > 0 and int(result["matches"]) > 0, result
    assert "BiasAdd" in result["found"], result


def test_browser_shows_a_script_failure_on_the_page(pages, tmp_path):
    broken = tmp_path / "broken.html"
    text = pages["small"].read_text(encoding="ascii")
    assert text.count('"bodies"') >= 1
    broken.write_text(text.replace('"bodies"', '"bodiez"', 1), encoding="ascii")
    result = run_chromium(broken, tmp_path)
    assert result.returncode == 0
    dom = result.stdout
    assert '<div id="error" hidden=""' not in dom, "the error box should be visible"
    assert "the page failed to render" in dom
    assert status(dom)["data-state"] == "error"
