"""Which activations to offload to host memory, and when: Beaumont et al.'s algorithms and vDNN.

Problem (Problem 1 of [1]): on a :class:`~autoremat.cost.chain.Chain` with memory limit
``M``, choose activations to copy to the host during forward and bring back during backward so
that every operation fits in ``M`` and the makespan is least. Strongly NP-complete (Theorem 1).

Paper: .. [1] O. Beaumont, L. Eyraud-Dubois, A. Shilova, "Optimal GPU-CPU Offloading Strategies
   for Deep Neural Network Training", hal-02316266, 2019.
   .. [2] S. B. Shriram, A. Garg, P. Kulkarni, "Dynamic Memory Management for GPU-based
   Training of Deep Neural Networks", IPDPS 2019 (vDNN++), after .. [3] M. Rhu et al.,
   "vDNN: Virtualized Deep Neural Networks for Scalable, Memory-Efficient Neural Network
   Design", MICRO 2016.

Every solver returns an :class:`~autoremat.cost.chain_schedule.OffloadSchedule` built by
:func:`~autoremat.cost.chain_replay.simulate_offload` (the paper's integral model: whole
activations, memory released when a copy completes), so schedules are comparable; and raises
:class:`~autoremat.errors.InfeasibleBudgetError` with ``min_budget_bytes =
chain.min_memory_bytes`` (offloading everything) when ``M`` is below it.

:func:`offload_greedy` (GREEDY, §4.2)
    Theorem 2: in the fractional relaxation (an activation may be offloaded partly, memory is
    released as data is copied) the no-wait, eager (a prefix ``x_0, x_1, ..``), ordered schedule
    offloading exactly ``M_peak - M`` bytes is optimal. GREEDY rounds the prefix up to whole
    activations. ``fractional=True`` returns Theorem 2's schedule itself (fractional model), a
    lower bound on every integral schedule at least as tight as :func:`lower_bound`.
    O(L^2) (the simulation). Heuristic for Problem 1.
:func:`offload_dp` (DYNPROG, §5.3 Algorithm 1)
    Optimal offload decisions for the *fractional communications* relaxation (each activation
    offloaded entirely or not, memory released/reserved progressively), by dynamic programming
    over ``(C, D_F, D_B)`` after each operation: the bytes already on the host, the offload
    backlog (or, negative, the link's idle time times ``B``) and the backward's prefetch backlog
    computed in reversed time (the paper's ``(M_F, Δ_F, Δ_B)``; ``M_F = sum(x_j, j <= i) - C``).
    Memory is discretised in ``slots`` slots of ``M / slots`` bytes: memory needs ``m_F``, ``m_B``
    are rounded up, and activation sizes up as in the paper (``rounding="up"``) or down
    (``"down"``: then every set the DP finds feasible fits exactly, activations smaller than a
    slot are never offloaded, and copies look up to a slot cheaper each, which misleads the DP on
    long chains of small activations). The link's capacity during each operation (``u * B``) is
    rounded along prefix sums of time so that its rounding errors do not accumulate. The
    decisions are then scheduled in the integral model. Rounded up, sizes overstate what an
    offload frees, so the decisions often miss the exact limit by a few slots; then (and when
    the discretised problem has no feasible state, at the minimum limit) activations are added
    until every operation fits: at the first operation short of memory, the smallest activation
    before it that covers the deficit, else the largest (logged at INFO, recorded in
    ``options["repaired"]``). States with the same ``(C, D_F)`` and no less ``D_B`` and idle time
    than another are dropped (a smaller prefetch backlog never hurts). Time O(L * states * log),
    states <= O(S * (sum|x| + sum u B)^2 / s^2) (pseudo-polynomial; measured: at most ~5,000 per
    operation at S = 500 and ~40,000 at S = 2000 on the zoo's chains, i.e. 0.1 s to 15 s in pure
    Python). Exact for the relaxation when no rounding occurs; a heuristic for Problem 1 (worse
    with long chains, as the paper notes: discretisation errors accumulate).
:func:`vdnn` (VDNN, §6.1)
    vDNN++ offloads the inputs of convolutions, all of them or every other one. Without layer
    annotations the paper ranks activations by ``u_F[i] / |x_i|`` (compute that can hide the
    copy of ``x_i``) and, for every threshold, tries offloading all activations above it and
    every other one of them, keeping the best schedule (``mode="conv"``). ``mode="all"`` is
    vDNN_all: offload every activation. O(L^3).
:func:`lower_bound` (Proposition 3)
    ``max(sum(u_F + u_B), 2 (M_peak - M) / B)``.
"""

