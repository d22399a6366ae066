"""The offload runtime: storages the plan offloads live in pinned host memory between their last
forward use and their first backward use (the model: :mod:`autoremat.cost.offload_link`).

Built on ``torch.autograd.graph.saved_tensors_hooks``. Outputs of the plan's offloaded nodes are
*marked* as they are produced; a marked storage has two kinds of holders, and both take the host
path:

* a save by autograd (a node outside the recomputed regions keeps the tensor for backward), in
  the pack hook;
* a recomputed region that takes the tensor as an input (an *offloaded checkpoint*): the region
  keeps its inputs for its replay through :meth:`Offloader.hold_input` instead of a plain
  reference (:mod:`autoremat.runtime.region`).

On CUDA the first holder copies the whole storage to a pinned host buffer on the device-to-host
stream right away (after an event on the compute stream, so the copy sees the finished value); the
device storage is held only until that copy has completed (events are polled on every save, mark,
wait and unpack), then released to the caching allocator; every holder of one storage shares one
host copy. Where the plan says so (``Plan.offload_waits``), the compute stream waits for a copy
before a node runs and the device storages copied up to it are released right away: the plans'
waits include every point where the simulator releases a copy (``release_waits``), so the memory is
free at the simulator's point in the GPU's order, not when the CPU, which may run far ahead,
happens to see the copy complete. In backward the storages come back in the plan's order of first
backward use (``Plan.offload_order``): the first ``Plan.offload_prefetch_depth`` prefetches
(default 1) start when backward starts (a gradient hook on the forward's outputs), and each first
use of a storage starts the prefetch of the next one, on the host-to-device stream into a buffer
from the compute stream's pool; the compute stream waits on the copy's event; the buffer is dropped
(with the host copy) when autograd and the regions have freed the storage's last holder. A storage
whose copy out has not been released yet is used from the device, not transferred. A recomputed
region brings its offloaded inputs back in node order (the simulator's order), not argument order.

A node often saves its own output (ReLU, sigmoid, softmax...) before it returns and can be marked.
So the generated forward opens a *window* (:meth:`Offloader.begin_node`) just before an offloaded
node runs: saves made inside it are packed into a small pending holder, and :meth:`Offloader.mark`
moves those of the output's storage onto the host path like any later save.

On a CPU-only machine there is no separate host memory: the same path runs as exact bookkeeping (no
copies): marks, holders, waits, the order of prefetches and of first use, and bytes are recorded in
:class:`OffloadStats`, tensors are returned as they were. With ``Offloader.host_tier`` set, a CPU
run instead behaves as a device whose copies complete at once (copies the storage counters do not
see, originals released, copies back on prefetch), so that a
:class:`~autoremat.measure.LiveStorageCounter` measures what the simulator predicts at an unbounded
bandwidth. Gradients are identical either way.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["Offloader", "OffloadStats", "OffloadMark", "OffloadBegin", "OffloadWait", "HostInput",
           "active_offloader"]

_ACTIVE = threading.local()
"""``offloader``: the :class:`Offloader` whose hooks are active in this thread (else unset/None)."""


def active_offloader() -> "Offloader | None":
    """The offloader of the patched forward running in this thread, if any."""
    return getattr(_ACTIVE, "offloader", None)


@dataclass
class OffloadStats:
    """What the offloader did in the last step."""

    packed_bytes: int = 0
    """Bytes of distinct storages sent to the host (or that would be, on a CPU)."""
    packed_nodes: list[int] = field(default_factory=list)
    """Graph nodes whose storage was offloaded, in order of their first holder."""
    fetched_nodes: list[int] = field(default_factory=list)
    """The same nodes in the order backward first used them."""
    prefetched_nodes: list[int] = field(default_factory=list)
    """The nodes whose prefetch was started ahead of their use, in the order started."""
    prefetched_ahead: int = 0
    """First uses whose storage had been prefetched ahead."""
    saves: int = 0
    """Saved tensors routed to the host copies (several may share one storage)."""
    region_inputs: int = 0
    """Inputs of recomputed regions kept on the host path (offloaded checkpoints)."""
    waits: list[tuple[int, int]] = field(default_factory=list)
    """``(node the forward waited before, offloaded unit waited for)``, in order."""
    unit_bytes: dict[int, int] = field(default_factory=dict)
    """Node -> bytes of its own saved tensors sent to the host as one unit (``Plan.offload_saved``)."""
    unit_left_bytes: dict[int, int] = field(default_factory=dict)
    """Node -> bytes its call saved that stay out of its unit: parameters, inputs, outputs (what
    ``save_on_cpu`` would copy too; :mod:`autoremat.runtime.offload_saved`)."""


class _Pending:
    """A save made while an offloaded node runs, before its output could be marked."""

    __slots__ = ("tensor", "packed")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.packed: Any = None


class _Handle:
    __slots__ = ("node", "nbytes", "device", "host", "device_ref", "copy_done", "fetched", "ready", "used",
                 "tick", "storage", "holders", "prefetched", "__weakref__")

    def __init__(self, node: int, nbytes: int, device: torch.device, storage: Any) -> None:
        self.node = node
        # the storage this handle is for: a key (``_cdata``, an address) outlives its storage and
        # may be handed to a new one once the device copy is released (CUDA's caching allocator)
        self.storage = weakref.ref(storage)
        self.nbytes = nbytes
        self.device = device
        self.host: torch.Tensor | None = None
        self.device_ref: torch.Tensor | None = None  # flat uint8 view of the device storage, until copied
        self.copy_done: Any = None
        self.fetched: torch.Tensor | None = None  # the device buffer holders read in backward
        self.ready: Any = None
        self.used = False
        self.tick = 0  # when its last holder was registered (the order without Plan.offload_order)
        self.holders = 0  # live packed holders: when the last is gone, both copies are dropped
        self.prefetched = False

    def spans(self) -> list[tuple[int, int]]:  # (offset, bytes) in the host copy of each prefetch buffer
        return [(0, self.nbytes)]

    def fetched_from(self, bufs: list[torch.Tensor]) -> Any:  # what holders unpack from: the storage
        return bufs[0]


class _Packed:
    """One holder's packed form of a tensor in an offloaded storage. When autograd (or a region)
    frees the last holder of a storage, its fetched device copy and host copy are dropped: the
    simulator frees the prefetched copy after its last holder's backward."""

    __slots__ = ("handle", "dtype", "size", "stride", "offset", "tensor")

    def __init__(self, h: _Handle, t: torch.Tensor, keep: bool) -> None:
        self.handle = h
        self.dtype, self.size, self.stride, self.offset = t.dtype, tuple(t.size()), tuple(t.stride()), t.storage_offset()
        self.tensor = t if keep else None  # CPU bookkeeping: the tensor itself
        h.holders += 1

    def view(self, fetched: torch.Tensor) -> torch.Tensor:
        """The saved tensor, over the storage backward reads (``fetched``)."""
        return torch.empty(0, dtype=self.dtype, device=self.handle.device).set_(
            fetched.untyped_storage(), self.offset, self.size, self.stride)

    def __del__(self) -> None:
        h = self.handle
        h.holders -= 1
        if h.holders == 0 and h.used:
            h.fetched = h.host = h.device_ref = None


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 tensor over the whole storage of ``t``."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


