"""Brute force over the ``milp`` plan space (test oracle): every lower-set chain, every choice of
which of its segments (of recomputable nodes only) are recomputed."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from _graphs import random_dag_with_views, random_network, with_held_outputs

from autoremat.graph import Graph
from autoremat.plan import Plan, Segment
from autoremat.cost import simulate
from autoremat.solvers.content_keys import signature
from autoremat.solvers.evaluation.bruteforce import lower_set_chains


_TABLES: dict[tuple[int, int | None], list[tuple[int, float, Plan]]] = {}
"""Tables already made, by the graph's content (:func:`~autoremat.solvers.content_keys.signature`)
and ``k``: several tests brute-force the same seeded graph (4-5 s each on a 7-node one)."""


def space_table(graph: Graph, k: int | None = None) -> list[tuple[int, float, Plan]]:
    """``(peak, extra time, plan)`` of every plan of at most ``k`` segments in the milp space
    (kept by content: callers must not edit the plans)."""
    key = (signature(graph), k)
    if key not in _TABLES:
        _TABLES[key] = _space_table(graph, k)
    return _TABLES[key]


def _space_table(graph: Graph, k: int | None) -> list[tuple[int, float, Plan]]:
    out = []
    for chain in lower_set_chains(graph):
        if k is not None and len(chain) > k:
            continue
        parts, prev = [], frozenset()
        for lower in chain:
            parts.append(tuple(sorted(lower - prev)))
            prev = lower
        options = [(False, True) if all(graph.node(v)["recomputable"] for v in p) else (False,) for p in parts]
        for flags in itertools.product(*options):
            plan = Plan([Segment(p, f) for p, f in zip(parts, flags)])
            sim = simulate(graph, plan, check=False, record=False)
            out.append((sim.peak_bytes, sim.extra_time_s, plan))
    return out


def best_within(table: list[tuple[int, float, Plan]], budget: int) -> float | None:
    fits = [t for p, t, _ in table if p <= budget]
    return min(fits) if fits else None


def lattice_cases(family: str, seeds: int = 2, nodes: int = 30):
    """``(bits, lower sets, lattice, budget)`` on seeded random networks of ``family``
    (``tests/_graphs.random_network``) at the lattice's least budget and halfway to the unoptimised
    peak: the cases the cost-to-go is held to the label search on."""
    from _graphs import random_network

    from autoremat.cost import unoptimised_peak_bytes
    from autoremat.cost.bitsets import GraphBits
    from autoremat.solvers.kusumoto.families import all_lower_sets
    from autoremat.solvers.milp.lattice import Lattice

    for seed in range(seeds):
        g = random_network(family, seed, nodes)
        p = GraphBits(g)
        fam = all_lower_sets(p, 3000)
        lat = Lattice(p, fam)
        least = int(lat.least_peak().cost)
        for budget in (least, (least + unoptimised_peak_bytes(g)) // 2):
            yield p, fam, lat, budget


def bound_graphs(n: int) -> Iterator[tuple[str, Graph]]:
    """The seeded networks the cost-to-go tests check: chains with skips, U-Nets, dense and
    transformer blocks of ``n`` nodes, each also with held outputs, and small DAGs with views."""
    for family in ("chain_skips", "unet", "dense", "transformer"):
        for seed in range(2):
            yield f"{family}-{seed}", random_network(family, seed, n)
            yield f"{family}-{seed}-held", with_held_outputs(random_network(family, seed, n), seed)
    for seed in range(6):
        yield f"views-{seed}", random_dag_with_views(seed, 9)
