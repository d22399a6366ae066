"""``auto`` again at the budgets of stored ``optimum_gaps.py`` runs, against the best plan stored there.

    python -P benchmarks/auto_stored_budgets.py --out benchmarks/results/cpu/optimum_gaps/tight
    python -P benchmarks/auto_stored_budgets.py --graphs chain_skips-0,unet-13 --labels least

Why: ``optimum_gaps.py`` on all 100 seeded networks takes ~40 min (3 s per ``milp`` solve), most of
it ``milp``; when only ``auto`` changed, its plans can be judged against the best plan any solver
found in the stored run (``milp`` at 3 s, chen, dp-approx, xla-greedy, the old ``auto``): ``ratio``
is auto's extra time over the least of those and its own (:func:`~autoremat.solvers.milp.search.judge`,
the simulator without replay tails, as there). Reads the ``gaps.json`` of ``--runs`` (default: the
first 25 networks and networks 26-100 of 2026-11-27), writes ``auto.json`` and prints the counts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import autoremat  # noqa: E402
from autoremat.errors import InfeasibleBudgetError  # noqa: E402
from autoremat.solvers.milp.search import judge  # noqa: E402
from _graphs import random_networks  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "cpu" / "optimum_gaps"
RUNS = (RESULTS / "random_25", RESULTS / "random_26_100")
SOLVERS = ("chen", "dp-approx", "xla-greedy", "auto", "milp")


def rerun(graph: Any, label: str, row: dict[str, Any]) -> dict[str, Any]:
    """auto at ``row``'s budget, against the best plan stored in ``row``."""
    budget = row["budget_bytes"]
    stored = min(row[s]["extra_time_s"] for s in SOLVERS if "extra_time_s" in row.get(s, {}))
    start = time.perf_counter()
    try:
        plan = autoremat.solve(graph, budget, solver="auto")
    except InfeasibleBudgetError as err:
        return {"graph": graph.meta["model"], "nodes": len(graph), "label": label, "budget_bytes": budget,
                "infeasible": True, "min_budget_bytes": err.min_budget_bytes,
                "seconds": time.perf_counter() - start, "old_over_best": row["auto"].get("over_best")}
    seconds = time.perf_counter() - start
    peak, extra = judge(graph, plan)
    return {"graph": graph.meta["model"], "nodes": len(graph), "label": label, "budget_bytes": budget,
            "peak_bytes": peak, "extra_time_s": extra, "ratio": extra / min(stored, extra), "chosen": plan.solver,
            "stage": plan.options.get("auto_stage"), "seconds": seconds, "old_over_best": row["auto"].get("over_best")}


def counts(rows: list[dict[str, Any]], label: str) -> dict[str, Any]:
    mine = [r for r in rows if r["label"] == label]
    secs = sorted(r["seconds"] for r in mine)
    return {"networks": len(mine), "within_5pct_now": sum(r.get("ratio", 9.0) <= 1.05 for r in mine),
            "within_5pct_stored_run": sum((r["old_over_best"] or 9.0) <= 1.05 for r in mine),
            "no_plan_now": sum("infeasible" in r for r in mine),
            "no_plan_stored_run": sum(r["old_over_best"] is None for r in mine),
            "seconds_median": secs[len(secs) // 2] if secs else None, "seconds_max": secs[-1] if secs else None}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default=",".join(str(r) for r in RUNS))
    ap.add_argument("--graphs", default="", help="comma-separated network names (default: every stored one)")
    ap.add_argument("--labels", default="least,50%,Chen's least")
    ap.add_argument("--out", default="")
    opts = ap.parse_args(argv)
    stored = {g["graph"]: g for run in opts.runs.split(",") for g in json.loads(
        (Path(run) / "gaps.json").read_text())["graphs"] if g.get("part", "random") == "random"}
    want = set(opts.graphs.split(",")) if opts.graphs else set(stored)
    labels = opts.labels.split(",")
    rows = []
    for graph in random_networks(100):
        name = graph.meta["model"]
        if name not in want or name not in stored:
            continue
        for label in labels:
            if label in stored[name]["budgets"]:
                rows.append(rerun(graph, label, stored[name]["budgets"][label]))
                print(json.dumps(rows[-1]), flush=True)
    data = {"rows": rows, "summary": {label: counts(rows, label) for label in labels}}
    print(json.dumps(data["summary"], indent=1))
    if opts.out:
        Path(opts.out).mkdir(parents=True, exist_ok=True)
        (Path(opts.out) / "auto.json").write_text(json.dumps(data, indent=1))
    return data


if __name__ == "__main__":
    main(sys.argv[1:])
