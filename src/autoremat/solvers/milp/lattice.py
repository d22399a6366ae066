"""The exact search of ``"milp"`` over the lower-set lattice: labels, bounds, a proven answer.

A plan of the ``milp`` space is a path ``∅ = L0 ⊂ L1 ⊂ … ⊂ Lk = V`` of lower sets with a flag
per segment (recomputed or plain). The exact model of :mod:`autoremat.cost.segment_replay` prices
one step ``L -> L'`` from the state ``(L, D)`` (``D``: the dangling roots) and the kept bytes
``m``: its need (the step fits when ``m + need <= B``), its time, the kept bytes it adds and the
dangling roots after it, for either flag (:func:`~autoremat.cost.segment_replay.exact_transition`).

:class:`Lattice` runs a label-setting search on that graph of states (Kusumoto et al.'s DP,
§4.2, with exact dominance instead of time buckets):

* time-centric (:meth:`Lattice.least_time`): A*: labels ``(t, m)`` are taken in increasing
  ``t + h(L, m)``, ``h`` a proven, consistent lower bound of the time still to pay
  (:class:`.cost_to_go.CostToGo`, a backward DP over the lower sets and a grid of ``m``; keys
  take the larger of the parent's key and their own: pathmax); a label is dominated by one
  already taken at its state with no more time and no more kept bytes (its every continuation
  costs at least as much); the first label taken at ``V`` is the optimum. Without ``h`` (not
  built in a third of the time) labels go by ``t`` alone; above :data:`CTG_MAX_SETS` lower
  sets ``h`` is the module relaxation's (:mod:`.modules`).
  Steps whose lower bounds of the need (:class:`~autoremat.cost.backward_floor.TransitionBounds`;
  for the last step too) exceed what the budget leaves are never generated; a step's replay is
  paid only when its label is taken (most labels never are). Labels whose key reaches the
  incumbent's time are dropped. On DenseNet-121 at CPU size, 50 % budget, the proven bound after
  60 s went from 2.6e-6 s (gap 42.6 %) to 4.14e-6 s (gap 7.8 %) with ``h`` (x86_64, 2 cores).
* memory-centric (:meth:`Lattice.least_peak`): labels ``(P, m)``, ``P`` the peak so far, taken in
  increasing ``P`` (a step enters the queue with a lower bound of its ``P`` and is re-queued
  with the exact one when taken); the first label taken at ``V`` has the least peak.

Both are anytime: when the time limit (a ``deadline``, or ``work``: a count of labels taken,
steps generated and checked, weighted by :data:`CHECK_WORK` and the others, which stops the
search at the same point at any load) stops them, the key of the next label to take is a proven
lower bound of the optimum (every plan's path leaves the expanded region through a queued
label or a dominated one, and keys only grow along a path; with ``h``, because it is a
consistent lower bound). Plain steps after plain steps are
generated too: segments fix the forward order and split the backward, so two plain segments
are not one (measured: a 3-node DAG whose two-plain-segment plan peaks at 44 bytes, the
one-segment plan at 48).

Exactness: over all canonical strategies with free flags (no limit on the number of segments),
relative to the exact model. That model equals :func:`~autoremat.cost.simulate` on the plans of
seeded random DAGs (``tests/cost/test_segment_replay.py``, free flags included) and on the zoo's
CNN graphs; its two documented exceptions (a gradient buffer shared through a pass-through op,
a view of a recomputed segment's input) can move it either way, and where they make it
over-estimate a plan the search cannot see that plan (measured: never on the zoo's CNNs at CPU
size; on module-level transformer captures it does, so ``milp`` there reports a bound, not a
proof: see :mod:`.search`). Every plan returned is simulated by the caller.

Complexity: O(labels × successors) steps, each O(|∂L| + |S|) bookkeeping plus a replay O(|S| +
edges of S) per label taken, and ``h``'s DP (O(steps × grid) in numpy; ~1-15 s on DenseNet-121's
186k and PSPNet's 1.09M steps); the family is every lower set: graphs with a few thousand (VGG19
47, ResNet-50 240, U-Net 300, DenseNet-121 432, PSPNet 1545, GoogLeNet 8838 at CPU size).
"""

from __future__ import annotations

import logging
import math
import time
from bisect import bisect_left, bisect_right
from collections.abc import Iterator
from dataclasses import dataclass
from heapq import heappop, heappush

import numpy as np

