"""Offloading module calls' own saved tensors (issue 22, ``Plan.offload_saved``): what the solvers
reach with them, against the estimate and against the plans without them; and a Hugging Face GPT-2
run end to end on the CPU.

    python benchmarks/offload_saved.py [--graphs gpt2,densenet121,unet,resnet50] [--fractions 0.8,0.7,0.6,0.5]
        [--bandwidths 53.99e9,12e9] [--hf] [--out benchmarks/results/cpu/offload_dag]

* **Graphs** captured on an H200 (``benchmarks/results/nvidia-h200/offload_gpu/graph_<net>.json``):
  for each, the nodes whose own saved tensors a plan may offload (module calls that keep tensors
  of their own; none in an op-level fx capture); where there are some, ``offload-dag`` (offload
  alone) and ``combined`` (with recomputation) at each fraction of the unpatched peak and each link,
  with ``saved_units`` on (default) and off: predicted peak and step time as ratios of the
  unpatched step's, what is offloaded, solve time (wall clock, one run). Every number but the
  solve time is the simulator's deterministic prediction.
* **--hf**: a transformers GPT-2 small config (``autoremat.zoo.hf.gpt2``, 4 blocks, 64 wide,
  batch 4 x 64) on this CPU, captured at module level (one node per block), planned by
  ``offload-dag`` at 60 % of the unpatched peak (``offload=True``: a CPU capture does not offload
  by default), applied, trained 2 steps (SGD) beside an unpatched copy with the same seeds:
  gradients ``torch.equal`` at each step; the step peak the storage counter measures with the
  CPU's host tier (copies that complete at once) against the simulator's prediction at an
  unbounded link; the bytes of each unit against what ``save_on_cpu`` would also copy
  (parameters, inputs, outputs: ``OffloadStats.unit_left_bytes``).

Writes ``offload_saved.json`` and ``offload_saved.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import autoremat
from autoremat.cost import no_recompute_plan, simulate
from autoremat.plan import saved_unit_nodes

HERE = Path(__file__).resolve().parent
GRAPHS = HERE / "results" / "nvidia-h200" / "offload_gpu"
ESTIMATE = {0.8: (0.800, 1.000), 0.7: (0.670, 1.169), 0.6: (0.599, 1.235), 0.5: (0.498, 1.493)}
"""``block_internals_estimate.py`` at 53.99 GB/s (ANALYSIS.md section 6): fraction -> (peak, time)."""


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores, CPU only, load {os.getloadavg()[0]:.1f}"


def solve_row(g: autoremat.Graph, solver: str, frac: float, bw: float, units: bool) -> dict[str, Any]:
    base = simulate(g, no_recompute_plan(g), bandwidth_bytes_per_s=bw)
    row: dict[str, Any] = {"solver": solver, "fraction": frac, "bandwidth": bw, "saved_units": units}
    t0 = time.perf_counter()
    try:
        plan = autoremat.solve(g, int(frac * base.peak_bytes), solver=solver, bandwidth_bytes_per_s=bw,
                               saved_units=units)
        sim = simulate(g, plan, bandwidth_bytes_per_s=bw)
        row.update(peak_ratio=sim.peak_bytes / base.peak_bytes, time_ratio=sim.step_time_s / base.step_time_s,
                   offloaded=len(plan.offload), units=len(plan.offload_saved), recomputed=len(plan.recompute_segments),
                   depth=plan.offload_prefetch_depth, offloaded_gb=sim.offloaded_bytes / 1e9)
    except autoremat.InfeasibleBudgetError as err:
        row["least_ratio"] = None if err.min_budget_bytes is None else err.min_budget_bytes / base.peak_bytes
    row["solve_s"] = time.perf_counter() - t0
    print(row, flush=True)
    return row


def least_row(g: autoremat.Graph, solver: str, units: bool) -> dict[str, Any]:
    """The least budget ``solver`` meets (``min_budget``, at the graph's link) and its plan there."""
    base = simulate(g, no_recompute_plan(g))
    t0 = time.perf_counter()
    config = {"saved_units": units} if solver != "dp-approx" else {}
    least = autoremat.min_budget(g, solver, config=config)
    plan = autoremat.solve(g, least, solver=solver, **config)
    sim = simulate(g, plan)
    row = {"solver": solver, "saved_units": units, "least_ratio": least / base.peak_bytes,
           "time_ratio": sim.step_time_s / base.step_time_s, "offloaded": len(plan.offload),
           "units": len(plan.offload_saved), "recomputed": len(plan.recompute_segments),
           "solve_s": time.perf_counter() - t0}
    print(row, flush=True)
    return row


def graphs(nets: list[str], fractions: list[float], bandwidths: list[float]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for net in nets:
        g = autoremat.Graph.from_json(str(GRAPHS / f"graph_{net}.json"))
        cands = sorted(saved_unit_nodes(g, no_recompute_plan(g)))
        peak = simulate(g, no_recompute_plan(g)).peak_bytes
        info: dict[str, Any] = {"mode": g.meta.get("mode"), "nodes": len(g), "candidates": len(cands),
                                "candidate_bytes": sum(g.node(v)["extra_saved_bytes"] for v in cands),
                                "peak_bytes": peak, "rows": []}
        print(net, {k: v for k, v in info.items() if k != "rows"}, flush=True)
        if cands:
            info["least"] = [least_row(g, solver, units) for solver in ("offload-dag", "combined", "dp-approx")
                             for units in ((True, False) if solver != "dp-approx" else (False,))]
            for bw in bandwidths:
                for solver in ("offload-dag", "combined"):
                    for frac in fractions:
                        for units in (True, False):
                            info["rows"].append(solve_row(g, solver, frac, bw, units))
        out[net] = info
    return out


def hf_end_to_end(steps: int = 2, fraction: float = 0.6) -> dict[str, Any]:
    """See the module docstring (``--hf``)."""
    import torch

    from autoremat.measure import LiveStorageCounter, gradients, gradients_equal, run_step
    from autoremat.runtime import offloader_of
    from autoremat.zoo import hf

    model = hf.gpt2(n_layer=4, n_embd=64, n_head=4, vocab_size=256, seq=64)
    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0))
    t0 = time.perf_counter()
    g = autoremat.capture(model, (ids,), loss_fn=hf.logits_mean, blocks="module")
    capture_s = time.perf_counter() - t0
    unpatched = simulate(g, no_recompute_plan(g)).peak_bytes
    plan = autoremat.solve(g, int(fraction * unpatched), solver="offload-dag", offload=True)
    reference = copy.deepcopy(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in (reference, model)]
    autoremat.apply(model, plan)
    equal, measured, stats = [], [], None
    try:
        offloader_of(model).host_tier = True
        for step in range(steps):
            for m, opt in zip((reference, model), opts):
                opt.zero_grad(set_to_none=True)
                counter = LiveStorageCounter()
                torch.manual_seed(step)
                with counter:
                    run_step(m, (ids,), loss_fn=hf.logits_mean)
                if m is model:
                    measured.append(counter.peak)
            equal.append(gradients_equal(gradients(reference), gradients(model)))
            stats = offloader_of(model).stats
            for opt in opts:
                opt.step()
    finally:
        autoremat.restore(model)
    assert stats is not None
    predicted = simulate(g, plan, bandwidth_bytes_per_s=1e18).peak_bytes
    times = step_times(model, reference, plan, (ids,), hf.logits_mean)
    row = {"model": "GPT2LMHeadModel n_layer=4 n_embd=64 n_head=4 vocab=256, batch 4 x 64", "nodes": len(g),
           "capture_s": capture_s, "unpatched_peak_bytes": unpatched, "budget_fraction": fraction,
           "plan": plan.describe(), "units": list(plan.offload_saved), "offload": list(plan.offload),
           "predicted_peak_bytes_at_link": plan.predicted_peak_bytes, "predicted_peak_bytes_unbounded": predicted,
           "measured_peak_bytes": measured, "gradients_equal": equal,
           "unit_bytes": {str(k): v for k, v in stats.unit_bytes.items()},
           "unit_left_bytes": {str(k): v for k, v in stats.unit_left_bytes.items()},
           "extra_saved_bytes": {str(v): g.node(v)["extra_saved_bytes"] for v in plan.offload_saved}, **times}
    print(row, flush=True)
    return row


