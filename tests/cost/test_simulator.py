"""``autoremat.cost.simulator``: hand-computed peaks, recomputation, timeline, levels, properties.

Expected peaks are worked out by hand from the model in the simulator's docstring. For a chain
where every node saves its own output and the loss saves the last one, nothing is freed in
forward; backward of node ``v`` allocates the gradient of ``v-1`` while the gradient of ``v``
and the outputs ``0..v`` are live, so the peak is ``max_v (b_0 + … + b_v + b_v + b_(v-1))``.
"""

from __future__ import annotations

import random

import networkx as nx
import pytest

from _graphs import random_chain_dag, random_profiled, with_held_outputs

from autoremat.cost import Simulation, no_recompute_plan, simulate, step_levels, unoptimised_peak_bytes
from autoremat.errors import PlanMismatchError
from autoremat.graph import Graph
from autoremat.plan import Plan, Segment, segments_from_lower_sets


def chain_formula(sizes: list[int]) -> int:
    best = 0
    for v in range(len(sizes)):
        best = max(best, sum(sizes[: v + 1]) + sizes[v] + (sizes[v - 1] if v else 0))
    return best


def make_graph(n: int, edges, meta=None, **per_node) -> Graph:
    g = nx.DiGraph()
    for v in range(n):
        g.add_node(v, name=f"n{v}", **{k: vals[v] for k, vals in per_node.items()})
    g.add_edges_from(edges)
    return Graph(g, meta)


def plan_of(g: Graph, *segments: tuple[tuple[int, ...], bool]) -> Plan:
    return Plan([Segment(nodes, rec) for nodes, rec in segments], graph_fingerprint=g.fingerprint)


