"""``autoremat.cost.replay_frames``: a module-level replay holds what its calls compute for later nodes
to the replay's end (Python frames); an fx replay frees it after its last reader in the replay."""

from __future__ import annotations

import networkx as nx
import pytest

from autoremat.cost import simulate
from autoremat.graph import Graph
from autoremat.plan import Plan, Segment


def _layer(mode: str) -> Graph:
    """A call ``layer`` computing ``bias`` (100 B: read by ``use`` in the call and by ``next`` after it,
    as T5's first layer returns its position bias to the next layers), then ``big`` (50 B, saved)."""
    g = nx.DiGraph()
    g.add_node(0, name="embed", out_bytes=1, alloc_bytes=1, scope=("embed",))
    g.add_node(1, name="bias", out_bytes=100, alloc_bytes=100, scope=("layer",))
    g.add_node(2, name="use", out_bytes=1, alloc_bytes=1, scope=("layer",))
    g.add_node(3, name="big", out_bytes=50, alloc_bytes=50, saves=(3,), scope=("layer",))
    g.add_node(4, name="next", out_bytes=1, alloc_bytes=1, saves=(1,), is_output=True, scope=("head",))
    g.add_edges_from([(0, 1), (1, 2), (2, 3), (1, 4), (3, 4)])
    return Graph(g, {"mode": mode, "loss_saves": []})


@pytest.mark.parametrize("mode,peak,at,replayed", [
    ("module", 302, "recompute of node 3 (big)", [251, 252, 301]),  # bias's copy held to the replay's end
    ("fx", 252, "backward of node 4 (next)", [251, 152, 201]),  # freed after ``use`` reads it
])
def test_a_replayed_calls_returned_value_stays_to_the_replays_end(mode, peak, at, replayed) -> None:
    plan = Plan([Segment((0,), False), Segment((1, 2, 3), True), Segment((4,), False)])
    sim = simulate(_layer(mode), plan)
    assert (sim.peak_bytes, sim.peak_at) == (peak, at)
    assert [live for phase, _, live in sim.timeline if phase == "recompute"] == replayed
