"""``autoremat.cost.offload_link``: one transfer at a time; offloads release memory once copied;
prefetches come back in order of need, and one still running stalls the step."""

from __future__ import annotations

import pytest

from autoremat.cost import no_recompute_plan, simulate
from autoremat.cost.offload_link import Link
from autoremat.graph import Graph
from autoremat.plan import Plan


def test_link_serves_one_transfer_at_a_time_in_issue_order():
    link = Link(10.0)
    assert link.transfer(20, 0.0) == (0.0, 2.0)
    assert link.transfer(10, 1.0) == (2.0, 3.0)  # waits for the link
    assert link.transfer(10, 5.0) == (5.0, 6.0)  # waits for its data


def offload_plan(g: Graph, nodes: tuple[int, ...]) -> Plan:
    return Plan(list(no_recompute_plan(g).segments), graph_fingerprint=g.fingerprint, offload=nodes)


def test_offloading_lowers_the_peak_and_a_fast_link_hides_it():
    g = Graph.chain([100] * 8, [1.0] * 8)
    base = simulate(g, no_recompute_plan(g))
    fast = simulate(g, offload_plan(g, (0, 1, 2)), bandwidth_bytes_per_s=1e6)
    assert fast.peak_bytes < base.peak_bytes
    assert fast.offloaded_bytes == 300 and fast.offload_stall_s == 0.0 and fast.extra_time_s == 0.0


def test_a_slow_link_stalls_backward_and_keeps_memory_longer():
    g = Graph.chain([100] * 8, [1.0] * 8)
    fast = simulate(g, offload_plan(g, (0, 1, 2)), bandwidth_bytes_per_s=1e6)
    slow = simulate(g, offload_plan(g, (0, 1, 2)), bandwidth_bytes_per_s=20.0)
    assert slow.offload_stall_s > 0 and slow.extra_time_s == pytest.approx(slow.offload_stall_s)
    assert slow.peak_bytes >= fast.peak_bytes


def test_the_graphs_link_is_the_default():
    g = Graph.chain([100] * 8, [1.0] * 8)
    g.meta["bandwidth_bytes_per_s"] = 20.0
    plan = offload_plan(g, (0, 1, 2))
    assert simulate(g, plan).offload_stall_s == simulate(g, plan, bandwidth_bytes_per_s=20.0).offload_stall_s > 0
