"""``autoremat.cost.schedule``: the joint forward+backward graph and its schedule model.

Every schedule goes through :func:`simulate_schedule`, the validity checker (each compute has its
inputs resident and is not resident itself, every free names a resident value, every node is
computed, the final node stays), and an independent replay (``tests/_schedules.py``). The model
is the papers' (see its module docstring, "Limitations"); its relation to
:func:`autoremat.cost.simulate`, stated there, is checked here: NoRemat's peak against the
simulator's unoptimised peak on seeded random graphs.
"""

from __future__ import annotations

import random

import networkx as nx
import pytest
from _graphs import plain_dag, random_chain_dag, random_profiled_graphs, with_held_outputs
from _schedules import all_schedules, check_schedule, figure1

from autoremat.cost import unoptimised_peak_bytes
from autoremat.cost.schedule import COMPUTE, FREE, JointGraph, Op, no_remat, simulate_schedule, with_liveness_frees
from autoremat.graph import Graph
from autoremat.solvers.evaluation.twremat import twremat_schedule
from autoremat.solvers.xla_greedy import xla_greedy_schedule

SIZE = 100


# ---------------------------------------------------------------------- joint graph and simulator
def test_joint_graph_of_a_chain():
    g = Graph.chain([SIZE] * 3, [1.0, 2.0, 3.0])
    j = JointGraph.from_graph(g)
    assert [j.name(v) for v in range(len(j))] == [
        "fwd 0", "fwd 1", "fwd 2", "loss", "bwd 2", "bwd 1", "bwd 0", "final"]
    assert j.pred == [[], [0], [1], [2], [2, 3], [1, 4], [0, 5], [6]]
    assert j.size_bytes == [SIZE, SIZE, SIZE, SIZE, SIZE, SIZE, 0, 0]
    assert j.time_s == [1.0, 2.0, 3.0, 0.0, 6.0, 4.0, 2.0, 0.0]
    assert j.final == 7 and j.fwd == {0: 0, 1: 1, 2: 2} and j.bwd == {2: 4, 1: 5, 0: 6}


def test_joint_graph_views_and_extras():
    g = nx.DiGraph()
    g.add_node(0, out_bytes=8, alloc_bytes=8, saves=())
    g.add_node(1, out_bytes=8, alloc_bytes=0, alias_of=0, saves=())  # a view of 0
    g.add_node(2, out_bytes=8, alloc_bytes=8, saves=(1,), extra_saved_bytes=3, is_output=True)
    g.add_edges_from([(0, 1), (1, 2)])
    j = JointGraph.from_graph(Graph(g, {"loss_saves": []}))
    names = [j.name(v) for v in range(len(j))]
    assert names == ["fwd 0", "fwd 1", "fwd 2", "extra 2", "loss", "bwd 2", "bwd 1", "bwd 0", "final"]
    assert j.pred[2] == [0, 1]  # a consumer of the view also holds its storage
    assert j.pred[3] == [2] and j.size_bytes[3] == 3 and j.time_s[3] == 0.0
    assert j.pred[5] == [0, 3, 4]  # bwd 2: loss seed, the saved view's storage, its extras


def test_figure1_memory_of_the_paper():
    j = figure1()
    assert simulate_schedule(j, no_remat(j)).peak_bytes == 4
    remat = with_liveness_frees(j, [0, 1, 2, 3, 0, 4])
    stats = simulate_schedule(j, remat)
    assert stats.peak_bytes == 3 and stats.n_computes == 6 and stats.time_s == 6.0
    assert stats.max_recomputations == 2 and stats.recomputed_nodes == 1
    assert remat.ops[:3] == [Op(COMPUTE, 0), Op(COMPUTE, 1), Op(FREE, 0)]


@pytest.mark.parametrize("ops, message", [
    ([Op(COMPUTE, 1)], "not resident"),
    ([Op(COMPUTE, 0), Op(COMPUTE, 0)], "already resident"),
    ([Op(FREE, 0)], "not resident"),
    ([Op(COMPUTE, 0), Op(COMPUTE, 1), Op(COMPUTE, 2), Op(COMPUTE, 3), Op(COMPUTE, 4), Op(FREE, 4)],
     "final node"),
    ([Op(COMPUTE, 9)], "outside"),
    ([Op("load", 0)], "action"),
])
def test_simulator_rejects_invalid_schedules(ops, message):
    with pytest.raises(ValueError, match=message):
        simulate_schedule(figure1(), ops)


def test_simulator_requires_every_node():
    # node 1 is no ancestor of the final node 2 (built directly; from_dag refuses two sinks)
    j = JointGraph([[], [], [0]], [1, 1, 1], [1.0] * 3, [0] * 3, ["node"] * 3, [0, 1, 2], final=2)
    ops = [Op(COMPUTE, 0), Op(COMPUTE, 2), Op(FREE, 0)]
    with pytest.raises(ValueError, match="never computed"):
        simulate_schedule(j, ops)
    assert simulate_schedule(j, ops, require_all=False).peak_bytes == 2
    with pytest.raises(ValueError, match="exactly one sink"):
        JointGraph.from_dag(nx.DiGraph([(0, 2), (1, 3)]))
    with pytest.raises(ValueError, match="never computed before"):
        with_liveness_frees(figure1(), [0, 2])


