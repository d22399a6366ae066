"""Simulator vs measurement on the zoo's CPU-sized models (and a transformers GPT-2).

For each model: capture, then for each budget (no recomputation, 75 %, 50 % of the unoptimised
step peak) solve with ``chen``, apply, and measure the real step peak (live-storage counter)
and median step time; compare with the simulator's prediction and check gradients.

    python benchmarks/simulator_accuracy.py [--models resnet50,unet] [--out benchmarks/results/cpu]

Writes ``simulator_accuracy.json`` and ``simulator_accuracy.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

import autoremat
from autoremat.measure import gradients, gradients_equal, measure, run_step
from autoremat.cost import no_recompute_plan, simulate


def _gpt2():  # type: ignore[no-untyped-def]
    from autoremat.zoo import hf

    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(1))
    return hf.gpt2(), (ids,), hf.logits_mean


def _grads(model, args, loss_fn):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    run_step(model, args, loss_fn=loss_fn)
    return gradients(model)


def run(models: list[str], steps: int) -> list[dict]:
    rows: list[dict] = []
    for name in models:
        if name == "gpt2":
            model, args, loss_fn = _gpt2()
        else:
            model, args = autoremat.zoo.build(name, size="small")
            loss_fn = None
        t0 = time.perf_counter()
        graph = autoremat.capture(model, args, loss_fn=loss_fn)
        capture_s = time.perf_counter() - t0
        ref = _grads(model, args, loss_fn)
        base = None
        for budget in ("none", "75%", "50%"):
            t0 = time.perf_counter()
            try:
                plan = no_recompute_plan(graph) if budget == "none" else autoremat.solve(graph, budget, solver="chen")
            except autoremat.InfeasibleBudgetError as err:
                rows.append({"model": name, "budget": budget, "infeasible": True,
                             "min_budget_bytes": err.min_budget_bytes})
                continue
            solve_s = time.perf_counter() - t0
            pred = simulate(graph, plan).peak_bytes
            if budget != "none":
                autoremat.apply(model, plan)
            try:
                m = measure(model, args, loss_fn=loss_fn, steps=steps)
                same = gradients_equal(ref, _grads(model, args, loss_fn))
            finally:
                autoremat.restore(model)
            base = base or m
            rows.append({
                "model": name, "mode": graph.meta["mode"], "nodes": len(graph), "budget": budget,
                "segments": len(plan.segments), "recomputed": len(plan.recompute_segments),
                "predicted_peak_bytes": pred, "measured_peak_bytes": m.peak_bytes,
                "error": pred / m.peak_bytes - 1.0, "peak_ratio": m.peak_bytes / base.peak_bytes,
                "step_time_s": m.step_time_s, "time_ratio": m.step_time_s / base.step_time_s,
                "gradients_equal": same, "capture_s": capture_s, "solve_s": solve_s,
            })
    return rows


def to_markdown(rows: list[dict], machine: str) -> str:
    lines = [f"# Simulator vs measured step peak ({machine})", "",
             "CPU-sized zoo models, `chen` solver; peak from the live-storage counter, time = median step.", "",
             "| model | budget | segments (recomputed) | predicted | measured | error | peak vs none | time vs none | grads equal |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("infeasible"):
            lines.append(f"| {r['model']} | {r['budget']} | infeasible (min {r['min_budget_bytes'] / 2**20:.2f} MiB) |"
                         " | | | | | |")
            continue
        lines.append(
            f"| {r['model']} | {r['budget']} | {r['segments']} ({r['recomputed']}) | "
            f"{r['predicted_peak_bytes'] / 2**20:.2f} MiB | {r['measured_peak_bytes'] / 2**20:.2f} MiB | "
            f"{r['error']:+.1%} | {r['peak_ratio']:.0%} | {r['time_ratio']:.2f}x | {r['gradients_equal']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--models", default=",".join([*autoremat.zoo.names(), "gpt2"]))
    p.add_argument("--out", default="benchmarks/results/cpu")
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = run(a.models.split(","), a.steps)
    machine = f"{platform.machine()} CPU, {os.cpu_count()} cores, torch {torch.__version__}"
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "simulator_accuracy.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))
    (out / "simulator_accuracy.md").write_text(to_markdown(rows, machine))
    print(to_markdown(rows, machine))


if __name__ == "__main__":
    main()
