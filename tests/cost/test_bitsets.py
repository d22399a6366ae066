"""``autoremat.cost.bitsets``: a graph's arrays and per-set quantities equal their definitions."""

from __future__ import annotations

import random

import pytest
from _graphs import random_dag_with_views, with_held_outputs

from autoremat.cost.bitsets import GraphBits, bit_list, bits
from autoremat.solvers.kusumoto.families import all_lower_sets


def test_bits_of_a_mask():
    assert list(bits(0)) == [] and list(bits(0b10110)) == [1, 2, 4]
    big = (1 << 300) | (1 << 7) | 1 | sum(1 << k for k in range(40, 60))
    assert bit_list(big) == list(bits(big)) == [0, 7, *range(40, 60), 300]


def test_bit_list_is_bits_on_random_masks():
    """Byte tables below bit 512 and the per-byte path above it, dense and sparse masks."""
    rng = random.Random(0)
    for _ in range(300):
        top = rng.choice((9, 64, 431, 512, 513, 1200))
        mask = sum(1 << k for k in range(top) if rng.random() < rng.choice((0.02, 0.5, 0.97)))
        assert bit_list(mask) == list(bits(mask))


@pytest.mark.parametrize("seed", range(10))
def test_per_set_quantities_are_their_definitions(seed):
    g = with_held_outputs(random_dag_with_views(seed, 4 + seed % 8), seed)
    p = GraphBits(g)
    n = len(g)
    readers = {u: {w for w in g.succ(u)} | {x for x in g.nodes if u in g.node(x)["saves"] and x != u}
               for u in g.nodes}
    for lower in all_lower_sets(p, 10**6):
        inside = set(bits(lower))
        boundary = {u for u in inside if readers[u] - inside}
        outputs = {u for u in inside if g.node(u)["is_output"]}
        held = {u for u in inside if g.held_to_loss(u)}  # outputs and what the returned object holds
        info = p.info(lower)
        assert set(bits(info.boundary)) == boundary
        assert set(bits(info.alive)) == {g.root(u) for u in boundary | held}
        assert set(bits(p.roots(lower))) == {g.root(u) for u in inside}
        assert p.nbytes(info.alive) == sum(g.node(r)["alloc_bytes"] for r in bits(info.alive))
        outside_params = {q for v in g.nodes if v not in inside for q in g.node(v)["params"]
                          if q in g.meta["param_bytes"]}
        after = p.after(lower)
        assert after.params == frozenset(outside_params)
        assert after.param_bytes == sum(g.meta["param_bytes"][q] for q in outside_params)
        assert [u for u, _ in after.grads] == sorted(
            u for u in boundary | outputs if g.node(u)["requires_grad"]
            and (g.node(u)["is_output"] or set(g.succ(u)) - inside))
        flags = p.beyond_flags(lower)
        assert [bool(flags[u]) for u in range(n)] == [bool(readers[u] - inside) for u in range(n)]


def test_recompute_flag_follows_segments_from_lower_sets():
    from autoremat.plan import segments_from_lower_sets

    rng = random.Random(4)
    for seed in range(8):
        g = random_dag_with_views(50 + seed, 8)
        p = GraphBits(g)
        family = all_lower_sets(p, 10**6)
        for _ in range(20):
            lower = rng.choice(family[:-1])
            upper = rng.choice([m for m in family if m & lower == lower and m != lower])
            chain = [list(bits(m)) for m in (lower, upper, p.full) if m] if upper != p.full else [
                list(bits(m)) for m in (lower, upper) if m]
            segs = segments_from_lower_sets(g, chain)
            want = next(s for s in segs if set(s.nodes) == set(bits(upper & ~lower))).recompute
            assert p.recompute_flag(lower, upper) == want
