"""``auto``'s chain search (:mod:`autoremat.solvers.milp.chain`): a beam search of the exact model's
steps over the prefixes of auto's own plan's order, with free flags (issue 28: ResNet-50's optimum
alternates short recomputed and plain segments that neither dp-approx nor the polish reaches)."""

from __future__ import annotations

import math
import random

import pytest
from _graphs import FAMILIES, convolutional, random_dag, random_network, with_held_outputs

import autoremat
from autoremat.cost import simulate, unoptimised_peak_bytes
from autoremat.cost.bitsets import GraphBits
from autoremat.plan import validate_plan
from autoremat.solvers import finalize_plan
from autoremat.solvers.milp import chain as chain_mod
from autoremat.solvers.milp import exact
from autoremat.solvers.milp.lattice import add_label, dominated, lattice_plan_nodes
from autoremat.solvers.polish import plan_order
from autoremat.solvers.stable import REFERENCE_TIME_SOURCE

from .milp_oracle import best_within, space_table


def _auto(g, budget, monkeypatch: pytest.MonkeyPatch, chain: bool):
    """auto with the chain search on or off and the lattice off (so that the chain is what differs)."""
    monkeypatch.setattr(exact, "AUTO_MAX_NODES", 0)
    monkeypatch.setattr(chain_mod, "CHAIN_MAX_NODES", 300 if chain else 0)
    try:
        return autoremat.solve(g, budget)
    except autoremat.InfeasibleBudgetError:
        return None


def test_the_chain_search_finds_the_optimum_the_heuristics_miss(monkeypatch: pytest.MonkeyPatch):
    g = random_dag(59, 7)
    best = best_within(space_table(g), 58)  # brute force over every canonical strategy: 4 s
    off, on = _auto(g, 58, monkeypatch, False), _auto(g, 58, monkeypatch, True)
    assert simulate(g, off).extra_time_s > 2 * best  # dp-approx, chen, polish: 9 s
    assert simulate(g, on).extra_time_s == pytest.approx(best)
    assert on.options["auto_stage"] == "chain" and on.solver == "milp"


def test_auto_recomputes_less_on_a_dense_network_beyond_the_lattice(monkeypatch: pytest.MonkeyPatch):
    """125 nodes: more lower sets than auto's lattice takes; dp-approx and the polish recompute
    1.29x what the chain search finds (alternating recomputed and plain segments)."""
    g = random_network("dense", 1, 125)
    budget = int(0.5 * unoptimised_peak_bytes(g))
    off, on = _auto(g, budget, monkeypatch, False), _auto(g, budget, monkeypatch, True)
    assert on.predicted_extra_time_s < 0.8 * off.predicted_extra_time_s
    assert on.predicted_peak_bytes <= budget
    assert any(not s.recompute for s in on.segments[:-1]), "a plain segment between recomputed ones"


@pytest.mark.parametrize("family", FAMILIES)
def test_auto_is_never_worse_fits_and_is_deterministic_on_random_networks(family: str,
                                                                         monkeypatch: pytest.MonkeyPatch):
    for seed in range(2):
        g = random_network(family, 300 + seed, 45)
        for frac in (0.45, 0.7):
            budget = int(frac * unoptimised_peak_bytes(g))
            off, on = _auto(g, budget, monkeypatch, False), _auto(g, budget, monkeypatch, True)
            if off is None:
                continue
            assert on is not None and on.predicted_peak_bytes <= budget
            assert on.predicted_extra_time_s <= off.predicted_extra_time_s * (1 + 1e-12)
            validate_plan(g, on)
            again = _auto(g.copy(), budget, monkeypatch, True)  # a fresh graph object: no cached lattice
            assert again.segments == on.segments


