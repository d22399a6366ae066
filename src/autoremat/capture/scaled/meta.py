"""The full-size capture on the meta device: bytes of every node at the real batch, nothing
allocated.

The model's parameters and buffers are swapped in place for meta tensors (:func:`on_meta`), the
inputs replaced by meta tensors of the same shapes, and the ordinary capture runs on that, with
the composite functions that pick their ops by device (attention) dispatching as the real device
would (:class:`autoremat.capture.device_parity.AsDevice`).

**Autocast.** Autocast's dispatch keys never fire on meta tensors; under CPU or CUDA autocast the
capture runs with the device's autocast emulated (:func:`autoremat.capture.autocast_meta.emulated_autocast`:
its own policy, read from the build's kernels, and its cast cache), logged at INFO and recorded as
``graph.meta["autocast_emulated"]``. Autocast on another device type falls back (logged, with
the reason), as a model that cannot run on meta does.

**Cost.** Many meta kernels are Python; :func:`autoremat.capture.capture` answers repeated ops on
the meta device from :class:`autoremat.capture.meta_cache.MetaOpCache`, and batch norm and
pointwise ops of new shapes by layout rules verified against their kernels
(:mod:`autoremat.capture.meta_rules`; the docstrings have the measurements).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from ...graph import Graph
from .batch import map_batch

__all__ = ["on_meta", "traced_on_meta", "meta_inputs", "meta_capture", "autocast_on"]

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def on_meta(model: nn.Module, *more: nn.Module) -> Iterator[dict[int, torch.Tensor]]:
    """Swap ``model``'s parameters and buffers for meta tensors in place, and put them back.

    Tied parameters stay tied (one meta tensor per original); ``.grad`` is set aside while
    swapped. The objects the optimizer holds are untouched: the modules point at new meta
    tensors for the duration and at the originals again afterwards, even on an exception.
    ``more``: modules that hold some of the same tensors (``model`` traced by fx, whose root
    keeps its own references to the attributes it reads), swapped to the same meta tensors.
    Yields ``{id(meta tensor): original}``.
    """
    memo: dict[int, torch.Tensor] = {}
    swapped: list[tuple[dict, str, Any]] = []
    modules = list({id(m): m for root in (model, *more) for m in root.modules()}.values())
    grads = {id(p): p.grad for m in modules for p in m.parameters(recurse=False)}
    try:
        for mod in modules:
            for store in (mod._parameters, mod._buffers):
                for name, t in list(store.items()):
                    if t is None or t.device.type == "meta":
                        continue
                    if id(t) not in memo:
                        m = torch.empty_like(t, device="meta")
                        memo[id(t)] = nn.Parameter(m, t.requires_grad) if isinstance(t, nn.Parameter) else m
                    swapped.append((store, name, t))
                    store[name] = memo[id(t)]
        yield {id(store[name]): t for store, name, t in swapped}
    finally:
        for store, name, t in reversed(swapped):
            store[name] = t
        for m in modules:
            for p in m.parameters(recurse=False):
                p.grad = grads.get(id(p), p.grad)


def traced_on_meta(model: nn.Module, mode: str) -> torch.fx.GraphModule | None:
    """``model`` traced by fx, or ``None`` at module level (``mode`` "module", or "auto" where fx
    cannot trace it, logged). The model's tensors are on meta while it is traced, so nothing is
    allocated (keeping the model's state as a capture does copies its buffers: on a device that
    holds only the resident tensors, that ran out of memory); afterwards the trace's own references
    to them (the root's copies of the attributes ``get_attr`` nodes read) are the real tensors."""
    from .. import _traced_or_none

    owned = {id(m) for m in model.modules()}
    with on_meta(model) as real_of:
        gm = _traced_or_none(model, mode, torch.device("meta"))
    if gm is not None:
        for mod in gm.modules():
            if id(mod) in owned:
                continue
            for store in (mod._parameters, mod._buffers):
                for name, t in list(store.items()):
                    if t is not None and id(t) in real_of:
                        store[name] = real_of[id(t)]
    return gm


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


def meta_capture(model: nn.Module, args: tuple, kwargs: dict, opts: dict,
                 gm: torch.fx.GraphModule | None = None) -> tuple[Graph, dict[str, Any]] | None:
    """The full-size capture on the meta device, or ``None`` (logged) where it cannot run.

    ``gm``: ``model`` traced (captured at fx level without tracing again); then the second item
    is the full-size argument signatures of the nodes :mod:`.replay` times alone, read while the
    capture's recorded step runs (:class:`~.replay.ArgumentSignatures`), else it is empty."""
    from ...resident import device_of

    from ..autocast_meta import can_emulate

    device = device_of(model, args, kwargs)
    emulate = None
    if autocast_on(device):
        reason = can_emulate(device.type)
        if reason is not None:
            logger.info("autoremat: autocast is on and %s; bytes come from a linear fit of real captures at "
                        "batch sizes that fit", reason)
            return None
        emulate = device.type
        logger.info("autoremat: meta capture under %s autocast (%s), emulated on meta tensors as the device "
                    "applies it", device.type, str(torch.get_autocast_dtype(device.type)).replace("torch.", ""))
    margs, mkwargs = meta_inputs(args, kwargs)
    try:
        try:  # without values first: a model that reads none pays nothing for them
            g, watch, parity, shadows = _attempt(model, args, kwargs, margs, mkwargs, opts, gm, device, False,
                                                 emulate)
        except RuntimeError as exc:
            if "meta" not in str(exc):
                raise
            logger.debug("autoremat: meta capture read a tensor's value (%s); again with the values of the "
                         "inputs and buffers", str(exc).splitlines()[0][:200] if str(exc) else "")
            g, watch, parity, shadows = _attempt(model, args, kwargs, margs, mkwargs, opts, gm, device, True,
                                                 emulate)
    except Exception as exc:  # data-dependent Python on meta raises many types; fall back and say so
        logger.info("autoremat: %s cannot run on meta tensors (%s: %s); bytes come from a linear fit of real "
                    "captures at batch sizes that fit", type(model).__name__, type(exc).__name__,
                    str(exc).splitlines()[0][:200] if str(exc) else "")
        return None
    g.meta["device"] = str(device)
    if emulate is not None:  # the autocast the meta capture ran under (emulated), for the log and tests
        g.meta["autocast_emulated"] = {"device": emulate, "dtype": str(torch.get_autocast_dtype(emulate))}
    if shadows is not None and shadows.answered:
        logger.debug("autoremat: meta capture: %d value reads answered from the inputs' and buffers' values",
                     shadows.answered)
    if parity.choices:
        logger.debug("autoremat: meta capture: attention backends as on %s: %s", device, parity.choices)
    from ..signature import input_signature

    g.meta["inputs"] = input_signature(args, kwargs)  # the real batch's devices, not "meta"
    return g, (watch.signatures if watch is not None else {})


def _attempt(model: nn.Module, args: tuple, kwargs: dict, margs: tuple, mkwargs: dict, opts: dict,
             gm: torch.fx.GraphModule | None, device: torch.device, values: bool,
             emulate: str | None = None) -> tuple[Graph, Any, Any, Any]:
    """One meta capture, dispatching as on ``device``
    (:func:`autoremat.capture.device_parity.as_device`); with ``values``, small integer inputs
    and buffers carry their values (:class:`autoremat.capture.shadow_values.ShadowValues`), so
    Python that reads them runs; ``emulate``: the device type whose autocast the meta tensors see
    (:func:`autoremat.capture.autocast_meta.emulated_autocast`). ``(graph, watch, parity mode,
    shadows or None)``."""
    from .. import _capture
    from ..autocast_meta import emulated_autocast
    from ..device_parity import as_device
    from ..shadow_values import ShadowValues
    from .replay import ArgumentSignatures

    watch = ArgumentSignatures(gm) if gm is not None else None
    shadows = ShadowValues() if values else None
    if shadows is not None:
        for m, r in zip(tree_flatten((margs, mkwargs))[0], tree_flatten((args, kwargs))[0]):
            if isinstance(m, torch.Tensor) and isinstance(r, torch.Tensor):
                shadows.seed(m, r, floats=False)
    with on_meta(model, *(() if gm is None else (gm,))) as real_of, as_device(device, shadows) as parity, \
            emulated_autocast(emulate) if emulate is not None else contextlib.nullcontext():
        if shadows is not None:
            for b in model.buffers():
                if id(b) in real_of:
                    shadows.seed(b, real_of[id(b)], floats=False)
        g = _capture(model, margs, mkwargs, **{**opts, "repeats": 1, "warmup": 0},
                     flop_times=opts.get("times") == "flops", traced=gm, watch=watch, shadows=shadows)
    return g, watch, parity, shadows
