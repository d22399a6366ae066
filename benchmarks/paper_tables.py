"""Reproduce the papers' tables with autoremat's solvers, beside the papers' own columns.

    python benchmarks/paper_tables.py [--nets resnet50,unet] [--out benchmarks/results/cpu] [--skip-measured]

Part A (paper size, meta device, simulated): for each zoo network at the paper's input size and
batch, the simulated unoptimised step peak, and for every registered solver (and objective) the
minimum feasible step-peak budget, the reduction against no recomputation, the extra time at
that budget, and the solver's runtime (one ``solve`` at the minimum plus finding the minimum),
beside Kusumoto et al. Table 1 and Feng & Huang Table 1. Two time conventions: the papers' (10 per
convolution, 1 otherwise: ``paper``) and FLOP-based times from the meta capture (``flops``).

Part B (CPU size, measured): the same at the zoo's small size, each minimum-budget plan applied
and its step peak measured with the live-storage counter.

Part C (Kumar et al.): TWRemat / NoRemat / GreedyRemat peak memory against depth for a deep MLP
chain (Fig. 2) and ResNets, and TWRemat(k)'s memory/length trade-off (Fig. 4), on the joint
forward+backward graph (schedule simulator; TWRemat is evaluated, not executed).

Writes ``paper_tables.json`` and ``paper_tables.md`` under ``--out``. Numbers are from the machine
the script ran on (named in the files).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

import autoremat
from autoremat.simulate import simulate, unoptimised_peak_bytes

# Kusumoto et al. 2019, Table 1 (GB; reduction vs vanilla in parentheses in the paper).
KUSUMOTO = {
    "pspnet": {"ApproxDP+MC": 2.7, "ApproxDP+TC": 3.1, "ExactDP+MC": 2.8, "ExactDP+TC": 3.2, "Chen": 4.0, "Vanilla": 9.4},
    "unet": {"ApproxDP+MC": 5.0, "ApproxDP+TC": 6.7, "ExactDP+MC": 4.7, "ExactDP+TC": 5.3, "Chen": 7.4, "Vanilla": 9.1},
    "resnet50": {"ApproxDP+MC": 3.4, "ApproxDP+TC": 4.4, "ExactDP+MC": 3.4, "ExactDP+TC": 4.3, "Chen": 3.7, "Vanilla": 8.9},
    "resnet152": {"ApproxDP+MC": 2.3, "ApproxDP+TC": 2.5, "ExactDP+MC": 2.3, "ExactDP+TC": 2.5, "Chen": 2.4, "Vanilla": 9.2},
    "vgg19": {"ApproxDP+MC": 4.5, "ApproxDP+TC": 5.5, "ExactDP+MC": 4.5, "ExactDP+TC": 5.5, "Chen": 4.7, "Vanilla": 7.0},
    "densenet161": {"ApproxDP+MC": 1.6, "ApproxDP+TC": 1.9, "ExactDP+MC": 1.7, "ExactDP+TC": 1.8, "Chen": 1.8, "Vanilla": 8.5},
    "googlenet": {"ApproxDP+MC": 5.2, "ApproxDP+TC": 5.5, "ExactDP+MC": 5.2, "ExactDP+TC": 5.9, "Chen": 6.5, "Vanilla": 8.5},
}
# Feng & Huang, Table 1: memory cut-off of Re-forwarding (their batch sizes differ from ours).
FENG_HUANG_CUT = {"vgg19": 0.48, "resnet50": 0.65, "resnet152": 0.80, "densenet121": 0.81, "densenet161": 0.83,
                  "densenet201": 0.82, "inception_v3": 0.69}
# Paper solver runtimes (seconds): Kusumoto §5.1; Feng & Huang Appendix Table 2 (one core).
PAPER_RUNTIME = {("dp-exact", "googlenet"): "> 80", ("dp-exact", "pspnet"): "> 80",
                 ("dp-approx", "*"): "< 1", ("reforward", "resnet152"): "59",
                 ("reforward", "densenet161"): "1538", ("reforward", "densenet201"): "7335"}

NETS = ["resnet50", "resnet152", "vgg19", "densenet121", "densenet161", "densenet201", "googlenet",
        "inception_v3", "unet", "pspnet"]


def solver_variants() -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = []
    for name in sorted(autoremat.SOLVERS):
        if name == "none":
            continue
        if name.startswith("dp-"):
            out += [(name, {"objective": "time"}), (name, {"objective": "memory"})]
        else:
            out.append((name, {}))
    return out


def min_budget_run(g: autoremat.Graph, name: str, options: dict[str, Any]) -> dict[str, Any]:
    """Minimum feasible budget of one solver on one graph, with timings."""
    t0 = time.perf_counter()
    try:
        plan = autoremat.solve(g, 0, solver=name, **options)
        minimum = plan.predicted_peak_bytes
    except autoremat.InfeasibleBudgetError as err:
        minimum = err.min_budget_bytes
        plan = None
    except ValueError as err:  # e.g. dp-exact refusing an exploding lower-set family
        return {"error": str(err)[:200], "runtime_s": time.perf_counter() - t0}
    search_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    if plan is None and minimum is not None:
        plan = autoremat.solve(g, minimum, solver=name, **options)
    solve_s = time.perf_counter() - t0
    sim = simulate(g, plan)
    return {"min_budget_bytes": int(minimum), "extra_time_s": sim.extra_time_s, "fwd_time_s": sim.fwd_time_s,
            "segments": len(plan.segments), "recomputed": len(plan.recompute_segments),
            "search_s": search_s, "solve_s": solve_s, "runtime_s": search_s + solve_s, "plan": plan}


def part_a(nets: list[str]) -> list[dict[str, Any]]:
    rows = []
    for net in nets:
        model, args = autoremat.zoo.build(net, size="paper", device="meta")
        g_flops = autoremat.capture(model, args)
        for times, g in (("paper", g_flops.with_paper_times()), ("flops", g_flops)):
            vanilla = unoptimised_peak_bytes(g)
            for name, options in solver_variants():
                r = min_budget_run(g, name, options)
                r.pop("plan", None)
                rows.append({"net": net, "nodes": len(g), "times": times, "solver": name, "options": options,
                             "vanilla_bytes": vanilla, **r,
                             "reduction": None if "min_budget_bytes" not in r else 1 - r["min_budget_bytes"] / vanilla})
                print(f"A {net:12s} {times:5s} {name:10s} {options} {rows[-1].get('reduction')} "
                      f"{rows[-1]['runtime_s']:.2f}s", flush=True)
    return rows


def part_b(nets: list[str]) -> list[dict[str, Any]]:
    rows = []
    for net in nets:
        model, args = autoremat.zoo.build(net, size="small")
        g = autoremat.capture(model, args)
        base = autoremat.measure(model, args, steps=1, warmup=0).peak_bytes
        for name, options in solver_variants():
            r = min_budget_run(g, name, options)
            plan = r.pop("plan", None)
            if plan is None:
                rows.append({"net": net, "solver": name, "options": options, **r})
                continue
            autoremat.apply(model, plan)
            try:
                measured = autoremat.measure(model, args, steps=1, warmup=0).peak_bytes
            finally:
                autoremat.restore(model)
            rows.append({"net": net, "solver": name, "options": options, "vanilla_measured_bytes": base,
                         "predicted_bytes": plan.predicted_peak_bytes, "measured_bytes": measured,
                         "measured_reduction": 1 - measured / base, "error": plan.predicted_peak_bytes / measured - 1,
                         "runtime_s": r["runtime_s"]})
            print(f"B {net:12s} {name:10s} {options} {rows[-1]['measured_reduction']:.3f}", flush=True)
    return rows


def part_c() -> dict[str, Any]:
    from autoremat.solvers.schedule import JointGraph, no_remat, simulate_schedule
    from autoremat.solvers.twremat import twremat_schedule
    from autoremat.solvers.xla_greedy import xla_greedy_schedule
    from autoremat.zoo.mlp import MLP

    def stats(g: autoremat.Graph, ks: list[int | None]) -> dict[str, Any]:
        joint = JointGraph.from_graph(g)
        base = simulate_schedule(joint, no_remat(joint))
        greedy = simulate_schedule(joint, xla_greedy_schedule(joint))
        out = {"noremat_peak": base.peak_bytes, "noremat_computes": base.n_computes,
               "greedy_peak": greedy.peak_bytes, "greedy_computes": greedy.n_computes, "twremat": []}
        for k in ks:
            s = simulate_schedule(joint, twremat_schedule(joint, k))
            out["twremat"].append({"k": k, "peak": s.peak_bytes, "computes": s.n_computes, "time_s": s.time_s})
        return out

    depth_rows = []
    for depth in (8, 16, 32, 64, 128, 256, 512):
        mlp = MLP(in_features=2048, hidden=2048, depth=depth, num_classes=10).to("meta")
        g = autoremat.capture(mlp, (torch.empty(512, 2048, device="meta"),))
        depth_rows.append({"depth": depth, **stats(g, [None])})
        print(f"C mlp depth {depth}", flush=True)
    resnets = {}
    for net in ("resnet50", "resnet152"):
        model, args = autoremat.zoo.build(net, size="paper", device="meta")
        g = autoremat.capture(model, args)
        resnets[net] = stats(g, [None, 4, 16, 64, 256, 1024])
        print(f"C {net}", flush=True)
    return {"mlp_depth": depth_rows, "resnets": resnets}


def _gib(b: float | None) -> str:
    return "—" if b is None else f"{b / 2**30:.2f}"


def _label(r: dict[str, Any]) -> str:
    o = r["options"].get("objective")
    return r["solver"] + (f" ({'TC' if o == 'time' else 'MC'})" if o else "")


def to_markdown(res: dict[str, Any]) -> str:
    L = [f"# Paper tables ({res['machine']})", "",
         "Generated by `benchmarks/paper_tables.py`. Memory is autoremat's *step peak* (activations, activation "
         "and parameter gradients, workspace; parameters and optimizer state excluded), simulated; the papers "
         "measured whole-device memory on their GPUs (Kusumoto: parameters included; Feng & Huang: differences of "
         "two batch sizes), so compare reductions, not bytes.", ""]
    if res.get("part_a"):
        L += ["## A. Minimum feasible budget at paper size (meta device, simulated)", "",
              "Reduction = 1 − min budget / unoptimised step peak. Runtime = finding the minimum plus one solve at "
              "it, one process, one core's worth of Python.", ""]
        for times in ("paper", "flops"):
            L += [f"### Times: {times}", "",
                  "| net | nodes | unoptimised | solver | min budget (GiB) | reduction | extra time / forward | runtime (s) | paper runtime (s) |",
                  "|---|---|---|---|---|---|---|---|---|"]
            for r in res["part_a"]:
                if r["times"] != times:
                    continue
                paper_rt = PAPER_RUNTIME.get((r["solver"], r["net"])) or PAPER_RUNTIME.get((r["solver"], "*"), "")
                if "error" in r:
                    L.append(f"| {r['net']} | {r['nodes']} | {_gib(r['vanilla_bytes'])} | {_label(r)} | {r['error'][:60]} | | | {r['runtime_s']:.2f} | {paper_rt} |")
                    continue
                L.append(f"| {r['net']} | {r['nodes']} | {_gib(r['vanilla_bytes'])} | {_label(r)} | "
                         f"{_gib(r['min_budget_bytes'])} | {r['reduction']:.1%} | "
                         f"{r['extra_time_s'] / max(r['fwd_time_s'], 1e-12):.2f} | {r['runtime_s']:.2f} | {paper_rt} |")
            L.append("")
        L += ["### Against the papers' reductions (paper time convention)", "",
              "| net | ours: best reduction (solver) | Kusumoto best column | Kusumoto Chen | Feng & Huang Re-forwarding | shortfall vs Kusumoto best |",
              "|---|---|---|---|---|---|"]
        for net in dict.fromkeys(r["net"] for r in res["part_a"]):
            rs = [r for r in res["part_a"] if r["net"] == net and r["times"] == "paper" and "reduction" in r
                  and r["reduction"] is not None]
            if not rs:
                continue
            best = max(rs, key=lambda r: r["reduction"])
            k = KUSUMOTO.get(net)
            kbest = None if k is None else max(1 - v / k["Vanilla"] for c, v in k.items() if c != "Vanilla")
            kchen = None if k is None else 1 - k["Chen"] / k["Vanilla"]
            fh = FENG_HUANG_CUT.get(net)
            short = "" if kbest is None else (f"{kbest - best['reduction']:+.1%}" if best["reduction"] < kbest else "none")
            L.append(f"| {net} | {best['reduction']:.1%} ({_label(best)}) | {'—' if kbest is None else f'{kbest:.0%}'} | "
                     f"{'—' if kchen is None else f'{kchen:.0%}'} | {'—' if fh is None else f'{fh:.0%}'} | {short} |")
        L.append("")
    if res.get("part_b"):
        L += ["## B. CPU size, plans applied and measured", "",
              "| net | solver | unoptimised (measured) | min-budget plan: predicted | measured | measured reduction | prediction error |",
              "|---|---|---|---|---|---|---|"]
        for r in res["part_b"]:
            if "measured_bytes" not in r:
                L.append(f"| {r['net']} | {_label(r)} | {r.get('error', 'no plan')[:60]} | | | | |")
                continue
            L.append(f"| {r['net']} | {_label(r)} | {r['vanilla_measured_bytes'] / 2**20:.2f} MiB | "
                     f"{r['predicted_bytes'] / 2**20:.2f} MiB | {r['measured_bytes'] / 2**20:.2f} MiB | "
                     f"{r['measured_reduction']:.1%} | {r['error']:+.1%} |")
        L.append("")
    if res.get("part_c"):
        c = res["part_c"]
        L += ["## C. Kumar et al.: TWRemat on the joint forward+backward graph (schedule simulator)", "",
              "Deep MLP chain (width 2048, batch 512, fp32), peak bytes of the schedule (parameters excluded):", "",
              "| depth | NoRemat (MiB) | GreedyRemat (MiB) | TWRemat (MiB) | TWRemat memory saving | TWRemat length / NoRemat |",
              "|---|---|---|---|---|---|"]
        for r in c["mlp_depth"]:
            tw = r["twremat"][0]
            L.append(f"| {r['depth']} | {r['noremat_peak'] / 2**20:.0f} | {r['greedy_peak'] / 2**20:.0f} | "
                     f"{tw['peak'] / 2**20:.0f} | {r['noremat_peak'] / tw['peak']:.1f}x | "
                     f"{tw['computes'] / r['noremat_computes']:.2f} |")
        L += ["", "TWRemat(k) trade-off at paper size (k = recursion limit in bags; None = full algorithm):", "",
              "| net | k | peak / NoRemat | length / NoRemat |", "|---|---|---|---|"]
        for net, r in c["resnets"].items():
            for tw in r["twremat"]:
                L.append(f"| {net} | {tw['k']} | {tw['peak'] / r['noremat_peak']:.3f} | "
                         f"{tw['computes'] / r['noremat_computes']:.2f} |")
            L.append(f"| {net} | GreedyRemat | {r['greedy_peak'] / r['noremat_peak']:.3f} | "
                     f"{r['greedy_computes'] / r['noremat_computes']:.2f} |")
        L.append("")
    return "\n".join(L) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nets", default=",".join(NETS))
    p.add_argument("--out", default="benchmarks/results/cpu")
    p.add_argument("--skip-measured", action="store_true")
    p.add_argument("--skip-twremat", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(1)
    nets = a.nets.split(",")
    machine = f"{platform.machine()} CPU, {os.cpu_count()} cores (solvers single-threaded), torch {torch.__version__}"
    res: dict[str, Any] = {"machine": machine, "solvers": sorted(autoremat.SOLVERS)}
    res["part_a"] = part_a(nets)
    res["part_b"] = [] if a.skip_measured else part_b(nets)
    res["part_c"] = {} if a.skip_twremat else part_c()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "paper_tables.json").write_text(json.dumps(res, indent=1, default=str))
    (out / "paper_tables.md").write_text(to_markdown(res))
    print(to_markdown(res))


if __name__ == "__main__":
    main()
