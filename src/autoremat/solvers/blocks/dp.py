"""The chain's dynamic program: one option per block, least extra time within the budget.

Problem (the model of :mod:`autoremat.cost.block_chain`): choose ``o_j`` for each block ``j`` to
minimise ``sum t_j(o_j)`` subject to ``H_j + max(F_j(o_j), B_j(o_j), G_j) <= M`` for every ``j``
and ``H_L + G_L <= M``, where ``H_j = sum(h_i(o_i), i < j)``: a multiple-choice knapsack whose
capacity constraints bind on every prefix. Dynamic programming over the blocks in order with
the prefix sum ``H`` as the state, quantised to ``unit`` bytes with every ``h`` rounded *up*
(so a predicted ``H`` is never below the true one: the program never accepts a choice the
model puts over the budget). Exact for the model up to that rounding.

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


def solve_chain(profile: ChainProfile, budget_bytes: int, *, units: int = 4096) -> ChainSolution | None:
    """The least-time choice within ``budget_bytes`` under the model, or ``None``."""
    st = _States(profile, units)
    held = st.held_bytes()
    best = np.full(st.size, np.inf)
    best[st.start] = 0.0
    choices = np.full((len(profile.held), st.size), -1, dtype=np.int32)
    for j in range(len(profile.held)):
        new = np.full(st.size, np.inf)
        for o, d in enumerate(st.h[j]):
            need = max(profile.fwd_peak[j][o], profile.bwd_peak[j][o], profile.gap_peak[j])
            ok = (held + need <= budget_bytes) & np.isfinite(best)
            src = np.nonzero(ok)[0]
            if not len(src):
                continue
            dst = src + d
            keep = (dst >= 0) & (dst < st.size)
            src, dst = src[keep], dst[keep]
            cand = best[src] + profile.time_s[j][o]
            better = cand < new[dst]
            new[dst[better]] = cand[better]
            choices[j, dst[better]] = o
        best = new
    final = np.where(held + profile.gap_peak[-1] <= budget_bytes, best, np.inf)
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
    """The smallest model peak any choice reaches (with the same rounding as :func:`solve_chain`)."""
    st = _States(profile, units)
    held = st.held_bytes()
    best = np.full(st.size, np.inf)
    best[st.start] = 0.0
    for j in range(len(profile.held)):
        new = np.full(st.size, np.inf)
        for o, d in enumerate(st.h[j]):
            need = max(profile.fwd_peak[j][o], profile.bwd_peak[j][o], profile.gap_peak[j])
            src = np.nonzero(np.isfinite(best))[0]
            dst = src + d
            keep = (dst >= 0) & (dst < st.size)
            src, dst = src[keep], dst[keep]
            cand = np.maximum(best[src], held[src] + need)
            np.minimum.at(new, dst, cand)
        best = new
    return int(np.min(np.maximum(best, held + profile.gap_peak[-1])))
