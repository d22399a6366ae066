"""A block captured op by op as one offload unit (``Plan.offload_saved`` naming its first op,
:mod:`autoremat.region_units`) in the simulator: on seeded random block chains (as
``capture(blocks="auto")`` records them) the unit is exactly the plain per-node accounting's bytes
that only the block's own backward reads, moved as one transfer; with a free link and every unit
prefetched at once the step is the plain one less those bytes between the block's end and
backward; the plan's checks refuse what cannot work."""

from __future__ import annotations

import random

import pytest
from _graphs import block_chain, with_held_outputs

from autoremat.cost import no_recompute_plan, simulate
from autoremat.cost.offload_link import block_needs
from autoremat.errors import PlanFormatError
from autoremat.graph import Graph
from autoremat.plan import Plan, Segment, offloadable_nodes, saved_unit_nodes, validate_plan
from autoremat.plan_offload import check_offload_saved, unit_bytes
from autoremat.region_units import region_units, unit_span

FREE = float("inf")


def chains(count: int = 30) -> list[Graph]:
    rng = random.Random(7)
    return [with_held_outputs(block_chain(random.Random(rng.random()), rng.randint(2, 6), width=rng.randint(4, 9),
                                          classes=rng.randint(1, 2), shared_saved=rng.random() < 0.3), i)
            for i in range(count)]


def units_plan(g: Graph, units: tuple[int, ...], depth: int = 1, segments: list[Segment] | None = None) -> Plan:
    return Plan(segments or list(no_recompute_plan(g).segments), graph_fingerprint=g.fingerprint,
                offload_saved=units, offload_prefetch_depth=depth)


def test_every_block_is_a_unit_of_its_ops_saved_bytes():
    g = block_chain(random.Random(1), 4)
    regions = g.call_regions()
    found = region_units(g)
    assert sorted(ru.path for ru in found.values()) == [f"layers.{j}" for j in range(4)]
    for v, ru in found.items():
        assert ru.nodes == regions[ru.path] and v == ru.nodes[0] and ru.last == ru.nodes[-1]
        assert unit_bytes(g, -1 - v) == ru.nbytes > 0 and unit_span(g, -1 - v) == (ru.last, ru.first_use)
        outputs = {w for w in ru.nodes if any(s not in ru.nodes for s in g.succ(w))}
        assert not outputs & set(ru.roots) and all(g.root(r) == r for r in ru.roots)
        assert ru.output == (ru.last if outputs == {ru.last} else -1)
    assert set(found) <= saved_unit_nodes(g, no_recompute_plan(g))
    returned = {ru.output for ru in found.values()} - {-1}
    saved = {g.root(u) for w in g.nodes for u in g.node(w)["saves"]}
    assert returned & saved and returned & offloadable_nodes(g, no_recompute_plan(g)) == returned & saved


@pytest.mark.parametrize("i", range(30))
def test_with_a_free_link_the_step_is_the_plain_one_less_the_units_between_block_end_and_backward(i: int):
    """Every unit prefetched when backward starts: each forward event is the plain one less the
    units of the blocks ended before it (released at the next node), the loss less all of them,
    every backward event the plain one (each part back, freed by the nodes that saved it as
    without the offload); no time; the bytes moved are the units'."""
    g = chains()[i]
    found = region_units(g)
    units = tuple(sorted(found))
    plain = simulate(g, no_recompute_plan(g), bandwidth_bytes_per_s=FREE)
    off = simulate(g, units_plan(g, units, depth=len(units)), bandwidth_bytes_per_s=FREE)
    assert off.extra_time_s == 0.0 and off.offloaded_bytes == sum(ru.nbytes for ru in found.values())
    assert off.peak_bytes <= plain.peak_bytes
    events = [e for e in off.timeline if e[0] != "prefetch"]
    assert [e[:2] for e in events] == [e[:2] for e in plain.timeline]
    for (phase, v, live), (_p, _v, base) in zip(events, plain.timeline):
        if phase == "fwd":
            gone = sum(ru.nbytes for ru in found.values() if ru.last < v)
        elif phase == "loss":
            gone = off.offloaded_bytes
        else:
            gone = 0
        assert base - live == gone, (phase, v)


@pytest.mark.parametrize("i", range(0, 30, 3))
def test_one_unit_ahead_never_raises_the_peak_on_a_free_link(i: int):
    g = chains()[i]
    units = tuple(sorted(region_units(g)))
    plain = simulate(g, no_recompute_plan(g), bandwidth_bytes_per_s=FREE)
    one = simulate(g, units_plan(g, units), bandwidth_bytes_per_s=FREE)
    assert one.peak_bytes <= plain.peak_bytes and one.extra_time_s == 0.0
    assert one.offload_order == sorted((-1 - v for v in units))  # last block first


