"""``solver="auto"`` against the proven optimum on the zoo, reusing ``milp_gaps``' proven bounds.

    python benchmarks/auto_gaps.py                      # every zoo graph of milp_gaps/gaps.json
    python benchmarks/auto_gaps.py --models resnet50,unet

``benchmarks/milp_gaps.py`` spends minutes per zoo model proving the optimum's lower bound at
each budget (milp's least budget, 75 %, 50 %, Chen's least). Those bounds depend on the graph and
the budget only, so when ``auto`` changes they need not be proven again: this script captures each
zoo model at CPU size (meta device), checks that the graph is the one the bounds were proven on
(same node count and unoptimised step peak; a graph that differs is reported and skipped), solves
``auto`` at the stored budgets and reports its extra time (the simulator's, without replay tails:
:func:`~autoremat.solvers.milp.search.judge`) against the stored bound and against the best plan
``milp`` found there (an upper bound of the optimum), and auto's own solve time. Where the stored
run recorded the plans as they run (finalised, with their replay tails: ``milp_gaps``' as-run line,
e.g. its ``--size paper`` run), ``auto``'s plan as it runs beside them too. The zoo's size is the
stored graph's (``(CPU size)`` or ``(paper size)`` in its name). Bounds proven as the plans run
(``milp_gaps.py --tails``: ``"tails": true`` in the file) are compared with ``auto``'s extra time
priced the same way (``judge(..., tails=True)``).

Writes ``gaps.json`` and ``RESULTS.md`` under ``--out`` (default ``benchmarks/results/cpu/auto_gaps``).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import autoremat
from autoremat import zoo
from autoremat.cost import unoptimised_peak_bytes
from autoremat.errors import InfeasibleBudgetError
from autoremat.solvers.milp.search import judge
from milp_gaps import memory_digest

RESULTS = Path(__file__).resolve().parent / "results" / "cpu"
MACHINE = "x86_64, 2 cores, CPU only, shared/loaded"


def _auto(graph: Any, budget: int, tails: bool = False) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        plan = autoremat.solve(graph, budget, solver="auto")
    except InfeasibleBudgetError as err:
        return {"infeasible": True, "min_budget_bytes": err.min_budget_bytes, "seconds": time.perf_counter() - start}
    seconds = time.perf_counter() - start
    peak, extra = judge(graph, plan, tails=tails)
    return {"extra_time_s": extra, "peak_bytes": peak, "chosen": plan.solver, "seconds": seconds,
            "as_run_s": plan.predicted_extra_time_s}


SIZES = {"(CPU size)": "small", "(paper size)": "paper"}


def stored_model(name: str) -> tuple[str, str] | None:
    """``(zoo model, size)`` of a stored graph's name (``"resnet50 (paper size)"``), or ``None``
    (a random DAG)."""
    for tag, size in SIZES.items():
        if name.endswith(" " + tag):
            return name[: -len(tag) - 1], size
    return None


def run_model(model: str, stored: dict[str, Any], size: str = "small", tails: bool = False) -> dict[str, Any]:
    graph = autoremat.capture(*zoo.build(model, size=size, device="meta"))
    peak = unoptimised_peak_bytes(graph)
    res: dict[str, Any] = {"graph": stored["graph"], "nodes": len(graph), "unoptimised_peak_bytes": peak,
                           "budgets": {}}
    digest = memory_digest(graph)
    if (len(graph), peak) != (stored["nodes"], stored["unoptimised_peak_bytes"]) \
            or stored.get("memory_digest", digest) != digest:
        res["skipped"] = (f"graph differs from the one the bounds were proven on ({len(graph)} nodes, peak {peak} B, "
                          f"digest {digest}; stored {stored['nodes']} nodes, {stored['unoptimised_peak_bytes']} B, "
                          f"digest {stored.get('memory_digest')})")
        return res
    for label, row in stored["budgets"].items():
        bound = row.get("optimum", {}).get("bound_s")
        best = row.get("milp", {}).get("extra_time_s")
        got = _auto(graph, row["budget_bytes"], tails)
        got.update({"budget_bytes": row["budget_bytes"], "bound_s": bound, "best_known_s": best,
                    "proven_optimal": row.get("optimum", {}).get("proven_optimal"),
                    "before": row.get("auto", {}).get("extra_time_s"),
                    "before_as_run_s": row.get("auto", {}).get("predicted_extra_time_s"),
                    "best_as_run_s": row.get("milp", {}).get("predicted_extra_time_s")})
        extra = got.get("extra_time_s")
        if extra is not None and bound is not None:
            got["over_bound"] = extra / bound if bound > 0 else (1.0 if extra <= 0 else float("inf"))
        if extra is not None and best is not None:
            got["over_best"] = extra / best if best > 0 else (1.0 if extra <= 0 else float("inf"))
        ran, best_ran = got.get("as_run_s"), got["best_as_run_s"]
        if ran is not None and best_ran is not None:
            got["as_run_over_best"] = ran / best_ran if best_ran > 0 else (1.0 if ran <= 0 else float("inf"))
        res["budgets"][label] = got
        print(f"  {model} {label}: " + json.dumps(got, default=str), flush=True)
    return res


def _cell(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}x"


def write_markdown(data: dict[str, Any], path: Path) -> None:
    lines = ["# `auto` against the proven optimum (zoo)", "",
             f"Machine: {data['machine']}. Bounds and best plans: `{data['bounds_from']}` (milp, 60 s per "
             "search); `auto` solved again on the same graphs (checked: node count and unoptimised peak). Extra "
             + ("time: as the plans run (replays to their tails; the bounds proven so). " if data.get("tails") else
                "time: the simulator's, without replay tails. ")
             + "`x bound`: auto's extra time over the optimum's proven "
             "lower bound (an upper bound of auto's distance to the optimum); `x best`: over the best plan milp "
             "found (a lower bound of that distance; equal where the optimum is proven).", "",
             "| graph | budget | auto before | auto now (chosen, s) | x bound | x best | optimum proven |",
             "|---|---|---|---|---|---|---|"]
    for g in data["graphs"]:
        if "skipped" in g:
            lines.append(f"| {g['graph']} | - | - | skipped: {g['skipped']} | - | - | - |")
            continue
        for label, r in g["budgets"].items():
            before = "infeasible" if r.get("before") is None else f"{r['before'] * 1e3:.4g} ms"
            now = ("infeasible" if r.get("infeasible") else
                   f"{r['extra_time_s'] * 1e3:.4g} ms ({r['chosen']}, {r['seconds']:.1f} s)")
            lines.append(f"| {g['graph']} | {label} ({r['budget_bytes']} B) | {before} | {now} | "
                         f"{_cell(r.get('over_bound'))} | {_cell(r.get('over_best'))} | "
                         f"{'yes' if r.get('proven_optimal') else 'no'} |")
    ran = [(g["graph"], label, r) for g in data["graphs"] for label, r in g.get("budgets", {}).items()
           if r.get("best_as_run_s") is not None]
    if ran:
        lines += ["", "As the plans run (finalised, with their replay tails): `auto` before (the stored run's), "
                  "now, and `milp`'s best plan finalised the same way.", "",
                  "| graph | budget | auto before | auto now | milp's plan | now over milp's |",
                  "|---|---|---|---|---|---|"]
        for graph, label, r in ran:
            cells = [("-" if x is None else f"{x * 1e3:.4g} ms")
                     for x in (r.get("before_as_run_s"), r.get("as_run_s"), r["best_as_run_s"])]
            lines.append(f"| {graph} | {label} | {' | '.join(cells)} | {_cell(r.get('as_run_over_best'))} |")
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bounds", default=str(RESULTS / "milp_gaps" / "gaps.json"))
    ap.add_argument("--models", default="", help="comma-separated zoo names (default: every zoo graph stored)")
    ap.add_argument("--out", default=str(RESULTS / "auto_gaps"))
    opts = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    stored = json.loads(Path(opts.bounds).read_text())
    wanted = [m for m in opts.models.split(",") if m]
    data: dict[str, Any] = {"machine": MACHINE, "bounds_from": str(Path(opts.bounds).relative_to(RESULTS.parents[1]))
                            if Path(opts.bounds).is_relative_to(RESULTS.parents[1]) else opts.bounds,
                            "tails": bool(stored.get("tails")), "graphs": []}
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    for g in stored["graphs"]:
        found = stored_model(g["graph"])
        if found is None or (wanted and found[0] not in wanted):
            continue
        print(f"{g['graph']}…", flush=True)
        data["graphs"].append(run_model(found[0], g, found[1], data["tails"]))
        (out / "gaps.json").write_text(json.dumps(data, indent=1, default=str))  # partial results survive
        write_markdown(data, out / "RESULTS.md")
    return data


if __name__ == "__main__":
    main(sys.argv[1:])
