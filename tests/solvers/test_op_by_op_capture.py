"""Node-by-node solvers on a module-level graph whose repeated blocks were captured op by op
(``capture(blocks="auto")``, the default; issue 21): an op inside a block is not recomputable on
its own, only whole module calls are, so ``xla-greedy``/``reforward`` reach nothing below the
unoptimised peak there (``chen`` recomputes a block as its call region; ``dp-approx`` reaches
what Chen's plans do, which it checks its own against, but not its own optimum). The error says so and names what to do; the integrations capture one
node per block for those solvers (:func:`autoremat.integrations._common.capture_blocks`)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autoremat
from autoremat import InfeasibleBudgetError
from autoremat.cost import unoptimised_peak_bytes
from autoremat.integrations._common import capture_blocks
import autoremat.solvers as solvers_pkg
from autoremat.solvers import SOLVERS, kusumoto, large_op_capture, least_budget, min_budget, plans_single_nodes


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32), nn.Tanh()) for _ in range(4)]
    return nn.Sequential(nn.Linear(16, 32), *blocks, nn.Linear(32, 4))


@pytest.fixture(scope="module")
def graphs() -> dict[str, autoremat.Graph]:
    model, x = _model(), torch.randn(64, 16)
    # times from FLOPs: the plans compared by time below do not depend on the machine's load
    return {b: autoremat.capture(model, (x,), mode="module", blocks=b, repeats=1, warmup=0, times="flops")
            for b in ("auto", "module")}


@pytest.mark.parametrize("solver", ["xla-greedy", "reforward"])
def test_node_solvers_on_an_op_by_op_capture_name_the_way_out(graphs, solver: str) -> None:
    ops, module = graphs["auto"], graphs["module"]
    assert ops.meta["blocks"] == "ops"
    inside = [v for v in ops.nodes if ops.node(v)["scope"]]
    assert inside and not any(ops.node(v)["recomputable"] for v in inside)  # only whole calls are
    assert min_budget(ops, solver) == unoptimised_peak_bytes(ops)
    with pytest.raises(InfeasibleBudgetError, match=r"captured op by op.*solver='blocks'.*blocks='module'"):
        autoremat.solve(ops, "80%", solver=solver)
    assert autoremat.solve(module, "80%", solver=solver).recompute_segments  # one node per block: it can
    assert autoremat.solve(ops, "80%", solver="blocks").recompute_segments


@pytest.fixture()
def large(monkeypatch: pytest.MonkeyPatch) -> None:
    """The op-by-op fixture graph counts as large (AUTO_BLOCKS_ENOUGH_NODES lowered to its size:
    a 64-layer GPT-2 at op level has 4,307 nodes, too slow to capture here)."""
    monkeypatch.setattr(solvers_pkg, "AUTO_BLOCKS_ENOUGH_NODES", 5)


@pytest.mark.parametrize("solver", [s for s in SOLVERS if plans_single_nodes(s)])
def test_min_budget_of_node_solvers_refuses_large_op_by_op_captures_at_once(graphs, solver: str, monkeypatch) -> None:
    """The least budget of a node-by-node solver is not searched on a large op-by-op capture
    (minutes on a 64-layer GPT-2, issue 24): a ValueError naming the way out, before any solve
    runs; on a small one (and on one node per block) it is computed as before."""
    ops = graphs["auto"]
    small = min_budget(ops, solver)
    assert small <= unoptimised_peak_bytes(ops)

    def fail(*_a, **_k):
        raise AssertionError("a solver ran")

    monkeypatch.setattr(solvers_pkg, "AUTO_BLOCKS_ENOUGH_NODES", len(ops))
    assert large_op_capture(ops) and not large_op_capture(graphs["module"])
    monkeypatch.setattr(solvers_pkg, "bare_solver", fail)
    monkeypatch.setattr(kusumoto, "min_budget", fail)
    with pytest.raises(ValueError, match=rf"min_budget\(solver='{solver}'\).*captured op by op.*blocks='module'"):
        min_budget(ops, solver)
    monkeypatch.undo()
    assert min_budget(graphs["module"], solver) < unoptimised_peak_bytes(graphs["module"])


@pytest.mark.parametrize("solver", [s for s in SOLVERS if plans_single_nodes(s)])
def test_solve_by_name_refuses_large_op_by_op_captures_at_once(graphs, solver: str, monkeypatch) -> None:
    """``solve(..., solver=<a node-by-node solver>)`` on a large op-by-op capture is refused before
    any solve runs, as its min_budget is (dp-approx searched 16 s+ on a 64-layer GPT-2 before
    its hint); a small one and one node per block are solved as before."""
    ops = graphs["auto"]

    def fail(*_a, **_k):
        raise AssertionError("a solver ran")

    monkeypatch.setattr(solvers_pkg, "AUTO_BLOCKS_ENOUGH_NODES", len(ops))
    monkeypatch.setattr(solvers_pkg, "bare_solver", fail)
    for budget in ("80%", "min"):
        with pytest.raises(ValueError, match=rf"solve\(solver='{solver}'\).*captured op by op.*solver='blocks'"):
            autoremat.solve(ops, budget, solver=solver)
    monkeypatch.undo()
    assert autoremat.solve(graphs["module"], "95%", solver=solver).budget_bytes > 0


def test_region_and_offload_solvers_still_answer_min_budget_on_large_op_by_op_captures(graphs, large) -> None:
    ops = graphs["auto"]
    assert not plans_single_nodes("vdnn") and not plans_single_nodes("blocks") and plans_single_nodes("dp-approx")
    assert min_budget(ops, "blocks") < unoptimised_peak_bytes(ops)
    assert min_budget(ops, "offload-greedy") <= unoptimised_peak_bytes(ops)


def test_auto_leaves_node_solvers_out_on_large_op_by_op_captures(graphs, monkeypatch, caplog) -> None:
    """What auto asks and what least_budget('auto') asks are one list: on a large op-by-op
    capture blocks and chen only (said in the log), and solve(..., 'min') meets that least."""
    import logging

    from autoremat.solvers.least import auto_order

    ops = graphs["auto"]
    # small: all but dp-approx still run (AUTO_NOT_ON_OP_CAPTURES)
    assert auto_order(ops, {}) == tuple(n for n in auto_order(graphs["module"], {}) if n != "dp-approx")
    monkeypatch.setattr(solvers_pkg, "AUTO_BLOCKS_ENOUGH_NODES", 5)
    assert auto_order(ops, {}) == ("none", "blocks", "chen") and "dp-approx" in auto_order(graphs["module"], {})
    for name in ("dp-approx", "combined", "milp"):
        monkeypatch.setitem(solvers_pkg.SOLVERS, name, None)  # would fail if called
    with caplog.at_level(logging.INFO, logger="autoremat.solvers.least"):
        plan = autoremat.solve(ops, "80%")
        with pytest.raises(InfeasibleBudgetError):
            autoremat.solve(ops, "5%")
    assert plan.solver in ("blocks", "chen") and "dp-approx left out" in caplog.text
    best = min((autoremat.solve(ops, "80%", solver=s) for s in ("blocks", "chen")),
               key=lambda p: p.predicted_extra_time_s)
    assert plan.predicted_extra_time_s == best.predicted_extra_time_s
    assert least_budget(ops) == min(min_budget(ops, "blocks"), min_budget(ops, "chen"))
    assert autoremat.solve(ops, "min").budget_bytes == least_budget(ops)


def test_auto_leaves_dp_approx_out_on_small_op_by_op_captures(graphs, monkeypatch, caplog) -> None:
    """Below AUTO_BLOCKS_ENOUGH_NODES too: dp-approx plans single ops, which these blocks do not let
    it recompute (it reached the least budget and the plans of the others on 39 transformers graphs,
    AUTO_NOT_ON_OP_CAPTURES); auto does not call it there, and still calls it on a graph of one node
    per block; asked by name it plans the op-by-op graph as before."""
    import logging

    from autoremat.solvers.least import auto_order

    ops, module = graphs["auto"], graphs["module"]
    assert len(ops) < solvers_pkg.AUTO_BLOCKS_ENOUGH_NODES
    real = solvers_pkg.SOLVERS["dp-approx"]
    calls: list[int] = []

    def counted(graph, budget, **kw):  # type: ignore[no-untyped-def]
        calls.append(len(graph))
        return real(graph, budget, **kw)

    monkeypatch.setitem(solvers_pkg.SOLVERS, "dp-approx", counted)
    with caplog.at_level(logging.INFO, logger="autoremat.solvers.least"):
        plan = autoremat.solve(ops, "80%")
    assert not calls and "dp-approx left out" in caplog.text and plan.solver != "dp-approx"
    assert least_budget(ops) == min(min_budget(ops, s) for s in auto_order(ops, {}) if s != "none")
    calls.clear()
    autoremat.solve(module, "80%")
    assert len(module) in calls
    assert autoremat.solve(ops, "80%", solver="dp-approx").solver == "dp-approx"


def test_the_hint_is_only_for_node_solvers_on_op_by_op_captures(graphs) -> None:
    with pytest.raises(InfeasibleBudgetError) as err:
        autoremat.solve(graphs["module"], "10%", solver="dp-approx")
    assert "op by op" not in str(err.value)
    with pytest.raises(InfeasibleBudgetError) as err:
        autoremat.solve(graphs["auto"], "10%", solver="blocks")
    assert "op by op" not in str(err.value)
    assert [capture_blocks(s) for s in ("auto", "blocks", "chen", "dp-approx")] == ["auto", "auto", "auto", "module"]


def test_chen_recomputes_blocks_captured_op_by_op_as_their_call_regions(graphs) -> None:
    ops, module = graphs["auto"], graphs["module"]
    assert min_budget(ops, "chen") < unoptimised_peak_bytes(ops)
    assert min_budget(ops, "chen") == pytest.approx(min_budget(module, "chen"), rel=0.01)
    plan = autoremat.solve(ops, "80%", solver="chen")
    regions = [s for s in plan.recompute_segments if len(s.nodes) > 1]
    assert regions and all(ops.region_of(s.nodes) is not None for s in regions)
