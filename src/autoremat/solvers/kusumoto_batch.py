"""The exact model's transitions out of one state, priced for many successors at once (numpy).

:meth:`.kusumoto_dp._DP._move` prices one transition ``L_i -> L_j`` from the dangling roots
``D`` with set operations on Python ints (:func:`.kusumoto_replay._bookkeeping`), a few
microseconds each; the time- and memory-centric searches of ``dp-exact`` price millions of
them on GoogLeNet. :class:`_BatchPricer` prices every successor ``j`` of one state in one pass
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
  ``saved(L_j) & S``, with ``saved(L_j)`` a row kept per set. :class:`_BatchPricer` checks this
  on the graph (``ok``); where it does not hold, the searches price one transition at a time;
- the dangling roots a transition holds (the roots of ``D`` the segment reads when
  recomputed, saves otherwise), and the gradient buffers a recomputed segment keeps alive
  (:meth:`.kusumoto_dp._DP._kept_grads`), are taken per root of ``D`` and per node of the
  boundary of ``L_i`` (a few columns), not per successor.

Rows of the per-set tables (alive roots, saved roots, gradient owners) are filled when a set
first appears as a successor. The tests compare every priced transition with the scalar code.
"""

from __future__ import annotations

import numpy as np

from .kusumoto_sets import _bits, _Prep

__all__: list[str] = []

_ALL = np.uint64(0xFFFFFFFFFFFFFFFF)


