"""Algorithm 1 of Kusumoto et al. over a family of lower sets, for both memory models.

See :mod:`.kusumoto` ("Algorithm", "Speed"). :class:`_DP` holds the family, its successor
lists (priced lazily, by key), and the searches (the exact model's in :mod:`.kusumoto_exact`): feasibility (dp-approx: least kept bytes per
set; dp-exact: a depth-first dive, and the least-kept sequence for the minimum), time-centric
(label-setting in increasing time; dp-exact's on numpy chunks of candidate labels, priced a
state at a time by :mod:`.kusumoto_batch`) and memory-centric (dp-approx: the table of
Algorithm 1 with max; dp-exact: the time-centric search on the time left out).
"""

from __future__ import annotations

import math
from array import array
from bisect import bisect_left, bisect_right
from heapq import heappop, heappush
from typing import Any

import numpy as np

from .kusumoto_batch import _BatchPricer, _Interner
from .kusumoto_closed import _Closed
from .kusumoto_exact import _INF, _ExactSearches
from .kusumoto_floor import _BackwardFloor
from .kusumoto_replay import _exact_transition, _grad_floor, _Seg
from .kusumoto_sets import _bit_list, _Prep

__all__: list[str] = []

_DENSE_CELLS = 1 << 23  # (time bucket, set) cells of the dense label table; beyond it, dicts
_SPARE_ROWS = 2  # dense table rows beyond T(V) / quantum (float sums may round past it; it grows)
_LOST_SPLIT = 16  # the memory-centric search's buckets per table quantum, for times without a unit


def _time_unit(p: _Prep) -> float | None:
    """The nodes' common time unit (the gcd of integer times), or ``None`` when they have none."""
    ints = [round(t) for t in p.time]
    if not all(abs(t - i) <= 1e-9 * max(1.0, abs(t)) for t, i in zip(p.time, ints)):
        return None
    unit = 0
    for i in ints:
        unit = math.gcd(unit, i)
    return float(unit) if unit else None


def _time_quantum(p: _Prep, slots: int) -> float:
    """Seconds per DP time unit: the nodes' common unit when it gives ≤ ``slots`` units, else T(V)/slots."""
    total = sum(p.time)
    if total <= 0:
        return 1.0
    unit = _time_unit(p)
    if unit is not None and total / unit <= slots:
        return unit
    return total / slots


class _DP(_ExactSearches):
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
        # the memory-centric search's buckets (of time left out): the nodes' common unit where the
        # times have one, else a sixteenth of the table's quantum (only the buckets it reaches
        # exist, however many T(V) would span; see kusumoto "Algorithm")
        self.lost_quantum = _time_unit(p) or quantum / _LOST_SPLIT
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
            # and the transitions priced so far, as columns (see _columns); dangling sets interned
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
            self._rows = _BatchPricer(p, family, self.floor, self.rec_hi, self.rec_lo, self._bwd)
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
        priced per state by :meth:`_columns`; a GoogLeNet search holds tens of millions)."""
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
        ``"feasible"`` (any; least kept bytes per state). The exact model runs its searches
        (:mod:`.kusumoto_exact`; memory-centric: the time-centric search on the time left out);
        the closed-form model's memory-centric run is the table below. Times are exact sums; a
        table cell is indexed by ``floor(t / quantum)`` and keeps its least ``m`` (ties: least ``t``).
        """
        self.runs += 1
        if mode == "time":
            return self._search_exact(budget) if self.exact else self._search_closed(budget)
        if mode == "feasible":
            return self._feasible_exact(budget) if self.exact else self._feasible_closed(budget)
        if self.exact:
            return self._search_exact(budget, most=True)
        fam, keys = self.fam, self.keys
        nsets = len(fam)
        last = nsets - 1
        quantum = self.quantum
        # cells[k][tq] = (m, t, back); back = (k', tq') or None
        cells: list[dict[int, tuple[int, float, Any]] | None] = [None] * nsets
        cells[0] = {0: (0, 0.0, None)}
        for i in range(last):
            entries = cells[i]
            if not entries:
                continue
            front = _front(entries)
            m_min = front[-1][1]
            limit = keys[i] + budget - m_min
            for key, j, need, dt, add in self.successors(i, limit):
                if key > limit:
                    break
                thr = budget - need
                if m_min > thr:
                    continue
                cell = cells[j]
                if cell is None:
                    cell = cells[j] = {}
                for tq, m, t in front:
                    if m > thr:
                        continue
                    t2 = t + dt
                    q2 = int(t2 // quantum)
                    m2 = m + add
                    old = cell.get(q2)
                    if old is None or m2 < old[0] or (m2 == old[0] and t2 < old[1]):
                        cell[q2] = (m2, t2, (i, tq))
        final = cells[last]
        if not final:
            return None
        q_best = max(final)
        t_best = final[q_best][1]
        seq: list[int] = []
        back: Any = (last, q_best)
        while back is not None and back[0] != 0:
            k, tq = back
            seq.append(fam[k])
            back = cells[k][tq][2]  # type: ignore[index]
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


def _front(entries: dict[int, tuple]) -> list[tuple[int, int, float]]:
    """Non-dominated ``(tq, m, t)`` of one memory-centric DP cell (§4.2: skip ``t' < t`` with
    ``m' >= m``), ``tq`` descending, so that ``m`` strictly decreases."""
    out: list[tuple[int, int, float]] = []
    best = -1
    for tq in sorted(entries, reverse=True):
        m, t = entries[tq][0], entries[tq][1]
        if best < 0 or m < best:
            out.append((tq, m, t))
            best = m
    return out
