"""``AutoRemat`` under Lightning's sharded strategies (issue 21): ``ModelParallelStrategy``
(FSDP2: the user shards in ``configure_model``) and ``FSDPStrategy`` (FSDP1: the strategy wraps
the module in ``FullyShardedDataParallel`` units).

The order, in ``on_fit_start`` (after the strategy has sharded the model and made the
optimizers), on every rank unless said otherwise:

1. rank zero measures what is resident per rank (the local shards of parameters, gradients and
   optimizer state, buffers, the batch; :func:`autoremat.resident.resident_bytes`);
2. **the full parameters in place** (:func:`capture_view`, a collective): FSDP2 units are
   unsharded (:func:`autoremat._fsdp.full_parameters`), FSDP1 ``summon_full_params`` runs on the
   strategy's wrapper with the wrappers inside the module lifted out of the module tree (the
   module then looks as it was before wrapping); module hooks are silenced. Rank zero records the
   module's inputs and captures it there: the same graph, node names and fingerprint as the
   unsharded module, with no collective (the others wait). Leaving the view reshards (local);
3. rank zero makes the :class:`~autoremat.per_rank.ShardingSpec` of the sharded module, turns
   the budget into a per-rank step budget (a percentage: of the per-rank unoptimised peak) and
   solves for one rank, the plan cut at the units as it will run
   (:func:`~autoremat.integrations._strategies.solve_per_rank`);
4. the plan is broadcast and every rank applies it to the sharded module (shard, then apply:
   :mod:`autoremat.runtime.sharding`). A resumed run applies the plan from the checkpoint the same way.

DeepSpeed strategies are refused in ``setup``; raising the batch size is not done under a sharded
strategy (``raise_batch_size="auto"`` skips it with one info line, ``True`` is refused); offload
plans are not made (``offload=True`` is refused). The capture needs the module's full parameters
on rank zero for its duration.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from torch import nn

from .._fsdp import full_parameters, is_fsdp1, is_fsdp2, units_of
from ..capture._tracing import silenced_hooks
from ..capture.scaled import capture_within, profile_limit_bytes
from ..measure import default_loss
from ..per_rank import per_rank_graph
from ..resident import allocated_resident_bytes, device_of, resident_bytes
from ..cost import simulate
from ._common import capture_blocks, step_budget_bytes
from ._planning import profiling_budget, wants_least
from ._strategies import UnsupportedStrategyError, deepspeed_refusal, solve_per_rank

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["strategy_kind", "capture_view", "profile_and_solve_sharded", "SHARDED"]

SHARDED = ("fsdp1", "fsdp2")


def strategy_kind(trainer: "pl.Trainer") -> str:
    """``"plain"`` (single device, DDP), ``"fsdp1"`` (``FSDPStrategy``) or ``"fsdp2"``
    (``ModelParallelStrategy``); raises :class:`UnsupportedStrategyError` for the rest."""
    name = type(trainer.strategy).__name__
    if "DeepSpeed" in name:
        raise deepspeed_refusal(f"Lightning's {name}")
    if name == "FSDPStrategy" or isinstance(trainer.strategy, _strategy_class("FSDPStrategy")):
        return "fsdp1"
    if name == "ModelParallelStrategy" or isinstance(trainer.strategy, _strategy_class("ModelParallelStrategy")):
        return "fsdp2"
    if any(s in name for s in ("SingleDevice", "DDP")) and "Sharded" not in name:
        return "plain"
    raise UnsupportedStrategyError(f"AutoRemat supports single-device, DDP, FSDPStrategy and ModelParallelStrategy "
                                   f"(FSDP2) strategies, not {name}")


def _strategy_class(name: str) -> type:
    import lightning.pytorch.strategies as strategies

    return getattr(strategies, name, type(None))


@contextlib.contextmanager
def capture_view(trainer: "pl.Trainer", pl_module: nn.Module, kind: str) -> Iterator[None]:
    """The module with its full parameters in place and its hooks silenced (every rank
    enters; see the module docstring)."""
    if kind == "fsdp2" or any(is_fsdp2(m) for m in pl_module.modules()):
        with full_parameters(pl_module), silenced_hooks(pl_module):
            yield
        return
    from torch.distributed.fsdp import FullyShardedDataParallel

    root = trainer.strategy.model
    with FullyShardedDataParallel.summon_full_params(root, writeback=False), _lifted(pl_module), \
            silenced_hooks(pl_module):
        yield


@contextlib.contextmanager
def _lifted(model: nn.Module) -> Iterator[None]:
    """Every FSDP1 wrapper inside ``model`` replaced, in its parent, by the module it wraps."""
    swaps: list[tuple[nn.Module, str, nn.Module]] = []
    for parent in list(model.modules()):
        for name, child in list(parent._modules.items()):
            if child is not None and is_fsdp1(child):
                swaps.append((parent, name, child))
    try:
        for parent, name, child in swaps:
            parent._modules[name] = child._fsdp_wrapped_module
        yield
    finally:
        for parent, name, child in reversed(swaps):
            parent._modules[name] = child


def profile_and_solve_sharded(cb: Any, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                              kind: str) -> dict[str, Any] | None:
    """Steps 1-3 of the module docstring; the payload (plan, summary) on rank zero, ``None``
    elsewhere. Every rank must call it."""
    from ..runtime._unit_trace import canonical_trace
    from ..runtime.sharded_memory import sharding_spec
    from ..runtime.sharding import snap_plan

    target = cb._target
    zero = trainer.is_global_zero
    loss_fn = cb.loss_fn or default_loss
    grads = "expected" if getattr(pl_module, "automatic_optimization", False) else "none"
    resident = resident_bytes(pl_module, optimizers=trainer.optimizers, grads=grads) if zero else 0
    graph = None
    with capture_view(trainer, pl_module, kind):
        if zero:
            args, kwargs, batch_bytes = cb._record_inputs(trainer, pl_module)
            resident += batch_bytes
            device = device_of(target, args, kwargs)
            limit = profile_limit_bytes(profiling_budget(cb.budget, cb.on_infeasible, resident), device=device,
                                        resident_bytes=resident)
            with trainer.precision_plugin.forward_context():
                graph = capture_within(target, args, kwargs, limit_bytes=limit, loss_fn=loss_fn,
                                       blocks=capture_blocks(cb._solver_options(sharded=True)[0]),
                                       repeats=cb.profile_steps, warmup=1)
                graph.meta["output_kept"] = cb.output_kept
    if not zero:
        return None
    assert graph is not None, "please report"
    spec = sharding_spec(target, graph, fsdp_version=1 if kind == "fsdp1" else 2,
                         outer=trainer.strategy.model if kind == "fsdp1" else None)
    ranked_graph = per_rank_graph(graph, spec)
    allocated = allocated_resident_bytes(pl_module, device=device, inputs=(args, kwargs), optimizers=trainer.optimizers)
    step_budget = "min" if wants_least(cb.budget, cb.on_infeasible, resident) else \
        step_budget_bytes(cb.budget, ranked_graph, device, resident, allocated)
    canon = canonical_trace(target, units_of(target)) if graph.meta.get("mode") == "fx" else None
    solve = (lambda g, b: cb._solve(g, b, sharded=True))
    ranked = solve_per_rank(graph, spec, step_budget, solve,
                            (lambda p: snap_plan(p, canon)) if canon is not None else (lambda p: p),
                            on_infeasible=cb.on_infeasible)
    sim = simulate(per_rank_graph(graph, spec, ranked.cut), ranked.cut, check=False, record=False)
    batch = None
    from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr

    if lightning_hasattr(pl_module, cb.batch_arg_name):
        batch = lightning_getattr(pl_module, cb.batch_arg_name)
    plan = ranked.plan
    summary = {
        "solver": plan.solver, "segments": len(ranked.cut.segments), "recomputed": len(ranked.cut.recompute_segments),
        "graph_nodes": len(graph), "graph_mode": graph.meta["mode"],
        "step_budget_bytes": ranked.step_budget_bytes, "budget_note": ranked.note, "resident_bytes": resident,
        "unoptimised_peak_bytes": ranked.unoptimised_peak_bytes, "predicted_peak_bytes": sim.peak_bytes,
        "measured_peak_bytes": None,
        "predicted_overhead": sim.extra_time_s / max(sim.step_time_s - sim.extra_time_s, 1e-12),
        "batch_size_before": batch, "batch_size_after": batch,
        "batch_size_not_raised": None if cb.raise_batch_size is False else "a sharded strategy (not supported yet)",
        "per_rank": {"strategy": kind, "world_size": spec.world_size, "units": len(spec.units), "tries": ranked.tries},
    }
    if cb.raise_batch_size is False:
        summary["batch_size_not_raised"] = "raise_batch_size=False"
    return {"plan": plan.to_dict(), "batch_size": batch, "original_batch_size": batch,
            "step_budget_bytes": ranked.step_budget_bytes, "summary": summary}
