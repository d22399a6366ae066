"""Accelerate: one call, or one config flag.

Accelerate's own config file rejects unknown keys, so autoremat is configured by
``AUTOREMAT_*`` environment variables (``accelerate launch`` passes the environment through)
or by an ``autoremat:`` section in a YAML file of ours::

    # train.py
    from accelerate import Accelerator
    import autoremat.integrations.accelerate as ar

    accelerator = Accelerator()
    model = ar.prepare(accelerator, model, (x,), budget="50%", optimizer=optimizer)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    # or, with no code change beyond `model = ar.prepare(accelerator, model, (x,))`:
    AUTOREMAT_BUDGET=50% AUTOREMAT_SOLVER=chen accelerate launch train.py
    AUTOREMAT_CONFIG=autoremat.yaml accelerate launch train.py   # autoremat: {budget: "6GB"}

Call ``prepare`` before ``accelerator.prepare`` (it patches the model in place and returns the
same object). Under multi-process launch the main process profiles and solves; its plan is
broadcast so all ranks run one plan. The main process shows the phases with their elapsed times
(:mod:`autoremat.progress`) and then the same summary table as the Lightning callback
(``AUTOREMAT_VERBOSE=0`` silences both); ``AUTOREMAT_ENABLED=0`` says that the model is left
as it is.

**FSDP plugin** (``fsdp_version`` 1 or 2, issue 21): the order is the same, and it is checked
(a model sharded already is refused with the order to use). ``prepare`` predicts the FSDP units
``accelerator.prepare`` will make from the plugin's wrap policy
(:func:`~autoremat.integrations._strategies.predicted_units`), solves for one rank (resident:
the parameter, gradient and optimizer-state shards plus buffers and the batch; step: the per-rank
graph of :mod:`autoremat.per_rank`, the plan cut at the units as it will run) and patches the
unsharded model; when ``accelerator.prepare`` shards it, the patched forward maps the plan onto
the units at the first forward (:mod:`autoremat.runtime.sharding`). DeepSpeed is refused before
any work (:func:`~autoremat.integrations._strategies.deepspeed_refusal`).

As with the callback: ``budget="min"`` (``AUTOREMAT_BUDGET=min``) plans at the least reachable
step peak; a budget no plan meets raises :class:`~autoremat.errors.InfeasibleBudgetError`
stating the reachable range, unless ``on_infeasible="min"`` (``AUTOREMAT_ON_INFEASIBLE=min``)
asks for the least instead; ``plan=`` (``AUTOREMAT_PLAN=plan.json``) applies a saved plan after
checking it against the model and the example batch; ``cache_dir=`` (``AUTOREMAT_CACHE_DIR``)
keeps decisions so a second run does not profile again; ``times="flops"``
(``AUTOREMAT_TIMES=flops``) plans on deterministic FLOP/byte times.

``output_kept`` (``AUTOREMAT_OUTPUT_KEPT``): how long the training loop keeps the object the model
returns, so the bytes it holds (the logits beside a loss computed with ``labels``, a key/value
cache): ``"step"`` (the default: to the end of backward, as ``outputs = model(**batch);
accelerator.backward(outputs.loss)`` does) or ``"loss"`` (dropped once the loss is computed:
``loss = model(**batch).loss``); the plan holds them that long (``Graph.meta["output_kept"]``).
``calls_per_step`` (``AUTOREMAT_CALLS_PER_STEP``, default 1): how many times the loop calls the
model before one backward (a contrastive encoder on two views: 2), all their activations live at
once; a byte or ``"auto"`` budget is then shared, each call planned at ``1/n`` of it (a
percentage is of one call's peak).
"""

from __future__ import annotations

import logging
import numbers
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from decimal import Decimal
from typing import Any

import torch
from torch import nn

from .._compiled import uncompiled
from ..budget import check_budget, check_on_infeasible, parse_budget
from ..cache import PlanCache, plan_key
from ..capture import resolve_times
from ..capture.scaled import capture_within, profile_limit_bytes
from ..capture.scaled.limits import free_cache, is_oom
from ..capture.signature import check_inputs
from ..errors import InfeasibleBudgetError
from ..graph import Graph, check_output_kept
from ..measure import default_loss
from ..plan import Plan
from ..progress import Progress
from ..resident import allocated_resident_bytes, resident_bytes
from ..runtime import apply, restore
from ..solvers import check_solver, solve
from ._atomic import Rollback
from ._common import capture_blocks, step_budget_bytes
from ._planning import (BACK_OFF, CONFIRM_TRIES, as_plan, cached_plan_misfit, least_for, measured_step_peak,
                        plan_within, profiling_budget, wants_least)
