"""``autoremat.cost.segment_replay``: the exact model is the simulator's rules on one segment.

On every small DAG of a seeded generator and random lower-set sequences, :func:`exact_peak`
equals :func:`~autoremat.cost.simulate`'s peak and extra time of the same plan, and the
replay-free bookkeeping (time, kept bytes, dangling roots) equals the replay's. On DAGs with
views and pass-through nodes (where the module docstring names two exceptions) the model stays
within the bound asserted here, and equals the simulator on most sequences.
"""

from __future__ import annotations

import random

import pytest
from _graphs import (convolutional, random_dag, random_dag_with_views, with_held_outputs, with_reader_less_views,
                     with_view_first_grads)

from autoremat.cost import simulate
from autoremat.cost.bitsets import GraphBits, bits
from autoremat.cost.segment_replay import TAIL_TIE, bookkeeping, exact_peak, exact_transition, pair_bookkeeping
from autoremat.plan import Plan, Segment, segments_from_lower_sets
from autoremat.replay_tail import replay_tails
from autoremat.solvers.kusumoto.families import all_lower_sets


def random_sequences(p: GraphBits, rng: random.Random, count: int) -> list[list[int]]:
    """``count`` random increasing lower-set sequences ending in ``V``."""
    family = all_lower_sets(p, 10**6)
    out = []
    for _ in range(count):
        seq, lower = [], 0
        while lower != p.full:
            lower = rng.choice([m for m in family if m & lower == lower and m != lower])
            seq.append(lower)
        out.append(seq)
    return out


def simulated(g, seq: list[int]) -> tuple[int, float]:
    sim = simulate(g, Plan(segments_from_lower_sets(g, [list(bits(m)) for m in seq])), record=False)
    return sim.peak_bytes, sim.extra_time_s


@pytest.mark.parametrize("seed", range(36))
def test_exact_model_equals_the_simulator(seed):
    """Random DAGs without views or pass-through nodes: peak and time equal, bookkeeping equal."""
    g = with_held_outputs(random_dag(seed, 1 + seed % 7), seed)
    p = GraphBits(g)
    for seq in random_sequences(p, random.Random(seed), 6):
        assert exact_peak(p, seq) == simulated(g, seq), seq
        lower = dangling = 0
        for upper in seq:
            _, dt, add, after = exact_transition(p, lower, upper, dangling, {})
            got = bookkeeping(p, lower, upper, dangling)
            assert got[1:] == (add, after) and got[0] == pytest.approx(dt)
            assert bookkeeping(p, lower, upper, dangling, pair=pair_bookkeeping(p, lower, upper)) == got
            lower, dangling = upper, after


def test_first_gradients_that_are_views_replay_as_simulated():
    """Nodes whose first gradient is a view (summed with the next out of place, :mod:`autoremat.cost.grad_handoff`),
    whether that sum falls in the segment or the first arrived in a later one: on 40 seeded DAGs, 6 random
    sequences each, the peaks equal the simulator's; the rule moves the simulated peak in 84 of the 240."""
    rng = random.Random(13)
    moved = 0
    for seed in range(40):
        plain = with_held_outputs(random_dag(seed, 3 + seed % 8), seed)
        g = with_view_first_grads(plain, seed)
        p = GraphBits(g)
        for seq in random_sequences(p, rng, 6):
            assert exact_peak(p, seq) == simulated(g, seq), (seed, seq)
            moved += simulated(g, seq) != simulated(plain, seq)
    assert moved >= 60, moved


def test_with_views_and_pass_through_nodes_the_model_stays_close():
    """The two documented exceptions (a pass-through reader sharing a boundary gradient buffer,
    a view of a recomputed segment's input) move the model off the simulator: on 40 seeded DAGs
    with views and pass-through nodes, 6 random sequences each, the peaks were equal on 236 of 240
    and the others within 6.7 % (asserted: 90 % equal, none over 10 % off); times always equal."""
    rng = random.Random(11)
    equal = total = 0
    for seed in range(40):
        g = random_dag_with_views(seed, 3 + seed % 9)
        p = GraphBits(g)
        for seq in random_sequences(p, rng, 6):
            (peak, t), (sim_peak, sim_t) = exact_peak(p, seq), simulated(g, seq)
            assert t == pytest.approx(sim_t)
            assert abs(peak - sim_peak) <= 0.10 * sim_peak, (seed, seq)
            equal += peak == sim_peak
            total += 1
    assert equal >= 0.9 * total


