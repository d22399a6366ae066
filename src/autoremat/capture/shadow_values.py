"""Real values beside small meta tensors, so a meta capture runs Python that reads them (issue
20: the step that does not fit is captured on the meta device).

Models branch on tensor values that do not depend on the weights: transformers' mask code asks
whether the position ids form one sequence per row (``(mask[:, -1] == 0).all()``) and whether the
attention mask has padding; position ids come from ``arange``. On meta tensors such a branch
raises ("Tensor.item() cannot be called on meta tensors"), and the scaled capture fell back to a
linear fit of real captures at small batch sizes (``use_cache=False``, the way models are trained
with checkpointing: Qwen2, Mistral, Llama, Gemma, Phi-3 all did).

:class:`ShadowValues` is a dispatch mode that keeps, beside each meta tensor it can, the CPU tensor
the real step would hold:

* **Seeds**: the real values of the step's small inputs (token ids, attention masks) and of the
  model's buffers (position-id tables, rotary frequencies), :meth:`ShadowValues.seed`.
* **Propagation**: an op whose meta inputs all have shadows, and whose output has at most
  ``max_numel`` elements, runs once more on the shadows on the CPU; factory ops (``arange``,
  ``full``) run on the CPU too. Views share their base's shadow storage, so in-place writes
  through either are seen by both. Random ops never run on shadows (they would draw from the
  CPU generator); a write into a shadowed storage from an op that cannot run on shadows marks the
  storage stale: its tensors have no value from then on.
* **Reads**: ``.item()``, ``bool(t)``, ``nonzero`` and other ops whose meta kernels cannot answer
  are answered from the shadows; without shadows they raise as before (and the capture falls back,
  as before).

The recorder sees exactly the ops of the real step: the shadow runs happen below it
(:func:`autoremat.capture._capture` enters this mode inside its meta-op cache and outside the
recorder), and values read are the real ones, so Python takes the real step's branches. Cost:
only small tensors derived from inputs and buffers are shadowed; parameters never are.
Decision: ``max_numel`` is 2**20 elements (a 4-byte shadow of at most 4 MiB of host memory): a
``(batch, 1, L, L)`` mask at long sequences is not shadowed, and code that reads its values
still falls back.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakTensorKeyDictionary

__all__ = ["ShadowValues", "MAX_NUMEL"]

MAX_NUMEL = 1 << 20
"""Largest tensor (elements) given a shadow (module docstring)."""

_CPU = torch.device("cpu")


class ShadowValues(TorchDispatchMode):
    """Shadows of meta tensors (module docstring). ``answered`` counts the value reads it
    answered."""

    def __init__(self, max_numel: int = MAX_NUMEL) -> None:
        super().__init__()
        self.max_numel = max_numel
        self._of = WeakTensorKeyDictionary()
        self._stale: set[int] = set()
        self.answered = 0

    def seed(self, meta: torch.Tensor, real: torch.Tensor, *, floats: bool = True) -> None:
        """Give meta tensor ``meta`` the value of ``real`` (same shape; small tensors only;
        with ``floats=False`` integer and boolean tensors only)."""
        if not floats and (real.is_floating_point() or real.is_complex()):
            return
        if meta.device.type == "meta" and real.device.type != "meta" and real.numel() <= self.max_numel:
            with torch.no_grad():
                self._of[meta] = real.detach().to(_CPU, copy=True).as_strided(meta.shape, meta.stride())

    def value(self, t: Any) -> torch.Tensor | None:
        """The shadow of meta tensor ``t``, or ``None``."""
        if not isinstance(t, torch.Tensor) or t.device.type != "meta":
            return None
        v = self._of.get(t)
        if v is None or t.untyped_storage()._cdata in self._stale:
            return None
        return v

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def, override]
        kwargs = kwargs or {}
        leaves = _leaves(args, kwargs)
        metas = [a for a in leaves if isinstance(a, torch.Tensor) and a.device.type == "meta"]
        if func in _FULL_WRITES and metas and self.value(args[0]) is None and _whole(args[0]) \
                and all(self.value(a) is not None for a in metas[1:]):
            self._of[args[0]] = torch.empty_strided(args[0].shape, args[0].stride(), dtype=args[0].dtype)
            self._stale.discard(args[0].untyped_storage()._cdata)  # every byte of it is written now
        if not all(self.value(a) is not None for a in metas) or torch.Tag.nondeterministic_seeded in func.tags \
                or func in _UNDEFINED:
            out = func(*args, **kwargs)
            if func._schema.is_mutable:
                self._spoil(func, args)
            return out
        if metas and _reads_values(func):
            self.answered += 1
            return self._on_shadows(func, args, kwargs, None)
        out = func(*args, **kwargs)
        if _small(out, self.max_numel):  # meta tensors only, each small
            try:
                self._on_shadows(func, args, kwargs, out)
            except (RuntimeError, TypeError, ValueError, IndexError, NotImplementedError):
                self._spoil(func, args)
        elif func._schema.is_mutable:
            self._spoil(func, args)
        return out

    def _on_shadows(self, func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
        """Run ``func`` on the shadows; record them as the shadows of ``out`` (the meta run's
        outputs), or, where ``out`` is ``None`` (an op meta cannot answer), return the real
        result with its tensors as new meta tensors that have those shadows."""
        real_args = tuple(_mapped(a, self._real) for a in args)
        real_kwargs = {k: _mapped(v, self._real) for k, v in kwargs.items()}
        with torch.no_grad():
            real = func(*real_args, **real_kwargs)
        if out is None:
            return tree_map(self._meta_of, real)
        outs, reals = tree_flatten(out)[0], tree_flatten(real)[0]
        for o, r in zip(outs, reals):
            if isinstance(o, torch.Tensor) and isinstance(r, torch.Tensor) and o.shape == r.shape:
                self._of[o] = r
        return out

    def _real(self, a: Any) -> Any:
        if isinstance(a, torch.Tensor) and a.device.type == "meta":
            return self.value(a)
        if isinstance(a, torch.device) and a.type == "meta":
            return _CPU
        return a

    def _meta_of(self, r: Any) -> Any:
        if not isinstance(r, torch.Tensor):
            return r
        m = torch.empty_strided(r.shape, r.stride(), dtype=r.dtype, device="meta")
        self._of[m] = r
        return m

    def _spoil(self, func: Any, args: tuple) -> None:
        """A write this mode could not follow: the written storages' shadows are stale."""
        for arg, a in zip(func._schema.arguments, args):
            if arg.alias_info is not None and arg.alias_info.is_write and isinstance(a, torch.Tensor) \
                    and a.device.type == "meta":
                self._stale.add(a.untyped_storage()._cdata)