from ._strategies import accelerate_fsdp_precision, accelerate_units, solve_per_rank
from .summary import print_summary, summarise

__all__ = ["AutoRematConfig", "prepare", "budget_text"]

logger = logging.getLogger(__name__)

_ENV_PREFIX = "AUTOREMAT_"
_NOT_RAISED = "the Accelerate path keeps it"


@dataclass
class AutoRematConfig:
    """Settings of :func:`prepare`; environment variables ``AUTOREMAT_<FIELD>`` override them."""

    enabled: bool = field(default=True, metadata={"help": "Patch the model at all (AUTOREMAT_ENABLED=0 turns it off)."})
    budget: str = field(default="auto", metadata={"help": 'Device budget: "auto", bytes, "6GB", "512MiB", "50%" or 0.5.'})
    solver: str = field(default="auto", metadata={"help": "A name of autoremat.SOLVERS, or auto."})
    profile_steps: int = field(default=3, metadata={"help": "Timed repeats when profiling."})
    on_infeasible: str = field(default="error", metadata={
        "help": "A budget no plan meets: 'error' (raise, stating the reachable range) or 'min' (plan at the least)."})
    plan: str = field(default="", metadata={"help": "A saved plan file to apply instead of profiling and solving."})
    cache_dir: str = field(default="", metadata={"help": "Plan cache directory (empty: no cache)."})
    times: str = field(default="measured", metadata={"help": "Node times: 'measured' or 'flops' (deterministic)."})
    output_kept: str = field(default="step", metadata={
        "help": "How long the training loop keeps the model's returned object: 'step' (to the end of backward, "
                "outputs = model(**batch); accelerator.backward(outputs.loss)) or 'loss' (dropped once the loss "
                "is computed, loss = model(**batch).loss)."})
    verbose: bool = field(default=True, metadata={"help": "Show progress and the summary table (main process)."})
    calls_per_step: int = field(default=1, metadata={
        "help": "Calls of the model before one backward (an encoder on two views: 2); a byte or 'auto' budget is "
                "shared, each call planned at 1/n of it."})

    def __post_init__(self) -> None:
        for f in fields(self):
            raw = os.environ.get(_ENV_PREFIX + f.name.upper())
            if raw is not None:
                # the field's declared kind (its default's type), not the value's: a YAML
                # ``budget: 0.5`` is still overridden by AUTOREMAT_BUDGET="6GB"
                setattr(self, f.name, _coerce(f.name, raw, type(f.default)))
        self.budget = budget_text(self.budget)
        check_solver(self.solver)
        self.on_infeasible = check_on_infeasible(self.on_infeasible)
        self.times = resolve_times(self.times)
        self.output_kept = check_output_kept(self.output_kept)
        if self.plan and not os.path.isfile(os.path.expanduser(self.plan)):
            raise ValueError(f"plan={self.plan!r}: no such plan file (AUTOREMAT_PLAN / the autoremat: section); "
                             "write one with `autoremat plan ... --out plan.json` or plan.to_json(path)")
        if self.profile_steps < 1:
            raise ValueError(f"profile_steps={self.profile_steps!r} must be >= 1")
        calls = self.calls_per_step
        if isinstance(calls, bool) or not isinstance(calls, int) or calls < 1:
            raise ValueError(f"calls_per_step={self.calls_per_step!r} must be an integer >= 1 (how many times the "
                             "training loop calls the model before one backward)")

    @classmethod
    def from_yaml(cls, path: str) -> "AutoRematConfig":
        """Read the ``autoremat:`` section of a YAML file (environment variables still win)."""
        import yaml

        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
        section = data.get("autoremat", {})
        if not isinstance(section, Mapping):
            raise ValueError(f"{path}: the 'autoremat:' section must be a mapping, got {type(section).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = set(section) - known
        if unknown:
            raise ValueError(f"{path}: unknown autoremat keys {sorted(unknown)}; accepted: {sorted(known)}")
        return cls(**section)

    @classmethod
    def resolve(cls, **overrides: Any) -> "AutoRematConfig":
        """Defaults, then ``AUTOREMAT_CONFIG``'s YAML, then explicit overrides; env vars last."""
        path = os.environ.get(_ENV_PREFIX + "CONFIG")
        base = cls.from_yaml(path) if path else cls()
        values = {f.name: getattr(base, f.name) for f in fields(cls)}
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def budget_text(value: Any) -> str:
    """A budget as the config keeps it (a string), checked now: YAML and Python numbers too
    (``budget: 0.5`` is ``"50%"``, ``budget: 6000000000`` is bytes, numpy scalars are numbers).
    Anything :func:`~autoremat.budget.parse_budget` refuses is a ``ValueError`` here, before
    any capture."""
    if isinstance(value, str):
        check_budget(value)
        return value
    parse_budget(value, unoptimised_peak_bytes=1)  # bools, None, negative or > 1 floats: ValueError
    if isinstance(value, numbers.Integral):
        return str(int(value))
    return f"{Decimal(repr(float(value))) * 100:f}%"


def _coerce(name: str, raw: str, typ: type) -> Any:
    if typ is bool:
        low = raw.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{_ENV_PREFIX}{name.upper()}={raw!r}: expected 1/0, true/false, yes/no or on/off")
    if typ is int:
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"{_ENV_PREFIX}{name.upper()}={raw!r}: expected an integer") from None
    return raw


