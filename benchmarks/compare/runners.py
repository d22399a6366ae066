"""One runner per configuration: no checkpointing, PyTorch's options (per-block full and selective
checkpointing, ``checkpoint_sequential``, ``save_on_cpu``, ``torch.compile`` at an activation memory budget)
and autoremat's plans."""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn

import autoremat

from .settings import SAC_SAVED_OPS
from .workloads import Workload


class NotApplicable(Exception):
    """A configuration that does not apply to a model (the reason is the message)."""


@dataclass
class Runner:
    """One configuration ready to step: ``forward(*args)`` on ``model``'s parameters."""

    key: str
    family: str
    label: str
    model: nn.Module
    forward: Callable[..., Any]
    row: dict[str, Any] = field(default_factory=dict)
    compiled: bool = False

    def step(self, args: Sequence[Any], loss_fn: Callable[[Any], torch.Tensor]) -> torch.Tensor:
        self.model.zero_grad(set_to_none=True)
        loss = loss_fn(self.forward(*args))
        loss.backward()
        return loss.detach()


class _Step(nn.Module):
    """``measure`` wants an ``nn.Module``: this one owns the runner's parameters and calls its forward."""

    def __init__(self, runner: Runner) -> None:
        super().__init__()
        self.inner = runner.model
        object.__setattr__(self, "_fwd", runner.forward)  # not a submodule (it may be a compiled wrapper)

    def forward(self, *args: Any) -> Any:
        return self._fwd(*args)


def _copy(w: Workload) -> nn.Module:
    return copy.deepcopy(w.model)


def runner_none(w: Workload) -> Runner:
    m = _copy(w)
    return Runner("none", "baseline", "no checkpointing", m, m)


def _wrap_blocks(w: Workload, m: nn.Module, **checkpoint_kwargs: Any) -> int:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    if not w.block_types:
        raise NotApplicable(f"no block type is known for {w.name}")
    n = sum(isinstance(mod, w.block_types) for mod in m.modules())
    if w.copy_list_args:
        checkpoint_kwargs["checkpoint_fn"] = _checkpoint_copying_lists
    apply_activation_checkpointing(
        m,
        checkpoint_wrapper_fn=partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                      **checkpoint_kwargs),
        check_fn=lambda mod: isinstance(mod, w.block_types),
    )
    return n


