"""Join ``compare.json`` files of several runs of ``compare`` / ``compare_gpu.py`` into one result.

    python benchmarks/merge_runs.py RUN1/compare.json RUN2/compare.json --out benchmarks/results/<machine>

Why: a GPU job often runs under a time limit (a scheduler's cap; a lent machine here runs one
command for at most 10 minutes), so the GPU comparison is measured a few models, or a few
configuration families, per job. Each job writes its own ``compare.json`` (a job stopped at its
limit still leaves the models it finished, see ``compare.driver._write_partial``). Every ratio is taken
against a ``none`` row measured side by side in the same run, so runs on the same kind of machine
can share one table.

Rules: every run must come from the same kind of machine (the GPU's name, or the CPU's
architecture and core count) and the same torch. A model measured in several runs (e.g. its
``--configs pytorch,autoremat`` in one job and ``--configs compile`` in another: each run measures
its own ``none``) is joined row by row: a configuration measured twice comes from the later run,
and rows from another run than the table's ``none`` keep their ratios to their own ``none``, their
step time being put on the table's scale (:func:`join_model`). Each largest-batch row (per task
and method) comes from the last run that has it; failures, the headline, ``RESULTS.md`` and the plots are recomputed; ``runs`` lists each
run's command, wall time, models and whether it had finished. ``offload.json`` files beside the
inputs (``compare_gpu.py``) are joined the same way, per model.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare  # noqa: E402


def machine_kind(machine: dict[str, Any]) -> tuple[Any, ...]:
    """What must agree between merged runs: the GPU (or CPU) and the torch build."""
    if machine.get("device_name"):
        return ("cuda", machine["device_name"], machine["torch"])
    return ("cpu", machine["platform_machine"], machine["cpu_count"], machine["torch"])


def merge(results: Sequence[dict[str, Any]], sources: Sequence[str] | None = None,
          log: Callable[[str], None] = print) -> dict[str, Any]:
    """One result holding every model and largest-batch row of ``results`` (later runs win; a
    model measured in several runs is joined row by row, see :func:`join_model`)."""
    if not results:
        raise ValueError("merge needs at least one compare.json")
    sources = list(sources or (f"run {i + 1}" for i in range(len(results))))
    kinds = {machine_kind(r["machine"]) for r in results}
    if len(kinds) > 1:
        raise SystemExit("merge_runs: these runs come from different machines or torch builds, whose timings do not "
                         "belong in one table: " + "; ".join(f"{s}: {machine_kind(r['machine'])}"
                                                              for s, r in zip(sources, results)))
    batch: dict[tuple[str, str], dict[str, Any]] = {}
    model_failures: dict[str, list[dict[str, Any]]] = {}
    runs = []
    parts: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for i, (src, r) in enumerate(zip(sources, results)):
        for name, info in r["models"].items():
            parts.setdefault(name, []).append((i, info))
        for f in r.get("failures", []):  # a model that failed as a whole has no rows to recompute them from
            if f["config"] == "*" and f["model"] not in r["models"]:
                model_failures.setdefault(f["model"], []).append(f)
        for row in r.get("largest_batch", []):
            batch[(row["task"], row["method"])] = row
        runs.append({"source": src, "command": r["command"], "wall_s": r["wall_s"], "partial": bool(r.get("partial")),
                     "models": list(r["models"]), "largest_batch": bool(r.get("largest_batch")),
                     "machine": r["machine"], "settings": r["settings"]})
    models = {name: join_model(name, pieces, sources, log) for name, pieces in parts.items()}
    merged: dict[str, Any] = {
        "schema": results[-1].get("schema", 1), "command": " && ".join(run["command"] for run in runs),
        "machine": results[-1]["machine"], "settings": results[-1]["settings"], "runs": runs,
        "wall_s": sum(run["wall_s"] for run in runs), "partial": False,
        "models": models, "rows": [row for info in models.values() for row in info["rows"]],
        "largest_batch": list(batch.values()),
    }
    merged["failures"] = ([f for name, fs in model_failures.items() if name not in models for f in fs]
                          + compare.row_failures(merged["rows"]) + compare.batch_failures(merged["largest_batch"]))
    merged["headline"] = compare.headline(models, merged["largest_batch"])
    return merged


def join_model(name: str, pieces: Sequence[tuple[int, dict[str, Any]]], sources: Sequence[str],
               log: Callable[[str], None] = print) -> dict[str, Any]:
    """One model's info from the runs that measured it (``(run index, info)``, in run order).

    A row measured in several runs comes from the last; the model's other fields and its ``none``
    row come from the last run that has a ``none`` row. A row from another run keeps its ratios to
    its own run's ``none``; its ``step_time_s`` is put on this table's scale (its ``time_ratio`` x
    this ``none``'s step time, so that rows compare as their ratios do) and what it measured is
    kept as ``measured_step_time_s``; every row records its run (``run``, an index into ``runs``)."""
    if len(pieces) == 1:
        i, info = pieces[0]
        return {**info, "rows": [{**row, "run": i} for row in info["rows"]]}
    log(f"merge_runs: {name} was measured in runs {', '.join(sources[i] for i, _ in pieces)}; a configuration "
        "measured twice is taken from the later run")
    rows: dict[str, dict[str, Any]] = {}
    for i, info in pieces:
        for row in info["rows"]:
            rows[row["config"]] = {**row, "run": i}
    base = rows.get("none")
    if base is None or base["status"] != "ok":
        raise SystemExit(f"merge_runs: {name} has no measured `none` row in these runs; its rows cannot be put on one "
                         "scale")
    own = next(info for i, info in reversed(pieces) if i == base["run"])
    for key, row in rows.items():
        if row["run"] != base["run"] and row.get("time_ratio") is not None:
            rows[key] = {**row, "measured_step_time_s": row["step_time_s"],
                         "step_time_s": row["time_ratio"] * base["step_time_s"]}
    return {**own, "rows": list(rows.values()), "runs": [i for i, _ in pieces]}


def merge_offload(summaries: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """``offload.json`` summaries joined per model (later wins); ``None`` when there are none."""
    if not summaries:
        return None
    out = dict(summaries[-1])
    out["models"] = {name: rows for s in summaries for name, rows in s["models"].items()}
    return out


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("inputs", nargs="+", type=Path, metavar="COMPARE_JSON", help="compare.json files, in run order")
    p.add_argument("--out", type=Path, required=True, help="folder for the merged compare.json, RESULTS.md and plots")
    a = p.parse_args(argv)
    results = []
    for path in a.inputs:
        if not path.is_file():
            raise SystemExit(f"merge_runs: {path} does not exist (pass the compare.json files of the runs)")
        results.append(json.loads(path.read_text()))
    merged = merge(results, [str(x) for x in a.inputs])
    a.out.mkdir(parents=True, exist_ok=True)
    compare.write_outputs(merged, a.out)
    offload = [json.loads(q.read_text()) for q in (x.parent / "offload.json" for x in a.inputs) if q.is_file()]
    joined = merge_offload(offload)
    if joined is not None:
        import compare_gpu

        compare_gpu.write_offload(joined, a.out)
    print(f"merged {len(results)} runs ({', '.join(merged['models'])}) into {a.out / 'compare.json'}"
          + ("" if joined is None else f" and {a.out / 'offload.json'}"))
    return merged


if __name__ == "__main__":
    main()
