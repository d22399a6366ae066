"""Selective saves inside recomputed module regions (module-level captures: Hugging Face layers).

A module-level plan recomputes whole layers, which makes its least plan per-layer checkpointing.
Inside a recomputed layer some op outputs are worth keeping: a matmul costs far more to redo
than the pointwise and normalisation ops around it. :func:`apply_selective` runs chosen modules
under non-reentrant ``torch.utils.checkpoint`` with
``torch.utils.checkpoint.create_selective_checkpoint_contexts``: the outputs of the ops the
policy names are saved in forward and reused by the recomputation, everything else is recomputed.

Policies, per module path:

* ``"matmuls"``: keep the outputs of ``mm``/``addmm``/``bmm``/``baddbmm`` and of the fused
  attention kernels (PyTorch's own selective-checkpointing recipe);
* ``"none"``: keep nothing (plain per-module checkpointing, the reference);
* a set of ints: keep the outputs of those ops, counted in the order the module dispatches them
  (forward and recomputation dispatch the same sequence), as chosen per region by a knapsack
  over measured op costs.

Decision (issue 24, option a against option b), by measurement (x86_64, 2 cores, CPU only,
shared): ``torch.export.export(model, ..., strict=False)`` of the zoo's Llama (RoPE, grouped-query
attention) and BERT succeeds (354 and 222 graph nodes, 1-2 s), but the exported module's
gradients differ from the eager model's on Llama (31 of 39 parameters, by up to 5e-9: the
exported graph does not run the eager kernels in the eager order), while they are equal on BERT.
Bit-for-bit gradients are a promise of this project, so Hugging Face models stay eager and
module-level, and choices inside a layer are selective saves in its region (option a): gradients
``torch.equal`` on both (tested). On the CPU sizes of ``benchmarks/hf_inside_layer.py``, keeping
every matmul output costs 2.0-2.5x HF checkpointing's peak for 0.88-0.93x its time, and at HF
checkpointing's peak the knapsack has under 1 MiB to spend (that peak already equals autoremat's
least one), so it changes nothing there (results under ``benchmarks/results/cpu/hf_inside_layer``).

:class:`SelectiveCall` runs one module call of a plan this way (``autoremat.apply`` of a plan
whose segment keeps ops, ``Plan.module_calls``): the kept ops are named by their index in the
call's op sequence and their name, and a call that dispatches another op at a kept index raises
(the model is not the one captured). Its ``context_fn`` joins selective checkpointing's contexts
with the buffer-restoring and parameter-checking ones of :mod:`.recompute_state`, so batch-norm
statistics are updated once, as in every autoremat region. :func:`apply_selective` (the
baseline of the benchmarks) refuses modules with running statistics.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..capture.module import node_modules
from .recompute_state import BothContexts, restoring_contexts
from .probed_call import ProbedCall
from .region import stateful_buffers
from .transforms import records

__all__ = ["MATMUL_OPS", "apply_selective", "restore_selective", "layer_paths", "is_selective", "SelectiveCall",
           "selective_contexts"]

_ATTR = "_autoremat_selective"

MATMUL_OPS: frozenset[str] = frozenset({
    "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm",
    "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_cudnn_attention",
})
"""Ops whose outputs the ``"matmuls"`` policy keeps (names as ``OpOverload.name()`` reads them)."""


def layer_paths(model: nn.Module) -> list[str]:
    """Paths of the model's repeated blocks: node modules that are members of a ``ModuleList``."""
    lists = {name for name, m in model.named_modules() if isinstance(m, nn.ModuleList)}
    return [p for p, _ in node_modules(model) if p.rpartition(".")[0] in lists]


