"""``autoremat.solvers.kusumoto.families``: every lower set, and the pruned family."""

from __future__ import annotations

import random

import pytest
from _graphs import random_edges

from autoremat.cost.bitsets import GraphBits, bits
from autoremat.solvers.kusumoto.families import all_lower_sets, pruned_lower_sets


@pytest.mark.parametrize("seed", range(10))
def test_all_lower_sets_are_the_graphs_lower_sets(seed):
    rng = random.Random(seed)
    g = random_edges(rng.randint(1, 9), 0.3, rng)
    family = all_lower_sets(GraphBits(g), 10**6)
    assert {frozenset(bits(m)) for m in family} == set(g.lower_sets())
    assert len(family) == len(set(family))
    assert [m.bit_count() for m in family] == sorted(m.bit_count() for m in family)


def test_all_lower_sets_stops_at_the_limit():
    g = random_edges(8, 0.0, random.Random(0))  # no edges: 2**8 lower sets
    assert all_lower_sets(GraphBits(g), 255) is None
    assert len(all_lower_sets(GraphBits(g), 256)) == 256


@pytest.mark.parametrize("seed", range(10))
def test_pruned_family_is_the_ancestor_closures_and_the_ends(seed):
    rng = random.Random(100 + seed)
    g = random_edges(rng.randint(1, 12), 0.3, rng)
    p = GraphBits(g)
    family = pruned_lower_sets(p)
    closures = {sum(1 << u for u in g.ancestor_closure(v)) for v in g.nodes} | {0, p.full}
    assert set(family) == closures and len(family) == len(closures)
    assert family[0] == 0 and family[-1] == p.full
