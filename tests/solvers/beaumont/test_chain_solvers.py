"""``autoremat.solvers.beaumont.chain_solvers``: GREEDY, DYNPROG and vDNN on a chain (Beaumont et al.).

Properties on seeded random chains, against brute force over every offload set:

* every schedule is valid (order, one transfer at a time, data dependencies, memory within the
  limit at every instant) and its makespan is >= Proposition 3's bound;
* Theorem 2 (the paper's exact condition): in the *fractional relaxation* the no-wait, eager,
  ordered schedule offloading exactly ``M_peak - M`` bytes is optimal. Checked against every
  whole-activation set, larger eager amounts and random fractional vectors. The integral GREEDY
  only rounds it up; it equals it when nothing needs offloading, and is never below it;
* Algorithm 1 is exact for the fractional-communications relaxation when nothing is rounded
  (integer sizes, one byte per slot, ``u * B`` integral): its optimum equals the best relaxed
  makespan over every set; that optimum is a lower bound on the best *integral* schedule found
  by brute force (≤ 6 operations), and DYNPROG's integral schedule is never better than that
  best (the integral problem is NP-hard);
* limits below ``chain.min_memory_bytes`` raise ``InfeasibleBudgetError`` with that minimum,
  which brute force confirms is the least feasible limit.
"""

from __future__ import annotations

import random

import pytest
from _chains import all_schedules, feasible, limits, rand_chain, subsets

from autoremat.cost.chain import Chain
from autoremat.cost.chain_replay import simulate_offload, simulate_relaxed
from autoremat.cost.chain_schedule import Transfer, offload_set_min_memory_bytes, validate_schedule
from autoremat.errors import InfeasibleBudgetError
from autoremat.solvers.beaumont.chain_solvers import dp_decisions, lower_bound, offload_dp, offload_greedy, vdnn

TOL = 1e-9


# ---------------------------------------------------------------------- golden cases
def test_hand_solved_two_op_chain():
    # F_0: x_0 -> x_1 (2 s), F_1: x_1 -> x_2 (2 s); B_1, B_0 take 2 s; B = 1 byte/s
    c = Chain(fwd_time_s=(2.0, 2.0), bwd_time_s=(2.0, 2.0), x_bytes=(0, 4, 6), y_bytes=(0, 0, 0),
              fwd_extra_bytes=(0, 0), bwd_extra_bytes=(0, 0), bandwidth_bytes_per_s=1.0)
    assert c.fwd_memory_bytes == (4, 10) and c.bwd_memory_bytes == (4, 10)
    assert c.peak_bytes == 10 and c.min_memory_bytes == 10  # F_1 needs x_1 (its input) and x_2
    c = Chain(fwd_time_s=(2.0, 2.0, 2.0), bwd_time_s=(2.0, 2.0, 2.0), x_bytes=(0, 4, 2, 6),
              y_bytes=(0, 0, 0, 0), fwd_extra_bytes=(0, 0, 0), bwd_extra_bytes=(0, 0, 0),
              bandwidth_bytes_per_s=1.0)
    assert c.peak_bytes == 12 and c.min_memory_bytes == 8
    # offload x_1 under M = 8: copy [2, 6] (x_1 produced at 2, F_1 reads it until 4);
    # F_2 needs 12 - 4 = 8: waits for the release at 6; F_2 [6, 8]; B_2 [8, 10];
    # prefetch x_1 needs B_2's 12 - 4 + 4 > 8: waits for B_2's end, [10, 14]; B_1 [14, 16], B_0 [16, 18]
    s = simulate_offload(c, 8, [1])
    assert s.fwd_start_s == (0.0, 2.0, 6.0)
    assert s.transfers == (Transfer(1, "offload", 2.0, 6.0, 4.0, 1.0), Transfer(1, "prefetch", 10.0, 14.0, 4.0, 1.0))
    assert s.bwd_start_s == (16.0, 14.0, 8.0)
    assert s.makespan_s == 18.0 and s.idle_s == 6.0 and s.peak_bytes == 8
    assert validate_schedule(c, s) == 8
    assert lower_bound(c, 8) == 12.0  # max(12, 2 * 4 / 1)
    # fractional model, same decision: memory frees as x_1 goes, so F_2 starts at 6 as well
    # (it needs all 4 bytes); the prefetch runs as late as possible, ending when B_1 starts
    r = simulate_relaxed(c, 8, [0, 1, 0, 0])
    assert r.makespan_s == pytest.approx(18.0)
    assert validate_schedule(c, r) <= 8


