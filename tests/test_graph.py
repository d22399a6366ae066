"""Tests for autoremat.graph: invariants, order theory, lower sets, JSON, transforms."""

from __future__ import annotations

import itertools
import json
import random

import networkx as nx
import pytest
from _graphs import diamond, random_edges, skip_connection

from autoremat.graph import GRAPH_FORMAT_VERSION, NODE_DEFAULTS, Graph


def _nx(n: int, edges=(), **per_node) -> nx.DiGraph:
    g = nx.DiGraph()
    for v in range(n):
        g.add_node(v, **{k: vals[v] for k, vals in per_node.items()})
    g.add_edges_from(edges)
    return g


def brute_force_lower_sets(g: Graph) -> set[frozenset[int]]:
    edges = list(g.nx.edges)
    out = set()
    for r in range(len(g) + 1):
        for combo in itertools.combinations(range(len(g)), r):
            s = set(combo)
            if all(u in s for (u, v) in edges if v in s):
                out.add(frozenset(s))
    return out


# ---------------------------------------------------------------------- invariants
class TestInvariants:
    def test_backward_edge_rejected(self):
        with pytest.raises(ValueError, match="topological"):
            Graph(_nx(3, [(0, 1), (2, 1)]))

    def test_self_loop_rejected(self):
        with pytest.raises(ValueError, match="topological"):
            Graph(_nx(2, [(1, 1)]))

    def test_node_ids_must_be_0_to_n_minus_1(self):
        g = nx.DiGraph()
        g.add_nodes_from([0, 2])
        with pytest.raises(ValueError, match="0..n-1"):
            Graph(g)
        g2 = nx.DiGraph()
        g2.add_nodes_from(["a", "b"])
        with pytest.raises(ValueError):
            Graph(g2)

    def test_saves_of_later_node_rejected(self):
        with pytest.raises(ValueError, match="node 0 saves node 1"):
            Graph(_nx(2, [(0, 1)], saves=[(1,), ()]))

    def test_saves_of_self_and_earlier_accepted_and_deduplicated(self):
        g = Graph(_nx(3, [(0, 1), (1, 2)], saves=[(0,), (1, 0, 0), (2, 0)]))
        assert g.node(1)["saves"] == (0, 1)
        assert g.node(2)["saves"] == (0, 2)

    def test_alias_of_later_node_rejected(self):
        with pytest.raises(ValueError, match="view of node 2"):
            Graph(_nx(3, [(0, 1), (1, 2)], alias_of=[None, 2, None]))

    def test_alias_of_self_rejected(self):
        with pytest.raises(ValueError, match="view of node 1"):
            Graph(_nx(2, [(0, 1)], alias_of=[None, 1]))

    def test_defaults_filled_in(self):
        g = Graph(_nx(2, [(0, 1)]))
        for v in g:
            for key, default in NODE_DEFAULTS.items():
                assert key in g.node(v)
            assert g.node(v)["saved_bytes"] == 0
        assert g.meta["mode"] == "synthetic"
        assert g.meta["loss_saves"] == []
        assert g.meta["resident_bytes"] == 0

    def test_saved_bytes_deduplicated_by_storage(self):
        # node 1 is a view of node 0; node 2 saves both -> one storage of 100 bytes, plus extras
        g = Graph(_nx(3, [(0, 1), (1, 2)], alloc_bytes=[100, 0, 7], alias_of=[None, 0, None],
                      saves=[(), (), (0, 1, 2)], extra_saved_bytes=[0, 0, 5]))
        assert g.root(1) == 0 and g.root(0) == 0 and g.root(2) == 2
        assert g.node(2)["saved_bytes"] == 100 + 7 + 5

    def test_alias_chain_roots(self):
        g = Graph(_nx(4, [(0, 1), (1, 2), (2, 3)], alias_of=[None, 0, 1, None]))
        assert [g.root(v) for v in g] == [0, 0, 0, 3]

    def test_chain_and_from_edges_shapes(self):
        g = Graph.chain([1, 2, 3], [0.5, 1.0, 2.0])
        assert len(g) == 3 and sorted(g.nx.edges) == [(0, 1), (1, 2)]
        assert [g.node(v)["out_bytes"] for v in g] == [1, 2, 3]
        assert [g.node(v)["bwd_time_s"] for v in g] == [1.0, 2.0, 4.0]
        assert [g.node(v)["is_output"] for v in g] == [False, False, True]
        assert g.meta["loss_saves"] == [2]
        d = diamond()
        assert [d.node(v)["is_output"] for v in d] == [False, False, False, True]
        assert d.meta["loss_saves"] == [3]
        with pytest.raises(ValueError, match="same length"):
            Graph.chain([1, 2], [1.0])

    def test_totals(self):
        g = Graph.chain([10, 20, 30], [1.0, 2.0, 3.0])
        assert g.total("out_bytes") == 60
        assert g.total("time_s", [0, 2]) == 4.0
        g.meta["param_bytes"] = {"a": 5, "b": 6}
        assert g.param_grad_bytes == 11

    def test_empty_graph(self):
        g = Graph()
        assert len(g) == 0
        assert list(g.lower_sets()) == [frozenset()]
        assert Graph.chain([]).meta["loss_saves"] == []
        assert Graph.chain([]).meta["loss_held_bytes"] == 0  # also for a graph saved before the key


