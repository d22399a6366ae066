"""What offloading a module-level node's own saved tensors could reach (issue 22): an ESTIMATE.

    python benchmarks/block_internals_estimate.py [--net gpt2] [--fractions 0.8,0.7,0.6]

On a graph captured with one node per repeated block, a block's saved tensors are inside its node
(``extra_saved_bytes``), where no offload plan can move them: offload alone stops at 0.971x of the
peak on the H200's GPT-2 graph. This script does not implement offloading them; it estimates what
it would give by rewriting the graph: each block's saved tensors become the output of a zero-time
node right after the block that saves its own output, so ``offload-dag`` can move them as one unit
(copied out when the block's forward ends, prefetched before its backward). The rewrite frees
them one node early in backward (before the block's own backward, not after), so levels during a
block's backward are understated by up to its saved bytes; the unpatched peak is printed for both
graphs to show whether that matters at the peak. Graphs: ``benchmarks/results/nvidia-h200/offload_gpu``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import autoremat
from autoremat.cost import no_recompute_plan, simulate

GRAPHS = Path(__file__).resolve().parent / "results" / "nvidia-h200" / "offload_gpu"
BLOCK_KINDS = ("gpt2block",)


def split_internals(g: autoremat.Graph, kinds: tuple[str, ...] = BLOCK_KINDS) -> autoremat.Graph:
    """``g`` with each block's saved extras moved into a zero-time node that saves its own output."""
    data = g.to_dict()
    new_id: dict[int, int] = {}
    nodes: list[dict[str, Any]] = []
    for v, d in enumerate(data["nodes"]):
        new_id[v] = len(nodes)
        d = {**d, "saves": [new_id[u] for u in d["saves"]]}
        if d.get("alias_of") is not None:
            d["alias_of"] = new_id[d["alias_of"]]
        internal = d["extra_saved_bytes"] if d["kind"] in kinds else 0
        nodes.append({**d, "extra_saved_bytes": 0} if internal else d)
        if internal:
            nodes.append({**d, "name": d["name"] + ".saved", "kind": "internals", "out_bytes": internal,
                          "alloc_bytes": internal, "saves": [len(nodes)], "time_s": 0.0, "bwd_time_s": 0.0,
                          "fwd_temp_bytes": 0, "bwd_temp_bytes": 0, "extra_saved_bytes": 0, "params": [],
                          "is_output": False, "alias_of": None, "grad_passthrough": False})
    meta = {k: v for k, v in data["meta"].items() if k != "fingerprint"}
    meta["loss_saves"] = [new_id[u] for u in meta.get("loss_saves", [])]
    edges = [[new_id[a], new_id[b]] for a, b in data["edges"]]
    return autoremat.Graph.from_dict({**data, "nodes": nodes, "edges": edges, "meta": meta})


def estimate(net: str, fractions: list[float]) -> list[dict[str, Any]]:
    g = autoremat.Graph.from_json(str(GRAPHS / f"graph_{net}.json"))
    split = split_internals(g)
    base, rewritten = simulate(g, no_recompute_plan(g)), simulate(split, no_recompute_plan(split))
    print(f"{net}: unpatched peak {base.peak_bytes} B (rewritten graph {rewritten.peak_bytes} B), "
          f"step {base.step_time_s * 1e3:.1f} ms", flush=True)
    rows = []
    for frac in fractions:
        t0 = time.perf_counter()
        row: dict[str, Any] = {"net": net, "fraction": frac}
        try:
            plan = autoremat.solve(split, int(frac * base.peak_bytes), solver="offload-dag")
            sim = simulate(split, plan)
            units = sum(split.node(v)["kind"] == "internals" for v in plan.offload)
            row.update(peak_ratio=sim.peak_bytes / base.peak_bytes, time_ratio=sim.step_time_s / base.step_time_s,
                       offloaded=len(plan.offload), units=units, depth=plan.offload_prefetch_depth)
        except autoremat.InfeasibleBudgetError as err:
            row.update(least_ratio=err.min_budget_bytes / base.peak_bytes)
        row["solve_s"] = time.perf_counter() - t0
        print(row, flush=True)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--net", default="gpt2")
    ap.add_argument("--fractions", default="0.8,0.7,0.6")
    a = ap.parse_args(argv)
    return estimate(a.net, [float(f) for f in a.fractions.split(",")])


if __name__ == "__main__":
    main()
