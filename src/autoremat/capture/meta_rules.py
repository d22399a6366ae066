"""Output metadata of a few meta-device ops from rules verified against their kernels.

Why. The meta kernels of batch norm (forward and backward) and of the pointwise ops are Python
decompositions (``torch._decomp`` / ``torch._refs``): 1.3-1.4 ms per batch-norm call on the
development machine (x86_64, CPU only), ~0.3 ms per ReLU. :class:`~.meta_cache.MetaOpCache` answers
an op seen before with the same input metadata, but every distinct channel count is a new key:
DenseNet-161's meta capture ran 85 distinct batch norms forward and backward, 0.23 s of its
0.75 s, which made the scaled capture cost about 2x a full capture.

Rule. For the ops in :func:`ruled` each output is one of: *like* tensor argument ``k`` (its
shape and strides), a *channel vector* of argument ``k`` (shape ``(k.shape[1],)``, stride
``(1,)``), or a *constant* shape and strides; its dtype is a constant. The templates are read
from a real kernel call and then **verified**: the next calls of the same structure (the op,
the arguments' ranks, dtypes, stride orders, density, conj/neg bits, which optional arguments
are absent, the non-tensor arguments; for a pointwise op, all tensor arguments of one shape and
strides) run the kernel too and must produce exactly what the templates predict. After
:data:`CONFIRMATIONS` such calls with outputs that match (on shapes that differ from the first
call's), the rule answers the structure without the kernel; one mismatch retires it for good.
The outputs made by a rule are fresh meta tensors, as a cache hit's are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["ruled", "structure", "LayoutRules", "CONFIRMATIONS"]

_aten = torch.ops.aten
_BATCH_NORM = (_aten.native_batch_norm.default, _aten.native_batch_norm_backward.default)
CONFIRMATIONS = 2
"""Calls of one structure whose outputs the templates predicted before the rule is used."""

Meta = tuple[tuple[int, ...], tuple[int, ...], torch.dtype]


def ruled(func: Any) -> bool:
    """Whether ``func`` is one of the ops with layout rules (pointwise, batch norm)."""
    return func in _BATCH_NORM or torch.Tag.pointwise in func.tags


def _dense(t: torch.Tensor) -> bool:
    return t.is_contiguous() or (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last))


def structure(func: Any, spec: Any, flat: Sequence[Any]) -> tuple | None:
    """The structure key of a call (module docstring), or ``None`` where no rule may apply."""
    tensors = [x for x in flat if isinstance(x, torch.Tensor)]
    if not tensors or not all(_dense(t) for t in tensors):
        return None
    if func not in _BATCH_NORM and len({(tuple(t.shape), t.stride()) for t in tensors}) != 1:
        return None  # pointwise: broadcasting or mixed layouts are left to the kernel
    key: list[Any] = [func, spec]
    for x in flat:
        if isinstance(x, torch.Tensor):
            order = tuple(sorted(range(x.dim()), key=lambda i: (-x.stride(i), i)))
            key.append((x.dim(), x.dtype, order, x.is_conj(), x.is_neg()))
        else:
            key.append((type(x), x))
    return tuple(key)


def _template(out: Meta, tensors: Sequence[torch.Tensor]) -> tuple:
    shape, stride, dtype = out
    for k, t in enumerate(tensors):
        if tuple(t.shape) == shape and t.stride() == stride:
            return ("like", k, dtype)
    for k, t in enumerate(tensors):
        if t.dim() >= 2 and shape == (t.shape[1],) and stride == (1,):
            return ("channels", k, dtype)
    return ("const", shape, stride, dtype)


def _apply(template: tuple, tensors: Sequence[torch.Tensor]) -> Meta:
    if template[0] == "like":
        t = tensors[template[1]]
        return tuple(t.shape), t.stride(), template[2]
    if template[0] == "channels":
        return (int(tensors[template[1]].shape[1]),), (1,), template[2]
    return template[1], template[2], template[3]


class LayoutRules:
    """Rules per structure: learned from a kernel's outputs, verified, then used (module docstring)."""

    def __init__(self) -> None:
        self.used = 0
        self._rules: dict[tuple, list[Any]] = {}
        """structure -> [templates, out_spec, confirmations, shapes of the first call]; None: retired."""

    def predict(self, key: tuple, flat: Sequence[Any]) -> tuple[list[Meta], Any] | None:
        """The outputs' metadata and spec where a confirmed rule answers ``key``, else ``None``."""
        rule = self._rules.get(key)
        if rule is None or rule[2] < CONFIRMATIONS:
            return None
        tensors = [x for x in flat if isinstance(x, torch.Tensor)]
        self.used += 1
        return [_apply(t, tensors) for t in rule[0]], rule[1]

    def learn(self, key: tuple, flat: Sequence[Any], outs: list[Meta], out_spec: Any) -> None:
        """Record what the kernel returned for a call of structure ``key`` (fresh outputs)."""
        tensors = [x for x in flat if isinstance(x, torch.Tensor)]
        shapes = tuple(tuple(t.shape) for t in tensors)
        if key not in self._rules:
            self._rules[key] = [[_template(o, tensors) for o in outs], out_spec, 0, shapes]
            return
        rule = self._rules[key]
        if rule is None or shapes == rule[3]:
            return
        if out_spec == rule[1] and [_apply(t, tensors) for t in rule[0]] == outs:
            rule[2] += 1
        else:
            self._rules[key] = None  # type: ignore[assignment]
