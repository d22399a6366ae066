"""``solver="auto"`` solved twice on the same graphs, by two versions of autoremat side by side.

    python benchmarks/auto_repeat.py --before /tmp/before/src      # the seeded networks of <= 120 nodes
    python benchmarks/auto_repeat.py --before /tmp/before/src --limit 6

The seeded random networks of ``benchmarks/optimum_gaps.py`` (``--bounds``: its ``gaps.json``,
whose budgets and best plans are reused) that ``auto`` asks the lattice search on (at most 120
nodes). Per network one subprocess per version (``--before``: a ``src`` directory put first on
``PYTHONPATH``; "now": the installed package), in turn, so both see the same load; each solves
``auto`` at every stored budget twice in one process (the second solve meets warm caches, as a
longer-running program would) and reports the extra time (the simulator's, without replay tails),
the plan (its segments) and the solve time. Reported: rows whose two solves differ, rows within
5 % of the best plan known (the least extra time any solver of the stored run or of this one found).

Writes ``repeat.json`` and ``RESULTS.md`` under ``--out`` (default ``benchmarks/results/cpu/auto_gaps/repeat``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "cpu"
MACHINE = "x86_64, 2 cores, CPU only, shared/loaded"
MAX_NODES = 120


def worker(index: int, bounds: str) -> None:
    """Solve network ``index`` at its stored budgets, twice each; one JSON line per solve."""
    import autoremat
    from autoremat.errors import InfeasibleBudgetError
    from autoremat.solvers.milp.search import judge

    sys.path.insert(0, str(HERE.parent / "tests"))
    from _graphs import random_networks

    stored = json.loads(Path(bounds).read_text())
    graph = random_networks(100, seed=0, lo=30, hi=300)[index]
    row = stored["graphs"][index]
    assert row["graph"] == graph.meta.get("model") and row["nodes"] == len(graph), (row["graph"], len(graph))
    for label, b in row["budgets"].items():
        for attempt in range(2):
            start = time.perf_counter()
            try:
                plan = autoremat.solve(graph, b["budget_bytes"], solver="auto")
            except InfeasibleBudgetError:
                out = {"infeasible": True}
            else:
                segs = json.dumps([[list(s.nodes), s.recompute] for s in plan.segments])
                out = {"extra_time_s": judge(graph, plan)[1], "chosen": plan.solver,
                       "plan_sha1": hashlib.sha1(segs.encode()).hexdigest()[:12]}
            out.update({"graph": row["graph"], "budget": label, "attempt": attempt,
                        "seconds": time.perf_counter() - start})
            print(json.dumps(out), flush=True)


def _known_best(row: dict[str, Any]) -> float | None:
    vals = [v.get("extra_time_s") for k, v in row.items() if isinstance(v, dict)]
    vals = [v for v in vals if v is not None]
    return min(vals) if vals else None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="the src directory of the version to compare with")
    ap.add_argument("--bounds", default=str(RESULTS / "optimum_gaps" / "random" / "gaps.json"))
    ap.add_argument("--limit", type=int, default=0, help="only the first N networks of <= 120 nodes")
    ap.add_argument("--out", default=str(RESULTS / "auto_gaps" / "repeat"))
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    opts = ap.parse_args(argv)
    if opts.worker is not None:
        worker(opts.worker, opts.bounds)
        return {}
    stored = json.loads(Path(opts.bounds).read_text())
    small = [i for i, g in enumerate(stored["graphs"]) if g["nodes"] <= MAX_NODES]
    if opts.limit:
        small = small[:opts.limit]
    load = os.getloadavg()
    runs: dict[str, list[dict[str, Any]]] = {"before": [], "now": []}
    for n, i in enumerate(small):
        for version in (("before", "now") if n % 2 == 0 else ("now", "before")):
            env = dict(os.environ)
            if version == "before":
                env["PYTHONPATH"] = opts.before + os.pathsep + env.get("PYTHONPATH", "")
            cmd = [sys.executable, __file__, "--before", opts.before, "--bounds", opts.bounds, "--worker", str(i)]
            got = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
            for line in got.splitlines():
                runs[version].append(json.loads(line))
        print(f"{n + 1}/{len(small)} {stored['graphs'][i]['graph']}", flush=True)
    best: dict[tuple[str, str], float | None] = {}
    for g in stored["graphs"]:
        for label, b in g["budgets"].items():
            best[(g["graph"], label)] = _known_best(b)
    for version in runs.values():
        for r in version:
            key = (r["graph"], r["budget"])
            if r.get("extra_time_s") is not None:
                best[key] = r["extra_time_s"] if best.get(key) is None else min(best[key], r["extra_time_s"])
    summary: dict[str, Any] = {"machine": MACHINE, "load_avg_start": load, "load_avg_end": os.getloadavg(),
                               "networks": len(small)}
    for name, version in runs.items():
        pairs: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for r in version:
            pairs.setdefault((r["graph"], r["budget"]), []).append(r)
        differ = [k for k, (a, b) in pairs.items()
                  if (a.get("plan_sha1"), a.get("infeasible")) != (b.get("plan_sha1"), b.get("infeasible"))]
        within = [k for k, rs in pairs.items() if rs[0].get("extra_time_s") is not None and best.get(k) is not None
                  and rs[0]["extra_time_s"] <= 1.05 * best[k] + 1e-15]
        feasible = [k for k, rs in pairs.items() if rs[0].get("extra_time_s") is not None]
        secs = [r["seconds"] for r in version if r["attempt"] == 0]
        summary[name] = {"rows": len(pairs), "two_solves_differ": len(differ), "differ": [list(k) for k in differ],
                         "with_a_plan": len(feasible), "within_5pct_of_best_known": len(within),
                         "solve_s_median": statistics.median(secs) if secs else None,
                         "solve_s_max": max(secs, default=None)}
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "repeat.json").write_text(json.dumps({"summary": summary, "runs": runs}, indent=1))
    print(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
