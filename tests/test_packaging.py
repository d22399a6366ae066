"""The torch requirement: a range for users, one pinned version for our installs.

A library that pins ``torch==X`` makes pip replace the torch a user already has (often a CUDA
build they chose). autoremat requires a range whose ends the test suite has passed on (torch 2.11,
the PyTorch of the GPU machines the GPU benchmark runs on, and 2.13), and the README / CI
install command pins one version inside it through ``constraints.txt`` (an unpinned resolve
would pull a newer CUDA build of several GB).
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTED = ("2.11.0", "2.13.0")


def _requirements() -> dict[str, str]:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    from packaging.requirements import Requirement

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return {r.name: str(r.specifier) for r in map(Requirement, deps)}


def test_torch_is_required_as_the_tested_range() -> None:
    from packaging.specifiers import SpecifierSet

    spec = SpecifierSet(_requirements()["torch"])
    assert all(spec.contains(v) for v in TESTED), spec
    assert not spec.contains("2.10.0") and not spec.contains("2.14.1"), f"{spec} admits an untested torch"


def test_installs_pin_one_torch_inside_the_range() -> None:
    from packaging.specifiers import SpecifierSet

    pins = [line.split("==", 1)[1].strip() for line in (ROOT / "constraints.txt").read_text().splitlines()
            if line.startswith("torch==")]
    assert pins == ["2.13.0"]
    assert SpecifierSet(_requirements()["torch"]).contains(pins[0])
    ci = (ROOT / ".ci" / "run").read_text()
    assert "-c constraints.txt" in ci and "-c constraints.txt" in (ROOT / "README.md").read_text()
