"""Storages, their sizes and who holds them: the bookkeeping of :func:`autoremat.cost.simulate`.

A storage is freed when its last holder lets go. The simulator's step state
(:class:`StepState`) adds the peak, the memory timeline, the gradient buffers and the parameter
gradients allocated so far; the offload model (:mod:`.offload_link`) and the replay of
recomputed segments act on it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from ..graph import Graph

__all__ = ["StorageLedger", "StepState", "PEAK_PLACES"]

PEAK_PLACES = {
    "fwd": "forward of node {v} ({name})",
    "recompute": "recompute of node {v} ({name})",
    "bwd": "backward of node {v} ({name})",
    "prefetch": "prefetch of node {v}",
    "loss fwd": "loss forward",
    "loss bwd": "loss backward",
}
"""How :attr:`Simulation.peak_at` names the event at which the peak occurs."""


class StorageLedger:
    """Storages, their sizes and who holds them; a storage is freed when its last holder lets go."""

    def __init__(self) -> None:
        self.size: dict[Hashable, int] = {}
        self.refs: dict[Hashable, set[Hashable]] = {}
        self.live = 0
        self._gid = 0

    def alloc(self, key: Hashable, nbytes: int) -> None:
        assert key not in self.size, f"storage {key} allocated twice, please report"
        self.size[key] = int(nbytes)
        self.refs[key] = set()
        self.live += int(nbytes)

    def free(self, key: Hashable) -> None:
        self.live -= self.size.pop(key)
        del self.refs[key]

    def addref(self, key: Hashable, holder: Hashable) -> None:
        self.refs[key].add(holder)

    def decref(self, key: Hashable, holder: Hashable) -> None:
        refs = self.refs.get(key)
        if refs is None:
            return
        refs.discard(holder)
        if not refs:
            self.free(key)

    def maybe_free(self, key: Hashable) -> None:
        if key in self.refs and not self.refs[key]:
            self.free(key)

    def new_grad(self, nbytes: int) -> Hashable:
        self._gid += 1
        key = ("g", self._gid)
        self.alloc(key, nbytes)
        return key


class StepState(StorageLedger):
    """The simulator's state during one step: the ledger plus the peak, where it occurred, the
    timeline, each node's gradient buffer and the parameter gradients allocated so far.

    ``levels`` (when given, ``{phase: {node: level}}``) receives the live level plus the
    transient at every event :meth:`touch` sees, and (phase ``"after bwd"``) the live level and
    the parameter-gradient bytes once each node's backward is over: what
    :func:`.simulator.step_levels` reports.
    """

    def __init__(self, graph: Graph, record: bool, levels: dict[str, dict[int, int]] | None = None) -> None:
        super().__init__()
        self.g = graph
        self.record = record
        self.levels = levels
        self.peak = 0
        self._peak_at: tuple[str, int] | None = None
        self.timeline: list[tuple[str, int, int]] = []
        self.grad: dict[int, Hashable] = {}
        self.pgrad: set[str] = set()
        self.pgrad_bytes = 0
        self.parts: dict[int, list[tuple[Hashable, Hashable]]] = {}
        """Node -> the gradients of its parts handed on so far (``grad_part``): ``(key, holder)``."""
        self.viewed: set[int] = set()
        """Nodes whose gradient is still the first one, a view (``first_grad_view``): the next is summed
        out of place (:mod:`.grad_handoff`)."""

    def touch(self, extra: int, phase: str, v: int = -1) -> None:
        """The live level plus ``extra`` bytes of transients at ``phase`` (a key of
        :data:`PEAK_PLACES`) of node ``v``: a new peak when higher than any before."""
        level = self.live + extra
        if self.levels is not None:
            self.levels[phase][v] = level
        if level > self.peak:
            self.peak = level
            self._peak_at = (phase, v)

    def keep(self, key: Hashable, v: int, extra: int) -> None:
        """Forward of node ``v``, kept in a recomputed segment (``Segment.keep``): its output storage
        ``key`` and its ``extra`` saved bytes (the op's other outputs: a layer norm's statistics,
        which selective checkpointing stores with it) are held from now."""
        self.addref(key, ("keep", v))
        if extra:
            self.alloc(("kx", v), extra)

    def replay_extras(self, v: int, extra: int) -> None:
        """A replay reaches node ``v``, which requires grad: its ``extra`` saved bytes are held for its
        backward (for a kept node, the ones stored in forward)."""
        if extra:
            self.alloc(("rx", v), extra)
            if ("kx", v) in self.size:
                self.free(("kx", v))

    def let_go(self, key: Hashable, v: int) -> None:
        """The replay no longer needs kept node ``v``'s stored output ``key`` (nor extras not handed on)."""
        self.decref(key, ("keep", v))
        if ("kx", v) in self.size:
            self.free(("kx", v))

    def give_part(self, u: int, nbytes: int, v: int) -> None:
        """Node ``v``'s backward hands node ``u`` the gradient of a part of its output (a view a
        split made, ``grad_part``): a buffer of that part's size, held until ``u``'s are joined."""
        key = self.new_grad(nbytes)
        self.addref(key, ("gp", u, v))
        self.parts.setdefault(u, []).append((key, ("gp", u, v)))

    def join_parts(self, u: int, nbytes: int) -> None:
        """Before node ``u``'s backward: the split's backward joins its parts' gradients into one of
        ``nbytes`` (added into ``u``'s gradient where it has one already), then lets them go."""
        parts = self.parts.pop(u, None)
        if parts is None:
            return
        old = self.grad.get(u)
        key = self.new_grad(nbytes)  # the join (and, with ``old``, the sum: added in place)
        self.addref(key, ("gb", u))
        self.grad[u] = key
        for k, holder in parts:
            self.decref(k, holder)
        if old is not None:
            self.decref(old, ("gb", u))
        self.viewed.discard(u)

    def workspace(self, d: dict[str, Any], key_of: Callable[[int], Hashable | None]) -> int:
        """A node's forward workspace here (``d``: its attributes): ``fwd_temp_bytes`` less those of
        its ``lingering`` bytes whose maker's storage (``key_of(maker)``) this state holds otherwise,
        counted already, or that have no key (``None``: a replay that does not make the maker again,
        so the frame that held it is gone); :mod:`autoremat.capture.lingering`."""
        if not d["lingering"]:
            return d["fwd_temp_bytes"]
        drop = 0
        for u, nbytes in d["lingering"]:
            key = key_of(u)
            if key is None or key in self.size:
                drop += nbytes
        return max(0, d["fwd_temp_bytes"] - drop)

    @property
    def peak_at(self) -> str:
        if self._peak_at is None:
            return "start"
        phase, v = self._peak_at
        name = self.g.node(v)["name"] if v >= 0 else ""
        return PEAK_PLACES[phase].format(v=v, name=name)

    def mark(self, phase: str, v: int) -> None:
        if self.record:
            self.timeline.append((phase, v, self.live))
        if self.levels is not None and phase == "bwd":
            self.levels["after bwd"][v] = self.live
            self.levels["pgrad after bwd"][v] = self.pgrad_bytes