from __future__ import annotations

import bisect
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

from ...cost.chain import Chain
from ...cost.chain_replay import simulate_offload, simulate_relaxed
from ...cost.chain_schedule import OffloadSchedule, check_chain, check_limit, offload_set_min_memory_bytes
from ...errors import InfeasibleBudgetError

__all__ = ["offload_greedy", "offload_dp", "vdnn", "lower_bound", "dp_decisions", "OFFLOAD_SOLVERS", "VDNN_MODES",
           "ROUNDINGS", "DEFAULT_SLOTS"]

logger = logging.getLogger(__name__)

DEFAULT_SLOTS = 500
"""Memory slots of :func:`offload_dp` (the paper: "500 is a reasonable value in practice")."""

VDNN_MODES = ("all", "conv")
ROUNDINGS = ("up", "down")


def _require_feasible(chain: Chain, limit: int, solver: str) -> None:
    need = chain.min_memory_bytes
    if limit < need:
        raise InfeasibleBudgetError(limit, need, solver=solver)


def lower_bound(chain: Chain, memory_limit_bytes: int) -> float:
    """Proposition 3: ``max(sum(u_F + u_B), 2 * max(0, M_peak - M) / B)`` seconds.

    Every schedule computes everything, and copies at least ``M_peak - M`` bytes out and back
    (Proposition 2). Raises :class:`~autoremat.errors.InfeasibleBudgetError` when no schedule
    fits ``memory_limit_bytes``.
    """
    chain = check_chain(chain)
    limit = check_limit(memory_limit_bytes)
    _require_feasible(chain, limit, "lower-bound")
    moved = max(0, chain.peak_bytes - limit)
    return max(chain.compute_time_s, 2.0 * moved / chain.bandwidth_bytes_per_s)


def offload_greedy(chain: Chain, memory_limit_bytes: int, *, fractional: bool = False) -> OffloadSchedule:
    """GREEDY: offload the first activations until ``M_peak - M`` bytes are covered (§4.2).

    ``fractional=False``: whole activations ``x_0..x_k`` with ``k`` the least index whose prefix
    reaches ``M_peak - M`` (zero-size activations are skipped), integral model.
    ``fractional=True``: exactly ``M_peak - M`` bytes (the last activation partly), fractional
    model: Theorem 2's optimal schedule for the fractional relaxation.
    """
    chain = check_chain(chain)
    limit = check_limit(memory_limit_bytes)
    _require_feasible(chain, limit, "offload-greedy")
    remaining = float(max(0, chain.peak_bytes - limit))
    fractions = [0.0] * (chain.n_ops + 1)
    for j in chain.offloadable:
        if remaining <= 0:
            break
        xj = chain.x_bytes[j]
        fractions[j] = 1.0 if (not fractional or xj <= remaining) else remaining / xj
        remaining -= xj
    opts = {"target_bytes": max(0, chain.peak_bytes - limit)}
    if fractional:
        return simulate_relaxed(chain, limit, fractions, solver="offload-greedy", options={**opts, "fractional": True})
    chosen = [j for j, f in enumerate(fractions) if f > 0]
    return simulate_offload(chain, limit, chosen, solver="offload-greedy", options=opts)