def test_no_offload_when_limit_does_not_bind():
    rng = random.Random(1)
    for _ in range(20):
        c = rand_chain(rng, rng.randint(1, 6))
        for limit in (c.peak_bytes, c.peak_bytes * 2):
            for s in all_schedules(c, limit):
                if s.solver == "vdnn" and s.options["mode"] == "all":
                    continue  # vDNN_all offloads everything whatever the limit
                assert s.offloaded == ()
                assert s.makespan_s == pytest.approx(c.compute_time_s)
                assert lower_bound(c, limit) == pytest.approx(c.compute_time_s)


# ---------------------------------------------------------------------- properties
def test_schedules_valid_and_above_lower_bound():
    rng = random.Random(2)
    for _ in range(40):
        c = rand_chain(rng, rng.randint(1, 8))
        for limit in limits(c):
            lb = lower_bound(c, limit)
            frac = offload_greedy(c, limit, fractional=True).makespan_s
            for s in all_schedules(c, limit):
                peak = validate_schedule(c, s)
                assert peak <= limit
                assert s.makespan_s >= lb * (1 - TOL)
                assert s.makespan_s >= frac * (1 - 1e-7)  # Theorem 2's optimum bounds every schedule


def test_theorem2_fractional_greedy_is_optimal_for_the_fractional_relaxation():
    rng = random.Random(3)
    for _ in range(40):
        c = rand_chain(rng, rng.randint(1, 6))
        for limit in limits(c, 4):
            best = offload_greedy(c, limit, fractional=True)
            validate_schedule(c, best)
            target = max(0, c.peak_bytes - limit)
            assert best.offloaded_bytes == pytest.approx(target)
            others = [simulate_relaxed(c, limit, [1.0 if j in sub else 0.0 for j in range(c.n_ops + 1)])
                      for sub in subsets(c) if feasible(c, limit, sub)]
            for _ in range(10):  # random fractional vectors that offload enough
                f = [rng.random() if j < c.n_ops and c.x_bytes[j] else 0.0 for j in range(c.n_ops + 1)]
                amounts = [f[j] * c.x_bytes[j] for j in range(c.n_ops + 1)]
                if offload_set_min_memory_bytes(c, amounts) <= limit:
                    others.append(simulate_relaxed(c, limit, f))
            for extra in (0.1, 0.3, 0.6, 1.0):  # eager schedules offloading more (Lemma 2)
                q = target + extra * (sum(c.x_bytes[j] for j in c.offloadable) - target)
                f = [0.0] * (c.n_ops + 1)
                for j in c.offloadable:
                    f[j] = min(1.0, max(0.0, q / c.x_bytes[j]))
                    q -= c.x_bytes[j]
                others.append(simulate_relaxed(c, limit, f))
            for o in others:
                validate_schedule(c, o)
                assert best.makespan_s <= o.makespan_s * (1 + 1e-7), (c, limit, o.fractions)
            # the integral GREEDY rounds the prefix up: never better than the relaxation's optimum
            assert offload_greedy(c, limit).makespan_s >= best.makespan_s * (1 - 1e-7)


def test_dp_is_exact_for_the_relaxation_without_rounding():
    rng = random.Random(5)
    checked = 0
    for _ in range(60):
        c = rand_chain(rng, rng.randint(1, 6), integer=True)
        for limit in limits(c, 4):
            if limit == 0 or limit >= c.peak_bytes:
                continue
            chosen, diag = dp_decisions(c, limit, slots=limit)  # one byte per slot
            assert chosen is not None
            best = min(simulate_relaxed(c, limit, [1.0 if j in sub else 0.0 for j in range(c.n_ops + 1)]).makespan_s
                       for sub in subsets(c) if feasible(c, limit, sub))
            assert diag["estimated_makespan_s"] == pytest.approx(best, abs=1e-9)
            own = simulate_relaxed(c, limit, [1.0 if j in chosen else 0.0 for j in range(c.n_ops + 1)])
            assert own.makespan_s == pytest.approx(best, abs=1e-9)
            assert diag.get("max_states", 0) >= 1
            checked += 1
    assert checked > 50


