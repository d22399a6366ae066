"""``autoremat.solvers.kusumoto.exact``: dp-exact's successor lists and per-state pricing.

A set's successors are exactly its strict supersets in the family within the key bound, in key
order; a priced transition is the bookkeeping of the exact model with its bound; the per-state
columns keep what was priced; the replays are cached.
"""

from __future__ import annotations

import pytest
from _graphs import random_dag_with_views

from autoremat.cost.segment_replay import bookkeeping, exact_transition
from autoremat.solvers.kusumoto.exact import ExactDP
from autoremat.solvers.kusumoto.search import Search, parse_config


def exact_dp(seed: int, n: int) -> ExactDP:
    g = random_dag_with_views(seed, n)
    dp = Search(g, "dp-exact", parse_config({"max_lower_sets": 10**6}, "dp-exact")).dp
    assert isinstance(dp, ExactDP)
    return dp


@pytest.mark.parametrize("seed", range(8))
def test_successors_are_the_supersets_within_the_key_bound(seed):
    dp = exact_dp(4000 + seed, 7 + seed % 4)
    for i, lower in enumerate(dp.fam):
        limit = dp.keys[i] + 3
        got = list(dp.successors(i, limit))
        want = [j for j in range(len(dp.fam)) if j != i and not lower & ~dp.fam[j] and dp.keys[j] <= limit]
        assert set(want) <= set(got)
        assert all(not lower & ~dp.fam[j] and j != i for j in got)
        assert [dp.keys[j] for j in got] == sorted(dp.keys[j] for j in got)


@pytest.mark.parametrize("seed", range(6))
def test_a_priced_transition_is_the_models_bookkeeping_and_bound(seed):
    dp = exact_dp(4100 + seed, 8)
    dp.run(dp.vanilla_need(), "time")
    priced = list(dp.priced())
    assert priced
    for i, j, dang, (dt, add, dang2, low) in priced:
        lower, upper = dp.fam[i], dp.fam[j]
        assert (dt, add, dang2) == bookkeeping(dp.p, lower, upper, dang)
        assert low <= dp.tight_need(i, j, dang) <= exact_transition(dp.p, lower, upper, dang, {})[0]


def test_replays_are_cached_per_pair_and_dangling_set():
    dp = exact_dp(4200, 8)
    last = len(dp.fam) - 1
    first = dp.exact_step(0, last, 0)
    assert dp.exact_step(0, last, 0) is first and len(dp.replays) == 1
    assert dp.vanilla_need() == first[0]
