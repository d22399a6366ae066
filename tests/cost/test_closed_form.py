"""``autoremat.cost.closed_form``: dp-approx's closed form, held within its stated bound.

The model is an approximation of the simulator (see its module docstring); here its extra time
equals :func:`~autoremat.cost.simulate`'s and its peak stays within
``[UNDER_BOUND, OVER_BOUND]`` times the simulated one on random lower-set sequences (of every
lower set and of the pruned family) of seeded random DAGs; its per-set terms are what their
definitions say; and pricing several successors at once equals pricing each alone.
"""

from __future__ import annotations

import random

import pytest
from _graphs import random_dag, random_dag_with_views, with_held_outputs

from autoremat.cost import simulate
from autoremat.cost.bitsets import GraphBits, bits
from autoremat.cost.closed_form import OVER_BOUND, UNDER_BOUND, ClosedForm, closed_peak, sparse_table
from autoremat.plan import Plan, segments_from_lower_sets
from autoremat.solvers.kusumoto.families import all_lower_sets, pruned_lower_sets


def random_sequence(p: GraphBits, family: list[int], rng: random.Random) -> list[int]:
    seq, lower = [], 0
    while lower != p.full:
        lower = rng.choice([m for m in family if m & lower == lower and m != lower])
        seq.append(lower)
    return seq


@pytest.mark.parametrize("maker", [random_dag, random_dag_with_views,
                                   lambda s, n: with_held_outputs(random_dag_with_views(s, n), s)])
def test_peak_within_the_bound_and_time_equal(maker):
    rng = random.Random(3)
    exact = 0
    total = 0
    for seed in range(60):
        g = maker(seed, 3 + seed % 9)
        p = GraphBits(g)
        for family in (all_lower_sets(p, 10**6), pruned_lower_sets(p)):
            for _ in range(6):
                seq = random_sequence(p, family, rng)
                peak, t = closed_peak(p, seq)
                sim = simulate(g, Plan(segments_from_lower_sets(g, [list(bits(m)) for m in seq])), record=False)
                assert t == pytest.approx(sim.extra_time_s)
                assert UNDER_BOUND * sim.peak_bytes <= peak <= OVER_BOUND * sim.peak_bytes, (seed, seq)
                exact += peak == sim.peak_bytes
                total += 1
    assert exact >= total // 5


def test_terms_are_their_definitions():
    """``ρ(L)``: saved storages (own roots) and extras of ``L``'s nodes; ``PG``: parameter bytes
    of the nodes outside ``L``; ``T(L)``: their times."""
    g = random_dag(17, 9)
    p = GraphBits(g)
    c = ClosedForm(p)
    saved_root = {g.root(u) for v in g.nodes for u in g.node(v)["saves"]}
    for lower in all_lower_sets(p, 10**6):
        nodes = list(bits(lower))
        terms = c.terms(lower)
        rho = sum((g.node(v)["alloc_bytes"] if g.root(v) == v and v in saved_root else 0)
                  + (g.node(v)["extra_saved_bytes"] if g.node(v)["requires_grad"] else 0) for v in nodes)
        assert terms.rho == rho
        assert terms.time_s == pytest.approx(sum(g.node(v)["time_s"] for v in nodes))
        outside = [v for v in g.nodes if v not in nodes]
        used = {q for v in outside for q in g.node(v)["params"]}
        assert terms.pg == sum(g.meta["param_bytes"][q] for q in used)


def test_extend_prices_each_successor_as_pair_does():
    g = random_dag_with_views(23, 10)
    p = GraphBits(g)
    c = ClosedForm(p)
    family = all_lower_sets(p, 10**6)
    for lower in family[:20]:
        ups = [m for m in family if m & lower == lower and m != lower]
        got = c.extend(lower, c.terms(lower), [(u, c.terms(u)) for u in ups])
        assert got == [c.pair(lower, u) for u in ups]


def test_sparse_table_range_maximum():
    rng = random.Random(1)
    values = [rng.randrange(100) for _ in range(37)]
    table = sparse_table(values)
    for lo in range(len(values)):
        for hi in range(lo, len(values)):
            k = (hi - lo + 1).bit_length() - 1
            assert max(table[k][lo], table[k][hi - (1 << k) + 1]) == max(values[lo:hi + 1])


def test_a_node_the_returned_object_holds_is_charged_as_an_output_is():
    """``R(L)`` of the closed form is the bitsets' alive set: a node held until the loss
    (``held_by_output``) stays charged after ``L`` though nothing outside ``L`` reads it."""
    from autoremat.graph import Graph

    g = Graph.chain([8, 4, 2, 1], saves_own_output=False)
    lower = 0b11  # {0, 1}: node 0 is read by node 1 only
    assert ClosedForm(GraphBits(g)).terms(lower).charge == ((4, 0b10),)
    g.node(0)["held_by_output"] = True
    p = GraphBits(g)
    assert set(bits(p.info(lower).alive)) == {0, 1}
    assert dict(ClosedForm(p).terms(lower).charge) == {8: 0b01, 4: 0b10}
