"""Every heuristic against the proven optimum (``milp``), and dp-approx against Chen's method.

    python benchmarks/optimum_gaps.py                         # zoo (CPU size) + 100 seeded networks
    python benchmarks/optimum_gaps.py --zoo resnet50 --random 4 --random-time-limit 5
    python benchmarks/optimum_gaps.py --markdown-only         # rewrite RESULTS.md from gaps.json

Graphs: the zoo models at CPU size (captured on the meta device) and ``--random`` seeded
op-level networks of four families (chains with skips, U-Nets, dense blocks, transformer
blocks; 30-300 nodes; ``tests/_graphs.random_networks``, the generator the tests use).

Budgets: ``milp``'s least budget (memory-centric search), 50 % and 75 % of the unoptimised
step peak (where at or above that least budget), and Chen's least budget; the random networks
get 50 % and Chen's least only (``--random-time-limit`` per ``milp`` solve).

At each budget: ``chen``, ``dp-approx``, ``xla-greedy``, ``auto`` (and ``dp-exact`` on the zoo,
where it runs on every lower set) solve; their extra time is :func:`~autoremat.solvers.milp.search.judge`'s
(the simulator's, without replay tails); ``milp`` (default options: the lattice first, then the
program) gives the optimum's proven lower bound, its status, gap and proof basis. Reported per
solver: extra time / bound. Checked: dp-approx recomputes no more than Chen's plan wherever Chen's
fits, and no dp-approx solve logs a warning or chooses the least-budget sequence.

Writes ``gaps.json`` and ``RESULTS.md`` under ``--out`` (default ``benchmarks/results/cpu/optimum_gaps``).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import autoremat
from autoremat import zoo
from autoremat.cost import unoptimised_peak_bytes
from autoremat.errors import InfeasibleBudgetError
from autoremat.graph import Graph
from autoremat.solvers.chen import chen_plans
from autoremat.solvers.milp import _config, _least_peak
from autoremat.solvers.milp.search import judge

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _graphs import random_networks  # noqa: E402  (the seeded generators the tests use)

ZOO = ("vgg19", "resnet50", "unet", "densenet121", "googlenet", "inception_v3", "pspnet")
HEURISTICS = ("chen", "dp-approx", "xla-greedy", "auto")
OUT = Path(__file__).resolve().parent / "results" / "cpu" / "optimum_gaps"
MACHINE = "x86_64, 2 cores, CPU only, shared/loaded"


class _Warnings(logging.Handler):
    """Counts dp-approx's warnings and least-budget fallbacks while it solves."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if record.levelno >= logging.WARNING or "least DP budget" in msg and "using" in msg:
            self.messages.append(msg)


def _solve(graph: Graph, budget: int, solver: str) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        config = {"fallback": False} if solver == "dp-exact" else None
        plan = autoremat.solve(graph, budget, solver=solver, **(config or {}))
    except InfeasibleBudgetError as err:
        return {"infeasible": True, "min_budget_bytes": err.min_budget_bytes, "seconds": time.perf_counter() - start}
    except ValueError as err:  # dp-exact where the graph has too many lower sets
        return {"error": str(err)[:160], "seconds": time.perf_counter() - start}
    peak, extra = judge(graph, plan)
    return {"extra_time_s": extra, "peak_bytes": peak, "seconds": time.perf_counter() - start,
            "chosen": plan.options.get("chosen", plan.solver)}


def _milp(graph: Graph, budget: int, limit: float) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        plan = autoremat.solve(graph, budget, solver="milp", time_limit_s=limit)
    except InfeasibleBudgetError as err:
        return {"infeasible": True, "min_budget_bytes": err.min_budget_bytes, "seconds": time.perf_counter() - start}
    except RuntimeError as err:
        return {"error": str(err)[:160], "seconds": time.perf_counter() - start}
    o = plan.options
    _, extra = judge(graph, plan)
    return {"extra_time_s": extra, "bound_s": o.get("optimum_bound_s", 0.0), "status": o["milp_status"],
            "gap": o["optimality_gap"], "basis": o.get("milp_bound_basis"), "segments": len(plan.segments),
            "seconds": time.perf_counter() - start}


