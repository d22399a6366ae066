"""``AutoRemat``: a Lightning callback that profiles, solves, patches and raises the batch size.

Modelled on Lightning's ``BatchSizeFinder``: a thin callback that validates in ``setup``, does
its work in ``on_fit_start`` (before the first optimisation step, so no step runs unpatched and
no state is lost), keeps its plan and batch size in its ``state_dict`` (a resumed run applies
them without profiling again) and restores the model when fitting ends.

What it does in ``on_fit_start``:

1. takes the first batch of the training dataloader and records the positional and keyword
   inputs of the module to optimise (``module=``; default: the LightningModule, or the first
   trainable submodule ``training_step`` calls, :func:`~._lightning_steps.record_inputs`) by running
   ``training_step`` once without gradients (``self.log`` is silenced for that call; other side
   effects of ``training_step`` happen, so keep it free of them or check
   ``torch.is_grad_enabled()``; it is called again for each batch size tried when raising);
2. captures that module on those inputs under the trainer's precision context (autocast), with
   ``profile_steps`` timed repeats, and measures what is resident before a step (parameters,
   optimizer state, the batch, and under automatic optimisation the previous step's
   gradients, which Lightning frees only after ``training_step``);
3. converts the device budget to a step-peak budget (``"auto"``: free device memory, or
   available host memory on a CPU, minus a margin, minus the resident bytes; a size or byte
   count: minus the resident bytes; a percentage: of the unoptimised step peak), solves, applies;
4. with ``raise_batch_size`` (``"auto"``, the default: only where a ``batch_size`` attribute
   exists, else one info line says it was skipped): scales the graph's activation bytes with the
   batch size (:meth:`autoremat.Graph.scaled`; parameter bytes do not scale), finds the largest batch whose plan fits
   (:mod:`autoremat.integrations.batch_size`: doubling, then bisection, capped by
   ``max_batch_size`` and the dataset length; every probe solves exactly as the final plan
   does, offload handling included), sets it the
   way Lightning does (``batch_size`` on the model, its ``hparams`` or the datamodule), rebuilds
   the dataloaders and confirms with a trial step of the patched module on a real batch of the
   new size (its measured step peak must meet the budget); on out-of-memory (Lightning's
   ``is_oom_error``: CUDA OOM, or the CPU allocator's "can't allocate memory") or a measured
   peak above the budget it backs off by bisection toward the last size that fitted.
   Model and optimizer state are never changed by any of this (capture restores RNG, buffers
   and gradients; no optimizer step is taken). When any step raises (capture fails, the budget
   is infeasible, profiling runs out of memory), the module is left unpatched with its batch size,
   dataloaders, placement and RNG state as they were before ``on_fit_start``.

A budget below what any plan reaches raises :class:`~autoremat.errors.InfeasibleBudgetError`
right after the capture (before any batch-size search), stating the reachable range in bytes and
percent; ``budget="min"`` plans at the least reachable step peak, and ``on_infeasible="min"``
falls back to it with a warning. ``plan=`` (a plan file from ``autoremat plan --out`` or
``plan.to_json``) skips profiling and solving: the plan is checked against the model (graph
fingerprint) and the batch (shapes, dtypes, devices) before it is applied. With a plan cache
(``cache_dir=`` or ``AUTOREMAT_CACHE_DIR``, see :mod:`autoremat.cache`) the decision is stored
and a second run of the same script on the same model and batch reuses it without profiling.

Under DDP rank zero profiles and solves; plan and batch size are broadcast, so every rank runs
the same plan. Under ``ModelParallelStrategy`` (FSDP2) and ``FSDPStrategy`` (FSDP1) the plan is
made for one rank and applied to the sharded module (:mod:`autoremat.integrations._lightning_sharded`);
DeepSpeed is refused in ``setup``. Everything user-facing is printed on rank zero only: the phases
with their elapsed times while they run (:mod:`autoremat.progress`) and a summary table at the end.
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..budget import ACCEPTED_FORMS, check_budget, check_on_infeasible
from ..cache import PlanCache, trainable_digest
from ..capture import resolve_times
from ..capture.scaled import capture_within, profile_limit_bytes
from ..errors import InfeasibleBudgetError
from ..graph import Graph, check_output_kept
from ..measure import default_loss
from ..plan import Plan
from ..progress import Progress
from ..resident import allocated_resident_bytes, device_of, resident_bytes, storage_bytes
from ..runtime import REGION_MODES, apply, is_patched, restore
from ..solvers import OFFLOAD_ONLY, SOLVERS, check_solver, solve
from ._common import capture_blocks, step_budget_bytes
from ._lightning_reuse import TRAINABLE, cache_key, dropped_if_stale, from_cache, reuse_given
from ._lightning_sharded import SHARDED, profile_and_solve_sharded, strategy_kind
from ._lightning_steps import calls_per_step, confirmed, record_inputs, try_size
from ._lightning_trainer import (atomic_fit_start, batch_of, dataset_length, reset_dataloaders, silenced_logging,
                                 trial_step)
from ._planning import as_plan, least_for, plan_within, profiling_budget
from .batch_size import confirmed_largest, predicted_largest
from .summary import print_summary, summarise

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr, lightning_setattr
    from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
except ImportError as exc:  # pragma: no cover - lightning is a hard dependency
    raise ImportError("autoremat.AutoRemat needs lightning (pip install lightning)") from exc

__all__ = ["AutoRemat"]

logger = logging.getLogger(__name__)

_STATE_VERSION, _RAISE_MODES = 1, ("auto", True, False)



class AutoRemat(Callback):
    """Fit the training step into a memory budget by recomputation, and raise the batch size.

    Args:
        budget: device memory budget: ``"auto"`` (free device memory minus a margin), bytes,
            a size string (``"6GB"``, ``"512MiB"``), a fraction of the unoptimised step peak
            (``"50%"``, ``0.5``) or ``"min"`` (the least step peak the solver reaches).
        solver: a name of :data:`autoremat.SOLVERS` or ``"auto"``.
        offload: ``"auto"``: the ``"combined"`` planner (recomputation plus offload to pinned host
            memory) takes part when the module runs on CUDA; ``True``: always plan with it;
            ``False``: recomputation only.
        profile_steps: timed repeats when profiling the first batch (``>= 1``).
        raise_batch_size: raise the batch size to the largest whose plan fits: ``"auto"`` (the
            default) where the model, its ``hparams`` or the datamodule has a ``batch_arg_name``
            attribute, else skipped with one info line; ``True``: required (an error without
            the attribute); ``False``: never.
        max_batch_size: upper bound when raising (default 8192, as Lightning's tuner).
        batch_arg_name: the attribute holding the batch size (model, hparams or datamodule).
        module: dotted path of the submodule to optimise, e.g. ``"model"``; default the
            LightningModule where ``training_step`` calls its ``forward`` first, else the first
            submodule with trainable parameters ``training_step`` calls (logged).
        loss_fn: maps the module's output to the scalar to backpropagate while profiling
            (default: :func:`autoremat.measure.default_loss`).
        verbose: print a summary table on rank zero.
        regions: how recomputed segments run: ``"lean"`` (autoremat's own checkpoint, little
            work per saved tensor) or ``"torch"`` (``torch.utils.checkpoint``); see
            :func:`autoremat.apply`.
        on_infeasible: ``"error"`` (default): a budget no plan meets raises, stating the reachable
            range; ``"min"``: plan at the least reachable step peak instead, with a warning.
        plan: a saved plan (file path, :class:`~autoremat.Plan` or dict) to apply instead of
            profiling and solving; refused, before training, if made for another model or batch.
        cache_dir: directory of the plan cache (default ``AUTOREMAT_CACHE_DIR``; no cache when
            neither is set): a second run on the same model and batch reuses the plan.
        times: node times for planning: ``"measured"`` or ``"flops"`` (deterministic); default
            ``AUTOREMAT_TIMES``, else measured.
        output_kept: how long the step keeps the object ``module`` returns, so the bytes it holds
            (the logits beside a loss computed with ``labels``, a key/value cache): ``"loss"``
            (the default: ``training_step`` returns the loss, and Lightning holds only what it
            returns) or ``"step"`` (to the end of backward: a ``training_step`` returning the
            output object, or a dict keeping it); ``Graph.meta["output_kept"]``.
    """

    def __init__(
        self,
        budget: int | float | str = "auto",
        solver: str = "auto",
        offload: bool | str = "auto",
        profile_steps: int = 3,
        raise_batch_size: bool | str = "auto",
        max_batch_size: int = 8192,
        batch_arg_name: str = "batch_size",
        module: str | None = None,
        loss_fn: Callable[[Any], torch.Tensor] | None = None,
        verbose: bool = True,
        regions: str = "lean",
        on_infeasible: str = "error",
        plan: Any = None,
        cache_dir: str | None = None,
        times: str | None = None,
        output_kept: str = "loss",
    ) -> None:
        super().__init__()
        if regions not in REGION_MODES:
            raise ValueError(f"regions={regions!r} must be one of {REGION_MODES}")
        if isinstance(budget, bool) or not isinstance(budget, (numbers.Real, str)):
            raise ValueError(f"budget={budget!r} is not understood; expected {ACCEPTED_FORMS}")
        if isinstance(budget, numbers.Real):  # numpy scalars: plain Python numbers from here on
            budget = int(budget) if isinstance(budget, numbers.Integral) else float(budget)
        check_budget(budget)  # syntax and range check now, not mid-run
        check_solver(solver)
        on_infeasible, self.output_kept = check_on_infeasible(on_infeasible), check_output_kept(output_kept)
        given = as_plan(plan)  # a missing or malformed plan file fails here, before training
        if raise_batch_size is True and given is not None:
            raise ValueError("raise_batch_size=True with plan=: a saved plan is made for one batch size; pass "
                             "raise_batch_size='auto' or False, or drop plan= to profile and raise")
        cache = PlanCache.from_setting(cache_dir)
        if times is not None:
            resolve_times(times)
        if raise_batch_size not in _RAISE_MODES or isinstance(raise_batch_size, int) and not isinstance(
                raise_batch_size, bool):
            raise ValueError(f"raise_batch_size={raise_batch_size!r} must be 'auto' (raise where the model has a "
                             f"`{batch_arg_name}` attribute), True or False")
        if offload not in ("auto", True, False):
            raise ValueError(f"offload={offload!r} must be 'auto' (offload where a GPU makes it pay), True or False")
        if offload is False and solver in OFFLOAD_ONLY:
            raise ValueError(f"solver={solver!r} plans offloads, which offload=False forbids; pick a recomputation "
                             "solver (e.g. 'dp-approx') or leave offload='auto'")
        if not isinstance(profile_steps, int) or profile_steps < 1:
            raise ValueError(f"profile_steps={profile_steps!r} must be an int >= 1")
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size!r} must be an int >= 1")
        if module is not None and not isinstance(module, str):
            raise ValueError(f"module={module!r} must be a dotted attribute path such as 'model', or None")
        if not isinstance(verbose, bool):
            raise ValueError(f"verbose={verbose!r} must be True or False")
        if not isinstance(batch_arg_name, str) or not batch_arg_name.replace(".", "_").isidentifier():
            raise ValueError(f"batch_arg_name={batch_arg_name!r} must be the name of the batch-size attribute, "
                             "e.g. 'batch_size'")
        if loss_fn is not None and not callable(loss_fn):
            raise ValueError(f"loss_fn={loss_fn!r} must be callable (outputs -> scalar tensor) or None")
        self.budget, self.solver, self.offload = budget, solver, offload
        self.profile_steps = profile_steps
        self.raise_batch_size = raise_batch_size
        self.max_batch_size = max_batch_size
        self.batch_arg_name = batch_arg_name
        self.module = module
        self.loss_fn = loss_fn
        self.verbose = verbose
        self.regions = regions
        self.on_infeasible = on_infeasible
        self.times = times
        self.given_plan = given
        self.cache = cache
        self.plan: Plan | None = None
        self.batch_size: int | None = None
        self.original_batch_size: int | None = None
        self.step_budget_bytes: int | None = None
        self.summary: dict[str, Any] = {}
        self._target: nn.Module | None = None
        self._progress = Progress(enabled=False)

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        return {"version": _STATE_VERSION, "plan": None if self.plan is None else self.plan.to_dict(),
                "batch_size": self.batch_size, "original_batch_size": self.original_batch_size,
                "step_budget_bytes": self.step_budget_bytes, "summary": dict(self.summary), "module": self.module}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("version") != _STATE_VERSION:
            raise ValueError(f"AutoRemat state version {state_dict.get('version')!r} is not supported")
        self.plan = None if state_dict.get("plan") is None else Plan.from_dict(state_dict["plan"])
        self.batch_size = state_dict.get("batch_size")
        self.original_batch_size = state_dict.get("original_batch_size")
        self.step_budget_bytes = state_dict.get("step_budget_bytes")
        if self.module is None:  # the submodule the planning run chose (module=None), if it chose one
            self.module = state_dict.get("module")
        summary = state_dict.get("summary") or {}  # (a checkpoint of an older version has none)
        was = summary.get("source")
        self.summary = {**summary, "source": "checkpoint" + (f" (planned from: {was})" if was else "")} \
            if summary else {}

    # ------------------------------------------------------------------ hooks
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage != "fit":
            return
        if strategy_kind(trainer) in SHARDED and (self.offload is True or self.raise_batch_size is True
                                                   or self.solver in OFFLOAD_ONLY):
            raise ValueError("under a sharded strategy (FSDP) AutoRemat neither offloads nor raises the batch size; "
                             "pass offload='auto' or False, raise_batch_size='auto' or False, a recomputation solver")
        if self.offload is True and trainer.strategy.root_device.type != "cuda":
            raise ValueError(f"offload=True needs a CUDA device (this run is on {trainer.strategy.root_device}): "
                             "without separate device memory, offloading saves nothing; use offload='auto' or False")
        target = self._resolve(pl_module)
        if is_patched(target):
            raise ValueError(f"module {self.module or type(pl_module).__name__} is already patched by autoremat; "
                             "use one AutoRemat callback per module")
        if (self.raise_batch_size is True and self.plan is None
                and not lightning_hasattr(pl_module, self.batch_arg_name)):
            raise ValueError(f"raise_batch_size=True needs a `{self.batch_arg_name}` attribute on the model, its "
                             "hparams or the datamodule (as Lightning's BatchSizeFinder does); add one or pass "
                             "raise_batch_size='auto' (skip when there is none) or False")
        if trainer.accumulate_grad_batches != 1 and self.raise_batch_size is True:
            raise ValueError("raise_batch_size=True with accumulate_grad_batches > 1 is not supported; "
                             "pass raise_batch_size=False")

    def _raise_skipped(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> str | None:
        """Why the batch size is not raised in this run (``None``: it is raised)."""
        if self.raise_batch_size is False:
            return "raise_batch_size=False"
        if self.given_plan is not None:
            return "a saved plan (plan=) is made for one batch size"
        if not lightning_hasattr(pl_module, self.batch_arg_name):
            return (f"no `{self.batch_arg_name}` attribute on the model, its hparams or the datamodule "
                    "(add one to let AutoRemat raise it)")
        if trainer.accumulate_grad_batches != 1:
            return "accumulate_grad_batches > 1"
        return None

    def _resolve(self, pl_module: nn.Module) -> nn.Module:
        if self.module is None:
            return pl_module
        obj: Any = pl_module
        for part in self.module.split("."):
            if not hasattr(obj, part):
                raise ValueError(f"module={self.module!r}: {type(obj).__name__} has no attribute {part!r}")
            obj = getattr(obj, part)
        if not isinstance(obj, nn.Module):
            raise ValueError(f"module={self.module!r} is a {type(obj).__name__}, not a torch.nn.Module")
        return obj

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        target = self._resolve(pl_module)
        with atomic_fit_start(trainer, pl_module, self, target):  # when it raises, all is as it was
            self._target = target
            self._progress = Progress(enabled=self.verbose and trainer.is_global_zero)
            self._fit_start(trainer, pl_module)

    def _fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        assert self._target is not None, "on_fit_start resolves the target first, please report"
        if self.plan is not None and (stale := dropped_if_stale(self, trainer, pl_module)) is not None:
            rank_zero_info(f"AutoRemat: {stale}")
        if self.plan is not None:  # resumed: reuse plan and batch size, no profiling
            if self.batch_size is not None and lightning_hasattr(pl_module, self.batch_arg_name):
                if lightning_getattr(pl_module, self.batch_arg_name) != self.batch_size:
                    lightning_setattr(pl_module, self.batch_arg_name, self.batch_size)
                    reset_dataloaders(trainer)
            apply(self._target, self.plan, regions=self.regions)
            size = "" if self.batch_size is None else f" (batch size {self.batch_size})"
            rank_zero_info(f"AutoRemat: resumed {self.plan.describe()}{size}")
            return
        if trainer.fit_loop._combined_loader is None:
            trainer.fit_loop.setup_data()  # every rank: it synchronises under DDP
        payload, kind = None, strategy_kind(trainer)
        try:  # sharded: every rank takes part (the full parameters are gathered for rank zero's capture)
            if kind in SHARDED:
                payload = profile_and_solve_sharded(self, trainer, pl_module, kind)
            elif trainer.is_global_zero:
                payload = reuse_given(self, trainer, pl_module) if self.given_plan is not None else \
                    self._profile_and_solve(trainer, pl_module)
        except Exception as err:  # the other ranks wait in the broadcast: tell them, then raise
            if trainer.is_global_zero:
                trainer.strategy.broadcast({"error": f"{type(err).__name__}: {err}"}, src=0)
            raise
        payload = trainer.strategy.broadcast(payload, src=0)
        if "error" in payload:
            raise RuntimeError(f"AutoRemat: rank 0 failed while planning, so every rank stops: {payload['error']}")
        plan = Plan.from_dict(payload["plan"])
        if "module" in payload and payload["module"] != self.module:  # rank zero chose the submodule training_step calls
            self.module = payload["module"]
            self._target = self._resolve(pl_module)
        if payload["batch_size"] is not None and lightning_hasattr(pl_module, self.batch_arg_name):
            if lightning_getattr(pl_module, self.batch_arg_name) != payload["batch_size"]:
                lightning_setattr(pl_module, self.batch_arg_name, payload["batch_size"])
                reset_dataloaders(trainer)
        if not is_patched(self._target):
            apply(self._target, plan, regions=self.regions)
        plan.options[TRAINABLE] = trainable_digest(self._target)
        self.plan, self.batch_size, self.original_batch_size = plan, payload["batch_size"], payload["original_batch_size"]
        self.step_budget_bytes, self.summary = payload["step_budget_bytes"], payload["summary"]
        if self.verbose and trainer.is_global_zero:
            print_summary(self.summary)

    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._target is not None:
            restore(self._target)

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        if self._target is not None:
            restore(self._target)

    # ------------------------------------------------------------------ the work (rank zero)
    def _profile_and_solve(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> dict[str, Any]:
        assert self._target is not None, "on_fit_start resolves the target first, please report"
        args, kwargs, batch_bytes = self._record_inputs(trainer, pl_module, choose=True)
        target, progress = self._target, self._progress  # (recording may choose the target: module=None)
        loss_fn = self.loss_fn or default_loss
        # Lightning's automatic optimisation zeroes gradients inside the closure *after*
        # training_step, so the previous step's gradients are still allocated during the forward.
        grads = "expected" if getattr(pl_module, "automatic_optimization", False) else "none"
        resident = resident_bytes(pl_module, optimizers=trainer.optimizers, grads=grads) + batch_bytes
        device = device_of(target, args, kwargs)
        allocated = allocated_resident_bytes(pl_module, device=device, inputs=(args, kwargs),
                                             optimizers=trainer.optimizers)
        key = cache_key(self, trainer, args, kwargs)
        cached = from_cache(self, key, device, resident, allocated)
        if cached is not None:
            return cached
        limit = profile_limit_bytes(profiling_budget(self.budget, self.on_infeasible, resident), device=device,
                                    resident_bytes=resident)
        with progress.phase(f"capture {type(target).__name__}"), trainer.precision_plugin.forward_context():
            # never an unpatched step above the device budget
            graph = capture_within(target, args, kwargs, limit_bytes=limit, loss_fn=loss_fn, repeats=self.profile_steps,
                                   warmup=1, times=self.times, blocks=capture_blocks(self._solver_options()[0]))
        del args, kwargs  # the steps below load batches of their own: one batch on the device at a time
        graph.meta["output_kept"] = self.output_kept  # before solving: every cost model reads it
        (solver, solve_kwargs), calls = self._solver_options(), calls_per_step(self, trainer, pl_module)
        with progress.phase(f"solve ({len(graph)} nodes, solver {self.solver})"):
            plan, step_budget, note = plan_within(graph, self.budget, device=device, resident=resident, solver=solver,
                                                  allocated=allocated, calls=calls,
                                                  solve_kwargs=solve_kwargs, on_infeasible=self.on_infeasible,
                                                  who="AutoRemat", solve_fn=self._solve,
                                                  warn=lambda text: rank_zero_warn(f"AutoRemat: {text}"))
        batch_size = original = (lightning_getattr(pl_module, self.batch_arg_name)
                                 if lightning_hasattr(pl_module, self.batch_arg_name) else None)
        skipped = self._raise_skipped(trainer, pl_module)
        first = (plan, graph)
        if skipped is None:
            with progress.phase("raise the batch size (solves, then trial steps)") as phase:
                batch_size, plan, graph = self._raise(trainer, pl_module, graph, plan, int(original), step_budget,
                                                      loss_fn, batch_bytes, phase)
        elif self.raise_batch_size == "auto":
            rank_zero_info(f"AutoRemat: batch size not raised: {skipped}")
        with progress.phase("reachable range and a measured step"):
            measured, plan, graph, batch_size, step_budget = confirmed(
                self, target, trainer, pl_module, loss_fn, (plan, graph, batch_size, step_budget), first, original)
            least = least_for(graph, solver, solve_kwargs)
        summary = summarise(plan, graph, step_budget=step_budget, resident=resident, least=least, measured=measured,
                            budget_note=note, batch_before=original, batch_after=batch_size, not_raised=skipped)
        payload = {"plan": plan.to_dict(), "batch_size": batch_size, "original_batch_size": original,
                   "step_budget_bytes": step_budget, "summary": summary, "module": self.module, "calls": calls}
        if key is not None and self.cache is not None:
            path = self.cache.store(key, payload)
            progress.line(f"plan cached in {path}")
        return payload

    def _solver_options(self, sharded: bool = False, recompute_only: bool = False) -> tuple[str, dict[str, Any]]:
        """The solver and the options ``solve`` gets, after the ``offload`` setting (no offload
        under sharding: FSDP moves the parameters itself; nor with ``recompute_only`` unless
        offload is forced: the batch-size search's many solves, see :meth:`_raise`)."""
        kwargs: dict[str, Any] = {}
        solver = self.solver
        if (self.offload is False or sharded or (recompute_only and self.offload is not True)) and solver == "auto":
            kwargs["auto_solvers"] = [n for n in SOLVERS if n != "combined"]
        elif self.offload is True and solver in ("auto", "combined"):
            solver, kwargs["offload"] = "combined", True
        elif self.offload is True and solver in OFFLOAD_ONLY:
            kwargs["offload"] = True
        return solver, kwargs

    def _solve(self, graph: Graph, step_budget: int | str, sharded: bool = False,
               recompute_only: bool = False, first_fit: bool = False) -> Plan:
        """Every solve of the callback (``step_budget``: bytes, or ``"min"``; see :meth:`_solver_options`)."""
        solver, kwargs = self._solver_options(sharded, recompute_only)
        return solve(graph, step_budget, solver=solver, first_fit=first_fit, **kwargs)

    def _record_inputs(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                       size: int | None = None, *, choose: bool = False) -> tuple[tuple, dict, int]:
        """Inputs of the target module in ``training_step`` on a real batch (of ``size`` rows);
        ``choose``: see :func:`~._lightning_steps.record_inputs`."""
        return record_inputs(self, trainer, pl_module, size, choose=choose)

    def _measure_patched(self, target: nn.Module, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                         plan: Plan, loss_fn: Callable[[Any], torch.Tensor], size: int | None) -> int | None:
        """Measured step peak of the patched target on a real batch of ``size`` rows."""
        args, kwargs, _ = self._record_inputs(trainer, pl_module, size)
        was = is_patched(target)
        if not was:
            apply(target, plan, regions=self.regions)
        try:
            return trial_step(target, args, kwargs, loss_fn, trainer)
        finally:
            if not was:
                restore(target)

    def _raise(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", graph: Graph, plan: Plan,
               original: int, step_budget: int, loss_fn: Callable[[Any], torch.Tensor],
               batch_bytes: int, phase: Any = None) -> tuple[int, Plan, Graph]:
        """Largest batch size whose plan fits, confirmed by a trial step; backs off on OOM.

        The prediction and the confirmation both solve with :meth:`_plan_at` (budget net of the
        larger batch; the prediction's probes ask for the first plan that fits, ``first_fit``, which
        exists exactly where the full solve finds one); under ``solver="auto"`` both plan
        recomputation only: a ``combined`` solve
        that weighs offloads takes up to a minute on a CUDA graph of ~200 nodes (an H200 run of
        the raised-batch test spent its 110 s in them), and the search solves at every size of a
        doubling and a bisection. So a raised batch runs a recomputation plan (the one its trial
        step measured); ``solver="combined"`` or ``offload=True`` weigh offloads at every size."""
        limit = self.max_batch_size
        length = dataset_length(trainer)
        if length is not None:
            limit = min(limit, length)

        def fits(size: int) -> bool:
            try:
                self._plan_at(graph, size, original, step_budget, batch_bytes, recompute_only=True, first_fit=True)
                return True
            except InfeasibleBudgetError:
                return False

        candidate = predicted_largest(original, max(limit, original), fits)

        def trial(size: int) -> tuple[Plan, Graph] | None:
            if phase is not None:
                phase.step(f"trial step at batch size {size} (predicted largest {candidate})")
            return self._try_size(trainer, pl_module, graph, size, original, step_budget, loss_fn, batch_bytes)

        confirmed = confirmed_largest(original, candidate, trial)
        if confirmed is None:
            return original, plan, graph
        size, (plan_at_size, scaled) = confirmed
        return size, plan_at_size, scaled

    def _plan_at(self, graph: Graph, size: int, original: int, step_budget: int, batch_bytes: int,
                 recompute_only: bool = False, first_fit: bool = False) -> tuple[Plan, Graph, int]:
        """The plan for batch ``size``: the graph scaled from ``original``, under the step budget
        less the extra batch bytes. Raises :class:`InfeasibleBudgetError` when none fits."""
        budget = int(step_budget - max(0.0, batch_bytes * (size / original - 1)))
        scaled = graph.scaled(size / original)
        return self._solve(scaled, budget, recompute_only=recompute_only, first_fit=first_fit), scaled, budget

    def _try_size(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", graph: Graph, size: int,
                  original: int, step_budget: int, loss_fn: Callable[[Any], torch.Tensor],
                  batch_bytes: int) -> tuple[Plan, Graph] | None:
        """Solve at ``size`` and confirm with a patched trial step on a real batch of that size."""
        return try_size(self, trainer, pl_module, graph, size, original, step_budget, loss_fn, batch_bytes)
