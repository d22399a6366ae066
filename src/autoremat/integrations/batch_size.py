"""The batch-size search of :class:`~autoremat.integrations.lightning.AutoRemat`, framework-free.

Two phases, as Lightning's ``BatchSizeFinder`` (``mode="binsearch"``) but on predictions first:

1. :func:`predicted_largest`: from the current batch size, double while a plan is predicted to
   fit, then bisect between the last size that fitted and the first that did not. Each probe is
   a solve on the graph scaled to that batch (no step runs), so it is cheap.
2. :func:`confirmed_largest`: confirm the prediction with real trial steps, bisecting between
   the last confirmed size and the first size whose trial failed (out of memory, or a measured
   peak over the budget).

Both phases call functions the caller provides, so the prediction and the confirmation solve
the same problem by construction: the caller passes one ``plan_at(size)`` to both (an
earlier version probed with a different solver call than it confirmed with).

Complexity: ``O(log(limit / original))`` probes in each phase.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

__all__ = ["predicted_largest", "confirmed_largest"]

T = TypeVar("T")


def predicted_largest(original: int, limit: int, fits: Callable[[int], bool]) -> int:
    """The largest size in ``[original, limit]`` for which ``fits`` holds (doubling, then bisection).

    ``original`` is assumed to fit (the caller already has a plan for it); ``fits`` is assumed
    monotone (a size that does not fit has no larger size that fits).
    """
    if original < 1 or limit < 1:
        raise ValueError(f"original={original!r} and limit={limit!r} must be >= 1")
    best = size = original
    while size < limit:  # doubling
        nxt = min(limit, size * 2)
        if not fits(nxt):
            break
        best = size = nxt
    lo, hi = best, (min(limit, size * 2) if best < limit else best)
    while hi - lo > 1:  # bisection between the last fit and the first miss
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def confirmed_largest(original: int, candidate: int, trial: Callable[[int], T | None]) -> tuple[int, T] | None:
    """The largest size in ``(original, candidate]`` whose ``trial`` succeeds, by bisection.

    ``trial(size)`` returns a result (e.g. the plan that ran) or ``None`` when the size failed.
    Returns ``(size, result)`` of the largest confirmed size, or ``None`` when none above
    ``original`` was confirmed (the caller keeps ``original``).
    """
    confirmed: tuple[int, T] | None = None
    good, bad = original, candidate + 1
    size = candidate
    while size > good:
        outcome = trial(size)
        if outcome is not None:
            confirmed = (size, outcome)
            good = size
        else:
            bad = size
        size = (good + bad) // 2
    return confirmed
