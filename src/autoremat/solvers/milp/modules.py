"""A cost-to-go for lattices too large for :class:`.cost_to_go.CostToGo`'s every step: steps
that stay inside a *module* of the lattice, priced in numpy.

Why: the cost-to-go DP relaxes every pair of lower sets ``L ⊂ L'``; GoogLeNet at CPU size has
8,838 lower sets and 35.8 M such pairs (~68 us of Python each), so its ``h`` was never built and
the lattice's bound stayed at the plain label search's (gap 73 % at 50 %). Measured (x86_64,
2 cores): GoogLeNet's lattice has 36 *cut sets* (lower sets comparable with every other lower
set: ``∅``, ``V`` and the prefixes ending at its single-node cuts), and only 1.05 M pairs lie
between two consecutive ones (PSPNet: 151 cut sets, 194 k of 546 k pairs).

The relaxation (:class:`ModuleMoves`, given to :class:`.cost_to_go.CostToGo` in place of the
lattice): states are the lower sets with the kept bytes ``m`` as there, plus, at each cut set
``C`` but ``∅`` and ``V``, two states "inside a plain (recomputed) step that spans ``C``"; steps
go between sets of one *module* (``C_a ⊆ L ⊂ L' ⊆ C_{a+1}``, consecutive cut sets). With ``g``
the key gap (:attr:`~autoremat.cost.backward_floor.TransitionBounds.keys`), ``floor``,
``rec_hi``, ``rec_lo`` of :class:`~autoremat.cost.backward_floor.TransitionBounds`, ``cd`` the
roots :meth:`~.lattice.Lattice.certain_dangling` at the step's start, ``dt`` the exact model's
time (the segment's nodes up to its last holder), ``A`` the kept bytes a plain segment adds by
its own savers (their extras, the roots of the segment they save or the returned object holds
to the end) plus the ``cd`` roots they save, and ``R`` the ``cd`` roots a recomputed one reads:

* from a set (a whole step, or the first piece of a spanning one): plain to a set: time 0, add
  ``A``, need ``max(g, A + floor[L'])`` (``max(g, A, floor[V])`` into ``V``); recomputed to a
  set: ``dt``, add ``R`` (0 into ``V``), need ``max(g, floor[L'], rec_hi[L'] - rec_lo[L], R +
  floor[L'])``; into the spanning states of the module's end ``C``: plain add ``A``, need
  ``max(g, A)``; recomputed ``dt``, add 0, need ``g``;
* from "inside a plain step at ``C``" (its next piece): plain only, add ``A``, need ``A +
  floor[L']`` to a set (``A`` into ``V``), ``A`` to the next spanning state;
* from "inside a recomputed step at ``C``": recomputed only, ``dt``, add 0, need ``max(g,
  floor[L'], rec_hi[L'] - rec_lo[C])`` to a set, ``g`` to the next spanning state.

Proof sketch that ``h`` stays a consistent lower bound of the exact cost-to-go (as
:class:`.cost_to_go.CostToGo`'s): every lower set is inside or outside each cut set, so an exact
step ``S = L -> L'`` that spans cut sets ``C_1 ⊂ … ⊂ C_r`` splits into pieces ``L -> C_1 -> … ->
C_r -> L'`` inside modules, through the spanning states of its flag; a step that spans none is
one step between sets. *Time*: node ids are topological and a piece's nodes all precede the next
piece's, so ``S`` replays every node of a piece up to the piece's last holder (and none after
its own last holder): the pieces' times sum to at most ``dt(S)``. *Kept bytes*: a plain piece's
``A`` is part of ``add(S)`` (its savers are ``S``'s; a ``cd`` root of a cut set that a piece
saves was saved by no earlier piece, and dangles at ``L`` if it lies in ``L``), the pieces'
parts are disjoint, so their sum is at most ``add(S)``; recomputed pieces add 0 (``S`` keeps
none of the tensors inside it), a whole recomputed step the ``cd`` roots it reads. *Fit*: the
exact need of ``S`` is at least ``g(S)`` and ``add(S) + floor[L']`` (plain, but into ``V``:
``add(S)`` and ``floor[V]``), and ``g(S)``, ``floor[L']``, ``rec_hi[L'] - rec_lo[L]``
(recomputed; ``add(S) + floor[L']`` besides, but into ``V``), the bounds the search prunes
with (:meth:`~autoremat.cost.backward_floor.TransitionBounds.move_bound`); ``rec_lo`` grows with
the set and ``g`` is additive, so each piece's need plus the earlier pieces' adds is at most
``need(S)``, which fits from ``m``: only the first piece may use ``g`` among plain pieces, only
the last uses ``floor[L']``. The relaxation also drops the dangling roots beyond ``cd``, so
every plan maps to a path of it that fits with no more time and no more kept bytes at each set
it visits; ``h`` is non-decreasing in ``m``, hence a lower bound, and consistent along exact
steps. Flags are free in the relaxation (more paths). Held to the brute force on every plan of
seeded DAGs and to the label search's optimum on random networks (``tests/solvers/milp/test_modules.py``).

What it leaves out, against the full ``h``: steps across modules, the backward sweep's levels
(:meth:`~autoremat.cost.backward_floor.TransitionBounds.move_bound`'s sweep) and exact needs.
Measured (x86_64, 2 cores, loaded): ``h`` at ``∅`` on PSPNet at ``milp``'s least budget 1.38e-6 s
(the full ``h`` with the bounds 2.29e-6 s), so it is used only where the full ``h`` is not tried
(:data:`.lattice.CTG_MAX_SETS`): GoogLeNet at CPU size, built in 17-25 s at load ~7.

Complexity: O(sets × module size) word operations in numpy to list the steps (each module's
pairs once), then :class:`.cost_to_go.CostToGo`'s DP over them (O(steps × grid)).
"""

