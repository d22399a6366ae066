"""``autoremat.solvers.kusumoto.dive``: dp-exact's feasibility dive and least-kept search.

The dive's answers equal the reference's Dijkstra at every budget (``test_golden.py``); here: a
sequence it returns fits in the exact model, what the probes learn is reused, GoogLeNet's least
budget prices a few thousand transitions, and the least-kept search gives up past its limit.
"""

from __future__ import annotations

import logging

import pytest
from _graphs import random_dag_with_views

from autoremat.solvers.kusumoto.search import Search, parse_config


def search_of(graph, solver: str = "dp-exact") -> Search:
    return Search(graph, solver, parse_config({"max_lower_sets": 10**6} if solver == "dp-exact" else {}, solver))


@pytest.fixture(autouse=True)
def _quiet(caplog):
    caplog.set_level(logging.ERROR)


@pytest.mark.parametrize("seed", range(8))
def test_probes_share_what_they_learn(seed):
    """A probe at the least budget fits; one byte below does not; the rooms learnt make a
    repeated probe return the same answer without pricing anything new."""
    g = random_dag_with_views(2100 + seed, 8 + seed % 4)
    search = search_of(g)
    least, seq = search.least_dp_budget()
    dp = search.dp
    assert dp.model_peak(seq)[0] == least
    assert dp.run(least - 1, "feasible") is None
    found = dp.run(least, "feasible")
    assert found is not None and dp.model_peak(found[0])[0] <= least
    priced = len(list(dp.priced()))
    assert (dp.run(least, "feasible") is None) is False
    assert dp.run(least - 1, "feasible") is None
    assert len(list(dp.priced())) == priced
    assert dp.dive.fail_room and dp.dive.ok


def test_depth_first_feasibility_prices_few_transitions_on_googlenet(monkeypatch):
    """GoogLeNet (8838 lower sets; thousands of successors per state within the key bound): the
    least budget takes a few thousand priced transitions. Dijkstra on the kept bytes (the search
    before) priced 8.7 million in a minute without an answer: it settles every state whose kept
    bytes are below those of V, and prices all their successors."""
    import autoremat

    model, args = autoremat.zoo.build("googlenet", size="small", device="meta")
    g = autoremat.capture(model, args).with_paper_times()
    search = search_of(g)
    assert len(search.dp.fam) == 8838
    priced = []
    move = search.dp.move

    def counted(i, j, dang):
        priced.append(1)
        if len(priced) > 200_000:
            raise AssertionError("over 200k transitions priced")
        return move(i, j, dang)

    monkeypatch.setattr(search.dp, "move", counted)
    least, seq = search.least_dp_budget()
    assert search.dp.model_peak(seq)[0] == least
    assert search.dp.run(least - 1, "feasible") is None
    assert len(list(search.dp.priced())) < 50_000
    # no worse than the pruned family's least budget, priced in the exact model
    _, approx_seq = search_of(g, "dp-approx").least_dp_budget()
    assert least <= search.dp.model_peak(approx_seq)[0]


def test_least_kept_sequence_gives_up_past_its_label_limit():
    g = random_dag_with_views(515, 12)
    search = search_of(g)
    least, dive_seq = search.least_dp_budget()
    assert search.dp.least_kept(least, limit=1) is None
    kept = search.dp.least_kept(least, limit=10**6)
    assert kept is not None and kept != dive_seq
    assert search.dp.model_peak(kept)[0] <= least


@pytest.mark.parametrize("seed", range(4))
def test_a_probe_stops_at_its_replay_count_and_keeps_what_it_proved(seed):
    """``max_replays``: no answer past that many new replays (``stopped``); a probe without the limit
    then answers as before, from what the stopped one learnt."""
    g = random_dag_with_views(2200 + seed, 10 + seed % 3)
    search = search_of(g)
    least, _ = search.least_dp_budget()
    dp = search_of(g).dp  # a fresh one: nothing replayed yet
    assert dp.dive.run(least, 0) is None and dp.dive.stopped
    found = dp.dive.run(least)
    assert found is not None and not dp.dive.stopped and dp.model_peak(found[0])[0] <= least
    assert dp.dive.run(least - 1, 10**9) is None and not dp.dive.stopped  # a proof, not a stop
