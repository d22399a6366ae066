"""Replays that leave out a recomputed segment's tail (autoremat.replay_tail): which ops form
the tail, what the simulator predicts, and the runtime (short replay, whole-replay fallback,
PyTorch regions, torch.compile, plan files)."""

from __future__ import annotations

import copy
import random
import logging

import networkx as nx
import pytest
import torch
from _graphs import convolutional, random_dag, random_dag_with_views
from torch import nn

import autoremat
from autoremat.errors import PlanMismatchError
from autoremat.graph import Graph
from autoremat.measure import gradients, gradients_equal, measure, run_step
from autoremat.plan import Plan, Segment
from autoremat.cost.bitsets import GraphBits
from autoremat.replay_tail import replay_tail, replay_tails, tail_inputs, tail_start, tails_of
from autoremat.runtime import region
from autoremat.runtime.checkpoint_region import CheckpointRegion
from autoremat.cost import simulate
from autoremat.solvers import finalize_plan


# ---------------------------------------------------------------------- which ops form the tail
def _graph(kinds: list[str], edges: list[tuple[int, int]], saves: dict[int, tuple[int, ...]],
           extras: dict[int, int] | None = None) -> Graph:
    g = nx.DiGraph()
    for v, kind in enumerate(kinds):
        g.add_node(v, name=f"n{v}", kind=kind, out_bytes=8, alloc_bytes=8, time_s=1.0 + v, bwd_time_s=1.0,
                   saves=saves.get(v, ()), extra_saved_bytes=(extras or {}).get(v, 0),
                   is_output=v == len(kinds) - 1)
    g.add_edges_from(edges)
    return Graph(g, {"mode": "fx", "loss_saves": [len(kinds) - 1]})


CHAIN = [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]


def test_a_trailing_convolution_whose_input_the_replay_makes_is_the_tail() -> None:
    # conv -> bn -> relu -> conv -> add -> head; the segment is bn, relu, conv, add
    g = _graph(["conv", "bn", "act", "conv", "add", "linear"], CHAIN, {1: (0,), 2: (2,), 3: (2,), 5: (4,)}, {1: 16})
    assert replay_tail(g, [1, 2, 3, 4]) == 3
    assert tail_inputs(g, [1, 2, 3, 4], 3) == [2]
    assert replay_tail(g, [1, 2]) is None  # both are needed: relu saves its output, bn its statistics


@pytest.mark.parametrize("change", ["linear", "own output", "extras", "saved by the segment", "model output"])
def test_what_ends_the_tail(change: str) -> None:
    kinds = ["conv", "bn", "act", "conv", "add", "linear"]
    saves = {1: (0,), 2: (2,), 3: (2,), 5: (4,)}
    extras = {1: 16}
    if change == "linear":
        kinds[3] = "linear"  # its saved tensors may be views the runtime cannot trace
    elif change == "own output":
        saves[3] = (2, 3)
    elif change == "extras":
        extras[3] = 4
    elif change == "saved by the segment":
        saves[4] = (3,)
    g = _graph(kinds, CHAIN, saves, extras)
    if change == "model output":
        g.nx.nodes[3]["is_output"] = True
    if change == "saved by the segment":  # the add saves the conv's output: the add is no tail op
        assert replay_tail(g, [1, 2, 3, 4]) is None
        assert replay_tail(g, [1, 2, 3]) == 3  # without its saver the conv is a tail again
    else:  # the trailing add (saves nothing) is the whole tail
        assert replay_tail(g, [1, 2, 3, 4]) == 4
        assert tail_inputs(g, [1, 2, 3, 4], 4) == []
        assert replay_tail(g, [1, 2, 3]) is None


def test_a_tail_convolution_keeps_its_input_out_of_the_tail() -> None:
    # relu -> view -> conv: the view (saves nothing) feeds the tail convolution, so it is replayed
    g = _graph(["conv", "bn", "act", "view", "conv", "linear"], CHAIN, {1: (0,), 2: (2,), 4: (3,), 5: (4,)}, {1: 16})
    assert replay_tail(g, [1, 2, 3, 4]) == 4
    assert tail_inputs(g, [1, 2, 3, 4], 4) == [3]


def test_simulated_tail_saves_its_time_and_never_adds_memory() -> None:
    g = _graph(["conv", "bn", "act", "conv", "add", "linear"], CHAIN, {1: (0,), 2: (2,), 3: (2,), 5: (4,)}, {1: 16})
    whole = Plan([Segment((0,), False), Segment((1, 2, 3, 4), True), Segment((5,), False)],
                 graph_fingerprint=g.fingerprint)
    short = copy.deepcopy(whole)
    short.replay_tails = replay_tails(g, short)
    assert tails_of(short) == {1: (3, [2])}
    a, b = simulate(g, whole), simulate(g, short)
    assert a.extra_time_s == pytest.approx(2.0 + 3.0 + 4.0)  # bn, relu, conv (up to the last saver)
    assert b.extra_time_s == pytest.approx(2.0 + 3.0)  # bn, relu
    assert b.peak_bytes <= a.peak_bytes


