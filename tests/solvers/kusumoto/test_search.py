"""``autoremat.solvers.kusumoto.search``: the search per graph, its minimum, its cache.

The cache shares a search between calls on the same graph and options, notices a graph edited in
place, drops a search interrupted mid-way and keeps one whose budget was infeasible, and holds
graphs weakly; the minimum is the smaller of the unoptimised peak and the simulated peak of the
sequence found at the least DP budget (or of Chen's least plan). The checks (package docstring,
"Checks"): wherever Chen's plan fits, dp-approx's plan fits and recomputes no more, and nothing
falls back to the least-budget sequence with a warning, on networks of four families, the zoo and
transformers (fast: a few of each; ``-m slow``: the zoo, 100 networks, 6-layer BERT and Llama).
"""

from __future__ import annotations

import gc
import weakref

import logging

import pytest
from _graphs import FAMILIES, random_dag, random_network, random_networks

import autoremat
from autoremat.cost import simulate, unoptimised_peak_bytes
from autoremat.graph import Graph
from autoremat.solvers.chen import chen_plans, solve_chen
from autoremat.solvers.kusumoto import min_budget, solve_dp_approx, solve_dp_exact
from autoremat.solvers.kusumoto.search import EXACT_ALWAYS_NODES, Search, parse_config, search_for


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


