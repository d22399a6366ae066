"""Runtime requirements: ranges for users, one pinned version for our installs.

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
LOWEST = {"networkx": "3.2.1", "numpy": "1.26.4", "nvidia-ml-py": "12.535.161", "pyyaml": "6.0.1", "rich": "13.7.1",
          "jsonargparse": "4.39.0", "matplotlib": "3.9.0"}
"""The other runtime requirements: the suite passed with each at this version (together, with torch
2.13.0, Lightning 2.5.6 and Accelerate 1.10.1), which is where their ranges start; each range stops
below the major version after the one pinned in ``constraints.txt`` (with which the suite runs in CI)."""


def _requirements() -> dict[str, str]:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    from packaging.requirements import Requirement

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return {r.name: str(r.specifier) for r in map(Requirement, deps)}


def _pins(name: str) -> list[str]:
    """The versions ``constraints.txt`` pins ``name`` to (one, when it is pinned)."""
    return [line.split("==", 1)[1].strip() for line in (ROOT / "constraints.txt").read_text().splitlines()
            if line.split("==", 1)[0] == name]


@pytest.mark.parametrize("name", sorted(TESTED))
def test_required_as_the_tested_range(name: str) -> None:
    from packaging.specifiers import SpecifierSet

    spec = SpecifierSet(_requirements()[name])
    assert all(spec.contains(v) for v in TESTED[name]), spec
    assert not any(spec.contains(v) for v in UNTESTED[name]), f"{name}{spec} admits an untested version"


@pytest.mark.parametrize("name", sorted(TESTED))
def test_installs_pin_one_version_inside_the_range(name: str) -> None:
    from packaging.specifiers import SpecifierSet

    pins = _pins(name)
    assert pins == [TESTED[name][1]]
    assert SpecifierSet(_requirements()[name]).contains(pins[0])
    ci = (ROOT / ".ci" / "run").read_text()
    assert "-c constraints.txt" in ci and "-c constraints.txt" in (ROOT / "README.md").read_text()


@pytest.mark.parametrize("name", sorted(LOWEST))
def test_other_requirements_start_at_the_tested_version(name: str) -> None:
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    spec = SpecifierSet(_requirements()[name])
    low = Version(LOWEST[name])
    below = f"{low.major}.{low.minor}.{low.micro - 1}" if low.micro else f"{low.major}.{low.minor - 1}.99"
    assert spec.contains(LOWEST[name]) and not spec.contains(below), f"{name}{spec}"
    pins = _pins(name)
    assert len(pins) == 1 and spec.contains(pins[0]), (name, pins)
    after = f"{Version(pins[0]).major + 1}.0.0"
    assert not spec.contains(after), f"{name}{spec} admits {after}, a major version after the pinned {pins[0]}"


def test_python_versions_are_the_tested_ones() -> None:
    """3.11 is the lowest Python the pinned install resolves on (numpy, networkx, matplotlib and
    transformers at their pins need it) and the suite has run on 3.11, 3.12 and 3.13."""
    tomllib = pytest.importorskip("tomllib")
    from packaging.specifiers import SpecifierSet

    spec = SpecifierSet(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"])
    assert not spec.contains("3.10.13") and all(spec.contains(v) for v in ("3.11.7", "3.12.1", "3.13.0"))
