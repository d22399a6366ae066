"""Typed solver options: one policy for every registered solver (autoremat.solvers._config)."""

from __future__ import annotations

import dataclasses

import pytest

import autoremat
from autoremat import SOLVERS, Graph, solve
from autoremat.solvers import CONFIGS, ChenConfig, SolverConfig
from autoremat.solvers.kusumoto import DPApproxConfig


def _graph() -> Graph:
    return Graph.chain([100, 300, 200, 400, 100, 300], [1.0, 2.0, 1.0, 3.0, 1.0, 1.0])


def test_every_registered_solver_has_a_config_class() -> None:
    assert set(CONFIGS) == set(SOLVERS)
    for name, cls in CONFIGS.items():
        assert issubclass(cls, SolverConfig) and dataclasses.is_dataclass(cls)
        assert cls.solver == name
        cls()  # the defaults are valid


@pytest.mark.parametrize("name", sorted(SOLVERS))
def test_unknown_option_is_a_value_error_naming_the_accepted(name: str) -> None:
    g = _graph()
    with pytest.raises(ValueError, match=rf"{name}: unknown option\(s\) \['no_such_option'\]; it accepts") as info:
        SOLVERS[name](g, 10**9, config={"no_such_option": 1})
    for accepted in (f.name for f in dataclasses.fields(CONFIGS[name])):
        assert accepted in str(info.value)
    with pytest.raises(ValueError, match="unknown option"):
        solve(g, 10**9, solver=name, no_such_option=1)


@pytest.mark.parametrize("name", sorted(SOLVERS))
def test_defaults_and_typed_instances_solve_alike(name: str) -> None:
    g = _graph()
    budget = autoremat.simulate(g, autoremat.solve(g, 10**9, solver="none")).peak_bytes
    a = SOLVERS[name](g, budget, config=None)
    b = SOLVERS[name](g, budget, config=CONFIGS[name]())
    assert a.segments == b.segments and a.offload == b.offload


def test_typed_option_values_are_used_and_checked() -> None:
    g = _graph()
    assert ChenConfig.parse({"thresholds": 3}).thresholds == 3
    with pytest.raises(ValueError, match="thresholds"):
        SOLVERS["chen"](g, 10**9, config={"thresholds": 0})
    with pytest.raises(ValueError, match="objective"):
        DPApproxConfig(objective="speed")
    with pytest.raises(ValueError, match="is a ChenConfig"):
        SOLVERS["dp-approx"](g, 10**9, config=ChenConfig())
    assert "thresholds" in ChenConfig.options_help() and "default 48" in ChenConfig.options_help()["thresholds"]


def test_auto_hands_each_solver_only_its_options() -> None:
    g = _graph()
    peak = autoremat.simulate(g, autoremat.solve(g, 10**9, solver="none")).peak_bytes
    plan = solve(g, int(peak * 0.7), solver="auto", thresholds=4, objective="memory")  # chen's and the DP's
    assert plan.solver in ("chen", "dp-approx")
    with pytest.raises(ValueError, match=r"accepted by none of the solvers it tries"):
        solve(g, int(peak * 0.7), solver="auto", no_such_option=1)


def test_grid_had_two_meanings_and_is_refused_with_the_new_names() -> None:
    """``grid`` was chen's number of thresholds and combined's number of budgets per base solver:
    under ``"auto"`` one value went to both. Now ``thresholds`` and ``budget_steps``."""
    g = _graph()
    for name, new in (("chen", "thresholds"), ("combined", "budget_steps")):
        with pytest.raises(ValueError, match=rf"{name}: option 'grid' is now called '{new}'"):
            SOLVERS[name](g, 10**9, config={"grid": 4})
        assert new in CONFIGS[name].options_help()
    with pytest.raises(ValueError, match="accepted by none of the solvers"):
        solve(g, 10**9, solver="auto", grid=4)
