"""Requirements on torch, Lightning and Accelerate: ranges for users, one pinned version for our installs.

A library that pins ``torch==X`` makes pip replace the torch a user already has (often a CUDA
build they chose), and the same holds for Lightning and Accelerate. autoremat requires ranges
whose ends the test suite has passed on (``TESTED``: torch 2.11, the PyTorch of the GPU machines
the GPU benchmark runs on, with Lightning 2.5.6 and Accelerate 1.10.1; and the pinned torch
2.13.0, Lightning 2.6.6, Accelerate 1.15.0), and the README / CI install command pins one version
of each inside them through ``constraints.txt`` (an unpinned resolve would pull a newer CUDA
build of torch, several GB).
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTED = {"torch": ("2.11.0", "2.13.0"), "lightning": ("2.5.6", "2.6.6"), "accelerate": ("1.10.1", "1.15.0")}
UNTESTED = {"torch": ("2.10.0", "2.14.1"), "lightning": ("2.5.5", "2.7.0"), "accelerate": ("1.10.0", "1.16.0")}


def _requirements() -> dict[str, str]:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    from packaging.requirements import Requirement

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return {r.name: str(r.specifier) for r in map(Requirement, deps)}


@pytest.mark.parametrize("name", sorted(TESTED))
def test_required_as_the_tested_range(name: str) -> None:
    from packaging.specifiers import SpecifierSet

    spec = SpecifierSet(_requirements()[name])
    assert all(spec.contains(v) for v in TESTED[name]), spec
    assert not any(spec.contains(v) for v in UNTESTED[name]), f"{name}{spec} admits an untested version"


@pytest.mark.parametrize("name", sorted(TESTED))
def test_installs_pin_one_version_inside_the_range(name: str) -> None:
    from packaging.specifiers import SpecifierSet

    pins = [line.split("==", 1)[1].strip() for line in (ROOT / "constraints.txt").read_text().splitlines()
            if line.startswith(f"{name}==")]
    assert pins == [TESTED[name][1]]
    assert SpecifierSet(_requirements()[name]).contains(pins[0])
    ci = (ROOT / ".ci" / "run").read_text()
    assert "-c constraints.txt" in ci and "-c constraints.txt" in (ROOT / "README.md").read_text()
