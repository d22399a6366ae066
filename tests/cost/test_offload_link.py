"""``autoremat.cost.offload_link``: one transfer at a time per direction; offloads release memory
once copied; prefetches come back in order of first backward use, and one still running stalls the
step; offloaded checkpoints (inputs of recomputed segments); forward waits; properties on random
graphs (a free link never raises the peak; derived waits replay exactly from the plan)."""

from __future__ import annotations

import random

import pytest
from _graphs import random_dag_with_views, random_profiled, rich_dag, with_held_outputs

from autoremat.cost import no_recompute_plan, simulate
from autoremat.cost.offload_link import Link
from autoremat.graph import Graph
from autoremat.plan import Plan, Segment, offloadable_nodes, region_stop, segments_from_lower_sets, wait_points


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


# ---------------------------------------------------------------------- the DAG model (issue 22)
def region_plan(g: Graph, first: int, last: int, offload: tuple[int, ...] = ()) -> Plan:
    """Nodes before ``first`` kept, ``first..last`` one recomputed segment, the rest kept."""
    n = len(g)
    segs = [Segment(tuple(range(first)), False)] if first else []
    segs += [Segment(tuple(range(first, last + 1)), True)]
    if last + 1 < n:
        segs.append(Segment(tuple(range(last + 1, n)), False))
    return Plan(segs, graph_fingerprint=g.fingerprint, offload=offload)


def test_the_links_carry_one_transfer_per_direction_at_a_time():
    """Copies to host and prefetches run at once (one link per direction): an offload still
    copying out does not delay the prefetch of another storage."""
    g = Graph.chain([100] * 6, [1.0] * 6)
    sim = simulate(g, offload_plan(g, (0, 4)), bandwidth_bytes_per_s=50.0)  # 2 s per copy
    # 4's copy out ends at 5 + 2 = 7 > the end of forward (6): its device copy serves backward
    # (no transfer back), while 0 (out at 1..3) comes back on the other link, hidden
    assert sim.offload_order == [4, 0] and sim.offload_stall_s == 0.0


def test_an_offloaded_checkpoint_lowers_the_peak_and_comes_back_for_the_replay():
    g = Graph.chain([100] * 7 + [300] * 3, [1.0] * 10)  # the peak: the tail's backward, before the replay
    plain = region_plan(g, 2, 6)
    assert offloadable_nodes(g, plain) >= {1}  # the region's input: a checkpoint it keeps
    base = simulate(g, plain)
    fast = simulate(g, region_plan(g, 2, 6, offload=(0, 1)), bandwidth_bytes_per_s=1e9)
    assert fast.peak_bytes < base.peak_bytes and fast.offload_stall_s == 0.0
    assert fast.offload_order == [1, 0]  # the region's replay (at node 6's backward) comes before node 1's
    # 7 s per copy: out at 2..9 (done before backward starts at 10), back at 10..17, needed at 16
    slow = simulate(g, region_plan(g, 2, 6, offload=(1,)), bandwidth_bytes_per_s=100 / 7)
    assert slow.offload_stall_s == pytest.approx(1.0)  # the replay waits for its input to come back


def test_a_region_that_replays_nothing_keeps_its_inputs_on_the_device():
    g = Graph.chain([100] * 6, [1.0] * 6, saves_own_output=False)
    plan = region_plan(g, 2, 3)
    assert region_stop(g, plan.segments[1]) == -1 and offloadable_nodes(g, plan) == set()


def test_views_of_an_offloaded_region_input_read_the_prefetched_copy():
    """A view inside a region of an input it keeps: the replay reads the prefetched storage."""
    g = make_views_graph()
    plan = Plan([Segment((0, 1), False), Segment((2, 3, 4), True), Segment((5,), False)], offload=(1,))
    assert 1 in offloadable_nodes(g, plan)
    fast = simulate(g, plan, bandwidth_bytes_per_s=1e12)
    assert fast.peak_bytes <= simulate(g, Plan(plan.segments)).peak_bytes and fast.offload_order == [1]


def make_views_graph() -> Graph:
    """0 -> 1 -> 2 (a view of 1) -> 3 -> 4 -> 5; 3 saves 2 (so the region {2, 3, 4} replays a view
    of its input 1); 1 also goes to 4."""
    import networkx as nx

    d = nx.DiGraph()
    for v in range(6):
        d.add_node(v, name=f"n{v}", out_bytes=100, alloc_bytes=0 if v == 2 else 100, alias_of=1 if v == 2 else None,
                   saves=(2,) if v == 3 else (v,), time_s=1.0, bwd_time_s=2.0, is_output=v == 5)
    d.add_edges_from([(0, 1), (1, 2), (2, 3), (3, 4), (1, 4), (4, 5)])
    return Graph(d, {"loss_saves": [5]})