def test_slower_links_stall_and_the_stall_is_the_extra_time():
    """A unit whose copy out has not completed is read from the device (no stall), one that has
    comes back on the link and may not hide behind the backward: most graphs stall at some link."""
    stalled = 0
    for g in chains():
        units = tuple(sorted(region_units(g)))
        rate = sum(unit_bytes(g, -1 - v) for v in units) / simulate(g, no_recompute_plan(g)).fwd_time_s
        slow = [simulate(g, units_plan(g, units), bandwidth_bytes_per_s=rate * k) for k in (0.1, 0.3, 1.0, 3.0)]
        assert all(s.extra_time_s == pytest.approx(s.offload_stall_s) for s in slow)
        stalled += any(s.offload_stall_s > 0 for s in slow)
    assert stalled >= 20


@pytest.mark.parametrize("i", range(0, 30, 5))
def test_derived_waits_replay_exactly_and_units_mix_with_node_units(i: int):
    g = chains()[i]
    cands = saved_unit_nodes(g, no_recompute_plan(g))
    plan = units_plan(g, tuple(sorted(cands)))
    limited = simulate(g, plan, bandwidth_bytes_per_s=5.0, offload_wait_limit_bytes=0)
    plan.offload_waits = limited.offload_waits
    again = simulate(g, plan, bandwidth_bytes_per_s=5.0)
    assert (again.peak_bytes, again.extra_time_s, again.offload_wait_s) == (
        limited.peak_bytes, limited.extra_time_s, limited.offload_wait_s)


def test_a_recomputed_block_a_pinned_block_and_an_inner_op_are_refused():
    g = block_chain(random.Random(3), 3)
    found = region_units(g)
    first = min(found)
    ru = found[first]
    segments = [Segment(tuple(range(first)), False), Segment(ru.nodes, True),
                Segment(tuple(range(ru.last + 1, len(g))), False)]
    recomputed = units_plan(g, (first,), segments=segments)
    with pytest.raises(PlanFormatError, match="recomputed segment"):
        validate_plan(g, recomputed)
    assert first not in saved_unit_nodes(g, recomputed)
    inner = [Segment(tuple(range(ru.last)), False), Segment((ru.last,), True),  # the block's last op recomputed
             Segment(tuple(range(ru.last + 1, len(g))), False)]
    with pytest.raises(PlanFormatError, match="also recomputes"):
        check_offload_saved(g, units_plan(g, (first,), segments=inner))
    with pytest.raises(PlanFormatError, match="not the first op of a block"):
        validate_plan(g, units_plan(g, (ru.nodes[1],)))
    g.meta["pinned_regions"] = [ru.path]
    pinned = Graph.from_json(g.to_json())  # call regions are computed once per graph
    assert first not in region_units(pinned) and first not in saved_unit_nodes(pinned, no_recompute_plan(pinned))
    with pytest.raises(PlanFormatError, match="pinned"):
        validate_plan(pinned, units_plan(pinned, (first,)))


def test_a_derived_wait_before_a_block_weighs_all_of_it():
    """The runtime waits before a block's call, not inside it: with a memory limit the block's
    first op waits if the whole block's forward (``block_needs``: its most above the level it starts
    at, in the plain step) would pass the limit, not only the first op's own allocation."""
    g = block_chain(random.Random(1), 4)
    starts = sorted(region_units(g))
    need = block_needs(g)
    assert set(need) == set(starts) and all(n > 0 for n in need.values())
    plan = units_plan(g, tuple(starts[:2]))
    free = simulate(g, plan, bandwidth_bytes_per_s=1.0)  # copies still running through the forward
    before = next(live for phase, v, live in free.timeline if phase == "fwd" and v == starts[2] - 1)
    first = g.node(starts[2])
    assert first["alloc_bytes"] + first["extra_saved_bytes"] + first["fwd_temp_bytes"] < need[starts[2]]
    limited = simulate(g, plan, bandwidth_bytes_per_s=1.0, offload_wait_limit_bytes=before + need[starts[2]] - 1)
    assert min(limited.offload_waits) == starts[2] and limited.offload_wait_s > 0
    roomy = simulate(g, plan, bandwidth_bytes_per_s=1.0, offload_wait_limit_bytes=before + need[starts[2]])
    assert starts[2] not in roomy.offload_waits
