"""Seeded random chains (Beaumont et al.'s model) and what their tests enumerate: the limits to
try, every offload set, whether a set fits, every chain solver's schedule."""

from __future__ import annotations

import itertools
import random

from autoremat.cost.chain import Chain
from autoremat.cost.chain_schedule import OffloadSchedule, offload_set_min_memory_bytes
from autoremat.solvers.beaumont.chain_solvers import offload_dp, offload_greedy, vdnn

__all__ = ["rand_chain", "limits", "subsets", "feasible", "all_schedules"]


def rand_chain(rng: random.Random, n: int, *, integer: bool = False) -> Chain:
    """A random chain of ``n`` operations; ``integer``: integral sizes and times, ``B = 1``."""
    if integer:
        uf = [rng.randint(0, 4) for _ in range(n)]
        ub = [rng.randint(0, 6) for _ in range(n)]
        x = [rng.choice([0, rng.randint(1, 6)])] + [rng.randint(0, 8) for _ in range(n)]
        y = [rng.randint(0, 2) for _ in range(n + 1)]
        exf = [rng.randint(0, 3) for _ in range(n)]
        exb = [rng.randint(0, 3) for _ in range(n)]
        bw = 1.0
    else:
        uf = [rng.uniform(0.1, 3.0) for _ in range(n)]
        ub = [u * rng.uniform(1.0, 3.0) for u in uf]
        x = [rng.choice([0, rng.randint(1, 400)])] + [rng.choice([0, rng.randint(1, 1000)]) for _ in range(n)]
        y = [rng.randint(0, 100) for _ in range(n + 1)]
        exf = [rng.randint(0, 200) for _ in range(n)]
        exb = [rng.randint(0, 200) for _ in range(n)]
        bw = rng.choice([30.0, 100.0, 300.0, 1000.0])
    return Chain(tuple(uf), tuple(ub), tuple(x), tuple(y), tuple(exf), tuple(exb), bandwidth_bytes_per_s=bw)


def limits(chain: Chain, k: int = 5) -> list[int]:
    lo, hi = chain.min_memory_bytes, chain.peak_bytes
    return sorted({lo + (hi - lo) * i // (k - 1) for i in range(k)} | {hi + 1})


def subsets(chain: Chain):
    offl = chain.offloadable
    for r in range(len(offl) + 1):
        yield from itertools.combinations(offl, r)


def feasible(chain: Chain, limit: int, subset) -> bool:
    amounts = [float(chain.x_bytes[j]) if j in subset else 0.0 for j in range(chain.n_ops + 1)]
    return offload_set_min_memory_bytes(chain, amounts) <= limit


def all_schedules(chain: Chain, limit: int) -> list[OffloadSchedule]:
    return [
        offload_greedy(chain, limit),
        offload_greedy(chain, limit, fractional=True),
        offload_dp(chain, limit, slots=50),
        offload_dp(chain, limit, slots=500),
        vdnn(chain, limit, mode="all"),
        vdnn(chain, limit, mode="conv"),
    ]
