"""What both integrations do between a capture and a patch, defined once: solve under the
device budget with the documented behaviour for an infeasible one, find the reachable range,
and load a plan the user saved.

* :func:`plan_within`: ``budget="min"`` plans at the least reachable step peak; any other
  budget is turned into a step budget (:func:`~autoremat.integrations._common.step_budget_bytes`)
  and solved; where no plan meets it, ``on_infeasible="error"`` (the default) raises
  :class:`~autoremat.errors.InfeasibleBudgetError` stating the reachable range in bytes and in
  percent, and ``on_infeasible="min"`` plans at the least instead and says so (one warning line
  and a note in the summary).
* :func:`measured_step_peak`: one patched step whose peak is measured, training state untouched.
* :func:`cached_plan_misfit`: whether a cached decision's plan still fits this run's budget.
* :func:`as_plan`: ``plan=`` as a :class:`~autoremat.plan.Plan`, a path to a plan file or a
  plan dict, checked when the integration is configured (a missing file or a malformed plan is
  an error before any training).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any, ContextManager

import torch
from torch import nn

from .._units import fmt_bytes
from ..budget import is_min, parse_budget
from ..capture._recorder import tensors_in
from ..capture.param_writes import written_first
from ..capture.preserved import preserved_state
from ..errors import InfeasibleBudgetError
from ..graph import Graph
from ..measure import counted_step_peak, profiling_run, run_step
from ..plan import Plan
from ..resident import device_of
from ..cost import unoptimised_peak_bytes
from ..solvers import least_budget, solve
from ._common import is_percentage, step_budget_bytes

__all__ = ["plan_within", "as_plan", "cached_plan_misfit", "least_for", "measured_step_peak", "profiling_budget",
           "wants_least", "CONFIRM_TRIES", "BACK_OFF"]

logger = logging.getLogger(__name__)

CONFIRM_TRIES = 4
"""Measured steps an integration tries before giving up when the chosen plan's step runs out of memory."""

BACK_OFF = 0.85
"""The step budget a plan whose measured step ran out of memory is solved again at, as a fraction."""


def least_for(graph: Graph, solver: str, solve_kwargs: Mapping[str, Any]) -> int:
    """The least step peak ``solver`` (with the integration's options) reaches on ``graph``."""
    kwargs = dict(solve_kwargs)
    auto_solvers = kwargs.pop("auto_solvers", None)
    return least_budget(graph, solver, auto_solvers=auto_solvers, **kwargs)


def _below_resident(budget: Any, resident: int) -> bool:
    """Whether a byte budget leaves no room for a step above ``resident`` ("auto", "min" and
    percentages never: they are not counted from the resident bytes)."""
    if is_min(budget) or is_percentage(budget) or (isinstance(budget, str) and budget.strip().lower() == "auto"):
        return False
    return parse_budget(budget) <= int(resident)


def wants_least(budget: Any, on_infeasible: str, resident: int) -> bool:
    """Whether the plan will be the least one before any solve: ``budget="min"``, or a byte
    budget below the resident bytes under ``on_infeasible="min"``."""
    return is_min(budget) or (on_infeasible == "min" and _below_resident(budget, resident))


def profiling_budget(budget: Any, on_infeasible: str, resident: int) -> Any:
    """The budget that limits profiling: ``"auto"`` where the plan will be the least one
    (:func:`wants_least`), else ``budget``."""
    return "auto" if wants_least(budget, on_infeasible, resident) else budget


