"""Offloaded storages in the simulator: Beaumont et al.'s link model (§3) on any graph.

.. [1] O. Beaumont, L. Eyraud-Dubois, A. Shilova, "Optimal GPU-CPU Offloading Strategies for Deep
   Neural Network Training", hal-02316266, 2019.

An offloaded storage is one the plan keeps for backward (``Plan.offload``) that lives in host
memory between its last forward use and its first backward use. Its *holders* are what keeps it
for backward: each node outside a recomputed segment that saves it (``("s", w)``) and each
recomputed segment that takes it as an input (``("seg", i)``: a checkpoint region keeps its
inputs; an "offloaded checkpoint").

* **Copy out**: when the first holder takes the storage (the first save, or the forward of the
  first region taking it), a copy to host is issued on the device-to-host link. Each direction
  has its own link carrying one transfer at a time in issue order at ``B`` bytes per second
  (the paper's assumption (A) per copy engine; the runtime has one copy stream per direction).
  The device memory is released once the copy is complete and forward no longer reads the
  storage (assumption (D)).
* **Forward waits**: the plan may make the forward wait, before a node, for a copy to complete
  (``Plan.offload_waits``: node -> offloaded node), so that its memory is free before the node
  allocates; the wait is a stall. With ``wait_limit`` the model derives such waits itself: before
  a node whose allocations would lift the live bytes above the limit, it waits for the fewest
  pending copies (in issue order) whose completion frees enough (Beaumont's no-wait schedule
  for a memory limit); :attr:`Offload.waits` records them, and a plan carrying them simulates
  the same.
* **Backward**: storages are needed in order of their *first backward use* (the holder that
  runs last in forward: a saver's backward, or the replay of a region, which starts when
  backward reaches the region's last saving node). The first ``depth`` (the plan's
  ``offload_prefetch_depth``, default 1) are prefetched when backward starts; each time one is
  first needed, the next in order is prefetched (``depth`` ahead), memory reserved when the
  prefetch starts, on the host-to-device link once the storage's copy out is complete. A storage
  whose device copy still exists (its copy out has not completed) is not transferred: the
  holders use the device copy. A prefetch still running when its first use begins stalls the step.
  A plan's ``offload_order`` (what the runtime prefetches in) replaces the computed order.

:func:`.simulator.simulate` drives it; positions are indices in the forward's execution order.

Decisions where the paper is ambiguous or silent (its model is a chain with one ``x_i`` per
layer, §3; the runtime, :mod:`autoremat.runtime.offload`, does the same):

* *"(A) Only one transfer can occur at a time"*: read per direction. GPUs have separate copy
  engines for device-to-host and host-to-device, and the runtime uses one stream per direction, so
  a copy out and a prefetch may overlap; within a direction, copies run one at a time in issue
  order (the paper leaves the order to the schedule; here it is the order holders appear in).
* *(B)*: the paper's ``B`` is a time per byte; here ``bytes_per_s`` is its inverse, per direction.
* *When a copy out starts*: the paper's schedule may start a transfer at any time after ``x_i``
  is produced; here it starts when the first holder keeps the storage (the earliest moment the
  runtime knows it is kept for backward), and only the forward waits (explicit, or derived from
  a limit) are chosen.
* *(D) release*: the device copy is released once the copy is complete **and** forward no longer
  reads it (on a DAG a kept tensor may still have forward consumers; the paper's ``x_i`` has one).
* *What may be offloaded*: the paper offloads activations ``x_i`` only ("no sense to transfer
  ``y_i``"); on a DAG, any storage the plan keeps for backward, by any number of holders (one host
  copy shared by all), including the inputs of recomputed segments — the paper's conclusion names
  offloading plus recomputation as future work; :mod:`autoremat.solvers.combined` plans it.
* *When prefetches start*: the paper's schedule chooses (its no-wait schedule, Proposition 1,
  prefetches as early as memory allows); here ``depth`` storages ahead in order of first
  backward use (``Plan.offload_prefetch_depth``, default 1: the first ``depth`` when backward
  starts, then one more at each first use), memory reserved when the prefetch starts (D). A
  policy the runtime can follow without a memory model, not an optimum: a deeper prefetch hides
  more behind compute at more memory; the solvers choose the depth per plan.
* *Partial transfers* (the paper's relaxed problem, Theorem 2) are not modelled: a storage moves
  whole.
* *A node's own saved tensors* (``Plan.offload_saved``, unit ``-1 - v``: :mod:`autoremat.plan_offload`)
  move as one unit of ``extra_saved_bytes``, held by the node alone: the copy out is issued when the
  node's forward ends (after the copies of what it saves that its own forward was the first to
  keep), on the same link and in the same order as every other copy; the unit is first used at
  the node's backward, before the node's other saved storages (it sorts first among units of the
  same first use), and freed when that backward ends.
* *A block captured op by op* (``Plan.offload_saved`` naming its first op, :mod:`autoremat.region_units`)
  moves as one unit of its parts (its ops' ``extra_saved_bytes`` and the storages they save that the
  block produced and does not return): the copy out is issued when the block's forward ends (its
  last node), on the same link, and the device storages are released together once it completes;
  the unit is first used at the backward of the block's last node that holds a part (first among
  what it reads). In backward each part comes back into its own buffer, held by the nodes that
  saved it and freed as they release it, as without the offload (the runtime's one device buffer
  per storage). With a free link this is the plain per-node accounting plus the prefetched parts
  (``tests/cost/test_region_units.py``).
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable

from ..graph import Graph
from ..region_units import RegionUnit, region_unit, region_units
from .ledger import StepState

__all__ = ["Link", "Offload", "block_needs"]


_BLOCK_NEED: "weakref.WeakKeyDictionary[Graph, dict[int, int]]" = weakref.WeakKeyDictionary()


def block_needs(g: Graph) -> dict[int, int]:
    """First op of each block captured op by op (:func:`~autoremat.region_units.region_units`) ->
    the most the block's forward holds above the level it starts at, in the plain step
    (:func:`~autoremat.cost.simulator.step_levels`, once per graph). The runtime can wait before a
    block's call but not inside it, so a derived wait (``wait_limit``) before a block weighs all of
    it, not its first op alone (without this, waits came one block late: a GPT-2 at 0.7x of its
    peak was planned at 0.775x). A recomputed block holds less than this: it may wait early."""
    if g not in _BLOCK_NEED:
        need: dict[int, int] = {}
        regions = region_units(g)
        if regions:
            from .simulator import step_levels

            touch = step_levels(g).fwd_touch
            for v, ru in regions.items():
                d = g.node(v)
                own = d["alloc_bytes"] * (d["alias_of"] is None) + d["extra_saved_bytes"] + d["fwd_temp_bytes"]
                most = max(t for t in (touch[w] for w in ru.nodes) if t is not None)
                need[v] = most - (touch[v] - own)  # type: ignore[operator]
        _BLOCK_NEED[g] = need
    return _BLOCK_NEED[g]


class Link:
    """One direction of the host<->device link: one transfer at a time, in issue order."""

    def __init__(self, bytes_per_s: float) -> None:
        self.rate = float(bytes_per_s)
        self.free_at = 0.0

    def transfer(self, nbytes: int, not_before: float) -> tuple[float, float]:
        start = max(self.free_at, not_before)
        end = start + nbytes / self.rate
        self.free_at = end
        return start, end


class Offload:
    """The offloaded storages of one simulated step (see the module docstring).

    ``waits``: explicit forward waits (node -> offloaded unit); ``wait_limit``: derive them
    instead, at nodes of ``wait_points``. Units are node ids (output storages, ``targets``) and
    ``-1 - v`` for the nodes ``v`` of ``units`` (their own saved tensors)."""

    def __init__(self, s: StepState, targets: set[int], bytes_per_s: float, *, waits: dict[int, int] | None = None,
                 wait_limit: int | None = None, wait_points: set[int] | None = None,
                 order: tuple[int, ...] = (), depth: int = 1, units: frozenset[int] = frozenset()) -> None:
        self.s, self.g, self.targets = s, s.g, targets
        self.regions: dict[int, RegionUnit] = {v: ru for v in units if (ru := region_unit(self.g, v)) is not None}
        """Units that are a block captured op by op (first node -> its region)."""
        self.units = frozenset(units) - set(self.regions)
        """Nodes whose own saved tensors are offloaded (``Plan.offload_saved``; unit ``-1 - v``)."""
        self.pack_at: dict[int, list[int]] = {v: [v] for v in self.units}
        """Node -> the nodes of ``units``/``regions`` whose unit is copied out after its forward."""
        self.need_at: dict[int, list[int]] = {v: [-1 - v] for v in self.units}
        """Node -> the units its backward reads first."""
        for v, ru in sorted(self.regions.items()):
            self.pack_at.setdefault(ru.last, []).append(v)
            self.need_at.setdefault(ru.first_use, []).append(-1 - v)
        self.parts: dict[int, list[tuple[Hashable, int, set[Hashable]]]] = {}
        """Region unit -> its parts: (device storage, bytes, the holders that read it in backward)."""
        self.cur: dict[Hashable, Hashable] = {}
        """A region unit's device storage -> where its holders read it once prefetched."""
        self.block_need = block_needs(self.g) if wait_limit is not None else {}
        """A block's first op -> what the block's forward adds at most (the limit's wait before a block)."""
        self.out_link, self.in_link = Link(bytes_per_s), Link(bytes_per_s)
        self.clock = 0.0
        self.stall_s = 0.0
        self.wait_s = 0.0
        self.offloaded_bytes = 0
        self.holders: dict[int, dict[Hashable, int]] = {}
        self.copied_at: dict[int, float] = {}
        self.pending: list[tuple[float, int]] = []
        self.order: list[int] = []
        self.needed: list[int] = []
        self.ready_at: dict[int, float] = {}
        self.keys: dict[int, Hashable] = {}
        self.explicit = dict(waits or {})
        self.limit = wait_limit
        self.wait_points = wait_points or set()
        self.waits: dict[int, int] = {}
        self.releases: dict[int, int] = {}
        """Forward node -> the last offloaded storage (in issue order) whose device copy is
        released just before it (its copy complete by then): where the runtime ties the release to
        the GPU's order (:func:`autoremat.solvers.finalize_plan`)."""
        self.given_order = [self.g.root(v) if v >= 0 else v for v in order]
        self.depth = max(1, int(depth))
        self.ahead = 0
        """How many storages of :attr:`order` (not yet used) are prefetched."""
        self.waiting: set[int] = set()
        """The storages of :attr:`order`, as a set."""

    def store(self, r: int) -> Hashable:
        """The ledger key of unit ``r``'s device storage: a node's output, or a node's own saved
        tensors (``r < 0``: node ``-1 - r``)."""
        return ("o", r) if r >= 0 else ("x", -1 - r)

    def device_keys(self, r: int) -> list[Hashable]:
        """The ledger keys of unit ``r``'s device storages (a region unit's parts)."""
        return [k for k, _n, _h in self.parts[r]] if r in self.parts else [self.store(r)]

    def nbytes(self, r: int) -> int:
        if r < 0 and -1 - r in self.regions:
            return self.regions[-1 - r].nbytes
        d = self.g.node(r if r >= 0 else -1 - r)
        return int(d["alloc_bytes"] if r >= 0 else d["extra_saved_bytes"])

    # ------------------------------------------------------------------ forward
    def pack(self, r: int, holder: Hashable, use: int) -> None:
        """``holder`` keeps storage ``r`` for backward, first using it at position ``use``."""
        first = r not in self.holders
        self.holders.setdefault(r, {})[holder] = use
        if not first:
            return
        nbytes = self.nbytes(r)
        _start, end = self.out_link.transfer(nbytes, self.clock)
        self.copied_at[r] = end
        self.offloaded_bytes += nbytes
        for k in self.device_keys(r):
            self.s.addref(k, ("xfer", r))
        self.pending.append((end, r))

    def pack_saved(self, v: int, pos: dict[int, int]) -> None:
        """After node ``v``'s forward (its inputs released): copy out the own saved tensors of the
        nodes of :attr:`pack_at` (``v``'s, or those of the block ``v`` ends)."""
        for w in self.pack_at[v]:
            ru = self.regions.get(w)
            if ru is None:
                self.pack(-1 - w, ("s", w), pos[w])
                continue
            parts = []
            for k in [("x", x) for x in ru.extra] + [("o", q) for q in ru.roots]:
                holders = set(self.s.refs[k]) | ({("s", k[1])} if k[0] == "x" else set())
                assert all(h[0] == "s" and h[1] in ru.nodes for h in holders), \
                    f"a part {k} of block {ru.path!r} is held by {holders} after the block; please report"
                self.s.refs[k].clear()  # the holders read the part from where the prefetch puts it
                parts.append((k, self.s.size[k], holders))
            self.parts[-1 - w] = parts
            self.pack(-1 - w, ("s", ru.first_use), pos[ru.first_use])

    def advance(self, at: int | None = None) -> None:
        """Release the device copy of every offload that has completed by now; ``at``: the forward
        node about to run, where :attr:`releases` records the last of them in issue order."""
        # One link, one copy at a time in issue order: the ends are in order, so the completed
        # copies are a prefix (the solvers simulate thousands of steps; this ran at every node).
        done = 0
        for end, r in self.pending:
            if end > self.clock:
                break
            for k in self.device_keys(r) if self.parts else (self.store(r),):
                self.s.decref(k, ("xfer", r))
            done += 1
            if at is not None:
                self.releases[at] = r  # the last in issue order covers the others
        if done:
            del self.pending[:done]

    def before_node(self, v: int, need_bytes: int) -> None:
        """The forward waits (if the plan or the limit says so) before node ``v`` allocates
        ``need_bytes``."""
        if v in self.explicit:
            self._wait_until(self.copied_at.get(self.explicit[v], 0.0))
            return
        if v in self.block_need:  # a block captured op by op: no wait inside it, so all of it here
            need_bytes = max(need_bytes, self.block_need[v])
        if self.limit is None or v not in self.wait_points or self.s.live + need_bytes <= self.limit:
            return
        excess = self.s.live + need_bytes - self.limit
        freed, last = 0, None
        for end, r in sorted(self.pending):
            keys = [k for k in self.device_keys(r) if self.s.refs[k] == {("xfer", r)}]
            if keys:  # its completion frees these device copies
                freed += sum(self.s.size[k] for k in keys)
                last = r
                if freed >= excess:
                    break
        if last is not None:
            self.waits[v] = last
            self._wait_until(self.copied_at[last])

    def _wait_until(self, t: float) -> None:
        if t > self.clock:
            self.wait_s += t - self.clock
            self.stall_s += t - self.clock
            self.clock = t
        self.advance()

    # ------------------------------------------------------------------ backward
    def start_backward(self) -> None:
        """Order the storages by first backward use (latest holder first; or as the plan's
        ``offload_order`` says) and prefetch the first ``depth``."""
        if self.given_order:
            self.order = [r for r in self.given_order if r in self.holders]
        else:
            self.order = sorted(self.holders, key=lambda r: (-max(self.holders[r].values()), r))
        self.waiting = set(self.order)
        self._prefetch_next()

    def key(self, r: int) -> Hashable:
        """The storage the holders of ``r`` read in backward (after :meth:`need`)."""
        return self.keys[r]

    def _prefetch_next(self) -> None:
        """Start prefetches in order until ``depth`` storages not yet used are prefetched."""
        ahead = self.ahead
        for r in self.order:
            if ahead >= self.depth:
                return
            if r not in self.ready_at:
                self._prefetch(r)
                ahead += 1

    def _prefetch(self, r: int) -> None:
        if r in self.waiting:  # one more of ``order`` ahead
            self.ahead += 1
        if r in self.parts:
            self._prefetch_parts(r)
            return
        if self.store(r) in self.s.size:  # the copy out has not completed: the device copy serves
            key: Hashable = self.store(r)
            self.ready_at[r] = self.clock
        else:
            nbytes = self.nbytes(r)
            _start, end = self.in_link.transfer(nbytes, max(self.clock, self.copied_at[r]))
            self.ready_at[r] = end
            key = ("pf", r)
            self.s.alloc(key, nbytes)
        self.keys[r] = key
        for holder in self.holders[r]:
            self.s.addref(key, holder)
        self.s.touch(0, "prefetch", r if r >= 0 else -1 - r)

    def _prefetch_parts(self, r: int) -> None:
        """A region unit: one transfer, a buffer per part held by the part's holders (or the
        device storages, where the copy out has not completed)."""
        parts = self.parts[r]
        if parts and parts[0][0] in self.s.size:  # the device copies serve (released together)
            self.ready_at[r] = self.clock
            new = [k for k, _n, _h in parts]
        else:
            _start, self.ready_at[r] = self.in_link.transfer(self.nbytes(r), max(self.clock, self.copied_at[r]))
            new = [("pf", r, i) for i in range(len(parts))]
            for key, (_k, n, _h) in zip(new, parts):
                self.s.alloc(key, n)
        for key, (k, _n, holders) in zip(new, parts):
            self.cur[k] = key
            for h in holders:
                self.s.addref(key, h)
        self.keys[r] = ("pf", r)
        self.s.touch(0, "prefetch", -1 - r)

    def need(self, r: int) -> None:
        """A holder of ``r`` is about to use it: wait for its prefetch; on its first use, start
        the prefetches of the next storages in order until ``depth`` are ahead."""
        if r not in self.ready_at:
            self._prefetch(r)
        if self.ready_at[r] > self.clock:
            self.stall_s += self.ready_at[r] - self.clock
            self.clock = self.ready_at[r]
        if r in self.waiting:  # its first use: start the next prefetch
            self.order.remove(r)
            self.waiting.discard(r)
            self.ahead -= 1
            self.needed.append(r)
            self._prefetch_next()