def test_the_better_of_the_two_beams_is_taken_on_a_unet(monkeypatch: pytest.MonkeyPatch):
    """On this U-Net, with ``h`` from the lower bounds' needs, the beam by time alone recomputes
    0.986x auto's plan without the chain search, the beam that also keeps the labels holding the
    fewest bytes 0.869x: auto takes the second (with exact needs in ``h`` both find the second's)."""
    g = random_network("unet", 1, 70)
    budget = int(0.6 * unoptimised_peak_bytes(g))
    off = _auto(g, budget, monkeypatch, False)
    monkeypatch.setattr(chain_mod, "CHAIN_EXACT_NEEDS", False)
    lat = chain_mod._lattice(g, plan_order(g, off))
    inc = off.predicted_extra_time_s
    times = []
    for spread in (False, True):
        seq, flags, _ = chain_mod.beam(lat, budget, inc, chain_mod.CHAIN_WIDTH, (int(0.01 * budget), 0.01 * inc), spread)
        plan = autoremat.Plan([autoremat.Segment(tuple(n), f) for n, f in zip(lattice_plan_nodes(seq), flags)])
        times.append(simulate(g, plan, check=False, record=False).extra_time_s)
    assert times[1] < 0.95 * times[0] < 0.95 * inc
    monkeypatch.setattr(chain_mod, "CHAIN_EXACT_NEEDS", True)
    on = _auto(g.copy(), budget, monkeypatch, True)  # a fresh graph: h with exact needs
    assert on.predicted_extra_time_s <= times[1] * (1 + 1e-9)


def test_beam_never_returns_a_plan_at_or_above_the_plan_to_beat():
    g = random_dag(59, 7)
    best = best_within(space_table(g), 58)
    assert chain_mod.chain_improve(g, None, 58, best) is None  # nothing recomputes less than the optimum
    found = chain_mod.chain_improve(g, None, 58, float("inf"))  # no plan to beat: any plan that fits
    assert found is not None and simulate(g, found).peak_bytes <= 58


def test_large_graphs_and_measured_times_are_left_alone_and_the_stand_in_is_searched(
        monkeypatch: pytest.MonkeyPatch):
    g = random_network("dense", 1, 125)
    budget = int(0.5 * unoptimised_peak_bytes(g))
    monkeypatch.setattr(chain_mod, "CHAIN_MAX_NODES", len(g) - 1)
    assert chain_mod.chain_improve(g, None, budget, float("inf")) is None
    monkeypatch.setattr(chain_mod, "CHAIN_MAX_NODES", 300)
    called = []
    monkeypatch.setattr(chain_mod, "chain_improve", lambda graph, *a: called.append(graph.meta["time_source"]))
    g.meta["time_source"] = "perf_counter"
    autoremat.solve(g, budget, noise_tolerance=0)
    assert not called  # measured times: noise would pick the plan
    autoremat.solve(g, budget)  # the stable path also solves a uniform-cost stand-in (solvers.stable): searched
    assert called and set(called) == {REFERENCE_TIME_SOURCE}
    assert chain_mod.CHAIN_MAX_NODES >= 300


def test_above_the_full_size_a_step_spans_at_most_the_window(monkeypatch: pytest.MonkeyPatch):
    """Above ``CHAIN_FULL_NODES`` the chain's steps (those the cost-to-go and the beam see) span at
    most ``CHAIN_WINDOW`` prefixes, in key order; the plan found is made of such steps, fits,
    recomputes less than auto's plan without the search and is the same on a fresh graph."""
    g = random_network("dense", 1, 125)
    budget = int(0.5 * unoptimised_peak_bytes(g))
    off = _auto(g, budget, monkeypatch, False)
    monkeypatch.setattr(chain_mod, "CHAIN_MAX_NODES", 300)
    monkeypatch.setattr(chain_mod, "CHAIN_FULL_NODES", 100)
    monkeypatch.setattr(chain_mod, "CHAIN_WINDOW", 12)
    found = chain_mod.chain_improve(g, off, budget, off.predicted_extra_time_s)
    assert found is not None and all(len(s.nodes) <= 12 for s in found.segments)
    lat = chain_mod._lattice(g, plan_order(g, off))  # the one the search used (kept per graph)
    assert isinstance(lat, chain_mod.WindowedChain)
    for i in range(lat.last):
        succ = lat.succ[i]
        assert succ == list(range(i + 1, min(i + 12, lat.last) + 1))
        assert [lat.keys[k] for k in succ] == sorted(lat.keys[k] for k in succ)
        assert {move[1] for move in lat.moves[i]} <= set(succ)
    sim = simulate(g, found)
    assert sim.peak_bytes <= budget and sim.extra_time_s < off.predicted_extra_time_s
    again = chain_mod.chain_improve(g.copy(), off, budget, off.predicted_extra_time_s)
    assert again.segments == found.segments
    monkeypatch.setattr(chain_mod, "CHAIN_FULL_NODES", 300)
    assert not isinstance(chain_mod._lattice(g, plan_order(g, off)), chain_mod.WindowedChain)


