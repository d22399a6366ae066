"""Which op outputs a recomputed region keeps: a 0/1 knapsack per region.

Problem: a recomputed module region replays its ops in backward. Keeping op ``i``'s output
(selective checkpointing, ``MUST_SAVE``) costs its ``out_bytes`` from forward until the region's
backward and saves its forward ``time_s`` in the replay. Given the bytes a region may keep,
choose the ops that save the most replay time: the 0/1 knapsack problem [1]_, solved exactly by
dynamic programming over the byte allowance quantised to ``unit_bytes`` (item sizes rounded
*up*, so the chosen set never exceeds the allowance). Time O(n * allowance / unit), space the same
in bits of choice. Ops without new bytes (views) are not items: keeping them frees nothing
and their replay is free.

Limitation: the benefit of keeping an op is its own time only; ops that run only to feed a kept
op are still replayed (selective checkpointing replays every op not saved), which the paper's
model of a segment does not capture either.

.. [1] S. Martello and P. Toth, *Knapsack Problems: Algorithms and Computer Implementations*,
   Wiley, 1990, ch. 2.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

__all__ = ["choose_saves", "region_policies", "DEFAULT_UNITS"]

DEFAULT_UNITS = 512
"""Number of quantisation steps of the allowance when ``unit_bytes`` is not given."""


def choose_saves(costs: Sequence[tuple[int, float]], allowance_bytes: int, *, unit_bytes: int | None = None) -> list[int]:
    """Indices of ``costs`` (``(out_bytes, time_s)`` per op) to keep, at most ``allowance_bytes``
    in total, with the largest total time. ``unit_bytes`` quantises the allowance (default:
    ``allowance_bytes / DEFAULT_UNITS``)."""
    if allowance_bytes < 0:
        raise ValueError(f"allowance_bytes must be >= 0, got {allowance_bytes}")
    if unit_bytes is not None and unit_bytes < 1:
        raise ValueError(f"unit_bytes must be >= 1, got {unit_bytes}")
    for b, t in costs:
        if b < 0 or t < 0:
            raise ValueError(f"op costs must be non-negative (out_bytes, time_s), got {(b, t)}")
    unit = unit_bytes or max(1, -(-allowance_bytes // DEFAULT_UNITS))
    cap = allowance_bytes // unit
    items = [(i, -(-b // unit), t) for i, (b, t) in enumerate(costs) if b > 0 and t > 0 and -(-b // unit) <= cap]
    best = [0.0] * (cap + 1)
    choice: list[list[bool]] = []
    for _i, w, t in items:
        row = [False] * (cap + 1)
        for c in range(cap, w - 1, -1):
            if best[c - w] + t > best[c]:
                best[c] = best[c - w] + t
                row[c] = True
        choice.append(row)
    kept: list[int] = []
    c = cap
    for k in range(len(items) - 1, -1, -1):
        if choice[k][c]:
            kept.append(items[k][0])
            c -= items[k][1]
    return sorted(kept)


def region_policies(costs: dict[str, Sequence[tuple[int, float]]], allowance_bytes: int,
                    *, unit_bytes: int | None = None) -> dict[str, list[int]]:
    """Kept op indices for each recomputed region (path -> op costs), the allowance split evenly.

    Every region's kept outputs live from its forward to its backward, so at the start of
    backward all of them are live at once: an even split keeps the sum within ``allowance_bytes``.
    Repeated blocks (regions whose ops have the same byte sequence: identical layers) are solved
    once, on the per-op median of their measured times, and share the answer, so timing noise
    does not give identical layers different policies.
    """
    if not costs:
        return {}
    share = max(0, allowance_bytes) // len(costs)
    groups: dict[tuple[int, ...], list[str]] = {}
    for path, c in costs.items():
        groups.setdefault(tuple(b for b, _ in c), []).append(path)
    out: dict[str, list[int]] = {}
    for sizes, paths in groups.items():
        times = [statistics.median(costs[p][i][1] for p in paths) for i in range(len(sizes))]
        kept = choose_saves(list(zip(sizes, times)), share, unit_bytes=unit_bytes)
        for p in paths:
            out[p] = list(kept)
    return {p: out[p] for p in costs}
