"""``autoremat.solvers.kusumoto.search``: the search per graph, its minimum, its cache.

The cache shares a search between calls on the same graph and options, notices a graph edited in
place, drops a search interrupted mid-way and keeps one whose budget was infeasible, and holds
graphs weakly; the minimum is the smaller of the unoptimised peak and the simulated peak of the
sequence found at the least DP budget.
"""

from __future__ import annotations

import gc
import weakref

import pytest
from _graphs import random_dag

import autoremat
from autoremat.cost import unoptimised_peak_bytes
from autoremat.solvers.kusumoto import min_budget
from autoremat.solvers.kusumoto.search import Search, parse_config, search_for


def test_search_cache_shares_and_notices_edits():
    g = random_dag(5, 7)
    first = search_for(g, "dp-approx", parse_config(None, "dp-approx"))
    assert search_for(g, "dp-approx", parse_config({"objective": "memory"}, "dp-approx")) is first
    assert search_for(g, "dp-approx", parse_config({"time_slots": 7}, "dp-approx")) is not first
    before = min_budget(g, "dp-approx")
    g.nx.nodes[0]["out_bytes"] += 50  # edited in place: a new search, the right answer
    g.nx.nodes[0]["alloc_bytes"] += 50
    assert search_for(g, "dp-approx", parse_config(None, "dp-approx")) is not first
    assert min_budget(g, "dp-approx") == min_budget(g.copy(), "dp-approx") >= before


def test_an_interrupted_search_is_not_reused(monkeypatch):
    g = random_dag(9, 7)
    search = search_for(g, "dp-approx", parse_config(None, "dp-approx"))

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(search, "least_dp_budget", interrupted)
    with pytest.raises(KeyboardInterrupt):
        min_budget(g, "dp-approx")
    assert search.broken
    assert search_for(g, "dp-approx", parse_config(None, "dp-approx")) is not search
    assert min_budget(g, "dp-approx") == min_budget(g.copy(), "dp-approx")


def test_a_search_goes_with_its_graph():
    g = random_dag(4, 7)
    min_budget(g, "dp-exact")
    search = weakref.ref(search_for(g, "dp-exact", parse_config(None, "dp-exact")))
    assert search() is not None
    del g
    gc.collect()
    assert search() is None


def test_an_infeasible_budget_keeps_the_search_for_the_next_call():
    """solve(g, too_little) then solve(g, minimum): the second call reuses the first's search."""
    g = random_dag(9, 11)
    search = search_for(g, "dp-approx", parse_config(None, "dp-approx"))
    with pytest.raises(autoremat.InfeasibleBudgetError) as err:
        autoremat.solve(g, 0, solver="dp-approx")
    assert not search.broken
    assert search_for(g, "dp-approx", parse_config(None, "dp-approx")) is search
    autoremat.solve(g, err.value.min_budget_bytes, solver="dp-approx")
    assert search_for(g, "dp-approx", parse_config(None, "dp-approx")) is search


@pytest.mark.parametrize("solver", ["dp-exact", "dp-approx"])
def test_minimum_is_the_least_simulated_peak_of_the_dp_sequence(solver):
    g = random_dag(12, 9)
    search = Search(g, solver, parse_config(None, solver))
    least = search.minimum()
    assert least.budget_bytes <= unoptimised_peak_bytes(g)
    assert least.dp_budget_bytes == search.least_dp_budget()[0]
    if least.plan is not None:
        assert autoremat.simulate(g, least.plan).peak_bytes == least.budget_bytes
    else:
        assert least.budget_bytes == unoptimised_peak_bytes(g)
    assert search.minimum() is least  # cached


def test_config_accepts_either_dp_config_and_rejects_others():
    from autoremat.solvers.chen import ChenConfig
    from autoremat.solvers.kusumoto import DPApproxConfig

    cfg = parse_config(DPApproxConfig(time_slots=7), "dp-exact")  # the shared options suit either DP
    assert cfg["time_slots"] == 7 and cfg["fallback"] is True
    with pytest.raises(ValueError, match="config is a ChenConfig"):
        parse_config(ChenConfig(), "dp-exact")
