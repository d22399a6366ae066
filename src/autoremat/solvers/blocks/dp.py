"""The chain's dynamic program: one option per block, least extra time within the budget.

Problem (the model of :mod:`autoremat.cost.block_chain`): choose ``o_j`` for each block ``j`` to
minimise ``sum t_j(o_j)`` subject to ``H_j + max(F_j(o_j), B_j(o_j), G_j) <= M`` for every ``j``
and ``H_L + G_L <= M``, where ``H_j = sum(h_i(o_i), i < j)``: a multiple-choice knapsack whose
capacity constraints bind on every prefix. Dynamic programming over the blocks in order with
the prefix sum ``H`` as the state, quantised to ``unit`` bytes (every ``h`` rounded up); each
state carries the exact ``H`` of the path it holds, and the budget is checked against that exact
value, so the program never accepts a choice the model puts over the budget, and a budget equal
to a choice's model peak (e.g. per-layer checkpointing's) is not refused by rounding. Paths that
meet in one state are merged (least time, then least exact ``H``): exact for the model when a
state is one byte, a heuristic merge otherwise.

Time O(L · K · S) for ``L`` blocks of at most ``K`` options and ``S`` states (the configured
number of units, 4096 by default; numpy over the states), space O(L · S) for the choices.

:func:`least_peak` answers the bottleneck version (the smallest achievable model peak) with
the same states, for :class:`~autoremat.errors.InfeasibleBudgetError`'s ``min_budget_bytes``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ...cost.block_chain import ChainProfile

__all__ = ["ChainSolution", "solve_chain", "least_peak"]


@dataclass(frozen=True)
class ChainSolution:
    choice: tuple[int, ...]
    time_s: float


class _States:
    """The quantised prefix sums of held bytes: state ``s`` stands for ``(base + s) * unit`` bytes."""

    def __init__(self, profile: ChainProfile, units: int) -> None:
        lo = sum(min(h) for h in profile.held)
        hi = sum(max(h) for h in profile.held)
        self.unit = max(1, math.ceil((hi - lo) / max(1, units)))
        self.h = [[math.ceil(x / self.unit) for x in row] for row in profile.held]
        self.base = sum(min(row) for row in self.h)
        self.size = sum(max(row) - min(row) for row in self.h) + 1
        self.start = -self.base  # H = 0 before the first block

    def held_bytes(self) -> np.ndarray:
        return (self.base + np.arange(self.size)) * self.unit


def _step(best: np.ndarray, exact: np.ndarray, src: np.ndarray, d: int, cand: np.ndarray, add: int,
          new: np.ndarray, new_exact: np.ndarray) -> np.ndarray:
    """Move the paths at states ``src`` by ``d`` states (``add`` exact bytes) with keys ``cand``
    into ``new`` where they are better (lower key, then lower exact ``H``); the states improved.
    ``src`` holds distinct states, so the moved states are distinct too."""
    dst = src + d
    inside = (dst >= 0) & (dst < len(new))
    src, dst, cand = src[inside], dst[inside], cand[inside]
    h = exact[src] + add
    better = (cand < new[dst]) | ((cand == new[dst]) & (h < new_exact[dst]))
    new[dst[better]] = cand[better]
    new_exact[dst[better]] = h[better]
    return dst[better]


def solve_chain(profile: ChainProfile, budget_bytes: int, *, units: int = 4096) -> ChainSolution | None:
    """The least-time choice within ``budget_bytes`` under the model, or ``None``."""
    st = _States(profile, units)
    best = np.full(st.size, np.inf)
    exact = np.zeros(st.size, dtype=np.int64)
    best[st.start] = 0.0
    choices = np.full((len(profile.held), st.size), -1, dtype=np.int32)
    for j in range(len(profile.held)):
        new, new_exact = np.full(st.size, np.inf), np.zeros(st.size, dtype=np.int64)
        for o, d in enumerate(st.h[j]):
            need = max(profile.fwd_peak[j][o], profile.bwd_peak[j][o], profile.gap_peak[j])
            src = np.nonzero((exact + need <= budget_bytes) & np.isfinite(best))[0]
            moved = _step(best, exact, src, d, best[src] + profile.time_s[j][o], profile.held[j][o], new, new_exact)
            choices[j, moved] = o
        best, exact = new, new_exact
    final = np.where(exact + profile.gap_peak[-1] <= budget_bytes, best, np.inf)
    s = int(np.argmin(final))
    if not np.isfinite(final[s]):
        return None
    out = []
    for j in range(len(profile.held) - 1, -1, -1):
        o = int(choices[j, s])
        out.append(o)
        s -= st.h[j][o]
    return ChainSolution(choice=tuple(reversed(out)), time_s=float(final.min()))


def least_peak(profile: ChainProfile, *, units: int = 4096) -> int:
    """The smallest model peak any choice reaches (states and merging as in :func:`solve_chain`,
    with the peak so far as the key)."""
    st = _States(profile, units)
    best = np.full(st.size, np.inf)
    exact = np.zeros(st.size, dtype=np.int64)
    best[st.start] = 0.0
    for j in range(len(profile.held)):
        new, new_exact = np.full(st.size, np.inf), np.zeros(st.size, dtype=np.int64)
        for o, d in enumerate(st.h[j]):
            need = max(profile.fwd_peak[j][o], profile.bwd_peak[j][o], profile.gap_peak[j])
            src = np.nonzero(np.isfinite(best))[0]
            _step(best, exact, src, d, np.maximum(best[src], exact[src] + need), profile.held[j][o], new, new_exact)
        best, exact = new, new_exact
    return int(np.min(np.maximum(best, exact + profile.gap_peak[-1])))