def test_plan_order_is_the_segments_in_turn_and_only_a_topological_one():
    g = random_network("unet", 3, 40)
    dp = autoremat.solve(g, int(0.5 * unoptimised_peak_bytes(g)), solver="dp-approx")
    order = plan_order(g, dp)
    assert order == tuple(v for s in dp.segments for v in s.nodes) and sorted(order) == list(g.nodes)
    first = next(v for v in g.nodes if g.pred(v))  # a node with a predecessor, put first
    bad = autoremat.Plan([autoremat.Segment((first,), recompute=False),
                          autoremat.Segment(tuple(v for v in g.nodes if v != first), recompute=False)])
    assert plan_order(g, bad) is None


def test_the_pareto_front_answers_as_a_scan_of_every_label():
    rng = random.Random(5)
    for _ in range(200):
        front: tuple[list[int], list[float]] = ([], [])
        taken: list[tuple[int, float]] = []
        for _ in range(30):
            m, t = rng.randrange(20), float(rng.randrange(20))
            scan = any(m0 <= m and t0 <= t for m0, t0 in taken)
            assert dominated(front, m, t) == scan
            if not scan:
                add_label(front, m, t)
                taken.append((m, t))
            ms, ts = front
            assert ms == sorted(ms) and all(a > b for a, b in zip(ts, ts[1:]))


def test_a_wider_beam_finds_a_plan_where_none_fits(monkeypatch: pytest.MonkeyPatch):
    """Issue 28: on this 149-node U-Net every other solver's least budget is 470,080 bytes; at 90 %
    of it both beams of width ``CHAIN_WIDTH`` find nothing, the wider one (``CHAIN_RESCUE_WIDTH``,
    asked only where nothing fits) a plan that fits."""
    g = random_network("unet", 4, 150)
    budget = 423_072
    assert budget < min(autoremat.solvers.min_budget(g, "chen"), autoremat.solvers.min_budget(g, "dp-approx"))
    plan = chain_mod.chain_improve(g, None, budget, float("inf"))
    assert plan is not None and simulate(g, plan).peak_bytes <= budget
    validate_plan(g, plan)
    monkeypatch.setattr(chain_mod, "CHAIN_RESCUE_WIDTH", 0)
    monkeypatch.setattr(chain_mod, "CHAIN_RESCUE_WORK", 0)  # (the exact rescue over two orders: not the beams)
    assert chain_mod.chain_improve(g, None, budget, float("inf")) is None


def _other_order(g) -> tuple[int, ...]:
    """A topological order other than node order: Kahn's, the largest ready node first."""
    import heapq

    indeg = {v: len(g.pred(v)) for v in g.nodes}
    ready = [-v for v, d in indeg.items() if d == 0]
    heapq.heapify(ready)
    out = []
    while ready:
        v = -heapq.heappop(ready)
        out.append(v)
        for w in g.succ(v):
            indeg[w] -= 1
            if indeg[w] == 0:
                heapq.heappush(ready, -w)
    return tuple(out)


