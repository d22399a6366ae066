"""``auto`` against the best plan known on the 100 seeded random networks of ``optimum_gaps``.

    python benchmarks/polish_gain.py [--gaps benchmarks/results/cpu/optimum_gaps/random/gaps.json] [--out DIR]
        [--baseline benchmarks/results/cpu/polish_gain/polish_gain.json] [--every K]

Re-solves ``solve(graph, budget)`` (``auto``) at every budget stored in an ``optimum_gaps`` run
(the same graphs: ``tests/_graphs.random_networks(100)``, checked by node count) and compares its
extra time with the best plan that run found (``auto``'s stored extra time over its stored
``over_best``), beside the stored ``auto`` row: a change to ``auto`` (issue 28: the boundary
polish, :mod:`autoremat.solvers.polish`; the chain search, :mod:`autoremat.solvers.milp.chain`)
is measured without the hour of ``milp`` searches. Each solve is run twice, interleaved, with the
chain search on and off, so that auto's solve time is compared on one loaded machine. Writes ``polish_gain.json`` and ``polish_gain.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _graphs import FAMILIES, random_networks  # noqa: E402

import autoremat  # noqa: E402


def _ratio(new: float, best: float) -> float:
    return new / best if best > 0 else (1.0 if new == 0 else float("inf"))


def _solve(g: Any, budget: int, chain: bool) -> tuple[float, float]:
    """auto's extra time at ``budget`` (``inf`` where it finds no plan: its lattice search has a
    wall-clock limit, so on a loaded machine it may miss a plan it found before) with its chain
    search on or off (``CHAIN_MAX_NODES`` set to 0), and its wall time; the chosen stage."""
    from autoremat.solvers.milp import chain as chain_mod

    keep = chain_mod.CHAIN_MAX_NODES
    chain_mod.CHAIN_MAX_NODES = keep if chain else 0
    start = time.perf_counter()
    try:
        plan = autoremat.solve(g, budget)
    except autoremat.InfeasibleBudgetError:
        return float("inf"), time.perf_counter() - start, "no plan"
    finally:
        chain_mod.CHAIN_MAX_NODES = keep
    stage = plan.options.get("auto_stage") or ("polish" if plan.options.get("polished_moves") else plan.solver)
    return plan.predicted_extra_time_s or 0.0, time.perf_counter() - start, stage


def compare(gaps: dict[str, Any], count: int, baseline: dict[str, Any] | None = None,
            every: int = 1) -> dict[str, list[dict[str, Any]]]:
    """Per budget name, one row per network where the stored ``auto`` had a plan: auto's ratio to
    the best plan known now (``now``), with the chain search off (``off``, timed interleaved with
    ``now``), in the stored run (``before``) and in ``baseline`` (an earlier output of this script:
    ``main``), and to the stored proven bound (``now_bound``). ``every``: every k-th network only."""
    prev = {(name, r["graph"]): r["now"] for name, rs in (baseline or {}).get("rows", {}).items() for r in rs}
    out: dict[str, list[dict[str, Any]]] = {}
    for i, (g, rec) in enumerate(zip(random_networks(count), gaps["graphs"][:count])):
        if i % every:
            continue
        if len(g) != rec["nodes"]:
            raise ValueError(f"{rec['graph']}: {len(g)} nodes here, {rec['nodes']} in the stored run")
        for name, bb in rec["budgets"].items():
            a = bb.get("auto", {})
            if a.get("infeasible") or not a.get("over_best"):
                continue
            best = a["extra_time_s"] / a["over_best"]
            bound = a["extra_time_s"] / a["over_bound"] if a.get("over_bound") else None
            runs = [(_solve(g, bb["budget_bytes"], on), on) for on in ((True, False) if i % 2 else (False, True))]
            (extra, secs, stage), (off_extra, off_secs, _) = [r for r, _ in sorted(runs, key=lambda x: not x[1])]
            row = {"graph": rec["graph"], "nodes": len(g), "before": a["over_best"], "now": _ratio(extra, best),
                   "off": _ratio(off_extra, best), "main": prev.get((name, rec["graph"])),
                   "now_bound": None if bound is None else _ratio(extra, bound), "seconds": secs,
                   "seconds_off": off_secs, "stage": stage}
            out.setdefault(name, []).append(row)
            print(f"  {rec['graph']} {name}: now {row['now']:.3f} off {row['off']:.3f} ({secs:.2f} s / {off_secs:.2f} s, "
                  f"{row['stage']})", flush=True)
    return out


def _q(xs: list[float], p: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(p * len(xs)))]


def _dist(xs: list[float]) -> str:
    return (f"{sum(x <= 1.05 for x in xs)} / {statistics.median(xs):.3f} / {_q(xs, .9):.3f} / {max(xs):.3f}"
            if xs else "-")


def report(rows: dict[str, list[dict[str, Any]]], machine: str) -> str:
    lines = ["# `auto` against the best plan known (seeded random networks)", "", f"Machine: {machine}.",
             "Ratio: auto's extra time over the best plan the stored `optimum_gaps` run found (<= 1.05: within "
             "5 %; below 1: auto now beats every plan that run found). Cells: within 5 % / median / p90 / worst. "
             "`stored`: auto in that run (before the polish); `main`: the baseline file (the code before this "
             "run's change); `chain off`: this code with the chain search off, solved interleaved with `now`.",
             "", "| budget | networks | stored | main | chain off | now | worse than main | now over the proven bound "
             "| auto s now: median / worst | chain off: median / worst |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, rs in rows.items():
        main = [r["main"] for r in rs if r.get("main") is not None]
        worse = sum(r["now"] > r["main"] * (1 + 1e-7) for r in rs if r.get("main") is not None)
        bound = [r["now_bound"] for r in rs if r.get("now_bound") is not None]
        secs, off = [r["seconds"] for r in rs], [r["seconds_off"] for r in rs]
        lines.append(f"| {name} | {len(rs)} | {_dist([r['before'] for r in rs])} | {_dist(main)} | "
                     f"{_dist([r['off'] for r in rs])} | {_dist([r['now'] for r in rs])} | {worse} | "
                     f"{_dist(bound)} ({len(bound)} bounds) | {statistics.median(secs):.2f} / {max(secs):.2f} | "
                     f"{statistics.median(off):.2f} / {max(off):.2f} |")
    lines += ["", "Per family (now; within 5 % / median / p90 / worst):", "",
              "| budget | " + " | ".join(FAMILIES) + " |", "|---|" + "---|" * len(FAMILIES)]
    for name, rs in rows.items():
        lines.append(f"| {name} | " + " | ".join(_dist([r["now"] for r in rs if r["graph"].startswith(f + "-")])
                                                 for f in FAMILIES) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gaps", type=Path, default=Path("benchmarks/results/cpu/optimum_gaps/random/gaps.json"))
    p.add_argument("--count", type=int, default=100)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--baseline", type=Path, default=None, help="an earlier polish_gain.json (the `main` column)")
    p.add_argument("--every", type=int, default=1, help="every k-th network only (a subsample)")
    args = p.parse_args(argv)
    import os

    load = os.getloadavg()[0]
    machine = f"{platform.machine()}, {os.cpu_count()} cores, CPU only, load average {load:.2f} at the start"
    baseline = json.loads(args.baseline.read_text()) if args.baseline else None
    rows = compare(json.loads(args.gaps.read_text()), args.count, baseline, args.every)
    text = report(rows, machine)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "polish_gain.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))
        (args.out / "polish_gain.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
