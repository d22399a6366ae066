"""``autoremat.solvers.reforward.search``: Algorithms 1 (linear) and 5 (arbitrary) against Eqn. 1.

Algorithm 1 against an exhaustive search of Eqn. 1, Algorithm 5 against Algorithm 1 on chains,
and Algorithm 5 exact for Eqn. 1 on small DAGs.
"""

from __future__ import annotations

import random

import pytest
from _graphs import plain_dag, rich_dag

from autoremat import Graph, InfeasibleBudgetError, simulate, validate_plan
from autoremat.cost import unoptimised_peak_bytes
from autoremat.solvers.reforward import reforward_arbitrary, reforward_linear, solve_reforward


# ---------------------------------------------------------------------- Algorithm 1 (LCG)
def _eqn1_exhaustive(keep: list[int], inner: list[int]) -> list[tuple[int, int]]:
    """``(kept bytes, largest re-forward)`` of every kept subset of a chain."""
    n = len(keep)
    out = []
    for mask in range(1 << n):
        kept = sum(keep[v] for v in range(n) if mask >> v & 1)
        runs, cur = [], 0
        for v in range(n):
            if mask >> v & 1:
                runs.append(cur)
                cur = 0
            else:
                cur += inner[v]
        runs.append(cur)
        out.append((kept, max(runs)))
    return out


@pytest.mark.parametrize("seed", range(5))
def test_linear_solver_is_exact_for_eqn_1(seed):
    rng = random.Random(seed)
    for _ in range(6):
        n = rng.randint(1, 10)
        sizes = [rng.choice([0, 10, 30, 100, 100, 250]) for _ in range(n)]
        g = Graph.chain(sizes, [rng.choice([1.0, 10.0]) for _ in range(n)])
        fam = reforward_linear(g)
        table = _eqn1_exhaustive(sizes, sizes)  # chains: keep = inner = the tensor size
        assert min(s.cost_bytes for s in fam) == min(k + r for k, r in table)
        terms = [s.max_term_bytes for s in fam]
        assert terms == sorted(set(terms), reverse=True)
        for s in fam:
            # the shortest path of the accessibility graph keeps the least under the max term
            assert s.reforward_bytes <= s.max_term_bytes
            assert s.kept_bytes == min(k for k, r in table if r <= s.max_term_bytes)
            assert sorted(s.kept + tuple(v for grp in s.groups for v in grp)) == list(range(n))


@pytest.mark.parametrize("seed", range(3))
def test_linear_and_arbitrary_solvers_agree_on_chains(seed):
    rng = random.Random(seed)
    for _ in range(5):
        n = rng.randint(1, 40)
        g = Graph.chain([rng.choice([0, 5, 50, 100, 300]) for _ in range(n)],
                        [rng.choice([1.0, 10.0]) for _ in range(n)])
        assert reforward_linear(g) == reforward_arbitrary(g)
        peak = unoptimised_peak_bytes(g)
        for budget in (peak, (peak * 2) // 3):
            try:
                lin = solve_reforward(g, budget, config={"method": "linear"})
            except InfeasibleBudgetError as err:
                with pytest.raises(InfeasibleBudgetError) as err2:
                    solve_reforward(g, budget)
                assert err2.value.min_budget_bytes == err.min_budget_bytes
                continue
            acg = solve_reforward(g, budget)
            assert lin.segments == acg.segments
            validate_plan(g, acg)
            assert simulate(g, acg).peak_bytes <= budget


def _eqn1_costs(g: Graph, store: bool) -> tuple[list[int], list[int], set[int]]:
    """``keep``, ``inner`` and the pinned nodes, from the module docstring's definitions."""
    n = len(g)
    saved = set()
    for v in g.nodes:
        if g.node(v)["requires_grad"]:
            saved |= {s for u in g.node(v)["saves"] for s in (u, g.root(u))}
    saved |= {s for u in g.meta["loss_saves"] for s in (u, g.root(u))}
    keep = [g.node(g.root(v))["alloc_bytes"] for v in range(n)]
    inner = [(g.node(v)["alloc_bytes"] if v in saved else 0)
             + (g.node(v)["extra_saved_bytes"] if g.node(v)["requires_grad"] else 0) for v in range(n)]
    pinned = set()
    for v in g.nodes:
        d = g.node(v)
        saves = {s for u in d["saves"] for s in (u, g.root(u))} if d["requires_grad"] else set()
        if not d["recomputable"]:
            pinned |= {v} | saves
        elif store and len(g.pred(v)) > 1:
            pinned |= {s for u in g.pred(v) for s in (u, g.root(u)) if s in saves and s != v}
    return keep, inner, pinned


def _eqn1_optimum(g: Graph, store: bool) -> int:
    """Least Eqn. 1 over every kept set whose re-forwarded parts are closed sets with one
    head and one tail (the model input and the loss being the virtual ones)."""
    keep, inner, pinned = _eqn1_costs(g, store)
    n = len(g)
    best = None
    for mask in range(1 << n):
        kept = {v for v in range(n) if mask >> v & 1}
        if not pinned <= kept:
            continue
        largest, ok, seen = 0, True, set()
        for s in range(n):
            if s in kept or s in seen:
                continue
            comp, stack = {s}, [s]
            while stack:
                x = stack.pop()
                for y in g.succ(x) + g.pred(x):
                    if y not in kept and y not in comp:
                        comp.add(y)
                        stack.append(y)
            seen |= comp
            heads = {u for x in comp for u in g.pred(x) if u not in comp}
            heads |= {"input"} if any(not g.pred(x) for x in comp) else set()
            tails = {w for x in comp for w in g.succ(x) if w not in comp}
            tails |= {"loss"} if any(not g.succ(x) or g.node(x)["is_output"] for x in comp) else set()
            if len(heads) != 1 or len(tails) != 1:
                ok = False
                break
            largest = max(largest, sum(inner[x] for x in comp))
        if ok:
            cost = sum(keep[v] for v in kept) + largest
            best = cost if best is None else min(best, cost)
    assert best is not None
    return best


@pytest.mark.parametrize("seed", range(3))
def test_arbitrary_solver_is_exact_for_eqn_1_on_small_dags(seed):
    # Algorithms 2-5 reach the least Eqn. 1 over every valid set of kept vertices
    rng = random.Random(20 + seed)
    for _ in range(12):
        n = rng.randint(4, 11)
        g = rich_dag(rng, n, p_skip=0.15) if rng.random() < 0.5 else plain_dag(rng, n)
        for mode in ("store", "merge"):
            fam = reforward_arbitrary(g, multi_input=mode)
            assert min(s.cost_bytes for s in fam) == _eqn1_optimum(g, mode == "store")
            for s in fam:
                assert sorted(s.kept + tuple(v for grp in s.groups for v in grp)) == list(range(n))
                assert s.reforward_bytes <= s.max_term_bytes
