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
same object). Under multi-process launch rank zero captures and solves; its plan is broadcast so
all ranks run one plan.

**FSDP plugin** (``fsdp_version`` 1 or 2, issue 21): the order is the same, and it is checked
(a model sharded already is refused with the order to use). ``prepare`` predicts the FSDP units
``accelerator.prepare`` will make from the plugin's wrap policy
(:func:`~autoremat.integrations._strategies.predicted_units`), solves for one rank (resident:
the parameter, gradient and optimizer-state shards plus buffers and the batch; step: the per-rank
graph of :mod:`autoremat.per_rank`, the plan cut at the units as it will run) and patches the
unsharded model; when ``accelerator.prepare`` shards it, the patched forward maps the plan onto
the units at the first forward (:mod:`autoremat.runtime.sharding`). DeepSpeed is refused before
any work (:func:`~autoremat.integrations._strategies.deepspeed_refusal`).
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

from ..budget import parse_budget
from ..capture.scaled import capture_within, profile_limit_bytes
from ..measure import default_loss
from ..plan import Plan
from ..resident import resident_bytes
from ..runtime import apply
from ..solvers import check_solver, solve
from ._atomic import Rollback
from ._common import step_budget_bytes
from ._strategies import accelerate_units, solve_per_rank

__all__ = ["AutoRematConfig", "prepare", "budget_text"]

logger = logging.getLogger(__name__)

_ENV_PREFIX = "AUTOREMAT_"


@dataclass
class AutoRematConfig:
    """Settings of :func:`prepare`; environment variables ``AUTOREMAT_<FIELD>`` override them."""

    enabled: bool = field(default=True, metadata={"help": "Patch the model at all (AUTOREMAT_ENABLED=0 turns it off)."})
    budget: str = field(default="auto", metadata={"help": 'Device budget: "auto", bytes, "6GB", "512MiB", "50%" or 0.5.'})
    solver: str = field(default="auto", metadata={"help": "A name of autoremat.SOLVERS, or auto."})
    profile_steps: int = field(default=3, metadata={"help": "Timed repeats when profiling."})

    def __post_init__(self) -> None:
        for f in fields(self):
            raw = os.environ.get(_ENV_PREFIX + f.name.upper())
            if raw is not None:
                # the field's declared kind (its default's type), not the value's: a YAML
                # ``budget: 0.5`` is still overridden by AUTOREMAT_BUDGET="6GB"
                setattr(self, f.name, _coerce(f.name, raw, type(f.default)))
        self.budget = budget_text(self.budget)
        check_solver(self.solver)
        if self.profile_steps < 1:
            raise ValueError(f"profile_steps={self.profile_steps!r} must be >= 1")

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
        if value.strip().lower() != "auto":
            parse_budget(value, unoptimised_peak_bytes=1)
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
) -> nn.Module:
    """Capture ``model`` on the example batch, solve under the budget and patch it in place.

    ``regions``: how recomputed segments run (see :func:`autoremat.apply`).

    ``budget`` is a device budget (resident parameters, optimizer state and the batch are
    subtracted) unless it is a percentage of the unoptimised step peak. Returns ``model``.

    Atomic: when it raises (capture fails, the budget is infeasible, profiling runs out of
    memory, the plan does not apply), the model is where it was (device, parameters, gradients,
    buffers), unpatched, and the RNG state is as it was (:mod:`autoremat.integrations._atomic`);
    ``optimizer`` is only read.
    """
    cfg = AutoRematConfig.resolve(budget=budget, solver=solver)
    if not cfg.enabled:
        logger.info("autoremat disabled (AUTOREMAT_ENABLED=0)")
        return model
    if isinstance(example_args, torch.Tensor):
        example_args = (example_args,)
    rollback = Rollback(model, [accelerator.device])
    try:
        sharding = accelerate_units(accelerator, model)  # DeepSpeed refused, FSDP units predicted
        if sharding is None:
            plan_dict = _plan_on_main(accelerator, model, example_args, example_kwargs, cfg, loss_fn, optimizer)
        elif accelerator.is_main_process:
            plan_dict = _solve_sharded(accelerator, model, example_args, example_kwargs, cfg, loss_fn, optimizer,
                                       *sharding)
        else:
            plan_dict = None
        plan_dict = _broadcast(accelerator, plan_dict)
        plan = Plan.from_dict(plan_dict)
        apply(model, plan, regions=regions)
    except BaseException:
        rollback.put_back()  # e.g. the model moved to the device before capture failed
        raise
    if accelerator.is_main_process:
        logger.info("autoremat: %s, predicted step peak %s bytes", plan.describe(), plan.predicted_peak_bytes)
    return model


def _plan_on_main(accelerator: Any, model: nn.Module, example_args: Sequence[Any],
                  example_kwargs: Mapping[str, Any] | None, cfg: AutoRematConfig,
                  loss_fn: Callable[[Any], torch.Tensor] | None,
                  optimizer: torch.optim.Optimizer | None) -> dict[str, Any] | None:
    """On the main process: move the model to the device, capture, solve; the plan as a dict
    (``None`` on the other processes, which receive it by broadcast)."""
    if not accelerator.is_main_process:
        return None
    device = accelerator.device
    args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in example_args)
    kwargs = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in (example_kwargs or {}).items()}
    model.to(device)
    resident = resident_bytes(model, inputs=(args, kwargs), optimizers=[] if optimizer is None else [optimizer])
    limit = profile_limit_bytes(cfg.budget, device=device, resident_bytes=resident)
    with accelerator.autocast():  # never an unpatched step above the device budget
        graph = capture_within(model, args, kwargs, limit_bytes=limit, loss_fn=loss_fn or default_loss,
                               repeats=cfg.profile_steps)
    step_budget = step_budget_bytes(cfg.budget.strip(), graph, device, resident)
    return solve(graph, step_budget, solver=cfg.solver).to_dict()


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
    args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in example_args)
    kwargs = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in (example_kwargs or {}).items()}
    model.to(device)
    resident = resident_bytes(model, inputs=(args, kwargs), optimizers=[] if optimizer is None else [optimizer],
                              shard_over=world)
    limit = profile_limit_bytes(cfg.budget, device=device, resident_bytes=resident)
    with accelerator.autocast():
        graph = capture_within(model, args, kwargs, limit_bytes=limit, loss_fn=loss_fn or default_loss,
                               repeats=cfg.profile_steps)
    spec = sharding_spec(model, graph, units=units, world=world, fsdp_version=version)
    step_budget = step_budget_bytes(cfg.budget.strip(), per_rank_graph(graph, spec), device, resident)
    canon = canonical_trace(model, units) if graph.meta.get("mode") == "fx" else None
    ranked = solve_per_rank(graph, spec, step_budget, lambda g, b: solve(g, b, solver=cfg.solver),
                            (lambda p: snap_plan(p, canon)) if canon is not None else (lambda p: p))
    logger.info("autoremat: FSDP%d over %d processes, %d units: per-rank step peak %s bytes predicted "
                "(unoptimised %s, budget %s, resident %s)", version, world, len(units), ranked.predicted_peak_bytes,
                ranked.unoptimised_peak_bytes, step_budget, resident)
    return ranked.plan.to_dict()


def _broadcast(accelerator: Any, obj: Any) -> Any:
    if accelerator.num_processes == 1:
        return obj
    from accelerate.utils import broadcast_object_list

    box = [obj]
    broadcast_object_list(box, from_process=0)
    return box[0]
