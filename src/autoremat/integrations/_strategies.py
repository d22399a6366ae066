"""Sharded training for the integrations: which engine shards the model, the FSDP units a
model has or will have, and a plan solved for one rank (issue 21).

* **DeepSpeed** is refused early with :class:`UnsupportedStrategyError`: ZeRO partitions
  parameters, gradients and optimizer state inside its own engine, which gathers parameters with
  its own module hooks; autoremat's regions have not been made to go through them, and DeepSpeed
  does not run on the CPU-only machine this was built on (its ops need a compiler toolchain and an
  accelerator), so it is not tested either.
* **FSDP units**: a model sharded already has them (:func:`autoremat._fsdp.units_of`); one about
  to be sharded has the units its wrap policy will make (:func:`predicted_units`: an FSDP1
  ``auto_wrap_policy`` — a ``ModuleWrapPolicy``/``CustomPolicy`` or a callable
  ``(module, recurse, nonwrapped_numel)`` as FSDP1's recursive wrap calls it — or an FSDP2
  policy ``module -> bool`` as Accelerate's ``fsdp2_prepare_model`` uses).
* **The per-rank plan** (:func:`solve_per_rank`): the graph is made per rank
  (:func:`autoremat.per_rank.per_rank_graph`), the solver runs on it, the plan is cut at the
  units (:func:`autoremat.runtime.sharding.snap_plan`, what ``apply`` will run) and simulated per
  rank; where the cut plan predicts more than the budget, the solver is asked again with the
  budget lowered by the excess (at most :data:`MAX_TRIES` times).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from .._fsdp import canonical_path
from .._units import fmt_bytes
from ..budget import is_min
from ..errors import InfeasibleBudgetError
from ..graph import Graph
from ..per_rank import ShardingSpec, per_rank_graph
from ..plan import Plan
from ..cost import simulate

__all__ = ["UnsupportedStrategyError", "deepspeed_refusal", "predicted_units", "PerRankPlan", "solve_per_rank",
           "accelerate_units", "accelerate_fsdp_precision", "MAX_TRIES"]

logger = logging.getLogger(__name__)

MAX_TRIES = 6


class UnsupportedStrategyError(ValueError):
    """A distributed engine autoremat does not work under."""


def deepspeed_refusal(where: str) -> UnsupportedStrategyError:
    """The error for DeepSpeed, naming where it was found."""
    return UnsupportedStrategyError(
        f"autoremat does not support DeepSpeed ({where}): ZeRO gathers and partitions parameters inside its own engine, "
        "which autoremat's recomputed regions do not go through. Use FSDP instead (Lightning: "
        "strategy=ModelParallelStrategy() or FSDPStrategy(); Accelerate: the FSDP plugin, fsdp_version 1 or 2), or DDP, "
        "or leave autoremat out of this run")


def predicted_units(model: nn.Module, policy: Any, *, fsdp_version: int) -> dict[str, nn.Module]:
    """The units an FSDP wrap ``policy`` will make in ``model`` (not ``model`` itself), by
    canonical path (see the module docstring)."""
    if policy is None:
        return {}
    paths = {id(m): canonical_path(p) for p, m in model.named_modules()}
    chosen: list[nn.Module]
    if hasattr(policy, "_run_policy"):  # FSDP1's ModuleWrapPolicy, CustomPolicy
        chosen = list(policy._run_policy(model, set(), {}))
    elif fsdp_version == 2:
        chosen = [m for m in model.modules() if policy(m)]
    else:
        chosen = []
        _recursive_choice(model, policy, chosen)
    return {paths[id(m)]: m for m in chosen if m is not model and id(m) in paths}


def _recursive_choice(module: nn.Module, policy: Callable[..., bool], chosen: list[nn.Module]) -> int:
    """FSDP1's recursive wrap, choosing instead of wrapping; returns the wrapped parameter count."""
    total = sum(p.numel() for p in module.parameters())
    if not policy(module=module, recurse=True, nonwrapped_numel=total):
        return 0
    wrapped = sum(_recursive_choice(child, policy, chosen) for child in module.children())
    if policy(module=module, recurse=False, nonwrapped_numel=total - wrapped):
        chosen.append(module)
        return total
    return wrapped


@dataclass
class PerRankPlan:
    """A plan solved for one rank: ``plan`` (to apply), ``cut`` (what runs: cut at the units),
    the per-rank prediction, how many solves it took, the step budget it was solved for
    (``budget="min"`` or ``on_infeasible="min"``: the least reachable, its predicted peak) and a
    note for the summary when the budget was not the one asked for."""

    plan: Plan
    cut: Plan
    predicted_peak_bytes: int
    unoptimised_peak_bytes: int
    tries: int
    step_budget_bytes: int = 0
    note: str | None = None


