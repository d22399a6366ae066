"""``autoremat.solvers.chen``: Chen et al.'s segmentation, golden cases, helpers, options, module level, zoo."""

from __future__ import annotations

import pytest
from _graphs import module_graph, random_from_edges
from _plans import check_plan

import autoremat
from autoremat import Graph, InfeasibleBudgetError, solve, validate_plan
from autoremat.cost import unoptimised_peak_bytes

N = 20
SIZE = 100


def long_chain() -> Graph:
    return Graph.chain([SIZE] * N, [float(i + 1) for i in range(N)])


from autoremat.solvers.chen import segment_by_threshold, split_candidates


def test_chen_uniform_chain_golden():
    # 20 nodes x 100 bytes, times 1..20, unoptimised peak 2200 (= (20 + 2) x 100).
    g = long_chain()
    assert unoptimised_peak_bytes(g) == 2200
    # Cheapest plan of chen's family under any binding budget above 1200: recompute the first
    # half. By hand: forward keeps outputs 10..19 (1000); backward of 19 adds its gradient and
    # that of 18 (1200); at node 9 the replay holds 10 copies + gradient 9 (1100), and backward
    # of 9 adds gradient 8 (1200). Extra time 1 + ... + 10 = 55.
    plan = solve(g, 2199, solver="chen")
    assert [s.nodes for s in plan.recompute_segments] == [tuple(range(10))]
    assert plan.predicted_peak_bytes == 1200
    assert plan.predicted_extra_time_s == 55.0
    assert solve(g, 1200, solver="chen").predicted_extra_time_s == 55.0
    # below 1200 two recomputed segments are needed, and they cost more
    plan = solve(g, 1199, solver="chen")
    assert len(plan.recompute_segments) == 2 and plan.predicted_extra_time_s > 55.0
    with pytest.raises(InfeasibleBudgetError) as err:
        solve(g, 0, solver="chen")
    m = err.value.min_budget_bytes
    assert m == 900
    assert solve(g, m, solver="chen").predicted_peak_bytes == m


def test_chen_helpers():
    chain = Graph.chain([100] * 4)
    assert split_candidates(chain) == [0, 1, 2]
    assert split_candidates(Graph.from_edges(4, [(0, 1), (1, 2), (2, 3), (0, 3)])) == [0]
    assert split_candidates(Graph.from_edges(4, [(0, 1), (0, 2), (1, 3), (2, 3)])) == [0]
    # 0 -> 1 -> 2 -> 3 -> 4 with a skip 1 -> 3: cutting after 0, 1 or 3 keeps one tensor
    assert split_candidates(Graph.from_edges(5, [(0, 1), (1, 2), (2, 3), (1, 3), (3, 4)])) == [0, 1, 3]
    assert segment_by_threshold(chain, 150, {0, 1, 2}) == [[0, 1], [0, 1, 2, 3]]
    assert segment_by_threshold(chain, 0, {0, 1, 2}) == [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3]]
    assert segment_by_threshold(chain, 10**9, {0, 1, 2}) == [[0, 1, 2, 3]]


def test_chen_options():
    g = long_chain()
    plan = solve(g, 2000, solver="chen", thresholds=4)
    check_plan(g, plan, 2000, "chen")
    assert plan.options["thresholds"] == 4
    assert plan.graph_mode == "synthetic"
    assert plan.node_names == tuple(f"n{i}" for i in range(N))
    with pytest.raises(ValueError, match="thresholds"):
        solve(g, 2000, solver="chen", thresholds=0)
    with pytest.raises(ValueError, match=r"chen: option 'grid' is now called 'thresholds'.*thresholds=4"):
        solve(g, 2000, solver="chen", grid=4)


# ---------------------------------------------------------------------- module-level graphs
def test_chen_module_mode_three_cases():
    g = module_graph(10)
    peak = unoptimised_peak_bytes(g)
    plan = solve(g, peak, solver="chen")
    check_plan(g, plan, peak, "chen")
    assert plan.recompute_segments == []
    budget = int(peak * 0.6)
    plan = solve(g, budget, solver="chen")
    check_plan(g, plan, budget, "chen")
    assert plan.recompute_segments
    assert all(len(s.nodes) == 1 for s in plan.recompute_segments)
    assert plan.node_names == tuple(f"layers.{v}" for v in range(len(g)))
    with pytest.raises(InfeasibleBudgetError) as err:
        solve(g, 10, solver="chen")
    m = err.value.min_budget_bytes
    assert m is not None and m > 10
    check_plan(g, solve(g, m, solver="chen"), m, "chen")


# ---------------------------------------------------------------------- properties
def _budget_sweep(g: Graph, solver: str, steps: int) -> list[tuple[int, float]]:
    peak = unoptimised_peak_bytes(g)
    out = []
    for i in range(steps + 1):
        budget = int(peak * (0.2 + 1.0 * i / steps))
        try:
            plan = solve(g, budget, solver=solver)
        except InfeasibleBudgetError:
            continue
        validate_plan(g, plan)
        assert plan.predicted_peak_bytes <= budget
        out.append((budget, plan.predicted_extra_time_s))
    return out


def _assert_non_increasing(results: list[tuple[int, float]]) -> None:
    extras = [e for _, e in results]
    assert all(b <= a + 1e-12 for a, b in zip(extras, extras[1:])), results


@pytest.mark.parametrize("solver", ["chen", "auto"])
def test_extra_time_never_rises_with_budget_chains(solver):
    for sizes in ([100] * 30, [10 * (i % 7 + 1) for i in range(40)], [1000, 1, 1000, 1, 500, 500, 2000, 3]):
        g = Graph.chain(sizes, [1.0 + (i % 3) for i in range(len(sizes))])
        results = _budget_sweep(g, solver, 24)
        assert results and results[-1][1] == 0.0
        _assert_non_increasing(results)


