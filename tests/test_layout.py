"""The planning side's layout rules (issue 23): module and function sizes, tests mirroring src.

* No module over 500 lines anywhere in ``src/autoremat``.
* No function over 80 lines there unless its docstring says why ("Long by design: ...").
* Every module in ``cost/``, ``solvers/``, ``offload/``, ``graph.py``, ``plan.py``,
  ``plan_schema.py`` and ``replay_tail.py`` has a test module of its own: ``tests/<path>/test_<module>.py``, and a
  package's ``__init__`` ``tests/<path>/test_<package>.py``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "src" / "autoremat"
PARTS = ["cost", "solvers", "offload"]
FILES = ["graph.py", "plan.py", "plan_schema.py", "replay_tail.py"]
UNTESTED_OK = {"solvers/milp/config.py", "solvers/milp/facts.py", "solvers/milp/formulation.py",
               "solvers/milp/highs.py", "solvers/milp/rows.py", "solvers/milp/search.py",
               "solvers/_config.py"}
"""Modules covered by their package's test module rather than one of their own: milp's parts
(``tests/solvers/milp/test_milp.py`` drives the formulation, the rows and the search through the
solver) and ``_config.py`` (``tests/solvers/test_config.py``, named for what it holds)."""


def modules() -> list[Path]:
    return sorted([p for part in PARTS for p in (PKG / part).rglob("*.py")] + [PKG / f for f in FILES])


@pytest.mark.parametrize("path", sorted(PKG.rglob("*.py")), ids=lambda p: str(p.relative_to(PKG)))
def test_module_and_function_sizes(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    assert text.count("\n") <= 500, f"{path.relative_to(PKG)}: {text.count(chr(10))} lines (at most 500)"
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 80:
            assert "Long by design" in (ast.get_docstring(node) or ""), (
                f"{path.relative_to(PKG)}: {node.name} has {node.end_lineno - node.lineno + 1} lines; split it or "
                "say why in its docstring ('Long by design: ...')")


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(PKG)))
def test_every_module_has_a_test_module(path: Path) -> None:
    rel = path.relative_to(PKG)
    if str(rel) in UNTESTED_OK:
        return
    folder = ROOT / "tests" / rel.parent
    name = rel.parent.name if rel.name == "__init__.py" else rel.stem
    assert (folder / f"test_{name}.py").exists(), f"{rel}: no tests/{rel.parent}/test_{name}.py"


def test_tests_of_a_subpackage_module_live_in_its_mirrored_folder() -> None:
    """``tests/test_<name>.py`` at the top is for a top-level module (``graph.py``) or a suite that
    crosses modules (semantics, bad inputs, README); a test module named for a module of a
    subpackage (``runtime/region.py``) lives in ``tests/runtime/``."""
    top = {p.stem.lstrip("_") for p in PKG.glob("*.py")}
    nested = {p.stem.lstrip("_") for p in PKG.rglob("*.py") if p.parent != PKG and p.stem != "__init__"}
    nested |= {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    misplaced = [t.name for t in (ROOT / "tests").glob("test_*.py") if t.stem[5:] in nested - top]
    assert not misplaced, f"move these next to their module's path under tests/: {misplaced}"
