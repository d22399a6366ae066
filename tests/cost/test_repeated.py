"""RepeatedSimulator (autoremat.cost.repeated) against simulate, and the forward floor against every
simulated peak, on seeded random graphs and plans: recomputed segments, offloaded storages and
nodes' own saved tensors, prefetch depths, derived and explicit forward waits."""

from __future__ import annotations

import random

import pytest
from _graphs import rich_dag, with_held_outputs

from autoremat.cost import no_recompute_plan, simulate, unoptimised_peak_bytes
from autoremat.cost.repeated import RepeatedSimulator, forward_floor_bytes
from autoremat.errors import InfeasibleBudgetError
from autoremat.plan import Plan
from autoremat.solvers import solve
from autoremat.solvers.combined import checkpoint_plans
from autoremat.solvers.offload_dag import offload_candidates


def _plans(g, rng: random.Random) -> list[Plan]:
    """Bases with and without recomputation, each with random offload sets, depths and waits."""
    bases = [no_recompute_plan(g), *checkpoint_plans(g, 2)[:1]]
    try:
        bases.append(solve(g, int(unoptimised_peak_bytes(g) * 0.6), solver="chen"))
    except InfeasibleBudgetError:
        pass
    out = []
    for base in bases:
        cands = offload_candidates(g, base)
        for _ in range(3):
            units = rng.sample(cands, rng.randint(0, len(cands))) if cands else []
            out.append(Plan(list(base.segments), offload=tuple(u for u in units if u >= 0),
                            offload_saved=tuple(-1 - u for u in units if u < 0), replay_tails=dict(base.replay_tails),
                            offload_prefetch_depth=rng.choice([1, 2, 4])))
    return out


@pytest.mark.parametrize("seed", range(8))
def test_repeated_simulation_equals_simulate(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(4):
        g = with_held_outputs(rich_dag(rng, rng.randint(3, 22)), seed)
        g.meta["device"] = "meta"
        run = RepeatedSimulator(g)
        floor = forward_floor_bytes(g)
        for plan in _plans(g, rng):
            for bandwidth in (20.0, 1000.0):
                for limit in (None, 0, int(rng.random() * unoptimised_peak_bytes(g))):
                    want = simulate(g, plan, check=False, record=False, bandwidth_bytes_per_s=bandwidth,
                                    offload_wait_limit_bytes=limit)
                    got = run(plan, bandwidth_bytes_per_s=bandwidth, offload_wait_limit_bytes=limit)
                    assert got == want
                    assert floor <= got.peak_bytes
            waited = Plan(list(plan.segments), offload=plan.offload, offload_saved=plan.offload_saved,
                          offload_waits=dict(want.offload_waits), replay_tails=dict(plan.replay_tails),
                          offload_prefetch_depth=plan.offload_prefetch_depth)
            assert run(waited, bandwidth_bytes_per_s=1000.0) == simulate(g, waited, check=False, record=False,
                                                                         bandwidth_bytes_per_s=1000.0)


def test_the_forward_floor_is_reached_by_a_single_node() -> None:
    """The floor is a real level, not 0: a graph of one large node peaks at exactly its forward's
    output, extras and workspace."""
    g = rich_dag(random.Random(0), 1)
    g.nx.nodes[0].update(alloc_bytes=1000, out_bytes=1000, alias_of=None, extra_saved_bytes=30, fwd_temp_bytes=7,
                         saves=(), requires_grad=False)
    assert forward_floor_bytes(g) == 1037
    assert simulate(g, no_recompute_plan(g)).peak_bytes >= 1037
