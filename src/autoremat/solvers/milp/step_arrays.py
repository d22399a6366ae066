"""The steps out of one lower set as numpy arrays for ``milp``'s cost-to-go, priced in one batch.

:class:`.cost_to_go.CostToGo` relaxes every step ``L_i -> L_j`` (both flags where the segment
may be recomputed) with a lower bound of its need, the kept bytes it adds at the roots that
dangle on every path (:meth:`.lattice.Lattice.certain_dangling`, ``cd``) and its time. Priced one
pair at a time (:meth:`.lattice.Lattice.step`: :func:`~autoremat.cost.segment_replay.pair_bookkeeping`
and :meth:`~autoremat.cost.backward_floor.TransitionBounds.move_bound` on Python ints), that was
most of ``h``'s time: 27 of 45 s under a profiler on PSPNet at CPU size, 50 % (1.1 M steps;
x86_64, 2 cores), so ``h`` was partial there (``h = 0`` at the root: no bound at all).

:class:`StepArrays` prices every successor of a set at once with
:class:`~autoremat.cost.batch_pricing.BatchPricer` from the dangling roots ``cd``, once with
every segment plain and once with the recomputable ones recomputed (``milp``'s flags are free),
and gives the same arrays as the pair-at-a-time terms: with ``g`` the key gap, the need bound
is ``max(g, cheap, low)``, where the pricer's ``low`` is ``move_bound``'s (with the kept bytes
it adds, the ``cd`` roots it holds included) and ``cheap`` is
:meth:`~autoremat.cost.backward_floor.TransitionBounds.cheap_bound`; the kept bytes added and
the time are the pricer's (held equal to the pair-at-a-time terms on seeded random networks
with views, pass-through nodes and held outputs, ``tests/solvers/milp/test_step_arrays.py``;
:class:`~autoremat.cost.batch_pricing.BatchPricer` itself to the scalar model in
``tests/cost/test_batch_pricing.py``). The step into ``V`` (its terms differ: nothing is kept
after it) is priced by :meth:`.lattice.Lattice.step`. Where the pricer's precondition fails
(a node saving a non-ancestor's storage: ``BatchPricer.ok``) every step is priced one at a time.

Exact needs (``exact``) are applied after, one step at a time, as before
(:meth:`.lattice.Lattice.need` on the steps the bounds let fit).

Complexity: per set, two numpy passes over its successors (O(successors × words)) plus one
Python step into ``V``; cached per set (recomputed when more successors are scanned).
"""

from __future__ import annotations

import numpy as np

from ...cost.batch_pricing import BatchPricer

__all__ = ["StepArrays"]