def test_forward_waits_free_memory_at_a_stall_and_derived_waits_replay_exactly():
    g = Graph.chain([100] * 8, [1.0] * 8)
    plan = offload_plan(g, (0, 1, 2))
    free = simulate(g, plan, bandwidth_bytes_per_s=20.0)  # 5 s per copy against 1 s nodes
    limited = simulate(g, plan, bandwidth_bytes_per_s=20.0, offload_wait_limit_bytes=500)
    assert limited.offload_waits and limited.offload_wait_s > 0
    assert limited.offload_stall_s >= limited.offload_wait_s and limited.peak_bytes < free.peak_bytes
    plan.offload_waits = limited.offload_waits
    again = simulate(g, plan, bandwidth_bytes_per_s=20.0)
    assert (again.peak_bytes, again.extra_time_s, again.offload_wait_s) == (
        limited.peak_bytes, limited.extra_time_s, limited.offload_wait_s)


def test_the_plans_order_replaces_the_order_of_use_for_prefetches():
    g = Graph.chain([100] * 8, [1.0] * 8)
    plan = offload_plan(g, (0, 1, 2))
    own = simulate(g, plan, bandwidth_bytes_per_s=1e9)
    plan.offload_order = (0, 1, 2)  # the wrong way round: 0 is prefetched first and held longest
    given = simulate(g, plan, bandwidth_bytes_per_s=1e9)
    assert own.offload_order == [2, 1, 0] and given.peak_bytes >= own.peak_bytes


def random_plan(g: Graph, rng: random.Random) -> Plan:
    n = len(g)
    cuts = sorted(rng.sample(range(1, n), min(n - 1, rng.randint(0, 4)))) if n > 1 else []
    return Plan(segments_from_lower_sets(g, [range(c) for c in cuts] + [range(n)],
                                         recompute_last=rng.random() < 0.3))


def random_cases(count: int, seed: int):
    rng = random.Random(seed)
    makers = [random_profiled, rich_dag, lambda r, n: random_dag_with_views(r.randrange(10 ** 6), n)]
    for i in range(count):
        g = with_held_outputs(makers[i % 3](rng, rng.randint(2, 25)), i) if i % 2 else makers[i % 3](rng, rng.randint(2, 25))
        plan = random_plan(g, rng)
        subset = tuple(v for v in sorted(offloadable_nodes(g, plan)) if rng.random() < 0.6)
        yield rng, g, plan, Plan(list(plan.segments), offload=subset)


def test_property_a_free_link_never_raises_the_peak_nor_stalls():
    """With an instant link every offloaded storage leaves the device at its last forward use and
    is back when first needed: the device holds a subset of what the plan without offloads holds."""
    for _rng, g, plan, offloaded in random_cases(150, seed=1):
        fast = simulate(g, offloaded, bandwidth_bytes_per_s=1e30)
        assert fast.peak_bytes <= simulate(g, plan).peak_bytes and fast.offload_stall_s == 0.0
        assert sorted(fast.offload_order) == list(offloaded.offload)


def test_property_derived_waits_simulate_the_same_from_the_plan():
    for rng, g, _plan, offloaded in random_cases(150, seed=2):
        bandwidth = rng.choice([1.0, 10.0, 100.0])
        limit = rng.randint(0, max(1, simulate(g, offloaded).peak_bytes))
        derived = simulate(g, offloaded, bandwidth_bytes_per_s=bandwidth, offload_wait_limit_bytes=limit)
        assert set(derived.offload_waits) <= wait_points(g, offloaded)
        offloaded.offload_waits = derived.offload_waits
        again = simulate(g, offloaded, bandwidth_bytes_per_s=bandwidth)
        assert (again.peak_bytes, again.extra_time_s, again.offload_order) == (
            derived.peak_bytes, derived.extra_time_s, derived.offload_order)


def test_property_release_waits_simulate_the_same_and_sit_where_copies_are_released():
    """``release_waits`` adds a wait at each forward node where the simulator releases an
    offloaded device copy (the last released there, in issue order): the plan with them simulates
    to the same peak, time and order, and every release at a wait point has one."""
    from autoremat.plan import release_waits

    seen = 0
    for rng, g, _plan, offloaded in random_cases(150, seed=3):
        bandwidth = rng.choice([1.0, 10.0, 100.0, 1e30])
        before = simulate(g, offloaded, bandwidth_bytes_per_s=bandwidth)
        for v, r in before.offload_releases.items():
            assert r in offloaded.offload
        offloaded.offload_waits = release_waits(g, offloaded, before.offload_releases)
        assert set(offloaded.offload_waits) <= wait_points(g, offloaded)
        assert {v for v in before.offload_releases if v in wait_points(g, offloaded)} <= set(offloaded.offload_waits)
        again = simulate(g, offloaded, bandwidth_bytes_per_s=bandwidth)
        assert (again.peak_bytes, again.extra_time_s, again.offload_order) == (
            before.peak_bytes, before.extra_time_s, before.offload_order)
        seen += len(before.offload_releases)
    assert seen > 50  # the property was exercised


