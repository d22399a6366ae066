"""Regions no gradient reaches are recomputed in every solver's plan where that frees memory
(:mod:`autoremat.solvers.unreached_regions`), and the ``blocks`` chain treats them as gaps it
recomputes (:func:`autoremat.cost.block_chain.chain_plan`).

On the network of ``tests/_codec.py`` (three encoder blocks whose output only picks integer codes,
three decoder blocks) the ``blocks`` solver's least plan recomputed the decoder blocks only: its chain
model takes a block's holdings as their largest change up to its backward, none for what is freed
before backward. Measured (CPU): that plan's step peak was 917,504 bytes, 720,896 with the encoder's
blocks recomputed too, as predicted.
"""

from __future__ import annotations

import pytest
import torch
from _codec import Codec

import autoremat
from autoremat.cost import no_recompute_plan, simulate
from autoremat.cost.unreached import unreached_units
from autoremat.solvers import finalize_plan
from autoremat.solvers.blocks.detect import find_blocks
from autoremat.solvers.unreached_regions import recompute_unreached


@pytest.fixture(scope="module")
def graph() -> autoremat.Graph:
    torch.manual_seed(0)
    return autoremat.capture(Codec(), (torch.randn(2, 1, 512),), loss_fn=torch.sum, mode="module", times="flops")


def _encoder_units(graph: autoremat.Graph) -> list[tuple[int, ...]]:
    return [u for u in unreached_units(graph) if graph.node(u[0])["module_path"].startswith("encoder")]


def test_the_encoder_blocks_are_the_units_no_gradient_reaches(graph):
    units = _encoder_units(graph)
    assert len(units) == 3 and units == unreached_units(graph)
    assert not any(p.startswith("encoder") for p in find_blocks(graph).paths)  # gaps of the chain
    assert sum(p.startswith("decoder") for p in find_blocks(graph).paths) == 3


def test_a_stored_plan_gets_them_recomputed_for_no_time(graph):
    base = no_recompute_plan(graph)
    freed = recompute_unreached(graph, base)
    assert [s.nodes for s in freed.recompute_segments] == _encoder_units(graph)
    before, after = simulate(graph, base), simulate(graph, freed)
    assert after.peak_bytes < before.peak_bytes and after.extra_time_s == before.extra_time_s == 0
    assert finalize_plan(graph, no_recompute_plan(graph), 10**15, "manual").segments == freed.segments


def test_a_plan_that_frees_nothing_more_is_left_as_it_is(graph):
    freed = recompute_unreached(graph, no_recompute_plan(graph))
    assert recompute_unreached(graph, freed) is freed


@pytest.mark.parametrize("solver", ["blocks", "chen", "auto"])
def test_every_solvers_least_plan_recomputes_the_encoder(graph, solver):
    plan = autoremat.solve(graph, "min", solver=solver)
    recomputed = {s.nodes for s in plan.recompute_segments}
    assert all(u in recomputed for u in _encoder_units(graph)), plan.describe()
    if solver != "chen":
        assert plan.predicted_peak_bytes == 720_896
