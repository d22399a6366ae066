"""The two no-wait replays of an offload schedule on a chain (Beaumont et al. §3, §4, §5.2).

.. [1] O. Beaumont, L. Eyraud-Dubois, A. Shilova, "Optimal GPU-CPU Offloading Strategies for Deep
   Neural Network Training", hal-02316266, 2019.

:func:`simulate_offload` is the paper's model (whole activations, memory released when a copy
completes); :func:`simulate_relaxed` its relaxation (memory moves progressively, activations may
be offloaded in part). Both are described, with their memory accounting, in
:mod:`.chain_schedule`, which holds the schedule types and :func:`~.chain_schedule.validate_schedule`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from .chain import Chain
from .chain_schedule import (OffloadSchedule, Transfer, check_chain, check_fractions, check_limit, memory_profile,
                             raise_if_infeasible, tolerance)

__all__ = ["simulate_offload", "simulate_relaxed"]


def simulate_offload(
    chain: Chain,
    memory_limit_bytes: int,
    offloaded: Iterable[int],
    *,
    solver: str = "simulate",
    options: dict[str, Any] | None = None,
) -> OffloadSchedule:
    """The no-wait ordered schedule offloading the whole activations ``offloaded`` (integral model).

    Raises :class:`~autoremat.errors.InfeasibleBudgetError` when some operation cannot fit
    even with every chosen activation before it on the host (``min_budget_bytes`` is what this
    set needs).

    Long by design: the paper's forward and backward phases share the link's clock and the release
    times, in the order §3 states them; split, they would pass all of it back and forth."""
    chain = check_chain(chain)
    limit = check_limit(memory_limit_bytes)
    n, L = chain.n_ops, chain.L
    chosen = sorted({int(j) for j in offloaded})
    for j in chosen:
        if not 0 <= j <= L:
            raise ValueError(f"activation {j} cannot be offloaded: expected indices 0..{L} (x_{L + 1} is never offloaded)")
    x = chain.x_bytes
    O = [j for j in chosen if x[j] > 0]
    amounts = [float(x[j]) if j in set(O) else 0.0 for j in range(n + 1)]
    raise_if_infeasible(chain, limit, amounts, solver)
    bw = chain.bandwidth_bytes_per_s
    uf, ub = chain.fwd_time_s, chain.bwd_time_s
    mf, mb = chain.fwd_memory_bytes, chain.bwd_memory_bytes

    # ---------------------------------------------------------------- forward
    fs, fe = [0.0] * n, [0.0] * n
    off_s: dict[int, float] = {}
    off_e: dict[int, float] = {}
    link, nxt, prev_end = 0.0, 0, 0.0
    for i in range(n):
        while nxt < len(O) and O[nxt] <= i:
            j = O[nxt]
            st = max(link, fe[j - 1] if j > 0 else 0.0)
            off_s[j], off_e[j] = st, st + x[j] / bw
            link = off_e[j]
            nxt += 1
        start = prev_end
        need = mf[i] - limit
        if need > 0:
            acc, done = 0, False
            for j in O:
                if j >= i:
                    break
                acc += x[j]
                if acc >= need:
                    start = max(start, off_e[j], fe[j])  # released once copied and F_j is over
                    done = True
                    break
            assert done, "forward op cannot fit though the set was checked feasible, please report"
        fs[i], fe[i] = start, start + uf[i]
        prev_end = fe[i]
    release = {j: max(off_e[j], fe[j]) for j in O}

    # ---------------------------------------------------------------- backward
    # operations in execution order: F_0..F_L, B_L..B_0; B_i sits at position 2n-1-i
    mem = list(mf) + [mb[i] for i in range(L, -1, -1)]
    end_at: list[float | None] = list(fe) + [None] * n
    below: dict[int, int] = {}
    acc = 0
    for j in O:
        below[j] = acc
        acc += x[j]
    pf_s: dict[int, float] = {}
    pf_e: dict[int, float] = {}
    desc = sorted(O, reverse=True)
    ptr = 0
    bs, be = [0.0] * n, [0.0] * n
    prev_end = fe[L]
    for i in range(L, -1, -1):
        while ptr < len(desc) and desc[ptr] >= i:
            k = desc[ptr]
            thr = limit + below[k]
            pk = 2 * n - 1 - k
            assert mem[pk] <= thr, "B_k cannot fit with x_k back though the set was checked, please report"
            p = pk
            while p > 0 and mem[p - 1] <= thr:
                p -= 1
            earliest = 0.0
            if p > 0:
                e = end_at[p - 1]
                assert e is not None, "prefetch waits on an operation not yet timed, please report"
                earliest = e
            st = max(link, release[k], earliest)
            pf_s[k], pf_e[k] = st, st + x[k] / bw
            link = pf_e[k]
            ptr += 1
        start = prev_end
        for j in (i, i + 1):
            if j in pf_e:
                start = max(start, pf_e[j])
        need = mb[i] - limit
        if need > 0:  # offloads may still run into backward: wait for enough releases
            acc = 0
            for j in O:
                if j >= i:
                    break
                acc += x[j]
                if acc >= need:
                    start = max(start, release[j])
                    break
        bs[i], be[i] = start, start + ub[i]
        end_at[2 * n - 1 - i] = be[i]
        prev_end = be[i]

    transfers = [Transfer(j, "offload", off_s[j], off_e[j], float(x[j]), 1.0) for j in O]
    transfers += [Transfer(k, "prefetch", pf_s[k], pf_e[k], float(x[k]), 1.0) for k in desc]
    fractions = tuple(1.0 if j in set(O) else 0.0 for j in range(n + 1))
    sched = OffloadSchedule(
        solver=solver, model="integral", memory_limit_bytes=limit, fractions=fractions,
        fwd_start_s=tuple(fs), fwd_end_s=tuple(fe), bwd_start_s=tuple(bs), bwd_end_s=tuple(be),
        transfers=tuple(transfers), makespan_s=be[0], idle_s=max(0.0, be[0] - chain.compute_time_s),
        peak_bytes=0, bandwidth_bytes_per_s=bw, options=dict(options or {}),
    )
    sched.peak_bytes = memory_profile(chain, sched)[0]
    assert sched.peak_bytes <= limit, (
        f"simulated peak {sched.peak_bytes} exceeds the limit {limit}, please report")
    return sched


# ---------------------------------------------------------------------- fractional model
def _stream(items: Sequence[tuple[int, float]], avail: dict[int, float]) -> tuple[dict[int, float], dict[int, float], float]:
    """Work-conserving FIFO link: item ``j`` (amount in seconds) starts at max(link free, avail[j])."""
    s: dict[int, float] = {}
    e: dict[int, float] = {}
    link = 0.0
    for j, dur in items:
        s[j] = max(link, avail[j])
        e[j] = s[j] + dur
        link = e[j]
    return s, e, link


def _first_time(items: Sequence[tuple[int, float]], s: dict[int, float], amount: dict[int, float],
                need: float, bw: float, upto: int | None = None) -> float | None:
    """First time the stream has moved ``need`` bytes (items with index < ``upto`` only)."""
    acc = 0.0
    for j, _ in items:
        if upto is not None and j >= upto:
            break
        a = amount[j]
        if acc + a >= need - tolerance(need):
            return s[j] + max(0.0, need - acc) / bw
        acc += a
    return None


def _no_wait_phase(items: Sequence[tuple[int, float]], durations: Sequence[float], memory: Sequence[int],
                   limit: int, amount: dict[int, float], bw: float, *,
                   forward: bool) -> tuple[list[float], list[float], dict[int, float]]:
    """One phase of :func:`simulate_relaxed`, as early as it can run: ``(starts, ends, avail)``.

    Operation ``i`` starts when the previous one has ended and the stream of ``items`` (offloads
    in forward; prefetches in reversed time in backward) has moved what its memory need over
    ``limit`` asks, counting activations below ``i`` only. In forward ``x_i`` is available to
    the stream when ``F_{i-1}`` ends (before ``F_i``); in reversed backward once ``B_i`` is over."""
    n = len(durations)
    starts, ends = [0.0] * n, [0.0] * n
    avail: dict[int, float] = {}
    prev_end = 0.0
    for i in range(n):
        if forward and i in amount:
            avail[i] = prev_end  # x_i is produced by F_{i-1}
        done = [(j, d) for j, d in items if (j <= i if forward else j < i)]
        moved_s, _, _ = _stream(done, avail)
        start = prev_end
        need = memory[i] - limit
        if need > 0:
            t = _first_time(done, moved_s, amount, need, bw, upto=i)
            assert t is not None, (f"{'forward' if forward else 'backward'} op cannot fit though the set was checked "
                                   "feasible, please report")
            start = max(start, t)
        starts[i], ends[i] = start, start + durations[i]
        prev_end = ends[i]
        if not forward and i in amount:
            avail[i] = ends[i]
    return starts, ends, avail


def simulate_relaxed(
    chain: Chain,
    memory_limit_bytes: int,
    fractions: Sequence[float],
    *,
    solver: str = "relaxed",
    options: dict[str, Any] | None = None,
) -> OffloadSchedule:
    """The best ordered schedule offloading ``fractions[j] * |x_j|`` of each ``x_j``, fractional model.

    With ``fractions`` in {0, 1} this is the makespan Algorithm 1 minimises (fractional
    communications, §5); with the eager prefix of ``M_peak - M`` bytes it is Theorem 2's optimum
    of the fractional relaxation (§4). Raises
    :class:`~autoremat.errors.InfeasibleBudgetError` when some operation cannot fit.

    Long by design: the forward phase, the backward phase in reversed time and the idle time between
    them (equations (9) and (10)) read each other's results in the order of §4-§5."""
    chain = check_chain(chain)
    limit = check_limit(memory_limit_bytes)
    f = check_fractions(chain, fractions)
    n, L = chain.n_ops, chain.L
    x = chain.x_bytes
    amount = {j: f[j] * x[j] for j in range(n) if f[j] > 0}
    raise_if_infeasible(chain, limit, [amount.get(j, 0.0) for j in range(n + 1)], solver, tolerance(limit))
    bw = chain.bandwidth_bytes_per_s
    uf, ub = chain.fwd_time_s, chain.bwd_time_s
    mf, mb = chain.fwd_memory_bytes, chain.bwd_memory_bytes
    items = [(j, amount[j] / bw) for j in sorted(amount)]

    # forward: offload ASAP; F_i waits until data of x_0..x_{i-1} frees enough memory
    fs, fe, avail = _no_wait_phase(items, uf, mf, limit, amount, bw, forward=True)
    off_s, off_e, off_end = _stream(items, avail)
    # backward in reversed time: B_0 first; x_k can be "un-prefetched" once reversed B_k is over
    rev_items = items  # increasing index = reversed prefetch order
    rs, re_, ravail = _no_wait_phase(rev_items, ub, mb, limit, amount, bw, forward=False)
    r_s, r_e, r_end = _stream(rev_items, ravail)
    d_b = re_[L]

    # idle time between the phases
    t_f = fe[L]
    g = 0.0
    if items:
        g = max(g, off_end - t_f - (d_b - r_end))  # the link: offloads end before prefetches start
        for j in range(n):  # backward ops while offloads still run: enough must be released
            need = mb[j] - limit
            if need > 0:
                t = _first_time(items, off_s, amount, need, bw)
                assert t is not None, "please report"
                g = max(g, t - t_f - (d_b - re_[j]))
        for j in range(n):  # forward ops while prefetches already run: enough must stay out
            need = mf[j] - limit
            if need > 0:
                r = _first_time(rev_items, r_s, amount, need, bw)
                assert r is not None, "please report"
                g = max(g, r - d_b - (t_f - fe[j]))
    t_b0 = t_f + g

    def fwd_time(r: float) -> float:  # reversed time -> time
        return t_b0 + (d_b - r)

    bs = [fwd_time(re_[i]) for i in range(n)]
    be = [fwd_time(rs[i]) for i in range(n)]
    end = be[0]
    transfers = [Transfer(j, "offload", off_s[j], off_e[j], amount[j], f[j]) for j, _ in items]
    transfers += [Transfer(j, "prefetch", fwd_time(r_e[j]), fwd_time(r_s[j]), amount[j], f[j])
                  for j, _ in reversed(items)]
    sched = OffloadSchedule(
        solver=solver, model="fractional", memory_limit_bytes=limit, fractions=tuple(f),
        fwd_start_s=tuple(fs), fwd_end_s=tuple(fe), bwd_start_s=tuple(bs), bwd_end_s=tuple(be),
        transfers=tuple(transfers), makespan_s=end, idle_s=max(0.0, end - chain.compute_time_s),
        peak_bytes=0, bandwidth_bytes_per_s=bw, options=dict(options or {}),
    )
    sched.peak_bytes = memory_profile(chain, sched)[0]
    return sched
