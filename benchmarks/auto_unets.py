"""``auto`` on the seeded U-Nets of over 120 nodes against the best plan known there.

    python benchmarks/auto_unets.py            # auto only, against optimum_gaps' stored plans
    python benchmarks/auto_unets.py 5          # also milp (seeded by the other solvers), 5 s each

Issue 28: ``benchmarks/results/cpu/optimum_gaps/random/`` (``optimum_gaps.py``: every heuristic,
``auto`` and ``milp`` with a 3 s limit, seeded, on ``tests/_graphs.random_networks(100)``) found
``auto`` within 5 % of the best plan on 1 of 25 U-Nets, before the chain search. This solves
``auto`` again at the stored budgets of the U-Nets of over 120 nodes and prints one JSON line per
row: auto's extra time (the simulator's, without replay tails), the best stored, and their ratio.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import autoremat
from autoremat.errors import InfeasibleBudgetError
from autoremat.solvers.milp.search import judge

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
from _graphs import random_networks  # noqa: E402  (the seeded generators the tests use)

STORED = HERE / "results" / "cpu" / "optimum_gaps" / "random" / "gaps.json"


def _solve(graph, budget: int, solver: str, opts: dict) -> tuple[float | None, str, float]:
    start = time.perf_counter()
    try:
        plan = autoremat.solve(graph, budget, solver=solver, **opts)
    except InfeasibleBudgetError:
        return None, "infeasible", time.perf_counter() - start
    stage = plan.options.get("auto_stage")
    return judge(graph, plan)[1], plan.solver + (f"/{stage}" if stage else ""), time.perf_counter() - start


def main(argv: list[str]) -> None:
    limit = float(argv[0]) if argv else 0.0
    stored = json.loads(STORED.read_text())
    for graph, row in zip(random_networks(100, seed=0, lo=30, hi=300), stored["graphs"]):
        if not row["graph"].startswith("unet") or len(graph) <= 120:
            continue
        assert row["graph"] == graph.meta.get("model") and row["nodes"] == len(graph)
        for label, b in row["budgets"].items():
            known = [v["extra_time_s"] for v in b.values() if isinstance(v, dict) and v.get("extra_time_s") is not None]
            out = {"graph": row["graph"], "nodes": len(graph), "budget": label, "stored_best_s": min(known, default=None)}
            runs = [("auto", {})] + ([("milp", {"time_limit_s": limit})] if limit else [])
            for solver, opts in runs:
                out[solver], out[solver + "_chosen"], seconds = _solve(graph, b["budget_bytes"], solver, opts)
                out[solver + "_s"] = round(seconds, 2)
            vals = [v for v in (out["stored_best_s"], out["auto"], out.get("milp")) if v is not None]
            out["best_s"] = min(vals, default=None)
            out["auto_over_best"] = None if out["auto"] is None or not out["best_s"] else out["auto"] / out["best_s"]
            print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
