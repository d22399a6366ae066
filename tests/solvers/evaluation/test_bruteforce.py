"""``autoremat.solvers.evaluation.bruteforce``: the yardstick of the exact solvers, itself checked."""

from __future__ import annotations

import pytest

from autoremat import SOLVERS, Graph, InfeasibleBudgetError, simulate
from autoremat.solvers.evaluation.bruteforce import lower_set_chains, solve_bruteforce


def test_bruteforce_oracle_itself():
    g = Graph.chain([100] * 4)
    assert sum(1 for _ in lower_set_chains(g)) == 8  # compositions of 4
    assert simulate(g, solve_bruteforce(g, 400)).extra_time_s == 2.0
    with pytest.raises(InfeasibleBudgetError) as info:
        solve_bruteforce(g, 399)
    assert info.value.min_budget_bytes == 400
    assert solve_bruteforce(Graph(), 0).segments == []
    with pytest.raises(ValueError, match="max_nodes"):
        solve_bruteforce(Graph.chain([1] * 13), 10**9)
    assert "bruteforce" not in SOLVERS


def test_chains_are_every_increasing_lower_set_sequence():
    g = Graph.from_edges(3, [(0, 2), (1, 2)])  # lower sets {}, {0}, {1}, {0,1}, V
    chains = [[sorted(m) for m in c] for c in lower_set_chains(g)]
    assert sorted(map(str, chains)) == sorted(map(str, [
        [[0, 1, 2]], [[0], [0, 1, 2]], [[1], [0, 1, 2]], [[0, 1], [0, 1, 2]],
        [[0], [0, 1], [0, 1, 2]], [[1], [0, 1], [0, 1, 2]]]))
