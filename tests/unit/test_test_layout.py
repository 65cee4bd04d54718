"""The test tree keeps its own rules: every integration test module carries the `integration`
marker at module level (so `-m "not integration"` really leaves them out), helper modules hold
no tests, and no unit test module marks itself integration (it belongs in tests/integration)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def _module_marks(tree: ast.Module) -> set[str]:
    """Names X of `pytest.mark.X` in a module-level `pytestmark = ...` (one or a list)."""
    marks: set[str] = set()
    for node in tree.body:
        if not isinstance(node, ast.Assign):
            continue
        if not any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            continue
        for sub in ast.walk(node.value):
            if (
                isinstance(sub, ast.Attribute)
                and isinstance(sub.value, ast.Attribute)
                and sub.value.attr == "mark"
            ):
                marks.add(sub.attr)
    return marks


def _tests_in(tree: ast.Module) -> list[str]:
    return [
        n.name
        for n in tree.body
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name.startswith("test_")
    ]


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def test_every_integration_module_is_marked():
    unmarked = [
        p.name
        for p in sorted((TESTS / "integration").glob("test_*.py"))
        if "integration" not in _module_marks(_parse(p))
    ]
    assert not unmarked, f"no module-level pytestmark = pytest.mark.integration: {unmarked}"


def test_no_unit_module_is_an_integration_module():
    marked = [
        p.name
        for p in sorted((TESTS / "unit").glob("test_*.py"))
        if "integration" in _module_marks(_parse(p))
    ]
    assert not marked, f"integration tests in tests/unit (move them): {marked}"


def test_helper_modules_hold_no_tests_and_test_modules_hold_some():
    for folder in ("unit", "integration"):
        for p in sorted((TESTS / folder).glob("*.py")):
            tests = _tests_in(_parse(p))
            if p.name.startswith("test_"):
                assert tests, f"{folder}/{p.name} holds no tests: name it as a helper"
            else:
                assert not tests, f"{folder}/{p.name} is not collected but defines {tests}"


def test_the_slow_list_names_tests_that_exist():
    from .conftest import SLOW

    for name, tests in SLOW.items():
        path = TESTS / "unit" / name
        assert path.exists(), f"SLOW lists {name}, which is gone"
        defined = set(_tests_in(_parse(path)))
        missing = sorted(set(tests or ()) - defined)
        assert not missing, f"SLOW lists {name}::{missing}, which are gone"
