"""Hugging Face architectures beyond the zoo, as a user would train them: does autoremat work, and
does it predict the step peak (issue 24's "within 10 % on every HF architecture")?

    python benchmarks/hf_breadth.py [--names qwen2 bloom ...] [--precision fp32 bf16] [--out DIR]

For each architecture of :data:`autoremat.zoo.hf_breadth.CASES` (default configs: the causal LMs
keep ``use_cache=True``) and each precision (``fp32``; ``bf16``: forward and loss under CPU
autocast, backward outside it, as Lightning and Accelerate run a step): capture, the unpatched
step's measured peak (CPU storage counter) against the prediction, the least plan (``solve(g,
"min")``) applied, its measured peak against its prediction, and whether its gradients equal the
unpatched model's bit for bit. Writes ``hf_breadth.json`` and ``hf_breadth.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

import autoremat
from autoremat.cost import no_recompute_plan, simulate
from autoremat.measure import LiveStorageCounter, gradients, gradients_equal
from autoremat.zoo.hf_breadth import CASES, build


def _step(model: torch.nn.Module, args: tuple, kwargs: dict, loss: Any, bf16: bool) -> tuple[int, dict]:
    model.zero_grad(set_to_none=True)
    counter = LiveStorageCounter()
    torch.manual_seed(11)
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    with counter:
        with amp:
            value = loss(model(*args, **kwargs))
        value.backward()
    grads = gradients(model)
    model.zero_grad(set_to_none=True)
    return counter.peak, grads


def run(name: str, precision: str) -> dict[str, Any]:
    """One architecture at one precision (module docstring); errors are recorded, not raised."""
    bf16 = precision == "bf16"
    row: dict[str, Any] = {"name": name, "precision": precision}
    try:
        model, args, kwargs, loss = build(name)
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
            graph = autoremat.capture(model, args, kwargs, loss_fn=loss, repeats=1, warmup=0)
        plan = autoremat.solve(graph, "min")
        row["capture_solve_s"] = round(time.perf_counter() - t0, 2)
        vanilla, reference = _step(model, args, kwargs, loss, bf16)
        predicted = simulate(graph, no_recompute_plan(graph)).peak_bytes
        autoremat.apply(model, plan)
        try:
            peak, grads = _step(model, args, kwargs, loss, bf16)
        finally:
            autoremat.restore(model)
        row.update(nodes=len(graph), vanilla_bytes=vanilla, vanilla_pred_over_meas=round(predicted / vanilla, 3),
                   least_over_vanilla=round(peak / vanilla, 3),
                   least_pred_over_meas=round(plan.predicted_peak_bytes / peak, 3),
                   recomputed=len(plan.recompute_segments), gradients_equal=gradients_equal(reference, grads),
                   kept_for_cache=len(graph.meta.get("pinned_by_cache", {})))
    except Exception as err:  # a broken architecture is a result here
        row["error"] = f"{type(err).__name__}: {str(err)[:200]}"
    return row


def report(rows: list[dict[str, Any]], machine: str) -> str:
    lines = ["# Hugging Face architectures beyond the zoo", "", f"Machine: {machine}.",
             "Peaks: CPU storage counter, one step; bf16: forward and loss under CPU autocast, backward outside. "
             "`pred/meas`: predicted over measured step peak (within 10 %: 0.90-1.10).", "",
             "| architecture | precision | nodes | kept (KV cache) | unpatched pred/meas | least plan peak "
             "| least pred/meas | gradients equal | capture + solve |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | {r['precision']} | error: {r['error']} | | | | | | |")
            continue
        lines.append(f"| {r['name']} | {r['precision']} | {r['nodes']} | {r['kept_for_cache']} "
                     f"| {r['vanilla_pred_over_meas']:.3f} | {r['least_over_vanilla']:.2f}x "
                     f"| {r['least_pred_over_meas']:.3f} | {'yes' if r['gradients_equal'] else 'NO'} "
                     f"| {r['capture_solve_s']:.1f} s |")
    ok = [r for r in rows if "error" not in r]
    within = sum(0.9 <= r["vanilla_pred_over_meas"] <= 1.1 and 0.9 <= r["least_pred_over_meas"] <= 1.1 for r in ok)
    lines += ["", f"Within 10 % (unpatched and least plan): {within} of {len(rows)} runs; gradients equal: "
              f"{sum(r['gradients_equal'] for r in ok)} of {len(rows)}; errors: {len(rows) - len(ok)}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--names", nargs="*", default=sorted(CASES))
    p.add_argument("--precision", nargs="*", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "cpu" / "hf_breadth")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    machine = (f"{platform.machine()}, {os.cpu_count()} cores (1 intra-op thread), CPU only, torch {torch.__version__}, "
               f"load average {os.getloadavg()[0]:.1f} at the start")
    rows = []
    for name in a.names:
        for precision in a.precision:
            rows.append(run(name, precision))
            print(json.dumps(rows[-1]), flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "hf_breadth.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))
    (a.out / "hf_breadth.md").write_text(report(rows, machine))
    print(report(rows, machine))
    return 0


if __name__ == "__main__":
    sys.exit(main())