@pytest.mark.parametrize("seed", range(6))
def test_extra_time_never_rises_with_budget_random_dags(seed):
    g = random_from_edges(seed)
    results = _budget_sweep(g, "chen", 16)
    assert results and results[-1][1] == 0.0
    _assert_non_increasing(results)


def test_extra_time_never_rises_with_budget_module_graph():
    _assert_non_increasing(_budget_sweep(module_graph(12), "chen", 24))


@pytest.fixture(scope="module")
def resnet_graph() -> Graph:
    m, a = autoremat.zoo.build("resnet50")
    return autoremat.capture(m, a, repeats=1, warmup=0)


def test_zoo_resnet50_chen(resnet_graph):
    g = resnet_graph
    assert g.meta["mode"] == "fx" and len(g) > 100
    peak = unoptimised_peak_bytes(g)
    # three budget cases on a real graph
    plan = solve(g, peak, solver="chen")
    check_plan(g, plan, peak, "chen")
    assert plan.recompute_segments == []
    budget = int(peak * 0.7)
    plan = solve(g, budget, solver="chen")
    check_plan(g, plan, budget, "chen")
    assert plan.recompute_segments and plan.predicted_extra_time_s > 0
    with pytest.raises(InfeasibleBudgetError) as err:
        solve(g, int(peak * 0.1), solver="chen")
    m = err.value.min_budget_bytes
    check_plan(g, solve(g, m, solver="chen"), m, "chen")
    # property over a grid of budgets
    results = _budget_sweep(g, "chen", 12)
    assert len(results) >= 8 and results[-1][1] == 0.0
    _assert_non_increasing(results)
    # same with the papers' time convention
    gp = g.with_paper_times()
    _assert_non_increasing(_budget_sweep(gp, "chen", 8))


def test_chen_on_a_transformers_model_captured_op_by_op_recomputes_whole_blocks():
    """The default capture records repeated blocks op by op; Chen's module-level variant plans
    each block as its call region (Graph.recompute_units), as it did on the block-level graph:
    the same least budget, and the plan applies with gradients equal to the unpatched model's."""
    pytest.importorskip("transformers")
    import copy

    import torch

    from autoremat.zoo import hf
    from autoremat.measure import gradients, run_step

    model = hf.gpt2()
    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(1))
    ops = autoremat.capture(model, (ids,), loss_fn=hf.logits_mean, times="flops")
    whole = autoremat.capture(model, (ids,), loss_fn=hf.logits_mean, blocks="module", times="flops")
    assert ops.ops_blocks and len(ops) > 3 * len(whole)
    least_ops, least_whole = autoremat.min_budget(ops, "chen"), autoremat.min_budget(whole, "chen")
    assert least_ops < 0.8 * unoptimised_peak_bytes(ops)
    assert abs(least_ops - least_whole) <= 0.01 * least_whole
    plan = solve(ops, "min", solver="chen")
    blocks = [s for s in plan.recompute_segments if len(s.nodes) > 1]
    assert blocks and all(ops.region_of(s.nodes) is not None for s in blocks)
    ref = copy.deepcopy(model)
    autoremat.apply(model, plan)
    torch.manual_seed(0)
    run_step(model, (ids,), loss_fn=hf.logits_mean)
    torch.manual_seed(0)
    run_step(ref, (ids,), loss_fn=hf.logits_mean)
    got, want = gradients(model), gradients(ref)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def _chen_graphs() -> list[Graph]:
    import random

    from _graphs import block_chain, random_profiled_graphs

    return [*random_profiled_graphs(6, seed=3), module_graph(12), block_chain(random.Random(2), 4),
            block_chain(random.Random(4), 3, mode="fx")]


@pytest.mark.parametrize("index", range(9))
def test_min_budget_is_the_least_budget_chen_meets(index: int) -> None:
    """``min_budget(g, "chen")`` comes from one pass over Chen's plans; it is the least budget
    the solver meets: it meets it and fails one byte less."""
    from autoremat.solvers import min_budget
    from autoremat.solvers.chen import min_budget_chen, solve_chen

    g = _chen_graphs()[index]
    least = min_budget(g, "chen")
    assert least == min_budget_chen(g)
    validate_plan(g, solve_chen(g, least))
    with pytest.raises(InfeasibleBudgetError):
        solve_chen(g, least - 1)
    coarse = min_budget(g, "chen", config={"thresholds": 3})  # the solver's options are honoured
    solve_chen(g, coarse, config={"thresholds": 3})
    with pytest.raises(InfeasibleBudgetError):
        solve_chen(g, coarse - 1, config={"thresholds": 3})
    with pytest.raises(ValueError, match="thresholds"):
        min_budget(g, "chen", config={"thresholds": 0})


def test_chens_plans_are_kept_per_graph_and_tried_again_after_an_edit() -> None:
    from _graphs import skip_chain

    from autoremat.solvers.chen import chen_plans

    g = skip_chain()
    first = chen_plans(g)
    again = chen_plans(g)
    assert [(p, t, q.to_dict()) for p, t, q in first] == [(p, t, q.to_dict()) for p, t, q in again]
    assert all(a[2] is not b[2] for a, b in zip(first, again))  # fresh plans: a caller may stamp its own
    g.nx.nodes[1]["time_s"] *= 10  # an edited graph: its plans' extra times change
    assert [t for _, t, _ in chen_plans(g)] != [t for _, t, _ in first]
