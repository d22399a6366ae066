"""Every configuration of one model, interleaved round-robin: the rows of ``compare.json``."""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

import autoremat

from . import solving  # solving.solve_limited is a seam compare_gpu patches
from .measuring import _Timeout, _sync, compare_grads, grads_of, measure_peak, time_limit, timed_step
from .runners import (
    COMPILED, MATCH_TAG, NotApplicable, Runner, TORCH_REGIONS, _copy, runner_autoremat, runner_block_ac,
    runner_block_sac, runner_ckpt_seq, runner_compile, runner_none, runner_save_on_cpu,
)
from .settings import AUTOREMAT_BUDGETS, COMPILE_BUDGETS, ROW_FIELDS
from .workloads import build_workload


@dataclass
class Options:
    rounds: int = 5
    steps_per_round: int = 2
    compile_budgets: tuple[float, ...] = COMPILE_BUDGETS
    compile_backend: str = "inductor"
    compile_timeout_s: float | None = 150.0
    autoremat_budgets: tuple[float, ...] = AUTOREMAT_BUDGETS
    match_pytorch: bool = True
    """Also run every solver at the lowest eager PyTorch option's measured peak (``@match``)."""
    solvers: tuple[str, ...] | None = None
    solver_timeout_s: float | None = 60.0
    size: str = "small"
    batch: dict[str, int] = field(default_factory=dict)
    device: str = "cpu"
    configs: tuple[str, ...] | None = None
    """Only these config families ("pytorch", "compile", "autoremat"); None: all."""
    torch_regions: tuple[tuple[str, float], ...] = (("dp-approx", 0.5),)
    """(solver, budget fraction) rows repeated with ``regions="torch"`` (``+torch-regions``)."""
    compiled_plans: tuple[tuple[str, float], ...] = (("dp-approx", 0.5), ("dp-approx", 0.3))
    """(solver, budget fraction) rows repeated under ``torch.compile`` (``+compile``)."""


def solvers_to_run(opts: Options) -> list[str]:
    return list(opts.solvers) if opts.solvers else [s for s in sorted(autoremat.SOLVERS) if s != "none"]


def planned_configurations(models: Sequence[str], opts: Options) -> list[dict[str, Any]]:
    """Every (model, configuration) the run would measure, without building anything."""
    out = []
    for name in models:
        keys = [("none", "baseline"), ("block-ac", "pytorch"), ("block-sac", "pytorch"), ("ckpt-seq", "pytorch"),
                ("save-on-cpu", "pytorch")]
        keys += [(f"compile@{b:g}", "compile") for b in opts.compile_budgets]
        keys += [(f"autoremat:{s}@{f:g}", "autoremat") for s in solvers_to_run(opts) for f in opts.autoremat_budgets]
        if opts.match_pytorch:
            keys += [(f"autoremat:{s}@{MATCH_TAG}", "autoremat") for s in solvers_to_run(opts)]
        for suffix, pairs in ((TORCH_REGIONS, opts.torch_regions), (COMPILED, opts.compiled_plans)):
            keys += [(f"autoremat:{s}@{f:g}{suffix}", "autoremat") for s, f in pairs
                     if s in solvers_to_run(opts) and f in opts.autoremat_budgets]
        for key, fam in keys:
            if opts.configs is None or fam == "baseline" or fam in opts.configs:
                out.append({"model": name, "config": key, "family": fam})
    return out


def _row(model: str, r: Runner | None = None, **kw: Any) -> dict[str, Any]:
    row = dict.fromkeys(ROW_FIELDS)
    row["model"] = model
    if r is not None:
        row.update(config=r.key, family=r.family, label=r.label)
        row.update({k: v for k, v in r.row.items() if not k.startswith("_")})
    row.update(kw)
    return row


def _err(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}".strip()
    return text if len(text) <= 1500 else text[:1500] + " ..."


