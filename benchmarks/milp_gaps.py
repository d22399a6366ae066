"""Every solver against the proven optimum (the ``milp`` solver's bound) on the zoo and random DAGs.

    python benchmarks/milp_gaps.py                                   # the 7 zoo models, ~40 min on 2 cores
    python benchmarks/milp_gaps.py --models vgg19,resnet50 --random 2 --time-limit 30
    python benchmarks/milp_gaps.py --quick --out /tmp/gaps           # one tiny random DAG
    python benchmarks/milp_gaps.py --size paper --random 0 --out benchmarks/results/cpu/milp_gaps/paper
    python benchmarks/milp_gaps.py --tails --random 0 --out /tmp/gaps_as_run   # priced as plans run

For each graph (zoo models at CPU size, or at the papers' sizes with ``--size paper``, captured on
the meta device, so no size runs out of host memory; seeded random DAGs: chains
with skips and U-Net-like graphs) and each solver (``chen``, ``dp-approx``, ``dp-exact``,
``xla-greedy``, ``reforward``, ``auto``, ``milp``):

* the least budget (the ``min_budget_bytes`` of the error it raises at budget 0; for ``milp`` the
  memory-centric search within ``--time-limit``, with its proven lower bound);
* at ``milp``'s least budget (where it found one), at 75 % and 50 % of the unoptimised step peak
  (where at or above it) and at Chen's least budget: its extra time
  without replay tails (the cost every solver optimises,
  :func:`autoremat.solvers.milp.search.judge`) and its gap to the optimum's proven lower bound
  (``milp`` within ``--time-limit``, every other solver's plan as an incumbent, k = 12 or the
  most segments of those plans):
  ``(extra - bound) / extra``;
* per budget, ``auto``'s extra time as its plan runs (finalised: with its replay tails, which
  ``auto`` compares its candidates by) beside the optimum's plan finalised the same way (the
  optimum is proven without tails, so ``auto`` can be below it there: U-Net at the papers' size).

``--tails``: every extra time and the optimum priced as the plans run instead (each recomputed
segment replayed to its tail; ``milp``'s ``tails`` option, :func:`autoremat.solvers.milp.optimality_gap`'s),
the terms ``auto`` chooses its plans in.

Writes ``gaps.json`` and ``RESULTS.md`` under ``--out`` (default
``benchmarks/results/cpu/milp_gaps``). Solver times are wall-clock on whatever machine runs it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

import networkx as nx

import autoremat
from autoremat import zoo
from autoremat.errors import InfeasibleBudgetError
from autoremat.graph import Graph
from autoremat.plan import Plan
from autoremat.cost import unoptimised_peak_bytes
from autoremat.solvers import finalize_plan
from autoremat.solvers.milp import Gap, optimality_gap
from autoremat.solvers.milp.search import judge

SOLVERS = ("chen", "dp-approx", "dp-exact", "xla-greedy", "reforward", "auto", "milp")
FRACTIONS = (0.75, 0.5)
DEFAULT_MODELS = ("vgg19", "resnet50", "unet", "densenet121", "googlenet", "inception_v3", "pspnet")
OUT = Path(__file__).resolve().parent / "results" / "cpu" / "milp_gaps"
TAILS = False
"""``--tails``: extra times and bounds as the plans run (replays to their tails), not replayed whole."""
SIZES = {"small": "CPU size", "paper": "paper size"}
"""``--size``: the zoo's size name -> the label the tables give it."""


def zoo_graphs(models: list[str], size: str) -> list[tuple[str, Any]]:
    """``(label, build)`` of each zoo model at ``size``, captured on the meta device (FLOP times)."""
    if size not in SIZES:
        raise ValueError(f"size={size!r}: expected one of {sorted(SIZES)}")
    return [(f"{m} ({SIZES[size]})", lambda m=m: autoremat.capture(*zoo.build(m, size=size, device="meta")))
            for m in models]


def chain_with_skips(seed: int, n: int) -> Graph:
    rng = random.Random(seed)
    g = nx.DiGraph()
    for v in range(n):
        size = rng.randint(1, 40) * 1024
        g.add_node(v, name=f"n{v}", out_bytes=size, alloc_bytes=size, time_s=rng.randint(1, 9) * 1e-3,
                   bwd_time_s=2e-3, saves=(v,) if rng.random() < 0.8 else (), is_output=v == n - 1,
                   extra_saved_bytes=rng.choice([0, 0, 512]), params=(f"p{v}",) if rng.random() < 0.3 else ())
        if v:
            g.add_edge(v - 1, v)
        if v > 3 and rng.random() < 0.3:
            g.add_edge(rng.randrange(v - 3), v)
    params = {f"p{v}": 2048 for v in range(n)}
    return Graph(g, {"mode": "synthetic", "loss_saves": [n - 1], "param_bytes": params,
                     "model": f"chain-skips-{n}-seed{seed}"})