def _repair(chain: Chain, limit: int, chosen: set[int]) -> list[int]:
    """Add activations until every operation fits; return those added.

    At the first operation ``i`` short of ``deficit`` bytes, add the smallest ``x_j`` (``j < i``)
    that covers the deficit alone (the earliest among equals), else the largest one, and repeat.
    """
    added: list[int] = []
    offl = chain.offloadable
    x = chain.x_bytes
    mf, mb = chain.fwd_memory_bytes, chain.bwd_memory_bytes
    for i in range(chain.n_ops):
        while True:
            deficit = max(mf[i], mb[i]) - limit - sum(x[j] for j in chosen if j < i)
            if deficit <= 0:
                break
            cand = [j for j in offl if j < i and j not in chosen]
            assert cand, "cannot repair a set although the limit is feasible, please report"
            big = [j for j in cand if x[j] >= deficit]
            j = min(big, key=lambda c: (x[c], c)) if big else max(cand, key=lambda c: (x[c], -c))
            chosen.add(j)
            added.append(j)
    return added


def _rounded_capacity(times: Sequence[float], per_slot_s: float) -> list[int]:
    """Slots the link moves during each operation, rounded along prefix sums of time."""
    out, acc, prev = [], 0.0, 0
    for t in times:
        acc += t
        cur = int(math.floor(acc / per_slot_s + 0.5))
        out.append(cur - prev)
        prev = cur
    return out


def _prune(states: dict[tuple[int, int, int], tuple[int, Any, int]]) -> dict[tuple[int, int, int], tuple[int, Any, int]]:
    """Drop dominated states: same ``(C, D_F)``, no smaller ``D_B`` backlog, no less idle time.

    A smaller prefetch backlog ``D_B`` (or more link slack, when negative) never hurts: the
    backward waits, the next backlog and the idle time between phases are all non-decreasing in
    it, so of two such states only one with less backlog or less idle time can lead to the optimum.
    """
    out: dict[tuple[int, int, int], tuple[int, Any, int]] = {}
    group: tuple[int, int] | None = None
    best = 0
    for key in sorted(states):  # by C, then D_F, then D_B
        val = states[key]
        if (key[0], key[1]) != group:
            group, best = (key[0], key[1]), val[0]
            out[key] = val
        elif val[0] < best:
            best = val[0]
            out[key] = val
    return out


