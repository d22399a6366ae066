"""``autoremat.cost.chain``: Beaumont et al.'s chain model, and a chain made from a graph.

A chain checks its arguments and round-trips through its dict; a chain built from a graph keeps
the graph's times, kept bytes and parameter gradients exactly, and its ``M_peak`` is the
simulator's unoptimised peak (it is read from :func:`autoremat.cost.step_levels`): on the zoo
(both groupings) and on seeded random graphs.
"""

from __future__ import annotations

import random

import pytest
from _graphs import random_dag, random_profiled, with_held_outputs

import autoremat
from autoremat.cost import unoptimised_peak_bytes
from autoremat.graph import Graph
from autoremat.cost.chain import Chain, chain_from_graph, layer_cuts, split_points
from autoremat.cost.chain_schedule import validate_schedule
from autoremat.solvers.beaumont.chain_solvers import lower_bound, offload_dp, offload_greedy, vdnn

TOL = 1e-9


def test_chain_validation():
    ok = dict(fwd_time_s=(1.0,), bwd_time_s=(1.0,), x_bytes=(0, 1), y_bytes=(0, 0),
              fwd_extra_bytes=(0,), bwd_extra_bytes=(0,))
    Chain(**ok)
    with pytest.raises(ValueError, match="x_bytes"):
        Chain(**{**ok, "x_bytes": (1,)})
    with pytest.raises(ValueError, match=">= 0"):
        Chain(**{**ok, "y_bytes": (0, -1)})
    with pytest.raises(ValueError, match="bandwidth"):
        Chain(**ok, bandwidth_bytes_per_s=0)
    with pytest.raises(ValueError, match="at least one"):
        Chain(**{**ok, "fwd_time_s": ()})
    c = Chain(**ok)
    assert Chain.from_dict(c.to_dict()) == c


# ---------------------------------------------------------------------- from a real graph
def _kept_bytes(g) -> int:
    roots = set()
    for v in g.nodes:
        d = g.node(v)
        if d["requires_grad"]:
            roots.update(g.root(u) for u in d["saves"])
    roots.update(g.root(u) for u in g.meta["loss_saves"])
    extras = sum(g.node(v)["extra_saved_bytes"] for v in g.nodes if g.node(v)["requires_grad"])
    return sum(g.node(r)["alloc_bytes"] for r in roots) + extras + g.meta["loss_extra_bytes"]


@pytest.mark.parametrize("name", ["resnet50", "densenet121", "inception_v3"])
def test_chain_from_zoo_graph(name):
    model, args = autoremat.zoo.build(name, size="small", device="meta")
    g = autoremat.capture(model, args)
    sim_peak = unoptimised_peak_bytes(g)
    used_params = {p for v in g.nodes for p in g.node(v)["params"] if p in g.meta["param_bytes"]}
    for grouping in ("fine", "split-points"):
        c = chain_from_graph(g, grouping=grouping)
        # the layers partition the execution order
        assert c.layer_nodes[0][0] == 0 and c.layer_nodes[-1][1] == len(g) - 1
        assert all(b[0] == a[1] + 1 for a, b in zip(c.layer_nodes, c.layer_nodes[1:]))
        # preserved exactly
        assert sum(c.fwd_time_s) == pytest.approx(g.total("time_s"), rel=1e-12)
        assert sum(c.bwd_time_s) == pytest.approx(g.total("bwd_time_s"), rel=1e-12)
        assert sum(c.x_bytes) == _kept_bytes(g)
        assert c.x_bytes[0] == 0
        assert c.y_bytes[-1] == 0
        assert c.bwd_extra_bytes[0] + c.y_bytes[0] >= sum(g.meta["param_bytes"][p] for p in used_params)
        assert c.meta["replayed_peak_bytes"] == sim_peak  # the replay is simulate()'s model
        assert c.peak_bytes == sim_peak
        assert c.min_memory_bytes < c.peak_bytes
        for limit in (c.min_memory_bytes, (c.min_memory_bytes + c.peak_bytes) // 2):
            for s in (offload_greedy(c, limit), offload_dp(c, limit, slots=200), vdnn(c, limit)):
                assert validate_schedule(c, s) <= limit
                assert s.makespan_s >= lower_bound(c, limit) * (1 - TOL)
    fine, coarse = chain_from_graph(g), chain_from_graph(g, grouping="split-points")
    assert fine.n_ops >= coarse.n_ops




@pytest.mark.parametrize("seed", range(20))
def test_chain_peak_is_the_simulated_peak_on_random_graphs(seed):
    """``M_peak`` (the chain's ``max(m_F, m_B)``) is the simulator's unoptimised peak wherever no
    clamp acts, never below it; the layers partition the nodes and cut only where the chain's
    dependencies hold."""
    rng = random.Random(seed)
    g = random_profiled(rng, rng.randint(1, 25)) if seed % 2 else random_dag(seed, 2 + seed % 10)
    with_held_outputs(g, seed)
    sim_peak = unoptimised_peak_bytes(g)
    for grouping in ("fine", "split-points"):
        c = chain_from_graph(g, grouping=grouping)
        assert c.meta["replayed_peak_bytes"] == sim_peak
        assert c.peak_bytes >= sim_peak
        assert [last for _, last in c.layer_nodes] == layer_cuts(g, grouping)
        assert sum(c.fwd_time_s) == pytest.approx(g.total("time_s"))
    assert split_points(g)[-1] == len(g) - 1


def test_no_cut_falls_after_a_node_the_returned_object_holds():
    """A node held by the returned object (``held_by_output``) waits for the loss as an output
    does: no split point or layer cut until the end, and the chain's peak is the simulator's."""
    g = Graph.chain([8, 4, 2, 1], saves_own_output=False)
    assert split_points(g) == [0, 1, 2, 3]
    g.node(1)["held_by_output"] = True
    assert split_points(g) == [0, 1, 3]
    assert layer_cuts(g, "split-points") == [0, 1, 3]
    assert chain_from_graph(g).peak_bytes == unoptimised_peak_bytes(g)


def test_what_the_output_object_holds_to_the_end_is_no_offloadable_activation():
    """Kept to the end of backward (``output_kept="step"``), a saved storage the returned object
    holds is not in ``x`` (offloading it would free nothing); the chain's peak is still the
    simulator's."""
    g = Graph.chain([8, 4, 2, 1])
    g.node(1)["held_by_output"] = True
    loss = chain_from_graph(g)
    g.meta["output_kept"] = "step"
    step = chain_from_graph(g)
    assert sum(loss.x_bytes) - sum(step.x_bytes) == 4 + 1  # node 1, and the output (node 3)
    assert step.meta["replayed_peak_bytes"] == unoptimised_peak_bytes(g) > loss.meta["replayed_peak_bytes"]
