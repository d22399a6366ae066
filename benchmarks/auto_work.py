"""Calibrate ``auto``'s work limit for the lattice search (``milp.exact.AUTO_WORK``) against the clock.

    python benchmarks/auto_work.py                    # 24 seeded networks of 30-120 nodes + zoo VGG19, U-Net
    python benchmarks/auto_work.py --count 8 --cap 4
    python benchmarks/auto_work.py --limit-only        # only auto's searches at AUTO_WORK, cold
    python benchmarks/auto_work.py --in-auto           # auto itself on the stored <= 120-node networks

``auto`` asks the exact lattice search (:mod:`autoremat.solvers.milp.lattice`) on graphs of at most
120 nodes and 1000 lower sets. It used to stop it after 2 s of wall-clock time, so the same graph
gave different plans at different loads; it now stops after a count of work units (labels taken,
steps generated, steps checked, steps of the cost-to-go DP: :data:`~autoremat.solvers.milp.lattice.LABEL_WORK`
and the others). This script runs the searches ``auto`` runs (least peak; least time at 50 % and at
Chen's least budget, no incumbent) on fresh lattices (cold caches, as ``auto`` meets a new graph)
with no work limit and a wall-clock cap, counts what each search that closed did, fits CPU seconds
(``process_time``, which a loaded machine inflates less than the wall clock) to the counts (the
weights), reports the work units per CPU second with the weights in the code (``AUTO_WORK`` is 2 s
times their median), and runs ``auto``'s calls at ``AUTO_WORK`` where they do not close, for the
seconds the limit buys.

Writes ``work.json`` and ``RESULTS.md`` under ``--out`` (default ``benchmarks/results/cpu/auto_work``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import autoremat
from autoremat import zoo
from autoremat.cost import unoptimised_peak_bytes
from autoremat.cost.bitsets import GraphBits
from autoremat.errors import InfeasibleBudgetError
from autoremat.solvers.chen import chen_plans
from autoremat.solvers.kusumoto.families import all_lower_sets
from autoremat.solvers.milp import lattice as L
from autoremat.solvers.milp.cost_to_go import STEP_WORK, CostToGo
from autoremat.solvers.milp.exact import AUTO_MAX_LOWER_SETS, AUTO_MAX_NODES, AUTO_WORK
from autoremat.solvers.milp.lattice import Lattice

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _graphs import random_networks  # noqa: E402  (the seeded generators the tests use)

HERE = Path(__file__).resolve().parent
OUT = HERE / "results" / "cpu" / "auto_work"
WEIGHTS = (L.LABEL_WORK, L.CHILD_WORK, L.CHECK_WORK)
MACHINE = "x86_64, 2 cores, CPU only, shared/loaded"


def _chen_least(graph: Any) -> int | None:
    return min((p for p, _, _ in chen_plans(graph)), default=None)


def _timed(fn) -> tuple[Any, float, float]:
    w, c = time.process_time(), time.perf_counter()
    out = fn()
    return out, time.process_time() - w, time.perf_counter() - c


def _counts(fn) -> list[float]:
    """(labels taken, steps generated, checks) of a search that closed: run again with one weight
    at a time (the counts are deterministic; the caches warm, so this costs less than the first run)."""
    got = []
    for w in ((1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0)):
        L.LABEL_WORK, L.CHILD_WORK, L.CHECK_WORK = w
        try:
            got.append(fn().work)
        finally:
            L.LABEL_WORK, L.CHILD_WORK, L.CHECK_WORK = WEIGHTS
    return got


def measure(graph: Any, name: str, cap: float) -> list[dict[str, Any]]:
    """The searches ``auto`` runs on ``graph`` (least peak; least time at 50 % and Chen's least,
    no incumbent), each on a fresh lattice, with no work limit: counts (closed ones) and CPU seconds."""
    p = GraphBits(graph)
    fam = all_lower_sets(p, AUTO_MAX_LOWER_SETS)
    if fam is None or len(graph) > AUTO_MAX_NODES:
        return []
    rows = []
    base = {"graph": name, "nodes": len(graph), "lower_sets": len(fam)}
    budgets = {"least peak": None, "50%": int(0.5 * unoptimised_peak_bytes(graph)), "chen least": _chen_least(graph)}
    for label, budget in budgets.items():
        lat = Lattice(p, fam)  # cold, as auto meets a new graph
        steps = 0
        if budget is None:
            ans, cpu, wall = _timed(lambda: lat.least_peak(deadline=time.monotonic() + cap))
        else:
            ctg, cpu0, wall0 = _timed(lambda: CostToGo(lat, budget, deadline=time.monotonic() + cap))
            if ctg.table is None:
                continue
            lat._ctg = {budget: ctg}
            steps = ctg.work / STEP_WORK
            ans, cpu, wall = _timed(lambda: lat.least_time(budget, deadline=time.monotonic() + cap))
            cpu, wall = cpu + cpu0, wall + wall0
        row = {**base, "search": label, "status": ans.status, "cpu_s": cpu, "wall_s": wall, "work": ans.work}
        if ans.status != "time_limit":
            again = (lambda: lat.least_peak()) if budget is None else (lambda: lat.least_time(budget))
            row["counts"] = [c - (ctg.work if budget is not None else 0) for c in _counts(again)] + [steps]
        rows.append(row)
    return rows


def at_the_limit(graph: Any, name: str) -> list[dict[str, Any]]:
    """``auto``'s own calls with :data:`AUTO_WORK` on a fresh lattice where they do not close: the
    CPU and wall seconds the limit buys (2 s on an idle machine is the target)."""
    p = GraphBits(graph)
    fam = all_lower_sets(p, AUTO_MAX_LOWER_SETS)
    if fam is None or len(graph) > AUTO_MAX_NODES:
        return []
    out = []
    for label, budget in {"least peak": None, "50%": int(0.5 * unoptimised_peak_bytes(graph)),
                          "chen least": _chen_least(graph)}.items():
        lat = Lattice(p, fam)
        ans, cpu, wall = _timed(lambda: lat.least_peak(work=AUTO_WORK) if budget is None
                                else lat.least_time(budget, work=AUTO_WORK))
        if ans.status == "time_limit":
            out.append({"graph": name, "nodes": len(graph), "search": label, "work": ans.work, "cpu_s": cpu,
                        "wall_s": wall})
    return out


def in_auto(out: Path) -> dict[str, Any]:
    """``auto`` itself on the seeded networks of ``benchmarks/optimum_gaps.py`` that it asks the
    lattice on (<= 120 nodes), at their stored budgets in turn (warm caches and incumbents, as
    ``auto`` runs): each lattice search's status, work and CPU seconds; the ones the limit stopped
    are what :data:`AUTO_WORK` costs."""
    stored = json.loads((HERE / "results" / "cpu" / "optimum_gaps" / "random" / "gaps.json").read_text())
    nets = random_networks(100, seed=0, lo=30, hi=300)
    log: list[dict[str, Any]] = []
    real = {"least_time": Lattice.least_time, "least_peak": Lattice.least_peak}

    def wrap(name: str):
        def run(self, *a, **k):  # type: ignore[no-untyped-def]
            ans, cpu, wall = _timed(lambda: real[name](self, *a, **k))
            log.append({"search": name, "status": ans.status, "work": ans.work, "cpu_s": cpu, "wall_s": wall})
            return ans
        return run

    load = os.getloadavg()
    try:
        Lattice.least_time, Lattice.least_peak = wrap("least_time"), wrap("least_peak")
        for i, row in enumerate(stored["graphs"]):
            if row["nodes"] > AUTO_MAX_NODES:
                continue
            for label, b in row["budgets"].items():
                try:
                    autoremat.solve(nets[i], b["budget_bytes"], solver="auto")
                except InfeasibleBudgetError:
                    pass
    finally:
        Lattice.least_time, Lattice.least_peak = real["least_time"], real["least_peak"]
    stopped = [r for r in log if r["status"] == "time_limit"]
    cpu = sorted(r["cpu_s"] for r in stopped)
    summary = {"machine": MACHINE, "load_avg_start": load, "load_avg_end": os.getloadavg(), "AUTO_WORK": AUTO_WORK,
               "searches": len(log), "stopped_by_the_limit": len(stopped),
               "stopped_cpu_s": [round(c, 2) for c in cpu], "stopped_cpu_s_median": statistics.median(cpu) if cpu else None,
               "closed_work_max": max((r["work"] for r in log if r["status"] != "time_limit"), default=None)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "in_auto.json").write_text(json.dumps({"summary": summary, "searches": log}, indent=1))
    print(json.dumps(summary, indent=1))
    return summary


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=24)
    ap.add_argument("--cap", type=float, default=8.0, help="wall-clock cap per search (s)")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--limit-only", action="store_true", help="only auto's calls at AUTO_WORK (no fit)")
    ap.add_argument("--in-auto", action="store_true", help="the lattice searches of auto itself on the stored networks")
    opts = ap.parse_args(argv)
    if opts.in_auto:
        return in_auto(Path(opts.out))
    graphs = [(f"{g.graph.get('name', 'random')}-{i}" if hasattr(g, "graph") else f"random-{i}", g)
              for i, g in enumerate(random_networks(opts.count, seed=0, lo=30, hi=AUTO_MAX_NODES))]
    for model in ("vgg19", "unet"):
        graphs.append((f"{model} (CPU size)", autoremat.capture(*zoo.build(model, size="small", device="meta"))))
    load = os.getloadavg()
    rows: list[dict[str, Any]] = []
    limit: list[dict[str, Any]] = []
    for name, g in graphs:
        for r in [] if opts.limit_only else measure(g, name, opts.cap):
            print(json.dumps(r), flush=True)
            rows.append(r)
        for r in at_the_limit(g, name):
            print("at AUTO_WORK:", json.dumps(r), flush=True)
            limit.append(r)
    closed = [r for r in rows if "counts" in r]
    x = np.array([[c[0] + c[1], c[2], c[3]] for c in (r["counts"] for r in closed)], dtype=float)
    y = np.array([r["cpu_s"] for r in closed])
    fit = np.linalg.lstsq(x, y, rcond=None)[0] if len(closed) >= 3 else None
    weights = np.array([L.LABEL_WORK, L.CHECK_WORK, STEP_WORK], dtype=float)
    rates = [float(u / t) for u, t in zip(x @ weights, y) if t >= 0.3] if len(closed) else []
    summary = {"machine": MACHINE, "load_avg_start": load, "load_avg_end": os.getloadavg(),
               "searches": len(rows), "closed": len(closed),
               "fit_s_per_unit": None if fit is None else {"label or step": fit[0], "check": fit[1],
                                                            "cost-to-go step": fit[2]},
               "weights": {"LABEL_WORK": L.LABEL_WORK, "CHILD_WORK": L.CHILD_WORK, "CHECK_WORK": L.CHECK_WORK,
                           "STEP_WORK": STEP_WORK},
               "units_per_cpu_s_over_0.3s": {"n": len(rates), "min": min(rates, default=None),
                                             "median": statistics.median(rates) if rates else None,
                                             "max": max(rates, default=None)},
               "AUTO_WORK": AUTO_WORK,
               "at_AUTO_WORK": {"n": len(limit), "cpu_s": sorted(round(r["cpu_s"], 2) for r in limit),
                                "wall_s": sorted(round(r["wall_s"], 2) for r in limit)}}
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    if opts.limit_only:
        summary = {k: summary[k] for k in ("machine", "load_avg_start", "load_avg_end", "weights", "AUTO_WORK",
                                           "at_AUTO_WORK")}
        (out / "at_limit.json").write_text(json.dumps({"summary": summary, "at_AUTO_WORK": limit}, indent=1))
        print(json.dumps(summary, indent=1))
        return summary
    (out / "work.json").write_text(json.dumps({"summary": summary, "rows": rows, "at_AUTO_WORK": limit}, indent=1,
                                              default=float))
    print(json.dumps(summary, indent=1, default=float))
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
