"""How :class:`~autoremat.integrations.lightning.AutoRemat` reuses a plan instead of profiling:
from the plan cache (:mod:`autoremat.cache`) or from ``plan=`` (a saved plan, checked against the
batch before it is applied)."""

from __future__ import annotations

import hashlib
import inspect
from typing import TYPE_CHECKING, Any

import torch

from ..cache import plan_key, trainable_digest
from ..capture import resolve_times
from ..capture.signature import check_inputs
from ..measure import default_loss
from ..resident import resident_bytes
from ._planning import cached_plan_misfit
from .summary import summarise

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from .lightning import AutoRemat

__all__ = ["cache_key", "from_cache", "reuse_given", "TRAINABLE", "dropped_if_stale"]


def _batch_size(cb: "AutoRemat", pl_module: "pl.LightningModule") -> int | None:
    from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr

    return lightning_getattr(pl_module, cb.batch_arg_name) if lightning_hasattr(pl_module, cb.batch_arg_name) else None


def cache_key(cb: "AutoRemat", trainer: "pl.Trainer", args: tuple, kwargs: dict) -> str | None:
    """The plan-cache key of this run (``None`` without a cache): the module, the recorded
    inputs and every setting the decision depends on."""
    if cb.cache is None:
        return None
    assert cb._target is not None, "please report"
    settings = {"integration": "lightning", "budget": cb.budget, "solver": cb.solver, "offload": cb.offload,
                "raise_batch_size": cb.raise_batch_size, "max_batch_size": cb.max_batch_size,
                "on_infeasible": cb.on_infeasible, "times": resolve_times(cb.times), "output_kept": cb.output_kept,
                "precision": str(trainer.precision), "loss_fn": getattr(cb.loss_fn, "__qualname__", None),
                # how often training_step calls the module sets the budget per call (calls_per_step)
                "training_step": _source_hash(type(trainer.lightning_module).training_step)}
    return plan_key(cb._target, args, kwargs, settings)


def _source_hash(fn: Any) -> str | None:
    """A hash of ``fn``'s source (``None`` where Python has none for it)."""
    try:
        return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16]
    except (OSError, TypeError):
        return None


def from_cache(cb: "AutoRemat", key: str | None, device: torch.device, resident: int,
               allocated: int | None = None) -> dict[str, Any] | None:
    """The cached decision under ``key`` where its plan still fits this run's step budget (a
    share of it per call where ``training_step`` calls the module more than once, as
    :func:`~._planning.plan_within` plans each call; the count is stored with the decision)."""
    if key is None or cb.cache is None:
        return None
    entry = cb.cache.load(key)
    if entry is None:
        return None
    misfit = cached_plan_misfit(entry, cb.budget, device, resident, allocated, int(entry.get("calls", 1)))
    if misfit is not None:
        cb._progress.line(misfit)
        return None
    path = cb.cache.path(key)
    cb._progress.line(f"reusing the cached plan {path} (no profiling)")
    entry["summary"] = {**entry["summary"], "source": f"cache ({path.name})"}
    return entry


def reuse_given(cb: "AutoRemat", trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> dict[str, Any]:
    """The payload of a plan given as ``plan=``: checked against the batch, measured, no capture."""
    assert cb._target is not None and cb.given_plan is not None, "please report"
    plan = cb.given_plan
    args, kwargs, batch_bytes = cb._record_inputs(trainer, pl_module, choose=True)
    check_inputs(plan, args, kwargs)  # another batch size, dtype or device: PlanMismatchError
    grads = "expected" if getattr(pl_module, "automatic_optimization", False) else "none"
    resident = resident_bytes(pl_module, optimizers=trainer.optimizers, grads=grads) + batch_bytes
    size = _batch_size(cb, pl_module)
    with cb._progress.phase("a measured step with the saved plan"):
        measured = cb._measure_patched(cb._target, trainer, pl_module, plan, cb.loss_fn or default_loss, size)
    summary = summarise(plan, None, step_budget=plan.budget_bytes, resident=resident, measured=measured,
                        source="plan= (a saved plan)", batch_before=size, batch_after=size,
                        not_raised=cb._raise_skipped(trainer, pl_module))
    return {"plan": plan.to_dict(), "batch_size": size, "original_batch_size": size,
            "step_budget_bytes": plan.budget_bytes, "summary": summary, "module": cb.module}


TRAINABLE = "trainable_at_planning"
"""The key of ``Plan.options`` under which the callback records its target's
:func:`~autoremat.cache.trainable_digest` when it plans (kept with the plan in its ``state_dict``)."""


def dropped_if_stale(cb: "AutoRemat", trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> str | None:
    """Where the callback holds a plan from an earlier fit (or a checkpoint) made while other
    parameters were trainable (a backbone unfrozen between two fits of a fine-tuning run): the
    plan and batch size are dropped, the batch size the callback raised is put back, and the reason
    is returned, so that this fit plans again; else ``None`` (the plan is reused, as before). A plan
    from an older checkpoint has no record and is reused."""
    from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr, lightning_setattr

    from ._lightning_trainer import reset_dataloaders

    assert cb.plan is not None and cb._target is not None, "please report"
    then = cb.plan.options.get(TRAINABLE)
    if then is None or then == trainable_digest(cb._target):
        return None
    original, name = cb.original_batch_size, cb.batch_arg_name
    if original is not None and lightning_hasattr(pl_module, name) and lightning_getattr(pl_module, name) != original:
        lightning_setattr(pl_module, name, original)
        reset_dataloaders(trainer)
    cb.plan = cb.batch_size = None
    return "the trainable parameters changed since the plan was made; planning again"
