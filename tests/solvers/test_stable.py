"""Stable plans (autoremat.solvers.stable): captures that differ only by timing noise give one
plan; a plan clearly faster on the measured times still wins; deterministic times are solved once."""

from __future__ import annotations

import math
import random
import statistics

import pytest

import autoremat
from autoremat import Graph, solve
from autoremat.capture import timing_noise
from autoremat.solvers import stable
from autoremat.solvers.stable import DEFAULT_NOISE_TOLERANCE, is_measured, reference_graph


def _key(plan: autoremat.Plan) -> tuple:
    return plan.solver, tuple((s.nodes, s.recompute) for s in plan.segments), plan.offload


@pytest.fixture(scope="module")
def cpu_like() -> Graph:
    """A ResNet-50 (small) graph with CPU-like times (a per-op cost plus FLOP time), marked measured."""
    model, inputs = autoremat.zoo.build("resnet50", size="small")
    g = autoremat.capture(model, inputs, times="flops")
    for v in g.nodes:
        d = g.node(v)
        d["time_s"] = 100 * d["time_s"] + 20e-6
        d["bwd_time_s"] = 2 * d["time_s"]
    g.meta["time_source"] = "perf_counter"
    return g


def _noisy(g: Graph, seed: int, sigma: float) -> Graph:
    """``g`` as another capture on a loaded machine would see it: a global slow-down and
    per-node noise (log-normal), seeded."""
    rng = random.Random(seed)
    out = g.copy()
    scale = math.exp(rng.gauss(0, 0.3))
    for v in out.nodes:
        for attr in ("time_s", "bwd_time_s"):
            out.node(v)[attr] *= scale * math.exp(rng.gauss(0, sigma))
    return out


def test_noisy_captures_give_one_plan(cpu_like: Graph) -> None:
    captures = [_noisy(cpu_like, seed, sigma=0.2) for seed in range(3)]  # each a different fastest plan
    plans = [solve(g, "50%") for g in captures]
    fastest = {_key(solve(g, "50%", noise_tolerance=0)) for g in captures}
    assert len({_key(p) for p in plans}) == 1
    assert len(fastest) > 1  # without it the same noise picks several plans (the symptom)
    plan = plans[0]
    assert plan.options["stability"]["chosen"] == "reference"
    assert plan.options["stability"]["tolerance"] == DEFAULT_NOISE_TOLERANCE
    assert plan.predicted_peak_bytes <= plan.budget_bytes
    # its prediction is on the measured times, not the reference costs
    assert plan.predicted_extra_time_s == pytest.approx(autoremat.simulate(captures[0], plan).extra_time_s)


def _captured(g: Graph, seed: int, *, loaded: bool, stuck: dict[int, float] | None = None,
              repeats: int = 3) -> Graph:
    """``g`` as a capture sees it (median of ``repeats`` timed steps, ``time_noise`` from them),
    seeded: a 5 % jitter on a quiet machine; on a loaded one (what the issue's target met on the
    shared 2-core machine) also each time of each repeat slowed 5-100x with probability 0.2, and
    the nodes of ``stuck`` slowed by their factor in every repeat (there: the first convolution's
    forward, 78x in most repeats)."""
    rng = random.Random(seed)
    out, samples = g.copy(), []
    for v in out.nodes:
        for attr in ("time_s", "bwd_time_s"):
            xs = []
            for _ in range(repeats):
                x = g.node(v)[attr] * math.exp(rng.gauss(0, 0.05))
                if loaded and rng.random() < 0.2:
                    x *= rng.uniform(5, 100)
                if attr == "time_s" and v in (stuck or {}):
                    x *= stuck[v]
                xs.append(x)
            out.node(v)[attr] = statistics.median(xs)
            samples.append(xs)
    out.meta["time_noise"] = timing_noise(samples)
    return out