class _BatchPricer:
    """``price(i, dang, js)``: :meth:`.kusumoto_dp._DP._move` of ``L_i -> L_j`` for each ``j``."""

    def __init__(self, p: _Prep, family: list[int], floor: list[int], rec_hi: list[int],
                 rec_lo: list[int]) -> None:
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
        self.alloc = self._table(p.alloc)
        self.ones = self._table([1] * n)
        self.out = np.asarray(p.out, dtype=np.int64)
        self.time = np.asarray(p.time, dtype=np.float64)
        self.integer_times = p.time_groups is not None
        self.times = self._table([int(t) for t in p.time]) if self.integer_times else None
        extra = self._table([p.extra[v] if p.rg[v] else 0 for v in range(n)])
        self.extra_in = self.weigh(self.members, extra)  # extras of the rg nodes of each set
        self.succ = self.rows([p.succmask[u] for u in range(n)])
        savers = [0] * n  # rg nodes saving each root
        for v in range(n):
            if p.rg[v]:
                for r in _bits(p.saves_roots[v]):
                    savers[r] |= 1 << v
        self.savers = self.rows(savers)
        anc = [0] * n  # ancestors of each node (nodes are in topological order)
        for v in range(n):
            for u in p.pred[v]:
                anc[v] |= anc[u] | (1 << u)
        self.ok = all(r == v or anc[v] >> r & 1 for v in range(n) for r in _bits(p.saves_roots[v]))
        # per set, filled on first use: roots alive after it, roots its rg nodes save, and the
        # owner of each node's gradient buffer alive after it (-1: none)
        self.filled = np.zeros(sets, dtype=bool)
        self.alive = np.zeros((sets, self.words), dtype=np.uint64)
        self.saved = np.zeros((sets, self.words), dtype=np.uint64)
        self.owner = np.full((sets, n), -1, dtype=np.int32)

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
        return table

    def weigh(self, rows: np.ndarray, table: np.ndarray) -> np.ndarray:
        """The sum of the table's weights over each row's bits (exact, in integers)."""
        octets = np.ascontiguousarray(rows).view(np.uint8)
        return table[np.arange(octets.shape[1]), octets].sum(axis=1)

    @staticmethod
    def hits(rows: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """Whether each row shares a bit with ``mask`` (one row of words)."""
        return (rows & mask).any(axis=1)

    def _fill(self, js: np.ndarray) -> None:
        p, fam = self.p, self.fam
        new = js[~self.filled[js]]
        if not len(new):
            return
        alive, saved = [], []
        for j in new.tolist():
            upper = fam[j]
            alive.append(p.info(upper)[1])
            kept = 0
            for v in _bits(upper & p.rg_mask):
                kept |= p.saves_roots[v]
            saved.append(kept)
            for u, owner in p.after(upper)[0]:
                self.owner[j, u] = owner
        self.alive[new] = self.rows(alive)
        self.saved[new] = self.rows(saved)
        self.filled[new] = True

    # -------------------------------------------------------------- pricing
    def segments(self, i: int, js: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(S rows, recompute flags)`` of ``L_j \\ L_i`` for each ``j`` (the flags are
        :meth:`.kusumoto_sets._Prep.recompute_flag`'s)."""
        seg = self.members[js] & ~self.members[i]
        rec = self.hits(seg, self.saver) & ~self.hits(seg, self.nonrecomp) & (js != self.last)
        if self.p.module_mode:
            rec &= self.weigh(seg, self.ones) == 1
        return seg, rec

    def price(self, i: int, dang: int, js: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(times, added kept bytes, dangling roots after, lower bounds of the need)`` of
        ``L_i -> L_j`` from the dangling roots ``dang``, for the set indices ``js``; the
        dangling roots as rows of little-endian bytes (``int.from_bytes`` gives the set)."""
        p, n = self.p, self.n
        self._fill(js)
        lower = self.fam[i]
        seg, rec = self.segments(i, js)
        # recomputation time: the segment's nodes up to its last holding node
        held_nodes = np.where(rec[:, None], seg & self.holder, np.uint64(0))
        below = held_nodes.copy()
        for shift in (1, 2, 4, 8, 16, 32):
            below |= below >> np.uint64(shift)
        nonzero = held_nodes != 0  # a word is whole below a nonzero word above it
        above = np.logical_or.accumulate(nonzero[:, ::-1], axis=1)[:, ::-1]
        below[:, :-1] |= np.where(above[:, 1:], _ALL, np.uint64(0))
        part = seg & below
        if self.times is not None:
            dt = self.weigh(part, self.times).astype(np.float64)
        else:
            bits = np.unpackbits(part.view(np.uint8), axis=1, bitorder="little", count=n).astype(bool)
            dt = np.where(bits, self.time, 0.0).cumsum(axis=1)[:, -1] if n else np.zeros(len(js))
        # kept bytes a saved segment adds: its extras and the storages of S its nodes save
        kept_new = np.where(rec[:, None], np.uint64(0), self.saved[js] & seg)
        add = np.where(rec, 0, self.extra_in[js] - self.extra_in[i]) + self.weigh(kept_new, self.alloc)
        alive = self.alive[js]
        fresh = alive & seg & ~kept_new
        # the dangling roots the segment holds (reads when recomputed, saves otherwise)
        held = np.zeros_like(seg)
        if dang:
            reads: dict[int, np.ndarray] = {}
            for u in _bits(p.info(lower)[0]):
                r = p.root[u]
                if dang >> r & 1:
                    hit = self.hits(seg, self.succ[u])
                    reads[r] = hit if r not in reads else reads[r] | hit
            for r in _bits(dang):
                read = reads.get(r)
                hold = np.where(rec, read if read is not None else False, self.hits(seg, self.savers[r]))
                held[:, r // 64] |= hold.astype(np.uint64) << np.uint64(r % 64)
            add = add + self.weigh(held, self.alloc)
        dangling = self.rows([dang])[0]
        dang2 = (dangling & ~held & alive) | fresh
        low = add + self.floor[js]
        if rec.any():
            owners = []  # gradient owners kept through the segment, per lower node (-1: none)
            lower_grads = (p.info(lower)[0] | (p.out_mask & lower)) & p.rg_mask
            for u in _bits(lower_grads):
                own = self.owner[js, u]
                keep = (own >= 0) & ~self.hits(seg, self.succ[u]) & rec
                owners.append(np.where(keep, own, -1))
            grads = np.zeros(len(js), dtype=np.int64)
            if owners:
                table = np.sort(np.stack(owners, axis=1), axis=1)
                first = np.ones_like(table, dtype=bool)  # each owner counted once per row
                first[:, 1:] = table[:, 1:] != table[:, :-1]
                counted = first & (table >= 0)
                grads = np.where(counted, self.out[np.maximum(table, 0)], 0).sum(axis=1)
            low = np.where(rec, np.maximum(low, add + self.rec_hi[js] - self.rec_lo[i] + grads), low)
        final = js == self.last
        dt[final] = 0.0
        add[final] = 0
        dang2[final] = 0
        low[final] = self.floor[self.last]
        return dt, add, np.ascontiguousarray(dang2).view(np.uint8), low