def _report(accelerator: Any, model: nn.Module, plan: Plan, summary: dict[str, Any], example_args: Sequence[Any],
            example_kwargs: Mapping[str, Any] | None, loss_fn: Callable[[Any], torch.Tensor] | None,
            cfg: AutoRematConfig, progress: Progress, sharded: bool) -> None:
    """The main process's log line and (verbose) summary table of what :func:`prepare` did; an
    unsharded plan's step peak is measured once for it when planning did not."""
    logger.info("autoremat: %s, predicted step peak %s bytes", plan.describe(), plan.predicted_peak_bytes)
    if not cfg.verbose:
        return
    if summary.get("measured_peak_bytes") is None and not sharded:
        args, kwargs = _on_device(accelerator.device, example_args, example_kwargs)
        with progress.phase("a measured step with the plan"):
            prepared = _PreparedForward(uncompiled(model), accelerator)  # as accelerator.prepare runs it
            summary["measured_peak_bytes"] = measured_step_peak(prepared, args, kwargs, loss_fn or default_loss,
                                                                keep_output=cfg.output_kept == "step")
    print_summary(summary, title="autoremat (Accelerate)")


class _PreparedForward(nn.Module):
    """``model`` run as ``accelerator.prepare`` runs it under native mixed precision: autocast
    around its forward only, its floating-point outputs converted to float32. The backward runs
    outside autocast, so autocast's cast cache (the low-precision weight copies) is dropped when
    the forward returns."""

    def __init__(self, model: nn.Module, accelerator: Any) -> None:
        super().__init__()
        self.model, self._accelerator = model, accelerator

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not getattr(self._accelerator, "native_amp", False):
            return self.model(*args, **kwargs)
        from accelerate.utils import convert_to_fp32

        with self._accelerator.autocast():
            out = self.model(*args, **kwargs)
        return convert_to_fp32(out)


