"""``autoremat.cost.chain_replay``: the integral and fractional no-wait replays of a chain schedule.

The relaxation is never slower than the integral model for the same set; with nothing offloaded
both replays run the chain back to back at its ``M_peak`` (the peak the simulator predicts for a
chain made from a graph: ``test_chain.py``); a set whose operations cannot fit is refused.
"""

from __future__ import annotations

import random

import pytest
from _chains import all_schedules, feasible, limits, rand_chain, subsets

from autoremat.cost.chain_replay import simulate_offload, simulate_relaxed
from autoremat.cost.chain_schedule import validate_schedule
from autoremat.errors import InfeasibleBudgetError


def test_relaxed_never_worse_than_integral_for_the_same_set():
    rng = random.Random(4)
    for _ in range(30):
        c = rand_chain(rng, rng.randint(1, 6))
        for limit in limits(c, 4):
            for sub in subsets(c):
                if not feasible(c, limit, sub):
                    continue
                integral = simulate_offload(c, limit, sub)
                relaxed = simulate_relaxed(c, limit, [1.0 if j in sub else 0.0 for j in range(c.n_ops + 1)])
                validate_schedule(c, integral)
                validate_schedule(c, relaxed)
                assert relaxed.makespan_s <= integral.makespan_s * (1 + 1e-7)




def test_nothing_offloaded_runs_back_to_back_at_the_chains_peak():
    rng = random.Random(12)
    for _ in range(30):
        c = rand_chain(rng, rng.randint(1, 8))
        for s in (simulate_offload(c, c.peak_bytes, []), simulate_relaxed(c, c.peak_bytes, [0.0] * (c.n_ops + 1))):
            assert validate_schedule(c, s) == c.peak_bytes == s.peak_bytes
            assert s.makespan_s == pytest.approx(c.compute_time_s) and s.idle_s == pytest.approx(0.0, abs=1e-9)
            assert s.transfers == ()


def test_a_set_that_cannot_fit_is_refused():
    rng = random.Random(13)
    c = None
    while c is None or c.min_memory_bytes == 0 or not c.offloadable:
        c = rand_chain(rng, 5, integer=True)
    with pytest.raises(InfeasibleBudgetError) as err:
        simulate_offload(c, c.min_memory_bytes - 1, c.offloadable)
    assert err.value.min_budget_bytes == c.min_memory_bytes
    with pytest.raises(ValueError, match="never offloaded"):
        simulate_offload(c, c.peak_bytes, [c.n_ops])
    with pytest.raises(ValueError, match="fractions"):
        simulate_relaxed(c, c.peak_bytes, [0.0])