def _checkpoint_copying_lists(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """``checkpoint(fn, *args, use_reentrant=False)`` with list arguments shallow-copied.

    Non-reentrant checkpoint keeps a reference to each argument for the recomputation; a DenseNet
    dense layer gets its block's list of features, which the block keeps appending to, so by
    backward the recomputation would concatenate more features than the forward did (BatchNorm
    then fails: "running_mean should contain 128 elements not 124"). Copying the list freezes it.
    """
    from torch.utils.checkpoint import checkpoint

    args = tuple(list(a) if isinstance(a, list) else a for a in args)
    return checkpoint(fn, *args, use_reentrant=False, **kwargs)


_LIST_NOTE = ("; the dense layer takes its block's growing feature list, which plain non-reentrant checkpoint holds "
              "by reference, so the recomputation in backward fails (\"running_mean should contain 128 elements not "
              "124\"): the checkpoint_fn here passes a copy of the list")


def runner_block_ac(w: Workload) -> Runner:
    m = _copy(w)
    n = _wrap_blocks(w, m)
    return Runner("block-ac", "pytorch", "per-block checkpoint (apply_activation_checkpointing)", m, m,
                  row={"note": f"{n} x {w.block_note} wrapped in checkpoint_wrapper(NO_REENTRANT), as Lightning's "
                               "FSDP strategy / Accelerate do" + (_LIST_NOTE if w.copy_list_args else "")})


def sac_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """Selective checkpointing policy: save matmul and convolution outputs, recompute the rest."""
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in _sac_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def _sac_ops() -> set:
    return {getattr(torch.ops.aten, name).default for name in SAC_SAVED_OPS}


def runner_block_sac(w: Workload) -> Runner:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    m = _copy(w)
    n = _wrap_blocks(w, m, context_fn=partial(create_selective_checkpoint_contexts, sac_policy))
    return Runner("block-sac", "pytorch", "per-block selective checkpoint (save mm/conv outputs)", m, m,
                  row={"note": f"{n} x {w.block_note}: checkpoint(use_reentrant=False, context_fn="
                               "create_selective_checkpoint_contexts(policy)); the policy saves "
                               + "/".join(f"aten.{o}" for o in SAC_SAVED_OPS) + " outputs"
                               + (_LIST_NOTE if w.copy_list_args else "")})


def runner_ckpt_seq(w: Workload) -> Runner:
    from torch.utils.checkpoint import checkpoint_sequential

    if w.sequential is None:
        raise NotApplicable(f"not a sequential model: {w.not_sequential}")
    m = _copy(w)
    fns = w.sequential(m)
    segments = max(2, round(math.sqrt(len(fns))))

    def forward(x: torch.Tensor) -> torch.Tensor:
        return checkpoint_sequential(fns, segments, x, use_reentrant=False)

    return Runner("ckpt-seq", "pytorch", f"checkpoint_sequential ({segments} segments)", m, forward,
                  row={"note": f"{len(fns)} modules in {segments} segments (~sqrt(n)); the last segment is not "
                               "checkpointed"})


def runner_save_on_cpu(w: Workload, device: torch.device) -> Runner:
    m = _copy(w)
    pin = device.type == "cuda"

    def forward(*args: Any) -> Any:
        with torch.autograd.graph.save_on_cpu(pin_memory=pin):
            return m(*args)

    note = ("every saved tensor copied to pinned host memory, copied back in backward" if pin else
            "CPU-only machine: every saved tensor is copied into (the same) host memory, so this shows the cost of "
            "the copies, not a saving")
    return Runner("save-on-cpu", "pytorch", "save_on_cpu (offload all saved tensors)", m, forward, row={"note": note})


class CompileBackend:
    """A ``torch.compile`` backend that compiles under one ``activation_memory_budget``.

    Each configuration gets its own backend object, so Dynamo keeps a separate cache entry per
    configuration (it checks the backend before reusing a compiled frame) and a recompilation can
    never pick up another configuration's budget. (Inductor's ``fallback_random``, which would make
    dropout draw from the eager generator, is left off: with it, budgets below 1.0 fail to lower on
    models with dropout, "should be handled in replace_random.py", torch 2.13.)
    """

    def __init__(self, budget: float, backend: str) -> None:
        self.budget = float(budget)
        self.backend = backend
        self.compile_s = 0.0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        import torch._functorch.config as functorch_config

        t0 = time.perf_counter()
        try:
            with functorch_config.patch(activation_memory_budget=self.budget):
                if self.backend == "inductor":
                    from torch._inductor.compile_fx import compile_fx

                    return compile_fx(gm, example_inputs)
                from torch._dynamo.backends.registry import lookup_backend

                return lookup_backend(self.backend)(gm, example_inputs)
        finally:
            self.compile_s += time.perf_counter() - t0


def runner_compile(w: Workload, budget: float, backend: str) -> Runner:
    m = _copy(w)
    be = CompileBackend(budget, backend)
    cm = torch.compile(m, backend=be)
    r = Runner(f"compile@{budget:g}", "compile", f"torch.compile, activation_memory_budget={budget:g}", m, cm,
               compiled=True)
    r.row.update(compile_budget=budget, compile_backend=backend)
    if w.has_dropout:
        r.row["note"] = ("the model has dropout and Inductor draws its own random numbers, so the gradient difference "
                         "includes different dropout masks, not only rounding")
    r.row["_backend"] = be
    return r


def runner_autoremat(w: Workload, plan: autoremat.Plan, solver: str, fraction: float, tag: str | None = None,
                     regions: str = "lean", compile_backend: str | None = None) -> Runner:
    """``tag`` names the budget in the key instead of the fraction (``"match"``: see ``MATCH_TAG``);
    ``regions="torch"`` runs the plan on ``torch.utils.checkpoint`` regions (key ``+torch-regions``);
    ``compile_backend``: the patched model under ``torch.compile`` (key ``+compile``; its regions are
    traced as the checkpoint higher-order op, ``activation_memory_budget`` left at 1.0)."""
    m = _copy(w)
    autoremat.apply(m, plan, regions=regions)
    name = tag or f"{fraction:g}"
    label = f"autoremat {solver} @ " + (f"{tag} ({fraction:.0%})" if tag else f"{fraction:.0%}")
    if compile_backend is not None:
        be = CompileBackend(1.0, compile_backend)
        r = Runner(f"autoremat:{solver}@{name}{COMPILED}", "autoremat", label + f", torch.compile ({compile_backend})",
                   m, torch.compile(m, backend=be), compiled=True)
        r.row["_backend"] = be
        return r
    if regions == "torch":
        return Runner(f"autoremat:{solver}@{name}{TORCH_REGIONS}", "autoremat",
                      label + ", torch.utils.checkpoint regions", m, m)
    return Runner(f"autoremat:{solver}@{name}", "autoremat", label, m, m)


TORCH_REGIONS = "+torch-regions"
COMPILED = "+compile"


MATCH_TAG = "match"
"""``autoremat:<solver>@match``: the budget is the lowest step peak an eager PyTorch option
(per-block, selective, sequential checkpointing, save_on_cpu) measured on this model, so that the
step times compare at equal peak (the first target of issue 6)."""