def prepare(
    accelerator: Any,
    model: nn.Module,
    example_args: Sequence[Any] | torch.Tensor,
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    budget: str | int | float | None = None,
    solver: str | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    regions: str = "lean",
    on_infeasible: str | None = None,
    plan: Plan | str | os.PathLike[str] | None = None,
    cache_dir: str | None = None,
    times: str | None = None,
    output_kept: str | None = None,
    calls_per_step: int | None = None,
) -> nn.Module:
    """Capture ``model`` on the example batch, solve under the budget and patch it in place.

    ``regions``: how recomputed segments run (see :func:`autoremat.apply`). ``budget`` is a device
    budget (resident parameters, optimizer state and the batch are subtracted) unless it is a
    percentage of the unoptimised step peak, or ``"min"``. ``on_infeasible``, ``plan``,
    ``cache_dir``, ``times``, ``output_kept`` and ``calls_per_step``: see the module docstring
    (each also an ``AUTOREMAT_*`` variable). Returns ``model``.

    Atomic: when it raises (capture fails, the budget is infeasible, profiling runs out of
    memory, the plan does not apply), the model is where it was (device, parameters, gradients,
    buffers), unpatched, and the RNG state is as it was (:mod:`autoremat.integrations._atomic`);
    ``optimizer`` is only read.
    """
    given = as_plan(plan) if plan is not None and not isinstance(plan, (str, os.PathLike)) else None
    cfg = AutoRematConfig.resolve(budget=budget, solver=solver, on_infeasible=on_infeasible,
                                  plan=None if plan is None or given is not None else os.fspath(plan),
                                  cache_dir=cache_dir, times=times, output_kept=output_kept,
                                  calls_per_step=calls_per_step)
    main = accelerator.is_main_process
    progress = Progress(enabled=cfg.verbose and main)
    if not cfg.enabled:
        logger.info("autoremat disabled (AUTOREMAT_ENABLED=0)")
        if main and cfg.verbose:
            progress.line("disabled (AUTOREMAT_ENABLED=0): the model is left as it is, nothing profiled or patched")
        return model
    given = given or (as_plan(os.path.expanduser(cfg.plan)) if cfg.plan else None)
    if isinstance(example_args, torch.Tensor):
        example_args = (example_args,)
    if isinstance(example_args, Mapping) and example_kwargs is None:  # a Hugging Face batch
        raise TypeError(f"example_args is a mapping ({type(example_args).__name__}): for a model called as "
                        "model(**batch), pass prepare(accelerator, model, (), batch)")
    rollback = Rollback(model, [accelerator.device])
    try:
        sharding = accelerate_units(accelerator, model)  # DeepSpeed refused, FSDP units predicted
        if sharding is not None and given is not None:
            raise ValueError("prepare(plan=...) under Accelerate's FSDP plugin: a saved plan is not re-cut at the "
                             "FSDP units; leave plan unset and let prepare solve for one rank")
        payload = None
        try:
            if main and sharding is not None:
                payload = _solve_sharded(accelerator, model, example_args, example_kwargs, cfg, loss_fn, optimizer,
                                         *sharding)
            elif main:
                payload = _plan_on_main(accelerator, model, example_args, example_kwargs, cfg, loss_fn, optimizer,
                                        given, progress)
        except Exception as err:  # the other processes wait in the broadcast: tell them, then raise
            _broadcast(accelerator, {"error": f"{type(err).__name__}: {err}"})
            raise
        payload = _broadcast(accelerator, payload)
        if "error" in payload:
            raise RuntimeError(f"autoremat: the main process failed while planning, so every process stops: "
                               f"{payload['error']}")
        plan_obj = Plan.from_dict(payload["plan"])
        apply(model, plan_obj, regions=regions)  # a plan made for another model: PlanMismatchError
    except BaseException:
        rollback.put_back()  # e.g. the model moved to the device before capture failed
        raise
    if main:
        _report(accelerator, model, plan_obj, payload["summary"], example_args, example_kwargs, loss_fn, cfg,
                progress, sharded=sharding is not None)
    return model


def _on_device(device: Any, example_args: Sequence[Any], example_kwargs: Mapping[str, Any] | None
               ) -> tuple[tuple, dict]:
    args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in example_args)
    kwargs = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in (example_kwargs or {}).items()}
    return args, kwargs


def _plan_on_main(accelerator: Any, model: nn.Module, example_args: Sequence[Any],
                  example_kwargs: Mapping[str, Any] | None, cfg: AutoRematConfig,
                  loss_fn: Callable[[Any], torch.Tensor] | None, optimizer: torch.optim.Optimizer | None,
                  given: Plan | None, progress: Progress) -> dict[str, Any]:
    """On the main process: move the model to the device, then the saved plan (checked against the
    batch) or a decision (cached, or profiled and solved); the plan and its summary."""
    device = accelerator.device
    args, kwargs = _on_device(device, example_args, example_kwargs)
    model.to(device)
    resident = resident_bytes(model, inputs=(args, kwargs), optimizers=[] if optimizer is None else [optimizer])
    if given is not None:
        check_inputs(given, args, kwargs)  # another batch size, dtype or device: PlanMismatchError
        return {"plan": given.to_dict(), "summary": summarise(
            given, None, step_budget=given.budget_bytes, resident=resident, source="plan= (a saved plan)",
            not_raised=_NOT_RAISED)}
    allocated = _allocated(model, args, kwargs, optimizer, device)
    return _decide(accelerator, model, args, kwargs, cfg, loss_fn or default_loss, resident, allocated, progress)


