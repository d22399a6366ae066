"""``autoremat.solvers.milp.cut_bound``: a lower bound of the least extra time from the backward's separators.

Held to the brute force over the whole ``milp`` plan space (every lower-set chain, every flag
choice, simulated) on small seeded DAGs with and without a chain through them (views, pass-through
nodes, saved inputs and extras, held outputs), and to the lattice's proven optimum on seeded networks of
the four families; it must also be positive where those graphs make recomputation necessary, and
prove a budget infeasible where a separator's level cannot fit.
"""

from __future__ import annotations

import math

import networkx as nx
import pytest
from _graphs import random_dag_with_views, random_network, with_held_outputs

from autoremat.cost import unoptimised_peak_bytes
from autoremat.errors import InfeasibleBudgetError
from autoremat.graph import Graph
from autoremat.solvers.milp import Gap, solve_milp
from autoremat.solvers.milp.cut_bound import CUTS_BASIS, cut_bound, separator_floor, separators
from autoremat.solvers.milp.exact import lattice_of

from .milp_oracle import best_within, space_table


def small_dag(seed: int, n: int, kept: str | None = None, spine: bool = True) -> Graph:
    """:func:`random_dag_with_views` with (``spine``) an edge from each node to the next, which orders
    them all, and its sinks as outputs (``kept``: held outputs, as :func:`with_held_outputs` marks them)."""
    g = random_dag_with_views(seed, n)
    d = g.nx.copy()
    if spine:
        d.add_edges_from((v - 1, v) for v in range(1, n))
    for v in range(n):
        d.nodes[v]["is_output"] = d.out_degree(v) == 0
    out = Graph(d, {**g.meta, "loss_saves": [v for v in range(n) if d.out_degree(v) == 0][:1]})
    return with_held_outputs(out, seed, kept=kept) if kept else out


def test_separators_are_the_nodes_every_order_meets():
    for seed in range(30):
        g = small_dag(seed, 12, spine=False)
        d = g.nx
        want = [c for c in g.nodes if nx.ancestors(d, c) == set(range(c))
                and nx.descendants(d, c) == set(range(c + 1, len(g))) and not any(u < c < w for u, w in d.edges)]
        assert separators(g) == want
    skip = Graph.from_edges(4, [(0, 1), (1, 2), (2, 3), (0, 3)], out_bytes=[1] * 4)
    assert separators(skip) == [0, 3]  # 0's gradient from 3 is pending at 1 and 2: its buffers depend on the order
    diamond = Graph.from_edges(4, [(0, 1), (0, 2), (1, 3), (2, 3)], out_bytes=[1] * 4)
    assert separators(diamond) == [0, 3]  # 1 and 2 run in either order


@pytest.mark.parametrize("spine", [True, False])
@pytest.mark.parametrize("kept", [None, "step"])
@pytest.mark.parametrize("seed", range(8))
def test_never_above_the_brute_force_optimum(seed, kept, spine):
    g = small_dag(seed, 6 + seed % (3 if spine else 2), kept, spine)  # 8 nodes without a spine: 20-40k plans
    table = space_table(g)
    peaks = sorted({peak for peak, _, _ in table})
    assert separator_floor(g) <= peaks[0]  # no plan's step peak below it
    for budget in [peaks[0] - 1, *peaks]:
        want = best_within(table, budget)
        got = cut_bound(g, budget, 10.0)
        if want is None:
            continue
        assert got.bound_s <= want * (1 + 1e-6) + 1e-12, (budget, got, want)


def _networks():
    for family in ("chain_skips", "dense", "transformer", "unet"):
        for seed in range(2):
            yield random_network(family, seed, 26 + 6 * seed)


@pytest.mark.parametrize("graph", list(_networks()), ids=lambda g: g.meta.get("model", ""))
def test_never_above_the_lattice_optimum_on_networks(graph):
    """The lattice's optimum (proven in the exact model, which is the simulator's on these) at three
    budgets between its least and the unpatched peak; positive somewhere on the families whose
    blocks meet at separators."""
    lat = lattice_of(graph)
    least = lat.least_peak()
    peak = unoptimised_peak_bytes(graph)
    seen = []
    for budget in (int(least.cost), int(least.cost + (peak - least.cost) * 0.3), int((least.cost + peak) / 2)):
        want = lat.least_time(budget)
        assert want.status == "optimal"
        got = cut_bound(graph, budget, 20.0)
        assert got.bound_s <= want.cost * (1 + 1e-6) + 1e-15
        seen.append((got.bound_s, want.cost))
    if graph.meta["model"].startswith(("chain_skips", "dense")):
        assert any(b > 0.25 * c for b, c in seen), seen


def test_brute_force_cases_get_positive_bounds():
    """Not a bound of zero everywhere: on the small DAGs above, at the least budget a plan meets, the
    bound is positive wherever recomputation is needed there (at least most of them)."""
    positive = needed = 0
    for seed in range(10):
        g = small_dag(seed, 6 + seed % 3)
        table = space_table(g)
        least = min(peak for peak, _, _ in table)
        if best_within(table, least) > 0:
            needed += 1
            positive += cut_bound(g, least, 10.0).bound_s > 0
    assert needed >= 5 and positive >= needed // 2, (positive, needed)


def _param_heavy() -> Graph:
    """A chain whose parameter gradients alone (at its first node's backward) take most of its step."""
    g = Graph.from_edges(6, [(v, v + 1) for v in range(5)], out_bytes=[100] * 6, time_s=[1e-3] * 6)
    for v in g.nodes:
        g.nx.nodes[v].update(params=(f"w{v}",), param_grad_bytes=400)
    g.meta["param_bytes"] = {f"w{v}": 400 for v in g.nodes}
    return g


def test_a_separator_level_over_the_budget_proves_it_infeasible():
    g = _param_heavy()
    peak = unoptimised_peak_bytes(g)
    assert separator_floor(g) > 0.5 * peak
    assert cut_bound(g, int(0.5 * peak), 5.0).bound_s == math.inf
    least = solve_milp(g, peak, config={"objective": "memory", "time_limit_s": 5})
    assert least.options["least_peak_bound_bytes"] >= separator_floor(g)
    with pytest.raises(InfeasibleBudgetError):
        solve_milp(g, int(0.5 * peak), config={"time_limit_s": 5})


def test_milp_reports_the_separators_bound_where_it_is_the_largest(monkeypatch):
    """With ``k`` given (no lattice) and a second for the program, its bound stays below the
    separators' on a chain with skips: ``milp`` keeps the larger, names its basis, says it proven."""
    import autoremat.solvers.milp as milp

    g = random_network("chain_skips", 0, 60)
    budget = int(0.6 * unoptimised_peak_bytes(g))
    cut = cut_bound(g, budget, 30.0)
    assert cut.status == "optimal" and cut.bound_s > 0
    # the separators' program with all the time it needs, whatever the machine's load
    monkeypatch.setattr(milp, "cut_bound", lambda graph, b, limit, threads=None: cut_bound(graph, b, 30.0))
    plan = solve_milp(g, budget, config={"k": 12, "time_limit_s": 1})
    o = plan.options
    assert o["milp_bound_basis"] == CUTS_BASIS and o["optimum_bound_s"] == pytest.approx(cut.bound_s, rel=1e-6)
    assert o["optimality_gap"] > 0 and "(proven)" in plan.describe()
    gap = Gap(o["extra_time_no_tails_s"], o["optimum_bound_s"], o["optimality_gap"], False, None, None,
              basis=o["milp_bound_basis"])
    assert gap.describe().endswith("of the best bound on the optimum (proven)")