def test_tail_start_on_bitsets_equals_replay_tail() -> None:
    """The bitset form the cost models price replays with: on 40 seeded convolutional DAGs (views,
    extras, outputs inside), every range of node ids and random subsets of one: the same tail."""
    rng = random.Random(5)
    tails = 0
    for seed in range(40):
        make = random_dag_with_views if seed % 2 else random_dag
        g = convolutional(make(seed, 6 + seed % 9), seed)
        p = GraphBits(g)
        segments = [list(range(a, b)) for a in range(len(g)) for b in range(a + 1, len(g) + 1)]
        segments += [sorted(rng.sample(range(len(g)), rng.randint(1, len(g)))) for _ in range(20)]
        for nodes in segments:
            want = replay_tail(g, nodes)
            assert tail_start(p, sum(1 << v for v in nodes)) == (-1 if want is None else want), (seed, nodes)
            tails += want is not None
    assert tails > 200, tails


# ---------------------------------------------------------------------- a dense block, end to end
class _Dense(nn.Module):
    """DenseNet-style: each layer concatenates all earlier features (cat -> bn -> relu -> 1x1 conv)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.layers = nn.ModuleList(nn.Sequential(nn.BatchNorm2d(8 + 4 * i), nn.ReLU(), nn.Conv2d(8 + 4 * i, 4, 1))
                                    for i in range(4))
        self.head = nn.Linear(24, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        feats = [self.stem(x)]
        for layer in self.layers:
            feats.append(layer(torch.cat(feats, 1)))
        return self.head(torch.cat(feats, 1).mean((2, 3)))


def _dense_plan() -> tuple[nn.Module, torch.Tensor, Graph, Plan]:
    """Each layer (cat, bn, relu, conv) one recomputed segment: the conv is its tail."""
    torch.manual_seed(0)
    model, x = _Dense().train(), torch.randn(4, 3, 16, 16)
    graph = autoremat.capture(model, (x,))
    names = [graph.node(v)["name"] for v in graph.nodes]
    base = autoremat.solve(graph, 10**12, solver="none")
    segs, start = [], 0
    for v, name in enumerate(names):
        if graph.node(v)["kind"] == "cat" and v > start:
            segs.append(Segment(tuple(range(start, v)), start > 0))
            start = v
    segs.append(Segment(tuple(range(start, len(names))), False))
    plan = finalize_plan(graph, Plan(segs, options=dict(base.options)), 10**12, "manual")
    return model, x, graph, plan


def test_dense_layers_replay_without_their_convolution_and_match_the_prediction(monkeypatch) -> None:
    model, x, graph, plan = _dense_plan()
    tails = tails_of(plan)
    assert len(tails) == 4 and all(graph.node(first)["kind"] == "conv" for first, _ in tails.values())
    whole = copy.deepcopy(plan)
    whole.replay_tails = {}
    assert simulate(graph, plan).extra_time_s < simulate(graph, whole).extra_time_s

    shorts = []
    real = region._Frame._recompute_short
    monkeypatch.setattr(region._Frame, "_recompute_short", lambda self: shorts.append(1) or real(self))
    reference = gradients_after(copy.deepcopy(model), x)
    for p in (plan, whole):
        patched = autoremat.apply(copy.deepcopy(model), p)
        shorts.clear()
        assert gradients_equal(reference, gradients_after(patched, x))
        assert len(shorts) == (4 if p is plan else 0)
        measured = measure(patched, (x,), steps=1, warmup=1).peak_bytes
        assert abs(measured - simulate(graph, p).peak_bytes) <= 0.005 * measured

    patched = autoremat.apply(copy.deepcopy(model), plan)
    state = patched.__dict__["_autoremat_patch"]
    regions = [m for m in state.forward_module.children() if isinstance(m, CheckpointRegion)]
    assert sum(r.short_replay is not None for r in regions) == 4
    for r in regions:
        assert "tail_mark" not in r.replay.code  # the whole replay runs in backward: no marker
        if r.short_replay is not None:
            assert "tail_mark" in r.body.code and "conv" not in r.short_replay.code.split("return")[-1]


def gradients_after(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    run_step(model, (x,))
    return gradients(model)


def test_a_tail_that_saves_what_it_cannot_trace_replays_whole(monkeypatch, caplog) -> None:
    """Under autocast the tail convolution saves bfloat16 copies of its input and weight: this
    forward's recomputation replays the region whole, and gradients are still the unpatched
    model's."""
    model, x, _graph_, plan = _dense_plan()
    shorts = []
    real = region._Frame._recompute_short
    monkeypatch.setattr(region._Frame, "_recompute_short", lambda self: shorts.append(1) or real(self))

    def grads(m: nn.Module) -> dict[str, torch.Tensor]:
        m.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(x).float().mean()
        loss.backward()
        return gradients(m)

    reference = grads(copy.deepcopy(model))
    patched = autoremat.apply(copy.deepcopy(model), plan)
    with caplog.at_level(logging.INFO, logger="autoremat.runtime.region"):
        got = grads(patched)
        assert gradients_equal(reference, got)
        assert gradients_equal(reference, grads(patched))  # a second step: said once per region
    assert not shorts
    said = [r for r in caplog.records if "replayed whole" in r.getMessage()]
    assert len(said) == len(tails_of(plan))


