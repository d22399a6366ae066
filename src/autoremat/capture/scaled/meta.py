"""The full-size capture on the meta device: bytes of every node at the real batch, nothing
allocated.

The model's parameters and buffers are swapped in place for meta tensors (:func:`on_meta`), the
inputs replaced by meta tensors of the same shapes, and the ordinary capture runs on that.

**Cost.** Many meta kernels are Python (batch norm and its backward, convolution, and the
elementwise ops of their decompositions run through ``torch._refs`` / ``torch._prims``): on the
CPU zoo they made the meta capture as dear as a whole real capture (DenseNet-121: 1.09 s CPU
against 0.87 s). :class:`MetaOpCache` answers an op it has seen with the same input metadata from
a cache of output metadata (shape, strides, dtype), the way ``FakeTensorMode``'s dispatch cache
does; only ops that return fresh tensors are cached (no aliasing or mutating schema, no view, no
random or data-dependent op), so the outputs a hit makes (new meta tensors of the cached
metadata) are exactly what the kernel would have returned, and the recorder sees the same storages
and bytes. Repeated blocks hit: ResNet-152 1.23 s -> 0.53 s CPU (measurements in
``benchmarks/results/cpu/scaled_capture/``). Ops of new shapes whose meta kernels are Python
(batch norm forward and backward, pointwise ops) are answered by layout rules verified against
those kernels (:mod:`.meta_rules`): DenseNet-161's meta capture 0.75 s -> 0.60 s CPU, its
layer-for-layer byte counts unchanged on the CPU zoo.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from ...graph import Graph
from .batch import map_batch
from .meta_rules import LayoutRules, ruled, structure

__all__ = ["on_meta", "traced_on_meta", "meta_inputs", "MetaOpCache", "meta_capture", "autocast_on"]

logger = logging.getLogger(__name__)

_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout)
_UNCACHED_TAGS = (torch.Tag.nondeterministic_seeded, torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)


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


class MetaOpCache(TorchDispatchMode):
    """Output metadata of meta-device ops, keyed by the op and its inputs' metadata (module
    docstring). ``hits`` and ``misses`` count the cacheable ops."""

    def __init__(self) -> None:
        super().__init__()
        self.hits = 0
        self.misses = 0
        self._outputs: dict[tuple, tuple[list[tuple], Any]] = {}
        self._cacheable: dict[Any, bool] = {}
        self.rules = LayoutRules()
        """Verified layout rules for batch norm and pointwise ops (:mod:`.meta_rules`); ``rules.used``
        counts the hits they answered."""

    def _may_cache(self, func: Any) -> bool:
        ok = self._cacheable.get(func)
        if ok is None:
            schema = func._schema
            ok = (not schema.is_mutable and not getattr(func, "is_view", False) and len(schema.returns) > 0
                  and all(a.alias_info is None for a in (*schema.arguments, *schema.returns))
                  and all(str(r.type) == "Tensor" for r in schema.returns)
                  and not any(tag in func.tags for tag in _UNCACHED_TAGS))
            self._cacheable[func] = ok
        return ok

    def _key(self, func: Any, flat: list[Any], spec: Any) -> tuple | None:
        key: list[Any] = [func, spec]
        for x in flat:
            if isinstance(x, torch.Tensor):
                if x.device.type != "meta":
                    return None
                # not the storage offset: a fresh output's layout follows sizes and strides (gradients
                # of a concatenation are slices of one storage at many offsets)
                key.append((tuple(x.shape), x.stride(), x.dtype, x.is_conj(), x.is_neg()))
            elif isinstance(x, _PLAIN):
                key.append((type(x), x))
            else:
                return None
        return tuple(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def, override]
        kwargs = kwargs or {}
        if not self._may_cache(func):
            return func(*args, **kwargs)
        flat, spec = tree_flatten((args, kwargs))
        key = self._key(func, flat, spec)
        if key is None:
            return func(*args, **kwargs)
        hit = self._outputs.get(key)
        if hit is None and ruled(func):
            shape_key = structure(func, spec, flat)
            hit = self.rules.predict(shape_key, flat) if shape_key is not None else None
            if hit is not None:
                self._outputs[key] = hit
        if hit is not None:
            self.hits += 1
            specs, out_spec = hit
            return tree_unflatten([torch.empty_strided(shape, stride, dtype=dtype, device="meta")
                                   for shape, stride, dtype in specs], out_spec)
        self.misses += 1
        out = func(*args, **kwargs)
        outs, out_spec = tree_flatten(out)
        if _fresh(outs):
            metas = [(tuple(t.shape), t.stride(), t.dtype) for t in outs]
            self._outputs[key] = (metas, out_spec)
            if ruled(func) and (shape_key := structure(func, spec, flat)) is not None:
                self.rules.learn(shape_key, flat, metas, out_spec)
        return out


def _fresh(flat: list[Any]) -> bool:
    """Whether ``flat`` are meta tensors, each alone in a storage that ``empty_strided`` of its
    shape, strides and dtype would make (so a cache hit reproduces its bytes exactly)."""
    storages = set()
    for t in flat:
        if not isinstance(t, torch.Tensor) or t.device.type != "meta" or t.storage_offset() != 0:
            return False
        st = t.untyped_storage()
        storages.add(st._cdata)
        probe = torch.empty_strided(tuple(t.shape), t.stride(), dtype=t.dtype, device="meta")
        if probe.untyped_storage().nbytes() != st.nbytes():
            return False
    return bool(flat) and len(storages) == len(flat)


def meta_capture(model: nn.Module, args: tuple, kwargs: dict, opts: dict,
                 gm: torch.fx.GraphModule | None = None) -> tuple[Graph, dict[str, Any]] | None:
    """The full-size capture on the meta device, or ``None`` (logged) where it cannot run.

    ``gm``: ``model`` traced (captured at fx level without tracing again); then the second item
    is the full-size argument signatures of the nodes :mod:`.replay` times alone, read while the
    capture's recorded step runs (:class:`~.replay.ArgumentSignatures`), else it is empty."""
    from .. import _capture
    from ...resident import device_of
    from .replay import ArgumentSignatures

    device = device_of(model, args, kwargs)
    if autocast_on(device):
        logger.info("autoremat: autocast is on and does not apply to meta tensors; bytes come from a linear "
                    "fit of real captures at batch sizes that fit")
        return None
    margs, mkwargs = meta_inputs(args, kwargs)
    cache = MetaOpCache()
    watch = ArgumentSignatures(gm) if gm is not None else None
    try:
        with on_meta(model, *(() if gm is None else (gm,))), cache:
            g = _capture(model, margs, mkwargs, **{**opts, "repeats": 1, "warmup": 0},
                         flop_times=opts.get("times") == "flops", traced=gm, watch=watch)
    except Exception as exc:  # data-dependent Python on meta raises many types; fall back and say so
        logger.info("autoremat: %s cannot run on meta tensors (%s: %s); bytes come from a linear fit of real "
                    "captures at batch sizes that fit", type(model).__name__, type(exc).__name__,
                    str(exc).splitlines()[0][:200] if str(exc) else "")
        return None
    logger.debug("autoremat: meta capture: %d ops answered from the cache (%d by layout rules), %d run", cache.hits,
                 cache.rules.used, cache.misses)
    g.meta["device"] = str(device)
    from ..signature import input_signature

    g.meta["inputs"] = input_signature(args, kwargs)  # the real batch's devices, not "meta"
    return g, (watch.signatures if watch is not None else {})
