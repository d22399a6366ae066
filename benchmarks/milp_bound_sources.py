"""Where ``milp``'s proven lower bound comes from, and how far each of its three bases gets (issue 28).

    python benchmarks/milp_bound_sources.py                      # googlenet, pspnet, densenet121, inception_v3, resnet50
    python benchmarks/milp_bound_sources.py --models pspnet --lattice-s 45 --program-s 60

For each zoo model at CPU size (captured on the meta device, as ``benchmarks/milp_gaps.py``)
and each budget (``milp``'s least budget from ``milp_gaps/gaps.json``, and 50 % of the
unoptimised step peak):

* the best heuristic plan's extra time (``dp-approx``, ``reforward``, ``chen``: the least that fits);
* the lattice (:mod:`autoremat.solvers.milp.lattice`): lower sets, superset pairs (the steps the
  cost-to-go DP relaxes, per flag), the cost-to-go's time within 0.6 of ``--lattice-s`` (as
  ``milp`` gives it) and ``h`` at the root, and the A* bound, labels taken and replays when the
  search stops at ``--lattice-s`` (cost-to-go included), seeded with the heuristic plan;
* the separators' program (:mod:`autoremat.solvers.milp.cut_bound`) within ``--cuts-s``: its bound,
  time and the separators it used;
* the HiGHS program (``optimality_gap`` with ``k`` the heuristic plan's segments, so the
  lattice is not used) within ``--program-s``: its bound (the separators' where that is the larger:
  ``program_basis`` says which);
* the graph's separators (nodes every other node is an ancestor or a descendant of).

Prints one JSON line per model and budget and writes them to ``sources-<budgets>.json`` under
``--out`` (default ``benchmarks/results/cpu/milp_gaps``; read in its ``ANALYSIS.md``).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any

import autoremat
from autoremat import zoo
from autoremat.cost import unoptimised_peak_bytes
from autoremat.solvers.milp import optimality_gap
from autoremat.solvers.milp.cut_bound import cut_bound, separators
from autoremat.solvers.milp.exact import lattice_of
from autoremat.solvers.milp.search import judge

MODELS = ("googlenet", "pspnet", "densenet121", "inception_v3", "resnet50")
OUT = Path(__file__).resolve().parent / "results" / "cpu" / "milp_gaps"


def pairs(lat) -> int:
    rows = lat.rows
    return sum(int(((rows & rows[i]) == rows[i]).all(axis=1).sum()) - 1 for i in range(len(lat.fam)))


def best_heuristic(graph, budget: int):
    best = None
    for s in ("dp-approx", "reforward", "chen"):
        try:
            plan = autoremat.solve(graph, budget, solver=s)
        except Exception:  # noqa: BLE001 (infeasible for this solver: left out)
            continue
        peak, extra = judge(graph, plan)
        if peak <= budget and (best is None or extra < best[1]):
            best = (plan, extra)
    return best


def at_budget(graph, budget: int, lattice_s: float, program_s: float, cuts_s: float) -> dict[str, Any]:
    row: dict[str, Any] = {"budget": budget}
    best = best_heuristic(graph, budget)
    row["heuristic_extra_s"] = None if best is None else best[1]
    lat = lattice_of(graph)
    if lat is not None:
        start = time.monotonic()
        ctg = lat.cost_to_go(budget, start + 0.6 * lattice_s)
        row["ctg_s"] = time.monotonic() - start
        row["h_root_s"] = None if ctg is None else float(ctg.table[0, 0])
        inc = math.inf if best is None else best[1] * (1 - 1e-9)
        ans = lat.least_time(budget, incumbent=inc, deadline=start + lattice_s)
        row.update(lattice_s=time.monotonic() - start, lattice_bound_s=ans.bound, lattice_status=ans.status,
                   labels=ans.labels, replays=ans.replays)
    cut = cut_bound(graph, budget, cuts_s)
    row.update(cut_bound_s=cut.bound_s, cut_status=cut.status, cut_seconds=cut.seconds, cut_separators=len(cut.cuts))
    if best is not None:
        start = time.monotonic()
        gap = optimality_gap(graph, best[0], budget, time_limit_s=program_s, k=len(best[0].segments))
        row.update(program_s=time.monotonic() - start, program_bound_s=gap.bound_s, program_k=gap.k,
                   program_optimal=gap.proven_optimal, program_basis=gap.basis)
    print(json.dumps(row), flush=True)
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--lattice-s", type=float, default=45.0)
    ap.add_argument("--program-s", type=float, default=60.0)
    ap.add_argument("--cuts-s", type=float, default=15.0, help="time limit of the separators' program")
    ap.add_argument("--budgets", default="least,50%", help="which of: least (milp's, from milp_gaps/gaps.json), 50%%")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    least = {}
    gaps = OUT / "gaps.json"
    if gaps.exists():
        for g in json.loads(gaps.read_text())["graphs"]:
            if g.get("least", {}).get("milp", {}).get("bytes"):
                least[g["graph"]] = int(g["least"]["milp"]["bytes"])
    data: dict[str, Any] = {"machine": f"{platform.machine()}, {len(__import__('os').sched_getaffinity(0))} cores, "
                            f"CPU only, Python {platform.python_version()}", "lattice_s": args.lattice_s,
                            "program_s": args.program_s, "models": []}
    for m in args.models.split(","):
        graph = autoremat.capture(*zoo.build(m, size="small", device="meta"))
        lat = lattice_of(graph)
        entry = {"name": m, "nodes": len(graph), "separators": len(separators(graph)),
                 "lower_sets": None if lat is None else len(lat.fam), "pairs": None if lat is None else pairs(lat),
                 "budgets": {}}
        print(json.dumps({k: v for k, v in entry.items() if k != "budgets"}), flush=True)
        peak = unoptimised_peak_bytes(graph)
        for label, budget in (("least", least.get(f"{m} (CPU size)")), ("50%", int(0.5 * peak))):
            if budget is not None and label in args.budgets.split(","):
                entry["budgets"][label] = at_budget(graph, budget, args.lattice_s, args.program_s, args.cuts_s)
        data["models"].append(entry)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"sources-{'-'.join(args.budgets.split(','))}.json").write_text(json.dumps(data, indent=1))
    return data


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
