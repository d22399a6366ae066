"""How long ``combined`` takes on the H200-captured graphs (issue 22), before and after a change.

    python benchmarks/combined_speed.py [--before SRC] [--nets densenet121,resnet50,unet,gpt2] [--out DIR]

Per graph of ``benchmarks/results/nvidia-h200/offload_gpu/graph_<net>.json`` (paper-size captures on
an H200, one node per repeated block), ``autoremat.solve(graph, budget, solver="combined")`` at 50 %
of the unpatched step peak and at dp-approx's least budget (``plans_<net>.json``): wall time, the
number of simulated steps, and the plan's predicted peak and extra time. ``--before SRC`` also runs
another source tree (``SRC`` holding the ``autoremat`` package, e.g. a ``git archive`` of an older
commit's ``src``) case by case, interleaved with this one, each in its own process, so the two see
the same machine load; the plans are compared (same, faster, or slower predicted extra time).
Writes ``combined_speed.json`` and ``combined_speed.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
GRAPHS = HERE / "results" / "nvidia-h200" / "offload_gpu"
NETS = ("densenet121", "resnet50", "unet", "gpt2")


def one(net: str, which: str) -> dict:
    """Solve one case in this process (the ``autoremat`` on ``sys.path``)."""
    import autoremat
    import autoremat.cost.simulator as simulator
    from autoremat.cost import no_recompute_plan, simulate

    g = autoremat.Graph.from_json(str(GRAPHS / f"graph_{net}.json"))
    peak = simulate(g, no_recompute_plan(g)).peak_bytes
    least = json.loads((GRAPHS / f"plans_{net}.json").read_text())["dp_approx_least_bytes"]
    budget = peak // 2 if which == "half" else int(least)
    count = [0]
    run = simulator._run

    def counted(*args, **kwargs):
        count[0] += 1
        return run(*args, **kwargs)

    simulator._run = counted
    t0 = time.perf_counter()
    try:
        plan = autoremat.solve(g, budget, solver="combined")
        row = {"peak_bytes": plan.predicted_peak_bytes, "extra_time_s": plan.predicted_extra_time_s,
               "offloaded": len(plan.offload), "recomputed_segments": len(plan.recompute_segments),
               "stability": (plan.options.get("stability") or {}).get("chosen")}
    except autoremat.InfeasibleBudgetError as err:
        row = {"infeasible_least_bytes": err.min_budget_bytes}
    finally:
        simulator._run = run
    row.update(net=net, which=which, budget_bytes=budget, nodes=len(g), solve_s=time.perf_counter() - t0,
               simulations=count[0], unpatched_peak_bytes=peak)
    return row


def _in_child(net: str, which: str, src: str | None) -> dict:
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, __file__, "--one", f"{net}:{which}"], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _verdict(a: dict, b: dict) -> str:
    if (a.get("peak_bytes"), a.get("extra_time_s")) == (b.get("peak_bytes"), b.get("extra_time_s")):
        return "same plan"
    if "extra_time_s" not in a or "extra_time_s" not in b:
        return "differs (feasibility)"
    if b["extra_time_s"] < a["extra_time_s"] - 1e-12:
        return "faster"
    if b["extra_time_s"] > a["extra_time_s"] + 1e-12:
        return "SLOWER"
    return "same time, " + ("lower peak" if b["peak_bytes"] < a["peak_bytes"] else "higher peak")


def _plan_text(r: dict) -> str:
    if "extra_time_s" not in r:
        return f"infeasible (least {r['infeasible_least_bytes'] / r['unpatched_peak_bytes']:.4f}x)"
    return (f"{r['peak_bytes'] / r['unpatched_peak_bytes']:.4f}x, +{r['extra_time_s'] * 1e3:.3f} ms, "
            f"{r['offloaded']} off / {r['recomputed_segments']} rec")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--before", help="source tree of the 'before' autoremat (its src directory)")
    ap.add_argument("--nets", default=",".join(NETS))
    ap.add_argument("--out", default=str(HERE / "results" / "cpu" / "combined_speed"))
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(*a.one.split(":"))))
        return
    rows = []
    for net in a.nets.split(","):
        for which in ("half", "least"):
            before = _in_child(net, which, a.before) if a.before else None
            after = _in_child(net, which, None)
            rows.append({"before": before, "after": after})
            print(net, which, "before", before and round(before["solve_s"], 1), "after", round(after["solve_s"], 1),
                  flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    machine = f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}"
    (out / "combined_speed.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))
    lines = [f"# combined on the H200 graphs ({machine})", "",
             "| net (nodes) | budget | before: s (simulations) | after: s (simulations) | before: plan "
             "| after: plan | plans |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        b, x = r["before"], r["after"]
        label = "50 % of peak" if x["which"] == "half" else "dp-approx least"
        lines.append(f"| {x['net']} ({x['nodes']}) | {label} | "
                     + (f"{b['solve_s']:.1f} ({b['simulations']})" if b else "-")
                     + f" | {x['solve_s']:.1f} ({x['simulations']}) | " + (_plan_text(b) if b else "-")
                     + f" | {_plan_text(x)} | " + (_verdict(b, x) if b else "-") + " |")
    (out / "combined_speed.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