_VALUE_READS = frozenset({"_local_scalar_dense", "is_nonzero", "equal", "nonzero", "nonzero_static", "unique",
                          "_unique2", "unique_consecutive", "masked_select", "repeat_interleave", "bincount",
                          "allclose", "_assert_async"})


_UNDEFINED = frozenset({torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
                        torch.ops.aten.empty_like.default, torch.ops.aten.new_empty.default,
                        torch.ops.aten.new_empty_strided.default})
"""Ops whose outputs hold no defined value: no shadow (a read of one would be the real step's
garbage, not a value)."""

_FULL_WRITES = frozenset({torch.ops.aten.fill_.Scalar, torch.ops.aten.fill_.Tensor, torch.ops.aten.zero_.default,
                          torch.ops.aten.copy_.default})
"""In-place ops that define every element of their first argument from the others."""


def _whole(t: torch.Tensor) -> bool:
    """Whether ``t`` covers its whole storage (a write to it defines every byte)."""
    return t.storage_offset() == 0 and t.is_contiguous() and \
        t.numel() * t.element_size() == t.untyped_storage().nbytes()


def _leaves(args: tuple, kwargs: dict) -> list[Any]:
    """An aten op's arguments, with lists and tuples (``Tensor[]``) opened one level."""
    out: list[Any] = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, (list, tuple)):
            out.extend(a)
        else:
            out.append(a)
    return out


def _mapped(a: Any, fn: Any) -> Any:
    """``a`` with ``fn`` applied to it, or to each element of a list or tuple argument."""
    if isinstance(a, (list, tuple)):
        return type(a)(fn(x) for x in a)
    return fn(a)


def _reads_values(func: Any) -> bool:
    """Whether ``func``'s result depends on its inputs' values (its meta kernel cannot answer)."""
    return func._schema.name.split("::")[-1] in _VALUE_READS or torch.Tag.data_dependent_output in func.tags


def _small(out: Any, limit: int) -> bool:
    tensors = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    return bool(tensors) and all(t.device.type == "meta" and t.numel() <= limit for t in tensors)