def test_pytorch_regions_and_torch_compile_run_a_plan_with_tails() -> None:
    model, x, _g, plan = _dense_plan()
    torch.manual_seed(5)
    reference = gradients_after(copy.deepcopy(model), x)
    patched = autoremat.apply(copy.deepcopy(model), plan, regions="torch")
    assert gradients_equal(reference, gradients_after(patched, x))

    torch._dynamo.reset()
    patched = autoremat.apply(copy.deepcopy(model), plan)
    compiled = torch.compile(patched, backend="aot_eager", fullgraph=True)  # a graph break would raise
    compiled(x).float().mean().backward()
    for name, g in gradients(patched).items():
        assert torch.allclose(g, reference[name], rtol=1e-5, atol=1e-6), name


def test_tails_survive_the_plan_file_and_are_checked_against_the_model(tmp_path) -> None:
    model, x, _g, plan = _dense_plan()
    path = tmp_path / "plan.json"
    plan.to_json(str(path))
    loaded = Plan.from_json(str(path))
    assert tails_of(loaded) == tails_of(plan)
    reference = gradients_after(copy.deepcopy(model), x)
    assert gradients_equal(reference, gradients_after(autoremat.apply(copy.deepcopy(model), loaded), x))

    si, (first, inputs) = next(iter(tails_of(plan).items()))
    bad = copy.deepcopy(plan)
    bad.replay_tails[si] = (plan.segments[si + 1].nodes[0], tuple(inputs))  # not in its segment
    target = copy.deepcopy(model)
    with pytest.raises(PlanMismatchError, match="replay tail"):
        autoremat.apply(target, bad)
    assert not autoremat.is_patched(target)


def test_tail_mark_outside_a_region_does_nothing() -> None:
    region.tail_mark(torch.ones(2))
    assert getattr(region._ACTIVE, "frame", None) is None


def test_solve_records_tails_that_shorten_densenet_replays() -> None:
    """On the zoo's DenseNet-121 at 30 % the plan's prediction counts on shorter replays, and the
    same plan with whole replays would simulate slower at the same peak."""
    model, args = autoremat.zoo.build("densenet121", size="small")
    graph = autoremat.capture(model, args)
    plan = autoremat.solve(graph, "30%", solver="dp-approx")
    assert tails_of(plan)
    whole = copy.deepcopy(plan)
    whole.replay_tails = {}
    a, b = simulate(graph, whole), simulate(graph, plan)
    assert b.extra_time_s < a.extra_time_s and b.peak_bytes <= a.peak_bytes
    assert plan.predicted_extra_time_s == pytest.approx(b.extra_time_s)


def test_a_tail_reading_the_segments_input_replays_nothing(monkeypatch) -> None:
    """A segment that is one 1x1 convolution: its tail is the whole segment and its tail input is
    the segment's input, so the replay runs no op and hands out that input again."""
    model, x, graph, plan = _dense_plan()
    names = [graph.node(v)["name"] for v in graph.nodes]
    conv = next(v for v, n in enumerate(names) if graph.node(v)["kind"] == "conv" and v > 0)
    segs = [Segment(tuple(range(conv)), False), Segment((conv,), True),
            Segment(tuple(range(conv + 1, len(names))), False)]
    plan = finalize_plan(graph, Plan(segs, options=dict(plan.options)),
                         10**12, "manual")
    assert tails_of(plan) == {1: (conv, list(graph.pred(conv)))}
    assert simulate(graph, plan).extra_time_s == 0.0
    shorts = []
    real = region._Frame._recompute_short
    monkeypatch.setattr(region._Frame, "_recompute_short", lambda self: shorts.append(1) or real(self))
    reference = gradients_after(copy.deepcopy(model), x)
    patched = autoremat.apply(copy.deepcopy(model), plan)
    assert gradients_equal(reference, gradients_after(patched, x))
    assert shorts == [1]
    measured = measure(patched, (x,), steps=1, warmup=1).peak_bytes
    assert abs(measured - plan.predicted_peak_bytes) <= 0.005 * measured
