"""Buffers and tensor attributes in a generated forward are read from their module at every call.

``torch.fx`` (with buffers proxied, see :mod:`autoremat.capture._tracing`) records a buffer
read as a ``get_attr`` node; a ``GraphModule`` built from it would hold the buffer *tensor*
found at build time. ``module.to()``/``.double()`` replace buffer tensors, and a recomputed region
swaps a module's buffers for copies (:class:`~autoremat.runtime.checkpoint_region.CheckpointRegion`), so
the generated modules instead read ``owner._buffers[name]`` at run time (:func:`read_buffer`):
a buffer read stays a read of the model's current buffer. The same holds for a plain tensor
attribute of a module (``self.mask = torch.ones(n)``, not a buffer), which fx also records as a
``get_attr``: a user who assigns another tensor to it gets the new one read
(:func:`read_attribute`; the guard, :mod:`autoremat.runtime.guard`, re-traces when it stops being
a tensor).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch import nn

__all__ = ["read_buffer", "read_attribute", "buffer_slot", "dynamic_buffer_reads"]


def read_buffer(owner: nn.Module, name: str) -> torch.Tensor:
    """``owner``'s buffer ``name`` as it is now."""
    return owner._buffers[name]  # type: ignore[return-value]


def read_attribute(owner: nn.Module, name: str) -> torch.Tensor:
    """``owner``'s tensor attribute ``name`` (an instance attribute, not a buffer) as it is now."""
    return owner.__dict__[name]  # type: ignore[no-any-return]


def _attribute_slot(root: nn.Module, target: str) -> tuple[nn.Module, str] | None:
    path, _, name = target.rpartition(".")
    try:
        owner = root.get_submodule(path) if path else root
    except AttributeError:
        return None
    return (owner, name) if isinstance(owner.__dict__.get(name), torch.Tensor) else None


def buffer_slot(root: nn.Module, target: str) -> tuple[nn.Module, str] | None:
    """``(owning module, buffer name)`` when ``target`` (a dotted ``get_attr`` target of ``root``)
    names a buffer, else ``None``."""
    path, _, name = target.rpartition(".")
    try:
        owner = root.get_submodule(path) if path else root
    except AttributeError:
        return None
    return (owner, name) if name in owner._buffers else None


def dynamic_buffer_reads(root: nn.Module, graph: torch.fx.Graph, attrs: dict[str, Any]) -> None:
    """Rewrite every ``get_attr`` of a buffer of ``root`` in ``graph`` into ``read_buffer(owner,
    name)``, and of a tensor attribute into ``read_attribute(owner, name)``; the owner module is
    put in ``attrs`` (the ``GraphModule`` root dict) under a flat name of its own."""
    owners: dict[int, str] = {}
    for n in list(graph.nodes):
        if n.op != "get_attr" or str(n.target) in attrs:
            continue
        slot = buffer_slot(root, str(n.target))
        read_fn: Any = read_buffer
        if slot is None:
            slot, read_fn = _attribute_slot(root, str(n.target)), read_attribute
        if slot is None:
            continue
        owner, name = slot
        key = owners.get(id(owner))
        if key is None:
            base = "buffers_of_" + "".join(c if c.isalnum() else "_" for c in str(n.target).rpartition(".")[0])
            key, k = base, 1
            while key in attrs:
                key, k = f"{base}_{k}", k + 1
            owners[id(owner)] = key
            attrs[key] = owner
        with graph.inserting_before(n):
            ref = graph.get_attr(key)
            read = graph.call_function(read_fn, (ref, name))
        n.replace_all_uses_with(read)
        graph.erase_node(n)
