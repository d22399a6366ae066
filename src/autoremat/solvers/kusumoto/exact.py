"""``dp-exact``'s pricing: Algorithm 1's transitions in the exact model, per state.

A state of the exact model is a lower set ``L_i`` and its dangling roots ``D``
(:mod:`autoremat.cost.segment_replay`). :class:`ExactDP` lists a set's successors in key order
(supersets found with numpy on bitset rows), and prices them per state into ``array`` columns
aligned with that list: time, added kept bytes, dangling roots after (interned,
:mod:`.interning`) and lower bounds of the need (:class:`~autoremat.cost.backward_floor.TransitionBounds`;
every successor of a state at once with :class:`~autoremat.cost.batch_pricing.BatchPricer`, or
one at a time). The replay that gives a transition's need is paid only when a search reaches
it and its bounds fit (:meth:`ExactDP.exceeds`). The searches themselves are
:class:`~.dive.Dive` (feasibility, least-kept) and :class:`~.labels.LabelSearch` (time- and
memory-centric). See the package docstring ("Feasibility", "Speed").
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ...cost.backward_floor import TransitionBounds
from ...cost.batch_pricing import BatchPricer
from ...cost.bitsets import GraphBits
from ...cost.segment_replay import SegmentCost, bookkeeping, exact_peak, exact_transition
from .dive import Dive
from .dp import LowerSetDP
from .interning import Interner
from .labels import LabelSearch

__all__ = ["ExactDP", "BATCH_MIN"]

_NONE_Q, _ZERO_Q, _ZERO_D, _NONE_I = array("q", [-1]), array("q", [0]), array("d", [0.0]), array("i", [-1])
BATCH_MIN = 24  # fewer transitions to price than this: one at a time (see price_all)


class ExactDP(LowerSetDP):
    """Algorithm 1 with the exact model (``dp-exact``): states ``(set, dangling roots)``."""

    exact = True

    def __init__(self, p: GraphBits, family: list[int], quantum: float) -> None:
        self.bounds = bounds = TransitionBounds(p, family)
        super().__init__(p, family, quantum, bounds.keys, [array("i") for _ in family])
        self.floor, self.rec_hi, self.rec_lo, self.pg = bounds.floor, bounds.rec_hi, bounds.rec_lo, bounds.pg
        self.segments: dict[tuple[int, int, int], SegmentCost] = {}  # replays by (lower, upper, roots held)
        self.replays: dict[tuple[int, int], tuple[int, float, int, int]] = {}  # exact_transition by (pair, dang)
        # per state, aligned with its successor list: lower bounds of the need (-1: none yet)
        # and the transitions priced so far, as columns (see columns); dangling sets interned
        self.moves: dict[tuple[int, int], tuple[array, array, array, array, array]] = {}
        self._tight: dict[tuple[int, int], int] = {}
        # prices a state's successors at once for the searches that visit them all
        self.rows = BatchPricer(p, bounds)
        self.pricer: BatchPricer | None = self.rows if self.rows.ok else None
        # dangling sets and states (set, dangling set) by dense index (see Interner)
        self.interner = Interner(self.rows.words)
        self.dive = Dive(self)
        self.labels = LabelSearch(self)

    # -------------------------------------------------------------- the searches
    def least_time(self, budget: int) -> tuple[list[int], float] | None:
        return self.labels.run(budget)

    def most_time(self, budget: int) -> tuple[list[int], float] | None:
        return self.labels.run(budget, most=True)

    def feasible(self, budget: int) -> tuple[list[int], float] | None:
        return self.dive.run(budget)

    def least_kept(self, budget: int, limit: int) -> list[int] | None:
        """:meth:`.dive.Dive.least_kept` (the least-kept sequence that fits, or ``None``)."""
        return self.dive.least_kept(budget, limit)

    def vanilla_need(self) -> int:
        return self.exact_step(0, len(self.fam) - 1, 0)[0]

    def model_peak(self, seq: Sequence[int]) -> tuple[int, float]:
        return exact_peak(self.p, seq)

    def recompute_time(self, seq: Sequence[int]) -> float:
        """The recomputation time of a lower-set sequence (its transitions' times summed in order,
        as the table sums them)."""
        t, lower = 0.0, 0
        for upper in seq:
            t += bookkeeping(self.p, lower, upper, 0)[0]
            lower = upper
        return t

    # -------------------------------------------------------------- transitions
    def successors(self, i: int, limit: int) -> Any:
        """Successors of set ``i`` with key ``<= limit`` (and maybe more), by key: an ``array``
        of ``j`` (priced per state by :meth:`columns`; a GoogLeNet search holds tens of millions)."""
        lst = self.succ[i]
        if limit <= self.scanned[i]:
            return lst
        pos = self.scan[i]
        n = len(self.fam)
        # supersets of L_i among the sets of the next keys, at once
        end = bisect_right(self.ordered_keys, limit, lo=pos)
        cand = self.order_np[pos:end]
        rows = self.rows.members
        mine = rows[i]
        sup = ((rows[cand] & mine) == mine).all(axis=1) & (cand != i)
        found = cand[sup].tolist()
        pos = end
        self.scan[i] = pos
        self.scanned[i] = limit if pos < n else 1 << 62
        self.transitions += len(found)
        lst.extend(found)
        return lst

    def exact_step(self, i: int, j: int, dang: int) -> tuple[int, float, int, int]:
        """:func:`~autoremat.cost.segment_replay.exact_transition` of ``L_i -> L_j`` from the
        dangling roots ``dang`` (cached)."""
        key = (i * len(self.fam) + j, dang)
        got = self.replays.get(key)
        if got is None:
            got = self.replays[key] = exact_transition(self.p, self.fam[i], self.fam[j], dang, self.segments)
        return got

    # -------------------------------------------------------------- pricing per state
    def columns(self, i: int, dang: int, room: int) -> tuple[Any, int, tuple[array, ...]]:
        """``(successor list, count within the key bound, columns)`` of state ``(i, dang)``.

        Each state keeps, aligned with its successor list, the lower bounds of the need (-1
        where none is known yet) and the priced transitions as ``array`` columns: time, added
        kept bytes, index of the dangling set after (-1 where not priced yet) and id of the
        state it leads to (-1 where not known yet). A GoogLeNet search prices millions of
        transitions, and a tuple each took 9 GB more at its peak.
        """
        keys = self.keys
        limit = keys[i] + room
        lst = self.successors(i, limit)
        count = bisect_right(lst, limit, key=keys.__getitem__)
        state = (i, dang)
        cols = self.moves.get(state)
        if cols is None:
            cols = self.moves[state] = (array("q"), array("d"), array("q"), array("i"), array("i"))
        if len(cols[0]) < count:
            grow = count - len(cols[0])
            for col, fill in zip(cols, (_NONE_Q, _ZERO_D, _ZERO_Q, _NONE_I, _NONE_I)):
                col.extend(fill * grow)
        return lst, count, cols

    def candidates(self, i: int, dang: int, m: int,
                   budget: int) -> Iterator[tuple[int, tuple[float, int, int, int]]]:
        """Transitions of the exact model out of state ``(set i, dangling roots)`` with kept bytes
        ``m``, from the largest successor down (the feasibility dive): each larger lower set ``j``
        that the budget can still admit, with its (cached) ``(time, added kept bytes, dangling
        roots, lower bound of the need)`` from :func:`bookkeeping`.

        A transition whose lower bound the budget cannot admit is left out (it would fail its
        deferred memory check anyway). The bound is first the cheap one (:attr:`floor`, and
        for a recomputed segment :attr:`rec_hi` - :attr:`rec_lo`: no bookkeeping), then
        :meth:`move`'s; each transition is priced only when it is reached (the dive stops at
        the first that fits; the searches that visit them all use :meth:`expand`).
        """
        room = budget - m
        lst, count, cols = self.columns(i, dang, room)
        bounds, dts, adds, dix, _ = cols
        fam, floor, rec_hi, rec_lo = self.fam, self.floor, self.rec_hi, self.rec_lo[i]
        recompute_flag = self.p.recompute_flag
        lower = fam[i]
        for pos in range(count - 1, -1, -1):
            bound = bounds[pos]
            if bound < 0:
                j = lst[pos]
                bound = floor[j]
                if recompute_flag(lower, fam[j]):  # the cheap bound (TransitionBounds.cheap_bound)
                    bound = max(bound, rec_hi[j] - rec_lo)
                bounds[pos] = bound
            if bound > room:
                continue
            k = dix[pos]
            if k < 0:
                dt, add, dang2, low = self.move(i, lst[pos], dang)
                k = self.interner.dangling(dang2)
                dts[pos], adds[pos], dix[pos] = dt, add, k
                if low > bound:
                    bounds[pos] = bound = low
                    if bound > room:
                        continue
            yield lst[pos], (dts[pos], adds[pos], self.interner.sets[k], bound)

    def price_all(self, i: int, dang: int, lst: Any, count: int, room: int,
                  cols: tuple[array, ...]) -> np.ndarray:
        """Price every successor among the first ``count`` of state ``(i, dang)`` that its
        bound admits and that is not priced yet (one :class:`BatchPricer` pass, or one
        :meth:`move` each for fewer than ``BATCH_MIN`` of them, where numpy's overhead per
        call costs more, and where the graph rules the batch out), and give each that fits a
        state id; return the positions whose bound (tightened by the pricing) fits ``room``,
        in order."""
        if not count:
            return np.zeros(0, dtype=np.intp)
        bounds, dts, adds, dix, sids = cols
        js = np.frombuffer(lst, dtype=np.int32, count=count).astype(np.intp)
        b = np.frombuffer(bounds, dtype=np.int64, count=count)
        k = np.frombuffer(dix, dtype=np.int32, count=count)
        fresh = np.flatnonzero(b < 0)
        if len(fresh):
            rows = self.rows
            jn = js[fresh]
            rec = rows.segments(i, jn)[1]
            cheap = rows.floor[jn]
            b[fresh] = np.where(rec, np.maximum(cheap, rows.rec_hi[jn] - self.rec_lo[i]), cheap)
        todo = np.flatnonzero((b <= room) & (k < 0))
        if len(todo):
            if self.pricer is not None and len(todo) >= BATCH_MIN:
                dt, add, packed, low = self.pricer.price(i, dang, js[todo])
                ks = self.interner.dangling_rows(packed)
            else:
                moves = [self.move(i, j, dang) for j in js[todo].tolist()]
                dt = np.array([mv[0] for mv in moves], dtype=np.float64)
                add = np.array([mv[1] for mv in moves], dtype=np.int64)
                ks = np.array([self.interner.dangling(mv[2]) for mv in moves], dtype=np.int64)
                low = np.array([mv[3] for mv in moves], dtype=np.int64)
            np.frombuffer(dts, dtype=np.float64, count=count)[todo] = dt
            np.frombuffer(adds, dtype=np.int64, count=count)[todo] = add
            k[todo] = ks
            b[todo] = np.maximum(b[todo], low)
        fits = np.flatnonzero(b <= room)
        s = np.frombuffer(sids, dtype=np.int32, count=count)
        unknown = fits[s[fits] < 0]
        if len(unknown):
            s[unknown] = self.interner.state_ids(js[unknown], k[unknown])
        del b, k, s
        return fits

    def expand(self, i: int, dang: int, m: int,
               budget: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(state ids, added kept bytes, times)`` of the transitions out of state ``(i,
        dang)`` with kept bytes ``m`` that the budget admits (:meth:`price_all`), as arrays."""
        room = budget - m
        lst, count, cols = self.columns(i, dang, room)
        fits = self.price_all(i, dang, lst, count, room, cols)
        _, dts, adds, _, sids = cols
        return (np.frombuffer(sids, dtype=np.int32, count=count)[fits].astype(np.int64),
                np.frombuffer(adds, dtype=np.int64, count=count)[fits],
                np.frombuffer(dts, dtype=np.float64, count=count)[fits])

    def priced(self) -> Iterator[tuple[int, int, int, tuple[float, int, int, int]]]:
        """``(i, j, dangling roots, (time, added kept bytes, dangling roots after, lower bound))``
        of every transition the exact model has priced so far (for tests and diagnostics)."""
        for (i, dang), (bounds, dts, adds, dix, _) in self.moves.items():
            lst = self.succ[i]
            for pos, k in enumerate(dix):
                if k >= 0:
                    yield i, lst[pos], dang, (dts[pos], adds[pos], self.interner.sets[k], bounds[pos])

    def move(self, i: int, j: int, dang: int) -> tuple[float, int, int, int]:
        """``(time, added kept bytes, dangling roots, lower bound of the need)`` of one transition
        (not cached here: the per-state columns of :meth:`columns` keep what is priced)."""
        fam, p = self.fam, self.p
        lower, upper = fam[i], fam[j]
        recompute = p.recompute_flag(lower, upper)
        dt, add, dang2 = bookkeeping(p, lower, upper, dang, recompute=recompute)
        # a lower bound of the transition's need (its replay is dear)
        return dt, add, dang2, self.bounds.move_bound(i, j, add, recompute)

    def exceeds(self, i: int, j: int, dang: int, room: int) -> bool:
        """Whether ``L_i -> L_j`` from ``dang`` needs more than ``room``: :meth:`tight_need`
        first, the replay only when that bound fits."""
        return self.tight_need(i, j, dang) > room or self.exact_step(i, j, dang)[0] > room

    def tight_need(self, i: int, j: int, dang: int, move: tuple[float, int, int, int] | None = None) -> int:
        """A lower bound of the need of ``L_i -> L_j`` from the dangling roots ``dang``, tighter
        than :meth:`move`'s and dearer (a sweep of the segment, cached per pair): checked before
        a replay is paid. For a recomputed segment, :meth:`TransitionBounds.tight_bound`;
        otherwise :meth:`move`'s bound (``move``, when the caller has it)."""
        key = (i * len(self.fam) + j, dang)
        got = self._tight.get(key)
        if got is None:
            _, add, _, got = move or self.move(i, j, dang)
            if self.p.recompute_flag(self.fam[i], self.fam[j]):
                got = max(got, self.bounds.tight_bound(i, j, add))
            self._tight[key] = got
        return got
