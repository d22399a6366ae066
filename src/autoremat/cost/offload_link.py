"""Offloaded storages in the simulator: Beaumont et al.'s link model (§3) on any graph.

.. [1] O. Beaumont, L. Eyraud-Dubois, A. Shilova, "Optimal GPU-CPU Offloading Strategies for Deep
   Neural Network Training", hal-02316266, 2019.

A copy to host starts when a storage is first saved, on a link that carries one transfer at a
time in issue order; its device memory is released once the copy is complete and forward no
longer reads it. In backward the copies come back in order of need, one prefetch ahead, memory
reserved when a prefetch starts; a prefetch still running when its first user's backward
starts stalls the step. :func:`.simulator.simulate` drives it.
"""

from __future__ import annotations

from .ledger import StepState

__all__ = ["Link", "Offload"]


class Link:
    """The host<->device link: one transfer at a time, in issue order (Beaumont et al. §3)."""

    def __init__(self, bytes_per_s: float) -> None:
        self.rate = float(bytes_per_s)
        self.free_at = 0.0

    def transfer(self, nbytes: int, not_before: float) -> tuple[float, float]:
        start = max(self.free_at, not_before)
        end = start + nbytes / self.rate
        self.free_at = end
        return start, end


class Offload:
    """Offloaded storages: copied to host after their first save (device memory released once
    the copy is complete and forward no longer needs them), prefetched back during backward in
    order of need, one ahead (memory reserved when a prefetch starts). A prefetch that is not
    complete when its first user's backward starts stalls the step."""

    def __init__(self, s: StepState, targets: set[int], link: Link) -> None:
        self.s, self.g, self.targets, self.link = s, s.g, targets, link
        self.clock = 0.0
        self.stall_s = 0.0
        self.offloaded_bytes = 0
        self.savers: dict[int, list[int]] = {}
        self.copied_at: dict[int, float] = {}
        self.pending: list[tuple[float, int]] = []
        self.order: list[int] = []
        self.ready_at: dict[int, float] = {}

    def pack(self, r: int, saver: int) -> None:
        self.savers.setdefault(r, []).append(saver)
        if r in self.copied_at:
            return
        nbytes = self.g.node(r)["alloc_bytes"]
        _start, end = self.link.transfer(nbytes, self.clock)
        self.copied_at[r] = end
        self.offloaded_bytes += nbytes
        self.s.addref(("o", r), ("xfer", r))
        self.pending.append((end, r))

    def advance(self) -> None:
        """Release the device copy of every offload that has completed by now."""
        if not self.pending:
            return
        keep = []
        for end, r in self.pending:
            if end <= self.clock:
                self.s.decref(("o", r), ("xfer", r))
            else:
                keep.append((end, r))
        self.pending = keep

    def start_backward(self) -> None:
        # the first needed is the one whose last saver runs latest
        self.order = sorted(self.savers, key=lambda r: -max(self.savers[r]))
        self._prefetch_next()

    def _prefetch_next(self) -> None:
        for r in self.order:
            if r not in self.ready_at:
                self._prefetch(r)
                return

    def _prefetch(self, r: int) -> None:
        nbytes = self.g.node(r)["alloc_bytes"]
        _start, end = self.link.transfer(nbytes, max(self.clock, self.copied_at[r]))
        self.ready_at[r] = end
        key = ("pf", r)
        self.s.alloc(key, nbytes)
        for w in self.savers[r]:
            self.s.addref(key, ("s", w))
        self.s.touch(0, "prefetch", r)

    def need(self, r: int) -> None:
        if r not in self.ready_at:
            self._prefetch(r)
        if self.ready_at[r] > self.clock:
            self.stall_s += self.ready_at[r] - self.clock
            self.clock = self.ready_at[r]
        if self.order and self.order[0] == r:
            self.order.pop(0)
        elif r in self.order:
            self.order.remove(r)
        self._prefetch_next()
