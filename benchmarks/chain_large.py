"""``auto`` on the zoo graphs above the chain search's node limit, with the limit as it is and raised.

    python benchmarks/chain_large.py                          # inception_v3 (314 nodes), densenet121 (431)
    python benchmarks/chain_large.py densenet121
    python benchmarks/chain_large.py inception_v3 16,32,64       # windows (CHAIN_WINDOW) to try

Issue 28: ``auto``'s chain search (:mod:`autoremat.solvers.milp.chain`) runs on graphs of at most
:data:`~autoremat.solvers.milp.chain.CHAIN_MAX_NODES` (1000) nodes, windowed above
:data:`~autoremat.solvers.milp.chain.CHAIN_FULL_NODES` (300; it ran only up to 300 before). For each
model and each budget stored by ``benchmarks/milp_gaps.py`` this solves ``auto`` on a fresh capture
(meta device, CPU size; cold caches) with the limit at 300 (the search off on these graphs) and as
the code has it, and prints one JSON line: auto's extra time
(the simulator's, without replay tails), its chosen solver, the ratio to the best plan ``milp``
found there, and the solve time (wall and CPU).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import autoremat
from autoremat import zoo
from autoremat.errors import InfeasibleBudgetError
from autoremat.solvers.milp import chain as chain_mod
from autoremat.solvers.milp.search import judge

BOUNDS = Path(__file__).resolve().parent / "results" / "cpu" / "milp_gaps" / "gaps.json"


def main(argv: list[str]) -> None:
    stored = json.loads(BOUNDS.read_text())
    models = (argv[0] if argv else "inception_v3,densenet121").split(",")
    windows = [int(w) for w in argv[1].split(",")] if len(argv) > 1 else [chain_mod.CHAIN_WINDOW]
    default, window = chain_mod.CHAIN_MAX_NODES, chain_mod.CHAIN_WINDOW
    try:
        for model in models:
            row = next(g for g in stored["graphs"] if g["graph"].startswith(model + " (CPU size)"))
            for label, b in row["budgets"].items():
                best = b.get("milp", {}).get("extra_time_s")
                for limit, w in [(300, window)] + [(default, w) for w in windows]:
                    chain_mod.CHAIN_MAX_NODES, chain_mod.CHAIN_WINDOW = limit, w
                    g = autoremat.capture(*zoo.build(model, size="small", device="meta"))  # fresh caches
                    wall, cpu = time.perf_counter(), time.process_time()
                    try:
                        plan = autoremat.solve(g, b["budget_bytes"], solver="auto")
                        extra, chosen = judge(g, plan)[1], plan.solver
                    except InfeasibleBudgetError:
                        extra, chosen = None, "infeasible"
                    print(json.dumps({"model": model, "nodes": len(g), "budget": label, "chain_max_nodes": limit, "window": w,
                                      "extra_s": extra, "chosen": chosen, "best_known_s": best,
                                      "over_best": None if extra is None or not best else extra / best,
                                      "wall_s": round(time.perf_counter() - wall, 2),
                                      "cpu_s": round(time.process_time() - cpu, 2)}), flush=True)
    finally:
        chain_mod.CHAIN_MAX_NODES, chain_mod.CHAIN_WINDOW = default, window


if __name__ == "__main__":
    main(sys.argv[1:])
