"""A lower bound of the extra time still to pay from a state of the lattice search (A* keys).

The lattice search (:mod:`.lattice`) takes labels ``(t, m)`` at states ``(L, D)`` (lower set,
dangling roots; ``m``: the kept bytes). Taken in increasing ``t`` alone, its proven bound (the
next key) climbs slowly on graphs with many states (DenseNet-121: ~2.1e-6 s after 47 s against
an optimum near 4e-6 s). :class:`CostToGo` gives ``h(L, m)``, a lower bound of the least extra
time of any continuation from any state ``(L, D)`` with kept bytes ``m`` within the budget, so
that labels are taken by ``t + h`` (A*) and the bound is the least ``t + h`` queued.

The relaxation: the dangling roots are dropped (a step holds none, so it adds only the kept
bytes ``add`` it adds by itself) and a step's need is replaced by the lower bounds the search
already prunes with (the key gap, :meth:`~autoremat.cost.backward_floor.TransitionBounds.cheap_bound`
and ``move_bound + add``). Every step the exact model allows from ``(L, D, m)`` is allowed in the
relaxation from ``(L, m)`` with the same time and a kept-bytes increase that is not larger;
the relaxation's cost-to-go is non-decreasing in ``m`` (less kept bytes admit every step more
do), so it is a lower bound of the exact one.

Exact needs (``exact_until``): the sets the DP relaxes before that time price each step the
bounds let fit with the exact model's need at the roots that dangle on *every* path to the set
(:meth:`~.lattice.Lattice.certain_dangling`; :meth:`~.lattice.Lattice.need`, one replay per
segment, shared with the search). The exact need never falls when more roots dangle
(``tests/solvers/milp/test_exact_needs.py`` checks it along random walks of seeded networks),
so it is a lower bound of the step's need on every path and ``h`` stays a consistent lower
bound; any mix of exact and bounded sets is one. Measured before (x86_64, 2 cores, shared): PSPNet
at CPU size, ``milp``'s least budget, ``h`` at the empty set 2.29e-6 s with the bounds, 3.60e-6 s
with exact needs everywhere (best plan known 3.95e-6 s); paid at every step the bounds let fit
they cost ~30 s more on a cold lattice (PSPNet at 50 %: 195 s against 53 s at load 5).

So they are paid lazily (:meth:`CostToGo._refine`): a set's row is computed with the bounds;
then a step that attains the row's least at a grid point that no step with a known exact need
attains gets its exact need (one per such point), and again until every finite point is
attained by one. Raising a need only drops grid points from its step's prefix, so the row
never falls, and at the end it equals the row exact needs at every step give (its value at
each point is at least the bounds' row and at most the attaining step's): equal tables in
``tests/solvers/milp/test_step_arrays.py``. Measured (x86_64, 2 cores, load ~1.5): PSPNet at
CPU size, 50 %, exact needs at every set in 22.7 s with 9,510 replays (eagerly: 656,644
replays, 174 s under a profiler), ``h`` at the empty set 2.408e-6 s against 1.326e-6 s with the
bounds; the A* then closed at the optimum, 2.412e-6 s (best heuristic plan 2.770e-6 s).
The table is built in two passes: the bounds' (priced in batches, :mod:`.step_arrays`; PSPNet:
5 s), then the exact needs' until ``exact_until`` (:meth:`CostToGo._exact_pass`; a row not
reached keeps the bounds' value), so running out of time for exact needs never leaves ``h = 0``.

It is computed by a backward DP over the lower sets (supersets first) on a grid of ``m``
(points ``0, u, 2u, …`` up to the budget, ``u`` the least power of two giving at most
:data:`GRID` points and :data:`CELLS` cells; tensor sizes are mostly multiples of a power of
two, so most steps' kept bytes land on the grid): ``h(L, g)`` for a grid point ``g`` is taken
as the value for every ``m`` in ``[g, g + u)``, and a step's end ``g + add`` is rounded down to
the grid (measured on DenseNet-121 at 50 %: ``h`` at the empty set 3.75e-6 s with 1024
points, 3.95e-6 s with 8192, the optimum's incumbent 4.49e-6 s).
Both roundings only lower ``h`` (it is non-decreasing in ``m``), so ``h`` stays a lower bound;
it is also consistent (``h(L, m) <= dt + h(L', m')`` along every exact step), so the first
label taken at the full set is optimal and ``t + h`` never decreases along a path (the least
queued key is a proven bound). ``h = inf`` proves that no continuation fits: such labels are
dropped. Stopped by its deadline, the DP leaves ``h = 0`` at the sets it did not reach. Held
to the brute force in ``tests/solvers/milp/test_cost_to_go.py``.

Complexity: O(steps) Python bookkeeping (the lattice's own step terms, cached and shared with
the search) plus O(steps × G) in numpy per budget.
"""