def run_graph(name: str, graph: Graph, limit: float, solvers: tuple[str, ...], fractions: tuple[float, ...],
              log: _Warnings) -> dict[str, Any]:
    peak = unoptimised_peak_bytes(graph)
    start = time.perf_counter()
    least = _least_peak(graph, _config({"time_limit_s": limit}))
    res: dict[str, Any] = {"graph": name, "nodes": len(graph), "unoptimised_peak_bytes": peak, "budgets": {},
                           "milp_least": {"bytes": least.cost, "bound": least.bound, "status": least.status,
                                          "basis": least.basis, "seconds": time.perf_counter() - start}}
    chen_least = min(p for p, _, _ in chen_plans(graph))
    budgets = {"least": None if least.cost is None else int(least.cost)}
    budgets.update({f"{f:.0%}": int(f * peak) for f in fractions})
    budgets["Chen's least"] = chen_least
    for label, budget in budgets.items():
        if budget is None or (least.cost is not None and budget < least.cost) or budget >= peak:
            continue
        row: dict[str, Any] = {"budget_bytes": budget}
        for solver in solvers:
            log.messages.clear()
            row[solver] = _solve(graph, budget, solver)
            if solver == "dp-approx":
                row[solver]["warnings"] = list(log.messages)
        row["milp"] = _milp(graph, budget, limit)
        bound, best = row["milp"].get("bound_s"), row["milp"].get("extra_time_s")
        for solver in solvers:
            extra = row[solver].get("extra_time_s")
            if extra is not None and bound is not None:
                row[solver]["over_bound"] = _ratio(extra, bound)
            if extra is not None and best is not None:  # the best plan milp found: an upper bound of the optimum
                row[solver]["over_best"] = _ratio(extra, min(best, extra))
        res["budgets"][label] = row
        print(f"  {name} {label}: " + json.dumps({k: (v if not isinstance(v, dict) else
              {a: b for a, b in v.items() if a in ("extra_time_s", "over_bound", "status", "gap", "basis",
                                                    "infeasible", "seconds")}) for k, v in row.items()},
              default=str)[:900], flush=True)
    return res


def _ratio(extra: float, bound: float) -> float:
    return extra / bound if bound > 0 else (1.0 if extra <= 0 else float("inf"))


