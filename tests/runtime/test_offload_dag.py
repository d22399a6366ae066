"""The offload runtime on DAG plans (issue 22): offloaded checkpoints (inputs of recomputed
regions), storages kept by several holders, views, forward waits, prefetch in the plan's order.

On the CPU the runtime is exact bookkeeping: what it packs, the bytes, the order in which
backward first uses each storage, the prefetches it starts and the forward waits it runs are
compared with the simulator's prediction for the same plan, and gradients are ``torch.equal`` to
the unpatched model's. With ``Offloader.host_tier`` the CPU run also releases offloaded storages
and copies them back, and its measured peak is compared with the simulator's at an unbounded
bandwidth. The GPU checks at the end (``-m gpu``) measure real copies.
"""

from __future__ import annotations

import pytest
from _offloaded import measured_with_host_tier, offloaded_step
import torch
from torch import nn

import autoremat
from autoremat.cost import simulate
from autoremat.measure import run_step
from autoremat.plan import Plan, Segment, offloadable_nodes, wait_points
from autoremat.runtime import offloader_of
from autoremat.solvers import finalize_plan
from autoremat.solvers.combined import checkpoint_plans


_GRAPHS: dict[str, autoremat.Graph] = {}


def zoo_case(name: str) -> tuple[nn.Module, tuple, autoremat.Graph]:
    """A fresh zoo model at batch 1, its inputs and its graph (captured once per module: the
    bookkeeping compared here does not depend on the measured times)."""
    model, args = autoremat.zoo.build(name, batch_size=1)
    if name not in _GRAPHS:
        _GRAPHS[name] = autoremat.capture(model, args, repeats=1, warmup=0)
    return model, args, _GRAPHS[name]


def run_and_compare(model: nn.Module, args: tuple, g: autoremat.Graph, plan: Plan, *, loss_fn=None, regions="lean"):
    """One step unpatched and one patched; returns the offloader's stats (gradients checked)."""
    stats = offloaded_step(model, args, plan, loss_fn=loss_fn, regions=regions)
    assert offloader_of(model) is None and "forward" not in model.__dict__
    return stats


def check_bookkeeping(g: autoremat.Graph, plan: Plan, stats) -> None:
    """The runtime did what the simulator predicts for ``plan``."""
    sim = simulate(g, plan)
    assert sorted(stats.packed_nodes) == list(plan.offload)
    assert stats.packed_bytes == sim.offloaded_bytes == sum(g.node(v)["alloc_bytes"] for v in plan.offload)
    assert stats.fetched_nodes == sim.offload_order == list(plan.offload_order)  # order of first backward use
    assert stats.prefetched_nodes == list(plan.offload_order)  # prefetches in the plan's order
    order = {v: i for i, v in enumerate(v for seg in plan.segments for v in seg.nodes)}
    assert stats.waits == sorted(plan.offload_waits.items(), key=lambda kv: order[kv[0]])


def dag_plan(g: autoremat.Graph, base: Plan, wait_limit_fraction: float = 0.5) -> Plan:
    """``base`` with every storage it keeps offloaded and forward waits derived from a limit."""
    offload = tuple(sorted(offloadable_nodes(g, base)))
    plan = Plan(list(base.segments), offload=offload)
    limit = int(wait_limit_fraction * simulate(g, base).peak_bytes)
    plan.offload_waits = simulate(g, plan, bandwidth_bytes_per_s=1e6, offload_wait_limit_bytes=limit).offload_waits
    return finalize_plan(g, plan, 10**15, "manual")


