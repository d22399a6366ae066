"""``autoremat.solvers.blocks.dp``: the chain program against brute force on random model
terms (least time within the budget, the least peak), and its rounding never accepts a choice
over the budget."""

from __future__ import annotations

import itertools
import random

import pytest

from autoremat.cost.block_chain import ChainProfile, chain_peak, chain_time
from autoremat.solvers.blocks.dp import least_peak, solve_chain


def _profile(rng: random.Random, blocks: int, options: int) -> ChainProfile:
    held = [[0] + [rng.randint(-60, 20) for _ in range(options - 1)] for _ in range(blocks)]
    fwd = [[rng.randint(50, 150) for _ in range(options)] for _ in range(blocks)]
    bwd = [[rng.randint(50, 200) for _ in range(options)] for _ in range(blocks)]
    times = [[0.0] + [float(rng.randint(1, 9)) for _ in range(options - 1)] for _ in range(blocks)]
    return ChainProfile(held=held, held_min=held, fwd_peak=fwd, bwd_peak=bwd,
                        gap_peak=[rng.randint(0, 120) for _ in range(blocks + 1)], time_s=times)


@pytest.mark.parametrize("seed", range(20))
def test_program_equals_brute_force(seed: int):
    rng = random.Random(seed)
    p = _profile(rng, rng.randint(1, 4), rng.randint(2, 4))
    choices = list(itertools.product(*(range(len(h)) for h in p.held)))
    assert least_peak(p, units=10**6) == min(chain_peak(p, c) for c in choices)
    for budget in sorted({chain_peak(p, c) for c in choices}):
        sol = solve_chain(p, budget, units=10**6)  # one byte per state: exact
        best = min(chain_time(p, c) for c in choices if chain_peak(p, c) <= budget)
        assert sol is not None and sol.time_s == pytest.approx(best)
        assert chain_peak(p, sol.choice) <= budget
    assert solve_chain(p, least_peak(p, units=10**6) - 1, units=10**6) is None


@pytest.mark.parametrize("seed", range(10))
def test_coarse_states_stay_within_the_budget(seed: int):
    rng = random.Random(100 + seed)
    p = _profile(rng, 5, 4)
    for budget in range(100, 400, 17):
        sol = solve_chain(p, budget, units=7)
        if sol is not None:
            assert chain_peak(p, sol.choice) <= budget
    assert least_peak(p, units=7) >= least_peak(p, units=10**6)


def test_coarse_states_accept_a_budget_equal_to_a_choice_peak():
    """Per-layer checkpointing's peak as the budget: rounding each block's held bytes up would
    put six identical blocks over it (the benchmark's Llama was refused at HF's own peak)."""
    blocks = 6
    p = ChainProfile(held=[[0, -667]] * blocks, held_min=[[0, -667]] * blocks, fwd_peak=[[50, 50]] * blocks,
                     bwd_peak=[[4000, 700]] * blocks, gap_peak=[10] * blocks + [5000], time_s=[[0.0, 1.0]] * blocks)  # peak at the loss
    whole = (1,) * blocks
    budget = chain_peak(p, whole)
    assert least_peak(p, units=7) == budget == least_peak(p, units=10**6)
    sol = solve_chain(p, budget, units=7)
    assert sol is not None and chain_peak(p, sol.choice) <= budget