@pytest.mark.parametrize("family", ["chain_skips", "transformer"])
def test_a_new_order_keeps_the_graphs_replays_and_finds_what_a_fresh_lattice_finds(family: str):
    """``auto`` solving one graph at several budgets meets several orders: each order's lattice
    takes over the segment replays of the last (keyed by the segment's bitsets), and its beam
    finds what a lattice built afresh on a copy of the graph finds."""
    g = random_network(family, 7, 60)
    budget = int(0.55 * unoptimised_peak_bytes(g))
    slack = (int(0.01 * budget), 0.0)
    first = chain_mod._lattice(g, tuple(range(len(g))))
    for spread in (False, True):
        chain_mod.beam(first, budget, float("inf"), chain_mod.CHAIN_WIDTH, slack, spread)
    order = _other_order(g)
    assert order != tuple(range(len(g)))
    before = len(first.replays)
    second = chain_mod._lattice(g, order)
    assert second is not first and second.replays is first.replays and second.p is first.p
    chain_mod.clear_shared_needs()  # built afresh: no exact needs kept by content either
    fresh = chain_mod._lattice(g.copy(), order)
    assert fresh.replays is not first.replays and fresh.needs is not second.needs
    for spread in (False, True):
        got = chain_mod.beam(second, budget, float("inf"), chain_mod.CHAIN_WIDTH, slack, spread)
        assert got == chain_mod.beam(fresh, budget, float("inf"), chain_mod.CHAIN_WIDTH, slack, spread)
    assert before > 0 and len(second.replays) < before + len(fresh.replays)  # some replays were reused


def test_a_graph_of_the_same_bytes_and_other_times_meets_the_chains_exact_needs():
    """The stand-in of another capture (every time doubled: the measured mean rounded to the next
    power of two) meets the exact needs of the first (CHAIN_SHARED_NEEDS): its ``h`` and its beam
    replay no step again, and they find what they find without them, at twice the time."""
    g = random_network("transformer", 3, 60)
    budget = int(0.55 * unoptimised_peak_bytes(g))
    other = g.copy()
    for v in other.nodes:
        other.node(v)["time_s"] *= 2
        other.node(v)["bwd_time_s"] *= 2
    slack = (int(0.01 * budget), 0.0)
    first = chain_mod._lattice(g, tuple(range(len(g))))
    found = chain_mod.beam(first, budget, float("inf"), chain_mod.CHAIN_WIDTH, slack, True)
    assert found is not None and first.needs
    second = chain_mod._lattice(other, tuple(range(len(g))))
    assert second.needs is first.needs and not second.replays
    again = chain_mod.beam(second, budget, float("inf"), chain_mod.CHAIN_WIDTH, slack, True)
    assert not second.replays  # every need it checked was known
    assert again is not None and again[:2] == found[:2] and again[2] == 2 * found[2]
    g.node(0)["out_bytes"] += 8  # other bytes: other needs
    assert chain_mod._lattice(g.copy(), tuple(range(len(g)))).needs is not first.needs


def _residual_blocks(seed: int, blocks: int = 6):
    """Residual blocks whose shortcut has the lower node id (captured first, as a ``downsample``
    before the main branch): ``x -> s``, ``x -> m1 -> m2 -> m3``, ``add(s, m3)``; seeded sizes, times."""
    rnd = random.Random(seed)
    edges, out, times, x = [], [8], [1.0], 0
    for _ in range(blocks):
        s, m1, m2, m3, add = range(len(out), len(out) + 5)
        edges += [(x, s), (x, m1), (m1, m2), (m2, m3), (s, add), (m3, add)]
        out += [rnd.choice([2, 4, 8, 16]) for _ in range(5)]
        times += [rnd.choice([1.0, 2.0, 4.0]) for _ in range(5)]
        x = add
    return autoremat.Graph.from_edges(len(out), edges, out_bytes=out, time_s=times)