def test_dp_against_integral_brute_force():
    rng = random.Random(6)
    ties = total = 0
    for _ in range(60):
        c = rand_chain(rng, rng.randint(1, 6), integer=True)
        for limit in limits(c, 4):
            if limit == 0:
                continue
            best = min(simulate_offload(c, limit, sub).makespan_s for sub in subsets(c) if feasible(c, limit, sub))
            dp = offload_dp(c, limit, slots=max(1, limit))
            validate_schedule(c, dp)
            relaxed_opt = dp.options.get("estimated_makespan_s", c.compute_time_s)
            assert relaxed_opt <= best + 1e-9  # the relaxation bounds the integral optimum
            assert dp.makespan_s >= best - 1e-9
            assert offload_greedy(c, limit, fractional=True).makespan_s <= best + 1e-9
            ties += dp.makespan_s <= best + 1e-9
            total += 1
    assert ties >= 0.5 * total  # DYNPROG is usually optimal on these small chains


def test_infeasible_limits_raise_the_true_minimum():
    rng = random.Random(7)
    for _ in range(40):
        c = rand_chain(rng, rng.randint(1, 6), integer=rng.random() < 0.5)
        m = c.min_memory_bytes
        # brute force: m is the least limit some set of whole activations fits
        assert min(offload_set_min_memory_bytes(c, [float(c.x_bytes[j]) if j in sub else 0.0
                                                    for j in range(c.n_ops + 1)]) for sub in subsets(c)) == m
        if m == 0:
            continue
        for solve in (offload_greedy, offload_dp, vdnn, lower_bound,
                      lambda ch, lim: offload_greedy(ch, lim, fractional=True),
                      lambda ch, lim: vdnn(ch, lim, mode="all")):
            with pytest.raises(InfeasibleBudgetError) as err:
                solve(c, m - 1)
            assert err.value.min_budget_bytes == m and err.value.budget_bytes == m - 1
            solve(c, m)  # and the minimum itself works
        with pytest.raises(InfeasibleBudgetError):
            simulate_offload(c, m - 1, c.offloadable)


def test_fractional_greedy_monotone_in_the_limit():
    rng = random.Random(8)
    for _ in range(20):
        c = rand_chain(rng, rng.randint(2, 8))
        spans = [offload_greedy(c, limit, fractional=True).makespan_s for limit in limits(c, 8)]
        assert all(a >= b * (1 - 1e-7) for a, b in zip(spans, spans[1:]))


def test_dp_rounding_down_never_needs_repair():
    rng = random.Random(11)
    for _ in range(30):
        c = rand_chain(rng, rng.randint(2, 8))
        for limit in limits(c, 5)[1:]:  # above the minimum the discretised problem is feasible
            for slots in (20, 200):
                s = offload_dp(c, limit, slots=slots, rounding="down")
                validate_schedule(c, s)
                if s.options.get("dp_decisions") is not None and limit < c.peak_bytes:
                    chosen, _ = dp_decisions(c, limit, slots, rounding="down")
                    if chosen is not None:
                        assert s.options["repaired"] == []


def test_more_slots_refine_the_dp_estimate():
    rng = random.Random(9)
    for _ in range(10):
        c = rand_chain(rng, 8)
        limit = (c.min_memory_bytes + c.peak_bytes) // 2
        for slots in (10, 100, 1000):
            s = offload_dp(c, limit, slots=slots)
            validate_schedule(c, s)
            assert s.options["slots"] == slots and s.options["slot_bytes"] == pytest.approx(limit / slots)



def test_arguments_are_checked():
    c = Chain(fwd_time_s=(1.0,), bwd_time_s=(1.0,), x_bytes=(0, 1), y_bytes=(0, 0), fwd_extra_bytes=(0,),
              bwd_extra_bytes=(0,))
    with pytest.raises(ValueError, match="slots"):
        offload_dp(c, 10, slots=0)
    with pytest.raises(ValueError, match="rounding"):
        offload_dp(c, 10, rounding="nearest")
    with pytest.raises(ValueError, match="mode"):
        vdnn(c, 10, mode="every-other")
    with pytest.raises(ValueError, match="memory_limit_bytes"):
        offload_greedy(c, -1)
