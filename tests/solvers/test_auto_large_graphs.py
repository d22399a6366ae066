"""``solver="auto"`` on graphs of at least ``AUTO_BLOCKS_ENOUGH_NODES`` nodes: it stops after the
``blocks`` plan where the blocks repeat (a chain exact over options solved once per class), and
asks the node-by-node solvers (not ``combined``, :data:`autoremat.solvers.AUTO_SLOW_ON_LARGE`)
where they all differ: DenseNet's dense blocks and transitions, a coarse partition that
``dp-approx`` plans better (DenseNet-201 at CPU size, 50 %: 7.9 % less recomputation); up to
``CHAIN_MAX_NODES`` nodes, where dp-approx takes seconds."""

from __future__ import annotations

import logging

import pytest

import autoremat
import autoremat.solvers as solvers_pkg
from autoremat import zoo
from autoremat.cost import unoptimised_peak_bytes
from autoremat.solvers import AUTO_BLOCKS_ENOUGH_NODES, AUTO_SLOW_ON_LARGE, SOLVERS
from autoremat.solvers.blocks import repeats


def _spied(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the solvers ``auto`` runs, in order (each still runs)."""
    called: list[str] = []
    for name in ("blocks", "chen", "dp-approx", "combined"):
        inner = solvers_pkg.bare_solver(name)

        def spy(graph, budget_bytes, *, config=None, _name=name, _inner=inner):
            called.append(_name)
            return _inner(graph, budget_bytes, config=config)

        monkeypatch.setitem(SOLVERS, name, spy)
    return called


@pytest.fixture(scope="module")
def densenet() -> autoremat.Graph:
    return autoremat.capture(*zoo.build("densenet121", size="small", device="meta"))


def test_auto_asks_the_node_solvers_where_the_blocks_all_differ(densenet, monkeypatch, caplog) -> None:
    graph = densenet
    assert len(graph) >= AUTO_BLOCKS_ENOUGH_NODES  # the real threshold, no patch
    budget = unoptimised_peak_bytes(graph) // 2
    blocks = autoremat.solve(graph, budget, solver="blocks")
    assert blocks.options["blocks"] == blocks.options["classes"] > 1 and not repeats(blocks)
    called = _spied(monkeypatch)
    with caplog.at_level(logging.INFO, logger="autoremat.solvers"):
        plan = autoremat.solve(graph, budget)
    assert called == ["blocks", "chen", "dp-approx"] and not set(called) & set(AUTO_SLOW_ON_LARGE)
    assert "blocks solver's blocks all differ" in caplog.text and "combined" in caplog.text
    dp = autoremat.solve(graph, budget, solver="dp-approx")
    monkeypatch.setattr(solvers_pkg, "CHAIN_MAX_NODES", len(graph) - 1)  # above it: blocks' plan as before
    called.clear()
    with caplog.at_level(logging.INFO, logger="autoremat.solvers"):
        assert autoremat.solve(graph, budget).solver in ("blocks", "milp")
    assert called == ["blocks"] and f"over {len(graph) - 1} nodes; not trying" in caplog.text
    assert plan.predicted_extra_time_s <= min(blocks.predicted_extra_time_s, dp.predicted_extra_time_s)
    assert autoremat.simulate(graph, plan).peak_bytes <= budget


def test_auto_stops_after_blocks_where_they_repeat(monkeypatch, caplog) -> None:
    graph = autoremat.capture(*zoo.build("transformer", size="small", device="meta"))
    budget = unoptimised_peak_bytes(graph) // 2
    blocks = autoremat.solve(graph, budget, solver="blocks")
    assert repeats(blocks) and blocks.options["classes"] < blocks.options["blocks"]
    monkeypatch.setattr(solvers_pkg, "AUTO_BLOCKS_ENOUGH_NODES", len(graph))
    called = _spied(monkeypatch)
    with caplog.at_level(logging.INFO, logger="autoremat.solvers"):
        plan = autoremat.solve(graph, budget)
    assert called == ["blocks"] and "over repeated blocks; not trying" in caplog.text
    assert autoremat.simulate(graph, plan).peak_bytes <= budget


def test_repeats_reads_only_a_blocks_plan() -> None:
    plan = autoremat.Plan(segments=[], solver="blocks", options={"blocks": 4, "classes": 2})
    assert repeats(plan)
    assert not repeats(autoremat.Plan(segments=[], solver="blocks", options={"blocks": 4, "classes": 4}))
    assert not repeats(autoremat.Plan(segments=[], solver="chen", options={"blocks": 4, "classes": 2}))
    assert not repeats(autoremat.Plan(segments=[], solver="blocks"))