class StepArrays:
    """``arrays(i, budget, exact)``: :meth:`.lattice.Lattice.move_arrays` (see the module docstring)."""

    def __init__(self, lat, batch: bool = True) -> None:
        self.lat = lat
        self.batch = batch
        self.keys = np.asarray(lat.keys, dtype=np.int64)
        self._pricer: BatchPricer | None = None
        self._cache: dict[tuple[int, bool], tuple[int, tuple | None]] = {}

    @property
    def pricer(self) -> BatchPricer | None:
        if self._pricer is None and self.batch:
            self._pricer = BatchPricer(self.lat.p, self.lat.bounds)
            self.batch = self._pricer.ok
        return self._pricer if self.batch else None

    def arrays(self, i: int, budget: int, exact: bool = False):
        """Set ``i``'s steps as ``(need bound, kept bytes added, time, target set)`` arrays, or
        ``None`` without steps (cached per set; see :meth:`.lattice.Lattice.move_arrays`)."""
        lat = self.lat
        succ = lat.successors(i, lat.keys[i] + budget)
        got = self._cache.get((i, exact))
        if got is None or got[0] != len(succ):
            rows = self._scalar(i, budget) if self.pricer is None else self._batch(i, succ)
            if rows is not None and exact:
                rows = self._exact(i, budget, rows)
            got = self._cache[(i, exact)] = (len(succ), rows)
        return None if got[1] is None else got[1][:4]

    def _scalar(self, i: int, budget: int) -> tuple | None:
        """Pair at a time, from :meth:`.lattice.Lattice.step`'s cached terms."""
        lat = self.lat
        moves = lat.moves_of(i, budget)
        if not moves:
            return None
        cd, nbytes = lat.certain_dangling(i), lat.p.nbytes
        rows = []
        for gap, j, f, cheap, dt, reach, add, _, _, low in moves:
            held = nbytes(reach & cd)
            rows.append((max(gap, cheap, low + add + held), add + held, dt, j, f))
        return _columns(rows)

    def _batch(self, i: int, succ: list[int]) -> tuple | None:
        lat, pr = self.lat, self.pricer
        assert pr is not None
        if not succ:
            return None
        js = np.asarray(succ, dtype=np.intp)
        inner = js[js != lat.last]
        cd = lat.certain_dangling(i)
        keys = self.keys
        parts: list[tuple] = []
        if len(inner):
            gap = keys[inner] - keys[i]
            floor = pr.floor[inner]
            dt, add, _, low = pr.price(i, cd, inner, np.zeros(len(inner), dtype=bool))
            parts.append((np.maximum(np.maximum(gap, floor), low), add, dt, inner, np.zeros(len(inner), dtype=bool)))
            can = pr.segments(i, inner)[1]
            rj = inner[can]
            if len(rj):
                dt, add, _, low = pr.price(i, cd, rj, np.ones(len(rj), dtype=bool))
                cheap = np.maximum(pr.floor[rj], pr.rec_hi[rj] - pr.rec_lo[i])
                parts.append((np.maximum(np.maximum(gap[can], cheap), low), add, dt, rj, np.ones(len(rj), dtype=bool)))
        if len(inner) < len(js):  # the step into V: its own terms (Lattice.step)
            last, nbytes = lat.last, lat.p.nbytes
            rows = []
            for f in lat.flags(i, last):
                cheap, dt, reach, add, _, _, low = lat.step(i, last, f)
                held = nbytes(reach & cd)
                rows.append((max(keys[last] - keys[i], cheap, low + add + held), add + held, dt, last, f))
            parts.append(_columns(rows))
        req, add, dt, j, flag = (np.concatenate(x) for x in zip(*parts))
        return req.astype(np.int64), add.astype(np.int64), dt.astype(np.float64), j.astype(np.intp), flag

    def exact_needs(self, i: int, idx: list[int], budget: int) -> np.ndarray:
        """The exact model's need at the certainly dangling roots of the steps at positions
        ``idx`` of :meth:`arrays`' bounded arrays of set ``i`` (:meth:`.lattice.Lattice.need`)."""
        _, _, _, j, flag = self._cache[(i, False)][1]
        return self._needs(i, j, flag, idx, budget)

    def _needs(self, i: int, j: np.ndarray, flag: np.ndarray, idx: list[int], budget: int) -> np.ndarray:
        """:meth:`.lattice.Lattice.need` at the certainly dangling roots of set ``i`` for the steps
        at positions ``idx`` of the columns ``j`` (target sets) and ``flag``."""
        lat = self.lat
        cd = lat.certain_dangling(i)
        return np.asarray([lat.need(i, int(j[k]), cd, bool(flag[k]), budget) for k in idx], dtype=np.int64)

    def _exact(self, i: int, budget: int, rows: tuple) -> tuple:
        """The exact model's need at the certainly dangling roots for the steps the bounds let
        fit (:meth:`.lattice.Lattice.need`; the need never falls when more roots dangle)."""
        req, add, dt, j, flag = rows
        req = req.copy()
        idx = np.flatnonzero(req <= budget).tolist()
        if idx:
            req[idx] = np.maximum(req[idx], self._needs(i, j, flag, idx, budget))
        return req, add, dt, j, flag


def _columns(rows: list[tuple]) -> tuple:
    """Rows ``(need, add, time, set, flag)`` as columns."""
    req, add, dt, j, flag = zip(*rows)
    return (np.asarray(req, dtype=np.int64), np.asarray(add, dtype=np.int64), np.asarray(dt, dtype=np.float64),
            np.asarray(j, dtype=np.intp), np.asarray(flag, dtype=bool))