def _policy(spec: str | Collection[int]) -> Callable[[], Callable[..., CheckpointPolicy]]:
    """A factory of fresh policy functions (one per region call: op counters start at 0)."""
    if spec == "matmuls":
        def make() -> Callable[..., CheckpointPolicy]:
            def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
                keep = op.name() in MATMUL_OPS
                return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
            return policy
        return make
    if spec == "none":
        keep_idx: frozenset[int] = frozenset()
    elif isinstance(spec, Collection) and not isinstance(spec, str) and all(isinstance(i, int) for i in spec):
        keep_idx = frozenset(spec)
    else:
        raise ValueError(f"a selective policy must be 'matmuls', 'none' or a set of op indices, got {spec!r}")

    def make_indexed() -> Callable[..., CheckpointPolicy]:
        seen = {False: 0, True: 0}

        def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            i = seen[ctx.is_recompute]
            seen[ctx.is_recompute] = i + 1
            return CheckpointPolicy.MUST_SAVE if i in keep_idx else CheckpointPolicy.PREFER_RECOMPUTE
        return policy
    return make_indexed


class _RetainedCache:
    """Selective checkpointing's recomputation context, for a backward that keeps the graph as well.

    PyTorch's context hands each stored output to the recomputation once and marks it consumed, so
    a second backward through a retained graph (``loss.backward(retain_graph=True)`` then another
    backward, as multi-loss training does) raised "Trying to backward an extra time ..." in every
    selective region, where the unpatched model and plain recomputed regions run it. Decided: a
    recomputation inside a backward that keeps the graph
    (``torch._C._autograd._get_current_graph_task_keep_graph()``) leaves the region's storage as it
    found it, so the next backward finds the stored outputs, as the unpatched step's saved tensors
    stay with a retained graph; the last backward (not keeping it) consumes them as PyTorch's does.
    Only the storage's containers are copied and put back (no tensor is copied), which holds for
    the storage layouts of the torch versions we run on (lists per op, or dicts per op and call)."""

    def __init__(self, cached: Any) -> None:
        self.cached = cached
        self.kept: dict[Any, Any] | None = None

    def __enter__(self) -> Any:
        keep = torch._C._autograd._get_current_graph_task_keep_graph()
        self.kept = {k: copy.copy(v) for k, v in self.cached.storage.items()} if keep else None
        return self.cached.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        try:
            return self.cached.__exit__(*exc)
        finally:
            if self.kept is not None:  # the graph is kept for another backward
                self.cached.storage.clear()
                self.cached.storage.update(self.kept)
                getattr(self.cached, "func_counter", {}).clear()
                self.kept = None


def selective_contexts(policy: Callable[..., CheckpointPolicy]) -> tuple[Any, Any]:
    """``create_selective_checkpoint_contexts(policy)`` whose recomputation also serves backwards
    through a retained graph (:class:`_RetainedCache`)."""
    caching, cached = create_selective_checkpoint_contexts(policy)
    return caching, _RetainedCache(cached)


def _context(make: Callable[[], Callable[..., CheckpointPolicy]]) -> Any:
    return selective_contexts(make())


def _call(fn: Callable[..., Any], make: Callable[[], Callable[..., CheckpointPolicy]], *args: Any,
          **kwargs: Any) -> Any:
    if not records():  # also under torch.func transforms (.transforms)
        return fn(*args, **kwargs)
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True,
                      context_fn=functools.partial(_context, make), **kwargs)


def is_selective(model: nn.Module) -> bool:
    """Whether :func:`apply_selective` has patched ``model``."""
    return _ATTR in model.__dict__


