"""``autoremat.cost.grad_handoff``: a view with no readers of its own (module level) whose backward has
workspace is touched at its place in backward, in the simulator and in the exact model alike."""

from __future__ import annotations

import networkx as nx
import pytest

from autoremat.cost import no_recompute_plan, simulate
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
