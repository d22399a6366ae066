"""The full-size capture on the meta device: bytes of every node at the real batch, nothing
allocated.

The model's parameters and buffers are swapped in place for meta tensors (:func:`on_meta`), the
inputs replaced by meta tensors of the same shapes, and the ordinary capture runs on that.

**Cost.** Many meta kernels are Python; :func:`autoremat.capture.capture` answers repeated ops on
the meta device from :class:`autoremat.capture.meta_cache.MetaOpCache` (its docstring has the
measurements).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ...graph import Graph
from .batch import map_batch

__all__ = ["on_meta", "meta_inputs", "meta_capture", "autocast_on"]

logger = logging.getLogger(__name__)



@contextlib.contextmanager
def on_meta(model: nn.Module) -> Iterator[nn.Module]:
    """Swap ``model``'s parameters and buffers for meta tensors in place, and put them back.

    Tied parameters stay tied (one meta tensor per original); ``.grad`` is set aside while
    swapped. The objects the optimizer holds are untouched: the modules point at new meta
    tensors for the duration and at the originals again afterwards, even on an exception.
    """
    memo: dict[int, torch.Tensor] = {}
    swapped: list[tuple[dict, str, Any]] = []
    grads = {id(p): p.grad for p in model.parameters()}
    try:
        for mod in model.modules():
            for store in (mod._parameters, mod._buffers):
                for name, t in list(store.items()):
                    if t is None or t.device.type == "meta":
                        continue
                    if id(t) not in memo:
                        m = torch.empty_like(t, device="meta")
                        memo[id(t)] = nn.Parameter(m, t.requires_grad) if isinstance(t, nn.Parameter) else m
                    swapped.append((store, name, t))
                    store[name] = memo[id(t)]
        yield model
    finally:
        for store, name, t in reversed(swapped):
            store[name] = t
        for p in model.parameters():
            p.grad = grads.get(id(p), p.grad)


def meta_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Meta tensors of the inputs' shapes, dtypes and ``requires_grad``."""
    def meta(t: torch.Tensor, _batched: bool) -> torch.Tensor:
        return torch.empty_like(t, device="meta").requires_grad_(t.requires_grad)
    return map_batch(args, -1, 0, meta), map_batch(kwargs, -1, 0, meta)


def autocast_on(device: torch.device) -> bool:
    try:
        return bool(torch.is_autocast_enabled(device.type))
    except (TypeError, RuntimeError):
        return False


def meta_capture(model: nn.Module, args: tuple, kwargs: dict, opts: dict) -> Graph | None:
    """The full-size capture on the meta device, or ``None`` (logged) where it cannot run."""
    from .. import _capture
    from ...resident import device_of

    device = device_of(model, args, kwargs)
    if autocast_on(device):
        logger.info("autoremat: autocast is on and does not apply to meta tensors; bytes come from a linear "
                    "fit of real captures at batch sizes that fit")
        return None
    margs, mkwargs = meta_inputs(args, kwargs)
    try:
        with on_meta(model):
            g = _capture(model, margs, mkwargs, **{**opts, "repeats": 1, "warmup": 0},
                         flop_times=opts.get("times") == "flops")
    except Exception as exc:  # data-dependent Python on meta raises many types; fall back and say so
        logger.info("autoremat: %s cannot run on meta tensors (%s: %s); bytes come from a linear fit of real "
                    "captures at batch sizes that fit", type(model).__name__, type(exc).__name__,
                    str(exc).splitlines()[0][:200] if str(exc) else "")
        return None
    g.meta["device"] = str(device)
    from ..signature import input_signature

    g.meta["inputs"] = input_signature(args, kwargs)  # the real batch's devices, not "meta"
    return g