# ---------------------------------------------------------------------- order theory
class TestOrderTheory:
    def test_diamond(self):
        g = diamond()
        assert g.succ(0) == [1, 2] and g.pred(3) == [1, 2]
        assert g.delta_plus({0}) == {1, 2}
        assert g.delta_plus({1, 2}) == {3}
        assert g.delta_minus({3}) == {1, 2}
        assert g.delta_minus({1, 2}) == {0}
        assert g.delta_minus({0}) == set()
        assert g.boundary({0, 1}) == {0, 1}
        assert g.boundary({0, 1, 2}) == {1, 2}
        assert g.boundary({0}) == {0}
        assert g.boundary(set(range(4))) == set()
        assert g.ancestor_closure(3) == frozenset({0, 1, 2, 3})
        assert g.ancestor_closure(2) == frozenset({0, 2})
        assert g.ancestor_closure(0) == frozenset({0})
        assert g.is_lower_set({0, 2}) and not g.is_lower_set({1}) and not g.is_lower_set({0, 3})
        assert set(g.lower_sets()) == {frozenset(s) for s in
                                       [(), (0,), (0, 1), (0, 2), (0, 1, 2), (0, 1, 2, 3)]}

    def test_chain(self):
        g = Graph.chain([1] * 5)
        assert set(g.lower_sets()) == {frozenset(range(k)) for k in range(6)}
        for k in range(1, 5):
            assert g.boundary(range(k)) == {k - 1}
        assert g.delta_plus({2}) == {3} and g.delta_minus({2}) == {1}
        assert g.ancestor_closure(3) == frozenset({0, 1, 2, 3})
        assert not g.is_lower_set({1, 2})

    def test_skip_connection(self):
        g = skip_connection()
        assert g.delta_plus({0}) == {1, 3}
        assert g.delta_minus({3}) == {0, 2}
        assert g.boundary({0, 1}) == {0, 1}      # 0 -> 3 and 1 -> 2 leave
        assert g.boundary({0, 1, 2}) == {0, 2}
        assert g.boundary({0}) == {0}
        assert g.ancestor_closure(3) == frozenset({0, 1, 2, 3})
        assert g.ancestor_closure(1) == frozenset({0, 1})
        assert len(list(g.lower_sets())) == 5

    def test_lower_sets_ordered_by_size_and_unique(self):
        g = diamond()
        sets = list(g.lower_sets())
        assert len(sets) == len(set(sets))
        assert [len(s) for s in sets] == sorted(len(s) for s in sets)
        assert sets[0] == frozenset() and sets[-1] == frozenset(range(4))

    def test_antichain_has_all_subsets(self):
        g = Graph.from_edges(4, [])
        assert len(list(g.lower_sets())) == 16

    @pytest.mark.parametrize("seed", range(12))
    def test_lower_sets_match_brute_force(self, seed):
        rng = random.Random(seed)
        g = random_edges(rng.randint(1, 8), rng.choice([0.15, 0.3, 0.5]), rng)
        expected = brute_force_lower_sets(g)
        got = list(g.lower_sets())
        assert len(got) == len(expected)
        assert set(got) == expected
        assert all(g.is_lower_set(s) for s in got)

    def test_lower_sets_limit(self):
        g = diamond()
        assert len(list(g.lower_sets(limit=6))) == 6
        with pytest.raises(ValueError, match="more than 5 lower sets"):
            list(g.lower_sets(limit=5))
        antichain = Graph.from_edges(10, [])
        with pytest.raises(ValueError):
            for _ in antichain.lower_sets(limit=100):
                pass