def plan_within(graph: Graph, budget: Any, *, device: torch.device | str, resident: int, solver: str,
                allocated: int | None = None,
                solve_kwargs: Mapping[str, Any], on_infeasible: str, who: str, warn: Any = None,
                solve_fn: Callable[[Graph, Any], Plan] | None = None, calls: int = 1) -> tuple[Plan, int, str | None]:
    """``(plan, step_budget_bytes, note)`` for a device ``budget`` (module docstring).

    ``warn(text)`` is told when ``on_infeasible="min"`` replaced the budget (default: a log
    warning naming ``who``). ``note`` says what happened to the budget, for the summary (``None``: as asked).
    ``solve_fn(graph, budget)`` solves (default :func:`autoremat.solve` with ``solver`` and
    ``solve_kwargs``), so that an integration solves here exactly as everywhere else. ``allocated``: the
    resident bytes already on the device (see :func:`~autoremat.integrations._common.step_budget_bytes`).
    ``calls``: how many calls of the graph's module one training step makes, their activations
    live together: a byte or ``"auto"`` budget is shared, each call planned at ``1/calls`` of it (a
    percentage is of one call's unoptimised peak, so it holds for the step as it is).
    """
    def run(b: Any) -> Plan:
        return solve_fn(graph, b) if solve_fn is not None else solve(graph, b, solver=solver, **solve_kwargs)

    if is_min(budget):
        plan = run("min")
        return plan, int(plan.budget_bytes or 0), "budget='min': the least reachable"
    peak = unoptimised_peak_bytes(graph)
    if on_infeasible == "min" and _below_resident(budget, resident):
        step, asked = 0, f"below the {fmt_bytes(resident)} resident before a step"
    else:
        step = step_budget_bytes(budget.strip() if isinstance(budget, str) else budget, graph, device, resident,
                                 allocated)
        shared = None
        if calls > 1 and not is_percentage(budget):
            step //= calls
            shared = f"1/{calls} of the step budget per call ({calls} calls per step)"
        asked = f"{fmt_bytes(step)} of step peak, {100 * step / max(peak, 1):.0f} %"
        try:
            return run(step), step, shared
        except InfeasibleBudgetError as err:
            if on_infeasible != "min":
                raise InfeasibleBudgetError(step, err.min_budget_bytes, solver=f"{who}/{solver}",
                                            unoptimised_peak_bytes=peak, reason=err.reason) from None
    plan = run("min")
    least = int(plan.budget_bytes or 0)
    text = (f"budget={budget!r} ({asked}) is below the least step peak solver {solver!r} reaches, "
            f"{fmt_bytes(least)} ({100 * least / max(peak, 1):.0f} %); planned at the least (on_infeasible='min')")
    if warn is not None:
        warn(text)
    else:
        logger.warning("%s: %s", who, text)
    return plan, least, f"asked {fmt_bytes(step) if step else budget}: unreachable"


def cached_plan_misfit(entry: Mapping[str, Any], budget: Any, device: Any, resident: int,
                       allocated: int | None, calls: int = 1) -> str | None:
    """Why a cached decision's plan does not fit this run's step budget (``1/calls`` of it per
    call, as :func:`plan_within` plans each call), or ``None`` where it fits. Device budgets only:
    a percentage or ``"min"`` is relative to the same graph, so its plan always fits."""
    if is_min(budget) or is_percentage(budget):
        return None
    try:
        room = step_budget_bytes(budget, Graph(), device, resident, allocated) // max(1, int(calls))
    except ValueError:
        room = -1
    predicted = entry["summary"].get("predicted_peak_bytes") or 0
    if predicted <= room:
        return None
    room_text = ("no room above the resident bytes" if room < 0 else
                 f"{room} bytes{f' per call, {calls} calls per step' if calls > 1 else ''}")
    return f"the cached plan ({predicted} bytes) no longer fits the step budget ({room_text}); profiling again"


def as_plan(value: Any, name: str = "plan") -> Plan | None:
    """``value`` as a :class:`Plan`: a ``Plan``, a path to a plan file, a plan dict, or ``None``."""
    if value is None or isinstance(value, Plan):
        return value
    if isinstance(value, Mapping):
        return Plan.from_dict(value, source=name)
    if isinstance(value, (str, os.PathLike)):
        path = os.fspath(value)
        if not os.path.isfile(path):
            raise ValueError(f"{name}={path!r}: no such plan file; write one with `autoremat plan ... --out "
                             f"{os.path.basename(path) or 'plan.json'}` or plan.to_json(path)")
        return Plan.from_json(path)
    raise ValueError(f"{name}={value!r} must be a plan file path, an autoremat.Plan, a plan dict or None")


@profiling_run
def measured_step_peak(target: nn.Module, args: tuple, kwargs: dict, loss_fn: Callable[[Any], torch.Tensor],
                       context: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
                       keep_output: bool = False) -> int:
    """One forward+backward of ``target``, ``context()`` around the forward and the loss (the
    trainer's precision plugin wraps ``training_step`` so), the returned object kept through
    backward with ``keep_output`` (:func:`~autoremat.measure.run_step`); returns its step peak.
    RNG, buffers and gradients are put back (:func:`~autoremat.capture.preserved.preserved_state`),
    so training is unaffected.
    On the CPU: :func:`~autoremat.measure.counted_step_peak` (it keeps a compiled model compiling)."""
    device = device_of(target, args, kwargs)
    with preserved_state(target, [device]), written_first([*target.parameters(), *tensors_in((args, kwargs))]):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            run_step(target, args, kwargs, loss_fn, keep_output=keep_output, forward_context=context)
            torch.cuda.synchronize(device)
            return int(torch.cuda.max_memory_allocated(device) - base)
        return counted_step_peak(target, args, kwargs, loss_fn, keep_output=keep_output, context=context)