def test_a_finalized_offload_plan_waits_where_its_copies_are_released():
    """What :func:`autoremat.solvers.finalize_plan` stamps: the solver's plan with the release
    waits, its prediction the simulator's for that plan."""
    from autoremat.solvers import finalize_plan

    for _rng, g, _plan, offloaded in random_cases(40, seed=4):
        if not offloaded.offload:
            continue
        g.meta["bandwidth_bytes_per_s"] = 10.0
        sim = simulate(g, offloaded)
        plan = finalize_plan(g, Plan(list(offloaded.segments), offload=offloaded.offload), 10**18, "manual")
        expected = {v for v in sim.offload_releases if v in wait_points(g, plan)}
        assert expected <= set(plan.offload_waits)
        again = simulate(g, plan)
        assert (plan.predicted_peak_bytes, plan.predicted_extra_time_s) == (again.peak_bytes, again.extra_time_s)


# ------------------------------------------------ a node's own saved tensors as one unit (offload_saved)
def saved_plan(g: Graph, nodes, **kw) -> Plan:
    return Plan(list(no_recompute_plan(g).segments), graph_fingerprint=g.fingerprint, offload_saved=tuple(nodes), **kw)


def test_a_nodes_own_saved_tensors_leave_after_its_forward_and_come_back_for_its_backward():
    """module_graph: each call keeps 50 + 10 v bytes of its own. Offloaded at a free link, they
    are gone from the forward's level once copied (the peak falls by about their sum less the
    units prefetched ahead), the bytes moved are theirs, backward needs them in reverse order,
    and nothing stalls; a slow link stalls backward, and the stall is the extra time."""
    from _graphs import module_graph

    g = module_graph(10)
    base = simulate(g, no_recompute_plan(g))
    units = tuple(range(10))
    fast = simulate(g, saved_plan(g, units), bandwidth_bytes_per_s=1e12)
    assert fast.offloaded_bytes == sum(50 + 10 * v for v in units)
    assert fast.offload_order == [-1 - v for v in reversed(units)]
    assert fast.extra_time_s < 1e-6
    assert fast.peak_bytes <= base.peak_bytes - sum(50 + 10 * v for v in range(8))
    slow = simulate(g, saved_plan(g, units), bandwidth_bytes_per_s=1.0)
    assert slow.offload_stall_s > 0 and slow.extra_time_s == pytest.approx(slow.offload_stall_s)
    assert slow.peak_bytes >= fast.peak_bytes


def test_offloaded_units_of_both_kinds_share_the_link_in_issue_order():
    """A node's output and its own saved tensors: one copy at a time in the order the forward
    issues them; a wait for a unit of saved tensors runs like any other (derived waits replay)."""
    from _graphs import module_graph

    g = module_graph(6)
    plan = saved_plan(g, (1, 2), offload=(0, 1))
    sim = simulate(g, plan, bandwidth_bytes_per_s=10.0, offload_wait_limit_bytes=0)
    assert sim.offloaded_bytes == 10 + 10 + 60 + 70
    assert set(sim.offload_order) == {0, 1, -2, -3}
    assert any(r < 0 for r in sim.offload_waits.values())
    again = simulate(g, saved_plan(g, (1, 2), offload=(0, 1), offload_waits=sim.offload_waits),
                     bandwidth_bytes_per_s=10.0)
    assert (again.peak_bytes, again.extra_time_s) == (sim.peak_bytes, sim.extra_time_s)


@pytest.mark.parametrize("seed", range(40))
def test_saved_units_at_a_free_link_never_raise_the_peak_on_random_graphs(seed: int):
    """Random profiled DAGs (views, nodes without grad, saved extras), with and without output
    offloads: adding every node's own saved tensors at a free link never raises the peak nor
    costs time, moves exactly their bytes, and a plan in the simulator's own order and waits
    replays the same."""
    rng = random.Random(seed)
    g = random_profiled(rng, rng.randint(4, 24)) if seed % 2 else random_dag_with_views(seed, rng.randint(4, 24))
    with_held_outputs(g, seed)
    base = no_recompute_plan(g)
    from autoremat.plan import saved_unit_nodes

    units = tuple(sorted(saved_unit_nodes(g, base)))
    outs = tuple(sorted(offloadable_nodes(g, base)))[: rng.randint(0, 3)]
    without = simulate(g, Plan(list(base.segments), offload=outs), bandwidth_bytes_per_s=1e15)
    with_units = simulate(g, Plan(list(base.segments), offload=outs, offload_saved=units), bandwidth_bytes_per_s=1e15)
    assert with_units.peak_bytes <= without.peak_bytes
    assert with_units.extra_time_s < 1e-6
    assert with_units.offloaded_bytes - without.offloaded_bytes == sum(g.node(v)["extra_saved_bytes"] for v in units)
    slow = simulate(g, Plan(list(base.segments), offload=outs, offload_saved=units), bandwidth_bytes_per_s=3.0,
                    offload_wait_limit_bytes=0)
    replay = Plan(list(base.segments), offload=outs, offload_saved=units, offload_waits=slow.offload_waits,
                  offload_order=tuple(slow.offload_order))
    again = simulate(g, replay, bandwidth_bytes_per_s=3.0)
    assert (again.peak_bytes, again.extra_time_s) == (slow.peak_bytes, slow.extra_time_s)
