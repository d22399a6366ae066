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

* **--meta**: a transformers GPT-2 at the H200 graph's sizes (12 layers, 768 wide, vocabulary
  50,257, batch 8 x 1,024, fp32) captured on the meta device twice: with the default
  ``blocks="auto"`` (each block op by op: a block is offloaded as its call region,
  :mod:`autoremat.region_units`) and with ``blocks="module"`` (one node per block). Bytes are the
  meta capture's (a 4-D float attention mask, as ``solver_speed.py``: transformers' 2-D mask code
  calls ``.item()``; the math attention then saves its probabilities, so a block keeps 1.94 GB
  where the H200's memory-efficient kernel kept 0.69 GB); times are the H200's measured ones
  (``graph_gpt2.json``: each module call's by name, a block region's spread over its ops in
  proportion to their FLOP times; glue 0), so the two captures differ only in granularity.
  ``offload-dag`` with units on and off at each fraction at 53.99 GB/s (``combined`` on the
  module-level capture: it refuses op-by-op captures of 400+ nodes), and least budgets.

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
from autoremat.plan_offload import unit_bytes

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


def meta_gpt2(blocks: str) -> autoremat.Graph:
    """See the module docstring (``--meta``): the capture, with the H200's measured times."""
    import torch
    import transformers

    from autoremat.region_units import region_units
    from autoremat.zoo import hf

    cfg = transformers.GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024,
                                  use_cache=False, bos_token_id=0, eos_token_id=0)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(cfg).train()
    ids = torch.zeros(8, 1024, dtype=torch.long, device="meta")
    mask = torch.zeros(8, 1, 1024, 1024, device="meta")
    g = autoremat.capture(model, (ids,), {"attention_mask": mask}, loss_fn=hf.logits_mean, blocks=blocks)
    ref = autoremat.Graph.from_json(str(GRAPHS / "graph_gpt2.json"))
    measured = {ref.node(v)["name"]: ref.node(v) for v in ref.nodes if ref.node(v)["kind"] != "glue"}
    regions = {ru.nodes: ru.path for ru in region_units(g).values()}
    inside = {v for nodes in regions for v in nodes}
    for v in g.nodes:
        d = g.node(v)
        if v not in inside:
            m = measured.get(d["name"])
            d["time_s"], d["bwd_time_s"] = (m["time_s"], m["bwd_time_s"]) if m else (0.0, 0.0)
    for nodes, path in regions.items():
        for key in ("time_s", "bwd_time_s"):
            total = sum(g.node(v)[key] for v in nodes) or 1.0
            for v in nodes:
                g.node(v)[key] = g.node(v)[key] / total * measured[path][key]
    g.meta["bandwidth_bytes_per_s"] = 53.99e9
    g.meta["device"] = "meta"
    return g


