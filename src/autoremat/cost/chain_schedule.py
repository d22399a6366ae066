"""Schedules of offloads and prefetches on a :class:`~autoremat.cost.chain.Chain`: their types, memory and checks.

Paper: .. [1] O. Beaumont, L. Eyraud-Dubois, A. Shilova, "Optimal GPU-CPU Offloading Strategies
   for Deep Neural Network Training", hal-02316266, 2019 (§3, §4, §5.2).

Two models, both for *ordered* schedules (offloads in increasing, prefetches in decreasing index
order; every offload before every prefetch, since the last offloaded activation is the first one
fetched back) and *no-wait* (every action as early as it can, Proposition 1):

``"integral"`` (:func:`.chain_replay.simulate_offload`), the paper's assumptions (A)-(D)
    (A) one transfer at a time on the link; (B) a transfer of ``x`` takes ``|x| / B`` s;
    (C) transfers overlap computation freely; (D) an offloaded activation's memory is released
    only when its whole transfer has completed, and a prefetch reserves the whole activation
    when it starts. ``F_i`` reads ``x_i``, so ``x_i``'s memory is released no earlier than the end
    of ``F_i`` (the paper: "to perform an operation it is necessary to have all inputs stored").
    ``x_j`` is offloaded as soon as ``F_{j-1}`` has produced it and the link is free. ``F_i``
    (and ``B_i``, when offloads run into backward) starts when the previous operation has ended
    and enough offloads of ``x_0..x_{i-1}`` have completed for ``m[i]`` minus the data on the
    host to fit. A prefetch of ``x_k`` starts as soon as the link is free, ``x_k``
    is on the host, and reserving it keeps every operation from now to ``B_k`` within the limit
    (otherwise it waits for the end of the operation that is in the way). ``B_i`` starts when
    ``B_{i+1}`` has ended and ``x_i``, ``x_{i+1}`` are back. For a fixed set and order this gives
    every operation its earliest start: no prefetch ever delays a computation.

``"fractional"`` (:func:`.chain_replay.simulate_relaxed`), the relaxations of §4 and §5
    Memory is released progressively as an offload proceeds and reserved progressively as a
    prefetch proceeds, and an activation may be offloaded partially (``fractions``). Forward
    runs as above (``F_i`` may not start on memory freed from ``x_i`` itself); backward is
    computed in reversed time, where prefetching as late as possible is the mirror image of
    offloading as early as possible; the idle time between the phases is the least one that
    keeps the link sequential and memory within the limit where offloads run into backward or
    prefetches into forward (the paper's equations (9) and (10)). With fractions in {0, 1} this
    is the model Algorithm 1 optimises; with an eager prefix it is Theorem 2's schedule.

The two replays (:func:`.chain_replay.simulate_offload`, :func:`.chain_replay.simulate_relaxed`)
are different rules on purpose (the paper's model and its relaxation), not two copies of one.
Both work on the chain, not on the graph: the offload solvers
(:mod:`autoremat.solvers.beaumont`) choose activations on the chain, and
:func:`autoremat.cost.simulate` judges the plan they map back to the graph (it is the one whose
budget is checked). With nothing offloaded, the integral replay's peak is the chain's
``M_peak``, which equals the simulator's unoptimised peak whenever no clamp acts (tested in
``tests/cost/test_chain_replay.py`` on seeded random graphs, and on the zoo).

Memory between operations (both models, what :func:`memory_profile` integrates): ``x_j`` is
allocated when ``F_{j-1}`` starts and freed when ``B_{j-1}`` ends (``x_0`` lives all step);
``ex^F_i`` during ``F_i``; ``ex^B_i`` during ``B_i``; ``y_j`` from the start of ``B_j`` to the end of
``B_{j-1}``. Frees at an instant happen before allocations at the same instant.

:func:`validate_schedule` checks every invariant of a schedule (order of operations, one
transfer at a time, data dependencies, memory within the limit at every instant); every solver
test calls it. Time O(L log L) per check; simulation O(L^2) worst case.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import InfeasibleBudgetError
from .chain import Chain

__all__ = [
    "Transfer", "OffloadSchedule", "memory_profile", "validate_schedule", "offload_set_min_memory_bytes", "MODELS",
    "check_limit", "check_chain", "check_fractions", "raise_if_infeasible", "tolerance",
]

MODELS = ("integral", "fractional")


@dataclass(frozen=True)
class Transfer:
    """One copy on the host<->device link."""

    activation: int
    """Index ``j`` of ``x_j``."""
    direction: str
    """``"offload"`` (device to host) or ``"prefetch"`` (host to device)."""
    start_s: float
    end_s: float
    moved_bytes: float
    """Bytes copied: ``fraction * |x_j|``."""
    fraction: float
    """Share of ``x_j`` that is offloaded (1.0 except for a partial activation in the
    fractional model)."""


@dataclass
class OffloadSchedule:
    """An ordered no-wait offloading schedule and what it costs.

    Operation times are indexed by operation (``fwd_start_s[i]`` is the start of ``F_i``);
    ``transfers`` are in link order. ``idle_s = makespan_s - sum(u_F + u_B)`` is the time the
    GPU waits on transfers.
    """

    solver: str
    model: str
    memory_limit_bytes: int
    fractions: tuple[float, ...]
    """Share of each activation ``x_0..x_{L+1}`` that is offloaded."""
    fwd_start_s: tuple[float, ...]
    fwd_end_s: tuple[float, ...]
    bwd_start_s: tuple[float, ...]
    bwd_end_s: tuple[float, ...]
    transfers: tuple[Transfer, ...]
    makespan_s: float
    idle_s: float
    peak_bytes: int
    """Highest GPU memory at any instant (rounded up in the fractional model)."""
    bandwidth_bytes_per_s: float
    options: dict[str, Any] = field(default_factory=dict)
    """Solver settings and diagnostics (slots, slot size, the DP's own estimate...)."""

    @property
    def offloaded(self) -> tuple[int, ...]:
        """Indices of the activations (partly) offloaded."""
        return tuple(j for j, f in enumerate(self.fractions) if f > 0)

    @property
    def offloaded_bytes(self) -> float:
        return float(sum(t.moved_bytes for t in self.transfers if t.direction == "offload"))

    def transfer(self, activation: int, direction: str) -> Transfer:
        for t in self.transfers:
            if t.activation == activation and t.direction == direction:
                return t
        raise KeyError(f"no {direction} of activation {activation} in this schedule")

    def to_dict(self) -> dict[str, Any]:
        return {
            "solver": self.solver, "model": self.model, "memory_limit_bytes": self.memory_limit_bytes,
            "fractions": list(self.fractions), "offloaded": list(self.offloaded),
            "fwd_start_s": list(self.fwd_start_s), "fwd_end_s": list(self.fwd_end_s),
            "bwd_start_s": list(self.bwd_start_s), "bwd_end_s": list(self.bwd_end_s),
            "transfers": [t.__dict__ for t in self.transfers],
            "makespan_s": self.makespan_s, "idle_s": self.idle_s, "peak_bytes": self.peak_bytes,
            "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s, "options": dict(self.options),
        }


# ---------------------------------------------------------------------- helpers
def check_limit(memory_limit_bytes: Any) -> int:
    if isinstance(memory_limit_bytes, bool) or not isinstance(memory_limit_bytes, (int, float)):
        raise ValueError(f"memory_limit_bytes={memory_limit_bytes!r} must be a number of bytes (int >= 0)")
    if not memory_limit_bytes >= 0 or math.isinf(memory_limit_bytes):
        raise ValueError(f"memory_limit_bytes={memory_limit_bytes!r} must be a finite number of bytes >= 0")
    return int(memory_limit_bytes)


def check_chain(chain: Any) -> Chain:
    if not isinstance(chain, Chain):
        raise TypeError(f"chain must be an autoremat.cost.chain.Chain (autoremat.offload.Chain), got {type(chain).__name__}")
    return chain


def check_fractions(chain: Chain, fractions: Sequence[float]) -> list[float]:
    if len(fractions) != chain.n_ops + 1:
        raise ValueError(f"fractions has {len(fractions)} entries; expected {chain.n_ops + 1} (x_0..x_L+1)")
    out = [float(f) for f in fractions]
    for j, f in enumerate(out):
        if not 0.0 <= f <= 1.0:
            raise ValueError(f"fractions[{j}]={f!r} must be in [0, 1]")
    if out[-1] != 0.0:
        raise ValueError(f"x_{chain.n_ops} (the last activation) cannot be offloaded: fractions[-1] must be 0")
    return [0.0 if chain.x_bytes[j] == 0 else f for j, f in enumerate(out)]


def offload_set_min_memory_bytes(chain: Chain, offloaded_bytes: Sequence[float]) -> float:
    """The least memory limit under which offloading these amounts (per activation) fits.

    Operation ``i`` (forward or backward) can count only data of ``x_0..x_{i-1}`` as being on
    the host, so it needs ``m[i] - sum(offloaded_bytes[j], j < i)``.
    """
    mf, mb = chain.fwd_memory_bytes, chain.bwd_memory_bytes
    best, below = 0.0, 0.0
    for i in range(chain.n_ops):
        best = max(best, mf[i] - below, mb[i] - below)
        below += offloaded_bytes[i]
    return best


def raise_if_infeasible(chain: Chain, limit: int, amounts: Sequence[float], solver: str,
                         tol: float = 0.0) -> None:
    need = offload_set_min_memory_bytes(chain, amounts)
    if need > limit + tol:
        raise InfeasibleBudgetError(limit, math.ceil(need), solver=solver)


def tolerance(limit: float) -> float:
    return max(1e-6, 1e-9 * abs(limit))


# ---------------------------------------------------------------------- memory and validation
def memory_profile(chain: Chain, schedule: OffloadSchedule) -> tuple[int, float]:
    """``(peak_bytes, time_s)``: the highest GPU memory of ``schedule`` and when it occurs.

    Piecewise-linear sweep over every allocation, release and transfer (see the module
    docstring); in the fractional model transfers change memory linearly.
    """
    n = chain.n_ops
    x, y = chain.x_bytes, chain.y_bytes
    fs, fe, bs, be = schedule.fwd_start_s, schedule.fwd_end_s, schedule.bwd_start_s, schedule.bwd_end_s
    steps: list[tuple[float, float]] = []  # (time, delta)
    slopes: list[tuple[float, float]] = []  # (time, delta slope)
    fluid = schedule.model == "fractional"

    def ramp(t0: float, t1: float, amount: float) -> None:
        if t1 - t0 <= 0 or not fluid:
            steps.append((t1 if amount < 0 and not fluid else t0, amount))
            return
        slopes.append((t0, amount / (t1 - t0)))
        slopes.append((t1, -amount / (t1 - t0)))

    by = {(t.activation, t.direction): t for t in schedule.transfers}
    for j in range(n + 1):
        t_alloc = fs[j - 1] if j >= 1 else 0.0
        t_free = be[j - 1] if j >= 1 else be[0]
        steps.append((t_alloc, float(x[j])))
        steps.append((t_free, -float(x[j])))
        off, pre = by.get((j, "offload")), by.get((j, "prefetch"))
        if off is not None and pre is not None:
            a = off.moved_bytes
            if fluid:
                ramp(off.start_s, off.end_s, -a)
                ramp(pre.start_s, pre.end_s, a)
            else:
                steps.append((max(off.end_s, fe[j]), -a))
                steps.append((pre.start_s, a))
    for i in range(n):
        steps.append((fs[i], float(chain.fwd_extra_bytes[i])))
        steps.append((fe[i], -float(chain.fwd_extra_bytes[i])))
        steps.append((bs[i], float(chain.bwd_extra_bytes[i])))
        steps.append((be[i], -float(chain.bwd_extra_bytes[i])))
    for j in range(n + 1):
        t0 = bs[min(j, n - 1)]
        t1 = be[j - 1] if j >= 1 else be[0]
        steps.append((t0, float(y[j])))
        steps.append((t1, -float(y[j])))
    # instants closer than q are one instant (float noise in computed times), frees first
    q = 1e-12 * max(1.0, abs(schedule.makespan_s))
    events: dict[float, list[float]] = {}
    for t, d in steps:
        events.setdefault(round(t / q) * q, [0.0, 0.0, 0.0])[0 if d < 0 else 1] += d
    for t, d in slopes:
        events.setdefault(round(t / q) * q, [0.0, 0.0, 0.0])[2] += d
    value, slope, prev_t = 0.0, 0.0, None
    peak, peak_t = 0.0, 0.0
    for t in sorted(events):
        neg, pos, dslope = events[t]
        if prev_t is not None:
            value += slope * (t - prev_t)
        if value > peak:
            peak, peak_t = value, t
        value += neg
        value += pos
        if value > peak:
            peak, peak_t = value, t
        slope += dslope
        prev_t = t
    return (int(round(peak)) if not fluid else math.ceil(peak - 1e-6)), peak_t


def validate_schedule(chain: Chain, schedule: OffloadSchedule, *, tol_s: float = 1e-9) -> int:
    """Check every invariant of ``schedule`` on ``chain``; return its peak GPU bytes.

    Checked: operations in order (``F_0..F_L`` then ``B_L..B_0``), none overlapping, each lasting
    its time; one transfer at a time, each lasting ``bytes / B``; offloads in increasing and
    prefetches in decreasing index order, every offload before every prefetch; ``x_j`` offloaded
    after ``F_{j-1}`` produced it and fetched back after its offload and before ``B_j`` starts;
    the same share offloaded and prefetched; the makespan and idle time; memory within
    ``memory_limit_bytes`` at every instant. Raises ``ValueError`` naming the first violation.
    """
    chain = check_chain(chain)
    if schedule.model not in MODELS:
        raise ValueError(f"schedule.model={schedule.model!r}; expected one of {MODELS}")
    scale = max(1.0, schedule.makespan_s, chain.compute_time_s)
    eps = tol_s * scale + 1e-12

    def fail(msg: str) -> None:
        raise ValueError(f"invalid offload schedule ({schedule.solver}): {msg}")

    _check_operations(chain, schedule, eps, fail)
    _check_transfers(chain, schedule, eps, fail)
    peak, when = memory_profile(chain, schedule)
    limit = schedule.memory_limit_bytes
    slack = 0 if schedule.model == "integral" else 1e-6 * max(1.0, limit) + 1
    if peak > limit + slack:
        fail(f"GPU memory reaches {peak} bytes at t={when} s, above the limit of {limit} bytes")
    return peak


def _check_operations(chain: Chain, schedule: OffloadSchedule, eps: float, fail: Callable[[str], None]) -> None:
    """:func:`validate_schedule`'s checks of the operations, the makespan and the fractions."""
    n = chain.n_ops
    for name in ("fwd_start_s", "fwd_end_s", "bwd_start_s", "bwd_end_s"):
        if len(getattr(schedule, name)) != n:
            fail(f"{name} has {len(getattr(schedule, name))} entries, expected {n}")
    if len(schedule.fractions) != n + 1:
        fail(f"fractions has {len(schedule.fractions)} entries, expected {n + 1}")
    fs, fe, bs, be = schedule.fwd_start_s, schedule.fwd_end_s, schedule.bwd_start_s, schedule.bwd_end_s
    prev = 0.0
    for i in range(n):
        if fs[i] < prev - eps:
            fail(f"F_{i} starts at {fs[i]} before the previous operation ends ({prev})")
        if abs(fe[i] - fs[i] - chain.fwd_time_s[i]) > eps:
            fail(f"F_{i} lasts {fe[i] - fs[i]}, expected {chain.fwd_time_s[i]}")
        prev = fe[i]
    for i in range(n - 1, -1, -1):
        if bs[i] < prev - eps:
            fail(f"B_{i} starts at {bs[i]} before the previous operation ends ({prev})")
        if abs(be[i] - bs[i] - chain.bwd_time_s[i]) > eps:
            fail(f"B_{i} lasts {be[i] - bs[i]}, expected {chain.bwd_time_s[i]}")
        prev = be[i]
    if abs(schedule.makespan_s - be[0]) > eps:
        fail(f"makespan_s={schedule.makespan_s} but B_0 ends at {be[0]}")
    if abs(schedule.idle_s - max(0.0, be[0] - chain.compute_time_s)) > eps:
        fail(f"idle_s={schedule.idle_s} but the makespan minus compute time is {be[0] - chain.compute_time_s}")
    if schedule.fractions[n] != 0:
        fail(f"x_{n} cannot be offloaded")
    if schedule.model == "integral" and any(f not in (0.0, 1.0) for f in schedule.fractions):
        fail("the integral model offloads whole activations (fractions 0 or 1)")


def _check_transfers(chain: Chain, schedule: OffloadSchedule, eps: float, fail: Callable[[str], None]) -> None:
    """:func:`validate_schedule`'s checks of the link: order, durations, data dependencies."""
    bw = chain.bandwidth_bytes_per_s
    fe, bs = schedule.fwd_end_s, schedule.bwd_start_s
    link = 0.0
    offs = [t for t in schedule.transfers if t.direction == "offload"]
    pres = [t for t in schedule.transfers if t.direction == "prefetch"]
    if len(offs) + len(pres) != len(schedule.transfers):
        fail("a transfer's direction is neither 'offload' nor 'prefetch'")
    if [t.activation for t in offs] != sorted(t.activation for t in offs) or len({t.activation for t in offs}) != len(offs):
        fail("offloads are not in increasing activation order (or repeat one)")
    if [t.activation for t in pres] != sorted((t.activation for t in pres), reverse=True):
        fail("prefetches are not in decreasing activation order")
    if {t.activation for t in offs} != {t.activation for t in pres} or list(schedule.transfers) != offs + pres:
        fail("every offload needs one prefetch, and offloads come before prefetches on the link")
    expected = {j for j, f in enumerate(schedule.fractions) if f > 0 and chain.x_bytes[j] > 0}
    if {t.activation for t in offs} != expected:
        fail(f"transfers move {sorted(t.activation for t in offs)} but fractions say {sorted(expected)}")
    for t in schedule.transfers:
        j = t.activation
        want = schedule.fractions[j] * chain.x_bytes[j]
        if abs(t.moved_bytes - want) > 1e-6 * max(1.0, want) or abs(t.fraction - schedule.fractions[j]) > 1e-12:
            fail(f"{t.direction} of x_{j} moves {t.moved_bytes} bytes, expected {want}")
        if abs((t.end_s - t.start_s) - t.moved_bytes / bw) > eps:
            fail(f"{t.direction} of x_{j} lasts {t.end_s - t.start_s} s, expected {t.moved_bytes / bw}")
        if t.start_s < link - eps:
            fail(f"{t.direction} of x_{j} starts at {t.start_s} while the link is busy until {link}")
        link = max(link, t.end_s)
        if t.direction == "offload":
            produced = fe[j - 1] if j > 0 else 0.0
            if t.start_s < produced - eps:
                fail(f"x_{j} is offloaded at {t.start_s} before F_{j - 1} produces it at {produced}")
        else:
            off = schedule.transfer(j, "offload")
            if t.start_s < off.end_s - eps:
                fail(f"x_{j} is prefetched at {t.start_s} before its offload ends at {off.end_s}")
            if t.end_s > bs[j] + eps:
                fail(f"x_{j} is back at {t.end_s} but B_{j} starts at {bs[j]}")
