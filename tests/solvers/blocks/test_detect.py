"""``autoremat.solvers.blocks.detect``: blocks are the runs of container members, identical ones
share a class, a path in two runs is no block."""

from __future__ import annotations

import random

import networkx as nx

from _graphs import block_chain
from autoremat.graph import Graph
from autoremat.solvers.blocks.detect import block_path, find_blocks


def test_blocks_and_classes_of_a_chain():
    g = block_chain(random.Random(0), 5, width=6, classes=2)
    b = find_blocks(g)
    assert b.paths == tuple(f"layers.{j}" for j in range(5))
    assert all(nodes == tuple(range(nodes[0], nodes[0] + 6)) for nodes in b.nodes)
    # block 0 reads the prefix twice over (its input is the prefix): a class of its own;
    # the others alternate between the two templates
    assert b.classes[2] == b.classes[4] != b.classes[3] and b.classes[1] == 1
    assert b.repeated == sum(1 for j, c in enumerate(b.classes) if c != j)


def test_block_path_is_the_outermost_member():
    assert block_path(("blocks", "blocks.3", "blocks.3.attn")) == "blocks.3"
    assert block_path(("encoder.block.0", "encoder.block.0.layer.1")) == "encoder.block.0"
    assert block_path(("embed",)) is None


def test_a_path_in_two_runs_is_no_block():
    g = nx.DiGraph()
    scopes = [("a.0",), ("b",), ("a.0",), ("c.1",), ("c.1",)]
    for v, scope in enumerate(scopes):
        g.add_node(v, name=f"n{v}", out_bytes=1, alloc_bytes=1, saves=(v,), scope=scope)
        if v:
            g.add_edge(v - 1, v)
    b = find_blocks(Graph(g, {"loss_saves": [4]}))
    assert b.paths == ("c.1",) and b.nodes == ((3, 4),)


def test_the_calls_of_a_shared_block_are_blocks_of_one_class():
    """A block run four times per step (weights shared) is four blocks, one per call
    (``"<path>@<k>/<n>"``, :mod:`autoremat.call_names`); the inner calls' names carry the call
    index, which is no part of the class. They were no block at all (no path ending in an integer),
    so ``blocks`` planned nothing inside ALBERT's layer."""
    import autoremat
    from _looped import looped_batch as _batch, looped_loss as _loss, looped_model as _model

    assert block_path(("layers.0@2/4", "layers.0.up@2/4")) == "layers.0@2/4"
    model, x = _model("block"), _batch()
    graph = autoremat.capture(model, (x,), loss_fn=_loss, repeats=1, warmup=0, times="flops")
    b = find_blocks(graph)
    assert b.paths == tuple(f"layers.0@{k}/4" for k in range(4))
    assert len(set(b.classes[1:3])) == 1  # the middle calls match (the first reads the input layer)
    plan = autoremat.solve(graph, "70%", solver="blocks")
    assert any(call[0].startswith("layers.0@") for call in plan.module_calls.values())


def test_blocks_whose_first_gradients_differ_are_not_one_class():
    """A node whose first gradient is a view is summed with the next out of place (``first_grad_view``):
    blocks that differ in it cost differently and share no class."""
    g = block_chain(random.Random(0), 5, width=6, classes=1)
    before = find_blocks(g).classes
    assert before[2] == before[3]
    nxg = g.nx.copy()
    nxg.nodes[find_blocks(g).nodes[3][1]]["first_grad_view"] = True
    after = find_blocks(Graph(nxg, g.meta)).classes
    assert after[3] != after[2] == after[4]