def test_noremat_chain_golden():
    # forward keeps every output for its backward; peak at the last node's backward: n outputs,
    # the loss seed and that backward's input gradient (the first node's backward makes none)
    for n in (1, 2, 4, 16):
        j = JointGraph.from_graph(Graph.chain([SIZE] * n))
        stats = check_schedule(j, no_remat(j))
        assert stats.peak_bytes == (n + 2 - (n == 1)) * SIZE and stats.n_computes == len(j) == 2 * n + 2


def test_empty_and_zero_size_graphs():
    for g in (Graph(), Graph.chain([0] * 5)):
        j = JointGraph.from_graph(g)
        for s in (no_remat(j), twremat_schedule(j), twremat_schedule(j, annotated=True), xla_greedy_schedule(j)):
            assert check_schedule(j, s).peak_bytes == 0


@pytest.mark.parametrize("case", ["chain", "random", "paper-dag"])
def test_schedules_are_valid(case):
    if case == "chain":
        joints = [JointGraph.from_graph(Graph.chain([SIZE] * n, [1.0 + i for i in range(n)])) for n in (1, 2, 7, 33)]
    elif case == "random":
        joints = [JointGraph.from_graph(g) for g in random_profiled_graphs(25)]
    else:
        joints = [figure1()]
    for j in joints:
        nr = check_schedule(j, no_remat(j))
        for name, s in all_schedules(j).items():
            stats = check_schedule(j, s)
            assert stats.n_computes >= nr.n_computes, name
        tight = simulate_schedule(j, twremat_schedule(j)).peak_bytes
        assert tight <= simulate_schedule(j, twremat_schedule(j, annotated=True)).peak_bytes



# ---------------------------------------------------------------------- against the simulator
@pytest.mark.parametrize("seed", range(30))
def test_noremat_is_never_below_the_simulated_peak_on_plain_graphs(seed):
    """The bound the module docstring states: where every node saves its own output and there are
    no parameters, extras, workspace or views, NoRemat's peak in the joint-graph model is at
    least :func:`autoremat.cost.simulate`'s unoptimised peak (the model counts every gradient as a
    new tensor of its ``bwd`` node, and an accumulation as one more input); on 900 such graphs
    it was equal on 585, above on the rest."""
    rng = random.Random(seed)
    for g in (plain_dag(rng, rng.randint(2, 15)), random_chain_dag(rng), with_held_outputs(plain_dag(rng, 9), seed),
              Graph.chain([rng.randint(0, 50) for _ in range(rng.randint(1, 10))])):
        j = JointGraph.from_graph(g)
        assert simulate_schedule(j, no_remat(j)).peak_bytes >= unoptimised_peak_bytes(g)
    assert simulate_schedule(JointGraph.from_graph(Graph.chain([SIZE] * 5)), no_remat(
        JointGraph.from_graph(Graph.chain([SIZE] * 5)))).peak_bytes == unoptimised_peak_bytes(Graph.chain([SIZE] * 5))


def test_the_loss_reads_what_the_returned_object_holds():
    """A node held by the returned object until the loss (``held_by_output``) is an input of the
    joint graph's loss node, as an output is, without a gradient seed: NoRemat's peak stays at or
    above the simulator's."""
    g = Graph.chain([40, 10, 10, 10], saves_own_output=False)
    before = JointGraph.from_graph(g)
    g.node(0)["held_by_output"] = True
    j = JointGraph.from_graph(g)
    loss = next(i for i, k in enumerate(j.kind) if k == "loss")
    assert j.fwd[0] in j.pred[loss] and j.fwd[0] not in before.pred[loss]
    assert j.size_bytes[loss] == before.size_bytes[loss]  # the seed: the output's gradient only
    assert simulate_schedule(j, no_remat(j)).peak_bytes >= unoptimised_peak_bytes(g) > unoptimised_peak_bytes(
        Graph.chain([40, 10, 10, 10], saves_own_output=False))


def test_the_loss_node_is_the_seed_the_loss_hands_the_output():
    """An output the loss hands an expanded scalar (``grad_seed_bytes``, ``out.sum()``): the loss
    node's tensor is that seed, and on a chain NoRemat's peak stays equal to the simulator's."""
    g = Graph.chain([SIZE] * 5)
    g.node(4)["grad_seed_bytes"] = 4
    j = JointGraph.from_graph(g)
    loss = next(i for i, k in enumerate(j.kind) if k == "loss")
    assert j.size_bytes[loss] == 4
    assert simulate_schedule(j, no_remat(j)).peak_bytes == unoptimised_peak_bytes(g) < unoptimised_peak_bytes(
        Graph.chain([SIZE] * 5))


def test_the_loss_tensor_is_held_to_final():
    """The loss tensor's own storage (``loss_held_bytes``, held by the loop to the step's end) is a
    joint node of its own after the loss, an input of ``final``: on a chain NoRemat's peak stays
    equal to the simulator's, both above the chain's without it."""
    g = Graph.chain([SIZE] * 5)
    g.meta["loss_held_bytes"] = 7
    j = JointGraph.from_graph(g)
    held = j.kind.index("loss tensor")
    assert j.pred[held] == [j.kind.index("loss")] and held in j.pred[j.final] and j.size_bytes[held] == 7
    assert simulate_schedule(j, no_remat(j)).peak_bytes == unoptimised_peak_bytes(g) == unoptimised_peak_bytes(
        Graph.chain([SIZE] * 5)) + 7