from __future__ import annotations

import numpy as np

from ...cost.bitsets import bits

__all__ = ["ModuleMoves", "cut_sets"]

_SLACK = 1 - 1e-9
"""Times from prefix sums may differ from the exact model's sum in the last bits: scaled down
(and less a few units in the last place of the prefix sum)."""


def cut_sets(rows: np.ndarray, fam: list[int]) -> list[int]:
    """Indices of the lower sets comparable with every other set of the family, by size (two
    sets of one size are comparable only when equal, so only sizes held by one set are tested)."""
    sizes: dict[int, list[int]] = {}
    for k, m in enumerate(fam):
        sizes.setdefault(m.bit_count(), []).append(k)
    out = []
    for size in sorted(sizes):
        if len(sizes[size]) != 1:
            continue
        k = sizes[size][0]
        mine = rows[k]
        inter = rows & mine
        if (((inter == rows).all(axis=1)) | ((inter == mine).all(axis=1))).all():
            out.append(k)
    return out


def _high_bit(words: np.ndarray) -> np.ndarray:
    """Index of the highest set bit of each row of ``uint64`` words (``-1`` for zero rows)."""
    out = np.full(words.shape[0], -1, dtype=np.int64)
    for w in range(words.shape[1] - 1, -1, -1):
        x = words[:, w]
        todo = (out < 0) & (x != 0)
        if not todo.any():
            continue
        hi = (x >> np.uint64(32)).astype(np.float64)
        lo = (x & np.uint64(0xFFFFFFFF)).astype(np.float64)
        pos = np.where(hi > 0, 32 + np.floor(np.log2(np.maximum(hi, 1))), np.floor(np.log2(np.maximum(lo, 1))))
        out[todo] = 64 * w + pos[todo].astype(np.int64)
    return out


