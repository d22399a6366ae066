"""The exact model's transitions out of one state, priced for many successors at once (numpy).

:meth:`autoremat.solvers.kusumoto.exact.ExactDP.move` prices one transition ``L_i -> L_j`` from the dangling roots
``D`` with set operations on Python ints (:func:`.segment_replay.bookkeeping`), a few
microseconds each; the time- and memory-centric searches of ``dp-exact`` price millions of
them on GoogLeNet. :class:`BatchPricer` prices every successor ``j`` of one state in one pass
over bitsets held as rows of 64-bit words (one row per lower set), with the same results, bit
for bit:

- byte sums over a bitset (bytes of storages, gradient buffers, integer times) are read from
  per-byte tables (256 entries for each byte of the row) and added as integers;
- the recomputation time of a recomputed segment is the sum of its nodes' times up to its last
  holding node (the bits below the highest bit of ``S & holders``). With integer times (the
  papers' convention) the scalar code sums integers too; otherwise the rows are unpacked and
  the times accumulated left to right (``np.cumsum``: the order of the scalar loop; the zeros
  of the other nodes change no float sum);
- the kept bytes a saved segment adds are its nodes' extras plus the storages of the segment
  that its own nodes save. A node saves only its own storage or its inputs' (and a view's
  root, an ancestor), so a root ``r`` of ``S = L_j \\ L_i`` saved by a node of ``L_j`` is
  saved by a node of ``S`` (a node of ``L_i`` is not a descendant of ``r``): those roots are
  ``saved(L_j) & S``, with ``saved(L_j)`` a row kept per set. :class:`BatchPricer` checks this
  on the graph (``ok``); where it does not hold, the searches price one transition at a time;
- the dangling roots a transition holds (the roots of ``D`` the segment reads when
  recomputed, saves otherwise), and the gradient buffers a recomputed segment keeps alive
  (:meth:`.backward_floor.TransitionBounds.kept_grads`), are taken per root of ``D`` and per node of the
  boundary of ``L_i`` (a few columns), not per successor;
- the level at a recomputed segment's last holding node that needs no sweep
  (:meth:`.backward_floor.BackwardFloor.at_stop`): that node is the top bit of the bits up to
  it (a popcount), its own backward a table lookup, and the own gradient buffers alive there a
  byte sum over ``own_after(L_j) & S & bits up to it``.

Rows of the per-set tables (alive roots, saved roots, gradient owners) are filled when a set
first appears as a successor. ``tests/cost/test_batch_pricing.py`` compares every priced transition with the scalar code.
"""

from __future__ import annotations

import numpy as np

from .backward_floor import TransitionBounds
from .bitsets import GraphBits, bit_list, bits
from .segment_replay import replay_time

__all__ = ["BatchPricer", "any_bit"]

_ALL = np.uint64(0xFFFFFFFFFFFFFFFF)


def any_bit(words: np.ndarray) -> np.ndarray:
    """Whether each row of words (the last axis) has a bit set: the words OR-ed one by one (a
    reduction over a short last axis costs more per row)."""
    acc = words[..., 0]
    for w in range(1, words.shape[-1]):
        acc = acc | words[..., w]
    return acc != 0