def apply_selective(model: nn.Module, policies: Mapping[str, str | Collection[int]]) -> nn.Module:
    """Run each module of ``policies`` (path -> policy) under selective checkpointing, in place.

    Raises ``ValueError`` for an unknown path or policy, a module with running statistics, or a
    model already patched (call :func:`restore_selective` first); on error nothing is changed.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if is_selective(model):
        raise ValueError("model already has selective regions; call restore_selective(model) first")
    mods = dict(model.named_modules())
    wraps: list[tuple[nn.Module, Callable[[], Callable[..., CheckpointPolicy]]]] = []
    for path, spec in policies.items():
        if path not in mods or path == "":
            raise ValueError(f"{type(model).__name__} has no submodule {path!r}; "
                             f"repeated blocks are {layer_paths(model)[:4]}...")
        if stateful_buffers([mods[path]]):
            raise ValueError(f"module {path!r} updates running statistics (batch norm); selective "
                             "checkpointing cannot restore them: leave it out or use autoremat.apply")
        if "forward" in mods[path].__dict__:
            raise ValueError(f"module {path!r} already has an instance forward (patched by autoremat.apply "
                             "or another tool); restore it first")
        wraps.append((mods[path], _policy(spec)))
    for mod, make in wraps:
        mod.__dict__["forward"] = functools.partial(_call, mod.forward, make)
    model.__dict__[_ATTR] = [mod for mod, _ in wraps]
    return model


def restore_selective(model: nn.Module) -> nn.Module:
    """Undo :func:`apply_selective` exactly; an unpatched model is returned unchanged."""
    for mod in model.__dict__.pop(_ATTR, []):
        mod.__dict__.pop("forward", None)
    return model


class _KeptOps:
    """The policy of one region call: ``MUST_SAVE`` for the ops at the kept indices (checked
    against their names), ``PREFER_RECOMPUTE`` for the others. An op that draws from the RNG
    (tagged ``nondeterministic_seeded``: drop path's ``rand``, dropout) is always replayed, even at
    a kept index: the replay takes a kept output from the cache without running the op, so the
    RNG would not advance and every later random op of the call would draw another mask."""

    def __init__(self, keep: Mapping[int, str], where: str) -> None:
        self.keep, self.where, self.seen = keep, where, 0

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        i = self.seen
        self.seen += 1
        name = self.keep.get(i)
        if name is None:
            return CheckpointPolicy.PREFER_RECOMPUTE
        if str(op) != name:
            raise RuntimeError(f"autoremat: {self.where} dispatched {op} as its op {i}, where the captured step ran "
                               f"{name}: the module runs other ops than when it was captured; capture it again "
                               "and solve")
        if torch.Tag.nondeterministic_seeded in op.tags:
            return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE


def _selective_contexts(stateful: list[tuple[nn.Module, str]], params: tuple[torch.Tensor, ...],
                        keep: Mapping[int, str], where: str, dicts: tuple[dict[str, Any], ...] = (),
                        generators: list[tuple[torch.Generator, torch.Tensor]] | None = None) -> tuple[Any, Any]:
    """``context_fn``: selective checkpointing's two contexts joined with the buffer-restoring and
    parameter-checking ones (:func:`.recompute_state.checkpoint_kwargs`)."""
    fwd, rec = restoring_contexts(stateful, params, dicts, generators)
    sac_fwd, sac_rec = selective_contexts(_KeptOps(keep, where))
    return BothContexts(fwd, sac_fwd), BothContexts(rec, sac_rec)


class SelectiveCall(ProbedCall):
    """A module-level recomputed call of a plan that keeps some op outputs (``apply`` wraps the
    module's ``forward`` with it): non-reentrant ``torch.utils.checkpoint`` with selective
    checkpointing's contexts. Probing, the RNG replay, ``torch.compile`` and deactivation by
    ``restore`` are :class:`~autoremat.runtime.probed_call.ProbedCall`'s (the kept ops are the
    compiler's choice under ``torch.compile``); only the region differs."""

    def __init__(self, fn: Callable[..., Any], stateful: list[tuple[nn.Module, str]], params: tuple[torch.Tensor, ...],
                 keep: Mapping[int, str], where: str, dicts: tuple[dict[str, Any], ...] = ()) -> None:
        super().__init__(fn, stateful, "torch", params, where, dicts)
        self.keep = dict(keep)

    def _call(self, rng: bool, stop: bool | Callable[[], bool], args: tuple[Any, ...], kwargs: dict[str, Any],
              gens: list[tuple[torch.Generator, torch.Tensor]] | None = None) -> Any:
        context = functools.partial(_selective_contexts, self.stateful, self.params, self.keep, self.where, self.dicts,
                                    gens)
        return checkpoint(self.fn, *args, use_reentrant=False, preserve_rng_state=rng, context_fn=context,
                          early_stop=stop if isinstance(stop, bool) else False, **kwargs)
