"""``auto`` against the best plan known on the 100 seeded random networks of ``optimum_gaps``.

    python benchmarks/polish_gain.py [--gaps benchmarks/results/cpu/optimum_gaps/random/gaps.json] [--out DIR]

Re-solves ``solve(graph, budget)`` (``auto``) at every budget stored in an ``optimum_gaps`` run
(the same graphs: ``tests/_graphs.random_networks(100)``, checked by node count) and compares its
extra time with the best plan that run found (``auto``'s stored extra time over its stored
``over_best``), beside the stored ``auto`` row: a change to ``auto`` (issue 28: the boundary
polish, :mod:`autoremat.solvers.polish`) is measured without the hour of ``milp`` searches.
Writes ``polish_gain.json`` and ``polish_gain.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _graphs import random_networks  # noqa: E402

import autoremat  # noqa: E402


def _ratio(new: float, best: float) -> float:
    return new / best if best > 0 else (1.0 if new == 0 else float("inf"))


def compare(gaps: dict[str, Any], count: int) -> dict[str, list[dict[str, Any]]]:
    """Per budget name, one row per network where the stored ``auto`` had a plan."""
    out: dict[str, list[dict[str, Any]]] = {}
    for g, rec in zip(random_networks(count), gaps["graphs"][:count]):
        if len(g) != rec["nodes"]:
            raise ValueError(f"{rec['graph']}: {len(g)} nodes here, {rec['nodes']} in the stored run")
        for name, bb in rec["budgets"].items():
            a = bb.get("auto", {})
            if a.get("infeasible") or not a.get("over_best"):
                continue
            best = a["extra_time_s"] / a["over_best"]
            plan = autoremat.solve(g, bb["budget_bytes"])
            out.setdefault(name, []).append({"graph": rec["graph"], "before": a["over_best"],
                                             "now": _ratio(plan.predicted_extra_time_s or 0.0, best),
                                             "polished": bool(plan.options.get("polished_moves"))})
    return out


def _q(xs: list[float], p: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(p * len(xs)))]


def report(rows: dict[str, list[dict[str, Any]]], machine: str) -> str:
    lines = ["# `auto` against the best plan known (100 seeded random networks)", "", f"Machine: {machine}.",
             "Ratio: auto's extra time over the best plan the stored `optimum_gaps` run found (<= 1.05: within 5 %).",
             "", "| budget | networks | within 5 % before / now | U-Nets within 5 % before / now | median before / now "
             "| p90 before / now | worst before / now | worse than before | polished |", "|---|---|---|---|---|---|---|---|---|"]
    for name, rs in rows.items():
        b, n = [r["before"] for r in rs], [r["now"] for r in rs]
        un = [r for r in rs if r["graph"].startswith("unet")]
        lines.append(f"| {name} | {len(rs)} | {sum(x <= 1.05 for x in b)} / {sum(x <= 1.05 for x in n)} | "
                     f"{sum(r['before'] <= 1.05 for r in un)} / {sum(r['now'] <= 1.05 for r in un)} of {len(un)} | "
                     f"{statistics.median(b):.3f} / {statistics.median(n):.3f} | {_q(b, .9):.3f} / {_q(n, .9):.3f} | "
                     f"{max(b):.3f} / {max(n):.3f} | {sum(y > x * (1 + 1e-7) for x, y in zip(b, n))} | "
                     f"{sum(r['polished'] for r in rs)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gaps", type=Path, default=Path("benchmarks/results/cpu/optimum_gaps/random/gaps.json"))
    p.add_argument("--count", type=int, default=100)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    import os

    load = os.getloadavg()[0]
    machine = f"{platform.machine()}, {os.cpu_count()} cores, CPU only, load average {load:.2f} at the start"
    rows = compare(json.loads(args.gaps.read_text()), args.count)
    text = report(rows, machine)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "polish_gain.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))
        (args.out / "polish_gain.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
