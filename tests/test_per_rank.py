"""The per-rank graph (:mod:`autoremat.per_rank`): FSDP's in-flight bytes as node workspace of a
copy of the graph, simulated by the one simulator. Measured against FSDP itself in
``tests/integrations/test_fsdp.py``."""

from __future__ import annotations

import random

import pytest

import autoremat
from autoremat.per_rank import ShardingSpec, per_rank_graph, shard_bytes
from autoremat.plan import Plan, Segment
from autoremat.cost import no_recompute_plan, simulate


def _chain(n: int = 8, param: int = 400) -> autoremat.Graph:
    g = autoremat.Graph.chain([100 + 10 * i for i in range(n)])
    for v in g.nodes:
        g.node(v)["params"] = (f"w{v}",)
    g.meta["param_bytes"] = {f"w{v}": param for v in g.nodes}
    return g


def _random_plan(g: autoremat.Graph, rng: random.Random) -> Plan:
    cuts = sorted(rng.sample(range(1, len(g)), rng.randint(0, len(g) - 1)))
    bounds = [0, *cuts, len(g)]
    segs = [Segment(tuple(range(a, b)), rng.random() < 0.5) for a, b in zip(bounds, bounds[1:])]
    return Plan(segs, graph_fingerprint=g.fingerprint)


def test_nothing_sharded_is_the_graph_itself() -> None:
    """One rank, no units, the model's own parameters not sharded: the same simulation."""
    rng = random.Random(0)
    g = _chain()
    spec = ShardingSpec(world_size=1, units=(), unit_bytes={"": 0}, node_units=((),) * len(g), root_sharded=False)
    for _ in range(20):
        plan = _random_plan(g, rng)
        assert simulate(per_rank_graph(g, spec, plan), plan).peak_bytes == simulate(g, plan).peak_bytes


def _two_units(g: autoremat.Graph, world: int = 2) -> ShardingSpec:
    half = len(g) // 2
    return ShardingSpec(world_size=world, units=("a", "b"), unit_bytes={"a": 800, "b": 1600, "": 0},
                        node_units=tuple(("a",) if v < half else ("b",) for v in g.nodes), root_sharded=False)


def test_units_add_their_unsharded_parameters_and_gradients() -> None:
    g = _chain()
    spec = _two_units(g)
    ranked = per_rank_graph(g, spec)
    a, b = 0, len(g) - 1
    # forward of a node in unit b: b's parameters and, with 2 ranks, its all-gather output
    assert ranked.node(b)["fwd_temp_bytes"] == g.node(b)["fwd_temp_bytes"] + 2 * 1600
    # backward of a node in unit a: a's parameters, b's reduce-scatter input, a's full gradients so far
    assert ranked.node(a)["bwd_temp_bytes"] == g.node(a)["bwd_temp_bytes"] + 800 + 1600 + 400 * (len(g) // 2)
    # gradients: the units' shards, first used right after each unit's backward (b's: by a's last node)
    assert ranked.meta["param_bytes"] == {"fsdp-shard-grad:b": shard_bytes(1600, 2)}
    assert "fsdp-shard-grad:b" in ranked.node(len(g) // 2 - 1)["params"]
    assert simulate(ranked, no_recompute_plan(g)).peak_bytes > simulate(g, no_recompute_plan(g)).peak_bytes - 400 * len(g)


def test_recomputed_nodes_carry_the_backward_in_flight_bytes() -> None:
    g = _chain()
    spec = _two_units(g)
    plan = Plan([Segment(tuple(range(4)), True), Segment(tuple(range(4, 8)), False)], graph_fingerprint=g.fingerprint)
    plain, planned = per_rank_graph(g, spec), per_rank_graph(g, spec, plan)
    for v in range(4):
        assert planned.node(v)["fwd_temp_bytes"] == max(plain.node(v)["fwd_temp_bytes"],
                                                         plain.node(v)["bwd_temp_bytes"] - g.node(v)["bwd_temp_bytes"]
                                                         + g.node(v)["fwd_temp_bytes"])
    for v in range(4, 8):
        assert planned.node(v)["fwd_temp_bytes"] == plain.node(v)["fwd_temp_bytes"]


def test_spec_round_trips_and_must_match_the_graph() -> None:
    g = _chain()
    spec = _two_units(g, world=4)
    assert ShardingSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(ValueError, match="node_units has 3 entries for a graph of 8 nodes"):
        per_rank_graph(g, ShardingSpec(world_size=2, units=(), unit_bytes={}, node_units=((),) * 3))


def test_more_ranks_never_predict_more() -> None:
    g = _chain()
    peaks = [simulate(per_rank_graph(g, _two_units(g, w)), no_recompute_plan(g)).peak_bytes for w in (2, 4, 8)]
    assert peaks == sorted(peaks, reverse=True)