from ...cost.backward_floor import TransitionBounds
from ...cost.bitsets import GraphBits, bits
from ...cost.segment_replay import SegmentCost, bookkeeping, exact_transition, pair_bookkeeping
from .cost_to_go import CostToGo
from .modules import ModuleMoves
from .step_arrays import StepArrays

__all__ = ["Lattice", "LatticeAnswer", "dominated", "add_label", "EXACT_SHARE", "CTG_MAX_SETS"]

logger = logging.getLogger("autoremat.solvers.milp")

LABEL_WORK = 1.0
"""Work units per label taken off the queue (``work=`` of :meth:`Lattice.least_time` and
:meth:`Lattice.least_peak`: unlike a deadline, the same answer at any load)."""
CHILD_WORK = 1.0
"""Work units per step generated out of a taken label."""
CTG_MAX_SETS = 2500
"""Above this many lower sets the cost-to-go relaxes only the steps inside modules (:mod:`.modules`;
every step of GoogLeNet's 8838 sets, 35.8 M pairs, would take ~5000 s)."""
EXACT_SHARE = 1.0
"""The share of the cost-to-go's time until which its second pass gives steps exact needs
(:meth:`Lattice.cost_to_go`; the first pass, with the bounds, completes the table before it).
Was 0.3 in one pass, while each step the bounds let fit was replayed; paid lazily
(:meth:`.cost_to_go.CostToGo._refine`) they cover every set of PSPNet at CPU size in ~20-25 s."""
CHECK_WORK = 24.0
"""Work units per exact check of a step's need (a replay of the segment where not cached). The
three weights and :data:`.cost_to_go.STEP_WORK` are a least-squares fit of CPU seconds on cold
lattices (``benchmarks/auto_work.py``: 67 searches of 24 seeded networks of 30-120 nodes and the
zoo's VGG19 and U-Net; x86_64, 2 cores): 1.4 us per label or step, 34 us per check, 10 us per
cost-to-go step; so one unit is ~1.2 us (searches over 0.3 s: 0.35-1.16 M units per CPU second,
median 0.83 M)."""


@dataclass
class LatticeAnswer:
    """What a lattice search proved: the best path found (``seq``: lower sets, ``flags``: recompute
    per segment) with its model ``cost`` (seconds of extra time, or bytes of peak), and a proven
    lower ``bound`` of the optimum; ``status`` is ``"optimal"``, ``"time_limit"`` or
    ``"infeasible"`` (no plan fits, proven)."""

    seq: list[int] | None
    flags: list[bool] | None
    cost: float | None
    bound: float
    status: str
    labels: int = 0
    replays: int = 0
    work: float = 0.0


