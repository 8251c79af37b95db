"""tfamp's modules import downward only: no import circle, no lower layer importing a higher one.

Every ``import`` statement of every module under ``tfamp/`` counts, at module
level and inside functions alike (a function-level import is still a
dependency: it only runs later). Imports under ``if TYPE_CHECKING:`` never run
and are left out. ``from package import name`` counts as an import of the
submodule when ``name`` is one, else of the package.

The layers, lowest first (a module may import its own layer and those below):

====  =========================================================================
0     ``choices``, ``env``, ``config``, ``oplists``, ``_quiet``: settings and data
1     ``rewrite/``: the pass, ``GraphDef -> (GraphDef, report)``
2     ``inspect/`` (reading and showing graphs and reports), and the runtime
      core ``runtime/runner``, ``progress``, ``log_lines``, ``plain``: running
      rewritten functions
3     ``numerics/``: where numbers sit against 16-bit limits, on graphs
4     ``keras/``: Keras models (tf_keras and Keras 3): the lifecycle of an
      enabled model, loss scaling, the probe, the fallback, range probes;
      ``serving/``: ``tfamp export`` (neither imports the other)
5     ``runtime/startup``, ``runtime/hook``: ``TFAMP_ENABLE`` (the start-up hook)
6     ``cli``, ``demo``, ``__main__``, the package ``tfamp`` (its lazy public API)
====  =========================================================================
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "tfamp"

LAYERS = (
    (0, r"tfamp\.(choices|env|config|oplists|_quiet)"),
    (1, r"tfamp\.rewrite(\..+)?"),
    (2, r"tfamp\.inspect(\..+)?|tfamp\.runtime(\.(runner|progress|log_lines|plain|trace_local))?"),
    (3, r"tfamp\.numerics(\..+)?"),
    (4, r"tfamp\.(keras|serving)(\..+)?"),
    (5, r"tfamp\.runtime\.(startup|hook)"),
    (6, r"tfamp|tfamp\.(cli|demo|__main__)"),
)


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Every Import / ImportFrom node, at any depth, outside ``if TYPE_CHECKING:``."""
    pending = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            pending.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        pending.extend(ast.iter_child_nodes(node))


def import_graph() -> dict[str, set[str]]:
    """{module: the tfamp modules it imports}."""
    known = modules()

    def resolve(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in known}
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                           for alias in node.names]
            for target in targets:
                if target.split(".")[0] != "tfamp":
                    continue
                resolved = resolve(target)
                if resolved is not None and resolved != name:
                    graph[name].add(resolved)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    counter = [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def layer_of(module: str) -> int | None:
    for number, pattern in LAYERS:
        if re.fullmatch(pattern, module):
            return number
    return None


def test_the_import_graph_sees_function_level_imports():
    # A planted circle through a function-level import, as four of them were.
    tree = ast.parse("def f():\n    from tfamp.b import x\n\nif TYPE_CHECKING:\n"
                     "    from tfamp.c import y\n")
    names = sorted(n.module for n in _imports(tree))
    assert names == ["tfamp.b"]
    assert cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]


def test_no_import_circle_anywhere_in_tfamp():
    found = cycles(import_graph())
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_every_module_has_a_layer():
    assert [m for m in modules() if layer_of(m) is None] == []


def test_lower_layers_never_import_higher_ones():
    upward = []
    for module, targets in sorted(import_graph().items()):
        for target in sorted(targets):
            if layer_of(target) > layer_of(module):
                upward.append(f"{module} (layer {layer_of(module)}) imports {target} "
                              f"(layer {layer_of(target)})")
    assert not upward, "\n".join(upward)


@pytest.mark.parametrize("low, high", [("tfamp.rewrite", "tfamp.keras"),
                                       ("tfamp.rewrite", "tfamp.runtime"),
                                       ("tfamp.rewrite", "tfamp.cli"),
                                       ("tfamp.numerics", "tfamp.keras"),
                                       ("tfamp.keras", "tfamp.runtime.startup")])
def test_named_layer_pairs(low, high):
    graph = import_graph()
    offenders = sorted(f"{m} -> {t}" for m, targets in graph.items() if m.startswith(low)
                       for t in targets if t.startswith(high))
    assert not offenders, offenders