def test_with_reader_less_views_the_model_stays_close_and_never_below():
    """Views as module-level capture records them (no readers of their own, most with backward workspace:
    :mod:`autoremat.cost.grad_handoff`): on 40 seeded DAGs, 6 random sequences each, the peaks were equal on
    221 of 240, the others above the simulator by up to 21.6 % (a view in a later segment than its root: the
    documented exception); with the simulator's rule alone, 200 equal and 21 below."""
    rng = random.Random(12)
    equal = total = 0
    for seed in range(40):
        g = with_reader_less_views(with_held_outputs(random_dag(seed, 3 + seed % 8), seed), seed)
        p = GraphBits(g)
        for seq in random_sequences(p, rng, 6):
            (peak, t), (sim_peak, sim_t) = exact_peak(p, seq), simulated(g, seq)
            assert t == pytest.approx(sim_t)
            assert sim_peak <= peak <= 1.25 * sim_peak, (seed, seq)
            equal += peak == sim_peak
            total += 1
    assert equal >= 0.9 * total


def test_the_final_transition_holds_nothing_dangling():
    g = random_dag(5, 6)
    p = GraphBits(g)
    need, dt, add, after = exact_transition(p, 0, p.full, 0, {})
    assert (dt, add, after) == (0.0, 0, 0)
    assert need == simulated(g, [p.full])[0]


def flagged(p: GraphBits, seq: list[int], rng: random.Random, share: float) -> tuple[list[bool], Plan]:
    """Random free flags for ``seq`` (a segment of recomputable savers recomputed with probability
    ``share``) and its plan."""
    flags, prev, segments = [], 0, []
    for upper in seq:
        nodes = list(bits(upper & ~prev))
        can = bool((upper & ~prev) & p.saver_mask) and all(p.recomputable[v] for v in nodes)
        flags.append(can and rng.random() < share)
        segments.append(Segment(tuple(nodes), flags[-1]))
        prev = upper
    return flags, Plan(segments)


def assert_bookkeeping_agrees(p: GraphBits, seq: list[int], flags: list[bool]) -> None:
    lower = dangling = 0
    for upper, flag in zip(seq, flags):
        _, dt, add, after = exact_transition(p, lower, upper, dangling, {}, flag)
        got = bookkeeping(p, lower, upper, dangling, recompute=flag)
        assert got[1:] == (add, after) and got[0] == pytest.approx(dt)
        lower, dangling = upper, after


@pytest.mark.parametrize("seed", range(12))
def test_free_flags_equal_the_simulator(seed):
    """The ``milp`` space: each segment recomputed or not at will (the last one included, any
    segment of recomputable savers); :func:`exact_peak` with ``flags`` equals the simulator."""
    g = with_held_outputs(random_dag(seed, 2 + seed % 6), seed)
    p = GraphBits(g)
    rng = random.Random(100 + seed)
    for seq in random_sequences(p, rng, 6):
        flags, plan = flagged(p, seq, rng, 0.6)
        sim = simulate(g, plan, record=False)
        assert exact_peak(p, seq, flags) == (sim.peak_bytes, pytest.approx(sim.extra_time_s)), (seq, flags)
        assert_bookkeeping_agrees(p, seq, flags)


def test_with_tails_the_time_is_the_plans_as_it_runs():
    """``GraphBits(tails=True)`` (``auto``'s searches): a recomputed segment's time is its replay
    up to its tail, as the simulator runs the plan with the tails ``solve`` gives it (plus
    ``TAIL_TIE`` of its whole replay's, the tie-break); its bytes are the whole replay's. On 60
    seeded convolutional DAGs, 8 random sequences each, free flags: the time equals the
    simulator's with tails, the peak the model's without them; bookkeeping agrees; and the tails
    shorten some replays (so the two models differ)."""
    rng = random.Random(17)
    shorter = 0
    for seed in range(60):
        g = convolutional(with_held_outputs(random_dag(seed, 4 + seed % 8), seed), seed, share=0.9)
        whole, tailed = GraphBits(g), GraphBits(g, tails=True)
        for seq in random_sequences(tailed, rng, 8):
            flags, plan = flagged(tailed, seq, rng, 0.7)
            whole_peak, whole_t = exact_peak(whole, seq, flags)
            plan.replay_tails = replay_tails(g, plan)
            sim = simulate(g, plan, record=False)
            peak, t = exact_peak(tailed, seq, flags)
            assert t == pytest.approx(sim.extra_time_s + TAIL_TIE * whole_t), (seed, seq, flags)
            assert peak == whole_peak
            shorter += sim.extra_time_s < whole_t
            assert_bookkeeping_agrees(tailed, seq, flags)
    assert shorter >= 10, shorter