def unet_like(seed: int, depth: int) -> Graph:
    """Down path of ``depth`` levels, up path mirroring it, a skip from each down level to its up level."""
    rng = random.Random(seed)
    g = nx.DiGraph()
    n = 2 * depth + 1
    sizes = [max(1, 64 >> min(i, n - 1 - i)) * 1024 * rng.randint(1, 3) for i in range(n)]
    for v in range(n):
        g.add_node(v, name=f"u{v}", out_bytes=sizes[v], alloc_bytes=sizes[v], time_s=rng.randint(1, 9) * 1e-3,
                   bwd_time_s=2e-3, saves=(v,), is_output=v == n - 1)
        if v:
            g.add_edge(v - 1, v)
    for i in range(depth - 1):  # the innermost level is already adjacent to its mirror
        g.add_edge(i, n - 1 - i)
    return Graph(g, {"mode": "synthetic", "loss_saves": [n - 1], "model": f"unet-like-{n}-seed{seed}"})


def _least(graph: Graph, solver: str, time_limit: float) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        if solver == "milp":
            from autoremat.solvers.milp import _least_peak, _config  # the outcome with its bound

            out = _least_peak(graph, _config({"time_limit_s": time_limit}))
            return {"bytes": out.cost, "bound_bytes": out.bound, "status": out.status,
                    "seconds": time.perf_counter() - start}
        autoremat.solve(graph, 0, solver=solver)
        return {"bytes": 0, "seconds": time.perf_counter() - start}
    except InfeasibleBudgetError as err:
        return {"bytes": err.min_budget_bytes, "seconds": time.perf_counter() - start}
    except Exception as err:  # noqa: BLE001 - a benchmark records what failed and goes on
        return {"error": f"{type(err).__name__}: {err}", "seconds": time.perf_counter() - start}


def _at(graph: Graph, budget: int, time_limit: float) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    plans: dict[str, Plan] = {}
    for solver in SOLVERS[:-1]:
        start = time.perf_counter()
        try:
            plan = autoremat.solve(graph, budget, solver=solver)
            peak, extra = judge(graph, plan, tails=TAILS)
            rows[solver] = {"extra_time_s": extra, "predicted_extra_time_s": plan.predicted_extra_time_s,
                            "peak_bytes": plan.predicted_peak_bytes, "segments": len(plan.segments),
                            "seconds": time.perf_counter() - start, "chosen": plan.solver}
            plans[solver] = plan
        except InfeasibleBudgetError as err:
            rows[solver] = {"infeasible": True, "min_budget_bytes": err.min_budget_bytes,
                            "seconds": time.perf_counter() - start}
        except Exception as err:  # noqa: BLE001 - a benchmark records what failed and goes on
            rows[solver] = {"error": f"{type(err).__name__}: {err}", "seconds": time.perf_counter() - start}
    # milp, seeded with every plan above (and its own seeds), k = 12: its plan and the proven bound
    best = min(plans.values(), key=lambda p: judge(graph, p, tails=TAILS)[1], default=None)
    start = time.perf_counter()
    if best is None:  # no other solver fits (below their least budgets): milp alone, its own bound
        try:
            mine = autoremat.solve(graph, budget, solver="milp", time_limit_s=time_limit, tails=TAILS)
        except (InfeasibleBudgetError, RuntimeError) as err:
            rows["milp"] = {"error": f"{type(err).__name__}: {err}", "seconds": time.perf_counter() - start}
            return rows
        o = mine.options
        extra = judge(graph, mine, tails=TAILS)[1]
        gap = Gap(extra, o["optimum_bound_s"], o["optimality_gap"], o["milp_status"] == "optimal",
                  mine, extra, o["k"], o["milp_bound_basis"], tails=TAILS)
    else:
        gap = optimality_gap(graph, best, budget, time_limit_s=time_limit, tails=TAILS)  # k: 12 or the longest seed
        mine = gap.optimum_plan
    bound = gap.bound_s
    rows["milp"] = {"extra_time_s": gap.optimum_extra_time_s, "segments": None if mine is None else len(mine.segments),
                    "seconds": time.perf_counter() - start, "proven_optimal": gap.proven_optimal, "bound_s": bound,
                    "predicted_extra_time_s": as_run(graph, mine, budget)}
    rows["optimum"] = {"bound_s": bound, "proven_optimal": gap.proven_optimal, "k": gap.k, "basis": gap.basis}
    for solver in [*plans, "milp"]:
        row = rows[solver]
        extra = row.get("extra_time_s")
        if extra is None:
            continue
        row["gap_to_bound"] = 0.0 if extra <= 0 else max(0.0, (extra - bound) / extra)
        row["outside_k"] = bool(row.get("segments") and row["segments"] > gap.k)
    return rows


