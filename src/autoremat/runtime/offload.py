"""The offload runtime: saved activations of chosen nodes live in pinned host memory between
forward and backward (Beaumont et al.'s model, see :mod:`autoremat.cost`).

Built on ``torch.autograd.graph.saved_tensors_hooks``. Outputs of the plan's offloaded nodes are
*marked* as they are produced; when autograd saves a tensor living in a marked storage:

* on CUDA, the whole storage is copied to a pinned host buffer on a side stream right away
  (after an event on the compute stream, so the copy sees the finished value); the device
  storage is held only until that copy has completed (events are polled on every save), then
  released to the caching allocator; several saves of one storage share one host copy;
* in backward, the first unpack of a storage brings it back on the side stream and makes the
  compute stream wait on it; it also starts the prefetch of the next storage in order of need
  (reverse order of saving), so transfers overlap the backward of the nodes in between; the
  prefetched buffer is ``record_stream``-ed on the compute stream.

A node often saves its own output (ReLU, sigmoid, softmax...) before it returns and can be marked.
So the generated forward opens a *window* (:meth:`Offloader.begin_node`) just before an offloaded
node runs: saves made inside it are packed into a small pending holder, and :meth:`Offloader.mark`
moves those of the output's storage onto the host path like any later save. Without that, the
producer's own save would pin the device storage until the node's backward and offloading it
would free nothing (the simulator assumes it frees the storage).

On a CPU-only machine there is no separate host memory: the same path runs as exact
bookkeeping (no copies): marks, saves, order of need and bytes are recorded in
:class:`OffloadStats`, tensors are returned as they were. Gradients are identical either way.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["Offloader", "OffloadStats", "OffloadMark", "OffloadBegin"]


@dataclass
class OffloadStats:
    """What the offloader did in the last step."""

    packed_bytes: int = 0
    """Bytes of distinct storages sent to the host (or that would be, on a CPU)."""
    packed_nodes: list[int] = field(default_factory=list)
    """Graph nodes whose storage was offloaded, in order of saving."""
    fetched_nodes: list[int] = field(default_factory=list)
    """The same nodes in the order backward needed them."""
    prefetched_ahead: int = 0
    """Fetches that had been started before they were needed."""
    saves: int = 0
    """Saved tensors routed to the host copies (several may share one storage)."""


class _Pending:
    """A save made while an offloaded node runs, before its output could be marked."""

    __slots__ = ("tensor", "packed")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.packed: Any = None


class _Handle:
    __slots__ = ("node", "nbytes", "dtype", "device", "host", "device_ref", "copy_done", "fetched", "ready",
                 "storage", "__weakref__")

    def __init__(self, node: int, nbytes: int, device: torch.device, storage: Any) -> None:
        self.node = node
        # the storage this handle is for: a key (``_cdata``, an address) outlives its storage and
        # may be handed to a new one once the device copy is released (CUDA's caching allocator)
        self.storage = weakref.ref(storage)
        self.nbytes = nbytes
        self.device = device
        self.host: torch.Tensor | None = None
        self.device_ref: torch.Tensor | None = None  # flat uint8 view of the device storage
        self.copy_done: Any = None
        self.fetched: torch.Tensor | None = None
        self.ready: Any = None


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 tensor over the whole storage of ``t``."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


class Offloader:
    """Pack/unpack hooks for one patched model (see the module docstring)."""

    def __init__(self) -> None:
        self.stats = OffloadStats()
        self._marked: dict[int, tuple[int, weakref.ref]] = {}
        self._handles: dict[int, _Handle] = {}
        self._order: list[weakref.ref] = []
        self._stream: Any = None
        self._pending: list[_Pending] | None = None  # open while an offloaded node runs

    # ------------------------------------------------------------------ forward
    def begin_step(self) -> None:
        self._marked.clear()
        self._handles.clear()
        self._order = []
        self._pending = None
        self.stats = OffloadStats()

    def begin_node(self, node: int) -> None:
        """Open the window of offloaded ``node``: its own saves wait for :meth:`mark`."""
        self._pending = []

    def mark(self, value: Any, node: int) -> Any:
        """Record that the storages of ``value``'s tensors belong to offloaded ``node``, and
        send the saves ``node`` made of them while it ran (see :meth:`begin_node`) to the host."""
        storages = {}
        for t in _tensors(value):
            st = t.untyped_storage()
            self._marked[st._cdata] = (node, weakref.ref(st))
            storages[st._cdata] = st
        pending, self._pending = self._pending, None
        for holder in pending or ():
            t = holder.tensor
            assert t is not None, "please report"
            st = t.untyped_storage()
            if storages.get(st._cdata) is st:
                holder.packed = self._offload(t, st._cdata, node)
                holder.tensor = None  # the host path holds the device storage only until copied
        return value

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def _pack(self, t: torch.Tensor) -> Any:
        st = t.untyped_storage()
        key = st._cdata
        entry = self._marked.get(key)
        if entry is None or entry[1]() is not st:
            if self._pending is None:
                return t
            holder = _Pending(t)
            self._pending.append(holder)
            return holder
        return self._offload(t, key, entry[0])

    def _offload(self, t: torch.Tensor, key: int, node: int) -> Any:
        """The packed form of a save of ``t``, whose storage (``key``) goes to the host."""
        self._poll()
        self.stats.saves += 1
        st = t.untyped_storage()
        h = self._handles.get(key)
        if h is None or h.storage() is not st:  # a new storage at a released one's address
            h = _Handle(node, st.nbytes(), t.device, st)
            self._handles[key] = h
            self._order.append(weakref.ref(h))
            self.stats.packed_bytes += h.nbytes
            self.stats.packed_nodes.append(h.node)
            if t.device.type == "cuda":
                self._copy_out(h, t)
            else:
                h.fetched = t  # CPU: bookkeeping only
        return (h, t.dtype, tuple(t.size()), tuple(t.stride()), t.storage_offset(),
                t if t.device.type != "cuda" else None)

    def _side_stream(self, device: torch.device) -> Any:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def _copy_out(self, h: _Handle, t: torch.Tensor) -> None:
        stream = self._side_stream(t.device)
        produced = torch.cuda.Event()
        produced.record(torch.cuda.current_stream(t.device))
        flat = _flat(t)
        h.host = torch.empty(h.nbytes, dtype=torch.uint8, pin_memory=True)
        with torch.cuda.stream(stream):
            stream.wait_event(produced)
            h.host.copy_(flat, non_blocking=True)
            h.copy_done = torch.cuda.Event()
            h.copy_done.record(stream)
        h.device_ref = flat  # held until the copy is complete

    def _poll(self) -> None:
        for ref in self._order:
            h = ref()
            if h is not None and h.device_ref is not None and h.copy_done is not None and h.copy_done.query():
                h.device_ref = None

    # ------------------------------------------------------------------ backward
    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _Pending):
            packed = packed.tensor if packed.packed is None else packed.packed
        if isinstance(packed, torch.Tensor):
            return packed
        h, dtype, size, stride, offset, cpu_tensor = packed
        if cpu_tensor is not None:
            self._note_fetch(h)
            return cpu_tensor
        flat = self._fetch(h)
        self._note_fetch(h)
        return torch.empty(0, dtype=dtype, device=h.device).set_(flat.untyped_storage(), offset, size, stride)

    def _note_fetch(self, h: _Handle) -> None:
        if h.node in self.stats.fetched_nodes:
            return
        self.stats.fetched_nodes.append(h.node)
        if h.ready is not None or h.device.type != "cuda":
            self.stats.prefetched_ahead += int(h.ready is not None)
        # start the next one in order of need: the latest-saved storage not fetched yet
        for ref in reversed(self._order):
            nxt = ref()
            if nxt is not None and nxt is not h and nxt.node not in self.stats.fetched_nodes and nxt.ready is None:
                if nxt.device.type == "cuda" and nxt.device_ref is None and nxt.fetched is None:
                    self._start_fetch(nxt)
                break

    def _start_fetch(self, h: _Handle) -> None:
        stream = self._side_stream(h.device)
        assert h.host is not None, "offload handle without a host copy, please report"
        with torch.cuda.stream(stream):
            stream.wait_event(h.copy_done)
            buf = torch.empty(h.nbytes, dtype=torch.uint8, device=h.device)
            buf.copy_(h.host, non_blocking=True)
            h.ready = torch.cuda.Event()
            h.ready.record(stream)
        h.fetched = buf

    def _fetch(self, h: _Handle) -> torch.Tensor:
        if h.device_ref is not None:  # the copy out has not been released yet: still on device
            return h.device_ref
        if h.fetched is None:
            self._start_fetch(h)
        current = torch.cuda.current_stream(h.device)
        current.wait_event(h.ready)
        assert h.fetched is not None, "please report"
        h.fetched.record_stream(current)
        return h.fetched


class OffloadMark(nn.Module):
    """Marks a node's output for the offloader (inserted in the generated forward)."""

    def __init__(self, offloader: Offloader, node: int) -> None:
        super().__init__()
        self._offloader = offloader
        self.node = node

    def forward(self, x: Any) -> Any:
        return self._offloader.mark(x, self.node)


class OffloadBegin(nn.Module):
    """Opens an offloaded node's window (inserted in the generated forward just before it)."""

    def __init__(self, offloader: Offloader, node: int) -> None:
        super().__init__()
        self._offloader = offloader
        self.node = node

    def forward(self) -> None:
        self._offloader.begin_node(self.node)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []
