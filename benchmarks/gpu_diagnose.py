"""Why a CUDA step peak differs from the prediction: allocator snapshots of the cases the GPU tests
flagged (run on a GPU; results for the lead to read off-line).

    PYTHONPATH=src python3 benchmarks/gpu_diagnose.py --out /tmp/diag

For each case: the graph is captured on CUDA, a plan solved, and one step measured three ways:
the caching allocator's peak (``max_memory_allocated``, what ``measure`` reports), the allocator's
reserved peak (what ``set_per_process_memory_fraction`` caps), and the live-storage counter (the
bytes the capture and the simulator count, without the allocator's rounding or library
workspaces). A memory-history snapshot of the patched step (python stacks) is written beside the
summary, so the live blocks at the peak can be attributed to ops.
"""

from __future__ import annotations

import argparse
import json
import pickle
from pathlib import Path

import torch

import autoremat
from autoremat.cost import no_recompute_plan, simulate
from autoremat.measure import LiveStorageCounter, measure, run_step


CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"  # the CPU path only checks that the script runs


def _ctx(autocast: bool):  # type: ignore[no-untyped-def]
    return torch.autocast(DEV, dtype=torch.float16 if CUDA else torch.bfloat16, enabled=autocast)


def _three_ways(model, args, *, autocast: bool = False) -> dict:
    if not CUDA:
        return {}
    with _ctx(autocast):
        run_step(model, args)  # warm-up
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base_alloc, base_res = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        run_step(model, args)
        torch.cuda.synchronize()
        alloc = torch.cuda.max_memory_allocated() - base_alloc
        reserved = torch.cuda.max_memory_reserved() - base_res
        model.zero_grad(set_to_none=True)
        counter = LiveStorageCounter()
        with counter:
            run_step(model, args)
        model.zero_grad(set_to_none=True)
    return {"allocator_peak": alloc, "reserved_peak": reserved, "counter_peak": counter.peak,
            "base_allocated": base_alloc, "base_reserved": base_res}


def _snapshot(model, args, path: Path, *, autocast: bool = False) -> None:
    if not CUDA:
        return
    with _ctx(autocast):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.memory._record_memory_history(max_entries=60000, stacks="python")
        run_step(model, args)
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        model.zero_grad(set_to_none=True)
    with open(path, "wb") as f:
        pickle.dump(snap, f)


def case(name: str, batch: int, solver: str, budget: str, out: Path, *, autocast: bool = False) -> dict:
    torch.manual_seed(0)
    model, args = autoremat.zoo.build(name, size="small", batch_size=batch, device=DEV)
    with _ctx(autocast):
        g = autoremat.capture(model, args)
    vanilla_sim = simulate(g, no_recompute_plan(g))
    row = {"case": f"{name} b{batch} {solver}@{budget}{' autocast' if autocast else ''}", "nodes": len(g),
           "predicted_vanilla": vanilla_sim.peak_bytes, "vanilla_peak_at": vanilla_sim.peak_at,
           "vanilla": _three_ways(model, args, autocast=autocast)}
    try:
        plan = autoremat.solve(g, budget, solver=solver)
    except autoremat.InfeasibleBudgetError as err:
        plan = autoremat.solve(g, err.min_budget_bytes, solver=solver)
    sim = simulate(g, plan)
    row.update(plan=plan.describe(), predicted_plan=sim.peak_bytes, plan_peak_at=sim.peak_at,
               segments=[list(s.nodes) for s in plan.segments if s.recompute])
    autoremat.apply(model, plan)
    try:
        row["plan_measured"] = _three_ways(model, args, autocast=autocast)
        _snapshot(model, args, out / f"snap_{name}{'_amp' if autocast else ''}.pickle", autocast=autocast)
    finally:
        autoremat.restore(model)
    row["timeline_top"] = sorted(sim.timeline, key=lambda e: -e[2])[:5]
    row["node_names"] = {v: g.node(v)["name"] for v in g.nodes}
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="/tmp/diag")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for args in (("unet", 32, "dp-approx", "50%", False), ("resnet50", 4, "auto", "60%", True),
                 ("resnet50", 64, "auto", "50%", False)):
        try:
            rows.append(case(*args[:4], out, autocast=args[4]))
        except Exception as err:  # noqa: BLE001 - a diagnosis run records what failed and goes on
            rows.append({"case": repr(args), "error": f"{type(err).__name__}: {err}"})
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "node_names"}, default=str)[:1500], flush=True)
    (out / "diagnose.json").write_text(json.dumps(rows, indent=1, default=str))


if __name__ == "__main__":
    main()
