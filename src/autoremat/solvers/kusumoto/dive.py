"""``dp-exact``'s feasibility searches: the depth-first dive and the least-kept sequence.

:class:`Dive` answers "does any lower-set sequence fit this budget in the exact model" (the
probes of the least-budget search, :meth:`.search.Search.least_dp_budget`) depth first, with
dominance on the kept bytes; the probes share what they learn (the rooms from which ``V`` is
known not to be reached, or to be reached). :meth:`Dive.least_kept` finds the sequence that
fits with the least kept bytes (Dijkstra on ``m``), the other candidate for the minimum. See
the package docstring ("Feasibility", "Least budget").
"""

from __future__ import annotations

import logging
import time
from heapq import heappop, heappush
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from .exact import ExactDP

__all__ = ["Dive", "Progress", "PROGRESS_EVERY_S"]

PROGRESS_EVERY_S = 10.0  # a search running longer logs where it is this often (INFO)

logger = logging.getLogger("autoremat.solvers.kusumoto")


class Progress:
    """Logs, at most every :data:`PROGRESS_EVERY_S` seconds, where a long dp-exact search is
    (INFO on ``autoremat.solvers.kusumoto``): its phase, budget, time so far and how much it has
    priced and replayed. :meth:`tick` is called once per expanded state (a clock read)."""

    __slots__ = ("dp", "phase", "budget", "start", "due")

    def __init__(self, dp: ExactDP, phase: str, budget: int) -> None:
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
                    "%d replays (%d lower sets)", self.phase, self.budget, now - self.start, len(dp.moves),
                    dp.transitions, len(dp.replays), len(dp.fam))


class Dive:
    """The exact model's feasibility searches over :class:`~.exact.ExactDP`'s priced transitions,
    and what their probes learn (:attr:`fail_room`, :attr:`ok`)."""

    def __init__(self, dp: ExactDP) -> None:
        self.dp = dp
        # rooms from which V is known not to be reached / to be reached (see run)
        self.fail_room: dict[tuple[int, int], int] = {}
        self.ok: dict[tuple[int, int], tuple[int, list[int]]] = {}
        self.stopped = False
        """Whether the last :meth:`run` stopped at its ``max_replays`` (no answer)."""

    def run(self, budget: int, max_replays: int | None = None) -> tuple[list[int], float] | None:
        """``"feasible"`` for the exact model (:meth:`.dp.LowerSetDP.run`): a depth-first search with dominance.

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
        bytes it adds), so the probes of :meth:`.search.Search.least_dp_budget` share what
        they learn: a state whose every transition was tried at room ``r`` without reaching
        ``V`` fails at any room ``<= r`` (:attr:`fail_room`), and one from which ``V`` was
        reached at room ``r`` succeeds, by the same transitions, at any room ``>= r``
        (:attr:`ok`).

        Why not Dijkstra on ``m`` (the search before this version): it settles every state
        whose ``m`` is below that of ``V``, pricing all their successors. On GoogLeNet (8838
        lower sets; ~5.6k successors within the key bound per state early in the network) one
        feasible probe did not finish in 264 s; this search finds the least budget in under a
        second (see the module docstring for the side-by-side timings).

        ``max_replays``: stop (return ``None``, :attr:`stopped` true) once the search has paid this
        many new exact replays without an answer; what it proved on the way stays valid.
        """
        self.stopped = False
        replays = self.dp.replays
        limit = None if max_replays is None else len(replays) + max_replays
        fam = self.dp.fam
        last = len(fam) - 1
        inf = 1 << 126
        fail_room, ok = self.fail_room, self.ok
        candidates, exceeds = self.dp.candidates, self.dp.exceeds
        start = (0, 0)
        best: dict[tuple[int, int], int] = {start: 0}
        stack = [(start, 0, candidates(0, 0, 0, budget))]
        progress = Progress(self.dp, "least-budget probe", budget)
        while stack:
            progress.tick()
            if limit is not None and len(replays) > limit:
                self.stopped = True
                return None
            state, m, moves = stack[-1]
            if best[state] < m:  # reached since with fewer kept bytes: that expansion covers this one
                stack.pop()
                continue
            room = budget - m
            known = ok.get(state)
            if known is not None and room >= known[0]:
                return self.found(stack, budget, known[1])
            if room > fail_room.get(state, -1):
                i, dang = state
                for j, (_, add, dang2, _) in moves:
                    nxt = (j, dang2)
                    m2 = m + add
                    if m2 >= best.get(nxt, inf) or exceeds(i, j, dang, room):
                        continue
                    best[nxt] = m2
                    if j == last:
                        return self.found(stack, budget, [j])
                    stack.append((nxt, m2, candidates(j, dang2, m2, budget)))
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

        :meth:`run` returns the first sequence its dive finds; at the least budget
        this one is the candidate the searches before it returned, and the least-budget search
        keeps whichever simulates lower (see :meth:`.search.Search.minimum`). It skips the
        states the dives proved cannot reach ``V`` with the room they would have
        (:attr:`fail_room`), and prices each state's successors at once (:meth:`.exact.ExactDP.price_all`).
        """
        dp = self.dp
        fam, ix = dp.fam, dp.interner
        last = len(fam) - 1
        fail_room = self.fail_room
        settled: dict[int, Any] = {}
        first = int(ix.state_ids(np.zeros(1, dtype=np.intp), np.array([ix.dangling(0)]))[0])
        heap: list[tuple[int, int, int, Any, int]] = [(0, 0, first, None, 0)]
        count = 1
        progress = Progress(self.dp, "least-kept search", budget)
        while heap:
            progress.tick()
            m, _, sid, back, m_src = heappop(heap)
            if sid in settled:
                continue
            i = int(ix.state_set[sid])
            dang = ix.sets[int(ix.state_dang[sid])]
            if back is not None:
                i0, dang0 = int(ix.state_set[back]), ix.sets[int(ix.state_dang[back])]
                if self.dp.exceeds(i0, i, dang0, budget - m_src):
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
            ids, adds, _ = self.dp.expand(i, dang, m, budget)
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

    def found(self, stack: list[tuple[tuple[int, int], int, Any]], budget: int,
               suffix: list[int]) -> tuple[list[int], float]:
        """The sequence of :meth:`run` when the top of ``stack`` reaches ``V`` by
        ``suffix`` (set indices); each state on the stack is recorded in :attr:`_ok`."""
        path = [state[0] for state, _, _ in stack[1:]]
        for k, (state, m, _) in enumerate(stack):
            tail = path[k:] + suffix
            known = self.ok.get(state)
            if known is None or budget - m < known[0]:
                self.ok[state] = (budget - m, tail)
        return [self.dp.fam[j] for j in path + suffix], 0.0
