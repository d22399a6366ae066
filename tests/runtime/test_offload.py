"""Offload: plan field, simulator transfer model, the combined planner, the chain offloading
solvers' plans run by the runtime (bookkeeping on the CPU; real transfers on CUDA, marked gpu)."""

from __future__ import annotations

import copy

import pytest
from _offloaded import offloaded_step
import torch

import autoremat
from autoremat.measure import deterministic_kernels, gradients, gradients_equal, measure, run_step
from autoremat.plan import Plan, offloadable_nodes
from autoremat.runtime import offloader_of
from autoremat.offload.bandwidth import measure_bandwidth
from autoremat.runtime.offload import Offloader
from autoremat.cost import no_recompute_plan, simulate, unoptimised_peak_bytes
from autoremat.solvers.beaumont import offload_candidates


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
    stats = offloaded_step(model, args, plan)
    assert sorted(stats.packed_nodes) == sorted(order)
    assert stats.packed_bytes == sum(g.node(v)["alloc_bytes"] for v in order)
    assert sorted(stats.fetched_nodes) == sorted(order)
    assert stats.fetched_nodes == simulate(g, plan).offload_order == list(plan.offload_order)  # first backward use
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
    stats = offloaded_step(model, (ids,), plan, loss_fn=loss_fn, seed=1)
    assert set(stats.packed_nodes) == set(blocks)


_CPU_RESNET: dict[str, tuple] = {}


def _cpu_resnet() -> tuple[torch.nn.Module, tuple, autoremat.Graph]:
    """A CPU resnet50 (small) and its capture, shared by the solver tests (the model is copied)."""
    if not _CPU_RESNET:
        model, args = autoremat.zoo.build("resnet50")
        _CPU_RESNET["x"] = (model, args, autoremat.capture(model, args))
    model, args, g = _CPU_RESNET["x"]
    return copy.deepcopy(model), args, g


@pytest.mark.parametrize("solver", ["offload-greedy", "offload-dp", "vdnn"])
def test_chain_solver_plans_run_on_a_cpu_model_with_offload_true(solver: str) -> None:
    model, args, g = _cpu_resnet()
    peak = unoptimised_peak_bytes(g)
    with pytest.raises(autoremat.InfeasibleBudgetError) as err:
        autoremat.solve(g, 0, solver=solver, offload=True)
    least = err.value.min_budget_bytes
    assert least < peak  # CPU-measured times: copies at 12 GB/s hide behind compute
    budget = (least + peak) // 2
    plan = autoremat.solve(g, budget, solver=solver, offload=True)
    assert plan.offload and not plan.recompute_segments
    assert simulate(g, plan).peak_bytes <= budget < peak
    stats = offloaded_step(model, args, plan)
    assert sorted(stats.packed_nodes) == list(plan.offload)
    assert stats.packed_bytes == sum(g.node(v)["alloc_bytes"] for v in plan.offload)
    assert sorted(stats.fetched_nodes) == list(plan.offload)
    assert offloader_of(model) is None


def test_a_producers_own_save_is_offloaded_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ReLU saves its output while it runs, before the runtime can mark that output; the
    window opened before the node holds that save until the mark, then sends it to the host like
    the next layer's save (otherwise it would pin the device storage on CUDA)."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    x = torch.randn(4, 8)
    g = autoremat.capture(model, (x,))
    relu = next(v for v in g.nodes if g.node(v)["kind"] == "act")
    assert relu in offload_candidates(g) and relu in g.node(relu)["saves"]
    plan = autoremat.solvers.finalize_plan(g, Plan(list(no_recompute_plan(g).segments), offload=(relu,)),
                                           10**12, "manual")
    seen: list[tuple[int, bool]] = []
    pack = Offloader._pack

    def spy(self: Offloader, t: torch.Tensor) -> object:
        out = pack(self, t)
        seen.append((t.untyped_storage()._cdata, out))
        return out

    monkeypatch.setattr(Offloader, "_pack", spy)
    autoremat.apply(model, plan)
    try:
        model(x).sum().backward()
        stats = offloader_of(model).stats
        keys = [key for key, _ in seen]
        relu_saves = [out for key, out in seen if keys.count(key) == 2]
        assert len(relu_saves) == 2 and not any(isinstance(o, torch.Tensor) for o in relu_saves)
        assert stats.packed_nodes == [relu] and stats.saves == 2  # both saves on the host path
    finally:
        autoremat.restore(model)


def _grads(model: torch.nn.Module, args: tuple) -> dict:
    with deterministic_kernels():
        torch.manual_seed(0)
        run_step(model, args)
    return gradients(model)