def as_run(graph: Graph, plan: Plan | None, budget: int) -> float | None:
    """``plan``'s extra time as it runs: finalised (its replay tails, what every solver's plan gets
    through ``solve``); ``None`` where it has none or no longer fits once finalised."""
    if plan is None:
        return None
    try:
        return finalize_plan(graph, Plan.from_dict(plan.to_dict()), budget, "milp").predicted_extra_time_s
    except (InfeasibleBudgetError, ValueError):
        return None


def as_run_line(res: dict[str, Any]) -> str:
    """Per budget, ``auto``'s extra time as it runs beside the optimum's plan's (both finalised)."""
    cells = []
    for label, row in res["budgets"].items():
        mine, opt = row.get("auto", {}).get("predicted_extra_time_s"), row.get("milp", {}).get("predicted_extra_time_s")
        if mine is not None and opt:
            cells.append(f"{label}: {mine * 1e3:.4g} ms against {opt * 1e3:.4g} ms ({mine / opt:.3f}x)")
    return ("As the plans run (finalised, with their replay tails): `auto` against `milp`'s plan, " + "; ".join(cells)
            + ".") if cells else ""


def memory_digest(graph: Graph) -> str:
    """A hash of everything but the times in ``graph``'s nodes and meta: bounds proven on a graph hold for
    another only when it is equal (the node count and unoptimised peak miss, e.g., ``first_grad_view``)."""
    doc = graph.to_dict()
    for d in doc["nodes"]:
        d.pop("time_s", None)
        d.pop("bwd_time_s", None)
    meta = {k: v for k, v in doc.get("meta", {}).items() if "time" not in k and k != "fingerprint"}
    return hashlib.sha256(json.dumps([doc["nodes"], meta], sort_keys=True, default=str).encode()).hexdigest()[:16]


def run_graph(name: str, graph: Graph, time_limit: float) -> dict[str, Any]:
    peak = unoptimised_peak_bytes(graph)
    res: dict[str, Any] = {"graph": name, "nodes": len(graph), "unoptimised_peak_bytes": peak,
                           "memory_digest": memory_digest(graph), "least": {}, "budgets": {}}
    for solver in SOLVERS:
        res["least"][solver] = _least(graph, solver, time_limit)
        print(f"  {name}: least budget {solver}: {res['least'][solver]}", flush=True)
    least = res["least"]["milp"].get("bytes")
    budgets = {"least": int(least)} if isinstance(least, (int, float)) else {}
    budgets.update({f"{f:.0%}": int(peak * f) for f in FRACTIONS if least is None or peak * f >= least})
    if isinstance(res["least"]["chen"].get("bytes"), int):
        budgets["Chen's least"] = res["least"]["chen"]["bytes"]
    for label, budget in budgets.items():
        res["budgets"][label] = _at(graph, budget, time_limit)
        res["budgets"][label]["budget_bytes"] = budget
        print(f"  {name}: {label}: " + json.dumps(res["budgets"][label], default=str)[:600], flush=True)
    return res


def _fmt_gap(row: dict[str, Any]) -> str:
    if "error" in row:
        return "not run (no other plan)" if "no solver found" in str(row["error"]) else "error"
    if row.get("infeasible"):
        return "infeasible"
    gap = row.get("gap_to_bound")
    if row.get("extra_time_s") is None:
        return "no plan"
    mark = " †" if row.get("outside_k") else ""
    return f"{row['extra_time_s'] * 1e3:.3g} ms" + ("" if gap is None else f" ({100 * gap:.1f} %)") + mark


def target_rows(data: dict[str, Any]) -> list[str]:
    """The target's table: per graph, ``milp``'s proven gap at its least budget and at 50 % (a
    50 % budget below the proven least budget counts as met: it is proven infeasible)."""
    lines = ["| graph | gap at the least budget | gap at 50 % | within 1 % at both |", "|---|---|---|---|"]
    for res in data["graphs"]:
        cells, met = [], True
        for label in ("least", "50%"):
            row = res["budgets"].get(label)
            if row is None and label == "50%":
                half = int(res["unoptimised_peak_bytes"] * 0.5)
                proven = (res["least"]["milp"].get("bound_bytes") or 0) > half
                cells.append("proven infeasible" if proven else "below the least budget found, not proven infeasible")
                met &= proven
                continue
            gap = None if row is None else row.get("milp", {}).get("gap_to_bound")
            if gap is None:
                cells.append("no plan")
                met = False
                continue
            cells.append(f"{100 * gap:.2f} %" + (" (proven optimal)" if row["milp"].get("proven_optimal") else ""))
            met &= gap <= 0.01
        lines.append(f"| {res['graph']} | " + " | ".join(cells) + f" | {'yes' if met else 'no'} |")
    return lines