def _quantile(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


def auto_distribution(data: dict[str, Any], part: str) -> dict[str, Any]:
    """Per budget label: how many graphs have ``auto`` within 5 % of the proven bound and of the
    best plan milp found, the distribution of both ratios (median, p90, worst), where auto found
    no plan, and where milp could not prove a gap of 5 % (there the bound says little)."""
    out: dict[str, Any] = {}
    labels = sorted({lb for g in data["graphs"] if g["part"] == part for lb in g["budgets"]})
    for label in labels:
        rows = [(g["graph"], g["budgets"][label]) for g in data["graphs"] if g["part"] == part and label in g["budgets"]]
        auto = [(name, r["auto"]) for name, r in rows]
        ob = [a["over_bound"] for _, a in auto if "over_bound" in a]
        bb = [a["over_best"] for _, a in auto if "over_best" in a]
        out[label] = {
            "graphs": len(rows),
            "auto_no_plan": sum("extra_time_s" not in a for _, a in auto),
            "auto_within_5pct_of_bound": sum(x <= 1.05 for x in ob),
            "auto_within_5pct_of_best_found": sum(x <= 1.05 for x in bb),
            "auto_chose_milp": sum(a.get("chosen") == "milp" for _, a in auto),
            "over_bound": {"median": _quantile(ob, 0.5), "p90": _quantile(ob, 0.9), "worst": max(ob, default=None)},
            "over_best_found": {"median": _quantile(bb, 0.5), "p90": _quantile(bb, 0.9), "worst": max(bb, default=None)},
            "milp_gap_over_5pct": sorted(name for name, r in rows if r["milp"].get("gap", 0.0) > 0.05),
            "milp_no_answer": sorted(name for name, r in rows if "gap" not in r["milp"]),
            "auto_seconds_median": _quantile([a["seconds"] for _, a in auto], 0.5),
            "auto_seconds_max": max((a["seconds"] for _, a in auto), default=None),
        }
    return out


def summary(data: dict[str, Any]) -> dict[str, Any]:
    """The targets' numbers: milp's gaps, auto's and every heuristic's distance to the bound,
    dp-approx against Chen, warnings."""
    out: dict[str, Any] = {}
    for part in ("zoo", "random"):
        rows = [(g, lb, r) for g in data["graphs"] if g["part"] == part for lb, r in g["budgets"].items()]
        gaps = [r["milp"].get("gap") for _, _, r in rows if r["milp"].get("gap") is not None]
        s: dict[str, Any] = {"budgets": len(rows), "milp_gap_max": max(gaps, default=None),
                             "milp_proven_within_1pct": sum(g <= 0.01 for g in gaps),
                             "milp_basis": sorted({str(r["milp"].get("basis")) for _, _, r in rows}),
                             "milp_seconds_median": statistics.median([r["milp"]["seconds"] for _, _, r in rows])
                             if rows else None}
        for solver in HEURISTICS:
            ratios = [r[solver]["over_bound"] for _, _, r in rows if "over_bound" in r.get(solver, {})]
            s[solver] = {"n": len(ratios), "median": statistics.median(ratios) if ratios else None,
                         "max": max(ratios, default=None), "within_5pct": sum(x <= 1.05 for x in ratios),
                         "within_10pct": sum(x <= 1.10 for x in ratios)}
        graphs_auto = {}
        for g, _, r in rows:
            x = r.get("auto", {}).get("over_bound")
            if x is not None:
                graphs_auto[g["graph"]] = max(graphs_auto.get(g["graph"], 0.0), x)
        s["auto_graphs_within_5pct"] = f"{sum(x <= 1.05 for x in graphs_auto.values())} of {len(graphs_auto)}"
        behind = [(g["graph"], lb) for g, lb, r in rows if "extra_time_s" in r.get("chen", {})
                  and r["dp-approx"].get("extra_time_s", float("inf")) > r["chen"]["extra_time_s"] * (1 + 1e-9) + 1e-15]
        s["dp_approx_behind_chen"] = behind
        s["dp_approx_warnings"] = sum(len(r["dp-approx"].get("warnings", [])) for _, _, r in rows)
        s["auto_per_budget"] = auto_distribution(data, part)
        out[part] = s
    return out


def write_markdown(data: dict[str, Any], path: Path) -> None:
    lines = ["# Heuristics against the proven optimum", "",
             f"Machine: {data['machine']}. `milp` time limit {data['time_limit_s']} s per solve on the zoo, "
             f"{data['random_time_limit_s']} s on the random networks. Extra time: the simulator's, without replay "
             "tails (what every solver optimises). Each cell: extra time, and in brackets its ratio to the "
             "optimum's proven lower bound (`milp`'s); `milp`'s cell gives its status, gap and proof basis "
             "(`exact model`: the lattice search over `cost.segment_replay`; `program`: the HiGHS relaxation).",
             "", "## Summary", "", "```json", json.dumps(data["summary"], indent=1, default=str), "```", ""]
    for g in data["graphs"]:
        if g["part"] == "random":
            continue
        ml = g["milp_least"]
        lines += [f"## {g['graph']} ({g['nodes']} nodes, unoptimised peak {g['unoptimised_peak_bytes']} B)", "",
                  f"milp least budget: {ml['bytes']} B ({ml['status']}, bound {ml['bound']}, {ml['basis']}, "
                  f"{ml['seconds']:.1f} s)", "",
                  "| budget | " + " | ".join(data["zoo_solvers"]) + " | milp |",
                  "|---|" + "---|" * (len(data["zoo_solvers"]) + 1)]
        for label, r in g["budgets"].items():
            cells = []
            for solver in data["zoo_solvers"]:
                c = r[solver]
                cells.append("infeasible" if c.get("infeasible") else "n/a" if "error" in c else
                             f"{c['extra_time_s'] * 1e3:.4g} ms ({c.get('over_bound', float('nan')):.3f}x)")
            m = r["milp"]
            mc = ("infeasible" if m.get("infeasible") else m.get("error", "")[:40] if "error" in m else
                  f"{m['extra_time_s'] * 1e3:.4g} ms, {m['status']}, gap {100 * m['gap']:.2f} %, {m['basis']}, "
                  f"{m['seconds']:.1f} s")
            lines.append(f"| {label} ({r['budget_bytes']} B) | " + " | ".join(cells) + f" | {mc} |")
        lines.append("")
    lines += ["## Random networks (ratio to the bound: auto, chen, dp-approx; milp gap)", "",
              "| graph | budget | auto | chen | dp-approx | milp |", "|---|---|---|---|---|---|"]
    for g in data["graphs"]:
        if g["part"] != "random":
            continue
        for label, r in g["budgets"].items():
            cells = [f"{r[s].get('over_bound', float('nan')):.3f}" if "over_bound" in r[s] else "-"
                     for s in ("auto", "chen", "dp-approx")]
            m = r["milp"]
            mc = "-" if "gap" not in m else f"{m['status']}, {100 * m['gap']:.2f} %, {m['seconds']:.1f} s"
            lines.append(f"| {g['graph']} ({g['nodes']}) | {label} | " + " | ".join(cells) + f" | {mc} |")
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--zoo", default=",".join(ZOO))
    ap.add_argument("--random", type=int, default=100)
    ap.add_argument("--random-start", type=int, default=0,
                    help="skip the first this many random networks (the same networks as a full run's later ones)")
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--random-time-limit", type=float, default=10.0)
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--markdown-only", action="store_true")
    opts = ap.parse_args(argv)
    out = Path(opts.out)
    if opts.markdown_only:
        data = json.loads((out / "gaps.json").read_text())
        data["summary"] = summary(data)
        write_markdown(data, out / "RESULTS.md")
        return data
    logging.basicConfig(level=logging.ERROR)
    log = _Warnings()
    logging.getLogger("autoremat.solvers.kusumoto").addHandler(log)
    logging.getLogger("autoremat.solvers.kusumoto").setLevel(logging.INFO)
    zoo_solvers = (*HEURISTICS[:2], "dp-exact", *HEURISTICS[2:])
    data: dict[str, Any] = {"machine": MACHINE, "time_limit_s": opts.time_limit,
                            "random_time_limit_s": opts.random_time_limit, "zoo_solvers": zoo_solvers, "graphs": []}
    out.mkdir(parents=True, exist_ok=True)
    jobs: list[tuple[str, str, Any]] = [("zoo", f"{m} (CPU size)", m) for m in opts.zoo.split(",") if m]
    if opts.random_start < 0:
        raise SystemExit(f"--random-start={opts.random_start} must be >= 0")
    jobs += [("random", g.meta["model"], g)
             for g in random_networks(opts.random_start + opts.random)[opts.random_start:]]
    for part, name, what in jobs:
        print(f"{name}…", flush=True)
        if part == "zoo":
            graph = autoremat.capture(*zoo.build(what, size="small", device="meta"))
            res = run_graph(name, graph, opts.time_limit, zoo_solvers, (0.5, 0.75), log)
        else:
            res = run_graph(name, what, opts.random_time_limit, HEURISTICS, (0.5,), log)
        res["part"] = part
        data["graphs"].append(res)
        data["summary"] = summary(data)
        (out / "gaps.json").write_text(json.dumps(data, indent=1, default=str))  # partial results survive
        write_markdown(data, out / "RESULTS.md")
    print(json.dumps(data["summary"], indent=1, default=str))
    return data


if __name__ == "__main__":
    main(sys.argv[1:])