def step_times(model: Any, reference: Any, plan: Any, args: tuple, loss_fn: Any, rounds: int = 7) -> dict[str, Any]:
    """Median wall-clock step of the unpatched copy and of the patched model (CPU bookkeeping: the
    hooks' Python work, no copies), interleaved in one process."""
    import statistics

    from autoremat.measure import run_step

    autoremat.apply(model, plan)
    out: dict[str, list[float]] = {"unpatched": [], "patched": []}
    try:
        for r in range(rounds):
            for name, m in (("unpatched", reference), ("patched", model))[:: 1 if r % 2 else -1]:
                t0 = time.perf_counter()
                run_step(m, args, loss_fn=loss_fn)
                out[name].append(time.perf_counter() - t0)
                m.zero_grad(set_to_none=True)
    finally:
        autoremat.restore(model)
    med = {k: statistics.median(v[1:]) for k, v in out.items()}
    return {"step_s_unpatched": med["unpatched"], "step_s_patched": med["patched"],
            "step_ratio": med["patched"] / med["unpatched"]}


def markdown(result: dict[str, Any]) -> str:
    lines = [f"# Nodes' own saved tensors offloaded (`Plan.offload_saved`)\n", f"Machine: {result['machine']}; "
             f"commit {result.get('commit', '?')}. Peaks and times: the simulator's predictions, as ratios of the "
             "unpatched step's; solve: wall clock, one run.\n"]
    for net, info in result.get("graphs", {}).items():
        lines.append(f"## {net} ({info['mode']} capture, {info['nodes']} nodes): {info['candidates']} candidate nodes, "
                     f"{info['candidate_bytes'] / 1e9:.2f} GB of own saved tensors, peak {info['peak_bytes'] / 1e9:.2f} GB\n")
        if not info["rows"]:
            continue
        if info.get("least"):
            lines += [f"Least budgets at the graph's link ({'min_budget'}):\n", "| solver | saved_units | least | time there | "
                      "offl./units/recomp. |", "|---|---|---|---|---|"]
            lines += [f"| {r['solver']} | {r['saved_units']} | {r['least_ratio']:.4f}x | {r['time_ratio']:.3f}x | "
                      f"{r['offloaded']}/{r['units']}/{r['recomputed']} |" for r in info["least"]]
            lines.append("")
        lines += ["| link GB/s | solver | budget | units on: peak | time | offl./units/recomp. | units off: peak | "
                  "time | estimate (53.99) |", "|---|---|---|---|---|---|---|---|---|"]
        rows = info["rows"]
        for on, off in zip(rows[::2], rows[1::2]):
            def pt(r: dict[str, Any]) -> tuple[str, str]:
                if "peak_ratio" in r:
                    return f"{r['peak_ratio']:.3f}x", f"{r['time_ratio']:.3f}x"
                least = r.get("least_ratio")
                return ("infeasible" + (f" (least {least:.3f}x)" if least else "")), "-"
            est = ESTIMATE.get(on["fraction"]) if net == "gpt2" and on["solver"] == "offload-dag" and \
                abs(on["bandwidth"] - 53.99e9) < 1e8 else None
            what = f"{on.get('offloaded', '-')}/{on.get('units', '-')}/{on.get('recomputed', '-')}"
            lines.append(f"| {on['bandwidth'] / 1e9:.2f} | {on['solver']} | {on['fraction']} | {pt(on)[0]} | "
                         f"{pt(on)[1]} | {what} | {pt(off)[0]} | {pt(off)[1]} | "
                         f"{'' if est is None else f'{est[0]:.3f}x at {est[1]:.3f}x'} |")
        lines.append("")
    hf_row = result.get("hf")
    if hf_row:
        lines += ["## Hugging Face GPT-2 on this CPU, end to end\n", f"{hf_row['model']}, {hf_row['nodes']} nodes "
                  f"(capture {hf_row['capture_s']:.1f} s); plan: {hf_row['plan']}.",
                  f"Gradients equal at each step: {hf_row['gradients_equal']}. Step peak measured with the host tier: "
                  f"{hf_row['measured_peak_bytes']} B; predicted at an unbounded link: "
                  f"{hf_row['predicted_peak_bytes_unbounded']} B (at the planning link, 12 GB/s: "
                  f"{hf_row['predicted_peak_bytes_at_link']} B); unpatched: {hf_row['unpatched_peak_bytes']} B.",
                  f"CPU step (bookkeeping, no copies; median of 6 interleaved): {hf_row['step_s_unpatched'] * 1e3:.1f} ms "
                  f"unpatched, {hf_row['step_s_patched'] * 1e3:.1f} ms patched ({hf_row['step_ratio']:.2f}x).",
                  f"Unit bytes (node: copied / left on the device, what save_on_cpu would copy too): "
                  + ", ".join(f"{k}: {v} / {hf_row['unit_left_bytes'].get(k, 0)}" for k, v in hf_row["unit_bytes"].items()),
                  ""]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--graphs", default="gpt2,densenet121,unet,resnet50")
    ap.add_argument("--fractions", default="0.8,0.7,0.6,0.5")
    ap.add_argument("--bandwidths", default="53.99e9,12e9")
    ap.add_argument("--hf", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    result: dict[str, Any] = {"machine": machine()}
    try:
        import subprocess

        result["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                          cwd=HERE).stdout.strip()
    except OSError:
        pass
    nets = [n for n in a.graphs.split(",") if n]
    result["graphs"] = graphs(nets, [float(f) for f in a.fractions.split(",")], [float(b) for b in a.bandwidths.split(",")])
    if a.hf:
        result["hf"] = hf_end_to_end()
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "offload_saved.json").write_text(json.dumps(result, indent=1, default=str))
        (out / "offload_saved.md").write_text(markdown(result))
    return result


if __name__ == "__main__":
    main()
