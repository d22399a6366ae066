"""dp-exact's searches over its states ``(lower set, dangling roots)``, a mixin of :class:`.kusumoto_dp._DP`.

The exact model's transitions are priced per state (:meth:`_ExactSearches._price_all`: at once
by :mod:`.kusumoto_batch`, or one at a time) and kept in per-state columns; on them run the
depth-first feasibility dive, the least-kept search (for the minimum) and the time-centric
label-setting search on numpy chunks of candidate labels (also memory-centric, on the time each
transition leaves out). :class:`.kusumoto_dp._DP` sets up what they read (family, keys,
successor lists, bounds, pricer, interner, caches) and keeps the closed-form model's searches
and its memory-centric table. See :mod:`.kusumoto` ("Feasibility",
"Least budget", "Speed").
"""

from __future__ import annotations

import logging
import math
import time
from array import array
from bisect import bisect_right
from collections.abc import Callable, Iterator
from heapq import heappop, heappush
from typing import Any

import numpy as np

from .kusumoto_replay import _bookkeeping
from .kusumoto_sets import _bit_list

__all__: list[str] = []

_NONE_Q, _ZERO_Q, _ZERO_D, _NONE_I = array("q", [-1]), array("q", [0]), array("d", [0.0]), array("i", [-1])
_BATCH_MIN = 24  # fewer transitions to price than this: one at a time (see _price_all)
_INF = 1 << 62  # "no label" in the int64 tables (budgets and byte counts stay far below)
PROGRESS_EVERY_S = 10.0  # a search running longer logs where it is this often (INFO)

logger = logging.getLogger("autoremat.solvers.kusumoto")


class _Progress:
    """Logs, at most every :data:`PROGRESS_EVERY_S` seconds, where a long dp-exact search is
    (INFO on ``autoremat.solvers.kusumoto``): its phase, budget, time so far and how much it has
    priced and replayed. :meth:`tick` is called once per expanded state (a clock read)."""

    __slots__ = ("dp", "phase", "budget", "start", "due")

    def __init__(self, dp: Any, phase: str, budget: int) -> None:
        self.dp, self.phase, self.budget = dp, phase, budget
        self.start = time.monotonic()
        self.due = self.start + PROGRESS_EVERY_S

    def tick(self) -> None:
        now = time.monotonic()
        if now < self.due:
            return
        self.due = now + PROGRESS_EVERY_S
        dp = self.dp
        logger.info("dp-exact: %s at %d bytes, %.0f s so far: %d states priced, %d transitions listed, "
                    "%d replays (%d lower sets)", self.phase, self.budget, now - self.start, len(dp._moves),
                    dp.transitions, len(dp._step), len(dp.fam))


class _ExactSearches:
    """The exact model's pricing and searches (mixed into :class:`.kusumoto_dp._DP`, which
    holds the state they read)."""

    # set up by _DP.__init__
    p: Any
    fam: list[int]
    lost_quantum: float
    _set_time: np.ndarray | None = None  # T(L) per set (see _set_times)
    keys: list[int]
    succ: list[Any]
    floor: list[int]
    rec_hi: list[int]
    rec_lo: list[int]
    pg: list[int]
    _moves: dict[tuple[int, int], tuple[array, ...]]
    _rows: Any
    _pricer: Any
    _ix: Any
    _merged: list[Any] | None
    _fail_room: dict[tuple[int, int], int]
    _ok: dict[tuple[int, int], tuple[int, list[int]]]
    _tight: dict[tuple[int, int], int]
    _floors: dict[int, int]
    _bwd: Any
    successors: Callable[[int, int], Any]
    exact_step: Callable[[int, int, int], tuple[int, float, int, int]]

    def _columns(self, i: int, dang: int, room: int) -> tuple[Any, int, tuple[array, ...]]:
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
        cols = self._moves.get(state)
        if cols is None:
            cols = self._moves[state] = (array("q"), array("d"), array("q"), array("i"), array("i"))
        if len(cols[0]) < count:
            grow = count - len(cols[0])
            for col, fill in zip(cols, (_NONE_Q, _ZERO_D, _ZERO_Q, _NONE_I, _NONE_I)):
                col.extend(fill * grow)
        return lst, count, cols

    def _candidates(self, i: int, dang: int, m: int,
                    budget: int) -> Iterator[tuple[int, tuple[float, int, int, int]]]:
        """Transitions of the exact model out of state ``(set i, dangling roots)`` with kept bytes
        ``m``, from the largest successor down (the feasibility dive): each larger lower set ``j``
        that the budget can still admit, with its (cached) ``(time, added kept bytes, dangling
        roots, lower bound of the need)`` from :func:`_bookkeeping`.

        A transition whose lower bound the budget cannot admit is left out (it would fail its
        deferred memory check anyway). The bound is first the cheap one (:attr:`floor`, and
        for a recomputed segment :attr:`rec_hi` - :attr:`rec_lo`: no bookkeeping), then
        :meth:`_move`'s; each transition is priced only when it is reached (the dive stops at
        the first that fits; the searches that visit them all use :meth:`_expand`).
        """
        room = budget - m
        lst, count, cols = self._columns(i, dang, room)
        bounds, dts, adds, dix, _ = cols
        fam, floor, rec_hi, rec_lo = self.fam, self.floor, self.rec_hi, self.rec_lo[i]
        recompute_flag = self.p.recompute_flag
        lower = fam[i]
        for pos in range(count - 1, -1, -1):
            bound = bounds[pos]
            if bound < 0:
                j = lst[pos]
                bound = floor[j]
                if recompute_flag(lower, fam[j]):  # its need is above what the budget leaves (see __init__)
                    bound = max(bound, rec_hi[j] - rec_lo)
                bounds[pos] = bound
            if bound > room:
                continue
            k = dix[pos]
            if k < 0:
                dt, add, dang2, low = self._move(i, lst[pos], dang)
                k = self._ix.dangling(dang2)
                dts[pos], adds[pos], dix[pos] = dt, add, k
                if low > bound:
                    bounds[pos] = bound = low
                    if bound > room:
                        continue
            yield lst[pos], (dts[pos], adds[pos], self._ix.sets[k], bound)

    def _price_all(self, i: int, dang: int, lst: Any, count: int, room: int,
                   cols: tuple[array, ...]) -> np.ndarray:
        """Price every successor among the first ``count`` of state ``(i, dang)`` that its
        bound admits and that is not priced yet (one :class:`_BatchPricer` pass, or one
        :meth:`_move` each for fewer than ``_BATCH_MIN`` of them, where numpy's overhead per
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
            rows = self._rows
            jn = js[fresh]
            rec = rows.segments(i, jn)[1]
            cheap = rows.floor[jn]
            b[fresh] = np.where(rec, np.maximum(cheap, rows.rec_hi[jn] - self.rec_lo[i]), cheap)
        todo = np.flatnonzero((b <= room) & (k < 0))
        if len(todo):
            if self._pricer is not None and len(todo) >= _BATCH_MIN:
                dt, add, packed, low = self._pricer.price(i, dang, js[todo])
                ks = self._ix.dangling_rows(packed)
            else:
                moves = [self._move(i, j, dang) for j in js[todo].tolist()]
                dt = np.array([mv[0] for mv in moves], dtype=np.float64)
                add = np.array([mv[1] for mv in moves], dtype=np.int64)
                ks = np.array([self._ix.dangling(mv[2]) for mv in moves], dtype=np.int64)
                low = np.array([mv[3] for mv in moves], dtype=np.int64)
            np.frombuffer(dts, dtype=np.float64, count=count)[todo] = dt
            np.frombuffer(adds, dtype=np.int64, count=count)[todo] = add
            k[todo] = ks
            b[todo] = np.maximum(b[todo], low)
        fits = np.flatnonzero(b <= room)
        s = np.frombuffer(sids, dtype=np.int32, count=count)
        unknown = fits[s[fits] < 0]
        if len(unknown):
            s[unknown] = self._ix.state_ids(js[unknown], k[unknown])
        del b, k, s
        return fits

    def _expand(self, i: int, dang: int, m: int,
                budget: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(state ids, added kept bytes, times)`` of the transitions out of state ``(i,
        dang)`` with kept bytes ``m`` that the budget admits (:meth:`_price_all`), as arrays."""
        room = budget - m
        lst, count, cols = self._columns(i, dang, room)
        fits = self._price_all(i, dang, lst, count, room, cols)
        _, dts, adds, _, sids = cols
        return (np.frombuffer(sids, dtype=np.int32, count=count)[fits].astype(np.int64),
                np.frombuffer(adds, dtype=np.int64, count=count)[fits],
                np.frombuffer(dts, dtype=np.float64, count=count)[fits])

    def priced(self) -> Iterator[tuple[int, int, int, tuple[float, int, int, int]]]:
        """``(i, j, dangling roots, (time, added kept bytes, dangling roots after, lower bound))``
        of every transition the exact model has priced so far (for tests and diagnostics)."""
        for (i, dang), (bounds, dts, adds, dix, _) in self._moves.items():
            lst = self.succ[i]
            for pos, k in enumerate(dix):
                if k >= 0:
                    yield i, lst[pos], dang, (dts[pos], adds[pos], self._ix.sets[k], bounds[pos])

    def _move(self, i: int, j: int, dang: int) -> tuple[float, int, int, int]:
        """``(time, added kept bytes, dangling roots, lower bound of the need)`` of one transition
        (not cached here: the per-state columns of :meth:`_columns` keep what is priced)."""
        fam, p = self.fam, self.p
        lower, upper = fam[i], fam[j]
        recompute = p.recompute_flag(lower, upper)
        dt, add, dang2 = _bookkeeping(p, lower, upper, dang, recompute=recompute)
        # a lower bound of the transition's need (its replay is dear): the backward of S
        # starts with the kept bytes it adds and the gradients after L' alive
        low = add + self.floor[j]
        if recompute:  # the dangling roots it holds stay too; and the level at its last holder
            low = max(low, add + self.rec_hi[j] - self.rec_lo[i] + self._kept_grads(i, j)
                      + self._bwd.at_stop(lower, upper))
        return dt, add, dang2, low

    def _exceeds(self, i: int, j: int, dang: int, room: int) -> bool:
        """Whether ``L_i -> L_j`` from ``dang`` needs more than ``room``: :meth:`tight_need`
        first, the replay only when that bound fits."""
        return self.tight_need(i, j, dang) > room or self.exact_step(i, j, dang)[0] > room

    def tight_need(self, i: int, j: int, dang: int, move: tuple[float, int, int, int] | None = None) -> int:
        """A lower bound of the need of ``L_i -> L_j`` from the dangling roots ``dang``, tighter
        than :meth:`_move`'s and dearer (a sweep of the segment, cached per pair): checked before
        a replay is paid. For a recomputed segment, the kept bytes it adds and the gradient
        buffers kept through it plus the parameter gradients of the nodes after ``L_j`` and
        :meth:`_bwd_floor`; otherwise :meth:`_move`'s bound (``move``, when the caller has it)."""
        key = (i * len(self.fam) + j, dang)
        got = self._tight.get(key)
        if got is None:
            _, add, _, got = move or self._move(i, j, dang)
            if self.p.recompute_flag(self.fam[i], self.fam[j]):
                got = max(got, add + self._kept_grads(i, j) + self.pg[j] + self._bwd_floor(i, j))
            self._tight[key] = got
        return got

    def _bwd_floor(self, i: int, j: int) -> int:
        """:meth:`_BackwardFloor.floor` of the recomputed segment ``L_j \\ L_i``, cached per pair."""
        key = i * len(self.fam) + j
        got = self._floors.get(key)
        if got is None:
            got = self._floors[key] = self._bwd.floor(self.fam[i], self.fam[j])
        return got

    def _kept_grads(self, i: int, j: int) -> int:
        """Bytes of the gradient buffers that stay alive through the whole backward of the
        segment ``L_j \\ L_i``: those of nodes of ``L_i`` read after ``L_j`` and by no node of
        the segment (no backward of the segment releases or replaces them)."""
        p = self.p
        lower, upper = self.fam[i], self.fam[j]
        seg = upper & ~lower
        owners = {owner for u, owner in p.after(upper)[0] if lower >> u & 1 and not p.succmask[u] & seg}
        return sum(p.out[o] for o in owners)

    def _feasible_exact(self, budget: int) -> tuple[list[int], float] | None:
        """``"feasible"`` :meth:`run` for the exact model: a depth-first search with dominance.

        Feasibility asks for any sequence that fits, so the search dives: from a state it
        follows the first transition that fits, trying the successors from the largest lower
        set down (long segments keep fewer boundaries), and backtracks when a state has no
        transition left. A state ``(set, dangling roots)`` is expanded again only when it is
        reached with fewer kept bytes ``m`` than before: whatever fits from it with ``m`` fits
        with less (a transition needs ``m + need <= B`` and adds bytes independent of ``m``),
        so the search is complete, and it returns ``None`` only when no sequence fits. It
        returns the first sequence found, which need not have the least kept bytes.

        Whether ``V`` can be reached from a state depends on the budget only through the room
        ``B - m`` (every check is ``need <= room``, every transition lowers the room by the
        bytes it adds), so the probes of :meth:`.kusumoto._Search.least_dp_budget` share what
        they learn: a state whose every transition was tried at room ``r`` without reaching
        ``V`` fails at any room ``<= r`` (:attr:`_fail_room`), and one from which ``V`` was
        reached at room ``r`` succeeds, by the same transitions, at any room ``>= r``
        (:attr:`_ok`).

        Why not Dijkstra on ``m`` (the search before this version): it settles every state
        whose ``m`` is below that of ``V``, pricing all their successors. On GoogLeNet (8838
        lower sets; ~5.6k successors within the key bound per state early in the network) one
        feasible probe did not finish in 264 s; this search finds the least budget in under a
        second (see the module docstring for the side-by-side timings).
        """
        fam = self.fam
        last = len(fam) - 1
        inf = 1 << 126
        fail_room, ok = self._fail_room, self._ok
        start = (0, 0)
        best: dict[tuple[int, int], int] = {start: 0}
        stack = [(start, 0, self._candidates(0, 0, 0, budget))]
        progress = _Progress(self, "least-budget probe", budget)
        while stack:
            progress.tick()
            state, m, moves = stack[-1]
            if best[state] < m:  # reached since with fewer kept bytes: that expansion covers this one
                stack.pop()
                continue
            room = budget - m
            known = ok.get(state)
            if known is not None and room >= known[0]:
                return self._found(stack, budget, known[1])
            if room > fail_room.get(state, -1):
                i, dang = state
                for j, (_, add, dang2, _) in moves:
                    nxt = (j, dang2)
                    m2 = m + add
                    if m2 >= best.get(nxt, inf) or self._exceeds(i, j, dang, room):
                        continue
                    best[nxt] = m2
                    if j == last:
                        return self._found(stack, budget, [j])
                    stack.append((nxt, m2, self._candidates(j, dang2, m2, budget)))
                    break
                else:  # every transition tried: V cannot be reached from here with this room
                    fail_room[state] = room
                    stack.pop()
                continue
            stack.pop()
        return None

    def least_kept(self, budget: int, limit: int) -> list[int] | None:
        """A sequence that fits ``budget`` with the least kept bytes at ``V`` (Dijkstra on
        ``m``; ties go to the label pushed first), or ``None`` when none does or the search
        pushes more than ``limit`` labels first.

        :meth:`_feasible_exact` returns the first sequence its dive finds; at the least budget
        this one is the candidate the searches before it returned, and the least-budget search
        keeps whichever simulates lower (see :meth:`.kusumoto._Search.minimum`). It skips the
        states the dives proved cannot reach ``V`` with the room they would have
        (:attr:`_fail_room`), and prices each state's successors at once (:meth:`_price_all`).
        """
        fam, ix = self.fam, self._ix
        last = len(fam) - 1
        fail_room = self._fail_room
        settled: dict[int, Any] = {}
        first = int(ix.state_ids(np.zeros(1, dtype=np.intp), np.array([ix.dangling(0)]))[0])
        heap: list[tuple[int, int, int, Any, int]] = [(0, 0, first, None, 0)]
        count = 1
        progress = _Progress(self, "least-kept search", budget)
        while heap:
            progress.tick()
            m, _, sid, back, m_src = heappop(heap)
            if sid in settled:
                continue
            i = int(ix.state_set[sid])
            dang = ix.sets[int(ix.state_dang[sid])]
            if back is not None:
                i0, dang0 = int(ix.state_set[back]), ix.sets[int(ix.state_dang[back])]
                if self._exceeds(i0, i, dang0, budget - m_src):
                    continue
            settled[sid] = back
            if count > limit:
                return None
            if i == last:
                seq: list[int] = []
                node: Any = sid
                while node is not None and ix.state_set[node] != 0:
                    seq.append(fam[int(ix.state_set[node])])
                    node = settled[node]
                seq.reverse()
                return seq
            ids, adds, _ = self._expand(i, dang, m, budget)
            js, ks = ix.state_set[ids].tolist(), ix.state_dang[ids].tolist()
            for sid2, a, j, k in zip(ids.tolist(), adds.tolist(), js, ks):
                if sid2 in settled:
                    continue
                m2 = m + a
                if budget - m2 <= fail_room.get((j, ix.sets[k]), -1):
                    continue
                heappush(heap, (m2, count, sid2, sid, m))
                count += 1
        return None

    def _found(self, stack: list[tuple[tuple[int, int], int, Any]], budget: int,
               suffix: list[int]) -> tuple[list[int], float]:
        """The sequence of :meth:`_feasible_exact` when the top of ``stack`` reaches ``V`` by
        ``suffix`` (set indices); each state on the stack is recorded in :attr:`_ok`."""
        path = [state[0] for state, _, _ in stack[1:]]
        for k, (state, m, _) in enumerate(stack):
            tail = path[k:] + suffix
            known = self._ok.get(state)
            if known is None or budget - m < known[0]:
                self._ok[state] = (budget - m, tail)
        return [self.fam[j] for j in path + suffix], 0.0

    def _search_exact(self, budget: int, most: bool = False) -> tuple[list[int], float] | None:
        """:meth:`_search_closed` for the exact model: labels of states ``(set, dangling roots)``.

        A transition's time and kept bytes come from set operations (:meth:`_price_all`); its
        peak needs a segment replay, which is only paid when the label it produced is popped
        (a label beyond the optimum never is). Buckets of time hold the candidate labels as
        numpy chunks, one per expansion and target bucket: ``(source label, state ids, kept
        bytes, times)``. While a bucket is processed, each state's least ``(m, t)`` candidate
        (the earliest on ties: the order of a stable sort of all of them) is kept in arrays;
        its states are popped in increasing ``(set, dangling roots)`` (a topological order:
        successors are larger sets), and a state whose least candidate fails its deferred
        check falls back to all its candidates of the bucket, in that order.

        ``most`` (memory-centric, §4.4: the most recomputation time): the same search on the
        time a transition leaves out, ``T(L' \\ L) - dt >= 0`` (the segment's nodes that it does
        not recompute: its boundary, and the whole last segment). Every sequence ends in ``V``,
        so its times left out sum to ``T(V)`` less its recomputation time, and the first label
        of ``V`` has the most. Buckets are then of the time left out, :attr:`lost_quantum` wide
        (see :class:`.kusumoto_dp._DP`), and the time returned is the sequence's recomputation time.
        """
        fam, quantum, ix = self.fam, self.quantum, self._ix
        if most:
            set_time = self._set_times()
            quantum = self.lost_quantum
        last = len(fam) - 1
        first = int(ix.state_ids(np.zeros(1, dtype=np.intp), np.array([ix.dangling(0)]))[0])
        best = _Column(np.int64, _INF)  # kept bytes of each state's settled label
        low_m = _Column(np.int64, _INF)  # per state: least candidate of the current bucket
        low_t = _Column(np.float64, 0.0)
        low_c = _Column(np.int64, -1)  # its chunk (index in the bucket's list)
        # sources[label] = (set, dangling roots, kept bytes, state id, bucket) of an expanded
        # label; labels[(state id, bucket)] = (m, t, (state id, bucket) of its source)
        sources: list[tuple[int, int, int, int, int]] = []
        labels: dict[tuple[int, int], tuple[int, float, tuple[int, int] | None]] = {}
        one = np.array([first], dtype=np.int64)
        buckets: dict[int, list[tuple[int, np.ndarray, np.ndarray, np.ndarray]]] = {
            0: [(-1, one, np.zeros(1, dtype=np.int64), np.zeros(1))]}
        pending = [0]
        progress = _Progress(self, "memory-centric search" if most else "time-centric search", budget)
        while pending:
            tq = heappop(pending)
            chunks = buckets.pop(tq)
            queue: list[tuple[int, int, int]] = []
            touched: list[np.ndarray] = []

            def absorb(c: int) -> None:
                _, ids, ms, ts = chunks[c]
                size = int(ids.max()) + 1
                lm, lt, lc = low_m.fit(size), low_t.fit(size), low_c.fit(size)
                had, old_t = lm[ids], lt[ids]
                better = (ms < had) | ((ms == had) & (ts < old_t))
                new = ids[had == _INF]
                if len(new):
                    touched.append(new)
                    sets = ix.state_set[new].tolist()
                    dangs = ix.state_dang[new].tolist()
                    for j, k, sid in zip(sets, dangs, new.tolist()):
                        heappush(queue, (j, ix.sets[k], sid))
                win = ids[better]
                lm[win], lt[win], lc[win] = ms[better], ts[better], c

            if len(chunks) == 1:
                absorb(0)
            else:  # every chunk at once: per state, the least (m, t), the earliest chunk on ties
                ids = np.concatenate([c[1] for c in chunks])
                ms = np.concatenate([c[2] for c in chunks])
                ts = np.concatenate([c[3] for c in chunks])
                cs = np.repeat(np.arange(len(chunks)), [len(c[1]) for c in chunks])
                order = np.lexsort((cs, ts, ms, ids))
                ranked = ids[order]
                self._merged = [chunks, len(chunks), [(ranked, ms[order], ts[order], cs[order])]]  # for _next_label
                win = order[np.flatnonzero(np.r_[True, ranked[1:] != ranked[:-1]])]
                new = ids[win]
                size = int(new.max()) + 1
                low_m.fit(size)[new], low_t.fit(size)[new], low_c.fit(size)[new] = ms[win], ts[win], cs[win]
                touched.append(new)
                sets_of = ix.sets
                queue = sorted(zip(ix.state_set[new].tolist(),
                                   [sets_of[k] for k in ix.state_dang[new].tolist()], new.tolist()))
            while queue:
                progress.tick()
                i, dang, sid = heappop(queue)
                settled = best.fit(sid + 1)[sid]
                m, t, c = int(low_m.a[sid]), float(low_t.a[sid]), int(low_c.a[sid])
                if m >= settled:
                    continue
                src = chunks[c][0]
                if src >= 0 and self._exceeds(sources[src][0], i, sources[src][1], budget - sources[src][2]):
                    got = self._next_label(chunks, sid, i, settled, budget, sources)
                    if got is None:
                        continue
                    m, t, src = got
                best.a[sid] = m
                labels[(sid, tq)] = (m, t, sources[src][3:] if src >= 0 else None)
                if i == last:
                    seq: list[int] = []
                    node: tuple[int, int] | None = (sid, tq)
                    while node is not None and ix.state_set[node[0]] != 0:
                        seq.append(fam[int(ix.state_set[node[0]])])
                        node = labels[node][2]
                    seq.reverse()
                    return seq, (self._recompute_time(seq) if most else t)
                here = len(sources)
                sources.append((i, dang, m, sid, tq))
                ids, adds, dts = self._expand(i, dang, m, budget)
                if not len(ids):
                    continue
                m2 = m + adds
                keep = m2 < best.fit(int(ids.max()) + 1)[ids]
                ids, m2 = ids[keep], m2[keep]
                if not len(ids):
                    continue
                if most:  # the time the transition leaves out (rounding kept from going below 0)
                    t2 = t + np.maximum(set_time[ix.state_set[ids]] - set_time[i] - dts[keep], 0.0)
                else:
                    t2 = t + dts[keep]
                q2 = (t2 // quantum).astype(np.int64)
                order = np.argsort(q2, kind="stable")
                q2 = q2[order]
                cuts = np.flatnonzero(q2[1:] != q2[:-1]) + 1
                for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), len(q2)]):
                    q = int(q2[a])
                    sel = order[a:b]
                    chunk = (here, ids[sel], m2[sel], t2[sel])
                    if q == tq:
                        chunks.append(chunk)
                        absorb(len(chunks) - 1)
                    else:
                        tgt = buckets.get(q)
                        if tgt is None:
                            tgt = buckets[q] = []
                            heappush(pending, q)
                        tgt.append(chunk)
            for ids in touched:  # the next bucket starts with no candidates
                low_m.a[ids] = _INF
        return None

    def _set_times(self) -> np.ndarray:
        """``T(L)`` of every set of the family (seconds, exact sums), for the memory-centric search."""
        got = self._set_time
        if got is None:
            time = self.p.time
            got = self._set_time = np.array([math.fsum(time[v] for v in _bit_list(m)) for m in self.fam])
        return got

    def _recompute_time(self, seq: list[int]) -> float:
        """The recomputation time of a lower-set sequence (its transitions' times summed in order,
        as the table sums them)."""
        t, lower = 0.0, 0
        for upper in seq:
            t += _bookkeeping(self.p, lower, upper, 0)[0]
            lower = upper
        return t

    def _next_label(self, chunks: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]], sid: int,
                    j: int, settled: int, budget: int,
                    sources: list[tuple[int, int, int, int, int]]) -> tuple[int, float, int] | None:
        """The first of state ``sid``'s candidates in the bucket (by ``(m, t)``, earliest on
        ties) whose deferred check passes, as ``(m, t, source label)``; ``None`` when none
        with fewer kept bytes than ``settled`` does (:meth:`_search_exact`)."""
        merged = self._merged
        if merged is None or merged[0] is not chunks:  # a new bucket
            merged = self._merged = [chunks, 0, []]
        # (state ids, kept bytes, times, chunk of each) of merged runs of chunks, each sorted by
        # state id, so that a state's candidates are a slice
        parts = merged[2]
        if merged[1] < len(chunks):  # chunks added since: one more run
            new = range(merged[1], len(chunks))
            parts.append(_ranked(np.concatenate([chunks[c][1] for c in new]),
                                 np.concatenate([chunks[c][2] for c in new]),
                                 np.concatenate([chunks[c][3] for c in new]),
                                 np.concatenate([np.full(len(chunks[c][1]), c) for c in new])))
            merged[1] = len(chunks)
            while len(parts) > 1 and len(parts[-1][0]) * 2 >= len(parts[-2][0]):  # keep few runs
                b, a = parts.pop(), parts.pop()
                parts.append(_ranked(*(np.concatenate([x, y]) for x, y in zip(a, b))))
        cuts = [(int(part[0].searchsorted(sid)), int(part[0].searchsorted(sid, "right"))) for part in parts]
        ms, ts, cs = (np.concatenate([part[f][a:b] for part, (a, b) in zip(parts, cuts)]) for f in (1, 2, 3))
        for at in np.lexsort((cs, ts, ms)).tolist():  # by (m, t), then the order of the chunks
            m = int(ms[at])
            if m >= settled:
                return None
            src = chunks[int(cs[at])][0]
            i, dang, m0 = sources[src][:3]
            if not self._exceeds(i, j, dang, budget - m0):
                return m, float(ts[at]), src
        return None


def _ranked(ids: np.ndarray, ms: np.ndarray, ts: np.ndarray,
            cs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Candidate columns sorted by state id (see :meth:`_ExactSearches._next_label`, which orders a
    state's candidates itself)."""
    order = np.argsort(ids, kind="stable")
    return ids[order], ms[order], ts[order], cs[order]


class _Column:
    """A numpy array indexed by state id that grows (filled with ``fill``) as ids appear."""

    def __init__(self, dtype: Any, fill: Any) -> None:
        self.fill = fill
        self.a = np.full(1024, fill, dtype=dtype)

    def fit(self, size: int) -> np.ndarray:
        if size > len(self.a):
            grown = np.full(max(size, 2 * len(self.a)), self.fill, dtype=self.a.dtype)
            grown[:len(self.a)] = self.a
            self.a = grown
        return self.a
