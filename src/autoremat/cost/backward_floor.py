"""Lower bounds of an exact-model transition's need, cheaper than its replay.

The replay (:func:`.segment_replay.replay_segment`) tracks every storage with its holders; the
DP (:mod:`autoremat.solvers.kusumoto`) pays it only for transitions whose bounds fit what the
budget leaves. :class:`BackwardFloor` sweeps a recomputed segment's backward counting, in
decreasing node order, only the buffers that are certainly alive at each node's backward;
:meth:`BackwardFloor.at_stop` is the part of that level at the last holding node that set
operations give. Each term is a distinct buffer of the replay at that node, so a bound never
exceeds the replay's need (held to it in ``tests/cost/test_backward_floor.py`` on every
transition of seeded random DAGs with views, pass-through nodes and shared gradient buffers).
O(|S| + edges of S) per segment.
"""

from __future__ import annotations

from collections.abc import Sequence
from heapq import heapify, heappop, heappush

from .bitsets import GraphBits, bit_list
from .closed_form import ClosedForm
from .segment_replay import grad_floor

__all__ = ["BackwardFloor", "TransitionBounds"]


class TransitionBounds:
    """Lower bounds of the need of the exact model's transitions ``L_i -> L_j`` over a family of
    lower sets (``family[k]``: a bitset), cheapest first:

    * :attr:`keys`: ``keys[j] - keys[i]`` (the saved outputs and extras held from the end of the
      segment's replay, or forward, to its own backward) orders a set's successors and bounds
      the need from below;
    * :attr:`floor` (:meth:`move_bound`): the backward of a segment ending in ``L'`` starts
      with ``L'``'s boundary gradients and the parameter gradients of the nodes after ``L'``;
    * for a recomputed segment ``S = L' \\ L``, when its replay reaches its last saving node,
      it holds the copies of the storages of ``S`` that its own nodes save, their extras and the
      parameter gradients of the nodes after ``L'``: ``rec_hi[L'] - rec_lo[L]`` (roots of ``L``
      whose savers all lie after ``L'`` make it a bound, not an equality); plus the gradient
      buffers kept through it (:meth:`kept_grads`) and :meth:`BackwardFloor.at_stop`;
    * :meth:`tight_bound`: the sweep of :class:`BackwardFloor` (dearer; cached per pair).
    """

    def __init__(self, p: GraphBits, family: list[int]) -> None:
        self.p = p
        self.family = family
        held = [0] * p.n  # held from the end of S's replay (or forward) to its own backward
        for v in range(p.n):
            if p.rg[v]:
                held[v] = (p.alloc[v] if p.root[v] == v and v in p.saves[v] else 0) + p.extra[v]
        self.keys = [sum(held[v] for v in bit_list(m)) for m in family]
        closed = ClosedForm(p)
        pg = [closed.terms(m).pg for m in family]
        self.pg = pg
        self.floor = [grad_floor(p, m) + pg[k] for k, m in enumerate(family)]
        copy_saved = [0] * p.n  # rg nodes x that save u = x or a predecessor of x
        for x in range(p.n):
            if p.rg[x]:
                for u in p.saves[x]:
                    if u == x or u in p.pred[x]:
                        copy_saved[u] |= p.bit[x]
        copyable = [p.alias_of[v] is None and copy_saved[v] != 0 for v in range(p.n)]
        rg_extra = [p.extra[v] if p.rg[v] else 0 for v in range(p.n)]
        self.rec_hi: list[int] = []
        self.rec_lo: list[int] = []
        for k, m in enumerate(family):
            ext = sum(rg_extra[v] for v in bit_list(m))
            own = sum(p.alloc[v] for v in bit_list(m) if copyable[v] and copy_saved[v] & m)
            kept = sum(p.alloc[v] for v in bit_list(m) if copyable[v])
            self.rec_hi.append(pg[k] + ext + own)
            self.rec_lo.append(ext + kept)
        self.sweep = BackwardFloor(p)
        self._floors: dict[int, int] = {}

    def cheap_bound(self, i: int, j: int, recompute: bool) -> int:
        """The bound that needs no bookkeeping (:attr:`floor`, and ``rec_hi - rec_lo``)."""
        bound = self.floor[j]
        if recompute:
            bound = max(bound, self.rec_hi[j] - self.rec_lo[i])
        return bound

    def move_bound(self, i: int, j: int, add: int, recompute: bool) -> int:
        """The bound of a transition whose bookkeeping added ``add`` kept bytes."""
        low = add + self.floor[j]
        if recompute:  # the dangling roots it holds stay too; and the level at its last holder
            lower, upper = self.family[i], self.family[j]
            low = max(low, add + self.rec_hi[j] - self.rec_lo[i] + self._kept(lower, upper)
                      + self.sweep.at_stop(lower, upper))
        return low

    def tight_bound(self, i: int, j: int, add: int) -> int:
        """The sweep's bound of a recomputed transition: the kept bytes it adds, the gradient
        buffers kept through it, the parameter gradients of the nodes after ``L_j`` and
        :meth:`BackwardFloor.floor` (cached per pair)."""
        key = i * len(self.family) + j
        swept = self._floors.get(key)
        if swept is None:
            swept = self._floors[key] = self.sweep.floor(self.family[i], self.family[j])
        return add + self.kept_grads(i, j) + self.pg[j] + swept

    def kept_grads(self, i: int, j: int) -> int:
        """Bytes of the gradient buffers that stay alive through the whole backward of the
        segment ``L_j \\ L_i``: those of nodes of ``L_i`` read after ``L_j`` and by no node of
        the segment (no backward of the segment releases or replaces them)."""
        return self._kept(self.family[i], self.family[j])

    def _kept(self, lower: int, upper: int) -> int:
        p = self.p
        seg = upper & ~lower
        owners = {owner for u, owner in p.after(upper).grads if lower >> u & 1 and not p.succmask[u] & seg}
        return sum(p.out[o] for o in owners)


