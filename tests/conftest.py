"""Shared test set-up: quiet TensorFlow, and tiny-graph helpers."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402


@pytest.fixture
def check_calls(monkeypatch):
    """Records every graph tfamp validated (check=True) before running it."""
    import tfamp.runtime.runner

    calls = []
    real = tfamp.runtime.runner.assert_valid_graph_def

    def spy(graph_def):
        calls.append(graph_def)
        return real(graph_def)

    monkeypatch.setattr(tfamp.runtime.runner, "assert_valid_graph_def", spy)
    return calls


def _node_defs_by_body(graph_def) -> dict:
    bodies = {"": {n.name: n for n in graph_def.node}}
    for fdef in graph_def.library.function:
        bodies[fdef.signature.name] = {n.name: n for n in fdef.node_def}
    return bodies


def _top_body_read_generally(graph_def):
    """The top graph through build_view's general reader (used for function bodies)."""
    from tfamp.rewrite import graph

    signatures = {f.signature.name: f.signature for f in graph_def.library.function}
    return graph._build_body("", graph_def.node, graph._PortResolver(signatures), None, {})


def _view_facts(body) -> tuple:
    nodes = {name: (node.op, node.inputs, node.outputs, node.data_inputs,
                    node.called_functions) for name, node in body.nodes.items()}
    consumers = {ref: sorted(c) for ref, c in body.consumers.items()}
    return nodes, consumers, body.rets


def checked_insert_casts(real):
    """insert_casts, asserting that its record of written NodeDefs is exact.

    The pass reads its result again from the NodeDefs insert_casts says it
    wrote (build_view's `written`); every other NodeDef must equal the
    input's, and the view built from the record must equal one read afresh.
    """
    from tfamp.rewrite.graph import build_view

    def wrapper(graph_def, view, coloring):
        new, casts, written = real(graph_def, view, coloring)
        old = _node_defs_by_body(graph_def)
        for body, nodes in _node_defs_by_body(new).items():
            if body not in old:  # a function copy: read afresh by the check
                continue
            differ = {name for name, nd in nodes.items() if old[body].get(name) != nd}
            assert differ == set(written.get(body, {})), (body, differ, set(written.get(body, {})))
        patched = build_view(new, earlier=view, written=written)
        fresh = build_view(new)
        assert [b.name for b in patched.bodies] == [b.name for b in fresh.bodies]
        for a, b in zip(patched.bodies, fresh.bodies, strict=True):
            assert _view_facts(a) == _view_facts(b), a.name
        # The top graph is read in one pass; the general reader must agree.
        for graph in (graph_def, new):
            assert (_view_facts(_top_body_read_generally(graph))
                    == _view_facts(build_view(graph).bodies[0]))
        return new, casts, written

    return wrapper


@pytest.fixture
def verify_written_record(monkeypatch):
    """Every rewrite in the test checks insert_casts' record (see above)."""
    from tfamp.rewrite import pipeline

    monkeypatch.setattr(pipeline, "insert_casts", checked_insert_casts(pipeline.insert_casts))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """Marks slow the tests the default suite's time budget leaves to ``-m slow``
    (tests/default_budget.py), before ``-m 'not slow'`` deselects."""
    from tests.default_budget import SLOW_IN_DEFAULT

    for item in items:
        if f"{item.path.name}::{item.name}" in SLOW_IN_DEFAULT:
            item.add_marker(pytest.mark.slow)
