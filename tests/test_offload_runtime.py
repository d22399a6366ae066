"""Offload: plan field, simulator transfer model, the combined planner, and the runtime
(bookkeeping on the CPU; real transfers on CUDA, marked gpu)."""

from __future__ import annotations

import copy

import pytest
import torch

import autoremat
from autoremat.measure import gradients, gradients_equal, measure, run_step
from autoremat.plan import Plan, offloadable_nodes
from autoremat.runtime import offloader_of
from autoremat.simulate import no_recompute_plan, simulate


def _chain(n: int = 8, size: int = 100, t: float = 1.0) -> autoremat.Graph:
    return autoremat.Graph.chain([size] * n, [t] * n)


def test_offload_with_fast_link_lowers_peak_without_stalls() -> None:
    g = _chain()
    base = no_recompute_plan(g)
    plan = Plan(list(base.segments), offload=(0, 1, 2, 3))
    fast = simulate(g, plan, bandwidth_bytes_per_s=1e9)
    assert fast.peak_bytes < simulate(g, base).peak_bytes
    assert fast.offload_stall_s == 0.0 and fast.extra_time_s == 0.0
    assert fast.offloaded_bytes == 400


def test_slow_link_stalls_and_holds_memory() -> None:
    g = _chain()
    plan = Plan(list(no_recompute_plan(g).segments), offload=(0, 1, 2, 3))
    slow = simulate(g, plan, bandwidth_bytes_per_s=10.0)  # 10 s per tensor against 1 s nodes
    assert slow.offload_stall_s > 0 and slow.extra_time_s >= slow.offload_stall_s
    assert slow.peak_bytes >= simulate(g, plan, bandwidth_bytes_per_s=1e9).peak_bytes


def test_validate_rejects_offload_of_unsaved_nodes() -> None:
    g = autoremat.Graph.chain([100] * 4, saves_own_output=False)
    with pytest.raises(ValueError, match="nothing to offload"):
        autoremat.validate_plan(g, Plan(list(no_recompute_plan(g).segments), offload=(1,)))


def test_plan_json_keeps_offload() -> None:
    g = _chain()
    plan = Plan(list(no_recompute_plan(g).segments), offload=(2, 0))
    again = Plan.from_json(plan.to_json())
    assert again.offload == (0, 2)


def _meta_resnet() -> autoremat.Graph:
    m, a = autoremat.zoo.build("resnet50", size="paper", device="meta")
    g = autoremat.capture(m, a)
    for v in g.nodes:  # a slower device: transfers can hide behind compute
        g.node(v)["time_s"] *= 100
        g.node(v)["bwd_time_s"] *= 100
    return g


def test_combined_never_slower_than_recompute_or_offload_alone() -> None:
    g = _meta_resnet()
    vanilla = simulate(g, no_recompute_plan(g)).peak_bytes
    offload_used = False
    for frac in (0.8, 0.6, 0.45):
        budget = int(frac * vanilla)
        combined = autoremat.solve(g, budget, solver="combined")
        sim = simulate(g, combined)
        assert sim.peak_bytes <= budget
        offload_used |= bool(combined.offload)
        alone = []
        for name in ("chen", "dp-approx"):
            try:
                alone.append(simulate(g, autoremat.solve(g, budget, solver=name)).extra_time_s)
            except autoremat.InfeasibleBudgetError:
                pass
        base = no_recompute_plan(g)
        order = sorted(offloadable_nodes(g, base))
        for k in range(1, len(order) + 1, max(1, len(order) // 16)):
            s = simulate(g, Plan(list(base.segments), offload=tuple(order[:k])), check=False)
            if s.peak_bytes <= budget:
                alone.append(s.extra_time_s)
                break
        assert alone and sim.extra_time_s <= min(alone) + 1e-12
    assert offload_used


def test_combined_on_a_cpu_capture_does_not_offload() -> None:
    model, args = autoremat.zoo.build("resnet50")
    g = autoremat.capture(model, args)
    plan = autoremat.solve(g, "60%", solver="combined")
    assert not plan.offload and plan.options["offload_allowed"] is False


@pytest.mark.parametrize("name", ["resnet50", "transformer"])
def test_runtime_bookkeeping_on_cpu(name: str) -> None:
    model, args = autoremat.zoo.build(name)
    g = autoremat.capture(model, args)
    chen = autoremat.solve(g, "60%", solver="chen")
    order = sorted(offloadable_nodes(g, chen))[:6]
    plan = Plan(list(chen.segments), solver="manual", offload=tuple(order))
    plan = autoremat.solvers.finalize_plan(g, plan, 10**12, "manual")
    reference = copy.deepcopy(model)
    torch.manual_seed(0)
    run_step(reference, args)
    autoremat.apply(model, plan)
    try:
        torch.manual_seed(0)
        run_step(model, args)
        stats = offloader_of(model).stats
    finally:
        autoremat.restore(model)
    assert gradients_equal(gradients(reference), gradients(model))
    assert sorted(stats.packed_nodes) == sorted(order)
    assert stats.packed_bytes == sum(g.node(v)["alloc_bytes"] for v in order)
    assert sorted(stats.fetched_nodes) == sorted(order)
    assert stats.fetched_nodes[0] == max(order, key=lambda v: max(w for w in g.nodes if v in g.node(w)["saves"]))
    assert "forward" not in model.__dict__ and offloader_of(model) is None


def test_module_level_offload_bookkeeping() -> None:
    pytest.importorskip("transformers")
    from autoremat.zoo import hf

    model = hf.gpt2(n_layer=2, n_embd=32, n_head=2, vocab_size=64, seq=32)
    ids = torch.randint(0, 64, (2, 32))
    loss_fn = hf.logits_mean
    g = autoremat.capture(model, (ids,), loss_fn=loss_fn)
    base = no_recompute_plan(g)
    blocks = [v for v in offloadable_nodes(g, base) if g.node(v)["kind"] != "glue"]
    assert blocks
    plan = autoremat.solvers.finalize_plan(g, Plan(list(base.segments), offload=tuple(blocks)), 10**12, "manual")
    reference = copy.deepcopy(model)
    torch.manual_seed(1)
    run_step(reference, (ids,), loss_fn=loss_fn)
    autoremat.apply(model, plan)
    try:
        torch.manual_seed(1)
        run_step(model, (ids,), loss_fn=loss_fn)
        stats = offloader_of(model).stats
    finally:
        autoremat.restore(model)
    assert gradients_equal(gradients(reference), gradients(model))
    assert set(stats.packed_nodes) == set(blocks)


@pytest.mark.gpu
def test_real_transfers_on_cuda() -> None:
    model, args = autoremat.zoo.build("resnet50", size="small", batch_size=64, device="cuda")
    g = autoremat.capture(model, args)
    base = no_recompute_plan(g)
    order = sorted(offloadable_nodes(g, base))
    plan = autoremat.solvers.finalize_plan(g, Plan(list(base.segments), offload=tuple(order[: len(order) // 2])),
                                           10**15, "manual")
    reference = copy.deepcopy(model)
    torch.manual_seed(0)
    run_step(reference, args)
    before = measure(model, args).peak_bytes
    autoremat.apply(model, plan)
    try:
        torch.manual_seed(0)
        run_step(model, args)
        after = measure(model, args).peak_bytes
    finally:
        autoremat.restore(model)
    assert gradients_equal(gradients(reference), gradients(model))
    assert after < before
