"""Running the comparison: models, then the largest-batch section; partial results written after each
model; ``--batch-only`` and ``--render``."""

from __future__ import annotations

import json
import math
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from .batch import batch_tasks, run_batch_task
from .model import Options, _err, run_model, solvers_to_run
from .report import headline, machine_info, plot, to_markdown
from .settings import BATCH_FIELDS, BATCH_METHODS


def run(models: Sequence[str], opts: Options, out: Path, *, batch: bool = True, quick: bool = False,
        command: str = "", batch_budgets: dict[str, int] | None = None, confirm_steps: int = 2,
        log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run every model, then the largest-batch comparison; write JSON, markdown and plots to ``out``."""
    t_start = time.perf_counter()
    device = torch.device(opts.device)
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "schema": 1, "command": command, "out": str(out), "machine": machine_info(device),
        "settings": {"rounds": opts.rounds, "steps_per_round": opts.steps_per_round, "size": opts.size,
                     "compile_budgets": list(opts.compile_budgets), "compile_backend": opts.compile_backend,
                     "compile_timeout_s": opts.compile_timeout_s, "autoremat_budgets": list(opts.autoremat_budgets),
                     "solvers": solvers_to_run(opts), "solver_timeout_s": opts.solver_timeout_s, "quick": quick,
                     "confirm_steps": confirm_steps, "models": list(models)},
        "models": {}, "rows": [], "largest_batch": [], "failures": [],
    }
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir
    import torch._dynamo.config as dynamo_config

    with tempfile.TemporaryDirectory(prefix="compare_inductor_") as cache, temporary_cache_dir(cache), \
            dynamo_config.patch(recompile_limit=64, accumulated_recompile_limit=4096):
        for name in models:
            try:
                info = run_model(name, opts, log)
            except Exception as err:  # noqa: BLE001 - one model failing must not lose the others
                log(traceback.format_exc())
                result["failures"].append({"model": name, "config": "*", "status": "failed", "error": _err(err),
                                           "note": None})
                continue
            result["models"][name] = info
            result["rows"].extend(info["rows"])
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if batch or name != models[-1]:  # else the final outputs follow at once
                _write_partial(result, out, t_start, log)
    if batch:
        result["largest_batch"] = run_batch_section(opts, quick=quick, batch_budgets=batch_budgets,
                                                    confirm_steps=confirm_steps, log=log)
    result["failures"] += row_failures(result["rows"]) + batch_failures(result["largest_batch"])
    result["headline"] = headline(result["models"], result["largest_batch"])
    result["wall_s"] = time.perf_counter() - t_start
    result["partial"] = False
    write_outputs(result, out)
    log(f"wrote {out / 'compare.json'}, {out / 'RESULTS.md'} and {len(result['plots'])} plots "
        f"in {result['wall_s'] / 60:.1f} min")
    return result


def _write_partial(result: dict[str, Any], out: Path, t_start: float, log: Callable[[str], None]) -> None:
    """The outputs with the models measured so far (``"partial": true``): a run stopped later (a
    time limit, a crash) still leaves its finished models on disk, and ``merge_runs.py`` can join
    them with another run's."""
    done = {**result, "failures": result["failures"] + row_failures(result["rows"]), "partial": True,
            "wall_s": time.perf_counter() - t_start}
    done["headline"] = headline(done["models"], [])
    write_outputs(done, out)
    log(f"wrote the {len(done['models'])} model(s) measured so far to {out / 'compare.json'} (partial)")


def run_batch_section(opts: Options, *, quick: bool, batch_budgets: dict[str, int] | None, confirm_steps: int,
                      log: Callable[[str], None]) -> list[dict[str, Any]]:
    """The largest-batch comparison: every task of :func:`batch_tasks` with every ``BATCH_METHODS``."""
    rows = []
    log("== largest batch under a fixed budget")
    for task in batch_tasks(quick, batch_budgets, size=opts.size):
        for method in BATCH_METHODS:
            try:
                rows.append(run_batch_task(task, method, log, confirm_steps=confirm_steps, device=opts.device))
            except Exception as err:  # noqa: BLE001 - one task failing must not lose the others
                log(traceback.format_exc())
                row = dict.fromkeys(BATCH_FIELDS)
                row.update(task=task.name, method=method, status="failed", error=_err(err),
                           budget_bytes=task.capacity)
                rows.append(row)
    return rows


def row_failures(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``failures`` entries of step-time rows that neither ran nor were infeasible."""
    return [{k: r[k] for k in ("model", "config", "status", "error", "note")}
            for r in rows if r["status"] not in ("ok", "infeasible")]


def batch_failures(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``failures`` entries of largest-batch rows that did not finish."""
    return [{"model": r["task"], "config": r["method"], "status": r["status"], "error": r["error"], "note": None}
            for r in rows if r["status"] != "ok"]


def run_batch_only(out: Path, opts: Options, *, quick: bool = False, command: str = "",
                   batch_budgets: dict[str, int] | None = None, confirm_steps: int = 2,
                   log: Callable[[str], None] = print) -> dict[str, Any]:
    """Re-run only the largest-batch comparison and merge it into ``out/compare.json``: the step-time
    tables stay as measured, the batch rows, their failures and the headline are replaced, and the
    section records its own command, wall time and machine (``batch_run``)."""
    path = out / "compare.json"
    if not path.is_file():
        raise SystemExit(f"--batch-only merges into an existing {path}, which does not exist; "
                         "run the full comparison first (without --batch-only)")
    result = json.loads(path.read_text())
    t_start = time.perf_counter()
    machine = machine_info(torch.device(opts.device))
    old_tasks = {r["task"] for r in result.get("largest_batch", [])}
    rows = run_batch_section(opts, quick=quick, batch_budgets=batch_budgets, confirm_steps=confirm_steps, log=log)
    result["largest_batch"] = rows
    result["failures"] = [f for f in result.get("failures", []) if f["model"] not in old_tasks] + batch_failures(rows)
    result["settings"]["confirm_steps"] = confirm_steps
    result["batch_run"] = {"command": command, "wall_s": time.perf_counter() - t_start, "machine": machine}
    result["headline"] = headline(result["models"], rows)
    write_outputs(result, out)
    log(f"merged the largest-batch section into {path} and rewrote {out / 'RESULTS.md'} "
        f"in {result['batch_run']['wall_s'] / 60:.1f} min")
    return result


def write_outputs(result: dict[str, Any], out: Path) -> None:
    """``compare.json``, ``RESULTS.md`` and the plots under ``out``."""
    result["out"] = str(out)
    result["plots"] = plot(result, out)
    (out / "compare.json").write_text(json.dumps(_finite(result), indent=1, default=_json_default,
                                                 allow_nan=False) + "\n")
    (out / "RESULTS.md").write_text(to_markdown(result))


def render(path: Path) -> dict[str, Any]:
    """Rewrite RESULTS.md and the plots from an existing compare.json (no measuring)."""
    result = json.loads(Path(path).read_text())
    result["headline"] = headline(result["models"], result["largest_batch"])
    write_outputs(result, Path(path).parent)
    return result


def _finite(obj: Any) -> Any:
    """The result with NaN and infinities as None (strict JSON)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _json_default(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return str(obj)