def test_latest_order_runs_each_node_as_late_as_its_consumers_allow():
    g = _residual_blocks(0, blocks=2)
    assert chain_mod.latest_order(g) == (0, 2, 3, 4, 1, 5, 7, 8, 9, 6, 10)  # main branch, then the shortcut
    for seed in range(20):
        g = random_dag(30, seed)
        order = chain_mod.latest_order(g)
        pos = {v: i for i, v in enumerate(order)}
        assert sorted(order) == list(g.nodes)
        assert all(pos[u] < pos[v] for v in g.nodes for u in g.pred(v))
        # reversed, it is Kahn's order of the reversed graph taking the least ready id first
        placed: set[int] = set()
        for v in reversed(order):
            ready = [u for u in g.nodes if u not in placed and all(w in placed for w in g.succ(u))]
            assert v == min(ready)
            placed.add(v)


@pytest.mark.parametrize("seed, budget", [(26, 82), (31, 66)])
def test_the_rescue_over_two_orders_finds_a_plan_where_one_order_has_none(seed: int, budget: int,
                                                                         monkeypatch: pytest.MonkeyPatch):
    """Issue 28 (PSPNet at its least budget): at ``milp``'s least budget of these blocks no beam over
    node order finds a plan (nor the wider one); the exact search over the prefixes of node order
    and of :func:`latest_order` does, and ``auto`` (lattice off) returns it."""
    g = _residual_blocks(seed)
    assert autoremat.solvers.min_budget(g, "milp") == budget
    monkeypatch.setattr(chain_mod, "CHAIN_RESCUE_WORK", 0)
    assert chain_mod.chain_improve(g, None, budget, float("inf")) is None
    assert _auto(g.copy(), budget, monkeypatch, True) is None
    monkeypatch.undo()
    plan = chain_mod.chain_improve(g, None, budget, float("inf"))
    assert plan is not None and simulate(g, plan).peak_bytes <= budget
    validate_plan(g, plan)
    assert plan_order(g, plan) not in (None, tuple(range(len(g)))), "a shortcut run after its main branch"
    got = _auto(g.copy(), budget, monkeypatch, True)
    assert got is not None and got.predicted_peak_bytes <= budget and not got.offloads


def test_the_rescue_runs_only_where_no_plan_recomputing_only_is_known():
    g = _residual_blocks(26)
    budget = 90
    plan = chain_mod.chain_improve(g, None, budget, float("inf"))
    assert plan is not None and chain_mod._chains[g][0][2] is False  # the beams found one: no rescue
    g2 = g.copy()
    assert chain_mod.chain_improve(g2, plan, budget, simulate(g2, plan).extra_time_s) is None
    assert chain_mod._chains[g2][0][2] is False
    g3 = _residual_blocks(26)
    g3.meta["blocks"] = "ops"  # as auto's lattice: not on a module-level graph captured op by op
    assert chain_mod.chain_improve(g3, None, 82, float("inf")) is None
    del g3.meta["blocks"]
    assert chain_mod.chain_improve(g3.copy(), None, 82, float("inf")) is not None


def test_exact_needs_in_h_lead_the_beams_to_less_recomputation(monkeypatch: pytest.MonkeyPatch):
    """On this dense network at 50 % the beams guided by ``h`` with the lower bounds' needs alone
    keep labels whose continuations do not fit: 1.43x the recomputation found with exact needs."""
    g = random_network("dense", 0, 50)
    budget = int(0.5 * unoptimised_peak_bytes(g))
    exact = chain_mod.chain_improve(g, None, budget, float("inf"))
    assert chain_mod._bounds[chain_mod._chains[g][1]][budget].exact_sets > 0
    monkeypatch.setattr(chain_mod, "CHAIN_EXACT_NEEDS", False)
    g2 = g.copy()
    bounds = chain_mod.chain_improve(g2, None, budget, float("inf"))
    assert chain_mod._bounds[chain_mod._chains[g2][1]][budget].exact_sets == 0
    assert simulate(g, exact).extra_time_s < 0.75 * simulate(g2, bounds).extra_time_s
    monkeypatch.undo()
    g3 = g.copy()
    g3.meta["blocks"] = "ops"  # blocks captured op by op: the bounds' needs (the same plans on the HF zoo)
    chain_mod.chain_improve(g3, None, budget, float("inf"))
    assert chain_mod._bounds[chain_mod._chains[g3][1]][budget].exact_sets == 0


