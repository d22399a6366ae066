"""``autoremat.solvers.kusumoto.labels``: dp-exact's time- and memory-centric label searches.

The memory-centric search (§4.4: the most recomputation time under the budget) runs the
label-setting search on the time each transition leaves out (``T(L' \\ L) - dt``), which is what
the table's "largest t" amounts to, since every sequence's times left out sum to ``T(V)`` less its
recomputation time. Checked here against brute force over every chain of the family (the exact
model's peak and time of each), on random DAGs with views and pass-through nodes, at the least
budget and above it; the time-centric search against brute force too; and the progress log.
"""

from __future__ import annotations

import logging

import pytest
from _graphs import random_dag, random_dag_with_views
from _plans import family_chains

from autoremat import simulate
from autoremat.solvers.kusumoto import dive, min_budget, solve_dp_exact
from autoremat.solvers.kusumoto.search import Search, parse_config


def search_of(graph) -> Search:
    return Search(graph, "dp-exact", parse_config({"max_lower_sets": 10**6}, "dp-exact"))


def model_table(search: Search) -> list[tuple[int, float]]:
    """``(peak, recomputation time)`` in the exact model of every chain of the family."""
    return [search.dp.model_peak(seq) for seq in family_chains(search.dp.fam)]


def by_brute_force(table: list[tuple[int, float]], budget: int, most: bool) -> float | None:
    fits = [t for peak, t in table if peak <= budget]
    return (max(fits) if most else min(fits)) if fits else None


@pytest.fixture(autouse=True)
def _quiet(caplog):
    caplog.set_level(logging.ERROR)


@pytest.mark.parametrize("seed", range(16))
def test_most_recomputation_equals_brute_force(seed):
    maker = random_dag_with_views if seed % 2 else random_dag
    g = maker(700 + seed, 6 + seed % 3)
    search = search_of(g)
    assert search.dp.exact and search.dp.lost_quantum == 1.0  # integer times: exact in time
    least, _ = search.least_dp_budget()
    vanilla = search.dp.vanilla_need()
    table = model_table(search)
    for budget in sorted({least, (least + vanilla) // 2, vanilla}):
        for most, mode in ((True, "memory"), (False, "time")):
            found = search.dp.run(budget, mode)
            want = by_brute_force(table, budget, most)
            if want is None:
                assert found is None
                continue
            assert found is not None
            seq, t = found
            assert t == want
            assert search.dp.model_peak(seq) == (search.dp.model_peak(seq)[0], t)
            assert search.dp.model_peak(seq)[0] <= budget


def test_float_times_stay_within_the_time_grid():
    """With times that share no unit the buckets are a sixteenth of the DP's quantum: the answer
    fits and is within a bucket per transition of the brute-force most."""
    g = random_dag_with_views(733, 8)
    for v in g.nodes:
        g.node(v)["time_s"] = g.node(v)["time_s"] * 1.37 + 0.01 * v
    search = search_of(g)
    assert search.dp.lost_quantum == search.dp.quantum / 16
    least, _ = search.least_dp_budget()
    seq, t = search.dp.run(least, "memory")
    peak, t_model = search.dp.model_peak(seq)
    assert peak <= least and t == pytest.approx(t_model)
    want = by_brute_force(model_table(search), least, True)
    assert want - len(seq) * search.dp.lost_quantum - 1e-9 <= t <= want + 1e-9


def test_solver_reports_the_memory_centric_plan():
    g = random_dag_with_views(705, 8)
    least = min_budget(g, "dp-exact")
    plan = solve_dp_exact(g, least, config={"objective": "memory"})
    assert plan.options["objective"] == "memory"
    search = search_of(g)
    dp_least, _ = search.least_dp_budget()
    assert plan.options["chosen"].startswith("memory-centric")
    assert simulate(g, plan).extra_time_s == by_brute_force(model_table(search), dp_least, True)


def test_long_searches_log_their_progress(caplog, monkeypatch):
    """Every search of dp-exact logs where it is (phase, budget, states, transitions, replays) once
    per PROGRESS_EVERY_S seconds; a short solve logs nothing."""
    g = random_dag_with_views(709, 9)
    caplog.set_level(logging.INFO, logger="autoremat.solvers.kusumoto")
    min_budget(g.copy(), "dp-exact")
    assert not [r for r in caplog.records if "so far" in r.getMessage()]
    monkeypatch.setattr(dive, "PROGRESS_EVERY_S", 0.0)
    g = g.copy()
    least = min_budget(g, "dp-exact")
    solve_dp_exact(g, least + (least >> 2))
    solve_dp_exact(g, least, config={"objective": "memory"})
    said = " | ".join(r.getMessage() for r in caplog.records if "so far" in r.getMessage())
    for phase in ("least-budget probe", "time-centric search", "memory-centric search"):
        assert f"dp-exact: {phase} at " in said
    assert "states priced" in said and "replays" in said
