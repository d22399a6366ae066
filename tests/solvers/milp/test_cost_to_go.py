"""``autoremat.solvers.milp.cost_to_go``: ``h(L, m)`` never exceeds the extra time still to pay.

On seeded random DAGs (with and without views and pass-through nodes) every plan of the
``milp`` space (every lower-set chain, every flag choice) is priced in the exact model
(:func:`~autoremat.cost.segment_replay.exact_transition`); at several budgets, for every plan
that fits and every prefix of it, ``t(prefix) + h(L, m) <= t(plan)``; ``h`` at the empty set
is at most the least time of a fitting plan (the optimum where it is ``>= 0``) and infinite only
where no plan fits. The A* search with ``h`` finds the exact model's optimum (also with views).
"""

from __future__ import annotations

import itertools
import math

import pytest
from _graphs import random_dag, random_dag_with_views, with_held_outputs

from autoremat.cost.bitsets import GraphBits
from autoremat.cost.segment_replay import exact_transition
from autoremat.solvers.kusumoto.families import all_lower_sets
from autoremat.solvers.milp.cost_to_go import CostToGo
from autoremat.solvers.milp.lattice import Lattice

from .milp_oracle import lattice_cases


def _chains(p: GraphBits, family: list[int]):
    """Every increasing chain of the family from the empty set to the full set (bitsets, without the empty set)."""
    index = {m: k for k, m in enumerate(family)}
    sups = {m: [x for x in family if x != m and x & m == m] for m in family}

    def walk(m):
        if m == p.full:
            yield []
            return
        for x in sups[m]:
            for rest in walk(x):
                yield [x, *rest]

    for chain in walk(0):
        yield [index[m] for m in chain]


def _priced(p: GraphBits, lat: Lattice, chain: list[int]):
    """``(flags, peak, t, prefixes)`` of every flag choice of ``chain`` in the exact model;
    ``prefixes``: ``(set, m, t)`` before each step."""
    options = [lat.flags(a, b) for a, b in zip([0, *chain], chain)]
    for flags in itertools.product(*options):
        cache: dict = {}
        lower = dang = m = peak = 0
        t = 0.0
        prefixes = []
        for k, f in zip(chain, flags):
            prefixes.append((lat.fam.index(lower), m, t))
            need, dt, add, dang = exact_transition(p, lower, lat.fam[k], dang, cache, f)
            peak = max(peak, m + need)
            m += add
            t += dt
            lower = lat.fam[k]
        yield flags, peak, t, prefixes


def _every_plan(seed: int, views, nodes: int):
    """A seeded random DAG of ``nodes`` nodes (``views``: with views; ``"held"``: and outputs the
    returned object holds), its lattice, every plan priced by the brute force as ``(peak, time,
    prefixes)``, and the distinct peaks, sorted."""
    g = (random_dag_with_views if views else random_dag)(seed, nodes)
    if views == "held":
        g = with_held_outputs(g, seed, share=0.4)
    return priced_plans(g)


def priced_plans(g):
    """``g``'s lattice, every plan priced by the brute force as ``(peak, time, prefixes)``, and the
    distinct peaks, sorted."""
    p = GraphBits(g)
    family = all_lower_sets(p, 10**6)
    lat = Lattice(p, family)
    plans = [(peak, t, prefixes) for chain in _chains(p, family) for _, peak, t, prefixes in _priced(p, lat, chain)]
    return lat, plans, sorted({peak for peak, _, _ in plans})


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("views", [False, True, "held"])
@pytest.mark.parametrize("seed", range(8))
def test_cost_to_go_is_a_lower_bound_along_every_plan(seed, views, exact):
    """With ``exact``, every step's need is the exact model's at the certainly dangling roots;
    ``"held"``: outputs held by the returned object (to the loss, or to the step's end)."""
    lat, plans, peaks = _every_plan(seed, views, 3 + seed % 4)
    for budget in [peaks[0] - 1, *peaks[:: max(1, len(peaks) // 5)], peaks[-1]]:
        ctg = CostToGo(lat, budget, grid=max(budget, 0) + 1 if seed % 2 else 7 + seed,  # exact, or coarse
                       exact_until=math.inf if exact else -math.inf)
        fits = [(t, prefixes) for peak, t, prefixes in plans if peak <= budget]
        h0 = ctg.at(0, 0)
        if not fits:
            assert h0 == math.inf or h0 >= 0
            assert lat.least_time(budget).status == "infeasible"
            continue
        best = min(t for t, _ in fits)
        assert h0 <= best + 1e-12
        for t, prefixes in fits:
            for k, m, t0 in prefixes:
                assert t0 + ctg.at(k, m) <= t + 1e-12, (budget, k, m, t0, t)
        got = lat.least_time(budget)
        assert got.status == "optimal" and got.cost == pytest.approx(best, abs=1e-12)


def test_a_finer_grid_gives_a_bound_at_least_as_high_and_the_search_a_proven_bound():
    g = random_dag(5, 8)
    p = GraphBits(g)
    lat = Lattice(p, all_lower_sets(p, 10**6))
    budget = lat.least_peak().cost
    coarse, fine = CostToGo(lat, int(budget), grid=2), CostToGo(lat, int(budget), grid=int(budget) + 1)
    assert coarse.at(0, 0) <= fine.at(0, 0)
    best = Lattice(p, all_lower_sets(p, 10**6)).least_time(int(budget), heuristic=False)
    astar = lat.least_time(int(budget))
    assert astar.cost == pytest.approx(best.cost, abs=1e-12)
    assert fine.at(0, 0) <= best.cost + 1e-12
    stopped = Lattice(p, all_lower_sets(p, 10**6)).least_time(int(budget), deadline=0.0)
    assert stopped.status == "time_limit" and stopped.bound <= best.cost + 1e-12


def _path_prefixes(p: GraphBits, lat: Lattice, seq: list[int], flags: list[bool]):
    """``(set, m, t)`` before each step of a lower-set path, and its total time, in the exact model."""
    cache: dict = {}
    lower = dang = m = 0
    t = 0.0
    out = []
    for upper, f in zip(seq, flags):
        out.append((lat.fam.index(lower), m, t))
        _, dt, add, dang = exact_transition(p, lower, upper, dang, cache, f)
        m += add
        t += dt
        lower = upper
    return out, t


@pytest.mark.parametrize("family", ["chain_skips", "unet", "dense", "transformer"])
def test_a_star_equals_the_plain_label_search_on_random_networks(family):
    """Networks too large for the brute force: the A* search's optimum equals the search
    without ``h`` (an ``h`` above the cost-to-go would make it miss the optimum), and along that
    optimal path ``t + h`` never exceeds the optimum; ``h`` is not vacuous (above 0 at the start)."""
    positive = 0
    for p, fam, lat, budget in lattice_cases(family):
        plain = Lattice(p, fam).least_time(budget, heuristic=False)
        astar = lat.least_time(budget)
        assert astar.status == plain.status == "optimal"
        assert astar.cost == pytest.approx(plain.cost, rel=1e-12, abs=1e-18)
        ctg = lat.cost_to_go(budget)
        prefixes, total = _path_prefixes(p, lat, plain.seq, plain.flags)
        assert total == pytest.approx(plain.cost, rel=1e-12, abs=1e-18)
        for k, m, t in prefixes:
            assert t + ctg.at(k, m) <= total * (1 + 1e-9) + 1e-18
        positive += ctg.at(0, 0) > 0
    if family != "transformer":  # its least-budget plans recompute what h's relaxation does not see
        assert positive >= 2
