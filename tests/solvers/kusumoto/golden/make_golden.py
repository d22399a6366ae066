"""Write ``reference.json.gz``: what the frozen Kusumoto reference returns on the golden cases.

The reference is the implementation of ``dp-exact`` / ``dp-approx`` as it was before the speed
work (commit c114895), kept until 2026-11 as ``tests/solvers/test_kusumoto_reference.py`` (1,635
lines) and run beside the optimised solvers on every test run. Its answers do not change, so they
are kept as data: this script takes the file from git history (``--commit``), runs it on the
cases below and writes every answer the tests compare with (``tests/solvers/kusumoto/test_golden.py``)
together with the graphs themselves (the zoo graphs as captured when the data was made, so a
change to capture does not change the cases).

    python tests/solvers/kusumoto/golden/make_golden.py [--commit REV] [--out PATH]

It takes a few minutes (the reference is the slow implementation). Run it only to add cases;
the answers of the existing ones are the reference's and must not change.
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[3]
sys.path.insert(0, str(ROOT / "tests"))

from _graphs import random_dag, random_dag_with_views  # noqa: E402
from _plans import dp_outcome  # noqa: E402

from autoremat.cost import unoptimised_peak_bytes  # noqa: E402
from autoremat.graph import Graph  # noqa: E402

REFERENCE_COMMIT = "9ca1355dcb018778070ef3ca71439c894d5b90b3"
REFERENCE_PATH = "tests/solvers/test_kusumoto_reference.py"
ZOO = ("vgg19", "resnet50", "googlenet", "unet", "pspnet", "mlp")
NO_LIMIT = {"max_lower_sets": 10**6}


def load_reference(commit: str) -> types.ModuleType:
    """The frozen reference module, read from git at ``commit``."""
    text = subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:{REFERENCE_PATH}"], check=True,
                          capture_output=True, text=True).stdout
    text = text.replace("from autoremat.simulate import", "from autoremat.cost import")
    mod = types.ModuleType("kusumoto_reference")
    exec(compile(text, f"{commit[:7]}:{REFERENCE_PATH}", "exec"), mod.__dict__)
    return mod


def jsonable(value: Any) -> Any:
    """``value`` as JSON gives it back (tuples become lists)."""
    return json.loads(json.dumps(value))


def budgets_of(ref: Any, graph: Graph, solver: str, config: dict) -> list[int]:
    least = ref.min_budget(graph, solver, config=config or None)
    peak = unoptimised_peak_bytes(graph)
    return sorted({max(least - 1, 0), least, (3 * least + peak) // 4, (least + peak) // 2, max(peak - 1, 0)})


def zoo_graph(name: str) -> Graph:
    import autoremat

    model, args = autoremat.zoo.build(name, size="small", device="meta")
    return autoremat.capture(model, args)


def cases() -> list[tuple[str, str, Graph, str, dict]]:
    """``(case name, graph key, graph, solver, config)``: the cases the reference answered in the
    tests before (random DAGs with and without views, larger ones for the numpy paths, the zoo at
    small size with both time conventions, and the graphs of the batch-pricing tests)."""
    out = []
    for seed in range(40):
        for maker in (random_dag, random_dag_with_views):
            key = f"{maker.__name__}:{seed}:{3 + seed % 9}"
            g = maker(seed, 3 + seed % 9)
            for solver in ("dp-approx", "dp-exact"):
                out.append((f"{key}:{solver}", key, g, solver, {}))
    from autoremat.cost.bitsets import GraphBits
    from autoremat.solvers.kusumoto.families import all_lower_sets

    for seed in range(6):
        key = f"random_dag_with_views:{100 + seed}:{40 + 10 * seed}"
        g = random_dag_with_views(100 + seed, 40 + 10 * seed)
        out.append((f"{key}:dp-approx", key, g, "dp-approx", {}))
        out.append((f"{key}:dp-approx:37", key, g, "dp-approx", {"time_slots": 37}))
        if all_lower_sets(GraphBits(g), 120) is not None:
            out.append((f"{key}:dp-exact", key, g, "dp-exact", {}))
    out.append(("fine-grid", "random_dag_with_views:7:30", random_dag_with_views(7, 30), "dp-approx",
                {"time_slots": 1000}))
    out.append(("dense-growth", "random_dag_with_views:11:25", random_dag_with_views(11, 25), "dp-approx",
                {"time_slots": 37}))
    for seeds, n in ((range(300, 304), 12), (range(400, 402), 10), (range(500, 506), 10), (range(600, 606), 11)):
        for seed in seeds:
            key = f"random_dag_with_views:{seed}:{n}"
            out.append((f"{key}:dp-exact", key, random_dag_with_views(seed, n), "dp-exact", {}))
    for name in ZOO:
        g = zoo_graph(name)
        paper = g.with_paper_times()
        out.append((f"zoo:{name}:paper:dp-approx", f"zoo:{name}:paper", paper, "dp-approx", {}))
        out.append((f"zoo:{name}:flops:dp-approx", f"zoo:{name}:flops", g, "dp-approx", {}))
        if name in ("vgg19", "mlp"):
            out.append((f"zoo:{name}:paper:dp-exact", f"zoo:{name}:paper", paper, "dp-exact", {}))
    return out


def feasibility(ref: Any, seed: int) -> tuple[str, Graph, dict]:
    """Where the reference's exact feasibility (Dijkstra on kept bytes) says "fits"."""
    g = random_dag_with_views(2000 + seed, 4 + seed % 9)
    old = ref._Search(g, "dp-exact", ref._config(dict(NO_LIMIT), "dp-exact")).dp
    least = ref.min_budget(g, "dp-exact", config=dict(NO_LIMIT))
    peak = unoptimised_peak_bytes(g)
    budgets = sorted({max(least - k, 0) for k in range(4)} | {least + k for k in range(3)}
                     | {(least + peak) // 2, peak} | set(range(0, peak + 1, max(1, peak // 12))))
    fits = [old.run(b, "feasible") is not None for b in budgets]
    return f"random_dag_with_views:{2000 + seed}:{4 + seed % 9}", g, {"least": least, "budgets": budgets,
                                                                       "fits": fits}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--commit", default=REFERENCE_COMMIT, help="git revision holding the frozen reference")
    p.add_argument("--out", default=str(HERE / "reference.json.gz"))
    args = p.parse_args(argv)
    ref = load_reference(args.commit)
    graphs: dict[str, dict] = {}
    data: dict[str, Any] = {"reference": f"{args.commit}:{REFERENCE_PATH}", "graphs": graphs, "cases": [],
                            "feasibility": [], "least_kept": []}
    for name, key, g, solver, config in cases():
        graphs.setdefault(key, g.to_dict())
        fresh = Graph.from_dict(graphs[key])
        budgets = budgets_of(ref, fresh, solver, config)
        data["cases"].append({"name": name, "graph": key, "solver": solver, "config": config, "budgets": budgets,
                              "outcome": dp_outcome(ref, Graph.from_dict(graphs[key]), solver, budgets, config)})
        print(name, flush=True)
    for seed in range(30):
        key, g, found = feasibility(ref, seed)
        graphs.setdefault(key, g.to_dict())
        data["feasibility"].append({"graph": key, **found})
    for seed in range(1000, 1025):  # the reference's minimum: the least-kept sequence's peak
        key = f"random_dag_with_views:{seed}:12"
        graphs.setdefault(key, random_dag_with_views(seed, 12).to_dict())
        data["least_kept"].append({"graph": key, "min": ref.min_budget(Graph.from_dict(graphs[key]), "dp-exact")})
    unet = Graph.from_dict(graphs["zoo:unet:paper"])
    old = ref._Search(unet, "dp-exact", ref._config(dict(NO_LIMIT), "dp-exact"))
    least = old.least_dp_budget()[0]
    data["unet_memory"] = {"graph": "zoo:unet:paper", "least": least, "most_time": old.dp.run(least, "memory")[1]}
    text = json.dumps(jsonable(data), separators=(",", ":"), sort_keys=True)
    with open(args.out, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=9, mtime=0) as f:
        f.write(text.encode("utf-8"))  # mtime=0: the same answers give the same bytes
    print(f"wrote {args.out}: {len(data['cases'])} cases, {len(graphs)} graphs, {len(text)} bytes of JSON")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
