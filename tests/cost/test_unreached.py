"""The simulator's rule for storages that nodes no gradient reaches hold (``unreached_saves``,
:mod:`autoremat.cost.unreached`): their lingering bytes count in forward unless a recomputed segment
holds both the holders and the maker (a checkpointed region saves nothing).

Network: ``0 -> 1`` and ``0 -> 2 -> 3 -> 4 -> 5`` (100 bytes each); node 1 takes no part in backward
(an integer-code branch) and holds node 0's output and its own until the branch is freed at node 4
(nothing else saves them): capture measures them as lingering bytes of node 3 (node 0's after its last
reader, node 2)."""

from __future__ import annotations

import networkx as nx
import pytest

from autoremat.cost import simulate, step_levels
from autoremat.cost.unreached import freed_by_recomputation
from autoremat.graph import Graph
from autoremat.plan import Plan, Segment

LINGER = {3: ((0, 100), (1, 100))}


def _graph(unreached: tuple[int, ...] = (0, 1), lingering: dict = LINGER) -> Graph:
    g = nx.DiGraph()
    for v in range(6):
        pairs = lingering.get(v, ())
        g.add_node(v, name=f"n{v}", out_bytes=100, alloc_bytes=100, time_s=1.0, bwd_time_s=2.0,
                   saves=() if v < 2 else (v,), requires_grad=v != 1,
                   unreached_saves=unreached if v == 1 else (), fwd_temp_bytes=sum(b for _, b in pairs),
                   lingering=pairs, is_output=v == 5)
    g.add_edges_from([(0, 1), (0, 2), (2, 3), (3, 4), (4, 5)])
    return Graph(g, {"loss_saves": [5]})


def _plan(g: Graph, *segments: tuple[tuple[int, ...], bool]) -> Plan:
    return Plan([Segment(nodes, rec) for nodes, rec in segments], graph_fingerprint=g.fingerprint)


def _touch(g: Graph, *segments: tuple[tuple[int, ...], bool]) -> int:
    return step_levels(g, _plan(g, *segments)).fwd_touch[3]


def test_the_unpatched_step_counts_what_the_branch_holds() -> None:
    g = _graph()
    plain = _graph(unreached=())
    assert _touch(g, ((0, 1, 2, 3, 4, 5), False)) == _touch(plain, ((0, 1, 2, 3, 4, 5), False))
    assert freed_by_recomputation(g, _plan(g, ((0, 1, 2, 3, 4, 5), False))) == frozenset()


def test_recomputed_together_the_holder_and_its_makers_free_them() -> None:
    g = _graph()
    stored = _touch(g, ((0, 1, 2, 3, 4, 5), False))
    both = ((0, 1), True), ((2, 3, 4, 5), False)
    assert freed_by_recomputation(g, _plan(g, *both)) == {0, 1}
    assert _touch(g, *both) == stored - 200  # both lingering makers
    ref = _graph(unreached=(), lingering={})  # the same plan, nothing lingering at all
    assert _touch(g, *both) == _touch(ref, *both)


def test_a_maker_outside_the_segment_is_its_input_and_still_lingers() -> None:
    g = _graph()
    alone = ((0,), False), ((1,), True), ((2, 3, 4, 5), False)
    assert freed_by_recomputation(g, _plan(g, *alone)) == {1}
    assert _touch(g, *alone) == _touch(g, ((0, 1, 2, 3, 4, 5), False)) - 100


def test_a_plan_freeing_them_lowers_the_step_peak_where_they_set_it() -> None:
    g = _graph(lingering={3: ((0, 100), (1, 100)), 2: ((1, 100),)})
    g.node(3)["fwd_temp_bytes"] += 1000  # the step's peak is node 3's forward
    base = simulate(g, _plan(g, ((0, 1, 2, 3, 4, 5), False))).peak_bytes
    assert simulate(g, _plan(g, ((0,), False), ((1,), True), ((2, 3, 4, 5), False))).peak_bytes == base - 100


def test_unreached_saves_round_trip_and_are_checked() -> None:
    g = _graph()
    assert Graph.from_json(g.to_json()).node(1)["unreached_saves"] == (0, 1)
    bad = nx.DiGraph()
    bad.add_node(0, unreached_saves=(1,))
    bad.add_node(1)
    with pytest.raises(ValueError, match="runs after it"):
        Graph(bad)


def test_a_recomputed_region_no_gradient_reaches_holds_no_inputs_for_a_backward() -> None:
    """Node 1 recomputed alone: node 0 is its input. A region with a backward would hold it to the
    backward's end; this one has none (the branch's own node holds it until freed: lingering)."""
    g = _graph()
    plan = ((0,), False), ((1,), True), ((2, 3, 4, 5), False)
    live = _graph(unreached=())  # the same, but node 1 holds nothing: an ordinary no-grad node
    assert step_levels(g, _plan(g, *plan)).bwd_touch[5] == step_levels(live, _plan(live, *plan)).bwd_touch[5] - 100


def test_what_the_returned_object_holds_through_the_branch_goes_with_it() -> None:
    """Node 0 is also held by the returned object (``held_by_output``: the object holds the branch's
    graph, which holds node 0) until the loss: recomputing node 0 and its holder frees it there."""
    g = _graph(lingering={})
    g.node(0)["held_by_output"] = True
    stored = ((0, 1, 2, 3, 4, 5), False),
    both = ((0, 1), True), ((2, 3, 4, 5), False)
    assert step_levels(g, _plan(g, *stored)).fwd_touch[4] == step_levels(g, _plan(g, *both)).fwd_touch[4] + 100
    plain = _graph(unreached=(), lingering={})  # held by the object itself: held either way
    plain.node(0)["held_by_output"] = True
    assert step_levels(plain, _plan(plain, *stored)).fwd_touch[4] == step_levels(plain, _plan(plain, *both)).fwd_touch[4]


@pytest.mark.parametrize("at,held_to", [(4, (3, 4)), (-1, (3, 4, 5))])
def test_a_recomputed_regions_inputs_are_held_to_where_its_graph_was_freed(at: int, held_to: tuple[int, ...]) -> None:
    """Capture recorded the branch's graph freed after node 4 (or after the forward: ``-1``,
    :func:`autoremat.capture.dead_nodes.release_points`); with no lingering bytes to show it (under bf16
    autocast the maker's consumer saved a cast), the recomputed branch still holds its input, node 0, to
    there."""
    alone = ((0,), False), ((1,), True), ((2, 3, 4, 5), False)
    plain = _graph(lingering={})
    freed = _graph(lingering={})
    freed.meta["dead_released_after"] = [[1, at]]
    assert Graph.from_json(freed.to_json()).meta["dead_released_after"] == [[1, at]]
    before, after = (step_levels(g, _plan(g, *alone)).fwd_touch for g in (plain, freed))
    assert [after[v] - before[v] for v in (2, 3, 4, 5)] == [100 if v in held_to else 0 for v in (2, 3, 4, 5)]