# ---------------------------------------------------------------------- hand-computed peaks
class TestHandComputedPeaks:
    @pytest.mark.parametrize(
        ("sizes", "expected"),
        [([10, 20, 30], 110), ([5, 50, 5, 5], 115), ([100] * 20, 2200), ([7], 14), ([3, 1], 8)],
    )
    def test_chain_without_recomputation(self, sizes, expected):
        assert chain_formula(sizes) == expected
        g = Graph.chain(sizes)
        sim = simulate(g, no_recompute_plan(g))
        assert sim.peak_bytes == expected
        assert unoptimised_peak_bytes(g) == expected

    def test_peak_location(self):
        g = Graph.chain([5, 50, 5, 5])
        assert simulate(g, no_recompute_plan(g)).peak_at == "backward of node 2 (n2)"

    def test_chain_that_saves_nothing(self):
        # forward frees each input once consumed: max(b_(v-1) + b_v) = 50; the loss keeps the
        # output (30) while its gradient (30) is allocated: 60.
        g = Graph.chain([10, 20, 30], saves_own_output=False)
        sim = simulate(g, no_recompute_plan(g))
        assert sim.peak_bytes == 60
        assert sim.peak_at == "loss backward"

    def test_parameter_gradients(self):
        # forward 20; loss gradient 10 -> 30; backward of node 1: grad of node 0 (10) and
        # the gradient of parameter w (100) -> 140. The parameter gradient outlives the step.
        g = make_graph(2, [(0, 1)], {"param_bytes": {"w": 100}, "loss_saves": [1]},
                       out_bytes=[10, 10], alloc_bytes=[10, 10], saves=[(0,), (1,)],
                       params=[(), ("w",)], is_output=[False, True])
        sim = simulate(g, no_recompute_plan(g))
        assert sim.peak_bytes == 140
        assert sim.peak_at == "backward of node 1 (n1)"
        assert sim.timeline[-1][2] == 100

    def test_shared_parameter_gradient_accumulates_in_a_temporary(self):
        # both nodes use w: the second use needs a transient 100 for out-of-place accumulation
        g = make_graph(2, [(0, 1)], {"param_bytes": {"w": 100}, "loss_saves": [1]},
                       out_bytes=[10, 10], alloc_bytes=[10, 10], saves=[(0,), (1,)],
                       params=[("w",), ("w",)], is_output=[False, True])
        # backward 1: 20 + 10 (grad1) + 10 (grad0) + 100 (w) = 140; after it 10 + 10 + 100 = 120
        # backward 0: 120 + 100 transient = 220
        assert simulate(g, no_recompute_plan(g)).peak_bytes == 220

    def test_forward_workspace(self):
        g = make_graph(3, [(0, 1), (1, 2)], {"loss_saves": [2]}, out_bytes=[10, 20, 30],
                       alloc_bytes=[10, 20, 30], saves=[(0,), (1,), (2,)], fwd_temp_bytes=[1000, 0, 0],
                       is_output=[False, False, True])
        sim = simulate(g, no_recompute_plan(g))
        assert sim.peak_bytes == 1010
        assert sim.peak_at == "forward of node 0 (n0)"

    def test_backward_workspace(self):
        g = make_graph(3, [(0, 1), (1, 2)], {"loss_saves": [2]}, out_bytes=[10, 20, 30],
                       alloc_bytes=[10, 20, 30], saves=[(0,), (1,), (2,)], bwd_temp_bytes=[0, 500, 0],
                       is_output=[False, False, True])
        # backward of node 1: 10 + 20 + 20 (grad1) + 10 (grad0) + 500
        assert simulate(g, no_recompute_plan(g)).peak_bytes == 560

    def test_extra_saved_bytes(self):
        g = make_graph(3, [(0, 1), (1, 2)], {"loss_saves": [2]}, out_bytes=[10, 20, 30],
                       alloc_bytes=[10, 20, 30], saves=[(0,), (1,), (2,)], extra_saved_bytes=[0, 7, 0],
                       is_output=[False, False, True])
        assert simulate(g, no_recompute_plan(g)).peak_bytes == 117

    def test_gradient_passthrough(self):
        # node 2 is an add-like node: saves nothing, passes its gradient through.
        # forward 60; loss: gradient 30 -> 90 (peak); then the loss releases output 2.
        g = make_graph(3, [(0, 1), (1, 2)], {"loss_saves": [2]}, out_bytes=[10, 20, 30],
                       alloc_bytes=[10, 20, 30], saves=[(0,), (1,), ()],
                       grad_passthrough=[False, False, True], is_output=[False, False, True])
        sim = simulate(g, no_recompute_plan(g))
        assert sim.peak_bytes == 90
        assert sim.peak_at == "loss backward"

    def test_diamond_gradient_accumulation(self):
        # forward 40; loss 50; backward of 3 allocates grads of 1 and 2 -> 70
        g = Graph.from_edges(4, [(0, 1), (0, 2), (1, 3), (2, 3)], out_bytes=[10] * 4)
        sim = simulate(g, no_recompute_plan(g))
        assert sim.peak_bytes == 70
        assert sim.peak_at == "backward of node 3 (n3)"

    def test_views_share_storage(self):
        # node 1 is a view of node 0 (no new storage); node 2 saves node 1 -> keeps node 0's storage
        g = make_graph(3, [(0, 1), (1, 2)], {"loss_saves": [2]}, out_bytes=[40, 40, 10],
                       alloc_bytes=[40, 0, 10], alias_of=[None, 0, None], saves=[(), (), (1,)],
                       grad_passthrough=[False, True, False], is_output=[False, False, True])
        # forward: 40 + 10 = 50; loss: gradient 10 -> 60, then output 2 (saved by nobody) is
        # released -> 50; backward 2: + 40 (gradient of the view) = 90
        sim = simulate(g, no_recompute_plan(g))
        assert sim.peak_bytes == 90
        assert sim.peak_at == "backward of node 2 (n2)"
        assert [live for _, _, live in sim.timeline] == [40, 40, 50, 50, 50, 40, 40, 0]

    def test_empty_graph(self):
        g = Graph()
        sim = simulate(g, no_recompute_plan(g))
        assert sim.peak_bytes == 0 and sim.extra_time_s == 0.0

    def test_zero_size_tensors(self):
        g = Graph.chain([0, 0, 0])
        assert simulate(g, no_recompute_plan(g)).peak_bytes == 0


