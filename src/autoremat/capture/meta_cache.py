"""Answer repeated meta-device ops from a cache of their output metadata.

Many meta kernels are Python (batch norm and its backward, convolution, the elementwise ops of
their decompositions run through ``torch._refs`` / ``torch._prims``). :class:`MetaOpCache`
answers an op it has seen with the same input metadata from a cache of output metadata (shape,
strides, dtype), the way ``FakeTensorMode``'s dispatch cache does; only ops that return fresh
tensors are cached (no aliasing or mutating schema, no view, no random or data-dependent op, no
output in an input's storage), so the outputs a hit makes (new meta tensors of the cached
metadata) are exactly what the kernel would have returned, and the recorder sees the same
storages and bytes (``tests/capture/test_meta_cache.py``: a meta capture equals the CPU capture
with FLOP times node for node). Repeated blocks hit: ResNet-152 1.23 s -> 0.53 s CPU
(``benchmarks/results/cpu/scaled_capture/``); a 64-layer GPT-2 at op level (4,626 of 5,209 ops
answered) 2.63 s -> 1.56 s, medians of 3 interleaved captures in one process on the shared
2-core machine at load ~5 (``benchmarks/results/cpu/solver_speed/``). :func:`autoremat.capture.capture`
enters it for every capture on the meta device.

Ops of new shapes whose meta kernels are Python (batch norm forward and backward, pointwise ops:
every distinct channel count is a new key) are answered by layout rules verified against those
kernels (:mod:`.meta_rules`): DenseNet-161's meta capture 0.75 s -> 0.60 s CPU, its
layer-for-layer byte counts unchanged on the CPU zoo (``benchmarks/results/cpu/scaled_capture/``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from .meta_rules import LayoutRules, ruled, structure

__all__ = ["MetaOpCache"]

_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout)
_UNCACHED_TAGS = (torch.Tag.nondeterministic_seeded, torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)


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

    def _key(self, func: Any, args: tuple, kwargs: dict) -> tuple | None:
        try:
            return (func, _meta_key(args), tuple((k, _meta_key(v)) for k, v in sorted(kwargs.items())))
        except _Uncacheable:
            return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def, override]
        kwargs = kwargs or {}
        key = self._key(func, args, kwargs) if self._may_cache(func) else None
        if key is None:
            return func(*args, **kwargs)
        hit = self._outputs.get(key)
        shape_key = None
        if hit is None and ruled(func):
            arg_flat, arg_spec = tree_flatten((args, kwargs))
            shape_key = structure(func, arg_spec, arg_flat)
            predicted = self.rules.predict(shape_key, arg_flat) if shape_key is not None else None
            if predicted is not None:
                specs, rule_spec = predicted
                hit = self._outputs[key] = (specs, None if rule_spec is _SINGLE else rule_spec)
        if hit is not None:
            self.hits += 1
            specs, out_spec = hit
            made = [torch.empty_strided(shape, stride, dtype=dtype, device="meta") for shape, stride, dtype in specs]
            return made[0] if out_spec is None else tree_unflatten(made, out_spec)
        self.misses += 1
        out = func(*args, **kwargs)
        flat, out_spec = tree_flatten(out)
        arg_flat = tree_flatten((args, kwargs))[0] if shape_key is None else arg_flat
        inputs = {a.untyped_storage()._cdata for a in arg_flat if isinstance(a, torch.Tensor) and a.layout is torch.strided}
        if _fresh(flat, inputs):
            metas = [(tuple(t.shape), t.stride(), t.dtype) for t in flat]
            single = isinstance(out, torch.Tensor)
            self._outputs[key] = (metas, None if single else out_spec)
            if shape_key is not None:
                self.rules.learn(shape_key, arg_flat, metas, _SINGLE if single else out_spec)
        return out


_SINGLE = "single tensor"
"""What the rules record as the output structure of an op that returns one tensor."""


class _Uncacheable(Exception):
    """An argument the cache cannot key on (a tensor off the meta device, an unknown object)."""


def _meta_key(x: Any) -> Any:
    """A hashable key of an op argument: a tensor's metadata (not the storage offset: a fresh
    output's layout follows sizes and strides; gradients of a concatenation are slices of one
    storage at many offsets), plain values with their type, lists and tuples element-wise."""
    if isinstance(x, torch.Tensor):
        if x.device.type != "meta" or x.layout is not torch.strided:  # a sparse gradient: run it
            raise _Uncacheable
        return (tuple(x.shape), x.stride(), x.dtype, x.is_conj(), x.is_neg())
    if isinstance(x, (list, tuple)):
        return (type(x), tuple(_meta_key(y) for y in x))
    if isinstance(x, _PLAIN):
        return (type(x), x)
    raise _Uncacheable


def _fresh(flat: list[Any], inputs: set[int]) -> bool:
    """Whether ``flat`` are meta tensors, each alone in a storage that ``empty_strided`` of its
    shape, strides and dtype would make (so a cache hit reproduces its bytes exactly), and none in
    an input's storage (``_unsafe_view`` declares no alias in its schema but returns its input's
    storage: a hit would make a new one, and the recorder would count bytes that a view has not)."""
    storages = set()
    for t in flat:
        if not isinstance(t, torch.Tensor) or t.device.type != "meta" or t.layout is not torch.strided \
                or t.storage_offset() != 0:
            return False
        st = t.untyped_storage()
        if st._cdata in inputs:
            return False
        storages.add(st._cdata)
        probe = torch.empty_strided(tuple(t.shape), t.stride(), dtype=t.dtype, device="meta")
        if probe.untyped_storage().nbytes() != st.nbytes():
            return False
    return bool(flat) and len(storages) == len(flat)