def meta_rows(fractions: list[float]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for blocks in ("auto", "module"):
        g = meta_gpt2(blocks)
        base = simulate(g, no_recompute_plan(g))
        cands = sorted(saved_unit_nodes(g, no_recompute_plan(g)))
        info: dict[str, Any] = {"nodes": len(g), "peak_bytes": base.peak_bytes, "step_s": base.step_time_s,
                                "candidates": len(cands), "unit_gb": [round(unit_bytes(g, -1 - v) / 1e9, 3) for v in cands],
                                "rows": [], "least": []}
        print("meta", blocks, {k: v for k, v in info.items() if k not in ("rows", "least")}, flush=True)
        solvers = ("offload-dag", "combined") if blocks == "module" else ("offload-dag",)
        for solver in solvers:
            info["least"] += [least_row(g, solver, units) for units in (True, False)]
            for frac in fractions:
                for units in (True, False):
                    info["rows"].append(solve_row(g, solver, frac, 53.99e9, units))
        out[blocks] = info
    return out


def hf_end_to_end(steps: int = 2, fraction: float = 0.6, blocks: str = "module") -> dict[str, Any]:
    """See the module docstring (``--hf``); ``blocks="auto"``: the default capture (blocks op by op,
    each offloaded as its call region)."""
    import torch

    from autoremat.measure import LiveStorageCounter, gradients, gradients_equal, run_step
    from autoremat.runtime import offloader_of
    from autoremat.zoo import hf

    model = hf.gpt2(n_layer=4, n_embd=64, n_head=4, vocab_size=256, seq=64)
    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0))
    t0 = time.perf_counter()
    g = autoremat.capture(model, (ids,), loss_fn=hf.logits_mean, blocks=blocks)
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
    row = {"model": "GPT2LMHeadModel n_layer=4 n_embd=64 n_head=4 vocab=256, batch 4 x 64", "blocks": blocks, "nodes": len(g),
           "capture_s": capture_s, "unpatched_peak_bytes": unpatched, "budget_fraction": fraction,
           "plan": plan.describe(), "units": list(plan.offload_saved), "offload": list(plan.offload),
           "predicted_peak_bytes_at_link": plan.predicted_peak_bytes, "predicted_peak_bytes_unbounded": predicted,
           "measured_peak_bytes": measured, "gradients_equal": equal,
           "unit_bytes": {str(k): v for k, v in stats.unit_bytes.items()},
           "unit_left_bytes": {str(k): v for k, v in stats.unit_left_bytes.items()},
           "extra_saved_bytes": {str(v): unit_bytes(g, -1 - v) for v in plan.offload_saved}, **times}
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
    lines += meta_markdown(result.get("meta") or {})
    for hf_row in (result.get("hf"), result.get("hf_default_blocks")):
        if not hf_row:
            continue
        lines += [f"## Hugging Face GPT-2 on this CPU, end to end (capture blocks={hf_row.get('blocks', 'module')!r})\n",
                  f"{hf_row['model']}, {hf_row['nodes']} nodes "
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


def meta_markdown(meta: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    for blocks, info in meta.items():
        lines += [f"## GPT-2 at the H200's sizes on the meta device, blocks={blocks!r} ({info['nodes']} nodes), H200 times, "
                  f"53.99 GB/s\n", f"Unpatched: peak {info['peak_bytes'] / 1e9:.2f} GB, step {info['step_s'] * 1e3:.1f} ms; "
                  f"{info['candidates']} unit candidates (GB: {info['unit_gb']}).\n",
                  "| solver | saved_units | least | time there | offl./units/recomp. |", "|---|---|---|---|---|"]
        lines += [f"| {r['solver']} | {r['saved_units']} | {r['least_ratio']:.4f}x | {r['time_ratio']:.3f}x | "
                  f"{r['offloaded']}/{r['units']}/{r['recomputed']} |" for r in info["least"]]
        lines += ["", "| solver | budget | units on: peak | time | offl./units/recomp. | units off: peak | time |",
                  "|---|---|---|---|---|---|---|"]
        for on, off in zip(info["rows"][::2], info["rows"][1::2]):
            cells = []
            for r in (on, off):
                if "peak_ratio" in r:
                    cells.append(f"{r['peak_ratio']:.3f}x | {r['time_ratio']:.3f}x")
                else:
                    least = r.get("least_ratio")
                    cells.append("infeasible" + (f" (least {least:.3f}x)" if least else "") + " | -")
            what = f"{on.get('offloaded', '-')}/{on.get('units', '-')}/{on.get('recomputed', '-')}"
            lines.append(f"| {on['solver']} | {on['fraction']} | {cells[0]} | {what} | {cells[1]} |")
        lines.append("")
    return lines


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--graphs", default="gpt2,densenet121,unet,resnet50")
    ap.add_argument("--fractions", default="0.8,0.7,0.6,0.5")
    ap.add_argument("--bandwidths", default="53.99e9,12e9")
    ap.add_argument("--hf", action="store_true")
    ap.add_argument("--meta", action="store_true")
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
    if a.meta:
        result["meta"] = meta_rows([float(f) for f in a.fractions.split(",")])
    if a.hf:
        result["hf"] = hf_end_to_end()
        result["hf_default_blocks"] = hf_end_to_end(blocks="auto")
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "offload_saved.json").write_text(json.dumps(result, indent=1, default=str))
        (out / "offload_saved.md").write_text(markdown(result))
    return result


if __name__ == "__main__":
    main()