def test_auto_least_budget_counts_the_rescue_and_solve_meets_it(monkeypatch: pytest.MonkeyPatch):
    """``least_budget(graph, "auto")`` counts the least-peak path over the rescue's lower sets
    (:func:`chain_least_peak`), and ``solve`` finds a plan there: by the rescue's A*, or else
    that path's plan (the fallback, forced here by a rescue that finds nothing)."""
    monkeypatch.setattr(exact, "AUTO_MAX_NODES", 0)
    monkeypatch.setattr(exact, "AUTO_LEAST_MAX_NODES", 0)
    g = _residual_blocks(26)
    peak, plan = chain_mod.chain_least_peak(g)
    assert peak == simulate(g, plan).peak_bytes == 82  # milp's least budget (the test above)
    assert autoremat.solvers.least_budget(g, "auto") == peak
    got = autoremat.solve(g, peak)
    assert got.predicted_peak_bytes <= peak and not got.offloads
    g2 = g.copy()
    monkeypatch.setattr(chain_mod, "_beams", lambda *args, **kwargs: None)
    monkeypatch.setattr(chain_mod, "_exact", lambda *args, **kwargs: None)
    fallback = chain_mod.chain_improve(g2, None, peak, float("inf"))
    assert fallback is not None and fallback.segments == plan.segments
    monkeypatch.setattr(chain_mod, "CHAIN_RESCUE_WORK", 0)
    g3 = g.copy()
    assert chain_mod.chain_least_peak(g3) is None
    assert autoremat.solvers.least_budget(g3, "auto") > peak


@pytest.mark.parametrize("ratio, exact_needs", [(2.0, True), (1.0, False)])
def test_the_rescue_has_exact_needs_only_on_few_enough_sets(ratio: float, exact_needs: bool,
                                                            monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(chain_mod, "RESCUE_EXACT_SETS", ratio)
    g = _residual_blocks(26)
    lat = chain_mod._lattice(g, tuple(range(len(g))), latest=True)
    assert len(g) + 1 < len(lat.fam) <= 2 * (len(g) + 1)
    assert (chain_mod._cost_to_go(lat, 90).exact_sets > 0) == exact_needs


@pytest.mark.parametrize("seed,share", [(92, 0.7), (131, 0.8), (248, 0.8)])
def test_the_beam_prices_replays_up_to_their_tails(seed: int, share: float, monkeypatch: pytest.MonkeyPatch):
    """On an fx graph the chain search prices a recomputed segment up to its replay tail (as
    ``solve``'s plan runs): on convolutional DAGs of 16 nodes its plan, finalised with its tails,
    recomputes less than the plan it finds pricing whole replays (the papers' ``T(Vi)``)."""
    def found(tails: bool) -> float:
        g = convolutional(with_held_outputs(random_dag(seed, 16), seed), seed, share=0.9)
        monkeypatch.setattr(chain_mod, "GraphBits", lambda graph, tails=True, mine=tails: GraphBits(graph, tails=mine))
        budget = int(share * unoptimised_peak_bytes(g))
        plan = chain_mod.chain_improve(g, None, budget, math.inf)
        assert plan is not None and chain_mod._chains[g][1].p.tails is tails
        return finalize_plan(g, plan, budget, "milp").predicted_extra_time_s

    assert found(True) < found(False)