class BatchPricer:
    """``price(i, dang, js)``: :meth:`autoremat.solvers.kusumoto.exact.ExactDP.move` of ``L_i -> L_j``
    for each ``j``, on bitset rows (see the module docstring)."""

    def __init__(self, p: GraphBits, bounds: TransitionBounds) -> None:
        family, floor, rec_hi, rec_lo, bwd = bounds.family, bounds.floor, bounds.rec_hi, bounds.rec_lo, bounds.sweep
        n, sets = p.n, len(family)
        self.p = p
        self.fam = family
        self.n = n
        self.words = max(1, (n + 63) // 64)
        self.last = sets - 1
        self.rec_lo = rec_lo
        self.floor = np.asarray(floor, dtype=np.int64)
        self.rec_hi = np.asarray(rec_hi, dtype=np.int64)
        self.members = self.rows(family)
        self.holder = self.rows([p.holder_mask])[0]
        self.saver = self.rows([p.saver_mask])[0]
        self.nonrecomp = self.rows([p.nonrecomp_mask])[0]
        self.end = self.rows([p.end_mask])[0]
        self.offsets = 256 * np.arange(8 * self.words, dtype=np.intp)
        self.alloc = self._table(p.alloc)
        self.ones = self._table([1] * n)
        self.out = np.asarray(p.out, dtype=np.int64)
        self.grad_bytes = self._table(p.out)
        self.bwd = bwd
        self.local = np.asarray(bwd.local, dtype=np.int64)  # a node's own backward (-1: none runs)
        self.time = np.asarray(p.time, dtype=np.float64)
        self.integer_times = p.time_groups is not None
        self.times = self._table([int(t) for t in p.time]) if self.integer_times else None
        extra = self._table([p.extra[v] if p.rg[v] else 0 for v in range(n)])
        self.extra_in = self.weigh(self.members, extra)  # extras of the rg nodes of each set
        self.succ = self.rows([p.succmask[u] for u in range(n)])
        savers = [0] * n  # rg nodes saving each root
        for v in range(n):
            if p.rg[v]:
                for r in bits(p.saves_roots[v]):
                    savers[r] |= 1 << v
        self.savers = self.rows(savers)
        anc = [0] * n  # ancestors of each node (nodes are in topological order)
        for v in range(n):
            for u in p.pred[v]:
                anc[v] |= anc[u] | (1 << u)
        self.ok = all(r == v or anc[v] >> r & 1 for v in range(n) for r in bits(p.saves_roots[v]))
        # per set, filled on first use: roots alive after it, roots its rg nodes save, and the
        # owner of each node's gradient buffer alive after it (-1: none)
        self.filled = np.zeros(sets, dtype=bool)
        self.alive = np.zeros((sets, self.words), dtype=np.uint64)
        self.saved = np.zeros((sets, self.words), dtype=np.uint64)
        self.owner = np.full((sets, n), -1, dtype=np.int32)
        self.own_after = np.zeros((sets, self.words), dtype=np.uint64)  # see BackwardFloor.own_after

    # -------------------------------------------------------------- bitset rows
    def rows(self, masks: list[int]) -> np.ndarray:
        """Bitsets as rows of little-endian 64-bit words."""
        width = 8 * self.words
        raw = b"".join(m.to_bytes(width, "little") for m in masks)
        return np.frombuffer(raw, dtype="<u8").reshape(len(masks), self.words).astype(np.uint64)

    def _table(self, weights: list[int]) -> np.ndarray:
        """``table[b, x]``: the sum of ``weights`` over the bits of the value ``x`` of byte ``b``."""
        nbytes = 8 * self.words
        table = np.zeros((nbytes, 256), dtype=np.int64)
        values = np.arange(256)
        for v, w in enumerate(weights):
            if w:
                table[v // 8, (values >> (v % 8)) & 1 == 1] += w
        return table.ravel()  # flat: byte b of value x at 256 * b + x (see weigh)

    def weigh(self, rows: np.ndarray, table: np.ndarray) -> np.ndarray:
        """The sum of the table's weights over each row's bits (exact, in integers)."""
        octets = np.ascontiguousarray(rows).view(np.uint8)
        return np.take(table, octets + self.offsets).sum(axis=1)

    @staticmethod
    def hits(rows: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """Whether each row shares a bit with ``mask`` (one row of words)."""
        return any_bit(rows & mask)

    @staticmethod
    def hits_each(rows: np.ndarray, masks: np.ndarray) -> np.ndarray:
        """``[k, c]``: whether row ``k`` shares a bit with ``masks[c]``."""
        return any_bit(rows[:, None, :] & masks[None])

    def _fill(self, js: np.ndarray) -> None:
        p, fam = self.p, self.fam
        new = js[~self.filled[js]]
        if not len(new):
            return
        alive, saved, own = [], [], []
        for j in new.tolist():
            upper = fam[j]
            alive.append(p.info(upper).alive)
            own.append(sum(1 << u for u in self.bwd.own_after(upper)))
            kept = 0
            for v in bits(upper & p.rg_mask):
                kept |= p.saves_roots[v]
            saved.append(kept)
            for u, owner in p.after(upper).grads:
                self.owner[j, u] = owner
        self.alive[new] = self.rows(alive)
        self.saved[new] = self.rows(saved)
        self.own_after[new] = self.rows(own)
        self.filled[new] = True

    # -------------------------------------------------------------- pricing
    def segments(self, i: int, js: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(S rows, recompute flags)`` of ``L_j \\ L_i`` for each ``j`` (the flags are
        :meth:`.bitsets.GraphBits.recompute_flag`'s)."""
        seg = self.members[js] & ~self.members[i]
        rec = self.hits(seg, self.saver) & ~self.hits(seg, self.nonrecomp) & (js != self.last)
        if self.p.module_mode:
            rec &= self.weigh(seg, self.ones) == 1
        return seg, rec

    def _times(self, seg: np.ndarray, rec: np.ndarray, below: np.ndarray) -> np.ndarray:
        """The recomputation times of the segments ``seg`` (rows) where ``rec``: each segment's
        nodes in ``below`` (up to its last holding node), or with :attr:`GraphBits.tails
        <.bitsets.GraphBits.tails>` up to its replay tail, one segment at a time
        (:func:`.segment_replay.replay_time`)."""
        p = self.p
        dt = np.zeros(len(seg))
        at = np.flatnonzero(rec)
        if p.tails:
            for a in at:
                dt[a] = replay_time(p, int.from_bytes(seg[a].tobytes(), "little"))
        elif self.times is not None:
            dt[at] = self.weigh(seg[at] & below[at], self.times)
        elif len(at):
            part = seg[at] & below[at]
            unpacked = np.unpackbits(part.view(np.uint8), axis=1, bitorder="little", count=self.n).astype(bool)
            dt[at] = np.where(unpacked, self.time, 0.0).cumsum(axis=1)[:, -1]
        return dt

    def price(self, i: int, dang: int, js: np.ndarray,
              recompute: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(times, added kept bytes, dangling roots after, lower bounds of the need)`` of
        ``L_i -> L_j`` from the dangling roots ``dang``, for the set indices ``js``; the
        dangling roots as rows of little-endian bytes (``int.from_bytes`` gives the set).
        ``recompute``: the segments' flags where the caller chooses them (``milp``'s free
        flags; a recomputed segment must have a saver and only recomputable nodes), else
        :meth:`segments`'."""
        p, n = self.p, self.n
        self._fill(js)
        lower = self.fam[i]
        seg, rec = self.segments(i, js)
        if recompute is not None:
            rec = np.asarray(recompute, dtype=bool) & (js != self.last)
        # recomputation time: the segment's nodes up to its last holding node
        held_nodes = np.where(rec[:, None], seg & self.holder, np.uint64(0))
        below = held_nodes.copy()
        for shift in (1, 2, 4, 8, 16, 32):
            below |= below >> np.uint64(shift)
        nonzero = held_nodes != 0  # a word is whole below a nonzero word above it
        above = np.logical_or.accumulate(nonzero[:, ::-1], axis=1)[:, ::-1]
        below[:, :-1] |= np.where(above[:, 1:], _ALL, np.uint64(0))
        dt = self._times(seg, rec, below)
        # kept bytes a saved segment adds: its extras and the storages of S its nodes save
        # (and, either way, those the output object holds to the step's end: segment_replay)
        kept_new = np.where(rec[:, None], seg & self.end, (self.saved[js] | self.end) & seg)
        add = np.where(rec, 0, self.extra_in[js] - self.extra_in[i]) + self.weigh(kept_new, self.alloc)
        alive = self.alive[js]
        fresh = alive & seg & ~kept_new
        # the dangling roots the segment holds (reads when recomputed, saves otherwise)
        held = np.zeros_like(seg)
        if dang:
            roots = bit_list(dang)
            readers = [u for u in bits(p.info(lower).boundary) if dang >> p.root[u] & 1]
            reads = self.hits_each(seg, self.succ[readers]) if readers else None
            saves = self.hits_each(seg, self.savers[roots])
            for c, r in enumerate(roots):
                read = np.zeros(len(js), dtype=bool)
                for d, u in enumerate(readers):
                    if p.root[u] == r:
                        read |= reads[:, d]
                hold = np.where(rec, read, saves[:, c])
                held[:, r // 64] |= hold.astype(np.uint64) << np.uint64(r % 64)
            add = add + self.weigh(held, self.alloc)
        dangling = self.rows([dang])[0]
        dang2 = (dangling & ~held & alive) | fresh
        low = add + self.floor[js]
        if rec.any():
            # gradient owners kept through the segment, per node of L_i (-1: none)
            lower_grads = bit_list((p.info(lower).boundary | (p.out_mask & lower)) & p.rg_mask)
            grads = np.zeros(len(js), dtype=np.int64)
            if lower_grads:
                own = self.owner[js[:, None], lower_grads]
                keep = (own >= 0) & ~self.hits_each(seg, self.succ[lower_grads]) & rec[:, None]
                table = np.sort(np.where(keep, own, -1), axis=1)
                first = np.ones_like(table, dtype=bool)  # each owner counted once per row
                first[:, 1:] = table[:, 1:] != table[:, :-1]
                counted = first & (table >= 0)
                grads = np.where(counted, self.out[np.maximum(table, 0)], 0).sum(axis=1)
            # the level at the last holding node s (BackwardFloor.at_stop): s is the top bit of
            # `below`, which holds the bits up to it
            stop = self.weigh(below, self.ones) - 1
            local = np.where(stop >= 0, self.local[np.maximum(stop, 0)], -1)
            at_stop = np.where(local >= 0, local + self.weigh(self.own_after[js] & seg & below, self.grad_bytes), 0)
            low = np.where(rec, np.maximum(low, add + self.rec_hi[js] - self.rec_lo[i] + grads + at_stop), low)
        final = js == self.last
        dt[final] = 0.0
        add[final] = 0
        dang2[final] = 0
        low[final] = self.floor[self.last]
        return dt, add, np.ascontiguousarray(dang2).view(np.uint8), low