# ---------------------------------------------------------------------- recomputation
class TestRecomputation:
    def test_small_chain_by_hand(self):
        # chain of 4 x 10 bytes, segment {0,1} recomputed: forward keeps only 2 and 3 (20 live),
        # backward of node 3 reaches 40 (outputs 2, 3, grads of 3 and 2); the replay of {0,1}
        # happens once only gradient 1 is left (10 + 20 + grad 0 = 40 again).
        g = Graph.chain([10] * 4, [1.0, 2.0, 3.0, 4.0])
        sim = simulate(g, plan_of(g, ((0, 1), True), ((2, 3), False)))
        assert sim.peak_bytes == 40
        assert unoptimised_peak_bytes(g) == 60
        assert sim.extra_time_s == 3.0
        assert sim.fwd_time_s == 10.0 and sim.bwd_time_s == 20.0
        assert sim.step_time_s == 33.0

    def test_long_chain_segments_lower_peak_and_add_their_forward_time(self):
        n = 16
        times = [float(i + 1) for i in range(n)]
        g = Graph.chain([100] * n, times)
        base = simulate(g, no_recompute_plan(g))
        assert base.peak_bytes == (n + 2) * 100 and base.extra_time_s == 0.0
        plan = plan_of(g, (tuple(range(0, 4)), True), (tuple(range(4, 8)), True),
                       (tuple(range(8, 12)), True), (tuple(range(12, 16)), False))
        sim = simulate(g, plan)
        assert sim.peak_bytes < base.peak_bytes
        assert sim.extra_time_s == sum(times[:12])
        # one recomputed segment of 4 is cheaper but saves less
        one = simulate(g, plan_of(g, (tuple(range(0, 4)), True), (tuple(range(4, 16)), False)))
        assert one.extra_time_s == sum(times[:4])
        assert sim.peak_bytes <= one.peak_bytes < base.peak_bytes

    def test_early_stop(self):
        # nodes 2 and 3 save nothing: the replay of segment {0..3} stops after node 1
        n = 6
        times = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]
        g = make_graph(n, [(v, v + 1) for v in range(n - 1)], {"loss_saves": [n - 1]},
                       out_bytes=[10] * n, alloc_bytes=[10] * n, time_s=times,
                       saves=[(0,), (1,), (), (), (4,), (5,)], is_output=[v == n - 1 for v in range(n)])
        sim = simulate(g, plan_of(g, ((0, 1, 2, 3), True), ((4, 5), False)))
        assert sim.extra_time_s == 1.0 + 2.0
        recomputed = [v for phase, v, _ in sim.timeline if phase == "recompute"]
        assert recomputed == [0, 1]

    def test_recompute_segment_that_saves_nothing_costs_nothing(self):
        g = Graph.chain([10] * 4, saves_own_output=False)
        sim = simulate(g, plan_of(g, ((0, 1), True), ((2, 3), False)))
        assert sim.extra_time_s == 0.0
        assert not [e for e in sim.timeline if e[0] == "recompute"]

    def test_timeline(self):
        g = Graph.chain([10] * 4)
        sim = simulate(g, plan_of(g, ((0, 1), True), ((2, 3), False)))
        phases = [p for p, _, _ in sim.timeline]
        assert set(phases) == {"fwd", "loss", "recompute", "bwd"}
        assert [v for p, v, _ in sim.timeline if p == "fwd"] == [0, 1, 2, 3]
        assert [v for p, v, _ in sim.timeline if p == "bwd"] == [3, 2, 1, 0]
        assert [v for p, v, _ in sim.timeline if p == "recompute"] == [0, 1]
        assert phases.index("recompute") > phases.index("bwd")  # replay happens in backward
        assert max(live for _, _, live in sim.timeline) <= sim.peak_bytes
        assert sim.timeline[-1][2] == 0  # no parameters: nothing outlives the step
        quiet = simulate(g, plan_of(g, ((0, 1), True), ((2, 3), False)), record=False)
        assert quiet.timeline == [] and quiet.peak_bytes == sim.peak_bytes


