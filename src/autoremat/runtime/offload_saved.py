"""A module call's own saved tensors in host memory, as one unit (``Plan.offload_saved``).

``torch.autograd.graph.save_on_cpu`` scoped to one module call, on the offloader's streams and in
its prefetch order (:mod:`autoremat.runtime.offload`; the model: :mod:`autoremat.cost.offload_link`,
unit ``-1 - v`` of node ``v``, :mod:`autoremat.plan_offload`).

The call runs inside a ``saved_tensors_hooks`` scope whose pack hook only collects what autograd
saves. When the call returns, each collected tensor is sorted:

* **left where it is** (handed to the offloader's own pack hook, as if no scope were open): a
  parameter or buffer of the module (or a view of one: same storage), a tensor in the call's
  arguments or its output (or a view of one). These are not the node's own saved tensors: the
  capture counts them as resident, or as node outputs (``Graph.node(v)["saves"]``), which the
  plan offloads on their own (``Plan.offload``) or keeps. ``save_on_cpu`` copies them too:
  weights every step, and a block's input once per block that saves it
  (:attr:`~autoremat.runtime.offload.OffloadStats.unit_left_bytes` counts what is not copied);
* **the unit**: everything else (the call's internal activations), each storage once. On CUDA
  they are copied, in the order saved, into one pinned host buffer on the device-to-host stream
  (after the call's work; each storage at an offset aligned to 16 bytes) and released once the
  copy has completed, like any offloaded storage; in backward the unit comes back in the plan's
  prefetch order into one device buffer per storage (reserved when the prefetch starts), each
  saved tensor unpacked as a view of its storage's buffer, and each buffer freed once autograd
  has released the last tensor saved in it (as without the offload). Where the copy out
  has not been released when backward needs the unit, the device storages serve (no transfer). On
  a CPU-only machine the unit is exact bookkeeping (tensors kept as they are), and with the host
  tier (``Offloader.host_tier``) a numpy copy the storage counters do not see, copied back when
  prefetched.

A block captured op by op (``capture(..., blocks="auto")``) is one such call: the plan names its
first op and the block's call is wrapped (:func:`block_of`), its unit being all its ops save
(:mod:`autoremat.region_units`).

Copying at the end of the call is the simulator's point (the node's forward ends). A module run
more than once per step (a weight-shared layer) offloads the calls the plan names in
``Plan.offload_calls``, each its own unit; the others, and replays in backward, run as they are
(:mod:`autoremat.runtime.offload_calls`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from ..plan import Plan
from .offload import Offloader, _flat, _Handle, _Packed, _tensors
from .offload_calls import CallTally, call_of

__all__ = ["SavedCall", "install_saved_units", "hooked_path", "block_of"]

_ALIGN = 16
"""Byte alignment of each storage in a unit's buffer (any dtype's element size divides it)."""


class _Save:
    """One tensor autograd saved inside the scope: until the call returns, the tensor; then its
    packed form (the unit's, or what the offloader's own pack hook made of it)."""

    __slots__ = ("tensor", "packed", "__weakref__")

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor: torch.Tensor | None = t
        self.packed: Any = None


class _UnitHandle(_Handle):
    """A unit: its storages' sizes and places in the host buffer; in backward one device buffer per
    storage (``fetched``: a list), each freed once autograd has released the last tensor saved in
    it, as without the offload (the capture's backward workspace is measured with the node's saved
    tensors freed one by one); the host buffer goes with the last."""

    __slots__ = ("bases", "part_bytes", "part_holders")

    def __init__(self, node: int, device: torch.device, storage: Any, bases: list[int], part_bytes: list[int],
                 total: int) -> None:
        super().__init__(node, total, device, storage)
        self.bases, self.part_bytes = bases, part_bytes
        self.part_holders = [0] * len(bases)

    def spans(self) -> list[tuple[int, int]]:
        """One device buffer per storage of the unit, from its place in the host buffer."""
        return list(zip(self.bases, self.part_bytes))

    def fetched_from(self, bufs: list[torch.Tensor]) -> Any:
        return bufs  # a list, as the device storages the copy out held (``device_ref``)


class _UnitPacked(_Packed):
    """A saved tensor of a unit: which of the unit's storages it is in."""

    __slots__ = ("part",)

    def __init__(self, h: _UnitHandle, t: torch.Tensor, keep: bool, part: int) -> None:
        super().__init__(h, t, keep)
        self.part = part
        h.part_holders[part] += 1

    def view(self, fetched: Any) -> torch.Tensor:
        return torch.empty(0, dtype=self.dtype, device=self.handle.device).set_(
            fetched[self.part].untyped_storage(), self.offset, self.size, self.stride)

    def __del__(self) -> None:
        h = self.handle
        h.part_holders[self.part] -= 1
        if h.part_holders[self.part] == 0 and h.used and isinstance(h.fetched, list):
            h.fetched[self.part] = None
        super().__del__()


