"""``milp``'s cost-to-go steps priced in one batch (:mod:`autoremat.solvers.milp.step_arrays`)
equal the pair-at-a-time terms, and the batch is what runs.

The cost-to-go is a proven lower bound only if every step's need bound, kept bytes and time are
the relaxation's (see :mod:`autoremat.solvers.milp.cost_to_go`); the batch (``BatchPricer`` with
free flags) must give the same multiset of steps as :meth:`Lattice.step` at every lower set, on
seeded random networks with views, pass-through nodes and outputs held by the returned object,
with and without exact needs, and the same ``h``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from autoremat.cost.bitsets import GraphBits
from autoremat.solvers.kusumoto.families import all_lower_sets
from autoremat.solvers.milp.cost_to_go import CostToGo
from autoremat.solvers.milp.lattice import Lattice
from autoremat.solvers.milp.step_arrays import StepArrays

from .milp_oracle import bound_graphs, lattice_cases


def _graphs():
    return bound_graphs(20)


def _rows(arrays):
    if arrays is None:
        return []
    return sorted(zip(*(a.tolist() for a in arrays)))


@pytest.mark.parametrize("name,graph", list(_graphs()), ids=lambda x: x if isinstance(x, str) else "")
def test_batch_equals_pair_at_a_time(name, graph):
    p = GraphBits(graph)
    fam = all_lower_sets(p, 3000)
    assert fam is not None
    batch, scalar = Lattice(p, fam), Lattice(p, fam)
    scalar.step_arrays = StepArrays(scalar, batch=False)
    assert batch.step_arrays.pricer is not None, name  # the batch runs on these graphs
    budget = 1 << 60
    steps = 0
    for exact in (False, True):
        for i in range(len(fam)):
            got, want = batch.move_arrays(i, budget, exact), scalar.move_arrays(i, budget, exact)
            assert _rows(got) == _rows(want), (name, i, exact)
            steps += len(_rows(got))
    assert steps > len(fam)
    # and h at a tight budget: the same table
    peak = max(int(r[0]) for i in range(len(fam)) for r in _rows(scalar.move_arrays(i, budget)))
    for frac in (0.5, 0.8):
        b = int(peak * frac)
        t1 = CostToGo(Lattice(p, fam), b, exact_until=math.inf).table
        lat = Lattice(p, fam)
        lat.step_arrays = StepArrays(lat, batch=False)
        t2 = CostToGo(lat, b, exact_until=math.inf).table
        assert np.array_equal(t1, t2), (name, frac)


@pytest.mark.parametrize("family", ["chain_skips", "unet", "dense", "transformer"])
def test_lazy_exact_needs_give_the_table_of_exact_needs_everywhere(family):
    """:meth:`CostToGo._refine` replays only the steps that attain a row's least, and gives the
    table that exact needs at every step give (the proven bound is not weakened, nor made
    unsound); on these networks it checks fewer steps than the eager pass does."""
    fewer = 0
    for p, fam, lat, budget in lattice_cases(family):
        eager_lat = Lattice(p, fam)
        eager = CostToGo(eager_lat, budget, exact_until=math.inf, lazy=False)
        before = len(lat.needs) + len(lat.tight)
        lazy = CostToGo(lat, budget, exact_until=math.inf)
        assert lazy.refined > 0 or not np.isfinite(eager.table[0, 0])
        assert np.array_equal(lazy.table, eager.table), (family, budget)
        fits = sum(int((a[0] <= budget).sum()) for i in range(len(fam)) if i != lat.last
                   for a in [eager_lat.move_arrays(i, budget)] if a is not None)
        fewer += lazy.refined < fits
        assert len(lat.needs) + len(lat.tight) - before <= lazy.refined
    assert fewer >= 1