def write_markdown(data: dict[str, Any], path: Path) -> None:
    lines = ["# Every solver against the proven optimum (`milp`)", "",
             f"Machine: {data['machine']}. Time limit per `milp` search: {data['time_limit_s']} s. "
             + ("Extra time is as the plans run (each recomputed segment replayed to its tail, what `auto` "
                "chooses by; `milp`'s `tails`); the " if data.get("tails") else
                "Extra time is the simulator's without replay tails (what every solver optimises); the ")
             + "percentage is the gap to the optimum's proven lower bound, `(extra - bound) / extra`, "
             "over canonical strategies of at most k segments (k = 12, or the most segments of a plan "
             "compared; † : the plan has more, so the bound does not cover it). The `milp` row is the milp search seeded with every other "
             "solver's plan at that budget, within the time limit (alone where no other solver fits); "
             "its least budget is the memory-centric search's (with its proven lower bound).", "",
             *([data["note"], ""] if data.get("note") else []),
             "## Target: `milp` proves a gap of at most 1 % at the least budget and at 50 %", "",
             *target_rows(data), ""]
    for res in data["graphs"]:
        lines += [f"## {res['graph']} ({res['nodes']} nodes, unoptimised peak {res['unoptimised_peak_bytes']} bytes)",
                  "", "| solver | least budget (bytes) | " + " | ".join(
                      f"extra time at {f} ({res['budgets'][f].get('budget_bytes')} B)" for f in res["budgets"]) + " |",
                  "|---|---|" + "---|" * len(res["budgets"])]
        for solver in SOLVERS:
            least = res["least"].get(solver, {})
            lb = least.get("bytes", least.get("error", "?"))
            if solver == "milp" and "bound_bytes" in least:
                lb = f"{lb} (bound {least['bound_bytes']}, {least['status']})"
            cells = [_fmt_gap(res["budgets"][f].get(solver, {"error": 1})) for f in res["budgets"]]
            lines.append(f"| {solver} | {lb} | " + " | ".join(cells) + " |")
        opt = [f"{f}: bound {res['budgets'][f]['optimum']['bound_s'] * 1e3:.4g} ms, k = {res['budgets'][f]['optimum']['k']}"
               f"{' (proven optimal)' if res['budgets'][f]['optimum']['proven_optimal'] else ''}"
               f"{', ' + res['budgets'][f]['optimum']['basis'] if res['budgets'][f]['optimum'].get('basis') else ''}"
               for f in res["budgets"] if "optimum" in res["budgets"][f]]
        lines += ["", "Optimum: " + "; ".join(opt), ""]
        run = as_run_line(res)
        lines += [run, ""] if run else []
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS))
    ap.add_argument("--random", type=int, default=2, help="seeded random DAGs of each family")
    ap.add_argument("--nodes", type=int, default=30)
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--size", choices=sorted(SIZES), default="small",
                    help="the zoo models' size: the CPU size (default) or the papers' (meta device)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tails", action="store_true", help="price plans as they run (replays to their tails)")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--markdown-only", action="store_true", help="rewrite RESULTS.md from gaps.json")
    opts = ap.parse_args(argv)
    if opts.markdown_only:
        data = json.loads((Path(opts.out) / "gaps.json").read_text())
        write_markdown(data, Path(opts.out) / "RESULTS.md")
        return data
    logging.basicConfig(level=logging.WARNING)
    global TAILS
    TAILS = opts.tails
    graphs: list[tuple[str, Any]] = []
    if opts.quick:
        graphs.append(("chain-skips-12-seed0", lambda: chain_with_skips(0, 12)))
        opts.time_limit = min(opts.time_limit, 10.0)
    else:
        graphs += zoo_graphs([m for m in opts.models.split(",") if m], opts.size)
        for s in range(opts.random):
            graphs.append((f"chain-skips-{opts.nodes}-seed{s}", lambda s=s: chain_with_skips(s, opts.nodes)))
            graphs.append((f"unet-like-{opts.nodes + 1}-seed{s}", lambda s=s: unet_like(s, opts.nodes // 2)))
    machine = f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}, CPU only"
    data: dict[str, Any] = {"machine": machine, "time_limit_s": opts.time_limit, "solvers": list(SOLVERS),
                            "fractions": list(FRACTIONS), "tails": TAILS, "graphs": []}
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, make in graphs:
        print(f"{name}…", flush=True)
        data["graphs"].append(run_graph(name, make(), opts.time_limit))
        (out / "gaps.json").write_text(json.dumps(data, indent=1, default=str))  # partial results survive
        write_markdown(data, out / "RESULTS.md")
    return data


if __name__ == "__main__":
    main(sys.argv[1:])