# ---------------------------------------------------------------------- properties
def _random_plan(g: Graph, rng: random.Random) -> Plan:
    n = len(g)
    cuts = sorted(rng.sample(range(1, n), rng.randint(0, n - 1)))
    lowers = [list(range(c)) for c in cuts] + [list(range(n))]
    return Plan(segments_from_lower_sets(g, lowers, recompute_last=rng.random() < 0.5),
                graph_fingerprint=g.fingerprint)


@pytest.mark.parametrize("seed", range(25))
def test_random_plans_properties(seed):
    rng = random.Random(seed)
    g = random_chain_dag(rng)
    plan = _random_plan(g, rng)
    sim = simulate(g, plan)
    assert isinstance(sim, Simulation)
    # a node's gradient is materialised at some point: the peak can never be below the largest
    assert sim.peak_bytes >= max(g.node(v)["out_bytes"] for v in g)
    # every node saves its own output, so the replay runs every recomputed node exactly once
    recomputed = plan.recomputed_nodes
    assert sim.extra_time_s == pytest.approx(sum(g.node(v)["time_s"] for v in recomputed))
    assert sorted(v for p, v, _ in sim.timeline if p == "recompute") == sorted(recomputed)
    assert sim.timeline[-1][2] == 0
    assert simulate(g, no_recompute_plan(g)).extra_time_s == 0.0


def test_plan_from_another_graph_is_rejected():
    g3 = Graph.chain([1] * 3)
    g4 = Graph.chain([1] * 4)
    with pytest.raises(PlanMismatchError):
        simulate(g4, no_recompute_plan(g3))
    with pytest.raises(PlanMismatchError):
        simulate(g3, no_recompute_plan(g4))


def test_no_recompute_plan():
    g = Graph.chain([1] * 3)
    p = no_recompute_plan(g)
    assert p.segments == [Segment((0, 1, 2), recompute=False)]
    assert p.solver == "none" and p.graph_fingerprint == g.fingerprint
    assert no_recompute_plan(Graph()).segments == []


# ---------------------------------------------------------------------- per-node levels
def test_step_levels_by_hand():
    """Chain 10, 20, 30 saving its outputs: forward levels 10, 30, 60; the loss adds the output
    gradient (30); backward of node v holds the outputs up to v, v's gradient and its input's new
    one (node 0 has no input), then frees its output and gradient."""
    lv = step_levels(Graph.chain([10, 20, 30]))
    assert lv.fwd_touch == [10, 30, 60]
    assert lv.bwd_touch == [10 + 10, 30 + 20 + 10, 60 + 30 + 20]
    assert lv.bwd_after == [0, 10 + 10, 30 + 20]
    assert lv.peak == 110 == unoptimised_peak_bytes(Graph.chain([10, 20, 30]))
    assert (lv.loss_fwd_touch, lv.loss_bwd_touch) == (60, 90)


def test_the_loss_tensor_is_held_to_the_steps_end():
    """``loss_held_bytes`` (the loss tensor's own storage, which the loop holds through
    ``backward()``: ``mse_loss``'s mean is input-sized on the CPU) is live from the loss's forward
    to the step's end. Chain 10, 20, 30 with 7 held bytes: the loss forward 60 + 7, its backward
    97, node 2's backward 60 + 30 + 20 + 7 = 117 (the peak; 110 without), 7 left after the last
    backward; a replay of nodes 0 and 1 sees it too."""
    base = Graph.chain([10, 20, 30])
    g = base.copy()
    g.meta["loss_held_bytes"] = 7
    lv = step_levels(g)
    assert (lv.loss_fwd_touch, lv.loss_bwd_touch) == (67, 97)
    assert lv.bwd_touch == [10 + 10 + 7, 30 + 20 + 10 + 7, 60 + 30 + 20 + 7]
    assert lv.bwd_after == [7, 10 + 10 + 7, 30 + 20 + 7]
    sim = simulate(g, no_recompute_plan(g))
    assert sim.peak_bytes == 117 and sim.peak_at == "backward of node 2 (n2)"
    assert sim.timeline[-1][2] == 7
    plan = plan_of(g, ((0, 1), True), ((2,), False))
    replayed = [x for x in step_levels(g, plan).recompute_touch if x is not None]
    assert replayed and replayed == [x + 7 for x in step_levels(base, plan).recompute_touch if x is not None]
    assert simulate(g, plan).peak_bytes == simulate(base, plan).peak_bytes + 7


