"""The default suite's budget list names tests that exist (a renamed test would
silently come back into the default suite)."""

import ast
from pathlib import Path

from tests.default_budget import SLOW_IN_DEFAULT

HERE = Path(__file__).parent


def _test_functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.name for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}


def test_every_entry_names_a_test_function_that_exists():
    stale = []
    for entry in SLOW_IN_DEFAULT:
        file, _, name = entry.partition("::")
        path = HERE / file
        function = name.split("[", 1)[0]
        if not path.is_file() or function not in _test_functions(path):
            stale.append(entry)
    assert not stale, f"tests/default_budget.py names tests that do not exist: {stale}"


def test_a_listed_test_is_marked_slow_and_no_other():
    # conftest.py marks them before pyproject's -m 'not slow' deselects.
    from tests import conftest

    class Item:
        def __init__(self, entry):
            file, _, self.name = entry.partition("::")
            self.path = HERE / file
            self.marks = []

        def add_marker(self, mark):
            self.marks.append(mark.name)

    listed, other = Item(next(iter(SLOW_IN_DEFAULT))), Item("test_cli.py::test_x")
    conftest.pytest_collection_modifyitems([listed, other])
    assert listed.marks == ["slow"] and other.marks == []
