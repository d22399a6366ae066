"""``autoremat.solvers.kusumoto.dp``: the time quantum and what both DPs share."""

from __future__ import annotations

import pytest

from autoremat.cost.bitsets import GraphBits
from autoremat.graph import Graph
from autoremat.solvers.kusumoto.dp import LOST_SPLIT, LowerSetDP, time_quantum, time_unit
from autoremat.solvers.kusumoto.search import Search, parse_config


def bits_of(times: list[float]) -> GraphBits:
    return GraphBits(Graph.chain([1] * len(times), times))


def test_time_unit_is_the_gcd_of_integer_times():
    assert time_unit(bits_of([10.0, 4.0, 6.0])) == 2.0
    assert time_unit(bits_of([0.5, 1.0])) is None
    assert time_unit(bits_of([0.0, 0.0])) is None


def test_quantum_is_the_unit_when_it_gives_few_slots_else_total_over_slots():
    assert time_quantum(bits_of([10.0, 4.0, 6.0]), 500) == 2.0
    assert time_quantum(bits_of([10.0, 4.0, 6.0]), 5) == pytest.approx(20 / 5)
    assert time_quantum(bits_of([0.3, 0.4]), 7) == pytest.approx(0.7 / 7)
    assert time_quantum(bits_of([0.0, 0.0]), 7) == 1.0


def test_memory_centric_buckets_are_the_unit_or_a_split_quantum():
    exact = Search(Graph.chain([1] * 6, [0.3] * 6), "dp-approx", parse_config(None, "dp-approx")).dp
    assert exact.lost_quantum == pytest.approx(exact.quantum / LOST_SPLIT)
    unit = Search(Graph.chain([1] * 6, [2.0] * 6), "dp-approx", parse_config(None, "dp-approx")).dp
    assert unit.lost_quantum == 2.0


def test_run_rejects_an_unknown_mode_and_counts_runs():
    dp = Search(Graph.chain([1] * 4), "dp-exact", parse_config(None, "dp-exact")).dp
    assert isinstance(dp, LowerSetDP) and dp.runs == 0
    dp.run(10**6, "feasible")
    assert dp.runs == 1
    with pytest.raises(AssertionError, match="please report"):
        dp.run(10**6, "fastest")