def _patched_run(model: torch.nn.Module, args: tuple, plan: Plan) -> tuple[dict, object, int]:
    """``model`` patched with ``plan`` (restored after): its gradients, the offloader's stats and
    its measured step peak."""
    autoremat.apply(model, plan)
    try:
        got = _grads(model, args)
        stats = offloader_of(model).stats
        return got, stats, measure(model, args).peak_bytes
    finally:
        autoremat.restore(model)


@pytest.mark.gpu
def test_real_transfers_on_cuda() -> None:
    model, args = autoremat.zoo.build("resnet50", size="small", batch_size=64, device="cuda")
    g = autoremat.capture(model, args)
    base = no_recompute_plan(g)
    order = offload_candidates(g)
    plan = autoremat.solvers.finalize_plan(g, Plan(list(base.segments), offload=tuple(order[: len(order) // 2])),
                                           10**15, "manual")
    reference = copy.deepcopy(model)
    ref = _grads(reference, args)
    before = measure(model, args).peak_bytes
    got, stats, after = _patched_run(model, args, plan)
    assert gradients_equal(ref, got)
    assert sorted(stats.packed_nodes) == order[: len(order) // 2] and stats.prefetched_ahead > 0
    assert after < before


@pytest.mark.gpu
@pytest.mark.parametrize("solver", ["offload-greedy", "offload-dp"])
def test_solver_plans_on_cuda_lower_the_measured_peak(solver: str) -> None:
    """A plan solved with the measured bandwidth at a budget that offloading must meet: exact
    gradients, real transfers, and a lower measured CUDA step peak than the unpatched model."""
    model, args = autoremat.zoo.build("resnet50", size="small", batch_size=64, device="cuda")
    g = autoremat.capture(model, args)
    g.meta["bandwidth_bytes_per_s"] = measure_bandwidth()
    peak = unoptimised_peak_bytes(g)
    with pytest.raises(autoremat.InfeasibleBudgetError) as err:
        autoremat.solve(g, 0, solver="offload-dp")
    least = err.value.min_budget_bytes
    assert least < peak, "offloading cannot lower the predicted peak on this GPU at the measured bandwidth"
    budget = (least + peak) // 2
    plan = autoremat.solve(g, budget, solver=solver)
    assert plan.offload and plan.predicted_peak_bytes <= budget
    reference = copy.deepcopy(model)
    ref = _grads(reference, args)
    before = measure(reference, args).peak_bytes
    got, stats, after = _patched_run(model, args, plan)
    assert sorted(stats.packed_nodes) == list(plan.offload)
    assert gradients_equal(ref, got)
    assert after < before, (f"measured peak {after} not below the unpatched {before} "
                            f"(predicted {plan.predicted_peak_bytes}, budget {budget})")


# ---------------------------------------------------------------------- benchmarks/compare_gpu.py, CPU side
def _compare_gpu(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    import importlib
    import sys
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    for mod in [m for m in sys.modules if m.split(".")[0] in ("compare", "compare_gpu")]:
        sys.modules.pop(mod)  # submodules too: a stale compare.solving is not bound to a new compare
    return importlib.import_module("compare_gpu")


def test_compare_gpu_plans_offloads_at_the_measured_bandwidth(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = _compare_gpu(monkeypatch)
    assert "--offload-only" in gpu.parser().format_help()  # help strings format (a bare % would not)
    model, args = autoremat.zoo.build("transformer", device="meta")
    g = autoremat.capture(model, args)
    for v in g.nodes:  # a slower device: copies hide behind compute (see _meta_resnet)
        g.node(v)["time_s"] *= 100
        g.node(v)["bwd_time_s"] *= 100
    budget = int(0.9 * unoptimised_peak_bytes(g))
    original = gpu.compare.solving.solve_limited
    with gpu.planned_with_bandwidth(7.5e9):
        status, plan, _ = gpu.compare.solving.solve_limited(g, budget, "offload-greedy", None)
    assert gpu.compare.solving.solve_limited is original
    assert status == "ok" and plan.offload
    assert g.meta["bandwidth_bytes_per_s"] == 7.5e9 == plan.bandwidth_bytes_per_s
    assert plan.predicted_peak_bytes == simulate(g, plan, bandwidth_bytes_per_s=7.5e9).peak_bytes <= budget


@pytest.mark.slow  # ~70 s: the offload comparison end to end; its planning seam has a fast test above
def test_compare_gpu_offload_section_runs_on_cpu(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """The offload comparison end to end on a CPU (mlp, one round): rows gathered, files written."""
    pytest.importorskip("matplotlib")
    import json

    from autoremat.offload.bandwidth import measure_link

    gpu = _compare_gpu(monkeypatch)
    opts = gpu.compare.Options(rounds=1, steps_per_round=1, autoremat_budgets=(0.5,),
                               solvers=("offload-dp", "combined", "dp-approx"), configs=("pytorch", "autoremat"),
                               solver_timeout_s=None, batch={"mlp": 512}, device="cpu")
    link = measure_link("cpu")
    result = gpu.run(["mlp"], opts, tmp_path, link, batch=False, quick=True, log=lambda s: None)
    data = json.loads((tmp_path / "offload.json").read_text())
    assert data == json.loads(json.dumps(gpu.compare.driver._finite(result["offload"])))
    assert data["bandwidth"]["bytes_per_s"] == 12e9 and data["bandwidth"]["measured"] is False
    rows = {r["config"]: r for r in data["models"]["mlp"]}
    assert list(rows) == [key for key, _ in gpu.offload_configs()]
    for r in rows.values():
        assert set(gpu.OFFLOAD_FIELDS) <= set(r)
    budget = rows["none"]["budget_bytes"]
    assert budget == int(0.5 * rows["none"]["measured_peak_bytes"])
    assert rows["save-on-cpu"]["status"] == "ok" and rows["save-on-cpu"]["gradients_equal"] is True
    assert rows["save-on-cpu"]["meets_budget"] is (rows["save-on-cpu"]["measured_peak_bytes"] <= budget)
    dp = rows["autoremat:dp-approx@0.5"]
    assert dp["status"] == "ok" and dp["gradients_equal"] is True and dp["meets_budget"] is not None
    off = rows["autoremat:offload-dp@0.5"]  # a CPU capture: offloading cannot lower the peak, said so
    assert off["status"] == "infeasible" and off["min_budget_bytes"] > budget
    assert rows["autoremat:vdnn@0.5"]["status"] == "not_run"
    md = (tmp_path / "OFFLOAD.md").read_text()
    assert "## mlp" in md and "save-on-cpu" in md and "not measured, no CUDA" in md and "12.00 GB/s" in md
    assert (tmp_path / "compare.json").exists() and (tmp_path / "RESULTS.md").exists()


def test_a_new_storage_at_a_released_storages_key_gets_its_own_handle() -> None:
    """On CUDA the offloader releases a storage once its host copy is done, and the allocator may
    give its key (the storage's address) to a new storage saved later in the step; that save must
    not be answered with the old storage's host copy (it was: wrong gradients on an H200). On the
    CPU storages are never released, so the reuse is made by hand here."""
    from autoremat.runtime.offload import Offloader

    off = Offloader()
    off.begin_step()
    a, b = torch.arange(4.0), torch.arange(4.0) + 10
    packed_a = off._offload(a, 12345, node=1)
    packed_b = off._offload(b, 12345, node=2)  # same key, another storage
    assert off.stats.packed_nodes == [1, 2]
    assert torch.equal(off._unpack(packed_a), a) and torch.equal(off._unpack(packed_b), b)


def test_a_wait_releases_every_copy_issued_up_to_it_in_the_gpus_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan's wait before a node (CUDA path, with a fake stream): the compute stream waits for
    the named copy, and the device copies of it and of every copy issued before it (one copy
    stream, in issue order) are dropped at once; later copies, and a storage already fetched back,
    stay. A wait is where the simulator releases them, not when the CPU sees them complete."""
    from autoremat.runtime.offload import _Handle

    waited: list[object] = []

    class FakeStream:
        def wait_event(self, event: object) -> None:
            waited.append(event)

    class Pending:  # a copy the CPU has not seen complete (the GPU is behind)
        def __init__(self, name: str) -> None:
            self.name = name

        def query(self) -> bool:
            return False

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())
    off = Offloader(order=(), waits={7: 2})
    handles = []
    for node in (0, 1, 2, 3):
        t = torch.zeros(4)
        h = _Handle(node, 16, torch.device("cuda"), t.untyped_storage())
        h.copy_done, h.device_ref = Pending(f"done{node}"), t
        handles.append(h)
    off._all.extend(handles)
    off._by_node.update({h.node: h for h in handles})
    handles[0].fetched = handles[0].device_ref  # fetched back already: its device copy serves backward
    off.wait(7)
    assert [e.name for e in waited] == ["done2"] and off.stats.waits == [(7, 2)]
    assert handles[0].device_ref is not None  # fetched: kept
    assert handles[1].device_ref is None        # issued before the awaited copy: done too
    assert handles[2].device_ref is None        # the awaited copy
    assert handles[3].device_ref is not None    # issued after it: not known to be done
