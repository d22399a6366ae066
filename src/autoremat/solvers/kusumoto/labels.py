"""``dp-exact``'s time- and memory-centric searches: label setting on numpy chunks.

:class:`LabelSearch` expands labels of states ``(set, dangling roots)`` in increasing
(quantised) recomputation time; a transition's time and kept bytes come from
:class:`~.exact.ExactDP`'s per-state columns, its peak (a replay) is checked only when the label
it produced is popped. Memory-centric (§4.4), the same search runs on the time each transition
leaves out. See the package docstring ("Algorithm", "Speed").
"""

from __future__ import annotations

import math
from heapq import heappop, heappush
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from ...cost.bitsets import bit_list
from .dive import Progress

if TYPE_CHECKING:
    from .exact import ExactDP

__all__ = ["LabelSearch", "Column", "Source", "by_state"]

_INF = 1 << 62  # "no label" in the int64 tables (budgets and byte counts stay far below)


class Source(NamedTuple):
    """An expanded label: the source of the candidate labels it produced."""

    set: int
    dang: int
    m: int
    sid: int
    bucket: int


class LabelSearch:
    """The label-setting searches of the exact model over :class:`~.exact.ExactDP`."""

    def __init__(self, dp: ExactDP) -> None:
        self.dp = dp
        self._set_time: np.ndarray | None = None  # T(L) per set (see set_times)
        self._merged: list[Any] | None = None  # the current bucket's chunks merged (next_label)

    def run(self, budget: int, most: bool = False) -> tuple[list[int], float] | None:
        """:meth:`.closed.ClosedDP.least_time` for the exact model: labels of states ``(set, dangling roots)``.

        A transition's time and kept bytes come from set operations (:meth:`price_all`); its
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
        (see :class:`.dp.LowerSetDP`), and the time returned is the sequence's recomputation time.

        Long by design: the bucket loop's state (per-state columns, chunk lists, the source labels)
        is shared by the absorption, the deferred checks and the expansion of each popped label."""
        dp = self.dp
        fam, quantum, ix = dp.fam, dp.quantum, dp.interner
        if most:
            set_time = self.set_times()
            quantum = dp.lost_quantum
        last = len(fam) - 1
        first = int(ix.state_ids(np.zeros(1, dtype=np.intp), np.array([ix.dangling(0)]))[0])
        best = Column(np.int64, _INF)  # kept bytes of each state's settled label
        low_m = Column(np.int64, _INF)  # per state: least candidate of the current bucket
        low_t = Column(np.float64, 0.0)
        low_c = Column(np.int64, -1)  # its chunk (index in the bucket's list)
        # sources[label]: the Source of an expanded
        # label; labels[(state id, bucket)] = (m, t, (state id, bucket) of its source)
        sources: list[Source] = []
        labels: dict[tuple[int, int], tuple[int, float, tuple[int, int] | None]] = {}
        one = np.array([first], dtype=np.int64)
        buckets: dict[int, list[tuple[int, np.ndarray, np.ndarray, np.ndarray]]] = {
            0: [(-1, one, np.zeros(1, dtype=np.int64), np.zeros(1))]}
        pending = [0]
        progress = Progress(dp, "memory-centric search" if most else "time-centric search", budget)
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
                self._merged = [chunks, len(chunks), [(ranked, ms[order], ts[order], cs[order])]]  # for next_label
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
                if src >= 0 and dp.exceeds(sources[src].set, i, sources[src].dang, budget - sources[src].m):
                    got = self.next_label(chunks, sid, i, settled, budget, sources)
                    if got is None:
                        continue
                    m, t, src = got
                best.a[sid] = m
                labels[(sid, tq)] = (m, t, (sources[src].sid, sources[src].bucket) if src >= 0 else None)
                if i == last:
                    seq: list[int] = []
                    node: tuple[int, int] | None = (sid, tq)
                    while node is not None and ix.state_set[node[0]] != 0:
                        seq.append(fam[int(ix.state_set[node[0]])])
                        node = labels[node][2]
                    seq.reverse()
                    return seq, (dp.recompute_time(seq) if most else t)
                here = len(sources)
                sources.append(Source(i, dang, m, sid, tq))
                ids, adds, dts = dp.expand(i, dang, m, budget)
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

    def set_times(self) -> np.ndarray:
        """``T(L)`` of every set of the family (seconds, exact sums), for the memory-centric search."""
        got = self._set_time
        if got is None:
            time = self.dp.p.time
            got = self._set_time = np.array([math.fsum(time[v] for v in bit_list(m)) for m in self.dp.fam])
        return got

    def next_label(self, chunks: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]], sid: int,
                    j: int, settled: int, budget: int,
                   sources: list[Source]) -> tuple[int, float, int] | None:
        """The first of state ``sid``'s candidates in the bucket (by ``(m, t)``, earliest on
        ties) whose deferred check passes, as ``(m, t, source label)``; ``None`` when none
        with fewer kept bytes than ``settled`` does (:meth:`run`)."""
        merged = self._merged
        if merged is None or merged[0] is not chunks:  # a new bucket
            merged = self._merged = [chunks, 0, []]
        # (state ids, kept bytes, times, chunk of each) of merged runs of chunks, each sorted by
        # state id, so that a state's candidates are a slice
        parts = merged[2]
        if merged[1] < len(chunks):  # chunks added since: one more run
            new = range(merged[1], len(chunks))
            parts.append(by_state(np.concatenate([chunks[c][1] for c in new]),
                                 np.concatenate([chunks[c][2] for c in new]),
                                 np.concatenate([chunks[c][3] for c in new]),
                                 np.concatenate([np.full(len(chunks[c][1]), c) for c in new])))
            merged[1] = len(chunks)
            while len(parts) > 1 and len(parts[-1][0]) * 2 >= len(parts[-2][0]):  # keep few runs
                b, a = parts.pop(), parts.pop()
                parts.append(by_state(*(np.concatenate([x, y]) for x, y in zip(a, b))))
        cuts = [(int(part[0].searchsorted(sid)), int(part[0].searchsorted(sid, "right"))) for part in parts]
        ms, ts, cs = (np.concatenate([part[f][a:b] for part, (a, b) in zip(parts, cuts)]) for f in (1, 2, 3))
        for at in np.lexsort((cs, ts, ms)).tolist():  # by (m, t), then the order of the chunks
            m = int(ms[at])
            if m >= settled:
                return None
            src = chunks[int(cs[at])][0]
            i, dang, m0 = sources[src].set, sources[src].dang, sources[src].m
            if not self.dp.exceeds(i, j, dang, budget - m0):
                return m, float(ts[at]), src
        return None


def by_state(ids: np.ndarray, ms: np.ndarray, ts: np.ndarray,
            cs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Candidate columns sorted by state id (see :meth:`LabelSearch.next_label`, which orders a
    state's candidates itself)."""
    order = np.argsort(ids, kind="stable")
    return ids[order], ms[order], ts[order], cs[order]


class Column:
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
