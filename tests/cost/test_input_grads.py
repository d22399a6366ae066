"""What a node's backward hands its inputs beyond the default (``autoremat.capture.input_grads``).

``grad_new``: inputs a pass-through node's backward gives a new gradient even so (under autocast a
residual ``add`` of an fp32 and a bf16 tensor hands its fp32 gradient to one input and a bf16 cast
to the other). ConvNeXt under bf16 autocast was predicted 0.976x its measured least-plan peak while
the cost models shared the gradient with both inputs.

On ``0 -> {1, 2} -> 3``: node 3 adds 1 (100 bytes) and 2 (50 bytes) and passes its gradient to 1;
2, read only by 3, gets a new 50-byte one (node 3's workspace puts the peak there). The simulator, the replay model of ``milp`` and the
closed form hold it; the backward floor stays below.

``grad_part``: inputs read through one of a split's views get a gradient of the view's size until the
split's backward joins them before the input's own backward."""

from __future__ import annotations

import networkx as nx
import pytest

from autoremat.cost import simulate, step_levels
from autoremat.cost.bitsets import GraphBits
from autoremat.cost.closed_form import closed_peak
from autoremat.cost.segment_replay import exact_peak
from autoremat.graph import Graph
from autoremat.plan import Plan, segments_from_lower_sets
from autoremat.solvers.milp.facts import backward_need


def _graph(cast: bool, *, size: int = 50) -> Graph:
    g = nx.DiGraph()
    g.add_node(0, name="x", out_bytes=100, alloc_bytes=100, saves=(0,))
    g.add_node(1, name="a", out_bytes=100, alloc_bytes=100, saves=(0,))
    g.add_node(2, name="b", out_bytes=size, alloc_bytes=size, saves=(0,))
    g.add_node(3, name="add", out_bytes=100, alloc_bytes=100, grad_passthrough=True, is_output=True, bwd_temp_bytes=1000,
               grad_new=(2,) if cast else ())
    g.add_edges_from([(0, 1), (0, 2), (1, 3), (2, 3)])
    return Graph(g, {"loss_saves": []})


def test_the_simulator_gives_the_cast_input_a_gradient_of_its_own() -> None:
    cast, shared = step_levels(_graph(True)), step_levels(_graph(False))
    assert cast.bwd_after[3] == shared.bwd_after[3] + 50
    assert cast.peak == shared.peak + 50  # at the add's backward (its workspace)


@pytest.mark.parametrize("size", [50, 400])
def test_the_specialised_models_hold_it_too(size: int) -> None:
    g = _graph(True, size=size)
    p = GraphBits(g)
    for seq in ([p.full], [0b0011, p.full], [0b0001, 0b0111, p.full]):
        plan = Plan(segments_from_lower_sets(g, [[v for v in g.nodes if m >> v & 1] for m in seq]))
        sim = simulate(g, plan, record=False).peak_bytes
        assert exact_peak(p, seq)[0] == sim, seq
        assert closed_peak(p, seq)[0] >= sim, seq


def test_grad_new_names_inputs_only() -> None:
    g = nx.DiGraph()
    g.add_node(0, name="x")
    g.add_node(1, name="y", grad_new=(0,))
    with pytest.raises(ValueError, match="not its inputs"):
        Graph(g)
    assert Graph.from_json(_graph(True).to_json()).node(3)["grad_new"] == (2,)


def _glu(parts: bool) -> Graph:
    """``gate, up = proj.chunk(2)``: node 0 (200 bytes), node 1 = silu(gate), node 2 = up * node 1."""
    g = nx.DiGraph()
    g.add_node(0, name="proj", out_bytes=200, alloc_bytes=200, saves=())
    g.add_node(1, name="silu", out_bytes=100, alloc_bytes=100, saves=(0,), grad_part=((0, 100),) if parts else ())
    g.add_node(2, name="mul", out_bytes=100, alloc_bytes=100, saves=(0, 1), is_output=True,
               grad_part=((0, 100),) if parts else ())
    g.add_edges_from([(0, 1), (0, 2), (1, 2)])
    return Graph(g, {"loss_saves": []})


def test_a_split_view_gets_a_gradient_of_its_size_joined_before_its_input() -> None:
    parts, whole = step_levels(_glu(True)), step_levels(_glu(False))
    assert parts.bwd_touch[2] == whole.bwd_touch[2] - 100  # half the projection's gradient, not all
    assert parts.bwd_after[1] == whole.bwd_after[1]  # both halves in: the same bytes as the whole
    assert parts.bwd_touch[0] >= whole.bwd_touch[0]  # joined (one buffer of 200) before node 0's backward
    g = _glu(True)
    for v in g.nodes:  # milp's per-node need stays a lower bound
        assert backward_need(g, v, {}) <= parts.bwd_touch[v]
    assert Graph.from_json(g.to_json()).node(2)["grad_part"] == ((0, 100),)
    assert g.scaled(2.0).node(1)["grad_part"] == ((0, 200),)