class HostInput:
    """An input of a recomputed region kept on the host path (see :meth:`Offloader.hold_input`);
    :meth:`unpack` brings it back for the region's replay."""

    __slots__ = ("offloader", "packed", "version", "tensor", "requires_grad")

    def __init__(self, offloader: "Offloader", packed: "_Packed", t: torch.Tensor) -> None:
        self.offloader = offloader
        self.packed = packed
        self.version = t._version
        self.requires_grad = t.requires_grad  # a copy back from the host does not carry it
        self.tensor = packed.tensor  # CPU bookkeeping: no copy, the version stays checkable

    @property
    def node(self) -> int:
        """The offloaded node whose storage this input lives in."""
        return self.packed.handle.node

    def unpack(self) -> torch.Tensor:
        if self.tensor is not None and self.tensor._version != self.version:
            raise RuntimeError(
                f"autoremat: an input of a recomputed region ({tuple(self.tensor.shape)} {self.tensor.dtype}) was "
                f"modified in place after the region ran (version {self.tensor._version}, expected {self.version}); "
                "change a clone of it instead (x = x.clone() before the in-place op)")
        return self.offloader._unpack(self.packed)


class Offloader:
    """Pack/unpack hooks and region-input holders for one patched model (see the module docstring).

    ``order``: the offloaded nodes in order of first backward use (``Plan.offload_order``);
    ``depth``: how many are prefetched ahead of their first use (``Plan.offload_prefetch_depth``)."""

    def __init__(self, order: Sequence[int] = (), waits: Mapping[int, int] | None = None, *, depth: int = 1) -> None:
        self.stats = OffloadStats()
        self.depth = max(1, int(depth))
        self.rank = {v: i for i, v in enumerate(order)}
        self.waits = dict(waits or {})
        self._marked: dict[int, tuple[int, weakref.ref]] = {}
        self._handles: dict[int, _Handle] = {}  # by storage key: the handle of the storage now there
        self._all: list[_Handle] = []  # every handle of the step (a key may be reused after a release)
        self._by_node: dict[int, _Handle] = {}
        self._streams: dict[str, Any] = {}
        self._pending: list[_Pending] | None = None  # open while an offloaded node runs
        self._tick = 0
        self._backward_started = False
        self.steps = 0
        """Training forwards begun (:meth:`begin_step`): a step's serial number."""
        self.host_tier = False
        """CPU only: keep offloaded storages in copies the memory counters do not see
        (:class:`~autoremat.measure.LiveStorageCounter` counts the device), release the originals,
        and copy them back when prefetched — the CUDA path's memory behaviour with copies that
        complete at once, so that a CPU run measures what the simulator predicts at an unbounded
        bandwidth. Off by default (bookkeeping only)."""

    # ------------------------------------------------------------------ forward
    def begin_step(self) -> None:
        self.steps += 1
        self._marked.clear()
        self._handles.clear()
        self._all.clear()
        self._by_node.clear()
        self._pending = None
        self._tick = 0
        self._backward_started = False
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
                self.stats.saves += 1
                holder.packed = self._offload(t, st._cdata, node)
                holder.tensor = None  # the host path holds the device storage only until copied
        self._poll()
        return value

    def wait(self, before: int) -> None:
        """The forward waits, before node ``before``, for the copy the plan names (``offload_waits``)."""
        h = self._by_node.get(self.waits[before])
        if h is None:
            return
        self.stats.waits.append((before, h.node))
        if h.copy_done is not None and h.device_ref is not None:
            torch.cuda.current_stream(h.device).wait_event(h.copy_done)
            # Later work on the compute stream runs after the copy, and after every copy issued
            # before it (one copy stream, in issue order): their device copies go now, in the
            # GPU's order, where a poll would wait for the CPU to see them complete.
            for other in self._all:
                if other.copy_done is not None and other.device_ref is not None and other.fetched is None:
                    other.device_ref = None
                if other is h:
                    break
        self._poll()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        outer = active_offloader()
        _ACTIVE.offloader = self
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            _ACTIVE.offloader = outer

    def owner_of(self, t: torch.Tensor) -> int | None:
        """The offloaded node whose storage ``t`` lives in (marked this step), else ``None``."""
        entry = self._marked.get(t.untyped_storage()._cdata)
        if entry is None or entry[1]() is not t.untyped_storage():
            return None
        return entry[0]

    def _pack(self, t: torch.Tensor) -> Any:
        t = t.detach()  # held as it is, a tensor an op saves of its own output (exp) holds that op's autograd
        # node: a cycle only backward breaks, so a graph no gradient reaches would never be freed (a leak a step)
        node = self.owner_of(t)
        if node is None:
            if self._pending is None:
                return t
            holder = _Pending(t)
            self._pending.append(holder)
            return holder
        self.stats.saves += 1
        return self._offload(t, t.untyped_storage()._cdata, node)

    def hold_input(self, t: torch.Tensor) -> HostInput | None:
        """A recomputed region's holder of its input ``t`` on the host path, when ``t``'s storage
        is offloaded (else ``None``: the region keeps ``t`` itself)."""
        node = self.owner_of(t)
        if node is None:
            return None
        self.stats.region_inputs += 1
        return HostInput(self, self._offload(t, t.untyped_storage()._cdata, node), t)

    def end_region(self, held: Sequence[HostInput]) -> None:
        """A region that holds ``held`` has finished its forward: its replay is among the first
        uses in backward of what runs before it (the order without ``offload_order``)."""
        self._tick += 1
        for h in held:
            h.packed.handle.tick = self._tick

    def _offload(self, t: torch.Tensor, key: int, node: int) -> "_Packed":
        """The packed form of a holder of ``t``, whose storage (``key``) goes to the host."""
        self._poll()
        self._tick += 1
        st = t.untyped_storage()
        h = self._handles.get(key)
        if h is None or h.storage() is not st:  # a new storage at a released one's address (CUDA)
            h = _Handle(node, st.nbytes(), t.device, st)
            self._handles[key] = h
            self.adopt(h, h.nbytes)
            if t.device.type == "cuda":
                self.copy_out(h, [_flat(t)], [0])
            elif self.host_tier:
                # the host tier is not the device's memory: a copy made by numpy is not an op the
                # storage counters (dispatch modes) see; its copy back (prefetch) is
                h.host = torch.from_numpy(_flat(t).numpy().copy())
            else:
                h.fetched = t  # CPU: bookkeeping only
        h.tick = self._tick
        return _Packed(h, t, keep=t.device.type != "cuda" and not self.host_tier)

    def _stream(self, direction: str, device: torch.device) -> Any:
        if direction not in self._streams:
            self._streams[direction] = torch.cuda.Stream(device)
        return self._streams[direction]

    def adopt(self, h: _Handle, packed_bytes: int) -> None:
        """Count ``h`` among the step's offloaded storages (``packed_bytes`` of them)."""
        self._all.append(h)
        self._by_node[h.node] = h
        self.stats.packed_bytes += packed_bytes
        self.stats.packed_nodes.append(h.node)

    def copy_out(self, h: _Handle, parts: Sequence[torch.Tensor], bases: Sequence[int]) -> None:
        """``parts`` (flat uint8 device views) into a pinned host buffer at ``bases``, on the device-to-host
        stream after the compute work so far; they are held (``h.device_ref``) until it completes."""
        stream = self._stream("out", h.device)
        produced = torch.cuda.Event()
        produced.record(torch.cuda.current_stream(h.device))
        h.host = torch.empty(h.nbytes, dtype=torch.uint8, pin_memory=True)
        with torch.cuda.stream(stream):
            stream.wait_event(produced)
            for p, b in zip(parts, bases):
                h.host[b:b + p.numel()].copy_(p, non_blocking=True)
            h.copy_done = torch.cuda.Event()
            h.copy_done.record(stream)
        h.device_ref = h.fetched_from(list(parts))  # as a prefetch would give them: the storage(s)

    def _poll(self) -> None:
        for h in self._all:
            if h.device_ref is not None and h.fetched is None and h.copy_done is not None and h.copy_done.query():
                h.device_ref = None

    # ------------------------------------------------------------------ backward
    def start_backward(self) -> None:
        """Backward has started: prefetch the first ``depth`` storages in order of use (once per step)."""
        if not self._backward_started:
            self._backward_started = True
            self._prefetch_next(None)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _Pending):
            packed = packed.tensor if packed.packed is None else packed.packed
        if isinstance(packed, torch.Tensor):
            return packed
        h = packed.handle
        self._poll()
        if packed.tensor is not None:
            self._note_use(h)
            return packed.tensor
        flat = self._fetch(h)
        self._note_use(h)
        return packed.view(flat)

    def _note_use(self, h: _Handle) -> None:
        if h.used:
            return
        h.used = True
        self._backward_started = True
        self.stats.fetched_nodes.append(h.node)
        self.stats.prefetched_ahead += int(h.prefetched)
        self._prefetch_next(h)

    def _prefetch_next(self, current: _Handle | None) -> None:
        """Start prefetches of the next storages in order of first backward use until ``depth``
        storages not yet used are prefetched."""
        ahead = sum(1 for h in self._all if not h.used and h is not current and h.prefetched)
        while ahead < self.depth:
            waiting = [h for h in self._all if not h.used and h is not current and not h.prefetched]
            if not waiting:
                return
            if self.rank:
                nxt = min(waiting, key=lambda h: self.rank.get(h.node, len(self.rank)))
            else:
                nxt = max(waiting, key=lambda h: h.tick)
            self.stats.prefetched_nodes.append(nxt.node)
            nxt.prefetched = True
            ahead += 1
            if nxt.device.type == "cuda" or self.host_tier:
                self._start_fetch(nxt)

    def _start_fetch(self, h: _Handle) -> None:
        if h.fetched is not None:
            return
        if h.device_ref is not None:  # the copy out has not been released: the device copy serves
            h.fetched = h.device_ref
            return
        assert h.host is not None, "offload handle without a host copy, please report"
        spans = h.spans()  # one storage, or a unit's (autoremat.runtime.offload_saved)
        if h.device.type != "cuda":  # the CPU's host tier (``host_tier``): a synchronous copy back
            h.fetched = h.fetched_from([h.host[b:b + n].clone() for b, n in spans])
            return
        stream = self._stream("in", h.device)
        # Buffers from the compute stream's pool (the allocator reuses a block only on its own stream: ones
        # made on the copy stream left 112 MiB of a 708 MiB cap unusable on an H200); the copy waits for the
        # compute work so far (it may free the block), recorded on the copy stream until the copy is done.
        compute = torch.cuda.current_stream(h.device)
        bufs = [torch.empty(n, dtype=torch.uint8, device=h.device) for _, n in spans]
        stream.wait_stream(compute)
        with torch.cuda.stream(stream):
            stream.wait_event(h.copy_done)
            for buf, (b, n) in zip(bufs, spans):
                buf.copy_(h.host[b:b + n], non_blocking=True)
            h.ready = torch.cuda.Event()
            h.ready.record(stream)
        for buf in bufs:
            buf.record_stream(stream)
        h.fetched = h.fetched_from(bufs)

    def _fetch(self, h: _Handle) -> torch.Tensor:
        self._start_fetch(h)
        if h.device.type != "cuda":
            assert h.fetched is not None, "please report"
            return h.fetched
        current = torch.cuda.current_stream(h.device)
        if h.ready is not None:
            current.wait_event(h.ready)
        assert h.fetched is not None, "please report"
        if isinstance(h.fetched, torch.Tensor):  # (a unit's device storages: made on this stream)
            h.fetched.record_stream(current)
        return h.fetched


class OffloadBegin(nn.Module):
    """Opens an offloaded node's window (inserted in the generated forward just before it)."""

    def __init__(self, offloader: Offloader, node: int) -> None:
        super().__init__()
        self._offloader = offloader
        self.node = node

    def forward(self) -> None:
        self._offloader.begin_node(self.node)


class OffloadMark(OffloadBegin):
    """Marks a node's output for the offloader (inserted in the generated forward)."""

    def forward(self, x: Any) -> Any:  # type: ignore[override]
        return self._offloader.mark(x, self.node)


class OffloadWait(OffloadBegin):
    """The forward's wait for a copy to host before a node (``Plan.offload_waits``)."""

    def forward(self) -> None:
        self._offloader.wait(self.node)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []
