"""Algorithm 1 of Kusumoto et al. over a family of lower sets, for both memory models.

See :mod:`.kusumoto` ("Algorithm", "Speed"). :class:`_DP` holds the family, its successor
lists (priced lazily, by key), and the searches: feasibility (dp-approx: least kept bytes per
set; dp-exact: a depth-first dive, and the least-kept sequence for the minimum), time-centric
(label-setting in increasing time; dp-exact's on numpy chunks of candidate labels, priced a
state at a time by :mod:`.kusumoto_batch`) and the generic table (memory-centric).
"""

from __future__ import annotations

import math
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Iterator
from heapq import heappop, heappush
from typing import Any

import numpy as np

from .kusumoto_batch import _BatchPricer, _Interner
from .kusumoto_closed import _Closed
from .kusumoto_floor import _BackwardFloor
from .kusumoto_replay import _bookkeeping, _exact_transition, _grad_floor, _Seg
from .kusumoto_sets import _bit_list, _Prep

__all__: list[str] = []

_NONE_Q, _ZERO_Q, _ZERO_D, _NONE_I = array("q", [-1]), array("q", [0]), array("d", [0.0]), array("i", [-1])
_BATCH_MIN = 24  # fewer transitions to price than this: one at a time (see _price_all)
_INF = 1 << 62  # "no label" in the int64 tables (budgets and byte counts stay far below)
_DENSE_CELLS = 1 << 23  # (time bucket, set) cells of the dense label table; beyond it, dicts
_SPARE_ROWS = 2  # dense table rows beyond T(V) / quantum (float sums may round past it; it grows)


def _time_quantum(p: _Prep, slots: int) -> float:
    """Seconds per DP time unit: the nodes' common unit when it gives ≤ ``slots`` units, else T(V)/slots."""
    total = sum(p.time)
    if total <= 0:
        return 1.0
    ints = [round(t) for t in p.time]
    if all(abs(t - i) <= 1e-9 * max(1.0, abs(t)) for t, i in zip(p.time, ints)):
        unit = 0
        for i in ints:
            unit = math.gcd(unit, i)
        if unit and total / unit <= slots:
            return float(unit)
    return total / slots


class _DP:
    """Algorithm 1 of Kusumoto et al. on a family of lower sets, with sparse dict tables.

    ``cells[k][D][t] = (m, back)``: the least kept bytes ``m`` over sequences ending in the
    ``k``-th set with (quantised) recomputation time ``t`` whose every transition fits the
    budget; ``D`` is the set of dangling roots (always 0 for the closed-form model). Entries
    dominated in ``(t, m)`` are skipped (§4.2). The successors of a set are visited in order of
    a lower bound of their cost (the model's key), and stop once that bound alone exceeds
    what the budget leaves; their transition terms are computed once and kept.
    """

    def __init__(self, p: _Prep, family: list[int], quantum: float, exact: bool) -> None:
        self.p = p
        self.fam = family
        self.quantum = quantum
        self.exact = exact
        n = len(family)
        if exact:
            # held from the end of S's replay (or forward) to its own backward: saved outputs, extras
            lb = [0] * p.n
            for v in range(p.n):
                if p.rg[v]:
                    lb[v] = (p.alloc[v] if p.root[v] == v and v in p.saves[v] else 0) + p.extra[v]
            keys = [sum(lb[v] for v in _bit_list(m)) for m in family]
            self._seg: dict[tuple[int, int, int], _Seg] = {}
            self._step: dict[tuple[int, int], tuple[int, float, int, int]] = {}
            # per state, aligned with its successor list: lower bounds of the need (-1: none yet)
            # and the transitions priced so far, as columns (see _candidates); dangling sets interned
            self._moves: dict[tuple[int, int], tuple[array, array, array, array]] = {}
            # rooms from which V is known not to be reached / to be reached (see _feasible_exact)
            self._fail_room: dict[tuple[int, int], int] = {}
            self._ok: dict[tuple[int, int], tuple[int, list[int]]] = {}
            # the backward of a segment ending in L' starts with L''s boundary gradients and the
            # parameter gradients of the nodes after L' alive: a lower bound of its need
            closed = _Closed(p)
            pg = [closed.terms(m)[1] for m in family]
            self.floor = [_grad_floor(p, m) + pg[k] for k, m in enumerate(family)]
            # a recomputed segment S = L' \\ L, when its replay reaches its last saving node, holds
            # the copies of the storages of S that its own nodes save, their extras and the
            # parameter gradients of the nodes after L': rec_hi[L'] - rec_lo[L] bounds its need
            # from below (roots of L whose savers all lie after L' make it a bound, not an equality)
            copy_saved = [0] * p.n  # rg nodes x that save u = x or a predecessor of x
            for x in range(p.n):
                if p.rg[x]:
                    for u in p.saves[x]:
                        if u == x or u in p.pred[x]:
                            copy_saved[u] |= p.bit[x]
            copyable = [p.alias_of[v] is None and copy_saved[v] != 0 for v in range(p.n)]
            rg_extra = [p.extra[v] if p.rg[v] else 0 for v in range(p.n)]
            self.pg = pg
            self._bwd = _BackwardFloor(p)  # the tighter bound's sweep (tight_need)
            self._floors: dict[int, int] = {}
            self._tight: dict[tuple[int, int], int] = {}
            self.rec_hi, self.rec_lo = [], []
            for k, m in enumerate(family):
                ext = sum(rg_extra[v] for v in _bit_list(m))
                own = sum(p.alloc[v] for v in _bit_list(m) if copyable[v] and copy_saved[v] & m)
                held = sum(p.alloc[v] for v in _bit_list(m) if copyable[v])
                self.rec_hi.append(pg[k] + ext + own)
                self.rec_lo.append(ext + held)
            # prices a state's successors at once for the searches that visit them all
            self._rows = _BatchPricer(p, family, self.floor, self.rec_hi, self.rec_lo)
            self._pricer: _BatchPricer | None = self._rows if self._rows.ok else None
            # dangling sets and states (set, dangling set) by dense index (see _Interner)
            self._ix = _Interner(self._rows.words)
            self._merged: list[Any] | None = None  # the current bucket's chunks merged (_next_label)
        else:
            self.closed = _Closed(p)
            self.terms = [self.closed.terms(m) for m in family]
            keys = [t[0] for t in self.terms]
        self.keys = keys
        self.order = sorted(range(n), key=keys.__getitem__)
        ordered = [keys[k] for k in self.order]
        self.scan = [bisect_left(ordered, keys[k]) for k in range(n)]
        self.scanned = [-1] * n
        self._ordered = ordered
        self._order_np = np.asarray(self.order, dtype=np.intp)
        # successor lists in key order: (key, j, need, dt_s, add) (closed form), j (exact model)
        self.succ: list[Any] = [array("i") if exact else [] for _ in range(n)]
        self._arr: list[tuple | None] = [None] * n
        self.runs = 0
        self.transitions = 0

    # -------------------------------------------------------------- transitions
    def successors(self, i: int, limit: int) -> Any:
        """Successors of set ``i`` with key ``<= limit`` (and maybe more), by key: a list of
        ``(key, j, need, dt_s, add)`` (closed-form model) or an ``array`` of ``j`` (exact model,
        priced per state by :meth:`_candidates`; a GoogLeNet search holds tens of millions)."""
        lst = self.succ[i]
        if limit <= self.scanned[i]:
            return lst
        fam, keys = self.fam, self.keys
        lower = fam[i]
        order = self.order
        pos = self.scan[i]
        n = len(fam)
        if self.exact:  # supersets of L_i among the sets of the next keys, at once
            end = bisect_right(self._ordered, limit, lo=pos)
            cand = self._order_np[pos:end]
            rows = self._rows.members
            mine = rows[i]
            sup = ((rows[cand] & mine) == mine).all(axis=1) & (cand != i)
            found = cand[sup].tolist()
            pos = end
        else:
            found = []
            while pos < n:
                j = order[pos]
                if keys[j] > limit:
                    break
                pos += 1
                if j != i and not lower & ~fam[j]:
                    found.append(j)
        self.scan[i] = pos
        self.scanned[i] = limit if pos < n else 1 << 62
        self.transitions += len(found)
        if self.exact:
            lst.extend(found)
        else:
            terms = self.terms
            priced = self.closed.extend(lower, terms[i], [(fam[j], terms[j]) for j in found])
            lst.extend((keys[j], j, need, dt, add) for j, (need, dt, add) in zip(found, priced))
        return lst

    def exact_step(self, i: int, j: int, dang: int) -> tuple[int, float, int, int]:
        """:func:`_exact_transition` of ``L_i -> L_j`` from the dangling roots ``dang`` (cached)."""
        key = (i * len(self.fam) + j, dang)
        got = self._step.get(key)
        if got is None:
            got = self._step[key] = _exact_transition(self.p, self.fam[i], self.fam[j], dang, self._seg)
        return got

    def vanilla_need(self) -> int:
        """The model's peak of the plan without recomputation (one segment ``V``)."""
        last = len(self.fam) - 1
        if self.exact:
            return self.exact_step(0, last, 0)[0]
        return self.closed.extend(0, self.terms[0], [(self.fam[last], self.terms[last])])[0][0]

    # -------------------------------------------------------------- the table
    def run(self, budget: int, mode: str) -> tuple[list[int], float] | None:
        """``(lower-set sequence ending in V, its recomputation time)`` the DP picks, or ``None``.

        ``mode``: ``"time"`` (least recomputation time), ``"memory"`` (most, §4.4) or
        ``"feasible"`` (any; least kept bytes per state). Times are exact sums; a table cell
        is indexed by ``floor(t / quantum)`` and keeps its least ``m`` (ties: least ``t``).
        """
        self.runs += 1
        if mode == "time":
            return self._search_exact(budget) if self.exact else self._search_closed(budget)
        if mode == "feasible":
            return self._feasible_exact(budget) if self.exact else self._feasible_closed(budget)
        fam, keys = self.fam, self.keys
        nsets = len(fam)
        last = nsets - 1
        quantum = self.quantum
        exact = self.exact
        feasible = mode == "feasible"
        # cells[k][D][tq] = (m, t, back); back = (k', D', tq') or None
        cells: list[dict[int, dict[int, tuple[int, float, Any]]] | None] = [None] * nsets
        cells[0] = {0: {0: (0, 0.0, None)}}
        for i in range(last):
            tab = cells[i]
            if not tab:
                continue
            for dang, entries in tab.items():
                front = _front(entries, mode)
                m_min = front[-1][1]
                limit = keys[i] + budget - m_min
                items = (self._candidates(i, dang, m_min, budget, descending=False) if exact
                         else self.successors(i, limit))
                for item in items:
                    if exact:
                        j, move = item
                        dt, add, dang2, low = move
                        if not _improves(cells[j], dang2, front, budget - low, dt, add, quantum, feasible):
                            continue  # no entry that could fit would improve the target cell: no replay
                        if m_min + self.tight_need(i, j, dang, move) > budget:
                            continue
                        need, dt, add, dang2 = self.exact_step(i, j, dang)
                    else:
                        if item[0] > limit:
                            break
                        _, j, need, dt, add = item
                        dang2 = 0
                    thr = budget - need
                    if m_min > thr:
                        continue
                    tgt = cells[j]
                    if tgt is None:
                        tgt = cells[j] = {}
                    cell = tgt.get(dang2)
                    if cell is None:
                        cell = tgt[dang2] = {}
                    for tq, m, t in front:
                        if m > thr:
                            continue
                        t2 = 0.0 if feasible else t + dt
                        q2 = int(t2 // quantum)
                        m2 = m + add
                        old = cell.get(q2)
                        if old is None or m2 < old[0] or (m2 == old[0] and t2 < old[1]):
                            cell[q2] = (m2, t2, (i, dang, tq))
        final = cells[last]
        if not final:
            return None
        cell = final[0]
        q_best = max(cell) if mode == "memory" else min(cell)
        t_best = cell[q_best][1]
        seq: list[int] = []
        back: Any = (last, 0, q_best)
        while back is not None and back[0] != 0:
            k, dang, tq = back
            seq.append(fam[k])
            back = cells[k][dang][tq][2]  # type: ignore[index]
        seq.reverse()
        return seq, t_best

    def _arrays(self, i: int) -> tuple[int, Any, Any, Any, Any, list[int]]:
        """The successor list of set ``i`` (closed-form model) as numpy columns, extended when it
        grew: ``(length, j, need, dt_s, add, keys)``, in key order (the keys stay a list: ``bisect``
        on it is cheaper than ``searchsorted`` for one value)."""
        lst = self.succ[i]
        got = self._arr[i]
        if got is not None and got[0] == len(lst):
            return got
        done = 0 if got is None else got[0]
        tail = lst[done:]
        cols = list(zip(*tail)) if tail else [(), (), (), (), ()]
        new = (np.array(cols[1], dtype=np.int64), np.array(cols[2], dtype=np.int64),
               np.array(cols[3], dtype=np.float64), np.array(cols[4], dtype=np.int64))
        if got is not None and done:
            new = tuple(np.concatenate((a, b)) for a, b in zip(got[1:5], new))  # type: ignore[assignment]
        got = self._arr[i] = (len(lst), *new, [item[0] for item in lst])
        return got

    def _feasible_closed(self, budget: int) -> tuple[list[int], float] | None:
        """``"feasible"`` :meth:`run` for the closed-form model: least kept bytes per set."""
        fam, keys = self.fam, self.keys
        last = len(fam) - 1
        inf = 1 << 126
        best = [inf] * len(fam)
        back = [-1] * len(fam)
        best[0] = 0
        for i in range(last):
            m = best[i]
            if m == inf:
                continue
            room = budget - m
            limit = keys[i] + room
            for kj, j, need, _, add in self.successors(i, limit):
                if kj > limit:
                    break
                if need <= room and m + add < best[j]:
                    best[j] = m + add
                    back[j] = i
        if best[last] == inf:
            return None
        seq: list[int] = []
        k = last
        while k > 0:
            seq.append(fam[k])
            k = back[k]
        seq.reverse()
        return seq, 0.0

    def _search_closed(self, budget: int) -> tuple[list[int], float] | None:
        """Time-centric :meth:`run` for the closed-form model as a label-setting search.

        Times only grow along a sequence, so labels ``(set, t, m)`` are expanded in increasing
        ``floor(t / quantum)`` (bucket ``q``; sets in order within a bucket); a label whose
        ``m`` is not below the least ``m`` already expanded for its set is dominated (§4.2) and
        dropped, and the first label of ``V`` is the answer. It finds what the table of
        :meth:`run` would, but only expands labels up to the answer. The pending labels are a
        dense ``(bucket, set)`` table (least ``m``, then least ``t``; the first such label keeps
        its place) and each expanded label is relaxed into it with numpy.
        """
        fam, keys = self.fam, self.keys
        quantum = self.quantum
        nsets = len(fam)
        last = nsets - 1
        inf = _INF
        # a bucket index never exceeds T(V) / quantum (each node is recomputed at most once)
        rows = max(1, int(sum(self.p.time) // quantum) + _SPARE_ROWS)
        if rows * nsets > _DENSE_CELLS:
            return self._search_closed_sparse(budget)
        budget = min(budget, _INF)  # the int64 comparisons below; needs stay far below
        # flat (bucket * nsets + set) tables: one-dimensional fancy indexing is the cheaper kind
        pm = np.full(rows * nsets, inf, dtype=np.int64)  # pending m
        pt = np.zeros(rows * nsets, dtype=np.float64)    # its exact t
        pb = np.zeros(rows * nsets, dtype=np.int64)      # the cell it came from
        queued = np.zeros(rows, dtype=bool)
        best_np = np.full(nsets, inf, dtype=np.int64)
        best = [inf] * nsets
        labels: list[dict[int, int]] = [{} for _ in fam]  # set -> bucket -> previous cell
        succ, arrays, scanned = self.succ, self._arr, self.scanned
        count = np.count_nonzero  # far cheaper than ndarray.any() on short arrays
        pm[0] = 0
        pb[0] = -1
        queued[0] = True
        pending = [0]
        while pending:
            tq = heappop(pending)
            base = tq * nsets
            row_m, row_t = pm[base:base + nsets], pt[base:base + nsets]
            queue = (row_m < inf).nonzero()[0].tolist()
            while queue:
                i = heappop(queue)
                m = row_m.item(i)
                if m >= best[i]:
                    continue
                t = row_t.item(i)
                best[i] = m
                best_np[i] = m
                labels[i][tq] = pb.item(base + i)
                if i == last:
                    seq: list[int] = []
                    k, kq = last, tq
                    while k > 0:
                        seq.append(fam[k])
                        kq, k = divmod(labels[k][kq], nsets)
                    seq.reverse()
                    return seq, t
                room = budget - m
                limit = keys[i] + room
                if limit > scanned[i]:
                    self.successors(i, limit)
                got = arrays[i]
                if got is None or got[0] != len(succ[i]):
                    got = self._arrays(i)
                _, J, NEED, DT, ADD, KL = got
                c = bisect_right(KL, limit)
                if not c:
                    continue
                J = J[:c]
                m2 = ADD[:c] + m
                hit = ((NEED[:c] <= room) & (m2 < best_np[J])).nonzero()[0]
                if not hit.size:
                    continue
                J, m2 = J[hit], m2[hit]
                t2 = DT[:c][hit] + t
                q2 = (t2 // quantum).astype(np.int64)
                cell = q2 * nsets + J
                try:
                    old_m = pm[cell]
                except IndexError:  # float rounding past T(V) / quantum: grow the table
                    top = int(q2.max())
                    extra = (top + 1 - rows) * nsets
                    pm = np.concatenate([pm, np.full(extra, inf, dtype=np.int64)])
                    pt = np.concatenate([pt, np.zeros(extra)])
                    pb = np.concatenate([pb, np.zeros(extra, dtype=np.int64)])
                    queued = np.concatenate([queued, np.zeros(top + 1 - rows, dtype=bool)])
                    rows = top + 1
                    row_m, row_t = pm[base:base + nsets], pt[base:base + nsets]
                    old_m = pm[cell]
                better = m2 < old_m
                tie = m2 == old_m
                if count(tie):
                    better |= tie & (t2 < pt[cell])
                win = better.nonzero()[0]
                if not win.size:
                    continue
                if win.size < cell.size:
                    cell, J, q2, m2, t2, old_m = cell[win], J[win], q2[win], m2[win], t2[win], old_m[win]
                pm[cell] = m2
                pt[cell] = t2
                pb[cell] = base + i
                here = q2 == tq
                if count(here):  # new labels of the current bucket join its queue
                    for j in J[here & (old_m == inf)].tolist():
                        heappush(queue, j)
                fresh = q2[~queued[q2]]
                if fresh.size:
                    for q in np.unique(fresh).tolist():
                        queued[q] = True
                        heappush(pending, q)
        return None


    def _search_closed_sparse(self, budget: int) -> tuple[list[int], float] | None:
        """:meth:`_search_closed` with sparse dict buckets (for time grids too fine for a dense table).

        Times only grow along a sequence, so labels ``(set, t, m)`` are expanded in increasing
        ``floor(t / quantum)`` (a bucket queue; sets in order within a bucket); a label whose
        ``m`` is not below the least ``m`` already expanded for its set is dominated (§4.2) and
        dropped, and the first label of ``V`` is the answer. It finds what the table of
        :meth:`run` would, but only expands labels up to the answer.
        """
        fam, keys = self.fam, self.keys
        quantum = self.quantum
        last = len(fam) - 1
        inf = 1 << 126
        best = [inf] * len(fam)
        labels: list[dict[int, tuple[int, float, int, int]]] = [{} for _ in fam]
        # buckets[tq][set] = (m, t, previous set, previous tq)
        buckets: dict[int, dict[int, tuple[int, float, int, int]]] = {0: {0: (0, 0.0, -1, 0)}}
        pending = [0]
        while pending:
            tq = heappop(pending)
            bucket = buckets.pop(tq)
            queue = sorted(bucket)
            while queue:
                i = heappop(queue)
                label = bucket[i]
                m, t = label[0], label[1]
                if m >= best[i]:
                    continue
                best[i] = m
                labels[i][tq] = label
                if i == last:
                    seq: list[int] = []
                    k, kq = last, tq
                    while k > 0:
                        seq.append(fam[k])
                        _, _, k, kq = labels[k][kq]
                    seq.reverse()
                    return seq, t
                limit = keys[i] + budget - m
                for kj, j, need, dt, add in self.successors(i, limit):
                    if kj > limit:
                        break
                    m2 = m + add
                    if m + need > budget or m2 >= best[j]:
                        continue
                    t2 = t + dt
                    q2 = int(t2 // quantum)
                    if q2 != tq:
                        tgt = buckets.get(q2)
                        if tgt is None:
                            tgt = buckets[q2] = {}
                            heappush(pending, q2)
                    else:
                        tgt = bucket
                    old = tgt.get(j)
                    if old is None or m2 < old[0] or (m2 == old[0] and t2 < old[1]):
                        if old is None and q2 == tq:
                            heappush(queue, j)
                        tgt[j] = (m2, t2, i, tq)
        return None

    def _exact_moves(self, i: int, dang: int, m: int,
                     budget: int) -> list[tuple[int, tuple[float, int, int, int]]]:
        """Transitions of the exact model out of state ``(set i, dangling roots)`` with kept bytes
        ``m``: each larger lower set ``j`` that the budget can still admit, with its (cached)
        ``(time, added kept bytes, dangling roots, lower bound of the need)`` from
        :func:`_bookkeeping`, in the order of the successor list (see :meth:`_candidates`)."""
        return list(self._candidates(i, dang, m, budget, descending=False))

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

    def _candidates(self, i: int, dang: int, m: int, budget: int,
                    descending: bool) -> Iterator[tuple[int, tuple[float, int, int, int]]]:
        """:meth:`_exact_moves` as a generator, from the smallest successor up or (``descending``)
        from the largest down.

        A transition whose lower bound the budget cannot admit is left out (it would fail its
        deferred memory check anyway). The bound is first the cheap one (:attr:`floor`, and
        for a recomputed segment :attr:`rec_hi` - :attr:`rec_lo`: no bookkeeping), then
        :meth:`_move`'s. Ascending, every transition is priced up front (:meth:`_price_all`);
        descending (the feasibility dive, which stops at the first that fits), each only when
        it is reached.
        """
        room = budget - m
        lst, count, cols = self._columns(i, dang, room)
        bounds, dts, adds, dix, _ = cols
        if not descending:
            sets = self._ix.sets
            for pos in self._price_all(i, dang, lst, count, room, cols).tolist():
                yield lst[pos], (dts[pos], adds[pos], sets[dix[pos]], bounds[pos])
            return
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
        (not cached here: :meth:`_candidates` keeps what it prices)."""
        fam, p = self.fam, self.p
        lower, upper = fam[i], fam[j]
        recompute = p.recompute_flag(lower, upper)
        dt, add, dang2 = _bookkeeping(p, lower, upper, dang, recompute=recompute)
        # a lower bound of the transition's need (its replay is dear): the backward of S
        # starts with the kept bytes it adds and the gradients after L' alive
        low = add + self.floor[j]
        if recompute:  # the dangling roots it holds stay too
            low = max(low, add + self.rec_hi[j] - self.rec_lo[i] + self._kept_grads(i, j))
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
        stack = [(start, 0, self._candidates(0, 0, 0, budget, descending=True))]
        while stack:
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
                    stack.append((nxt, m2, self._candidates(j, dang2, m2, budget, descending=True)))
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
        while heap:
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

    def _search_exact(self, budget: int) -> tuple[list[int], float] | None:
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
        """
        fam, quantum, ix = self.fam, self.quantum, self._ix
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
                self._merged = [chunks, len(chunks), [(ids, ms, ts, cs)]]  # for _next_label
                order = np.lexsort((cs, ts, ms, ids))
                ranked = ids[order]
                win = order[np.flatnonzero(np.r_[True, ranked[1:] != ranked[:-1]])]
                new = ids[win]
                size = int(new.max()) + 1
                low_m.fit(size)[new], low_t.fit(size)[new], low_c.fit(size)[new] = ms[win], ts[win], cs[win]
                touched.append(new)
                sets_of = ix.sets
                queue = sorted(zip(ix.state_set[new].tolist(),
                                   [sets_of[k] for k in ix.state_dang[new].tolist()], new.tolist()))
            while queue:
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
                    return seq, t
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

    def _next_label(self, chunks: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]], sid: int,
                    j: int, settled: int, budget: int,
                    sources: list[tuple[int, int, int, int, int]]) -> tuple[int, float, int] | None:
        """The first of state ``sid``'s candidates in the bucket (by ``(m, t)``, earliest on
        ties) whose deferred check passes, as ``(m, t, source label)``; ``None`` when none
        with fewer kept bytes than ``settled`` does (:meth:`_search_exact`)."""
        merged = self._merged
        if merged is None or merged[0] is not chunks:  # a new bucket
            merged = self._merged = [chunks, 0, []]
        parts = merged[2]  # (state ids, kept bytes, times, chunk of each) of merged runs of chunks
        if merged[1] < len(chunks):  # chunks added since: one more run
            new = range(merged[1], len(chunks))
            parts.append((np.concatenate([chunks[c][1] for c in new]),
                          np.concatenate([chunks[c][2] for c in new]),
                          np.concatenate([chunks[c][3] for c in new]),
                          np.concatenate([np.full(len(chunks[c][1]), c) for c in new])))
            merged[1] = len(chunks)
            while len(parts) > 1 and len(parts[-1][0]) * 2 >= len(parts[-2][0]):  # keep few runs
                b, a = parts.pop(), parts.pop()
                parts.append(tuple(np.concatenate([x, y]) for x, y in zip(a, b)))
        hits = [np.flatnonzero(part[0] == sid) for part in parts]
        ms, ts, cs = (np.concatenate([part[f][hit] for part, hit in zip(parts, hits)]) for f in (1, 2, 3))
        for at in np.lexsort((cs, ts, ms)).tolist():  # by (m, t), then the order of the chunks
            m = int(ms[at])
            if m >= settled:
                return None
            src = chunks[int(cs[at])][0]
            i, dang, m0 = sources[src][:3]
            if not self._exceeds(i, j, dang, budget - m0):
                return m, float(ts[at]), src
        return None


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


def _improves(tab: dict[int, dict[int, tuple[int, float, Any]]] | None, dang: int,
              front: list[tuple[int, int, float]], thr: int, dt: float, add: int, quantum: float,
              feasible: bool) -> bool:
    """Whether some entry of ``front`` with ``m <= thr`` would update the cell ``tab[dang]`` in
    :meth:`_DP.run` (the update rule there: a new time bucket, or fewer kept bytes, or as many
    in less time). When none would against the cell as it is, none does in turn either, so the
    transition's replay can be skipped (``thr`` from a lower bound of its need)."""
    cell = None if tab is None else tab.get(dang)
    if not cell:
        return any(m <= thr for _, m, _ in front)
    for _, m, t in front:
        if m > thr:
            continue
        t2 = 0.0 if feasible else t + dt
        old = cell.get(int(t2 // quantum))
        m2 = m + add
        if old is None or m2 < old[0] or (m2 == old[0] and t2 < old[1]):
            return True
    return False


def _front(entries: dict[int, tuple], mode: str) -> list[tuple[int, int, float]]:
    """Non-dominated ``(tq, m, t)`` of one DP cell (§4.2: skip ``t' > t`` with ``m' >= m``).

    Ordered so that ``m`` strictly decreases: ``tq`` ascending (time), descending (memory);
    in ``"feasible"`` mode only the least ``m``.
    """
    if mode == "feasible":
        tq = min(entries, key=lambda k: entries[k][0])
        return [(tq, entries[tq][0], entries[tq][1])]
    out: list[tuple[int, int, float]] = []
    best = -1
    for tq in sorted(entries, reverse=mode == "memory"):
        m, t = entries[tq][0], entries[tq][1]
        if best < 0 or m < best:
            out.append((tq, m, t))
            best = m
    return out