@pytest.fixture(scope="module")
def quiet_plan(cpu_like: Graph) -> autoremat.Plan:
    return solve(_captured(cpu_like, 0, loaded=False), "50%")


def test_loaded_captures_give_the_quiet_plan(cpu_like: Graph, quiet_plan: autoremat.Plan) -> None:
    """The issue-25 target on synthetic captures of a zoo graph: captures under load, one with
    the recomputed nodes slowed in every repeat, give the plan a quiet capture gives,
    because their own timing noise is larger than what the measured plans gain; with the 5 %
    tolerance alone (the rule that failed on the shared machine) that capture's measured plan,
    predicted faster by more than 5 % of the step, would have been taken instead."""
    # interference that stays on the nodes the quiet plan recomputes, 10x in every repeat (there:
    # the first convolution's forward 78x), looks like a real change (see the next test)
    stuck = dict.fromkeys(quiet_plan.recomputed_nodes, 10.0)
    captures = [_captured(cpu_like, seed, loaded=True, stuck=stuck if seed == 0 else None) for seed in range(3)]
    assert all(g.meta["time_noise"] > 0.3 for g in captures)
    plans = [solve(g, "50%") for g in captures]
    assert {_key(p) for p in plans} == {_key(quiet_plan)}
    assert all(p.options["stability"]["chosen"] == "reference" for p in plans)
    assert plans[0].options["stability"]["time_noise"] == round(captures[0].meta["time_noise"], 6)
    assert plans[0].options["stability"]["measured_plan_faster_by"] > DEFAULT_NOISE_TOLERANCE
    assert quiet_plan.options["stability"]["time_noise"] < DEFAULT_NOISE_TOLERANCE


def _two_branches() -> Graph:
    edges = [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 11), (0, 6), (6, 7), (7, 8), (8, 9), (9, 10), (10, 11)]
    g = Graph.from_edges(12, edges, out_bytes=[1000] * 12)
    g.meta["time_source"] = "perf_counter"
    return g


def test_a_real_change_of_times_changes_the_plan_of_quiet_captures() -> None:
    """The other direction: the branch the quiet plan recomputes really 10x slower (every
    repeat), captured quietly twice: the other branch is recomputed, in both captures. (On the
    ResNet-50 graph at 50 % the budget leaves no plan much faster than the reference one: 10-30x
    on its recomputed nodes moved the best plan by under 4 % of the step.)"""
    g = _two_branches()
    quiet = solve(_captured(g, 0, loaded=False), 0.8)
    assert quiet.options["stability"]["chosen"] == "reference"
    for v in quiet.recomputed_nodes:
        g.node(v)["time_s"] *= 10
    plans = [solve(_captured(g, seed, loaded=False), 0.8) for seed in range(2)]
    assert {p.options["stability"]["chosen"] for p in plans} == {"measured"}
    assert len({_key(p) for p in plans}) == 1
    assert not plans[0].recomputed_nodes & quiet.recomputed_nodes - {0}
    gain = plans[0].options["stability"]["measured_plan_faster_by"]
    assert gain > max(DEFAULT_NOISE_TOLERANCE, plans[0].options["stability"]["time_noise"])


def test_a_plan_clearly_faster_on_the_measured_times_wins() -> None:
    # two equal branches: the reference costs pick one to recompute; make that one 10x slower
    g = _two_branches()
    ref = solve(g, 0.8)
    assert ref.options["stability"]["chosen"] == "reference"
    for v in ref.recomputed_nodes:
        g.node(v)["time_s"] *= 10
    plan = solve(g, 0.8)
    assert plan.options["stability"]["chosen"] == "measured"
    assert plan.options["stability"]["measured_plan_faster_by"] > DEFAULT_NOISE_TOLERANCE
    assert not plan.recomputed_nodes & ref.recomputed_nodes - {0}
    assert _key(plan) == _key(solve(g, 0.8, noise_tolerance=0))