# ---------------------------------------------------------------------------------------- checks
def assert_never_behind_chen(g: Graph, caplog: pytest.LogCaptureFixture, solve=solve_dp_approx) -> int:
    """At Chen's least budget, 50 %, 75 % of the unoptimised peak (where Chen fits) and halfway
    between: the DP's plan fits and recomputes no more than Chen's, with no warning logged;
    returns how many budgets were checked."""
    peak = unoptimised_peak_bytes(g)
    least = min(p for p, _, _ in chen_plans(g))
    budgets = sorted({least, (least + peak) // 2} | {int(f * peak) for f in (0.5, 0.75) if f * peak >= least})
    for budget in budgets:
        chen = simulate(g, solve_chen(g, budget)).extra_time_s
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="autoremat"):
            plan = solve(g, budget)
        sim = simulate(g, plan)
        assert sim.peak_bytes <= budget
        assert sim.extra_time_s <= chen * (1 + 1e-9) + 1e-15, (g.meta.get("model"), budget, sim.extra_time_s, chen)
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    return len(budgets)


@pytest.mark.parametrize("family", FAMILIES)
def test_dp_approx_never_recomputes_more_than_chen(family, caplog):
    for seed in range(2):
        assert_never_behind_chen(random_network(family, seed, 40 + 30 * seed), caplog)


def test_the_transformer_blocks_that_fell_back_now_check_their_plans(caplog):
    """transformer-3 (147 nodes) fell back to the least-budget sequence at Chen's least budget and
    transformer-23 had no plan there; both now get the exact model's plan."""
    for g in random_networks(24)[3::20]:
        least = min(p for p, _, _ in chen_plans(g))
        with caplog.at_level(logging.INFO, logger="autoremat.solvers.kusumoto"):
            plan = solve_dp_approx(g, least)
        assert plan.options["chosen"] == "time-centric, exact model"
        assert simulate(g, plan).extra_time_s <= simulate(g, solve_chen(g, least)).extra_time_s
        assert "asking the exact model" in caplog.text


def test_inception_at_chens_least_budget(caplog):
    """Inception-v3 at CPU size: the closed form's least budget was above Chen's (no plan where
    Chen's fit); the exact model's least budget is not."""
    from autoremat import zoo

    g = autoremat.capture(*zoo.build("inception_v3", size="small", device="meta"))
    least = min(p for p, _, _ in chen_plans(g))
    assert min_budget(g, "dp-approx") <= least
    assert_never_behind_chen(g, caplog)


def test_small_graphs_always_ask_the_exact_model(caplog):
    g = random_network("chain_skips", 1, 26)
    assert len(g) <= EXACT_ALWAYS_NODES
    peak = unoptimised_peak_bytes(g)
    with caplog.at_level(logging.INFO, logger="autoremat.solvers.kusumoto"):
        solve_dp_approx(g, int(0.9 * peak))
    assert "is small" in caplog.text


def test_dp_exact_checks_against_chen_too(caplog):
    assert_never_behind_chen(random_network("unet", 3, 41), caplog, solve=solve_dp_exact)


@pytest.mark.slow
@pytest.mark.parametrize("part", ["zoo", "random-0", "random-1", "random-2", "random-3", "transformers"])
def test_never_behind_chen_on_the_zoo_networks_and_transformers(part, caplog):
    """The issue's targets: the zoo at CPU size, 100 seeded networks of 30-300 nodes and the
    6-layer BERT and Llama configurations that fell back. In six parts: as one test it passed
    every budget but ran past the 600 s test timeout (about 740 s of solving on a loaded
    2-core machine: zoo 50 s, the random networks 654 s, the transformers 35 s)."""
    from autoremat import zoo

    checked = 0
    if part == "zoo":
        for name in ("vgg19", "resnet50", "unet", "densenet121", "googlenet", "inception_v3", "pspnet"):
            checked += assert_never_behind_chen(autoremat.capture(*zoo.build(name, size="small", device="meta")), caplog)
        assert checked >= 20
    elif part.startswith("random-"):
        quarter = int(part.split("-")[1])
        for g in random_networks(100)[25 * quarter:25 * (quarter + 1)]:
            checked += assert_never_behind_chen(g, caplog)
        assert checked >= 75
    else:
        transformers = pytest.importorskip("transformers")
        import torch

        from autoremat.zoo import hf

        assert transformers
        for make in (hf.bert, hf.llama):
            ids = torch.randint(0, 256, (2, 64))
            g = autoremat.capture(make(layers=6), (), {"input_ids": ids, "labels": ids}, repeats=1, warmup=0)
            checked += assert_never_behind_chen(g, caplog)
        assert checked >= 4


def test_the_exact_models_least_is_searched_only_where_it_can_beat_what_is_known(monkeypatch):
    """``Search._exact_least``: a probe one byte below the least simulated peak known decides whether
    the exact model's least-budget search (which proves every smaller budget infeasible from 1/64 up)
    is paid; its answers are kept by bytes and structure, so the reference graph of a stable plan
    (same bytes, other times) meets them. Measured before: the first solve of a 374-node Qwen3-MoE
    capture under bf16 took 14.5 s (two searches of 47 infeasible probes each), now 1.6 s."""
    from autoremat.solvers.kusumoto import search as search_mod
    from autoremat.solvers.stable import reference_graph

    g = random_network("transformer", 3, 147)
    search = Search(g, "dp-approx", parse_config(None, "dp-approx"))
    searched: list[int] = []
    real = Search.least_dp_budget
    monkeypatch.setattr(Search, "least_dp_budget", lambda self, dp=None: searched.append(1) or real(self, dp))
    search_mod._EXACT_LEAST.clear()
    least, seq = search._exact_least(10 ** 12)  # far above: it may beat that, so it searches
    assert searched == [1] and search.second_opinion().model_peak(seq)[0] == least
    again = search._exact_least(least)  # nothing fits below its own least: no search, the same least
    assert searched == [1] and again is not None and again[0] == least
    assert search._exact_least(least - 1) is None and searched == [1]  # nothing fits at all
    ref = reference_graph(g)  # (a search holds its graph weakly)
    twin = Search(ref, "dp-approx", parse_config(None, "dp-approx"))
    monkeypatch.setattr(Search, "second_opinion", lambda self: pytest.fail("the reference graph searched again"))
    assert twin._exact_least(10 ** 12) == (least, seq)


def test_the_exact_models_probes_stop_at_their_replay_count(monkeypatch, caplog):
    """dp-approx asks its exact model for a least budget below the one it knows; each probe stops after
    ``EXACT_PROBE_REPLAYS`` new replays without an answer (LeViT paid 30,472 replays, 9 s, to find
    nothing). The zoo's GPT finds a lower one within 1,859: with the default it does; stopped after
    one replay it keeps the one it knew, and says so."""
    import autoremat.solvers.kusumoto.search as search_module
    from autoremat import zoo

    model, args = zoo.build("transformer")
    graph = autoremat.capture(model, args, repeats=1, warmup=0, times="flops")
    found = min_budget(graph.copy(), "dp-approx")
    monkeypatch.setattr(search_module, "EXACT_PROBE_REPLAYS", 1)
    with caplog.at_level(logging.INFO, logger="autoremat.solvers.kusumoto"):
        stopped = min_budget(graph.copy(), "dp-approx")
    assert found < stopped, (found, stopped)  # 4,867,784 < 4,918,984 B
    assert "stopped after 1 replays without an answer" in caplog.text
