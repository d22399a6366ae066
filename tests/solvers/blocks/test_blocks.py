"""``autoremat.solvers.blocks``: the three budget cases, plans within budget and checked by the
simulator, extra time never rising with the budget, the least budget, options, graphs without
blocks, and the chain program's plan against brute force over every choice of options."""

from __future__ import annotations

import itertools
import random

import pytest

from _graphs import block_chain, skip_chain
from _plans import check_plan
from autoremat import InfeasibleBudgetError, solve
from autoremat.cost import simulate, unoptimised_peak_bytes
from autoremat.cost.block_chain import chain_peak, chain_plan, chain_slack
from autoremat.solvers import SOLVERS, min_budget
from autoremat.solvers.blocks import BlocksConfig, chain_of, solve_blocks


def _graph(seed: int = 0, blocks: int = 4):
    return block_chain(random.Random(seed), blocks, width=7, shared_saved=True)


def test_three_budget_cases():
    g = _graph()
    peak = unoptimised_peak_bytes(g)
    plan = SOLVERS["blocks"](g, peak)
    assert not plan.recompute_segments  # not binding
    check_plan(g, plan, peak, "blocks")
    least = min_budget(g, "blocks")
    assert least < peak
    plan = SOLVERS["blocks"](g, least)  # binding
    check_plan(g, plan, least, "blocks")
    assert plan.recompute_segments and plan.options["blocks"] == 4
    with pytest.raises(InfeasibleBudgetError) as err:  # infeasible
        solve_blocks(g, least - 1)
    assert err.value.solver == "blocks" and err.value.min_budget_bytes >= least - 1


@pytest.mark.parametrize("seed", range(6))
def test_time_never_rises_with_the_budget_and_plans_fit(seed: int):
    g = _graph(seed, blocks=3 + seed % 3)
    peak, least = unoptimised_peak_bytes(g), min_budget(g, "blocks")
    last = float("inf")
    for k in range(9):
        budget = least + (peak - least) * k // 8
        plan = SOLVERS["blocks"](g, budget)
        check_plan(g, plan, budget, "blocks")
        assert plan.predicted_extra_time_s <= last + 1e-9
        last = plan.predicted_extra_time_s


@pytest.mark.parametrize("seed", range(4))
def test_program_is_optimal_over_every_choice(seed: int):
    """Brute force over every choice of options (3 blocks): the solver's plan takes the least
    extra time among the choices its model puts within the budget (which the simulator puts
    there too), and the true optimum is at most the model's slack away in memory."""
    g = block_chain(random.Random(seed), 3, width=5, shared_saved=True)
    cfg = BlocksConfig(keep_fractions=(0.2, 0.5))
    chain, profile = chain_of(g, cfg)
    table = {}
    for choice in itertools.product(*(range(len(chain.options[c])) for c in chain.classes)):
        sim = simulate(g, chain_plan(g, chain, choice), check=False)
        model = chain_peak(profile, choice)
        assert sim.peak_bytes <= model <= sim.peak_bytes + chain_slack(profile, choice)
        table[choice] = (model, sim.extra_time_s)
    peaks = sorted({p for p, _t in table.values()})
    for budget in peaks[:: max(1, len(peaks) // 6)]:
        best = min(t for p, t in table.values() if p <= budget)
        plan = solve_blocks(g, budget, config=cfg)
        assert simulate(g, plan).peak_bytes <= budget
        assert simulate(g, plan).extra_time_s == pytest.approx(best)


def test_graph_without_blocks():
    g = skip_chain(12)
    peak = unoptimised_peak_bytes(g)
    assert not solve_blocks(g, peak).recompute_segments
    with pytest.raises(InfeasibleBudgetError) as err:
        solve_blocks(g, peak - 1)
    assert err.value.min_budget_bytes == peak


def test_auto_tries_blocks():
    g = _graph(2)
    least = min_budget(g, "blocks")
    plan = solve(g, least)
    assert plan.predicted_peak_bytes <= least


def test_options_are_checked():
    g = _graph()
    with pytest.raises(ValueError, match="blocks: unknown option"):
        solve_blocks(g, 10, config={"thresholds": 3})
    with pytest.raises(ValueError, match="keep_fractions"):
        BlocksConfig(keep_fractions=(1.5,))
    with pytest.raises(ValueError, match="units"):
        BlocksConfig(units=0)
    assert BlocksConfig.parse(None) == BlocksConfig()


@pytest.mark.parametrize("seed", [1, 31])
def test_the_least_budget_it_reports_is_one_it_meets(seed: int):
    """Graphs where the chain model's least peak is optimistic (the simulator puts that plan
    higher): the error's least budget used to be the model's, where no plan fit (issue 28)."""
    g = block_chain(random.Random(seed), 3 + seed % 4, width=7, shared_saved=False)
    with pytest.raises(InfeasibleBudgetError) as err:
        solve_blocks(g, 1)
    least = err.value.min_budget_bytes
    check_plan(g, SOLVERS["blocks"](g, least), least, "blocks")
    assert min_budget(g, "blocks") <= least