def _solve_sharded(accelerator: Any, model: nn.Module, example_args: Sequence[Any],
                   example_kwargs: Mapping[str, Any] | None, cfg: AutoRematConfig,
                   loss_fn: Callable[[Any], torch.Tensor] | None, optimizer: torch.optim.Optimizer | None,
                   units: dict[str, nn.Module], version: int) -> dict[str, Any]:
    """Rank zero, FSDP plugin: capture the unsharded model, solve for one rank (module docstring)."""
    from ..runtime._unit_trace import canonical_trace
    from ..runtime.sharded_memory import sharding_spec
    from ..runtime.sharding import snap_plan
    from ..per_rank import per_rank_graph

    device, world = accelerator.device, accelerator.num_processes
    args, kwargs = _on_device(device, example_args, example_kwargs)
    model.to(device)
    resident = resident_bytes(model, inputs=(args, kwargs), optimizers=[] if optimizer is None else [optimizer],
                              shard_over=world)
    limit = profile_limit_bytes(profiling_budget(cfg.budget, cfg.on_infeasible, resident), device=device,
                                resident_bytes=resident)
    with accelerate_fsdp_precision(accelerator, model, version):  # as the sharded model will run
        graph = capture_within(model, args, kwargs, limit_bytes=limit, loss_fn=loss_fn or default_loss,
                               blocks=capture_blocks(cfg.solver),
                               repeats=cfg.profile_steps, times=cfg.times)
    graph.meta["output_kept"] = cfg.output_kept
    spec = sharding_spec(model, graph, units=units, world=world, fsdp_version=version)
    step_budget = "min" if wants_least(cfg.budget, cfg.on_infeasible, resident) else step_budget_bytes(
        cfg.budget.strip(), per_rank_graph(graph, spec), device, resident,
        _allocated(model, args, kwargs, optimizer, device))
    canon = canonical_trace(model, units) if graph.meta.get("mode") == "fx" else None
    ranked = solve_per_rank(graph, spec, step_budget, lambda g, b: solve(g, b, solver=cfg.solver),
                            (lambda p: snap_plan(p, canon)) if canon is not None else (lambda p: p),
                            on_infeasible=cfg.on_infeasible)
    logger.info("autoremat: FSDP%d over %d processes, %d units: per-rank step peak %s bytes predicted "
                "(unoptimised %s, budget %s, resident %s)", version, world, len(units), ranked.predicted_peak_bytes,
                ranked.unoptimised_peak_bytes, ranked.step_budget_bytes, resident)
    summary = summarise(ranked.plan, None, step_budget=ranked.step_budget_bytes, resident=resident,
                        budget_note=ranked.note,
                        source=f"profiled (FSDP{version}, per rank over {world} processes)", not_raised=_NOT_RAISED)
    summary["predicted_peak_bytes"] = ranked.predicted_peak_bytes
    summary["unoptimised_peak_bytes"] = ranked.unoptimised_peak_bytes
    return {"plan": ranked.plan.to_dict(), "summary": summary}