class Lattice:
    """Every lower set of a graph with the exact model's steps; reused across budgets (replays and successors kept)."""

    def __init__(self, p: GraphBits, family: list[int]) -> None:
        self.p = p
        self.fam = family
        self.last = len(family) - 1
        assert family[0] == 0 and family[-1] == p.full, "please report"
        self.bounds = TransitionBounds(p, family)
        self.keys = self.bounds.keys
        self.order = sorted(range(len(family)), key=self.keys.__getitem__)
        self.sorted_keys = [self.keys[k] for k in self.order]
        self.order_np = np.asarray(self.order, dtype=np.intp)
        words = max(1, (p.n + 63) // 64)
        raw = b"".join(m.to_bytes(8 * words, "little") for m in family)
        self.rows = np.frombuffer(raw, dtype="<u8").reshape(len(family), words).astype(np.uint64)
        self.succ: list[list[int]] = [[] for _ in family]
        self.scanned = [-1] * len(family)
        self.priced = [0] * len(family)  # successors whose steps moves_of has priced
        self.scan = [bisect_left(self.sorted_keys, self.keys[k]) for k in range(len(family))]
        self.replays: dict[tuple, SegmentCost] = {}
        self.needs: dict[tuple[int, int, int, bool], int] = {}
        self.tight: dict[tuple[int, int, bool], int] = {}
        module = p.module_mode
        self._flags: dict[tuple[int, int], tuple[bool, ...]] = {}
        self._module = module
        self.pairs: list[dict[int, tuple]] = [{} for _ in family]  # per set: its steps' plan-free terms
        self.moves: list[list[tuple]] = [[] for _ in family]  # per set: (step, key gap, flag) in key order
        self.step_arrays = StepArrays(self)  # move_arrays, priced in batches
        self._ctg: dict[tuple[int, bool], CostToGo] = {}  # (budget, without a work limit) -> h
        self._ctg_failed: dict[tuple[int, bool], tuple[float, float]] = {}  # -> (seconds, work) it did not finish in
        self._modules: ModuleMoves | None = None  # above CTG_MAX_SETS: the module relaxation's steps

    # -------------------------------------------------------------- steps
    def successors(self, i: int, limit: int) -> list[int]:
        """Strict supersets of set ``i`` with key ``<= limit`` (and maybe more), in key order."""
        lst = self.succ[i]
        if limit <= self.scanned[i]:
            return lst
        pos = self.scan[i]
        end = bisect_right(self.sorted_keys, limit, lo=pos)
        cand = self.order_np[pos:end]
        mine = self.rows[i]
        sup = ((self.rows[cand] & mine) == mine).all(axis=1) & (cand != i)
        lst.extend(cand[sup].tolist())
        self.scan[i] = end
        self.scanned[i] = limit if end < len(self.fam) else 1 << 62
        return lst

    def moves_of(self, i: int, room: int) -> list[tuple]:
        """Steps out of set ``i`` with key gap within ``room`` (maybe more), in key order: ``(gap, j, flag, *step)``."""
        lst = self.moves[i]
        have = self.priced[i]  # successors listed by others (StepArrays) are priced here too
        succ = self.successors(i, self.keys[i] + room)
        if len(succ) > have:
            ki = self.keys[i]
            for j in succ[have:]:
                for f in self.flags(i, j):
                    lst.append((self.keys[j] - ki, j, f, *self.step(i, j, f)))
            self.priced[i] = len(succ)
        return lst

    def move_arrays(self, i: int, budget: int, exact: bool = False):
        """Set ``i``'s steps within ``budget`` as numpy arrays ``(need bound, kept bytes added,
        time, target set)`` for :class:`.cost_to_go.CostToGo`, whatever the dangling roots beyond
        :meth:`certain_dangling` (``None`` without steps; cached; priced in one batch:
        :mod:`.step_arrays`). ``exact``: a step the bounds let fit gets the exact model's need
        at the certainly dangling roots (:meth:`need`; the need never falls when more roots
        dangle, held to the brute force in ``tests/solvers/milp/test_cost_to_go.py``)."""
        return self.step_arrays.arrays(i, budget, exact)

    def exact_needs(self, i: int, idx: list[int], budget: int) -> np.ndarray:
        """The exact needs of the steps at positions ``idx`` of ``move_arrays(i, budget)``."""
        return self.step_arrays.exact_needs(i, idx, budget)

    def certain_dangling(self, i: int) -> int:
        """Roots that dangle at set ``i`` on every path: alive after it, not held by the returned
        object to the step's end (kept from their segment on), and no node of it saves or reads
        them (any storage of theirs), so no step so far has held them."""
        p, lower = self.p, self.fam[i]
        saved = 0
        for v in bits(lower & p.rg_mask):
            saved |= p.saves_roots[v]
        out = 0
        for r in bits(p.info(lower).alive & lower & ~saved & ~p.end_mask):
            if not any(p.succmask[u] & lower for u in p.members[r]):
                out |= 1 << r
        return out

    def flags(self, i: int, j: int) -> tuple[bool, ...]:
        """The flags a segment ``L_j \\ L_i`` may take: plain always; recomputed when it has a
        saver and only recomputable nodes (one module call at module level)."""
        key = (i, j)
        got = self._flags.get(key)
        if got is None:
            p = self.p
            seg = self.fam[j] & ~self.fam[i]
            can = bool(seg & p.saver_mask) and not seg & p.nonrecomp_mask and (
                not self._module or seg & (seg - 1) == 0)
            got = self._flags[key] = (False, True) if can else (False,)
        return got

    def step(self, i: int, j: int, flag: bool) -> tuple[int, float, int, int, int, int, int]:
        """The terms of ``L_i -> L_j`` with ``flag`` that do not depend on the dangling roots
        (cached): ``(cheap bound, time, roots it holds if they dangle, kept bytes it adds by
        itself, roots alive after it, its roots that dangle after it, bound of the need less the
        kept bytes it adds)``; :func:`~autoremat.cost.segment_replay.bookkeeping` and
        :meth:`~autoremat.cost.backward_floor.TransitionBounds.move_bound` split in two."""
        key = 2 * j + flag
        mine = self.pairs[i]
        got = mine.get(key)
        if got is None:
            p, b = self.p, self.bounds
            if j == self.last:
                dt = pair_bookkeeping(p, self.fam[i], self.fam[j], True)[0] if flag else 0.0
                if flag:  # the replay's bounds hold for the last segment too
                    got = (b.cheap_bound(i, j, True), dt, 0, 0, 0, 0, b.move_bound(i, j, 0, True))
                else:  # at the loss it holds what it saves (its own roots, the dangling ones it
                    # saves: `reach`) and their extras; nothing joins the kept bytes after it
                    _, reach, add, _, _ = pair_bookkeeping(p, self.fam[i], self.fam[j], False)
                    got = (b.cheap_bound(i, j, False), 0.0, reach, 0, 0, 0, add)
            else:
                dt, reach, add, alive, fresh = pair_bookkeeping(p, self.fam[i], self.fam[j], flag)
                low = b.move_bound(i, j, 0, flag)
                got = (b.cheap_bound(i, j, flag), dt, reach, add, alive, fresh, low)
            mine[key] = got
        return got

    def need(self, i: int, j: int, dang: int, flag: bool, room: int) -> int:
        """The exact model's need of the step (the sweep's bound first: a step it already rules
        out for ``room`` is not replayed)."""
        key = (i, j, dang, flag)
        got = self.needs.get(key)
        if got is not None:
            return got
        if flag and j != self.last:
            tkey = (i, j, flag)
            tight = self.tight.get(tkey)
            if tight is None:
                add = bookkeeping(self.p, self.fam[i], self.fam[j], 0, recompute=True)[1]
                tight = self.tight[tkey] = self.bounds.tight_bound(i, j, add)
            if tight > room:
                return tight
        got = self.needs[key] = exact_transition(self.p, self.fam[i], self.fam[j], dang, self.replays, flag)[0]
        return got

    def path(self, labels: list[tuple], lid: int) -> tuple[list[int], list[bool]]:
        seq: list[int] = []
        flags: list[bool] = []
        while lid > 0:
            _, _, i, _, parent, _, flag = labels[lid][:7]
            seq.append(self.fam[i])
            flags.append(flag)
            lid = parent
        return seq[::-1], flags[::-1]

    # -------------------------------------------------------------- searches
    def least_time(self, budget: int, incumbent: float = math.inf, deadline: float = math.inf,
                   progress: float = 5.0, heuristic: bool = True, work: float = math.inf,
                   ctg: CostToGo | None = None) -> LatticeAnswer:
        """The least extra time of a path whose every step fits ``budget`` (see the module docstring).

        Labels are taken in increasing ``t + h`` (A*, ``h`` from :class:`.cost_to_go.CostToGo`;
        ``heuristic=False``: ``h = 0``); a label is dominated at its state by a taken one with
        no more time and no more kept bytes. ``ctg``: an ``h`` the caller built at this budget, used
        as given (its work not counted; ``heuristic`` ignored).

        Long by design: the label-setting loop (the lattice's inner loop) keeps its tables in locals."""
        last = self.last
        now = time.monotonic()
        spent = 0.0
        if ctg is not None and ctg.table is None:
            ctg = None  # given, but it passed its work limit: no h
        elif ctg is None and heuristic:
            ctg = self.cost_to_go(budget, now + (deadline - now) / 3, work / 3)
            spent = ctg.work if ctg is not None else work / 3 if work < math.inf else 0.0
        if ctg is None and heuristic:
            logger.info("milp (lattice): no cost-to-go bound within a third of the time; searching without it")
        if ctg is not None:
            table, unit = ctg.table, ctg.unit
            h0 = table.item(0, 0)
            if h0 == math.inf or h0 >= incumbent:
                return LatticeAnswer(None, None, None, incumbent, "infeasible" if incumbent == math.inf else "optimal",
                                     0, len(self.replays), spent)
        else:
            table, unit, h0 = np.zeros((len(self.fam), 1)), budget + 1, 0.0  # h = 0: labels by time alone
        # label: (t, m, set, dangling, parent, check, flag); check: (i, room) of the step to verify
        labels: list[tuple] = [(0.0, 0, 0, 0, -1, None, False)]
        heap: list[tuple[float, float, int, int]] = [(h0, 0.0, 0, 0)]
        best: dict[tuple[int, int], tuple[list[int], list[float]]] = {}  # state -> its Pareto front (_add)
        taken = 0
        next_log = time.monotonic() + progress
        bound = h0
        while heap:
            f, t, m, lid = heap[0]
            if f >= incumbent:
                return LatticeAnswer(None, None, None, incumbent, "optimal", taken, len(self.replays), spent)
            if spent > work or time.monotonic() > deadline:
                return LatticeAnswer(None, None, None, f, "time_limit", taken, len(self.replays), spent)
            heappop(heap)
            spent += LABEL_WORK
            _, _, j, dang, parent, check, flag = labels[lid]
            state = (j, dang)
            seen = best.get(state)
            if seen is not None and dominated(seen, m, t):
                continue
            if check is not None:
                i, room = check
                spent += CHECK_WORK
                if self.need(i, j, labels[parent][3], flag, room) > room:
                    continue
            if seen is None:
                best[state] = ([m], [t])
            else:
                add_label(seen, m, t)
            taken += 1
            bound = f
            if j == last:
                seq, flags = self.path(labels, lid)
                return LatticeAnswer(seq, flags, t, t, "optimal", taken, len(self.replays), spent)
            if time.monotonic() > next_log:
                next_log = time.monotonic() + progress
                logger.info("milp (lattice): %d labels taken, %d queued, time bound %.6g s, %d replays", taken,
                            len(heap), bound, len(self.replays))
            room = budget - m
            for k, fl, t2, m2, dang2 in self.children(j, t, m, dang, room, incumbent):
                spent += CHILD_WORK
                if k == last:
                    f2 = t2 if t2 > f else f
                else:  # pathmax: a path through the child is one through this label
                    f2 = t2 + table.item(k, m2 // unit)
                    if f2 >= incumbent:
                        continue
                    if f2 < f:
                        f2 = f
                seen = best.get((k, dang2))
                if seen is not None and dominated(seen, m2, t2):
                    continue
                labels.append((t2, m2, k, dang2, lid, (j, room), fl))
                heappush(heap, (f2, t2, m2, len(labels) - 1))
        return LatticeAnswer(None, None, None, math.inf if incumbent == math.inf else incumbent,
                             "infeasible" if incumbent == math.inf else "optimal", taken, len(self.replays), spent)

    def children(self, j: int, t: float, m: int, dang: int, room: int,
                 incumbent: float) -> Iterator[tuple[int, bool, float, int, int]]:
        """The steps out of a label ``(t, m)`` at state ``(j, dang)`` that its lower bounds do not
        rule out for ``room`` bytes left and that stay below ``incumbent`` seconds: ``(set, flag,
        time, kept bytes, dangling roots)`` after each (the need itself is checked when the child
        is taken: :meth:`need`). Shared by :meth:`least_time` and ``auto``'s beam (:mod:`.chain`)."""
        nbytes = self.p.nbytes
        for gap, k, fl, cheap, dt, reach, add, alive, fresh, low in self.moves_of(j, room):
            if gap > room:
                break
            t2 = t + dt
            if cheap > room or t2 >= incumbent:
                continue
            held = dang & reach
            if held:
                add += nbytes(held)
            if low + add > room:
                continue
            yield k, fl, t2, m + add, ((dang & ~held) & alive) | fresh

    def cost_to_go(self, budget: int, deadline: float = math.inf, work: float = math.inf):
        """:class:`.cost_to_go.CostToGo` at ``budget`` (cached per budget; ``None`` past ``deadline``
        or when it needs more than ``work`` units: its :attr:`~.cost_to_go.CostToGo.work`, the
        same whether cached or not, so a work-bounded caller gets the same answer either way).
        Without a work limit, the sets its second pass reaches within :data:`EXACT_SHARE` of the
        time get exact needs (all without a deadline); under one none do (``auto``: cached apart)."""
        key = (budget, work == math.inf)
        got = self._ctg.get(key)
        if got is None and len(self.fam) > CTG_MAX_SETS and self._modules is None:
            self._modules = ModuleMoves(self)  # too many steps for every pair: steps inside modules
        if got is None:
            seconds, units = self._ctg_failed.get(key, (-1.0, -1.0))
            if seconds >= deadline - time.monotonic() and units >= work:
                return None  # it did not finish with at least as much time and work before
            started = time.monotonic()
            exact = started + EXACT_SHARE * (deadline - started) if key[1] and not self._modules else -math.inf
            got = CostToGo(self._modules or self, budget, deadline=deadline, work=work, exact_until=exact)
            if got.table is None:
                self._ctg_failed[key] = (deadline - started, work)
                return None
            if got.partial or got.exact_sets:
                logger.info("milp (lattice): cost-to-go in %.1f s, exact needs at %d sets, h = 0 at %d not reached "
                            "in time", time.monotonic() - started, got.exact_sets, got.partial)
            self._ctg = {k: v for k, v in self._ctg.items() if k[1] != key[1]}
            self._ctg[key] = got
        return got if got.work <= work else None

    def least_peak(self, incumbent: int | None = None, deadline: float = math.inf,
                   progress: float = 5.0, work: float = math.inf) -> LatticeAnswer:
        """The least model peak of a path (the memory-centric problem; see the module docstring).

        Long by design: the label-setting loop (the lattice's inner loop) keeps its tables in locals."""
        last, moves_of, nbytes = self.last, self.moves_of, self.p.nbytes
        cap = math.inf if incumbent is None else incumbent  # only paths below the incumbent matter
        # label: (P, m, set, dangling, parent, exact, flag); exact: whether P is the exact key
        labels: list[tuple] = [(0, 0, 0, 0, -1, True, False)]
        heap: list[tuple[int, int, int]] = [(0, 0, 0)]
        best: dict[tuple[int, int], int] = {}
        taken = 0
        spent = 0.0
        next_log = time.monotonic() + progress
        while heap:
            key, m, lid = heap[0]
            if key >= cap:
                return LatticeAnswer(None, None, None, cap, "optimal", taken, len(self.replays), spent)
            if spent > work or time.monotonic() > deadline:
                return LatticeAnswer(None, None, None, key, "time_limit", taken, len(self.replays), spent)
            heappop(heap)
            spent += LABEL_WORK
            P, _, j, dang, parent, exact, flag = labels[lid]
            state = (j, dang)
            if m >= best.get(state, 1 << 62):
                continue
            if not exact:  # the step's exact need: re-queue with the exact key
                pm, pdang, i = labels[parent][1], labels[parent][3], labels[parent][2]
                spent += CHECK_WORK
                need = self.need(i, j, pdang, flag, 1 << 62)
                P2 = max(labels[parent][0], pm + need)
                labels[lid] = (P2, m, j, dang, parent, True, flag)
                if P2 > key:
                    heappush(heap, (P2, m, lid))
                    continue
            best[state] = m
            taken += 1
            if j == last:
                seq, flags = self.path(labels, lid)
                return LatticeAnswer(seq, flags, float(key), float(key), "optimal", taken, len(self.replays), spent)
            if time.monotonic() > next_log:
                next_log = time.monotonic() + progress
                logger.info("milp (lattice, least budget): %d labels taken, %d queued, peak bound %d bytes",
                            taken, len(heap), key)
            room = (cap - 1 - m) if cap != math.inf else 1 << 62
            for gap, k, f, cheap, _, reach, add, alive, fresh, low in moves_of(j, room):
                if gap > room:
                    break
                spent += CHILD_WORK
                held = dang & reach
                if held:
                    add += nbytes(held)
                m2 = m + add
                dang2 = ((dang & ~held) & alive) | fresh
                if m2 >= best.get((k, dang2), 1 << 62):
                    continue
                P2 = max(key, m + cheap, m + low + add)
                if P2 >= cap:
                    continue
                labels.append((P2, m2, k, dang2, lid, False, f))
                heappush(heap, (P2, m2, len(labels) - 1))
        return LatticeAnswer(None, None, None, cap, "optimal" if incumbent is not None else "infeasible", taken,
                             len(self.replays), spent)


def dominated(front: tuple[list[int], list[float]], m: int, t: float) -> bool:
    """Whether a label on ``front`` has no more kept bytes than ``m`` and no more time than ``t``.
    ``front``: a state's Pareto front of taken labels, kept bytes ascending and time strictly
    descending (:func:`add_label`), so the entry with the most kept bytes ``<= m`` has the least
    time of those: O(log) where a scan of every label taken at the state was O(labels) (a third
    of the search's time on ResNet-50 at CPU size; the same answers)."""
    ms, ts = front
    i = bisect_right(ms, m)
    return i > 0 and ts[i - 1] <= t


def add_label(front: tuple[list[int], list[float]], m: int, t: float) -> None:
    """Put a label ``(m, t)`` that :func:`dominated` let through on the front, dropping the
    entries it dominates (no fewer kept bytes and no less time: a run right after its place)."""
    ms, ts = front
    i = j = bisect_left(ms, m)
    while j < len(ms) and ts[j] >= t:
        j += 1
    ms[i:j] = [m]
    ts[i:j] = [t]


def lattice_plan_nodes(seq: list[int]) -> list[list[int]]:
    """The segments' node lists of a lower-set path (bitsets)."""
    out: list[list[int]] = []
    prev = 0
    for m in seq:
        out.append(list(bits(m & ~prev)))
        prev = m
    return out