from __future__ import annotations

import math
import time

import numpy as np

__all__ = ["CostToGo", "GRID", "CELLS", "STEP_WORK"]

GRID = 8192
"""Grid points of ``m`` in ``[0, budget]`` (more: a tighter ``h``, a dearer DP)."""

CELLS = 1 << 24
"""At most this many table cells (lower sets × grid points: 128 MiB of float64; PSPNet at CPU size,
1545 lower sets, keeps all 8192 points, as in the benchmark)."""


STEP_WORK = 7
"""Work units per step relaxed (the ``work`` limit; calibrated with the search's units,
:data:`.lattice.CHECK_WORK`)."""


class CostToGo:
    """``h(L, m)`` over one lattice at one budget (see the module docstring)."""

    def __init__(self, lattice, budget: int, grid: int = GRID, deadline: float = math.inf,
                 work: float = math.inf, exact_until: float = -math.inf, lazy: bool = True) -> None:
        self.budget = max(0, int(budget))
        self.deadline = deadline
        self.exact_until = exact_until  # sets relaxed before this monotonic time get exact needs
        self.exact_sets = 0
        self.lazy = lazy  # exact needs only for the steps that attain a row's least (_refine)
        self.refined = 0  # steps given their exact need by _refine
        self.partial = 0  # sets the DP did not reach by the deadline (h = 0 there)
        self.work_limit = work
        self.work = 0  # STEP_WORK per step relaxed so far (the table is None when it passed `work`)
        # grid step: a power of two (tensor sizes are mostly multiples of one: their kept bytes
        # then land on the grid and lose nothing), at most `grid` points up to the budget
        points = max(2, min(grid, CELLS // max(1, len(lattice.fam))))
        unit = 1
        while self.budget // unit + 1 > points:
            unit *= 2
        self.unit = unit
        self.last = lattice.last
        self.table = self._solve(lattice)

    def at(self, j: int, m: int) -> float:
        """``h(L_j, m)``: a lower bound of the extra time still to pay (``inf``: no continuation fits)."""
        if m > self.budget:
            return 0.0 if j == self.last else math.inf
        assert self.table is not None
        return float(self.table[j, m // self.unit])

    def _solve(self, lat) -> np.ndarray | None:
        """The backward DP (supersets first), with the bounds' needs; then, while before
        ``exact_until`` (:meth:`_exact_pass`), the exact needs. A step from grid point ``k`` with
        ``add`` kept bytes lands at or above point ``k + add // unit``; it fits from every ``k``
        with ``k * unit + need <= budget`` (a prefix of the row). Past the deadline the sets not
        yet reached (smaller than every set done: their steps all lead to done sets) get
        ``h = 0``, a consistent lower bound beside the others; past ``work``, no table (``None``)."""
        fam, budget, unit = lat.fam, self.budget, self.unit
        G = budget // unit + 1
        table = np.full((len(fam), G + 1), np.inf)  # column G: above the budget
        table[lat.last, :] = 0.0
        order = sorted(range(len(fam)), key=lambda k: -fam[k].bit_count())
        for n, i in enumerate(order):
            if i == lat.last:
                continue
            if n % 64 == 0 and time.monotonic() > self.deadline:
                # the sets not reached (every one with fewer nodes) get 0: still consistent
                self.partial = len(fam) - n
                table[[k for k in order[n:] if k != lat.last]] = 0.0
                return table[:, :G]
            arrays = lat.move_arrays(i, budget)
            if arrays is None:
                continue
            self.work += STEP_WORK * len(arrays[3])
            if self.work > self.work_limit:
                return None
            self._row(table, i, *arrays, G)
        self._exact_pass(lat, table, order, G)
        return table[:, :G]

    def _exact_pass(self, lat, table: np.ndarray, order: list[int], G: int) -> None:
        """The rows again with exact needs, supersets first, until ``exact_until`` (and the
        deadline). A set's row is computed from its supersets' rows, all of them done in this
        pass before it (more nodes), so the rows done are those of exact needs; a row not done
        keeps the bounds' value, computed from rows that were at most the final ones, so ``h``
        stays consistent (``h(L) <= dt + h(L')`` held with the old rows and ``h(L')`` only rose)
        and complete when this pass is cut: no ``h = 0`` at the empty set because exact needs
        ran out of time, as when one pass did both (PSPNet at CPU size under a profiler)."""
        stop = min(self.exact_until, self.deadline)
        lazy = self.lazy and hasattr(lat, "exact_needs")
        for i in order:
            if time.monotonic() >= stop:
                return
            if i == lat.last:
                continue
            arrays = lat.move_arrays(i, self.budget, not lazy)
            if arrays is None:
                continue
            self.exact_sets += 1
            if lazy:
                self._refine(lat, table, i, arrays, G)
            else:
                table[i, :] = np.inf
                self._row(table, i, *arrays, G)

    def _row(self, table: np.ndarray, i: int, req, add, dt, j, G: int) -> None:
        """Row ``i`` lowered to the least over the steps ``(need, add, time, target)``."""
        row, unit, budget = table[i], self.unit, self.budget
        top = (budget - req) // unit  # the last grid point the move fits from
        shift = add // unit
        for t, s, d, k in zip(top.tolist(), shift.tolist(), dt.tolist(), j.tolist()):
            if t < 0:
                continue
            span = min(t + 1, G)
            np.minimum(row[:span], _landing(table, k, s, span, G) + d, out=row[:span])

    def _refine(self, lat, table: np.ndarray, i: int, arrays, G: int) -> None:
        """Row ``i`` with exact needs, paid only where they can matter. The row with the bounds'
        needs first; then, while some grid point with a finite value is attained by no step
        whose exact need is known, the exact need (:meth:`~.lattice.Lattice.exact_needs`) of
        one step attaining it (the first), and the row again. Raising a need only drops grid
        points from its step's prefix, so the row never falls; at the end every finite point is
        attained by a step with its exact need, so the row equals the one with exact needs at
        every step (whose value there is at least the bounds' row and at most that step's):
        held equal to it in ``tests/solvers/milp/test_step_arrays.py``, with far fewer replays."""
        req, add, dt, j = arrays
        req = req.copy()
        unit, budget = self.unit, self.budget
        shift = (add // unit).tolist()
        checked = np.zeros(len(req), dtype=bool)
        while True:
            table[i, :] = np.inf
            self._row(table, i, req, add, dt, j, G)
            row = table[i, :G]
            top = ((budget - req) // unit).tolist()
            covered = ~np.isfinite(row)
            hit = []
            for first in (True, False):  # the checked steps' points, then one new step per point
                for n in np.flatnonzero(checked == first).tolist():
                    if top[n] < 0:
                        continue
                    span = min(top[n] + 1, G)
                    att = (_landing(table, j[n], shift[n], span, G) + dt[n] <= row[:span]) & ~covered[:span]
                    if att.any():
                        covered[:span] |= att
                        if not first:
                            hit.append(n)
            if not hit:
                return
            self.refined += len(hit)
            req[hit] = np.maximum(req[hit], lat.exact_needs(i, hit, budget))
            checked[hit] = True


def _landing(table: np.ndarray, k: int, shift: int, span: int, G: int) -> np.ndarray:
    """``h`` of set ``k`` where a step adding ``shift`` grid points of kept bytes lands from each
    of the ``span`` first points of its row (beyond the budget: only the full set, column ``G``)."""
    src = table[k, shift:shift + span]
    if len(src) < span:
        src = np.concatenate([src, np.full(span - len(src), table[k, G])])
    return src
