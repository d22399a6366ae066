"""The ``"milp"`` solver: exact on small graphs, its program checked against the simulator."""

from __future__ import annotations

import builtins
import logging
import random

import networkx as nx
import pytest
from _graphs import random_dag, with_held_outputs

import autoremat
from autoremat.errors import InfeasibleBudgetError
from autoremat.graph import Graph
from autoremat.plan import Plan, validate_plan
from autoremat.cost import simulate, unoptimised_peak_bytes
from autoremat.solvers.evaluation.bruteforce import solve_bruteforce
from autoremat.solvers.kusumoto import solve_dp_exact

from .milp_oracle import best_within, space_table

pytest.importorskip("highspy")

from autoremat.solvers.milp import min_budget_milp, optimality_gap, solve_milp  # noqa: E402
from autoremat.solvers.milp import search as milp_search  # noqa: E402
from autoremat.solvers.milp.formulation import constant_floor  # noqa: E402
from autoremat.solvers.milp.search import Search, judge  # noqa: E402

FAST = {"seeds": False, "time_limit_s": 30.0}
SEEDS = list(range(10))


def _budgets(table) -> list[int]:
    peaks = sorted({p for p, _, _ in table})
    return peaks[:: max(1, len(peaks) // 3)][:3]


@pytest.mark.parametrize("program", [False, True], ids=["lattice", "program"])
@pytest.mark.parametrize("seed", SEEDS)
def test_equals_brute_force_over_its_plan_space(seed, program):
    """Both stages: the lattice (``k`` not given) and the HiGHS program (``k`` = the node count)."""
    g = random_dag(seed, 3 + seed % 3)
    table = space_table(g)
    config = {**FAST, "k": len(g)} if program else FAST
    for budget in _budgets(table):
        plan = solve_milp(g, budget, config=config)
        validate_plan(g, plan)
        sim = simulate(g, plan)
        assert sim.peak_bytes <= budget
        assert sim.extra_time_s == pytest.approx(best_within(table, budget)), (seed, budget)
        assert plan.options["milp_status"] == "optimal" and plan.options["optimality_gap"] == 0.0
        if unoptimised_peak_bytes(g) > budget:  # else nothing is recomputed, optimal on any basis
            assert plan.options["milp_bound_basis"] == ("program" if program else "exact model")
            assert plan.options["k"] == len(g)


@pytest.mark.parametrize("program", [False, True], ids=["lattice", "program"])
@pytest.mark.parametrize("seed", range(12))
def test_equals_brute_force_when_the_loop_keeps_the_output(seed, program):
    """Storages the returned object holds to the end of backward (``output_kept="step"``) are a
    constant of every loss, replay and backward row: without them the program's optimistic rows
    kept proposing plans the simulator refuses (seed 11: no plan within the time limit)."""
    g = with_held_outputs(random_dag(seed, 3 + seed % 3), seed, share=0.4, kept="step")
    table = space_table(g)
    config = {**FAST, "k": len(g)} if program else FAST
    for budget in _budgets(table):
        plan = solve_milp(g, budget, config=config)
        assert simulate(g, plan).peak_bytes <= budget
        assert simulate(g, plan).extra_time_s == pytest.approx(best_within(table, budget)), (seed, budget)
        assert plan.options["milp_status"] == "optimal"


def test_a_lattice_plan_the_simulator_refuses_leaves_the_program_alone(monkeypatch, caplog):
    """Where the exact model's optimum does not fit in simulation, the program searches alone
    (its bound is the simulator's relaxation) and still finds the optimum."""
    from autoremat.solvers.milp import exact

    g = random_dag(8, 5)
    table = space_table(g)
    budget = _budgets(table)[0] + 2
    assert best_within(table, budget) > 0
    monkeypatch.setattr(exact, "judge", lambda graph, plan, tails=False: (budget + 1, 0.0))
    with caplog.at_level(logging.INFO, logger="autoremat.solvers.milp"):
        plan = solve_milp(g, budget, config=FAST)
    assert any("program alone" in r.getMessage() for r in caplog.records)
    assert plan.options["milp_bound_basis"] == "program" and plan.options["milp_status"] == "optimal"
    assert simulate(g, plan).extra_time_s == pytest.approx(best_within(table, budget))


def test_a_lattice_stopped_at_its_time_share_hands_over_to_the_program(monkeypatch):
    from autoremat.solvers.milp import exact

    g = random_dag(8, 5)
    table = space_table(g)
    budget = _budgets(table)[0] + 2
    monkeypatch.setattr(exact, "LATTICE_SHARE", 0.0)
    plan = solve_milp(g, budget, config=FAST)
    assert plan.options["milp_status"] == "optimal" and plan.options["milp_bound_basis"] == "program"
    assert simulate(g, plan).extra_time_s == pytest.approx(best_within(table, budget))
    assert min_budget_milp(g, config=FAST) == min(p for p, _, _ in table)


@pytest.mark.parametrize("seed", SEEDS[:6])
def test_never_worse_than_dp_exact_or_the_brute_force(seed):
    """Its space holds every plan they consider (and plain segments between recomputed ones)."""
    g = random_dag(seed, 3 + seed % 3)
    for budget in _budgets(space_table(g)):
        got = simulate(g, solve_milp(g, budget, config=FAST)).extra_time_s
        for other in (solve_bruteforce, solve_dp_exact):
            try:
                theirs = simulate(g, other(g, budget)).extra_time_s
            except InfeasibleBudgetError:
                continue
            assert got <= theirs + 1e-9, (other.__name__, seed, budget)


def _fixed(search: Search, plan: Plan) -> None:
    enc = search.f.encode(plan)
    assert enc is not None
    for col, val in enc.items():
        search.h.changeColBounds(col, val, val)


@pytest.mark.parametrize("seed", range(12))
def test_program_against_the_simulator(seed):
    """Property: at every plan, the program's time is the simulator's extra time (no tails) and its
    least peak is at most the simulated one (the relaxation admits every plan that fits)."""
    rng = random.Random(seed)
    g = random_dag(100 + seed, 4 + seed % 3)
    if seed % 3 == 2:  # some storages held by the returned object, to the loss or to the end
        with_held_outputs(g, seed, share=0.4)
    table = space_table(g)
    from autoremat.solvers.milp.highs import run

    for peak, extra, plan in rng.sample(table, min(6, len(table))):
        mem = Search(g, len(g), "memory")
        _fixed(mem, plan)
        res = run(mem.h, mem.highspy, 20)
        assert res.status == "optimal"
        assert res.objective / mem.f.mem_scale <= peak * (1 + 1e-9) + 1e-6, (seed, plan.segments)
        tim = Search(g, len(g), "time")
        tim.f.set_budget(tim.h, 10**12)
        _fixed(tim, plan)
        res = run(tim.h, tim.highspy, 20)
        assert res.status == "optimal"
        assert res.objective / tim.f.time_scale == pytest.approx(extra, abs=1e-6), (seed, plan.segments)
        assert judge(g, plan) == (peak, extra)


def test_the_loss_tensor_is_in_every_row_after_the_loss():
    """``loss_held_bytes`` (the loss tensor, live from the loss to the step's end) is a constant of
    the loss, replay and backward rows and of the plan-independent floor: on the chain 10, 20, 30
    with 7 held bytes the program's least peak of each plan of its space is the simulated one, 7
    above the chain's without (it was the chain's without: rows below the peak they bound)."""
    from autoremat.solvers.milp.highs import run

    base = Graph.chain([10, 20, 30])
    g = base.copy()
    g.meta["loss_held_bytes"] = 7
    assert constant_floor(g) == constant_floor(base) + 7 == 67
    for peak, _, plan in space_table(g):
        mem = Search(g, len(g), "memory")
        _fixed(mem, plan)
        res = run(mem.h, mem.highspy, 20)
        assert res.objective / mem.f.mem_scale == pytest.approx(peak) and peak == simulate(base, plan).peak_bytes + 7


def test_solve_stamps_the_simulators_numbers():
    g = random_dag(7, 6)
    budget = int(unoptimised_peak_bytes(g) * 0.8)
    plan = autoremat.solve(g, budget, solver="milp", seeds=False)
    sim = simulate(g, plan)
    assert plan.solver == "milp" and plan.predicted_peak_bytes == sim.peak_bytes <= budget
    assert plan.predicted_extra_time_s == sim.extra_time_s
    assert "of the optimum (proven" in plan.describe() or "optimal (proven" in plan.describe()
    assert Plan.from_json(plan.to_json()).segments == plan.segments


def test_infeasible_budget_names_the_least_budget():
    g = random_dag(4, 5)
    least = min(p for p, _, _ in space_table(g))
    with pytest.raises(InfeasibleBudgetError) as info:
        solve_milp(g, least - 1, config=FAST)
    assert info.value.min_budget_bytes == least
    assert min_budget_milp(g, config=FAST) == least
    assert autoremat.min_budget(g, "milp", config=FAST) == least
    assert simulate(g, solve_milp(g, least, config=FAST)).peak_bytes <= least


def test_missing_highspy_names_the_extra(monkeypatch):
    real = builtins.__import__

    def fake(name, *args, **kwargs):
        if name == "highspy" or name.startswith("highspy."):
            raise ImportError("No module named 'highspy'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake)
    with pytest.raises(ImportError, match=r'pip install "autoremat\[milp\]"'):
        solve_milp(random_dag(1, 4), 10)
    with pytest.raises(ImportError, match=r'pip install "autoremat\[milp\]"'):
        autoremat.min_budget(random_dag(1, 4), "milp")


def test_cli_plan_reports_the_gap(capsys, monkeypatch):
    from autoremat import cli

    argv = ["plan", "--model", "vgg19", "--device", "meta", "--solver", "chen", "--budget", "98%",
            "--gap", "--gap-time-limit", "5"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "extra time" in out and "(proven" in out and "as it runs (replays to their tails)" in out
    assert cli.main([*argv, "--gap-price", "whole"]) == 0
    out = capsys.readouterr().out
    assert "(proven" in out and "as it runs (replays to their tails)" not in out

    real = builtins.__import__

    def fake(name, *args, **kwargs):
        if name == "highspy":
            raise ImportError("No module named 'highspy'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake)
    assert cli.main(argv) == 2
    assert 'pip install "autoremat[milp]"' in capsys.readouterr().out.replace("\n", "")


def test_options_are_checked():
    g = random_dag(1, 4)
    for bad in ({"k": 0}, {"k": 1.5}, {"time_limit_s": 0}, {"objective": "speed"}, {"threads": 0}):
        with pytest.raises(ValueError):
            solve_milp(g, 100, config=bad)
    with pytest.raises(ValueError, match="budget_bytes"):
        solve_milp(g, -1)


def _wide(seed: int, n: int) -> Graph:
    """A chain with random skips, sizes and times: the program does not close on it in a second."""
    rng = random.Random(seed)
    nxg = nx.DiGraph()
    for v in range(n):
        size = rng.randint(1, 40)
        nxg.add_node(v, name=f"n{v}", out_bytes=size, alloc_bytes=size, time_s=float(rng.randint(1, 9)),
                     bwd_time_s=2.0, saves=(v,), is_output=v == n - 1)
        if v:
            nxg.add_edge(v - 1, v)
        if v > 3 and rng.random() < 0.3:
            nxg.add_edge(rng.randrange(v - 3), v)
    return Graph(nxg, {"mode": "synthetic", "loss_saves": [n - 1]})


def test_time_limit_returns_the_best_plan_with_a_gap(caplog, monkeypatch):
    g = _wide(0, 60)
    budget = int(unoptimised_peak_bytes(g) * 0.45)
    monkeypatch.setattr(milp_search, "PROGRESS_EVERY_S", 0.0)
    with caplog.at_level(logging.INFO, logger="autoremat.solvers.milp"):
        plan = solve_milp(g, budget, config={"time_limit_s": 2.0, "k": 8})
    assert plan.options["milp_status"] == "time_limit"
    gap = plan.options["optimality_gap"]
    assert 0.0 < gap <= 1.0
    sim = simulate(g, plan)
    assert sim.peak_bytes <= budget
    assert plan.options["optimum_bound_s"] == pytest.approx(sim.extra_time_s * (1 - gap))
    assert any("incumbent" in r.getMessage() and "gap" in r.getMessage() for r in caplog.records)


def test_optimality_gap_of_another_solvers_plan():
    g = random_dag(3, 6)
    with pytest.raises(InfeasibleBudgetError) as info:
        autoremat.solve(g, 0, solver="chen")
    budget = info.value.min_budget_bytes  # where Chen's plan binds
    chen = autoremat.solve(g, budget, solver="chen")
    gap = optimality_gap(g, chen, budget, time_limit_s=30)
    best = best_within(space_table(g), budget)
    assert gap.proven_optimal and gap.bound_s == pytest.approx(best)
    assert gap.gap == pytest.approx(0.0 if gap.extra_time_s == 0 else (gap.extra_time_s - best) / gap.extra_time_s)
    assert "optimum" in gap.describe() or "optimal" in gap.describe()
    assert gap.describe(as_run_s=gap.extra_time_s) == gap.describe()  # a plan that runs as priced: nothing to add
    other = gap.describe(as_run_s=gap.extra_time_s / 2 + 1e-3)  # one with replay tails: both, each named
    assert f"replaying segments whole ({gap.extra_time_s / 2 + 1e-3:.4g} s as it runs, with its replay tails)" in other


@pytest.mark.parametrize("k", [1, 2, 3])
def test_at_most_k_segments(k):
    g = random_dag(21, 5)
    table = space_table(g, k)
    for budget in sorted({p for p, _, _ in table})[:3]:
        plan = solve_milp(g, budget, config={**FAST, "k": k})
        assert len(plan.segments) <= k and plan.options["k"] == k
        assert simulate(g, plan).extra_time_s == pytest.approx(best_within(table, budget))
