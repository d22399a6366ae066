"""The simulator's rule for a node's ``lingering`` bytes (``autoremat.capture.lingering``): part of its
``fwd_temp_bytes`` that is an earlier node's output a Python frame keeps alive; counted only where the
plan does not hold that storage already and, in a replay, only where the replay makes it again.

On a chain ``0 -> 1 -> 2 -> 3 -> 4`` (100 bytes each) whose node 0 is read by node 1 only and saved by
nobody, node 2 and node 3 carry node 0's 100 bytes as lingering workspace; each case compares the
levels with the attribute against the same graph without it (the bytes counted every time)."""

from __future__ import annotations

import networkx as nx
import pytest

from autoremat.cost import simulate, step_levels
from autoremat.graph import Graph
from autoremat.plan import Plan, Segment


def _chain(lingering: dict[int, tuple[tuple[int, int], ...]], saves: dict[int, tuple[int, ...]]) -> Graph:
    g = nx.DiGraph()
    for v in range(5):
        pairs = lingering.get(v, ())
        g.add_node(v, name=f"n{v}", out_bytes=100, alloc_bytes=100, time_s=1.0, bwd_time_s=2.0,
                   saves=saves.get(v, (v,)), fwd_temp_bytes=sum(b for _, b in pairs), lingering=pairs,
                   is_output=v == 4)
        if v:
            g.add_edge(v - 1, v)
    return Graph(g, {"loss_saves": [4]})


def _pair(lingering: dict[int, tuple[tuple[int, int], ...]], saves: dict[int, tuple[int, ...]]) -> tuple[Graph, Graph]:
    """The graph with its lingering pairs, and the same bytes as plain workspace."""
    with_pairs = _chain(lingering, saves)
    plain = _chain(lingering, saves)
    for v in plain.nodes:
        plain.node(v)["lingering"] = ()
    return with_pairs, plain


def _plan(g: Graph, *segments: tuple[tuple[int, ...], bool]) -> Plan:
    return Plan([Segment(nodes, rec) for nodes, rec in segments], graph_fingerprint=g.fingerprint)


LINGER_0 = {2: ((0, 100),), 3: ((0, 100),)}
SAVES = {0: ()}


def test_the_unpatched_step_counts_every_lingering_byte() -> None:
    g, plain = _pair(LINGER_0, SAVES)
    assert step_levels(g).fwd_touch == step_levels(plain).fwd_touch
    assert step_levels(g).fwd_touch[2] == 300  # nodes 1 and 2, and node 0 held by a frame
    assert simulate(g, _plan(g, ((0, 1, 2, 3, 4), False))).peak_bytes == \
        simulate(plain, _plan(plain, ((0, 1, 2, 3, 4), False))).peak_bytes


def test_a_storage_the_plan_holds_is_not_counted_again_in_forward() -> None:
    """Node 0 is the recomputed segment's input: the segment holds it, so it lingers for nothing."""
    g, plain = _pair(LINGER_0, SAVES)
    segments = (((0,), False), ((1, 2, 3), True), ((4,), False))
    got, ref = step_levels(g, _plan(g, *segments)), step_levels(plain, _plan(plain, *segments))
    assert got.fwd_touch[2] == ref.fwd_touch[2] - 100
    assert got.fwd_touch[1] == ref.fwd_touch[1]  # no lingering bytes there


@pytest.mark.parametrize("first", [1, 2])
def test_a_replay_counts_only_what_it_makes_again(first: int) -> None:
    """Node 0 is made before the replayed segment: the frame that held it in forward is gone."""
    g, plain = _pair(LINGER_0, SAVES)
    segments = (((*range(first),), False), ((*range(first, 4),), True), ((4,), False))
    got, ref = step_levels(g, _plan(g, *segments)), step_levels(plain, _plan(plain, *segments))
    for v in (2, 3):
        assert got.recompute_touch[v] == ref.recompute_touch[v] - 100
    if first == 2:  # nobody holds node 0 in forward: it lingers there
        assert got.fwd_touch[2] == ref.fwd_touch[2]


def test_a_replay_counts_what_it_makes_again() -> None:
    """Node 1 (read by node 2 only, saved by nobody) lingers under node 3 in forward and in the replay
    of the segment that makes it again."""
    g, plain = _pair({3: ((1, 100),)}, {1: ()})
    segments = (((0,), False), ((1, 2, 3), True), ((4,), False))
    got, ref = step_levels(g, _plan(g, *segments)), step_levels(plain, _plan(plain, *segments))
    assert got.recompute_touch[3] == ref.recompute_touch[3] is not None
    assert got.fwd_touch[3] == ref.fwd_touch[3]


def test_lingering_pairs_are_checked_scaled_and_kept_in_json() -> None:
    g, _ = _pair(LINGER_0, SAVES)
    assert Graph.from_json(g.to_json()).node(2)["lingering"] == ((0, 100),)
    assert g.scaled(1.5).node(3)["lingering"] == ((0, 150),)
    bad = nx.DiGraph()
    bad.add_node(0, lingering=((0, 4),))
    with pytest.raises(ValueError, match="run before it"):
        Graph(bad)