@pytest.mark.parametrize("name", ["unet", pytest.param("densenet121", marks=pytest.mark.slow)])
def test_offloaded_checkpoints_on_dag_models_match_the_simulator(name: str):
    model, args, g = zoo_case(name)
    base = checkpoint_plans(g, 4)[1]  # a few recomputed parts: their inputs are checkpoints
    plan = dag_plan(g, base)
    regions_inputs = {g.root(u) for seg in plan.segments if seg.recompute for v in seg.nodes
                      for u in g.pred(v) if u not in seg.nodes}
    assert regions_inputs & set(plan.offload), "no offloaded checkpoint in the plan"
    stats = run_and_compare(model, args, g, plan)
    check_bookkeeping(g, plan, stats)
    assert stats.region_inputs > 0 and stats.saves > 0


@pytest.mark.parametrize(("solver", "fraction"), [("offload-dag", 0.8), ("combined", 0.65)])
def test_solver_plans_run_as_simulated(solver: str, fraction: float):
    """What the DAG solvers return runs with equal gradients and the predicted bookkeeping (the
    U-Net's long skips: offload-dag offloads saved tensors; combined, at a budget offload alone
    cannot meet, also recomputes and offloads that region's inputs)."""
    model, args, g = zoo_case("unet")
    budget = int(fraction * simulate(g, autoremat.cost.no_recompute_plan(g)).peak_bytes)
    plan = autoremat.solve(g, budget, solver=solver, offload=True)
    assert plan.offload and simulate(g, plan).peak_bytes <= budget
    if solver == "combined":
        assert plan.recompute_segments
    stats = run_and_compare(model, args, g, plan)
    check_bookkeeping(g, plan, stats)


