"""``solve(auto)`` on measured captures of zoo models: the reference solve kept per process.

    python -P benchmarks/reference_speed.py [--models resnet50 ...] [--budgets 50%,75%,min]
                                            [--rounds 3] [--out DIR]

Every ``auto`` solve of a measured capture solves the graph twice, once on its times and once
on the reference costs (:mod:`autoremat.solvers.stable`). Per model, two captures ``A`` and
``B`` (CPU size, measured times, taken once at the start), then ``--rounds`` rounds, each of:

* *cold*: each budget on a fresh copy of ``A`` with the reference memo cleared first
  (:func:`~autoremat.solvers.stable.clear_reference_memo`): a fresh reference graph per solve, the
  path every solve took before the memo; and the same for ``B``;
* *kept*: the memo cleared once, then each budget on a fresh copy of ``A`` in turn (*sweep*: the
  later budgets solve the same reference graph, whose per-graph caches, the chain beam's replays
  among them, serve them), then each budget on a fresh copy of ``B`` (*recapture*: a memo hit
  where ``B``'s reference costs, the mean node time rounded to a power of two, equal ``A``'s;
  else a sweep of its own).

Every kept plan is checked equal to the cold plan of the same capture and budget (the whole
``Plan.to_dict()``, predictions and the stability record included); a difference is reported and
the exit status is 1. Reported: the median seconds per row over the rounds and the ratios; the
machine and the load average before and after. Writes ``reference_speed.json`` and ``.md`` under
``--out`` (default: printed only).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["MODELS", "capture_pair", "timed", "run", "main"]

MODELS = ("resnet50", "densenet121", "googlenet", "unet", "inception_v3")
"""The zoo models measured by default (CPU size)."""


def capture_pair(model: str) -> tuple[Any, Any]:
    """Two measured captures of ``model`` at CPU size."""
    import autoremat
    from autoremat import zoo

    return tuple(autoremat.capture(*zoo.build(model, size="small")) for _ in range(2))  # type: ignore[return-value]


def timed(graph: Any, budget: str) -> tuple[float, dict[str, Any] | None]:
    """Seconds of ``solve(graph.copy(), budget)`` and the plan as a dict (``None``: infeasible)."""
    from autoremat import solve
    from autoremat.errors import InfeasibleBudgetError

    g = graph.copy()
    start = time.perf_counter()
    try:
        plan: dict[str, Any] | None = solve(g, budget).to_dict()
    except InfeasibleBudgetError:
        plan = None
    return time.perf_counter() - start, plan


def run(models: list[str], budgets: list[str], rounds: int) -> dict[str, Any]:
    """The rows (see the module docstring) and the plan mismatches."""
    from autoremat.solvers.stable import clear_reference_memo, reference_graph

    caps = {m: capture_pair(m) for m in models}
    times: dict[tuple[str, str, str], list[float]] = {}
    mismatches: list[str] = []
    for r in range(rounds):
        for m in models:
            a, b = caps[m]
            cold: dict[tuple[str, str], dict | None] = {}
            for name, g in (("A", a), ("B", b)):
                for bud in budgets:
                    clear_reference_memo()
                    s, cold[(name, bud)] = timed(g, bud)
                    times.setdefault((m, bud, f"cold {name}"), []).append(s)
            clear_reference_memo()
            for name, g, label in (("A", a, "sweep A"), ("B", b, "recapture B")):
                for bud in budgets:
                    s, plan = timed(g, bud)
                    times.setdefault((m, bud, label), []).append(s)
                    if plan != cold[(name, bud)]:
                        mismatches.append(f"round {r}: {m} {name} at {bud}: the kept plan differs from the cold one")
            print(f"round {r + 1}/{rounds} {m} done", file=sys.stderr, flush=True)
    same_t = {m: reference_graph(caps[m][0]).node(0)["time_s"] == reference_graph(caps[m][1]).node(0)["time_s"]
              for m in models}
    rows = []
    for m in models:
        for bud in budgets:
            med = {k: statistics.median(times[(m, bud, k)]) for k in ("cold A", "sweep A", "cold B", "recapture B")}
            rows.append({"model": m, "nodes": len(caps[m][0]), "budget": bud, **{k: round(v, 3) for k, v in med.items()},
                         "sweep x": round(med["cold A"] / med["sweep A"], 2),
                         "recapture x": round(med["cold B"] / med["recapture B"], 2),
                         "same reference costs": same_t[m]})
    return {"rows": rows, "mismatches": mismatches}


def _markdown(out: dict[str, Any]) -> str:
    cols = ["model", "nodes", "budget", "cold A", "sweep A", "sweep x", "cold B", "recapture B", "recapture x",
            "same reference costs"]
    lines = [f"# solve(auto) on measured captures, reference plans kept per process ({out['machine']})", "",
             f"Command: `{out['command']}`; {out['rounds']} rounds, medians in seconds; load average "
             f"{out['load_before']} before, {out['load_after']} after. Plans: "
             f"{'all kept plans equal to the cold ones' if not out['mismatches'] else '; '.join(out['mismatches'])}.",
             "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(row[c]) for c in cols) + " |" for row in out["rows"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--budgets", default="50%,75%,min")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    load_before = [round(x, 2) for x in os.getloadavg()]
    out = run(args.models, args.budgets.split(","), args.rounds)
    out.update(machine=f"{platform.machine()}, {os.cpu_count()} cores, CPU only", rounds=args.rounds,
               command="python -P benchmarks/reference_speed.py " + " ".join(argv if argv is not None else sys.argv[1:]),
               load_before=load_before, load_after=[round(x, 2) for x in os.getloadavg()])
    text = _markdown(out)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "reference_speed.json").write_text(json.dumps(out, indent=1) + "\n")
        Path(args.out, "reference_speed.md").write_text(text)
    return 1 if out["mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