# ---------------------------------------------------------------------- JSON
def _rich_graph() -> Graph:
    g = _nx(
        4, [(0, 1), (0, 2), (1, 3), (2, 3)],
        name=["conv", "relu", "view", "add"], kind=["conv", "relu", "view", "add"],
        target=["Conv2d", "ReLU", "aten.view", "aten.add"],
        module_path=["layer.conv", "layer.relu", "", ""],
        time_s=[0.5, 0.25, 0.0, 0.125], bwd_time_s=[1.0, 0.5, 0.0, 0.25],
        out_bytes=[400, 400, 400, 400], alloc_bytes=[400, 400, 0, 400],
        alias_of=[None, None, 0, None], saves=[(), (1,), (), ()],
        extra_saved_bytes=[3, 0, 0, 0], fwd_temp_bytes=[11, 0, 0, 0], bwd_temp_bytes=[13, 0, 0, 0],
        params=[("conv.weight", "conv.bias"), (), (), ()], param_grad_bytes=[120, 0, 0, 0],
        requires_grad=[True, True, True, True], grad_passthrough=[False, False, True, True],
        is_output=[False, False, False, True], recomputable=[True, True, False, True],
    )
    return Graph(g, {"mode": "fx", "model": "Toy", "param_bytes": {"conv.weight": 100, "conv.bias": 20},
                     "loss_saves": [3], "loss_extra_bytes": 4, "resident_bytes": 999,
                     "measured_peak_bytes": 12345})