class Branches(nn.Module):
    """``a`` is saved by two consumers and is the input of a recomputed region through a view."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.left = nn.Linear(32, 32)
        self.right = nn.Linear(32, 32)
        self.mid = nn.Linear(32, 32)
        self.out = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.relu(self.inp(x))
        b = self.left(a) * self.right(a)  # two consumers save a; the product saves both factors
        v = a.view(a.shape[0], 4, 8).transpose(1, 2).reshape(a.shape[0], 32)  # a view, then a copy
        c = torch.tanh(self.mid(b + a.view(a.shape[0], 32)))
        return self.out(c + v)


def test_several_holders_views_and_a_region_input_share_one_host_copy():
    model, x = Branches(), torch.randn(8, 16)
    g = autoremat.capture(model, (x,))
    at = {g.node(v)["name"]: v for v in g.nodes}
    relu, add, tanh = at["relu"], at["add"], at["tanh"]
    # left and right save relu's output; the region (add, mid, tanh) takes a view of it
    segments = [Segment(tuple(range(0, relu + 1)), False), Segment(tuple(range(relu + 1, add)), False),
                Segment(tuple(range(add, tanh + 1)), True), Segment(tuple(range(tanh + 1, len(g))), False)]
    base = Plan(segments)
    region_inputs = {u for v in segments[2].nodes for u in g.pred(v) if u not in segments[2].nodes}
    assert any(g.node(u)["kind"] == "view" and g.root(u) == relu for u in region_inputs)
    assert relu in offloadable_nodes(g, base)
    plan = finalize_plan(g, Plan(list(base.segments), offload=(relu,)), 10**15, "manual")
    stats = run_and_compare(model, (x,), g, plan)
    check_bookkeeping(g, plan, stats)
    assert stats.packed_nodes == [relu] and stats.saves >= 2 and stats.region_inputs == 1  # one storage


def test_torch_regions_refuse_an_offloaded_checkpoint():
    model, args, g = zoo_case("unet")
    plan = dag_plan(g, checkpoint_plans(g, 4)[1])
    autoremat.apply(model, plan, regions="torch")
    try:
        with pytest.raises(RuntimeError, match="regions='lean'"):
            run_step(model, args)
    finally:
        autoremat.restore(model)


def test_waits_run_where_the_plan_says():
    model, args, g = zoo_case("unet")
    base = autoremat.cost.no_recompute_plan(g)
    plan = dag_plan(g, base, wait_limit_fraction=0.3)
    assert plan.offload_waits and set(plan.offload_waits) <= wait_points(g, plan)
    stats = run_and_compare(model, args, g, plan)
    check_bookkeeping(g, plan, stats)


def test_module_level_offloaded_checkpoints():
    pytest.importorskip("transformers")
    from autoremat.zoo import hf

    model = hf.gpt2(n_layer=3, n_embd=32, n_head=2, vocab_size=64, seq=32)
    ids = torch.randint(0, 64, (2, 32))
    g = autoremat.capture(model, (ids,), loss_fn=hf.logits_mean, repeats=1, warmup=0)
    base = checkpoint_plans(g, 1)[0]  # every module call on its own
    assert base.recompute_segments
    plan = dag_plan(g, base)
    stats = run_and_compare(model, (ids,), g, plan, loss_fn=hf.logits_mean)
    assert stats.region_inputs > 0 and sorted(stats.packed_nodes) == list(plan.offload)
    assert stats.fetched_nodes == simulate(g, plan).offload_order


@pytest.mark.parametrize("name", ["unet", "densenet121"])
def test_measured_peak_with_the_host_tier_is_the_simulators(name: str):
    """Copies that complete at once (the CPU's host tier) are the simulator's link at an unbounded
    bandwidth: saved tensors leave the device after their first holder, the prefetch reserves the
    next storage one ahead, and a prefetched copy is freed after its last holder's backward.
    Everything saved offloaded: the measured peak is the predicted one (within 1 %) and far below
    the step without offload. (Before this test: prefetches skipped storages whose address a new
    storage took, and fetched copies lived to the end of the step.)"""
    model, args, g = zoo_case(name)
    base = autoremat.cost.no_recompute_plan(g)
    plan = finalize_plan(g, Plan(list(base.segments), offload=tuple(sorted(offloadable_nodes(g, base)))),
                         10**15, "manual")
    predicted = simulate(g, plan, bandwidth_bytes_per_s=1e18).peak_bytes
    without = simulate(g, base).peak_bytes
    measured = measured_with_host_tier(model, args, plan)
    assert abs(measured - predicted) <= 0.01 * measured, (measured, predicted, without)
    assert measured < 0.85 * without


def test_a_deeper_prefetch_runs_as_simulated():
    """``Plan.offload_prefetch_depth``: the runtime keeps that many storages prefetched ahead of
    their first backward use, as the simulator does: at depth 4 the host-tier run measures the
    predicted peak (within 1 %), which is well above depth 1's (more copies reserved ahead), and
    fetches and prefetches in the plan's order."""
    model, args, g = zoo_case("unet")
    base = autoremat.cost.no_recompute_plan(g)
    offload = tuple(sorted(offloadable_nodes(g, base)))
    plans = {d: finalize_plan(g, Plan(list(base.segments), offload=offload, offload_prefetch_depth=d), 10**15, "manual")
             for d in (1, 4)}
    predicted = {d: simulate(g, p, bandwidth_bytes_per_s=1e18).peak_bytes for d, p in plans.items()}
    assert predicted[4] > 1.1 * predicted[1]
    measured = measured_with_host_tier(model, args, plans[4])
    assert abs(measured - predicted[4]) <= 0.01 * measured, (measured, predicted)
    model, args, g = zoo_case("unet")
    check_bookkeeping(g, plans[4], run_and_compare(model, args, g, plans[4]))


@pytest.mark.parametrize("name", ["unet", "densenet121"])
def test_measured_peak_of_offloaded_checkpoints_with_the_host_tier(name: str):
    """Offloaded checkpoints (recomputed regions' inputs on the host path) and saved tensors: the
    measured peak is within 10 % of the prediction at an unbounded bandwidth, the bound of the
    other CPU prediction tests."""
    model, args, g = zoo_case(name)
    base = checkpoint_plans(g, 4)[1]
    plan = finalize_plan(g, Plan(list(base.segments), offload=tuple(sorted(offloadable_nodes(g, base)))),
                         10**15, "manual")
    predicted = simulate(g, plan, bandwidth_bytes_per_s=1e18).peak_bytes
    measured = measured_with_host_tier(model, args, plan)
    assert abs(measured - predicted) <= 0.10 * measured, (measured, predicted)


# ---------------------------------------------------------------- GPU checks (run with -m gpu)


def _cuda_case(name: str, budget_fraction: float, solver: str, batch_size: int = 32):
    from autoremat.offload.bandwidth import measure_bandwidth

    model, args = autoremat.zoo.build(name, size="small", batch_size=batch_size, device="cuda")
    g = autoremat.capture(model, args)
    g.meta["bandwidth_bytes_per_s"] = measure_bandwidth()
    unpatched = simulate(g, autoremat.cost.no_recompute_plan(g)).peak_bytes
    try:
        plan = autoremat.solve(g, int(budget_fraction * unpatched), solver=solver)
    except autoremat.InfeasibleBudgetError as err:
        assert err.min_budget_bytes is not None
        plan = autoremat.solve(g, err.min_budget_bytes, solver=solver)
    return model, args, g, plan


@pytest.mark.gpu
@pytest.mark.parametrize(("name", "solver"), [("unet", "offload-dag"), ("densenet121", "offload-dag"),
                                              ("unet", "combined"), ("resnet50", "combined")])
def test_dag_plans_on_cuda_measure_the_predicted_peak(name: str, solver: str):
    """Real copies: gradients equal, the measured CUDA step peak within 10 % of the prediction at
    the measured bandwidth and below the unpatched step's."""
    from autoremat.measure import measure

    model, args, g, plan = _cuda_case(name, 0.6, solver)
    # offload-dag must offload to reach 0.6x; combined may find recomputation cheaper there (it
    # did on an H200: the U-Net's plan recomputed one segment), and its plan is checked as it is.
    assert plan.offload if solver == "offload-dag" else (plan.offload or plan.recompute_segments)
    before = measure(model, args).peak_bytes
    if plan.offload:  # a plan that only recomputes has no offloader to keep books
        check_bookkeeping(g, plan, run_and_compare(model, args, g, plan))
    autoremat.apply(model, plan)
    try:
        after = measure(model, args).peak_bytes
    finally:
        autoremat.restore(model)
    assert abs(after - plan.predicted_peak_bytes) <= 0.10 * after, (after, plan.predicted_peak_bytes)
    assert after < before


@pytest.mark.gpu
def test_copies_overlap_compute_on_cuda():
    """The copy streams run beside the compute stream: some device-to-host and host-to-device copy
    overlaps a kernel in time (CUDA profiler trace), and prefetches ran ahead of their use."""
    from torch.profiler import ProfilerActivity, profile

    # batch 128: kernels long enough to keep the GPU busy while copies run. At batch 32, beside 15
    # other test processes, no copy overlapped a kernel on an H200 (2026-11-28); a likely cause, not
    # established: each kernel ended before the CPU launched the next, leaving nothing to overlap
    model, args, g, plan = _cuda_case("unet", 0.6, "offload-dag", batch_size=128)
    autoremat.apply(model, plan)
    try:
        run_step(model, args)  # warm up
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run_step(model, args)
            torch.cuda.synchronize()
        stats = offloader_of(model).stats
    finally:
        autoremat.restore(model)
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    copies = {d: [e.time_range for e in events if f"Memcpy {d}" in e.name] for d in ("DtoH", "HtoD")}
    kernels = [e.time_range for e in events if "Memcpy" not in e.name and "Memset" not in e.name]

    def overlaps(ranges):
        return any(c.start < k.end and k.start < c.end for c in ranges for k in kernels)

    assert copies["DtoH"] and overlaps(copies["DtoH"]), "no copy to host overlapped a kernel"
    assert copies["HtoD"] and overlaps(copies["HtoD"]), "no prefetch overlapped a kernel"
    assert stats.prefetched_ahead > 0