def dp_decisions(chain: Chain, limit: int, slots: int, *, rounding: str = "up",
                 prune: bool = True) -> tuple[list[int] | None, dict[str, Any]]:
    """Algorithm 1 on the discretised chain: offload decisions and diagnostics.

    Long by design: Algorithm 1's table (discretisation, the state update per operation in forward
    and in reversed backward, pruning, the backtrack) shares its discretised arrays; it follows the
    paper's pseudo-code in one place."""
    n, L = chain.n_ops, chain.L
    bw = chain.bandwidth_bytes_per_s
    slot = limit / slots
    per_slot_s = slot / bw
    xround = math.ceil if rounding == "up" else math.floor
    xs = [xround(b / slot) for b in chain.x_bytes]
    mfs = [math.ceil(m / slot) for m in chain.fwd_memory_bytes]
    mbs = [math.ceil(m / slot) for m in chain.bwd_memory_bytes]
    S = slots
    cap_f = _rounded_capacity(chain.fwd_time_s, per_slot_s)
    cap_b = _rounded_capacity(chain.bwd_time_s, per_slot_s)
    offl = set(chain.offloadable)
    clamp = sum(xs[j] for j in offl) + max(sum(cap_f), sum(cap_b)) + 1

    # windows of eq. (9) and (10): operations run back to back next to the phase change
    # (U_j: link capacity from the start of B_L to the start of B_j, resp. from the end of F_j
    # to the end of F_L; *_list[k] is U of the k-th operation from the phase change, and
    # w*_list[k] the largest m_j - U_j over the first k of them)
    neg = -(10**30)
    ub_list: list[int] = []
    uf_list: list[int] = []
    wb_list, wf_list = [neg], [neg]
    ub = uf = 0
    for j in range(L, -1, -1):
        ub_list.append(ub)
        wb_list.append(max(wb_list[-1], mbs[j] - ub))
        uf_list.append(uf)
        wf_list.append(max(wf_list[-1], mfs[j] - uf))
        ub += cap_b[j]
        uf += cap_f[j]

    State = tuple[int, int, int]
    cur: dict[State, tuple[int, State | None, int]] = {(0, 0, 0): (0, None, 0)}
    history: list[dict[State, tuple[int, State | None, int]]] = []
    max_states = 1
    for i in range(n):
        nxt: dict[State, tuple[int, State | None, int]] = {}
        cf, cb, xi = cap_f[i], cap_b[i], xs[i]
        opts = (0, 1) if i in offl and xi > 0 else (0,)
        mfi, mbi = mfs[i] - S, mbs[i] - S
        for key, val in cur.items():
            C, D, DB = key
            idle = val[0]
            Dp = D if D > 0 else 0
            eps = mfi - C
            if eps < 0:
                eps = 0
            elif eps > Dp:
                continue
            DBp = DB if DB > 0 else 0
            epsb = mbi - (C + Dp - DBp)
            if epsb < 0:
                epsb = 0
            elif epsb > DBp:
                continue
            wf = eps + cf
            wb = epsb + cb
            nidle = idle + eps + epsb
            for o in opts:
                if o:
                    q = Dp + xi
                    nD = q - wf
                    T = q if q < wf else wf
                    nDB = xi + (DBp - wb if DBp > wb else 0)
                else:
                    nD = D - wf
                    T = Dp if Dp < wf else wf
                    nDB = DB - wb
                if nD < -clamp:
                    nD = -clamp
                if nDB < -clamp:
                    nDB = -clamp
                nk = (C + T, nD, nDB)
                old = nxt.get(nk)
                if old is None or nidle < old[0]:
                    nxt[nk] = (nidle, key, o)
        if prune:
            nxt = _prune(nxt)
        history.append(nxt)
        cur = nxt
        max_states = max(max_states, len(cur))
    best: tuple[int, State] | None = None
    for key, val in cur.items():
        C, D, DB = key
        Q = C + max(D, 0)
        if D <= 0 and DB <= 0:
            g = 0
        elif D > 0 and DB > 0:
            g = D + DB
        elif D > 0:
            avb = -DB
            g = max(0, D - avb)
            k = bisect.bisect_left(ub_list, avb)
            if k:
                g = max(g, wb_list[k] - S - C)
        else:
            avf = -D
            g = max(0, DB - avf)
            k = bisect.bisect_left(uf_list, avf)
            if k:
                g = max(g, wf_list[k] - S - Q + DB)
        total = val[0] + g
        if best is None or total < best[0]:
            best = (total, key)
    diag: dict[str, Any] = {"slots": slots, "slot_bytes": slot, "rounding": rounding, "max_states": max_states}
    if best is None:
        return None, diag
    decisions = [0] * n
    key: State | None = best[1]
    for i in range(n - 1, -1, -1):
        assert key is not None, "broken DP backtrack, please report"
        _, parent, o = history[i][key]
        decisions[i] = o
        key = parent
    diag["estimated_idle_s"] = best[0] * per_slot_s
    diag["estimated_makespan_s"] = chain.compute_time_s + best[0] * per_slot_s
    return [i for i in range(n) if decisions[i]], diag


