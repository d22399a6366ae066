"""Algorithm 1 of Kusumoto et al. over a family of lower sets: what both memory models share.

.. [1] M. Kusumoto, T. Inoue, G. Watanabe, T. Akiba, M. Koyama, "A Graph Theoretic Framework of
   Recomputation Algorithms for Memory-Efficient Backpropagation", NeurIPS 2019 (Algorithm 1).

:class:`LowerSetDP` holds the family (bitsets, in order of size), the time quantum, the order
of the sets by a lower bound of a transition's cost (the model's *key*) and the scan of each
set's successors in that order. :class:`~.closed.ClosedDP` (``dp-approx``'s closed form) and
:class:`~.exact.ExactDP` (``dp-exact``'s segment replay) add their successor lists and
searches; :meth:`LowerSetDP.run` is the one entry point (see the package docstring,
"Algorithm", "Speed").
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Sequence
from typing import Any

import numpy as np

from ...cost.bitsets import GraphBits

__all__ = ["LowerSetDP", "time_quantum", "time_unit", "LOST_SPLIT", "MODES"]

LOST_SPLIT = 16  # the memory-centric search's buckets per table quantum, for times without a unit
MODES = ("time", "memory", "feasible")


def time_unit(p: GraphBits) -> float | None:
    """The nodes' common time unit (the gcd of integer times), or ``None`` when they have none."""
    ints = [round(t) for t in p.time]
    if not all(abs(t - i) <= 1e-9 * max(1.0, abs(t)) for t, i in zip(p.time, ints)):
        return None
    unit = 0
    for i in ints:
        unit = math.gcd(unit, i)
    return float(unit) if unit else None


def time_quantum(p: GraphBits, slots: int) -> float:
    """Seconds per DP time unit: the nodes' common unit when it gives ≤ ``slots`` units, else T(V)/slots."""
    total = sum(p.time)
    if total <= 0:
        return 1.0
    unit = time_unit(p)
    if unit is not None and total / unit <= slots:
        return unit
    return total / slots


class LowerSetDP:
    """Algorithm 1 of Kusumoto et al. on a family of lower sets (subclassed per memory model).

    A state is a set of the family (and, for the exact model, its dangling roots) with ``m``,
    the kept bytes; a transition goes to a strict superset in the family. The successors of a
    set are visited in order of a lower bound of their cost (the model's key, :attr:`keys`), and
    stop once that bound alone exceeds what the budget leaves; their transition terms are
    computed once and kept.
    """

    exact = False
    """Whether the model is the exact one (segment replay) rather than the closed form."""

    def __init__(self, p: GraphBits, family: list[int], quantum: float, keys: list[int], succ: list[Any]) -> None:
        self.p = p
        self.fam = family
        self.quantum = quantum
        # the memory-centric search's buckets (of time left out): the nodes' common unit where the
        # times have one, else a sixteenth of the table's quantum (only the buckets it reaches
        # exist, however many T(V) would span; see the package docstring, "Algorithm")
        self.lost_quantum = time_unit(p) or quantum / LOST_SPLIT
        n = len(family)
        self.keys = keys
        self.order = sorted(range(n), key=keys.__getitem__)
        ordered = [keys[k] for k in self.order]
        self.scan = [bisect_left(ordered, keys[k]) for k in range(n)]
        self.scanned = [-1] * n
        self.ordered_keys = ordered
        self.order_np = np.asarray(self.order, dtype=np.intp)
        self.succ = succ  # per set, its successors found so far, in key order
        self.runs = 0
        self.transitions = 0

    def run(self, budget: int, mode: str) -> tuple[list[int], float] | None:
        """``(lower-set sequence ending in V, its recomputation time)`` the DP picks, or ``None``.

        ``mode``: ``"time"`` (least recomputation time), ``"memory"`` (most, §4.4) or
        ``"feasible"`` (any that fits). Times are exact sums; a table cell or search bucket is
        indexed by ``floor(t / quantum)``.
        """
        self.runs += 1
        if mode == "time":
            return self.least_time(budget)
        if mode == "feasible":
            return self.feasible(budget)
        assert mode == "memory", f"mode={mode!r}, please report"
        return self.most_time(budget)

    def least_time(self, budget: int) -> tuple[list[int], float] | None:
        raise NotImplementedError

    def most_time(self, budget: int) -> tuple[list[int], float] | None:
        raise NotImplementedError

    def feasible(self, budget: int) -> tuple[list[int], float] | None:
        raise NotImplementedError

    def vanilla_need(self) -> int:
        """The model's peak of the plan without recomputation (one segment ``V``)."""
        raise NotImplementedError

    def model_peak(self, seq: Sequence[int]) -> tuple[int, float]:
        """The model's step peak and extra time of a lower-set sequence."""
        raise NotImplementedError
