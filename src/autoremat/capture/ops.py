"""The ATen ops each module call runs: what selective saves inside a module region choose from.

:func:`record_ops` runs one forward of the model with grad enabled under a ``TorchDispatchMode``
and, for each module path asked for, lists the ops its call dispatches in order, with the bytes of
the new storages each op creates and its forward time (``perf_counter`` around the op). Ops that
selective checkpointing ignores (``torch.utils.checkpoint.SAC_IGNORED_OPS``: detach, size
queries) are not counted, so an op's ``index`` is the number a selective-checkpoint policy sees
for it (:mod:`autoremat.runtime.selective`, policy as a set of indices). A module called more
than once in the step keeps the ops of its first call.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import SAC_IGNORED_OPS

from ..measure import default_loss

__all__ = ["OpCost", "record_ops"]


@dataclass(frozen=True)
class OpCost:
    """One op of a module call: its position, name, new output bytes and forward time."""

    index: int
    name: str
    out_bytes: int
    time_s: float


class _OpMode(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.current: str | None = None
        self.ops: dict[str, list[OpCost]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if self.current is None or func in SAC_IGNORED_OPS:
            return func(*args, **kwargs)
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        dt = time.perf_counter() - t0
        ins = {a.untyped_storage()._cdata for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)}
        fresh: dict[int, int] = {}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                if st._cdata not in ins:
                    fresh[st._cdata] = st.nbytes()
        ops = self.ops[self.current]
        ops.append(OpCost(len(ops), func.name(), sum(fresh.values()), dt))
        return out


def record_ops(model: nn.Module, paths: Collection[str], args: Sequence[Any], kwargs: Mapping[str, Any] | None = None,
               *, loss_fn: Callable[[Any], torch.Tensor] | None = None) -> dict[str, list[OpCost]]:
    """The ops each module of ``paths`` runs in one forward of ``model`` (then one backward, so
    the step leaves no graph behind); gradients are left as they were."""
    mods = dict(model.named_modules())
    missing = [p for p in paths if p not in mods]
    if missing:
        raise ValueError(f"{type(model).__name__} has no submodules {missing}; pass paths of model.named_modules()")
    mode = _OpMode()
    handles = []

    def pre(path: str) -> Callable[..., None]:
        def hook(_m: nn.Module, _a: tuple) -> None:
            if mode.current is None and path not in mode.ops:
                mode.current = path
                mode.ops[path] = []
        return hook

    def post(path: str) -> Callable[..., None]:
        def hook(_m: nn.Module, _a: tuple, _o: Any) -> None:
            if mode.current == path:
                mode.current = None
        return hook

    grads = {n: p.grad for n, p in model.named_parameters()}
    try:
        for p in paths:
            handles.append(mods[p].register_forward_pre_hook(pre(p)))
            handles.append(mods[p].register_forward_hook(post(p)))
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            with mode:
                out = model(*args, **dict(kwargs or {}))
            (loss_fn or default_loss)(out).backward()
    finally:
        for h in handles:
            h.remove()
        for n, p in model.named_parameters():
            p.grad = grads.get(n)
    return mode.ops
