"""``autoremat.solvers``: the registry, :func:`solve` (including ``"auto"``) and the finalisation.

Every registered solver has the one signature and, called through :data:`SOLVERS`, returns a plan
:func:`autoremat.apply` can run (the graph's identity, replay tails, predictions), as ``solve`` does.
The three budget cases through ``solve`` for ``none``, ``chen`` and ``"auto"``; golden cases; no
plan over budget is returned (the property that extra time never rises with the budget:
``test_chen.py``).
"""

from __future__ import annotations

import dataclasses
import inspect

import networkx as nx
import pytest
from _plans import check_plan

import autoremat
from autoremat import SOLVERS, Graph, InfeasibleBudgetError, solve
from autoremat.cost import no_recompute_plan, unoptimised_peak_bytes
from autoremat.solvers import SOLVER_FUNCTIONS, bare_solver
from autoremat.solvers.least import auto_lattice_least

N = 20
SIZE = 100


def long_chain() -> Graph:
    return Graph.chain([SIZE] * N, [float(i + 1) for i in range(N)])


# ---------------------------------------------------------------------- registry and API
def test_registry():
    assert {"none", "chen"} <= set(SOLVERS)
    assert autoremat.SOLVERS is SOLVERS
    assert set(SOLVERS) == set(SOLVER_FUNCTIONS)
    for name, fn in SOLVERS.items():
        assert callable(fn), name
        assert fn.solve is SOLVER_FUNCTIONS[name] is bare_solver(name) and fn.name == name
        params = inspect.signature(fn).parameters
        assert list(params)[:2] == ["graph", "budget_bytes"], name
        assert params["config"].kind is inspect.Parameter.KEYWORD_ONLY, name
        assert params["config"].default is None, name


def test_registry_functions_called_directly():
    """``SOLVERS[name](g, b)`` is what ``solve(g, b, solver=name)`` returns: the same plan, with
    everything apply reads, and the same refusal below the solver's minimum."""
    g = long_chain()
    g.meta["mode"] = "fx"
    peak = unoptimised_peak_bytes(g)
    for name, fn in SOLVERS.items():
        for budget in (peak, int(0.7 * peak)):
            try:
                want = solve(g, budget, solver=name)
            except InfeasibleBudgetError as err:
                with pytest.raises(InfeasibleBudgetError) as got:
                    fn(g, budget)
                assert got.value.min_budget_bytes == err.min_budget_bytes
                continue
            plan = fn(g, budget)
            check_plan(g, plan, budget, name)
            timing = {k for k in plan.options if k.endswith("_seconds")}  # milp reports its run time
            assert {k: v for k, v in plan.options.items() if k not in timing} == {
                k: v for k, v in want.options.items() if k not in timing}, name
            assert dataclasses.replace(plan, options={}) == dataclasses.replace(want, options={}), name
            assert plan.graph_mode == "fx" and plan.node_names == tuple(f"n{i}" for i in range(N))
        with pytest.raises(ValueError, match="budget_bytes"):
            fn(g, "50%")


def test_a_registered_solvers_plan_applies():
    """The plan of a registered solver called directly runs under :func:`autoremat.apply`, with
    the gradients of the unpatched model."""
    import copy

    import torch

    def grads(model: torch.nn.Module) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        out = model(*args)
        (out if isinstance(out, torch.Tensor) else out[0]).float().sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    model, args = autoremat.zoo.build("vgg19")
    g = autoremat.capture(model, args, repeats=1, warmup=0)
    peak = unoptimised_peak_bytes(g)
    reference = grads(copy.deepcopy(model))
    for name in ("chen", "dp-approx", "xla-greedy"):
        least = autoremat.min_budget(g, name)
        assert least < peak
        plan = SOLVERS[name](g, least)
        assert plan.recompute_segments and plan.graph_mode == g.meta["mode"] and plan.node_names
        patched = autoremat.apply(copy.deepcopy(model), plan)
        assert all(torch.equal(a, b) for a, b in zip(grads(patched), reference)), name