class TestJson:
    def test_dict_round_trip_preserves_everything(self):
        g = _rich_graph()
        fp = g.fingerprint
        g2 = Graph.from_dict(g.to_dict())
        assert g2.to_dict() == g.to_dict()
        assert g2.fingerprint == fp
        assert sorted(g2.nx.edges) == sorted(g.nx.edges)
        for v in g:
            assert g2.node(v) == g.node(v)
        assert g2.meta == g.meta

    def test_json_round_trip_text_and_file(self, tmp_path):
        g = _rich_graph()
        text = g.to_json()
        data = json.loads(text)
        assert data["format"] == "autoremat.graph" and data["version"] == GRAPH_FORMAT_VERSION
        g2 = Graph.from_json(text)
        assert g2.to_dict() == g.to_dict()
        assert g2.node(0)["saves"] == () and g2.node(1)["saves"] == (1,)
        assert g2.node(0)["params"] == ("conv.weight", "conv.bias")
        assert g2.node(2)["alias_of"] == 0 and g2.root(2) == 0
        assert g2.node(1)["saved_bytes"] == 400 and g2.node(0)["saved_bytes"] == 3
        path = tmp_path / "g.json"
        g.to_json(str(path))
        g3 = Graph.from_json(str(path))
        assert g3.to_dict() == g.to_dict() and g3.fingerprint == g.fingerprint

    def test_fingerprint_survives_round_trip_when_not_yet_computed(self):
        g = Graph.chain([1, 2, 3])
        d = g.to_dict()
        assert "fingerprint" not in d["meta"]
        assert Graph.from_dict(d).fingerprint == g.fingerprint

    def test_fingerprint_is_structural(self):
        a = Graph.chain([1, 2, 3])
        assert a.fingerprint == Graph.chain([7, 8, 9]).fingerprint
        assert a.fingerprint != Graph.chain([1, 2, 3, 4]).fingerprint
        assert diamond().fingerprint != skip_connection().fingerprint
        assert len(a.fingerprint) == 16

    def test_bad_format_rejected(self):
        d = Graph.chain([1]).to_dict()
        d["format"] = "something.else"
        with pytest.raises(ValueError, match="not an autoremat graph"):
            Graph.from_dict(d)
        with pytest.raises(ValueError, match="not an autoremat graph"):
            Graph.from_json('{"nodes": [], "edges": []}')

    def test_bad_version_rejected(self):
        d = Graph.chain([1]).to_dict()
        d["version"] = GRAPH_FORMAT_VERSION + 1
        with pytest.raises(ValueError, match="version"):
            Graph.from_dict(d)

    def test_copy_is_independent(self):
        g = Graph.chain([1, 2, 3])
        c = g.copy()
        c.node(0)["time_s"] = 99.0
        c.meta["model"] = "other"
        assert g.node(0)["time_s"] == 1.0 and "model" not in g.meta


# ---------------------------------------------------------------------- transforms
def test_with_paper_times():
    g = _rich_graph()
    p = g.with_paper_times()
    assert [p.node(v)["time_s"] for v in p] == [10.0, 1.0, 1.0, 1.0]
    assert [p.node(v)["bwd_time_s"] for v in p] == [20.0, 2.0, 2.0, 2.0]
    assert "paper" in p.meta["time_source"]
    # the original is untouched and the structure is kept
    assert [g.node(v)["time_s"] for v in g] == [0.5, 0.25, 0.0, 0.125]
    assert "time_source" not in g.meta
    assert p.fingerprint == g.fingerprint
    assert [p.node(v)["out_bytes"] for v in p] == [400] * 4


def test_scaled_multiplies_batch_quantities_only() -> None:
    g = Graph.chain([100, 201], [1.0, 2.0])
    g.node(0)["params"] = ("w",)
    g.node(0)["param_grad_bytes"] = 64
    g.meta["loss_extra_bytes"] = 3
    g.meta["loss_held_bytes"] = 5  # an input-sized loss storage (CPU mse_loss) grows with the batch
    s = g.scaled(2.5)
    assert [s.node(v)["out_bytes"] for v in s.nodes] == [250, 503]  # rounded up
    assert [s.node(v)["saved_bytes"] for v in s.nodes] == [250, 503]  # derived totals refreshed
    assert [s.node(v)["time_s"] for v in s.nodes] == [2.5, 5.0]
    assert s.node(0)["param_grad_bytes"] == 64 and s.meta["loss_extra_bytes"] == 8 and s.meta["loss_held_bytes"] == 13
    assert g.node(0)["out_bytes"] == 100  # the original is untouched
    with pytest.raises(ValueError, match="factor"):
        g.scaled(0)


def test_ops_blocks_reads_the_capture_mode_and_survives_json() -> None:
    """``Graph.ops_blocks``: the one reading of ``meta["blocks"]`` the solvers share (was six copies)."""
    g = Graph.chain([10, 20, 30])
    assert not g.ops_blocks
    g.meta["blocks"] = "module"
    assert not g.ops_blocks
    g.meta["blocks"] = "ops"
    assert g.ops_blocks and Graph.from_json(g.to_json()).ops_blocks