def run_model(name: str, opts: Options, log: Callable[[str], None]) -> dict[str, Any]:
    device = torch.device(opts.device)
    w = build_workload(name, size=opts.size, batch=opts.batch.get(name), device=device)
    log(f"== {name}: {w.description}")
    rows: list[dict[str, Any]] = []
    ready: list[Runner] = []
    info: dict[str, Any] = {"description": w.description, "batch": w.batch,
                            "parameters": sum(p.numel() for p in w.model.parameters())}
    want = (lambda fam: True) if opts.configs is None else (lambda fam: fam in opts.configs)

    # reference: no checkpointing
    base = runner_none(w)
    base.step(w.args, w.loss_fn)
    base_peak = measure_peak(base, w, device)
    ref = grads_of(base, w)
    rows.append(_row(name, base, status="ok", measured_peak_bytes=base_peak, gradients_equal=True,
                     grad_max_abs_diff=0.0))
    ready.append(base)
    info["unoptimised_peak_bytes"] = base_peak
    log(f"   none: peak {base_peak / 2**20:.2f} MiB")

    def prepare(r: Runner, row: dict[str, Any]) -> bool:
        """Warm up (compiling if needed), measure the peak, check gradients; False if it failed."""
        try:
            if r.compiled:
                t0 = time.perf_counter()
                with time_limit(opts.compile_timeout_s):
                    r.step(w.args, w.loss_fn)
                    _sync(device)
                row["compile_s"] = time.perf_counter() - t0
                r.step(w.args, w.loss_fn)  # a second call: anything compiled lazily is compiled now
            else:
                r.step(w.args, w.loss_fn)
            row["measured_peak_bytes"] = measure_peak(r, w, device)
            equal, diff = compare_grads(ref, grads_of(r, w))
            row["gradients_equal"], row["grad_max_abs_diff"] = equal, diff
            row["status"] = "ok"
            return True
        except _Timeout as err:
            row.update(status="timeout", error=f"compilation {err} on this machine; abandoned")
            with contextlib.suppress(Exception):  # stop kernel builds still queued for the abandoned graph
                from torch._inductor.async_compile import shutdown_compile_workers

                shutdown_compile_workers()
        except Exception as err:  # noqa: BLE001 - a failing configuration is a result, not a crash
            row.update(status="failed", error=_err(err))
            log("   " + traceback.format_exc(limit=3).replace("\n", "\n   "))
        return False

    # PyTorch's own options
    if want("pytorch"):
        for make in (runner_block_ac, runner_block_sac, runner_ckpt_seq, partial(runner_save_on_cpu, device=device)):
            key = {runner_block_ac: "block-ac", runner_block_sac: "block-sac",
                   runner_ckpt_seq: "ckpt-seq"}.get(make, "save-on-cpu")
            try:
                r = make(w)
            except NotApplicable as why:
                rows.append(_row(name, config=key, family="pytorch", label=key, status="not_applicable",
                                 note=str(why)))
                log(f"   {key}: not applicable ({why})")
                continue
            except Exception as err:  # noqa: BLE001
                rows.append(_row(name, config=key, family="pytorch", label=key, status="failed", error=_err(err)))
                continue
            row = _row(name, r)
            if prepare(r, row):
                ready.append(r)
            rows.append(row)
            log(f"   {r.key}: {row['status']} peak {(row['measured_peak_bytes'] or 0) / 2**20:.2f} MiB")

    # torch.compile with activation_memory_budget
    skip_reason = None  # set when a compile timed out: the +compile rows of autoremat are skipped too
    if want("compile"):
        for b in opts.compile_budgets:
            r = runner_compile(w, b, opts.compile_backend)
            row = _row(name, r)
            if skip_reason:
                row.update(status="skipped", error=skip_reason)
                rows.append(row)
                continue
            if prepare(r, row):
                ready.append(r)
            elif row["status"] == "timeout":
                skip_reason = (f"skipped: the compile at budget {b:g} did not finish within "
                               f"{opts.compile_timeout_s:g} s on this machine")
            rows.append(row)
            log(f"   {r.key}: {row['status']} compile {row['compile_s'] or float('nan'):.1f} s, "
                f"peak {(row['measured_peak_bytes'] or 0) / 2**20:.2f} MiB {row['error'] or ''}")

    # autoremat with every solver
    if want("autoremat"):
        t0 = time.perf_counter()
        graph = autoremat.capture(_copy(w), w.args, loss_fn=w.loss_fn)
        info["capture_s"] = time.perf_counter() - t0
        info["graph_nodes"] = len(graph)
        info["graph_mode"] = graph.meta.get("mode")
        from autoremat.cost import unoptimised_peak_bytes

        info["simulated_unoptimised_peak_bytes"] = int(unoptimised_peak_bytes(graph))
        log(f"   captured {len(graph)} nodes ({info['graph_mode']}) in {info['capture_s']:.1f} s")
        targets: list[tuple[str | None, float, int, str | None]] = [
            (None, f, int(f * base_peak), None) for f in opts.autoremat_budgets]
        eager = [r for r in rows if r["family"] == "pytorch" and r["status"] == "ok"
                 and r["measured_peak_bytes"] and r["measured_peak_bytes"] < base_peak]
        if opts.match_pytorch and eager:
            low = min(eager, key=lambda r: r["measured_peak_bytes"])
            b = int(low["measured_peak_bytes"])
            targets.append((MATCH_TAG, b / base_peak, b, f"budget = {low['config']}'s measured peak"))
        for solver in solvers_to_run(opts):
            timed_out = None
            for tag, f, budget, why in targets:
                key = f"autoremat:{solver}@{tag or format(f, 'g')}"
                label = f"autoremat {solver} @ " + (f"{tag} ({f:.0%})" if tag else f"{f:.0%}")
                row = _row(name, config=key, family="autoremat", label=label,
                           solver=solver, budget_fraction=f, budget_bytes=budget, note=why)
                if timed_out is not None:  # solver cost hardly depends on the budget
                    row.update(status="skipped", error=f"skipped: {solver} timed out at the {timed_out:.0%} budget")
                    rows.append(row)
                    continue
                status, payload, solve_s = solving.solve_limited(graph, budget, solver, opts.solver_timeout_s)
                extra: list[dict[str, Any]] = []
                row["solver_time_s"] = solve_s
                if status == "timeout":
                    timed_out = f
                if status == "infeasible":
                    row.update(status="infeasible", min_budget_bytes=payload,
                               note=why)
                elif status == "timeout":
                    row.update(status="timeout", error=f"solver did not finish within {solve_s:g} s")
                elif status == "error":
                    row.update(status="failed", error=payload)
                else:
                    plan = payload
                    row.update(predicted_peak_bytes=plan.predicted_peak_bytes, segments=len(plan.segments),
                               recomputed=len(plan.recompute_segments))
                    if plan.options.get("fallback"):
                        row["note"] = "; ".join(filter(None, [why, f"fell back to {plan.options['fallback']}"]))
                    variants = [("lean", row)]
                    if tag is None and (solver, f) in opts.torch_regions:
                        extra.append(dict(row, config=key + TORCH_REGIONS,
                                          label=label + ", torch.utils.checkpoint regions"))
                        variants.append(("torch", extra[-1]))
                    if tag is None and (solver, f) in opts.compiled_plans:
                        extra.append(dict(row, config=key + COMPILED, label=label + ", torch.compile"))
                        if skip_reason:
                            extra[-1].update(status="skipped", error=skip_reason)
                        else:
                            variants.append(("compile", extra[-1]))
                    for regions, vrow in variants:
                        try:
                            r = (runner_autoremat(w, plan, solver, f, tag, compile_backend=opts.compile_backend)
                                 if regions == "compile" else runner_autoremat(w, plan, solver, f, tag, regions=regions))
                        except Exception as err:  # noqa: BLE001
                            vrow.update(status="failed", error=_err(err))
                        else:
                            vrow.update(config=r.key)
                            if not prepare(r, vrow):
                                continue
                            ready.append(r)
                            if regions == "compile":  # the simulator predicts eager PyTorch, not Inductor
                                vrow["note"] = ("compiled: the plan's regions become checkpoint ops that the "
                                                "compiled backward recomputes; the prediction and the budget are "
                                                "eager PyTorch's, not checked here")
                                continue
                            m = vrow["measured_peak_bytes"]
                            vrow["prediction_error"] = plan.predicted_peak_bytes / m - 1.0 if m else None
                            vrow["meets_budget"] = m <= budget
                rows.append(row)
                rows.extend(extra)
                log(f"   {key}: {row['status']} solve {row['solver_time_s'] or 0:.2f} s "
                    f"peak {(row['measured_peak_bytes'] or 0) / 2**20:.2f} MiB {row['error'] or row['note'] or ''}")

    # interleaved timing
    times: dict[str, list[float]] = {r.key: [] for r in ready}
    log(f"   timing {len(ready)} configurations, {opts.rounds} rounds x {opts.steps_per_round} steps")
    for rnd in range(opts.rounds):
        gc.collect()
        k = rnd % len(ready)
        for r in ready[k:] + ready[:k]:
            for _ in range(opts.steps_per_round):
                times[r.key].append(timed_step(r, w, device))
    base_t = statistics.median(times["none"])
    for row in rows:
        ts = times.get(row["config"])
        if ts and row["status"] == "ok":
            row["step_times_s"] = ts
            row["step_time_s"] = statistics.median(ts)
            row["time_ratio"] = row["step_time_s"] / base_t
        if row["measured_peak_bytes"] is not None and base_peak:
            row["peak_ratio"] = row["measured_peak_bytes"] / base_peak
    info["rows"] = rows
    del ready, base
    gc.collect()
    return info