def test_config_objects_are_recorded_as_options():
    from autoremat.solvers.chen import ChenConfig

    g = long_chain()
    plan = SOLVERS["chen"](g, 2000, config=ChenConfig(thresholds=4))
    assert plan.options["thresholds"] == 4 == solve(g, 2000, solver="chen", thresholds=4).options["thresholds"]


def test_unknown_solver():
    with pytest.raises(ValueError) as err:
        solve(long_chain(), 10**9, solver="magic")
    msg = str(err.value)
    assert "'magic'" in msg and "'chen'" in msg and "'none'" in msg and "auto" in msg


@pytest.mark.parametrize("bad", [None, "graph", nx.DiGraph(), 42])
def test_not_a_graph(bad):
    with pytest.raises(TypeError, match="autoremat.Graph"):
        solve(bad, 10**9)


def test_bad_budget():
    with pytest.raises(ValueError, match="budget="):
        solve(long_chain(), "lots", solver="chen")


def test_budget_forms_through_solve():
    g = long_chain()
    peak = unoptimised_peak_bytes(g)
    assert solve(g, "50%", solver="chen").budget_bytes == peak // 2
    assert solve(g, 0.75, solver="chen").budget_bytes == int(peak * 3 // 4)
    assert solve(g, "1MB", solver="none").budget_bytes == 10**6
    plan = solve(g, "auto", solver="none")  # host memory dwarfs a 2 kB graph
    assert plan.budget_bytes > peak and plan.recompute_segments == []


# ---------------------------------------------------------------------- three budget cases
@pytest.mark.parametrize("solver", ["none", "chen", "auto"])
def test_not_binding(solver):
    g = long_chain()
    peak = unoptimised_peak_bytes(g)
    for budget in (peak, 2 * peak, 10**12):
        plan = solve(g, budget, solver=solver)
        check_plan(g, plan, budget, "none" if solver == "auto" else solver)
        assert plan.recompute_segments == []
        assert plan.predicted_peak_bytes == peak
        assert plan.predicted_extra_time_s == 0.0


@pytest.mark.parametrize("solver", ["chen", "auto"])
def test_binding(solver):
    g = long_chain()
    peak = unoptimised_peak_bytes(g)
    for frac in (0.95, 0.8, 0.6):
        budget = int(peak * frac)
        plan = solve(g, budget, solver=solver)
        check_plan(g, plan, budget, "chen" if solver == "chen" else plan.solver)
        if solver == "auto":  # auto picks the least extra time among the registered solvers
            assert plan.solver in ("chen", "dp-approx")
            assert plan.predicted_extra_time_s <= solve(g, budget, solver="chen").predicted_extra_time_s
        assert plan.recompute_segments, frac
        assert plan.predicted_peak_bytes <= budget < peak
        assert plan.predicted_extra_time_s > 0.0


def test_binding_none_is_infeasible():
    g = long_chain()
    peak = unoptimised_peak_bytes(g)
    with pytest.raises(InfeasibleBudgetError) as err:
        solve(g, peak - 1, solver="none")
    assert err.value.min_budget_bytes == peak
    assert err.value.budget_bytes == peak - 1
    assert err.value.solver == "none"


@pytest.mark.parametrize("solver", ["none", "chen", "auto"])
@pytest.mark.parametrize("budget", [0, 1, 500])
def test_infeasible(solver, budget):
    g = long_chain()
    with pytest.raises(InfeasibleBudgetError) as err:
        solve(g, budget, solver=solver)
    e = err.value
    assert isinstance(e, ValueError)
    assert e.solver == solver and e.budget_bytes == budget
    assert e.min_budget_bytes is not None and e.min_budget_bytes > budget
    assert str(e.min_budget_bytes) in str(e)
    # the reported minimum is met exactly
    plan = solve(g, e.min_budget_bytes, solver=solver)
    check_plan(g, plan, e.min_budget_bytes, plan.solver)
    assert plan.predicted_peak_bytes == e.min_budget_bytes
    with pytest.raises(InfeasibleBudgetError):
        solve(g, e.min_budget_bytes - 1, solver=solver)


def test_auto_minimum_is_the_least_of_the_solvers():
    g = long_chain()
    mins = {}
    for name in ("none", "chen", "dp-approx", "auto"):
        with pytest.raises(InfeasibleBudgetError) as err:
            solve(g, 0, solver=name)
        mins[name] = err.value.min_budget_bytes
    lattice = auto_lattice_least(g)  # auto's lattice search on this small graph (milp.exact.auto_least_peak)
    assert lattice is not None
    assert mins["auto"] == min(mins["none"], mins["chen"], mins["dp-approx"], lattice) < mins["none"]


# ---------------------------------------------------------------------- golden cases
@pytest.mark.parametrize("solver", ["none", "chen", "auto"])
def test_empty_graph(solver):
    g = Graph()
    plan = solve(g, 0, solver=solver)
    check_plan(g, plan, 0, "none" if solver == "auto" else solver)
    assert plan.segments == []


@pytest.mark.parametrize("solver", ["none", "chen", "auto"])
def test_zero_size_tensors(solver):
    g = Graph.chain([0] * 6)
    plan = solve(g, 0, solver=solver)
    check_plan(g, plan, 0, "none" if solver == "auto" else solver)
    assert plan.recompute_segments == [] and plan.predicted_peak_bytes == 0


def test_single_node():
    g = Graph.chain([100])
    assert solve(g, 200, solver="chen").recompute_segments == []
    with pytest.raises(InfeasibleBudgetError) as err:
        solve(g, 199, solver="chen")
    assert err.value.min_budget_bytes == 200


def test_a_solver_plan_over_budget_is_never_returned(monkeypatch):
    """Whatever a solver returns, solve() rejects a plan that simulates over the budget."""
    import autoremat.solvers as solvers

    g = long_chain()
    peak = unoptimised_peak_bytes(g)
    monkeypatch.setitem(solvers.SOLVERS, "liar", lambda graph, budget, *, config=None: no_recompute_plan(graph))
    with pytest.raises(InfeasibleBudgetError) as err:
        solve(g, peak - 1, solver="liar")
    assert err.value.min_budget_bytes == peak



@pytest.mark.parametrize("seed", range(4))
def test_first_fit_finds_a_plan_exactly_where_solve_does(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``first_fit`` (the batch-size search's probes): a plan that fits wherever the full solve
    finds one, the same error where it does not; no polish or chain search once a plan fits."""
    import autoremat.solvers as solvers_pkg
    from _graphs import random_dag

    g = random_dag(20 + 7 * seed, 5 + seed)
    peak = unoptimised_peak_bytes(g)
    least = solvers_pkg.least_budget(g)
    budgets = sorted({least - 1, least, *(int(f * peak) for f in (0.3, 0.5, 0.7, 0.9)), peak})
    full: dict[int, int | None] = {}
    for b in budgets:
        try:
            full[b] = solve(g, b).predicted_peak_bytes
        except InfeasibleBudgetError as err:
            full[b], least_said = None, err.min_budget_bytes
    calls: list[str] = []
    for name in ("_polished", "_chain_for_auto"):
        real = getattr(solvers_pkg, name)
        monkeypatch.setattr(solvers_pkg, name, lambda *a, _n=name, _r=real: calls.append(_n) or _r(*a))
    for b in budgets:
        calls.clear()
        try:
            plan = solve(g, b, first_fit=True)
        except InfeasibleBudgetError as err:
            assert full[b] is None and err.min_budget_bytes == least_said, b
            continue
        assert full[b] is not None and plan.predicted_peak_bytes <= b and not calls, (b, calls)


def test_first_fit_asks_the_rescue_searches_where_no_solver_fits() -> None:
    """Where only auto's lattice search reaches the budget (42 bytes on this graph, see
    tests/solvers/milp/test_exact.py), ``first_fit`` finds that plan too."""
    from _graphs import random_dag

    g = random_dag(40, 7)
    plan = solve(g, 42, first_fit=True)
    assert plan.solver == "milp" and plan.predicted_peak_bytes <= 42