def _unpack(save: _Save, offloader: Offloader) -> torch.Tensor:
    assert save.packed is not None, "a saved tensor unpacked before its module call returned; please report"
    return offloader._unpack(save.packed)


class SavedCall:
    """A module's ``forward`` whose own saved tensors are offloaded as unit ``-1 - node`` (see the
    module docstring); outside a patched training forward it runs the module as it is. ``nodes``:
    the call index -> node of each call it offloads (a module run more than once per step,
    ``Plan.offload_calls``), or ``{None: node}`` (every call, the module runs once), counted by
    ``tally`` (:mod:`autoremat.runtime.offload_calls`)."""

    def __init__(self, forward: Any, module: nn.Module, offloader: Offloader, nodes: dict[int | None, int],
                 tally: CallTally) -> None:
        self.forward, self.module, self.offloader, self.nodes, self.tally = forward, module, offloader, nodes, tally
        self.active = True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        k = self.tally.next_call() if self.active else None
        node = self.nodes.get(None, self.nodes.get(k)) if k is not None else None  # type: ignore[arg-type]
        if node is None:
            return self.forward(*args, **kwargs)
        saves: list[_Save] = []

        def pack(t: torch.Tensor) -> _Save:
            saves.append(_Save(t.detach()))  # without its history: no cycle through its autograd node (Offloader._pack)
            return saves[-1]

        with torch.autograd.graph.saved_tensors_hooks(pack, functools.partial(_unpack, offloader=self.offloader)):
            out = self.forward(*args, **kwargs)
        self._close(node, saves, (args, kwargs), out)
        # autograd keeps the pack hook (this closure) with every tensor saved in the scope: emptied,
        # it holds none of them, and each storage's buffer is freed when its own saves are released
        saves.clear()
        return out

    def _close(self, node: int, saves: Sequence[_Save], inputs: Any, out: Any) -> None:
        """Sort node ``node``'s call's saves (module docstring): the offloader's pack for what stays, then the unit."""
        off = self.offloader
        left = {t.untyped_storage()._cdata for t in (*_tensors(inputs), *_tensors(out))}
        left |= {t.untyped_storage()._cdata for t in (*self.module.parameters(), *self.module.buffers())}
        unit: list[_Save] = []
        left_bytes: dict[int, int] = {}
        # the call's device: its outputs', else its first save's; a save elsewhere (the CPU seed
        # of CUDA attention) stays as it is: the unit comes back to the call's device
        device = next((t.device for t in (*_tensors(out), *(s.tensor for s in saves)) if t is not None), None)
        for s in saves:
            t = s.tensor
            assert t is not None, "please report"
            if t.device != device:
                s.packed, s.tensor = t, None
            elif t.untyped_storage()._cdata in left or off.owner_of(t) is not None:
                left_bytes[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
                s.packed, s.tensor = off._pack(t), None
            else:
                unit.append(s)
        off.stats.unit_left_bytes[node] = off.stats.unit_left_bytes.get(node, 0) + sum(left_bytes.values())
        if unit:
            self._offload_unit(node, unit)

    def _offload_unit(self, node: int, unit: Sequence[_Save]) -> None:
        off = self.offloader
        parts: list[torch.Tensor] = []  # one flat uint8 view per distinct storage, in the order saved
        where: dict[int, tuple[int, int]] = {}  # storage key -> (part, byte offset in the buffer)
        total = 0
        for s in unit:
            st = s.tensor.untyped_storage()  # type: ignore[union-attr]
            if st._cdata not in where:
                where[st._cdata] = (len(parts), total)
                parts.append(_flat(s.tensor))  # type: ignore[arg-type]
                total += -(-st.nbytes() // _ALIGN) * _ALIGN
        first = unit[0].tensor
        assert first is not None, "please report"
        uid = -1 - node
        part_bytes = [p.numel() for p in parts]
        bases = [where[st][1] for st in sorted(where, key=lambda k: where[k][0])]
        h = _UnitHandle(uid, first.device, first.untyped_storage(), bases, part_bytes, total)
        off._tick += 1
        h.tick = off._tick
        off.adopt(h, sum(part_bytes))
        off.stats.unit_bytes[node] = off.stats.unit_bytes.get(node, 0) + sum(part_bytes)
        cuda = first.device.type == "cuda"
        if cuda:
            off.copy_out(h, parts, bases)
        elif off.host_tier:  # a copy the storage counters do not see (see Offloader.host_tier)
            host = np.zeros(total, dtype=np.uint8)
            for p, b in zip(parts, bases):
                host[b:b + p.numel()] = p.numpy()
            h.host = torch.from_numpy(host)
        keep = not cuda and not off.host_tier  # CPU bookkeeping: the tensors themselves
        for s in unit:
            t = s.tensor
            assert t is not None, "please report"
            s.packed, s.tensor = _UnitPacked(h, t, keep, where[t.untyped_storage()._cdata][0]), None
        off.stats.saves += len(unit)
        off._poll()


def block_of(name: str, mods: dict[str, nn.Module]) -> str | None:
    """The node module (a block captured op by op) whose call ran an op of module ``name`` (the
    plan's node name of an op: its module's path)."""
    path = name.partition(":")[0]
    found = [p for p in mods if path == p or path.startswith(p + ".")]
    return min(found, key=len) if found else None


def hooked_path(names: Sequence[str], v: int, mods: dict[str, nn.Module]) -> str | None:
    """The module whose call the runtime hooks for node ``v``: its own module (a module call), else
    the block whose call runs the op (:func:`block_of`); ``None`` if neither."""
    return names[v] if names[v] in mods else block_of(names[v], mods)


def install_saved_units(mods: dict[str, nn.Module], names: Sequence[str], plan: Plan, offloader: Offloader,
                        wrapped: list[tuple[nn.Module, bool, Any, Any]]) -> None:
    """Wrap the ``forward`` of each module call of ``plan.offload_saved`` in a :class:`SavedCall`
    (one per module: the calls of a module run more than once per step that the plan names in
    ``offload_calls``); ``wrapped`` records it for :func:`autoremat.restore`. A node that is an op
    of a block captured op by op (named by its module's path; the plan names the block's first op, checked
    against the graph by :func:`autoremat.plan.validate_plan`) wraps that block's call: all its
    ops save (:mod:`autoremat.region_units`)."""
    from ..errors import PlanMismatchError

    by_module: dict[str, dict[int | None, int]] = {}
    for v in plan.offload_saved:
        path = hooked_path(names, v, mods)
        if path is None:
            raise PlanMismatchError(f"plan offloads the saved tensors of {names[v]!r}, which is not a module call "
                                    "of this model nor an op of one; capture it and solve again")
        nodes = by_module.setdefault(path, {})
        k = call_of(plan, v)[0]
        if nodes and (k in nodes or (None in nodes) != (k is None)):
            raise PlanMismatchError(f"plan offloads the saved tensors of module {path!r} in one call twice, or "
                                    "both per call and as one call (offload_saved, offload_calls); solve again")
        nodes[k] = v
    for path, nodes in by_module.items():
        mod = mods[path]
        n = call_of(plan, next(iter(nodes.values())))[1]
        had = "forward" in mod.__dict__
        call = SavedCall(mod.forward, mod, offloader, nodes, CallTally(offloader, path, n))
        wrapped.append((mod, had, mod.__dict__.get("forward"), call))
        mod.__dict__["forward"] = call