def solve_per_rank(graph: Graph, spec: ShardingSpec, step_budget: int | str, solve: Callable[[Graph, Any], Plan],
                   cut: Callable[[Plan], Plan], *, on_infeasible: str = "error") -> PerRankPlan:
    """Solve ``graph`` for one rank under ``spec`` within ``step_budget`` (module docstring).
    ``solve(per_rank_graph, budget)`` is the integration's solver call (``budget`` bytes or
    ``"min"``); ``cut(plan)`` maps a plan onto the units (identity at module level).
    ``step_budget="min"``: the least plan the solver reaches on the per-rank graph, cut;
    ``on_infeasible="min"``: that plan where no plan meets ``step_budget`` (said in a warning)."""
    from ..cost import unoptimised_peak_bytes

    ranked = per_rank_graph(graph, spec)
    vanilla = int(unoptimised_peak_bytes(ranked))

    def judged(plan: Plan, tries: int, budget: int | None, note: str | None = None) -> PerRankPlan:
        snapped = cut(plan)
        peak = int(simulate(per_rank_graph(graph, spec, snapped), snapped, check=False, record=False).peak_bytes)
        return PerRankPlan(plan, snapped, peak, vanilla, tries, peak if budget is None else budget, note)

    if is_min(step_budget):
        return judged(solve(ranked, "min"), 1, None, "budget='min': the least reachable")
    budget = int(step_budget)
    best: PerRankPlan | None = None
    for tries in range(1, MAX_TRIES + 1):
        try:
            plan = solve(ranked, budget)
        except InfeasibleBudgetError as err:
            if best is None and on_infeasible != "min":
                raise
            logger.info("autoremat: no plan under %d bytes (%s); keeping the closest one", budget, err)
            break
        judge = judged(plan, tries, int(step_budget))
        if best is None or judge.predicted_peak_bytes < best.predicted_peak_bytes:
            best = judge
        over = judge.predicted_peak_bytes - int(step_budget)
        if over <= 0:
            return judge
        logger.info("autoremat: the plan cut at the FSDP units predicts %d bytes per rank, %d over the budget; "
                    "solving again %d bytes lower", judge.predicted_peak_bytes, over, over)
        budget -= max(over, 1)
    if on_infeasible == "min":
        least = judged(solve(ranked, "min"), MAX_TRIES + 1, None, f"asked {fmt_bytes(int(step_budget))}: unreachable")
        logger.warning("autoremat: no plan meets the per-rank step budget of %s; planned at the least reachable, %s "
                       "(on_infeasible='min')", fmt_bytes(int(step_budget)), fmt_bytes(least.predicted_peak_bytes))
        if best is not None and best.predicted_peak_bytes < least.predicted_peak_bytes:  # the cut can reorder them
            return replace(best, step_budget_bytes=best.predicted_peak_bytes, note=least.note)
        return least
    assert best is not None, "please report"
    raise InfeasibleBudgetError(int(step_budget), best.predicted_peak_bytes, solver="per-rank (cut at FSDP units)")


def accelerate_units(accelerator: Any, model: nn.Module) -> tuple[dict[str, nn.Module], int] | None:
    """Under Accelerate's FSDP plugin: the units ``accelerator.prepare`` will make in ``model``
    and the FSDP version; ``None`` without FSDP. Raises :class:`UnsupportedStrategyError` under
    DeepSpeed, and ``ValueError`` when ``model`` is sharded already (autoremat's ``prepare``
    comes before ``accelerator.prepare``)."""
    import copy

    from .._fsdp import has_units, is_fsdp1, is_fsdp2

    kind = str(getattr(accelerator, "distributed_type", "")).rsplit(".", 1)[-1]
    if kind == "DEEPSPEED" or getattr(getattr(accelerator, "state", None), "deepspeed_plugin", None) is not None:
        raise deepspeed_refusal("Accelerate's DeepSpeed plugin")
    if has_units(model) or is_fsdp1(model) or is_fsdp2(model):
        raise ValueError("autoremat.integrations.accelerate.prepare: the model is sharded already; call it before "
                         "accelerator.prepare(model, ...), on the model as you built it (the plan is made for the "
                         "unsharded model and follows it into the FSDP units accelerator.prepare makes)")
    if kind != "FSDP":
        return None
    plugin = copy.copy(accelerator.state.fsdp_plugin)
    version = int(getattr(plugin, "fsdp_version", 1) or 1)
    plugin.set_auto_wrap_policy(model)
    policy = plugin.auto_wrap_policy
    if version == 2 and policy is not None:
        from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy

        policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    return predicted_units(model, policy, fsdp_version=version), version


@contextlib.contextmanager
def accelerate_fsdp_precision(accelerator: Any, model: nn.Module, version: int) -> Iterator[None]:
    """The precision ``model`` runs in once ``accelerator.prepare`` has sharded it, for its
    capture. FSDP1 (and no FSDP): ``accelerator.autocast()``, the forward wrapper Accelerate puts
    on the model. FSDP2: no autocast (Accelerate's FSDP2 path does not wrap the forward; a capture
    under autocast ran other ops than the sharded model does, and a plan keeping ops inside a
    layer stopped the first step with "the module runs other ops"). A ``MixedPrecisionPolicy``
    whose ``param_dtype`` is not the parameters' (what ``mixed_precision="bf16"`` gives the FSDP2
    plugin) is refused: the model would run in that dtype, its plan is not made for it yet."""
    if version != 2:
        with accelerator.autocast():
            yield
        return
    policy = getattr(getattr(accelerator.state, "fsdp_plugin", None), "mixed_precision_policy", None)
    dtype = getattr(policy, "param_dtype", None)
    if dtype is not None and any(p.is_floating_point() and p.dtype != dtype for p in model.parameters()):
        raise UnsupportedStrategyError(
            f"autoremat does not plan under Accelerate's FSDP2 plugin with mixed precision yet (its "
            f"MixedPrecisionPolicy runs the model in {dtype}, without autocast): use fsdp_version=1 (autocast, "
            "supported), or mixed_precision='no', or leave autoremat out of this run")
    yield