class ModuleMoves:
    """The steps of the module relaxation over a :class:`~.lattice.Lattice` (see the module
    docstring), with the interface :class:`.cost_to_go.CostToGo` reads: ``fam``, ``last`` and
    :meth:`move_arrays`."""

    def __init__(self, lat) -> None:
        p, b = lat.p, lat.bounds
        self.last, self.rows = lat.last, lat.rows
        n = len(lat.fam)
        self.cuts = cut_sets(self.rows, lat.fam)
        # states inside a step that spans a cut set: (cut set, flag) -> index after the sets
        inner = [c for c in self.cuts if c not in (0, self.last)]
        self.mid = {(c, f): n + 2 * q + f for q, c in enumerate(inner) for f in (0, 1)}
        self.base = list(range(n)) + [c for c in inner for _ in (0, 1)]
        self.fam = lat.fam + [lat.fam[c] for c in self.base[n:]]  # what CostToGo reads (sizes)
        self.mid_of = np.full((n, 2), -1, dtype=np.intp)
        for (c, f), k in self.mid.items():
            self.mid_of[c, f] = k
        self.is_cut = np.zeros(n, dtype=bool)
        self.is_cut[self.cuts] = True
        self.keys = np.asarray(b.keys, dtype=np.int64)
        self.floor = np.asarray(b.floor, dtype=np.int64)
        self.rec_hi = np.asarray(b.rec_hi, dtype=np.int64)
        self.rec_lo = np.asarray(b.rec_lo, dtype=np.int64)
        # module of each set: members between consecutive cut sets (a cut set starts its module)
        self.module = np.zeros(n, dtype=np.intp)
        self.members: list[np.ndarray] = []
        for a, (lo, hi) in enumerate(zip(self.cuts, self.cuts[1:])):
            r_lo, r_hi = self.rows[lo], self.rows[hi]
            inside = ((self.rows & r_lo) == r_lo).all(axis=1) & ((self.rows & r_hi) == self.rows).all(axis=1)
            idx = np.nonzero(inside)[0]
            self.members.append(idx)
            self.module[idx[idx != hi]] = a
        # per set: the prefix sums of its nodes' times (time of its nodes with id <= x), the
        # extras of its savers, the roots its savers save; per root: its nodes' successors
        words = self.rows.shape[1]
        self.n = p.n
        member = self._unpack(self.rows)
        self.prefix = np.cumsum(member * np.asarray(p.time, dtype=np.float64), axis=1)
        rg = np.asarray(p.rg, dtype=bool)
        self.extras = member[:, rg] @ np.asarray(p.extra, dtype=np.float64)[rg]
        saved = []
        for m in lat.fam:
            acc = 0
            for v in bits(m & p.rg_mask):
                acc |= p.saves_roots[v]
            saved.append(acc)
        self.saved = self._pack(saved, words)
        self.end = self._pack([p.end_mask], words)[0]
        self.holder = self._pack([p.holder_mask], words)[0]
        self.alloc = np.asarray(p.alloc, dtype=np.float64)
        self.readers = [0] * p.n  # root -> successors of the nodes living in its storage
        for r in range(p.n):
            for u in p.members[r]:
                self.readers[r] |= p.succmask[u]
        self.lat = lat
        self._arrays: dict[int, tuple | None] = {}

    def _unpack(self, rows: np.ndarray) -> np.ndarray:
        """``(k, n)`` 0/1 float membership of ``uint64`` word rows."""
        flat = np.unpackbits(np.ascontiguousarray(rows.astype("<u8")).view(np.uint8), axis=1, bitorder="little")
        return flat[:, :self.n].astype(np.float64)

    @staticmethod
    def _pack(masks: list[int], words: int) -> np.ndarray:
        raw = b"".join(m.to_bytes(8 * words, "little") for m in masks)
        return np.frombuffer(raw, dtype="<u8").reshape(len(masks), words).astype(np.uint64)

    def _bytes(self, rows: np.ndarray) -> np.ndarray:
        """Bytes of the storages whose roots are set in each row."""
        return self._unpack(rows) @ self.alloc

    def _targets(self, i: int) -> np.ndarray:
        cand = self.members[self.module[i]] if self.members else np.zeros(0, dtype=np.intp)
        mine = self.rows[i]
        sup = ((self.rows[cand] & mine) == mine).all(axis=1) & (cand != i)
        return cand[sup]

    def move_arrays(self, i: int, budget: int, exact: bool = False):
        """Set ``i``'s relaxed steps as ``(need, kept bytes added, time, target)`` arrays, those
        whose need is within ``budget`` (``None`` without any; ``exact`` is not used: the
        relaxation has no exact needs). Cached per set (the arrays do not depend on the budget
        but for the filter, applied on each call)."""
        if i not in self._arrays:
            self._arrays[i] = self._price(i)
        got = self._arrays[i]
        if got is None:
            return None
        req, add, dt, j = got
        keep = req <= budget
        if not keep.any():
            return None
        return req[keep], add[keep], dt[keep], j[keep]

    def _price(self, i: int):
        """The relaxed steps out of state ``i``: a set (a step of either flag starts there) or
        the middle of a step spanning a cut set (only pieces of its flag go on; see the module
        docstring)."""
        base = self.base[i]
        mode = None if i == base else (i - len(self.base) + len(self.mid)) % 2  # 0 plain, 1 recomputed
        j = self._targets(base)
        if len(j) == 0:
            return None
        gap = self.keys[j] - self.keys[base]
        last = j == self.last
        floor = self.floor[j]
        seg = self.rows[j] & ~self.rows[base]
        cd = self.lat.certain_dangling(base)
        cd_row = self._pack([cd], self.rows.shape[1])[0]
        # plain: its savers' extras and the roots it saves: of the segment, held to the end, and
        # the certainly dangling ones (no earlier piece of a spanning step saved them)
        add = self.extras[j] - self.extras[base] + self._bytes((self.saved[j] | self.end) & seg)
        add = add + self._bytes(self.saved[j] & cd_row)
        stop = _high_bit(seg & self.holder)
        at = np.maximum(stop, 0)
        upto = self.prefix[j, at]  # a difference of prefix sums: less its rounding, so never above the sum
        dt = np.where(stop >= 0, (upto - self.prefix[base, at]) * _SLACK - 8 * np.spacing(upto), 0.0)
        dt = np.maximum(dt, 0.0)
        rec_need = np.maximum(np.maximum(gap, floor), self.rec_hi[j] - self.rec_lo[base])
        zero = np.zeros(len(j))
        inner = self.mid_of[j]  # the spanning step's state at a target cut set (-1: none)
        into = inner[:, 0] >= 0
        parts = []
        if mode is None:  # a whole step to a set, or the first piece of a spanning one
            rec_add = np.where(last, 0.0, self._read_dangling(cd, j))
            parts.append((np.where(last, np.maximum(np.maximum(gap, add), floor), np.maximum(gap, add + floor)),
                          add, zero, j))
            parts.append((np.maximum(rec_need, rec_add + np.where(last, 0, floor)), rec_add, dt, j))
            parts.append((np.maximum(gap, add)[into], add[into], zero[into], inner[into, 0]))
            parts.append((gap[into], zero[into], dt[into], inner[into, 1]))
        elif mode == 0:  # the next piece of a plain spanning step: no key gap (earlier pieces added)
            parts.append((np.where(last, add, add + floor), add, zero, j))
            parts.append((add[into], add[into], zero[into], inner[into, 0]))
        else:  # of a recomputed one: nothing kept
            parts.append((rec_need, zero, dt, j))
            parts.append((gap[into], zero[into], dt[into], inner[into, 1]))
        req, adds, time_s, to = (np.concatenate(x) for x in zip(*parts))
        return req.astype(np.int64), adds.astype(np.int64), time_s, to.astype(np.intp)

    def _read_dangling(self, cd: int, j: np.ndarray) -> np.ndarray:
        """Bytes of the certainly dangling roots ``cd`` (of set ``i``) that each target's
        segment reads (a node of the target set consumes a node of the root's storage)."""
        out = np.zeros(len(j))
        words = self.rows.shape[1]
        for r in bits(cd):
            reach = self._pack([self.readers[r]], words)[0]
            hit = ((self.rows[j] & reach) != 0).any(axis=1)
            out += np.where(hit, self.alloc[r], 0.0)
        return out
