"""The exact needs of ``milp``'s cost-to-go (``Lattice.move_arrays(exact=True)``) are lower bounds.

``h`` drops the dangling roots from the state; with exact needs it prices every step at the
roots that dangle on *every* path to its lower set (:meth:`Lattice.certain_dangling`). That is a
lower bound of the step's need on every path only if the exact model's need never falls when
more roots dangle: checked here along random walks over the lattice of seeded random networks
(views, pass-through nodes, outputs held by the returned object, both flags), against the need
at the walk's actual dangling roots. The bound it gives is then held to the brute force and to the
plain label search in ``test_cost_to_go.py``; here also: it is never below the relaxed ``h`` and
above it somewhere (not vacuous).
"""

from __future__ import annotations

import math
import random
import time

import numpy as np
import pytest
from _graphs import random_dag_with_views, random_network, with_held_outputs

from autoremat.cost.bitsets import GraphBits
from autoremat.cost.segment_replay import exact_transition
from autoremat.solvers.kusumoto.families import all_lower_sets
from autoremat.solvers.milp.cost_to_go import CostToGo
from autoremat.solvers.milp.lattice import Lattice

from .milp_oracle import bound_graphs, lattice_cases


def _graphs():
    return bound_graphs(24)


@pytest.mark.parametrize("name,graph", list(_graphs()), ids=lambda x: x if isinstance(x, str) else "")
def test_the_need_at_the_certain_dangling_roots_is_a_lower_bound(name, graph):
    p = GraphBits(graph)
    fam = all_lower_sets(p, 4000)
    assert fam is not None
    lat = Lattice(p, fam)
    rng = random.Random(name)
    cache: dict = {}
    checked = 0
    for _ in range(60):  # random walks from the empty set to the full set
        i, dang = 0, 0
        while i != lat.last:
            sups = lat.successors(i, 1 << 62)
            j = rng.choice(sups if rng.random() < 0.5 else sups[: max(1, len(sups) // 8)])
            for f in lat.flags(i, j):
                cd = lat.certain_dangling(i)
                assert cd & ~dang == 0, (name, i)  # they dangle on this path too
                real = exact_transition(p, fam[i], fam[j], dang, cache, f)[0]
                low = exact_transition(p, fam[i], fam[j], cd, cache, f)[0]
                assert low <= real, (name, i, j, f, low, real)
                checked += 1
            f = rng.choice(lat.flags(i, j))
            dang = exact_transition(p, fam[i], fam[j], dang, cache, f)[3]
            i = j
    assert checked > 60


@pytest.mark.parametrize("family", ["chain_skips", "unet", "dense"])
def test_exact_needs_raise_h_and_keep_it_below_the_optimum(family):
    raised = 0
    for p, fam, lat, budget in lattice_cases(family):
        loose = CostToGo(lat, budget)
        tight = CostToGo(lat, budget, exact_until=math.inf)
        assert tight.exact_sets > 0 and loose.exact_sets == 0
        assert (tight.table >= loose.table).all()
        best = Lattice(p, fam).least_time(budget, heuristic=False)
        assert best.status == "optimal"
        assert tight.at(0, 0) <= best.cost * (1 + 1e-9) + 1e-18
        raised += tight.at(0, 0) > loose.at(0, 0) * (1 + 1e-9)
    assert raised >= 1


def test_a_cost_to_go_past_its_deadline_is_zero_where_it_did_not_reach_and_exact_elsewhere():
    g = random_network("transformer", 0, 60)  # 130 lower sets
    p = GraphBits(g)
    lat = Lattice(p, all_lower_sets(p, 3000))
    budget = int(lat.least_peak().cost)
    full = CostToGo(lat, budget)
    cut = CostToGo(lat, budget, deadline=time.monotonic() - 1.0)  # checked every 64 sets
    assert cut.table is not None and 0 < cut.partial < len(lat.fam)
    done = (cut.table == full.table).all(axis=1)
    assert done.sum() == len(lat.fam) - cut.partial
    assert (cut.table[~done] == 0).all() and cut.at(0, 0) == 0.0
    assert (full.table[~done] > 0).any()  # it gave something up


def test_above_its_lower_set_limit_the_cost_to_go_is_the_module_relaxation(monkeypatch):
    from autoremat.solvers.milp import lattice as lattice_module

    g = random_network("transformer", 0, 60)
    p = GraphBits(g)
    lat = Lattice(p, all_lower_sets(p, 3000))
    budget = int(lat.least_peak().cost)
    monkeypatch.setattr(lattice_module, "CTG_MAX_SETS", len(lat.fam) - 1)
    ctg = lat.cost_to_go(budget)
    assert lat._modules is not None and ctg.exact_sets == 0  # the module relaxation, no exact needs
    best = Lattice(p, lat.fam).least_time(budget, heuristic=False)
    assert ctg.at(0, 0) <= best.cost + 1e-18
    assert lat.least_time(budget).cost == pytest.approx(best.cost, abs=1e-18)
    monkeypatch.setattr(lattice_module, "CTG_MAX_SETS", len(lat.fam))
    other = Lattice(p, lat.fam)
    assert other.cost_to_go(budget) is not None and other._modules is None


@pytest.fixture(scope="module")
def transformer_tables():
    """A 60-node transformer network's lattice (130 lower sets) at its least peak: the cost-to-go
    with the bounds' needs and with exact needs, and every set's steps with exact needs (eager),
    shared by the cuts below (each cut builds its own table; the needs the lattice caches are
    the same whichever computed them)."""
    from types import SimpleNamespace

    g = random_network("transformer", 0, 60)
    p = GraphBits(g)
    lat = Lattice(p, all_lower_sets(p, 3000))
    budget = int(lat.least_peak().cost)
    eager = Lattice(p, lat.fam)
    steps = {i: [a.tolist() for a in arrays] for i in range(len(lat.fam)) if i != lat.last
             and (arrays := eager.move_arrays(i, budget, exact=True)) is not None}
    return SimpleNamespace(lat=lat, budget=budget, loose=CostToGo(lat, budget),
                           tight=CostToGo(lat, budget, exact_until=math.inf), steps=steps)


@pytest.mark.parametrize("done", [0, 5, 40, 10_000])
def test_exact_needs_cut_by_the_clock_keep_a_complete_consistent_table(monkeypatch, transformer_tables, done):
    """The exact pass runs after the bounds' pass: stopped by the deadline after ``done`` sets,
    the rows it did are exact needs' rows, the others the bounds', ``h`` at the empty set is at
    least the bounds' (one pass that switched to exact needs first left it 0 when its deadline
    came before the small sets), and every row is consistent along the steps with exact needs."""
    from types import SimpleNamespace

    from autoremat.solvers.milp import cost_to_go as module

    t = transformer_tables
    lat, budget, loose, tight = t.lat, t.budget, t.loose, t.tight
    calls = [0]

    def counting():
        calls[0] += 1
        return 0.0

    monkeypatch.setattr(module, "time", SimpleNamespace(monotonic=counting))
    CostToGo(lat, budget, deadline=1.0, exact_until=-math.inf)
    first = calls[0] - 1  # the bounds' pass (the exact pass looked once)
    calls[0] = 0

    def cutting():  # before the deadline for the bounds' pass and `done` sets of the exact pass
        calls[0] += 1
        return 0.0 if calls[0] <= first + done else 2.0

    monkeypatch.setattr(module, "time", SimpleNamespace(monotonic=cutting))
    cut = CostToGo(lat, budget, deadline=1.0, exact_until=1.0)
    monkeypatch.undo()
    assert cut.partial == 0 and cut.exact_sets <= done and (cut.exact_sets > 0) == (done > 0)
    exact_rows = (cut.table == tight.table).all(axis=1)
    assert ((cut.table == loose.table).all(axis=1) | exact_rows).all()
    assert cut.at(0, 0) >= loose.at(0, 0) > 0
    if done >= len(lat.fam):
        assert (cut.table == tight.table).all()
    G = cut.table.shape[1]
    for i, arrays in t.steps.items():
        for req, add, dt, j in zip(*arrays):
            top = (budget - req) // cut.unit
            if top < 0:
                continue
            span, s = min(top + 1, G), add // cut.unit
            src = cut.table[j, s:s + span]
            src = np.concatenate([src, np.full(span - len(src), 0.0 if j == lat.last else np.inf)])
            assert (cut.table[i, :span] <= src + dt + 1e-18).all(), (done, i, j)