@pytest.mark.parametrize("seed", range(12))
def test_step_levels_are_the_simulators_events(seed):
    """The levels are the simulator's own: their maximum is the unoptimised peak, the level after
    each backward is the timeline's, parameter gradients only grow, and a node no gradient
    reaches has no backward level."""
    rng = random.Random(seed)
    g = with_held_outputs(random_profiled(rng, rng.randint(2, 20)), seed)
    g.meta["param_bytes"] = {"w": 7}
    for v in g.nodes:
        if v % 3 == 0:
            g.nx.nodes[v]["params"] = ("w",)
    lv = step_levels(g)
    sim = simulate(g, no_recompute_plan(g))
    touched = [x for x in lv.fwd_touch + lv.bwd_touch if x is not None] + [lv.loss_fwd_touch, lv.loss_bwd_touch]
    assert lv.peak == sim.peak_bytes == max([0, *touched])
    after = {v: live for phase, v, live in sim.timeline if phase == "bwd"}
    assert lv.bwd_after == [after[v] for v in g.nodes]
    order = list(reversed(g.nodes))
    assert all(lv.pgrad_after[a] <= lv.pgrad_after[b] for a, b in zip(order, order[1:]))
    assert all(lv.fwd_touch[v] is not None for v in g.nodes)
    for v in g.nodes:
        if not g.node(v)["requires_grad"]:
            assert lv.bwd_touch[v] is None


def test_peak_places_name_the_event():
    g = Graph.chain([5, 50, 5, 5])
    plan = plan_of(g, ((0, 1, 2), True), ((3,), False))
    assert simulate(g, plan).peak_at.startswith(("backward of node", "recompute of node", "forward of node"))
    g = make_graph(1, [], {"loss_saves": [0], "loss_fwd_temp_bytes": 1000}, out_bytes=[1], alloc_bytes=[1],
                   saves=[(0,)], is_output=[True])
    assert simulate(g, no_recompute_plan(g)).peak_at == "loss forward"
    assert simulate(Graph(), no_recompute_plan(Graph())).peak_at == "start"


def _held_chain(kept: str | None) -> Graph:
    """0 -> 1 -> 2, nothing saved; node 1 (1000 B) held by the returned object, node 2 the output."""
    meta = {} if kept is None else {"output_kept": kept}
    return make_graph(3, [(0, 1), (1, 2)], meta, alloc_bytes=[10, 1000, 10], out_bytes=[10, 1000, 10],
                      saves=[(), (), ()], is_output=[False, False, True], held_by_output=[False, True, False])


def test_output_kept_step_holds_the_returned_object_through_backward():
    """Forward peaks at 1010 either way (node 1 and node 2). Kept until the loss, backward of
    node 2 holds the seed (10) and node 1's gradient (1000): 1010. Kept to the step's end, node 1
    (1000) and node 2 (10) stay alive too: 2020, at that backward, and to the last one."""
    loss, default, step = (simulate(g, no_recompute_plan(g)) for g in map(_held_chain, ("loss", None, "step")))
    assert loss.peak_bytes == default.peak_bytes == 1010
    assert step.peak_bytes == 2020 and step.peak_at.startswith("backward of node 2")
    assert step.timeline[-1][2] - loss.timeline[-1][2] == 1010
    g = _held_chain("step")
    assert [g.held_until(v) for v in g.nodes] == [None, "step", "step"] and g.held_to_end() == [1, 2]
    assert _held_chain(None).held_until(1) == "loss" and _held_chain(None).held_to_end() == []


def test_an_unknown_output_kept_is_refused():
    g = _held_chain("backward")
    with pytest.raises(ValueError, match=r"output_kept.*'backward'.*\('loss', 'step'\)"):
        simulate(g, no_recompute_plan(g))
