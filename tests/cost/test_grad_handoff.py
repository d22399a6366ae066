"""``autoremat.cost.grad_handoff``: a view with no readers of its own (module level) whose backward has
workspace is touched at its place in backward, and a first gradient that is a view is summed with the
next out of place, in the simulator and in the exact model alike."""

from __future__ import annotations

import networkx as nx
import pytest

from autoremat.cost import no_recompute_plan, simulate
from autoremat.cost.simulator import step_levels
from autoremat.cost.bitsets import GraphBits
from autoremat.cost.segment_replay import exact_peak
from autoremat.graph import Graph
from autoremat.plan import Plan, Segment


def _windows() -> Graph:
    """``proj`` (10 B) -> an overlapping view of it (100 B of backward workspace, no readers) and
    ``reduce`` (4 B, the output), which reads and saves ``proj``'s storage."""
    g = nx.DiGraph()
    g.add_node(0, name="proj", out_bytes=10, alloc_bytes=10, saves=())
    g.add_node(1, name="windows", out_bytes=10, alloc_bytes=0, alias_of=0, bwd_temp_bytes=100)
    g.add_node(2, name="reduce", out_bytes=4, alloc_bytes=4, saves=(0,), is_output=True)
    g.add_edges_from([(0, 1), (0, 2)])
    return Graph(g, {"mode": "module", "loss_saves": []})


@pytest.mark.parametrize("segments", [None, [Segment((0,), True), Segment((1, 2), False)]])
def test_the_views_backward_touches_its_inputs_gradient_and_workspace(segments) -> None:
    g = _windows()
    plan = no_recompute_plan(g) if segments is None else Plan(segments)
    sim = simulate(g, plan)
    # after reduce's backward: proj's gradient (10 B) is all that is live; the view's backward adds
    # another of proj's size and its 100 B of workspace
    assert (sim.peak_bytes, sim.peak_at) == (120, "backward of node 1 (windows)")
    p = GraphBits(g)
    assert exact_peak(p, [p.full])[0] == exact_peak(p, [1, p.full])[0] == 120


def test_no_workspace_without_a_gradient_at_the_root() -> None:
    g = _windows()
    g.node(2)["requires_grad"] = False  # nothing hands proj a gradient: the view's backward never runs
    g = Graph(g.nx, g.meta)
    p = GraphBits(g)
    assert simulate(g, no_recompute_plan(g)).peak_bytes == exact_peak(p, [p.full])[0] == 14


def _two_readers(first_view: bool, passthrough: bool = False) -> Graph:
    """``table`` (100 B, no saves) read by ``a`` then ``b`` (10 B each, saving nothing), both read by
    ``out``; ``b``'s backward hands ``table`` its first gradient (as a view where ``first_view``),
    ``a``'s the second; ``passthrough``: ``a`` and ``b`` pass their own gradients on (a transpose)."""
    g = nx.DiGraph()
    g.add_node(0, name="table", out_bytes=100, alloc_bytes=100, first_grad_view=first_view)
    for v, name in ((1, "a"), (2, "b")):
        g.add_node(v, name=name, out_bytes=100 if passthrough else 10, alloc_bytes=0 if passthrough else 10,
                   alias_of=0 if passthrough else None, grad_passthrough=passthrough)
    g.add_node(3, name="out", out_bytes=4, alloc_bytes=4, saves=(1, 2), is_output=True)
    g.add_edges_from([(0, 1), (0, 2), (1, 3), (2, 3)])
    return Graph(g, {"mode": "fx", "loss_saves": []})


def _at_a(g: Graph, plan: Plan | None = None) -> int:
    """The simulated level at ``a``'s backward."""
    return step_levels(g, plan).bwd_touch[1]


def test_a_first_gradient_that_is_a_view_is_summed_out_of_place() -> None:
    """At ``a``'s backward (``table``'s storage is gone: nothing saves it): ``a``'s gradient (10 B),
    the first of ``table`` (100 B), ``a``'s new one (100 B) and, where the first is a view, their sum
    (100 B); added in place into a first gradient ``table`` owns otherwise. The exact model agrees."""
    for first_view, level in ((False, 210), (True, 310)):
        g = _two_readers(first_view)
        sim = simulate(g, no_recompute_plan(g))
        assert (_at_a(g), sim.peak_bytes, sim.peak_at) == (level, level, "backward of node 1 (a)")
        p = GraphBits(g)
        assert exact_peak(p, [p.full])[0] == exact_peak(p, [1, p.full])[0] == level


def test_the_sum_comes_after_the_givers_workspace_is_gone() -> None:
    """``a``'s backward workspace (150 B) and the first gradient alive through the sum (100 B) are two
    moments: the level is the larger (Mamba's broadcast ``mul``: 256 KiB of workspace, then the sum)."""
    g = _two_readers(True)
    g.node(1)["bwd_temp_bytes"] = 150
    assert _at_a(g) == 210 + 150
    p = GraphBits(g)
    assert exact_peak(p, [p.full])[0] == simulate(g, no_recompute_plan(g)).peak_bytes == 210 + 150


def test_a_pass_through_reader_hands_the_view_and_the_sum_is_a_third_buffer() -> None:
    """A transpose read twice (fx level): ``b`` hands ``table`` its own gradient (no new buffer); ``a``'s,
    its own too, is summed with it into a new one while both live (200 B where ``table`` owns the first)."""
    for first_view, level in ((False, 200), (True, 300)):
        g = _two_readers(first_view, passthrough=True)
        assert _at_a(g) == level
        p = GraphBits(g)
        assert exact_peak(p, [p.full])[0] == simulate(g, no_recompute_plan(g)).peak_bytes == 304  # out's backward


def test_the_exact_model_starts_a_segment_with_the_first_gradient_still_a_view() -> None:
    """``b`` in a later segment than ``a``: the state after ``b``'s segment (bitsets' ``After``) says
    ``table``'s gradient is still the view, and the replay of ``a``'s segment sums out of place."""
    g = _two_readers(True)
    p = GraphBits(g)
    assert p.after(0b0011).viewed == frozenset({0})
    assert p.after(0b0111).viewed == frozenset()  # both readers done: summed already
    plan = Plan([Segment((0, 1), False), Segment((2, 3), False)])
    assert exact_peak(p, [0b0011, p.full])[0] == simulate(g, plan).peak_bytes == _at_a(g, plan) == 310
