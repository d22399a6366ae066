"""``dp-approx``'s searches: Algorithm 1 with the closed-form memory model.

:class:`ClosedDP` prices a set's successors with :class:`~autoremat.cost.closed_form.ClosedForm`
(O(1) plus the boundary each) and keeps them, in key order, as ``(key, j, need, dt_s, add)``;
on them run the feasibility table (least kept bytes per set), the time-centric label-setting
search (a dense ``(time bucket, set)`` table relaxed with numpy, or dict buckets for time grids
too fine for it) and the memory-centric table of Algorithm 1 (with max for min). See the
package docstring ("Algorithm", "Speed").
"""

from __future__ import annotations

from collections.abc import Sequence
from bisect import bisect_right
from heapq import heappop, heappush
from typing import Any

import numpy as np

from ...cost.bitsets import GraphBits
from ...cost.closed_form import ClosedForm, closed_peak
from .dp import LowerSetDP

__all__ = ["ClosedDP", "cell_front", "DENSE_CELLS", "SPARE_ROWS"]

DENSE_CELLS = 1 << 23  # (time bucket, set) cells of the dense label table; beyond it, dicts
SPARE_ROWS = 2  # dense table rows beyond T(V) / quantum (float sums may round past it; it grows)
_INF = 1 << 62  # "no label" in the int64 tables (budgets and byte counts stay far below)


class ClosedDP(LowerSetDP):
    """Algorithm 1 with :class:`~autoremat.cost.closed_form.ClosedForm` (``dp-approx``)."""

    def __init__(self, p: GraphBits, family: list[int], quantum: float) -> None:
        self.closed = ClosedForm(p)
        self.terms = [self.closed.terms(m) for m in family]
        super().__init__(p, family, quantum, [t.rho for t in self.terms], [[] for _ in family])
        self._arr: list[tuple | None] = [None] * len(family)

    def successors(self, i: int, limit: int) -> list[tuple[int, int, int, float, int]]:
        """Successors of set ``i`` with key ``<= limit`` (and maybe more), by key, priced:
        ``(key, j, need, dt_s, add)``."""
        lst = self.succ[i]
        if limit <= self.scanned[i]:
            return lst
        fam, keys = self.fam, self.keys
        lower = fam[i]
        order = self.order
        pos = self.scan[i]
        n = len(fam)
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
        terms = self.terms
        priced = self.closed.extend(lower, terms[i], [(fam[j], terms[j]) for j in found])
        lst.extend((keys[j], j, need, dt, add) for j, (need, dt, add) in zip(found, priced))
        return lst

    def vanilla_need(self) -> int:
        last = len(self.fam) - 1
        return self.closed.extend(0, self.terms[0], [(self.fam[last], self.terms[last])])[0][0]

    def model_peak(self, seq: Sequence[int]) -> tuple[int, float]:
        return closed_peak(self.p, seq, self.closed)

    def most_time(self, budget: int) -> tuple[list[int], float] | None:
        """The memory-centric table of Algorithm 1 (max for min, §4.4): ``cells[k][tq] = (m, t,
        back)``, the least kept bytes ``m`` per (set, quantised time) cell (ties: least ``t``),
        expanded over each cell's front of non-dominated entries (§4.2); the sequence with the
        most recomputation time that fits."""
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
            front = cell_front(entries)
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

    def feasible(self, budget: int) -> tuple[list[int], float] | None:
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

    def least_time(self, budget: int) -> tuple[list[int], float] | None:
        """Time-centric :meth:`run` for the closed-form model as a label-setting search.

        Times only grow along a sequence, so labels ``(set, t, m)`` are expanded in increasing
        ``floor(t / quantum)`` (bucket ``q``; sets in order within a bucket); a label whose
        ``m`` is not below the least ``m`` already expanded for its set is dominated (§4.2) and
        dropped, and the first label of ``V`` is the answer. It finds what the table of
        :meth:`most_time` (with min for max) would, but only expands labels up to the answer. The pending labels are a
        dense ``(bucket, set)`` table (least ``m``, then least ``t``; the first such label keeps
        its place) and each expanded label is relaxed into it with numpy.

        Long by design: the label-setting loop keeps its numpy tables and bound methods in locals
        (an expansion is ~20 numpy calls on short arrays, so per-call overhead is the search's
        cost)."""
        fam, keys = self.fam, self.keys
        quantum = self.quantum
        nsets = len(fam)
        last = nsets - 1
        inf = _INF
        # a bucket index never exceeds T(V) / quantum (each node is recomputed at most once)
        rows = max(1, int(sum(self.p.time) // quantum) + SPARE_ROWS)
        if rows * nsets > DENSE_CELLS:
            return self.least_time_sparse(budget)
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

    def least_time_sparse(self, budget: int) -> tuple[list[int], float] | None:
        """:meth:`least_time` with sparse dict buckets (for time grids too fine for a dense table).

        Times only grow along a sequence, so labels ``(set, t, m)`` are expanded in increasing
        ``floor(t / quantum)`` (a bucket queue; sets in order within a bucket); a label whose
        ``m`` is not below the least ``m`` already expanded for its set is dominated (§4.2) and
        dropped, and the first label of ``V`` is the answer. It finds what the table of
        :meth:`most_time` (with min for max) would, but only expands labels up to the answer.
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


def cell_front(entries: dict[int, tuple]) -> list[tuple[int, int, float]]:
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