def offload_dp(chain: Chain, memory_limit_bytes: int, *, slots: int = DEFAULT_SLOTS,
               rounding: str = "up") -> OffloadSchedule:
    """DYNPROG: Algorithm 1's decisions, scheduled no-wait and ordered in the integral model.

    ``slots`` (>= 1) is the number of memory slots ``S``: sizes are counted in units of
    ``memory_limit_bytes / slots`` bytes (recorded as ``options["slot_bytes"]``). ``rounding``
    is how activation sizes become slots: ``"up"`` (the paper) or ``"down"`` (every decision
    fits without repair, but the copies of many small activations look cheaper than they are).
    The DP's own estimate of the (relaxed) makespan is ``options["estimated_makespan_s"]``;
    activations added to make the decisions fit are ``options["repaired"]``.
    """
    chain = check_chain(chain)
    limit = check_limit(memory_limit_bytes)
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise ValueError(f"slots={slots!r} must be an int >= 1 (the paper uses 500)")
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding={rounding!r}; expected one of {ROUNDINGS}")
    _require_feasible(chain, limit, "offload-dp")
    if limit >= chain.peak_bytes or limit == 0:
        return simulate_offload(chain, limit, [], solver="offload-dp",
                                options={"slots": slots, "slot_bytes": limit / slots, "rounding": rounding,
                                         "repaired": []})
    chosen, diag = dp_decisions(chain, limit, slots, rounding=rounding)
    if chosen is None:
        logger.info("offload-dp: with %d slots no decision fits the discretised limit; "
                       "offloading eagerly instead (raise slots)", slots)
        chosen = []
    picked = set(chosen)
    added = _repair(chain, limit, picked)
    if added:
        logger.info("offload-dp: the discretised decisions do not fit %d bytes exactly; added "
                    "activations %s (raise slots to avoid this)", limit, added)
    diag["repaired"] = added
    diag["dp_decisions"] = list(chosen)
    return simulate_offload(chain, limit, sorted(picked), solver="offload-dp", options=diag)


def vdnn(chain: Chain, memory_limit_bytes: int, *, mode: str = "conv") -> OffloadSchedule:
    """VDNN: the vDNN++ heuristic as the paper evaluates it (§6.1).

    ``mode="conv"``: for every threshold ``t`` among the ratios ``u_F[i] / |x_i|`` (and one above
    them all: offload nothing), the schedules offloading every activation with ratio >= ``t``,
    and every other one of those; the best feasible one is returned (``options["threshold"]``,
    ``options["variant"]``).
    ``mode="all"``: offload every activation (vDNN_all).
    """
    chain = check_chain(chain)
    limit = check_limit(memory_limit_bytes)
    if mode not in VDNN_MODES:
        raise ValueError(f"mode={mode!r} is not a vDNN mode; expected one of {VDNN_MODES}")
    _require_feasible(chain, limit, "vdnn")
    offl = list(chain.offloadable)
    candidates: list[tuple[list[int], dict[str, Any]]] = [(offl, {"variant": "all", "threshold": None})]
    if mode == "conv":
        candidates.append(([], {"variant": "none", "threshold": math.inf}))
        ratio = {i: chain.fwd_time_s[i] / chain.x_bytes[i] for i in offl}
        for t in sorted(set(ratio.values())):
            above = [i for i in offl if ratio[i] >= t]
            candidates.append((above, {"variant": "above", "threshold": t}))
            candidates.append((above[::2], {"variant": "every-other", "threshold": t}))
    best: OffloadSchedule | None = None
    seen: set[tuple[int, ...]] = set()
    for chosen, info in candidates:
        key = tuple(chosen)
        if key in seen:
            continue
        seen.add(key)
        amounts = [0.0] * (chain.n_ops + 1)
        for j in chosen:
            amounts[j] = float(chain.x_bytes[j])
        if offload_set_min_memory_bytes(chain, amounts) > limit:
            continue
        s = simulate_offload(chain, limit, chosen, solver="vdnn", options={"mode": mode, **info})
        if best is None or (s.makespan_s, s.offloaded_bytes) < (best.makespan_s, best.offloaded_bytes):
            best = s
    assert best is not None, "vDNN found no feasible candidate above the minimum limit, please report"
    return best


OFFLOAD_SOLVERS: dict[str, Callable[..., OffloadSchedule]] = {
    "offload-greedy": offload_greedy,
    "offload-dp": offload_dp,
    "vdnn": vdnn,
}
"""Registry: name -> ``solver(chain, memory_limit_bytes, **options) -> OffloadSchedule``."""