def test_deterministic_times_are_solved_once(cpu_like: Graph, monkeypatch: pytest.MonkeyPatch) -> None:
    g = cpu_like.copy()
    g.meta["time_source"] = "flops"
    assert not is_measured(g) and is_measured(cpu_like)
    small = _two_branches()  # the rule reads time_source only; a small graph solves at once
    small.meta["time_source"] = "flops"
    assert not is_measured(small)
    monkeypatch.setattr(stable, "reference_graph", lambda g: pytest.fail("solved the reference costs too"))
    plan = solve(small, 0.8)
    assert plan.recomputed_nodes and "stability" not in plan.options
    synthetic = Graph.chain([100, 200, 300, 200, 100])
    assert "stability" not in solve(synthetic, 0.8).options


def test_reference_costs_are_one_power_of_two_per_node(cpu_like: Graph) -> None:
    ref = reference_graph(cpu_like)
    fwd = {ref.node(v)["time_s"] for v in ref.nodes}
    assert len(fwd) == 1 and math.log2(fwd.pop()).is_integer()
    assert all(ref.node(v)["bwd_time_s"] == 2 * ref.node(v)["time_s"] for v in ref.nodes)
    assert [ref.node(v)["out_bytes"] for v in ref.nodes] == [cpu_like.node(v)["out_bytes"] for v in cpu_like.nodes]


@pytest.mark.parametrize("bad", [-0.1, 1.0, "5%", True])
def test_bad_tolerance_is_refused(cpu_like: Graph, bad: object) -> None:
    with pytest.raises(ValueError, match="noise_tolerance="):
        solve(cpu_like, "50%", noise_tolerance=bad)


def test_real_captures_give_one_plan() -> None:
    """Three captures of one zoo model on this machine (the ten of the issue's target run in
    ``tests/test_stability_slow.py``, marked slow)."""
    model, inputs = autoremat.zoo.build("resnet50", size="small")
    plans = {_key(solve(autoremat.capture(model, inputs), "50%")) for _ in range(3)}
    assert len(plans) == 1


def test_a_reference_plan_is_solved_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two captures that differ only in their times, with the same reference costs: the second
    meets the first's reference plan (no reference solve runs) and gets what a cold solve gives."""
    import autoremat.solvers as solvers

    g = _two_branches()
    first, second = _captured(g, 0, loaded=False), _captured(g, 1, loaded=False)
    assert reference_graph(first).node(0)["time_s"] == reference_graph(second).node(0)["time_s"]
    stable.clear_reference_memo()
    cold = solve(second, 0.8)
    stable.clear_reference_memo()
    solve(first, 0.8)
    real = solvers._solve_bytes

    def measured_only(graph: Graph, *args: object) -> autoremat.Plan:
        assert graph.meta["time_source"] != stable.REFERENCE_TIME_SOURCE, "solved the reference costs again"
        return real(graph, *args)

    monkeypatch.setattr(solvers, "_solve_bytes", measured_only)
    again = solve(second, 0.8)
    assert again.options["stability"]["chosen"] == "reference"
    assert _key(again) == _key(cold) and again.to_dict() == cold.to_dict()
    assert solve(second, 0.8).to_dict() == cold.to_dict()  # a memo hit hands out a fresh plan each time


def test_one_capture_at_several_budgets_gives_the_cold_plans() -> None:
    """A sweep of budgets on one capture shares its reference graph (and the solvers' per-graph
    caches on it): each plan is the one a cold solve at that budget gives."""
    g = _captured(_two_branches(), 0, loaded=False)
    budgets = (0.8, 0.7, 0.9, 0.75)
    sweep = [solve(g, b).to_dict() for b in budgets]
    cold = []
    for b in budgets:
        stable.clear_reference_memo()
        cold.append(solve(g.copy(), b).to_dict())
    assert sweep == cold
    assert {p["options"]["stability"]["chosen"] for p in sweep} == {"reference"}