def _decide(accelerator: Any, model: nn.Module, args: tuple, kwargs: dict, cfg: AutoRematConfig,
            loss_fn: Callable[[Any], torch.Tensor], resident: int, allocated: int,
            progress: Progress) -> dict[str, Any]:
    """The main process's plan and summary: from the cache, or profiled and solved (then cached)."""
    device = accelerator.device
    cache = PlanCache.from_setting(cfg.cache_dir or None)
    key = None
    if cache is not None:
        settings = {"integration": "accelerate", "budget": cfg.budget, "solver": cfg.solver,
                    "on_infeasible": cfg.on_infeasible, "times": cfg.times, "profile_steps": cfg.profile_steps,
                    "mixed_precision": str(getattr(accelerator, "mixed_precision", "no")),
                    "output_kept": cfg.output_kept, "calls_per_step": cfg.calls_per_step,
                    "loss_fn": getattr(loss_fn, "__qualname__", None)}
        key = plan_key(model, args, kwargs, settings)
        entry = cache.load(key)
        misfit = None if entry is None else cached_plan_misfit(entry, cfg.budget, device, resident, allocated,
                                                               cfg.calls_per_step)
        if misfit is not None:
            logger.warning("autoremat: %s", misfit)
        elif entry is not None:
            progress.line(f"reusing the cached plan {cache.path(key)} (no profiling)")
            return {**entry, "summary": {**entry["summary"], "source": f"cache ({cache.path(key).name})",
                                         "measured_peak_bytes": None}}
    limit = profile_limit_bytes(profiling_budget(cfg.budget, cfg.on_infeasible, resident), device=device,
                                resident_bytes=resident)
    with progress.phase(f"capture {type(model).__name__}"), accelerator.autocast():
        # never an unpatched step above the device budget
        graph = capture_within(model, args, kwargs, limit_bytes=limit, loss_fn=loss_fn, repeats=cfg.profile_steps,
                               times=cfg.times, blocks=capture_blocks(cfg.solver))
    graph.meta["output_kept"] = cfg.output_kept  # before solving: every cost model reads it
    with progress.phase(f"solve ({len(graph)} nodes, solver {cfg.solver})"):
        plan, step, note = plan_within(graph, cfg.budget, device=device, resident=resident, allocated=allocated,
                                       solver=cfg.solver, calls=cfg.calls_per_step,
                                       solve_kwargs={}, on_infeasible=cfg.on_infeasible, who="autoremat",
                                       warn=progress.line if progress.enabled else None)
        least = least_for(graph, cfg.solver, {})
    with progress.phase("a measured step with the plan"):
        plan, step, measured = _confirmed(accelerator, model, graph, plan, step, (args, kwargs), cfg, loss_fn)
    payload = {"plan": plan.to_dict(), "summary": summarise(
        plan, graph, step_budget=step, resident=resident, least=least, budget_note=note, measured=measured,
        not_raised=_NOT_RAISED)}
    if cache is not None and key is not None:
        progress.line(f"plan cached in {cache.store(key, payload)}")
    return payload


def _confirmed(accelerator: Any, model: nn.Module, graph: Graph, plan: Plan, step: int, inputs: tuple[tuple, dict],
               cfg: AutoRematConfig, loss_fn: Callable[[Any], torch.Tensor]) -> tuple[Plan, int, int]:
    """``(plan, step budget, its measured step peak)``: one step of the patched model as
    ``accelerator.prepare`` runs it, before training; where it runs out of memory (a prediction
    can miss allocator fragmentation or a workspace the profile did not see) the plan is solved
    again at 85 % of the step budget, each time said, up to :data:`CONFIRM_TRIES` times; then a
    ``torch.OutOfMemoryError`` says what to change (``prepare`` leaves the model as it was)."""
    last = ""
    for _ in range(CONFIRM_TRIES):
        apply(model, plan)
        try:
            prepared = _PreparedForward(uncompiled(model), accelerator)
            return plan, step, measured_step_peak(prepared, *inputs, loss_fn, keep_output=cfg.output_kept == "step")
        except RuntimeError as err:  # torch.OutOfMemoryError is a RuntimeError
            if not is_oom(err):
                raise
            last = str(err).splitlines()[0][:300]
        finally:
            restore(model)
        free_cache()  # out of the except block, whose traceback holds the failed step
        lower = int(step * BACK_OFF)
        logger.warning("autoremat: the patched step ran out of memory although its predicted peak (%s bytes) is "
                       "within the %d-byte step budget; planning again at %d bytes", plan.predicted_peak_bytes,
                       step, lower)
        try:
            plan, step = solve(graph, lower, solver=cfg.solver), lower
        except InfeasibleBudgetError:
            break  # below the least reachable: nothing smaller to try
    raise torch.OutOfMemoryError(
        f"autoremat: the patched step ran out of memory with every plan tried, down to a {step}-byte step budget; "
        "lower the batch size, or give a smaller budget (or raise AUTOREMAT_MARGIN under budget='auto'). The last "
        f"try: {last}")


def _allocated(model: nn.Module, args: tuple, kwargs: dict, optimizer: Any, device: Any) -> int:
    """The resident bytes on ``device`` now (free memory already excludes them)."""
    return allocated_resident_bytes(model, device=device, inputs=(args, kwargs),
                                    optimizers=[] if optimizer is None else [optimizer])


def _broadcast(accelerator: Any, obj: Any) -> Any:
    if accelerator.num_processes == 1:
        return obj
    from accelerate.utils import broadcast_object_list

    box = [obj]
    broadcast_object_list(box, from_process=0)
    return box[0]