class BackwardFloor:
    """Per-node terms of the sweep, and :meth:`floor` (uncached; :class:`TransitionBounds` caches it per pair)."""

    def __init__(self, p: GraphBits) -> None:
        self.p = p
        # the backward of a node v that receives a gradient allocates (or holds as a transient)
        # its inputs' gradients unless it passes its own through, its parameters' gradients,
        # and its workspace; -1 for a node no gradient reaches
        has_grad = [False] * p.n
        for v in range(p.n - 1, -1, -1):  # node ids are topological
            has_grad[v] = bool(p.rg[v]) and (bool(p.is_out[v]) or any(has_grad[w] for w in p.succ[v]))
        self.local = [
            (p.btemp[v] + sum(b for _, b in p.params[v])
             + sum(p.part[v].get(u, p.out[u]) for u in (p.grad_new[v] if p.passthru[v] else set(p.pred[v])) if p.rg[u]))
            if has_grad[v] else -1
            for v in range(p.n)]
        # a node whose gradient buffer is its own (no pass-through reader shares it)
        self.own_grad = [bool(p.rg[u]) and not any(p.passthru[w] and u not in p.grad_new[w] for w in p.succ[u])
                         for u in range(p.n)]
        self.passthru_mask = sum(1 << w for w in range(p.n) if p.passthru[w])
        self._split: dict[int, tuple[list[int], list[tuple[int, tuple[int, ...]]]]] = {}

    def floor(self, lower: int, upper: int) -> int:
        """A lower bound of what the backward of the recomputed segment ``S = upper \\ lower`` holds
        beyond the kept bytes, the gradient buffers it keeps throughout and the parameter
        gradients of the nodes after ``upper``: the largest, over the nodes ``v`` of ``S`` that
        receive a gradient (in decreasing order, as the backward runs them), of

        * ``v``'s own backward: its inputs' gradients (new buffers or transients) unless it
          passes its gradient through, its parameters' gradients, its workspace;
        * the gradient buffers alive then that no pass-through reader shares (each its node's
          own): of ``v`` and the nodes of ``S`` before it that a node after ``upper`` or a node of
          ``S`` after ``v`` reads, and of the nodes of ``lower`` that ``S`` reads and a node after
          ``upper`` or a node of ``S`` after ``v`` reads;
        * for each buffer that pass-through readers after ``upper`` share (not one that
          :meth:`TransitionBounds.kept_grads` counts), the least of its bytes and those of the sharing nodes
          whose backward has not run (each one's gradient is in the shared buffer or, once a
          reader in ``S`` has replaced it, in a buffer of its own), and alike for the own
          buffer of a pass-through node of ``S`` after its backward, which its inputs that had
          no gradient yet then share (see :meth:`_share`);
        * once the replay has run (``v`` at or before the last saving node), the recomputed
          storages of ``S`` that nodes up to ``v`` save, and their extras.

        Each term is a distinct buffer of the replay (:func:`.segment_replay.replay_segment`) at ``v``'s backward, so
        the sum never exceeds its peak (also checked against replays in the tests).

        Long by design: one sweep per recomputed pair, called for thousands of pairs per search; its
        state (open buffers, groups, events) lives in locals of one loop."""
        p = self.p
        seg = upper & ~lower
        nodes = bit_list(seg)
        stop = (seg & p.holder_mask).bit_length() - 1
        root, saves, alloc, extra, rg = p.root, p.saves, p.alloc, p.extra, p.rg
        succmask, pred, out, own = p.succmask, p.pred, p.out, self.own_grad
        local = self.local
        held_at = {}
        copies = held = 0
        for v in nodes:
            if v > stop:
                break
            if rg[v]:
                held += extra[v]
                for u in saves[v]:
                    r = root[u]
                    if seg >> r & 1 and not copies >> r & 1:
                        copies |= 1 << r
                        held += alloc[r]
            held_at[v] = held
        own_after, shared = self._after_split(upper)
        opened = 0  # nodes whose own gradient buffer is alive
        live = 0
        for u in own_after:  # their buffers exist from the start of S's backward
            if seg >> u & 1 or succmask[u] & seg:
                opened |= 1 << u
                live += out[u]
        # buffers that pass-through readers share (see _share): those after upper from the start
        # of S's backward (not those TransitionBounds.kept_grads counts), and a pass-through node's own buffer
        # after its backward, shared by its inputs that had none
        groups: list[list[int]] = []  # [shared bytes, pending bytes, counted, whole from v >=]
        events: list[tuple[int, int, int]] = []  # (-v, group, bytes leaving) as v goes below
        for nbytes, group in shared:
            if any(lower >> u & 1 and not succmask[u] & seg for u in group):
                continue
            live += self._share(groups, events, nbytes, group, seg, seg, nodes[-1])
        heapify(events)
        passthru, is_out = p.passthru, p.is_out
        outside = ~upper
        got = 0
        for v in reversed(nodes):
            while events and -events[0][0] > v:  # a sharer's backward or reader ran
                _, k, gone = heappop(events)
                grp = groups[k]
                grp[1] -= gone
                counted = grp[0] if v >= grp[3] else min(grp[0], grp[1])
                live += counted - grp[2]
                grp[2] = counted
            if local[v] < 0:  # no gradient reaches v: its backward does not run
                if opened >> v & 1:
                    opened &= ~(1 << v)
                    live -= out[v]
                continue
            level = live + local[v] + held_at.get(v, 0)
            if level > got:
                got = level
            for u in pred[v]:
                if own[u] and not opened >> u & 1:
                    opened |= 1 << u
                    live += out[u]
            if not opened >> v & 1:
                continue
            opened &= ~(1 << v)
            if not passthru[v]:
                live -= out[v]
                continue
            # v passes its own buffer to the inputs that have none yet (no reader outside
            # upper, not outputs, no reader in S after v)
            group = [u for u in set(pred[v]) if rg[u] and not succmask[u] & outside and not is_out[u]
                     and not (succmask[u] & seg) >> (v + 1)]
            if not group:
                live -= out[v]
                continue
            fresh: list[tuple[int, int, int]] = []
            live += self._share(groups, fresh, out[v], group, seg, seg & ((1 << v) - 1), v - 1) - out[v]
            for event in fresh:
                heappush(events, event)
        return got

    def at_stop(self, lower: int, upper: int) -> int:
        """The part of :meth:`floor`'s level at the last holding node ``s`` of ``S = upper \\ lower``
        (where the replay has run) that needs no sweep: ``s``'s own backward, and the gradient
        buffers of the nodes of ``S`` up to ``s`` whose buffer is their own and is alive after
        ``upper`` (opened at the start of ``S``'s backward, closed only at their own). 0 when
        ``S`` holds nothing or no gradient reaches ``s``. The copies and extras held at ``s`` are
        bounded by ``rec_hi - rec_lo`` (see :class:`TransitionBounds`), so their sum with this is
        a lower bound of the replay's need that set operations give (:meth:`TransitionBounds.move_bound`,
        and per row in :meth:`.batch_pricing.BatchPricer.price`)."""
        seg = upper & ~lower
        stop = (seg & self.p.holder_mask).bit_length() - 1
        if stop < 0 or self.local[stop] < 0:
            return 0
        out = self.p.out
        return self.local[stop] + sum(out[u] for u in self.own_after(upper) if seg >> u & 1 and u <= stop)

    def own_after(self, upper: int) -> list[int]:
        """The nodes whose gradient buffer is their own and is alive after ``upper`` (cached)."""
        return self._after_split(upper)[0]

    def _share(self, groups: list[list[int]], events: list[tuple[int, int, int]], nbytes: int,
               group: Sequence[int], seg: int, readers: int, first: int) -> int:
        """Register a gradient buffer of ``nbytes`` that the nodes ``group`` share for
        :meth:`floor`'s sweep (from node ``first`` down; the readers in ``readers`` are
        still to run their backward); returns the bytes it counts at ``first``.

        Until its own backward, a sharer's gradient is in the shared buffer or, once a reader
        replaced it, in a buffer of its own; so the group holds at least the least of
        ``nbytes`` and its pending sharers' bytes. The shared buffer itself is only freed at a
        sharer's own backward or when a pass-through reader replaces its last holder (a plain
        reader replaces a holder only while another holds it); at such a point ``f`` it stays
        when another sharer certainly holds it (of the lower set or before ``f``, no reader at or
        after ``f``). So it is whole while ``v`` is above the largest such point that no
        sharer certainly survives. ``events`` gets ``(-v, group, bytes)``: when the sweep goes
        below ``v``, the group's pending bytes drop by ``bytes`` and its count is renewed."""
        k = len(groups)
        pending = 0
        points = 0  # where the buffer may be freed: sharers of S, pass-through readers
        least = 1 << 62  # the least point from which some sharer certainly holds it
        pt = self.passthru_mask
        succmask, out = self.p.succmask, self.p.out
        for u in group:
            pending += out[u]
            mine = succmask[u] & readers
            last = mine.bit_length() - 1
            points |= mine & pt
            if seg >> u & 1:
                points |= 1 << u
                events.append((-u, k, out[u]))
                last = max(last, u)
            least = min(least, last)  # u certainly holds it at any point above `last`
        below = points & ((2 << least) - 1) if least >= 0 else 0
        # whole while v is above the largest point where it may go (-1: throughout)
        whole = below.bit_length()
        if whole:
            events.append((-whole, k, 0))
        else:
            whole = -1
        counted = nbytes if first >= whole else min(nbytes, pending)
        groups.append([nbytes, pending, counted, whole])
        return counted

    def _after_split(self, upper: int) -> tuple[list[int], list[tuple[int, tuple[int, ...]]]]:
        """:meth:`.bitsets.GraphBits.after`'s gradient buffers of ``upper`` for :meth:`floor` (cached per
        set): the nodes whose buffer is their own, and the buffers that pass-through readers
        outside ``upper`` share, as ``(bytes, sharing nodes)``."""
        got = self._split.get(upper)
        if got is None:
            p = self.p
            own = [u for u, owner in p.after(upper).grads if owner == u and self.own_grad[u]]
            groups: dict[int, list[int]] = {}
            for u, owner in p.after(upper).grads:
                if owner != u and not upper >> owner & 1:
                    groups.setdefault(owner, []).append(u)
            shared = [(p.out[owner], tuple(group)) for owner, group in groups.items()]
            got = self._split[upper] = (own, shared)
        return got
