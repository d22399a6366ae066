"""``autoremat.solvers.milp.modules``: the module relaxation's ``h`` never exceeds the extra time
still to pay, on every plan of seeded DAGs (brute force, as ``test_cost_to_go.py`` holds the
full ``h``) and along the optimum of random networks; the A* search with it finds the optimum."""

from __future__ import annotations

import math

import numpy as np
import pytest
from _graphs import random_dag, random_dag_with_views, with_held_outputs

from autoremat.cost.bitsets import GraphBits
from autoremat.solvers.kusumoto.families import all_lower_sets
from autoremat.solvers.milp import lattice as lattice_mod
from autoremat.solvers.milp.cost_to_go import CostToGo
from autoremat.solvers.milp.lattice import Lattice
from autoremat.solvers.milp.modules import ModuleMoves, cut_sets

from .milp_oracle import lattice_cases
from .test_cost_to_go import _every_plan, _path_prefixes, priced_plans


@pytest.mark.parametrize("views", [False, True, "held"])
@pytest.mark.parametrize("seed", range(10))
def test_the_module_cost_to_go_is_a_lower_bound_along_every_plan(seed, views):
    lat, plans, peaks = _every_plan(seed, views, 4 + seed % 4)
    moves = ModuleMoves(lat)
    for budget in [peaks[0] - 1, *peaks[:: max(1, len(peaks) // 6)], peaks[-1]]:
        ctg = CostToGo(moves, budget, grid=max(budget, 0) + 1 if seed % 2 else 7 + seed)
        fits = [(t, prefixes) for peak, t, prefixes in plans if peak <= budget]
        if not fits:
            continue
        assert ctg.at(0, 0) <= min(t for t, _ in fits) + 1e-12
        for t, prefixes in fits:
            for k, m, t0 in prefixes:
                assert t0 + ctg.at(k, m) <= t + 1e-12, (budget, k, m, t0, t)


def test_cut_sets_are_the_sets_comparable_with_every_other():
    for seed in range(6):
        p = GraphBits(random_dag(seed, 7))
        lat = Lattice(p, all_lower_sets(p, 10**6))
        want = [k for k, a in enumerate(lat.fam) if all(a & b in (a, b) for b in lat.fam)]
        assert sorted(cut_sets(lat.rows, lat.fam)) == want
        assert want[0] == 0 and want[-1] == lat.last


@pytest.mark.parametrize("family", ["chain_skips", "unet", "dense", "transformer"])
def test_the_a_star_with_the_module_bound_finds_the_optimum(family, monkeypatch):
    """Networks too large for the brute force: with the module relaxation as ``h`` (forced by a
    set limit of 0), the A* optimum equals the plain label search's, ``t + h`` stays below it
    along that path, and ``h`` is not vacuous on every family."""
    monkeypatch.setattr(lattice_mod, "CTG_MAX_SETS", 0)
    positive = 0
    for p, fam, _, budget in lattice_cases(family):
        plain = Lattice(p, fam).least_time(budget, heuristic=False)
        lat = Lattice(p, fam)
        astar = lat.least_time(budget)
        assert lat._modules is not None
        assert astar.status == plain.status == "optimal"
        assert astar.cost == pytest.approx(plain.cost, rel=1e-12, abs=1e-18)
        ctg = lat.cost_to_go(budget)
        prefixes, total = _path_prefixes(p, lat, plain.seq, plain.flags)
        for k, m, t in prefixes:
            assert t + ctg.at(k, m) <= total * (1 + 1e-9) + 1e-18
        positive += ctg.at(0, 0) > 0
    assert positive >= 1 or family in ("dense", "transformer")  # total orders: every step a piece


def test_the_steps_are_those_inside_a_module():
    p = GraphBits(random_dag(3, 9))
    lat = Lattice(p, all_lower_sets(p, 10**6))
    moves = ModuleMoves(lat)
    cuts = [lat.fam[c] for c in moves.cuts]
    for k in range(len(moves.fam)):  # the sets, then the states inside spanning steps
        i = moves.base[k]
        a = lat.fam[i]
        got = moves.move_arrays(k, 1 << 60)
        targets = set() if got is None else {moves.base[t] for t in got[3].tolist()}
        want = {j for j, b in enumerate(lat.fam) if b != a and b & a == a
                and not any(a & c == a and c & b == c and c not in (a, b) for c in cuts)}
        assert targets == want
        if got is not None:
            req, add, dt, _ = got
            assert (req >= 0).all() and (add >= 0).all() and (dt >= 0).all() and not np.isnan(dt).any()
    assert math.isfinite(CostToGo(moves, 1 << 40).at(0, 0))


def test_the_module_bound_holds_on_every_plan_of_small_networks_where_it_is_positive():
    """Dense blocks of 10 nodes: total orders (every set a cut set: every step a piece) where
    ``h`` is above 0 (the DAGs above mostly give 0 at their budgets)."""
    from _graphs import random_network

    from autoremat.cost import unoptimised_peak_bytes

    positive = 0
    for seed in range(2):
        g = random_network("dense", seed, 11)
        lat, plans, peaks = priced_plans(g)
        moves = ModuleMoves(lat)
        least = peaks[0]
        for budget in (least, (3 * least + unoptimised_peak_bytes(g)) // 4):
            ctg = CostToGo(moves, budget, grid=budget + 1)
            fits = [(t, prefixes) for peak, t, prefixes in plans if peak <= budget]
            for t, prefixes in fits:
                for k, m, t0 in prefixes:
                    assert t0 + ctg.at(k, m) <= t * (1 + 1e-9) + 1e-18, (budget, k, m, t0, t)
            positive += ctg.at(0, 0) > 0
    assert positive >= 2
