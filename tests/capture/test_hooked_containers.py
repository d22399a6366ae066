"""A hook on a module whose code an fx trace runs through (a block, a container) before capture.

The fx-level forward calls only the trace's leaves, so the patched model would run its own
forward, without the plan, at every step (one ``StateGuardWarning``, the unpatched step's peak).
Capture sees the hook up front: ``mode="auto"`` captures at module level, where the block is
called through ``__call__`` (hooks fire, the plan runs), and ``mode="fx"`` refuses, naming it."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import autoremat
from autoremat.measure import LiveStorageCounter, gradients, gradients_equal, run_step


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32)) for _ in range(6))
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return Residual()


def _hooked(model: nn.Module, seen: list) -> nn.Module:
    def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        if not autoremat.is_profiling() and not autoremat.runtime.is_recomputing():
            seen.append(out.detach().double().sum().item())  # no tensor kept: the peak is the plan's

    model.blocks[2].register_forward_hook(hook)
    return model


def test_a_hooked_block_is_captured_at_module_level_and_the_plan_runs() -> None:
    x = torch.randn(256, 32)
    seen_plain: list = []
    seen: list = []
    plain = _hooked(_model(), seen_plain)
    model = _hooked(_model(), seen)
    graph = autoremat.capture(model, (x,), repeats=1, warmup=0)
    assert graph.meta["mode"] == "module"
    plan = autoremat.solve(graph, "min")
    assert plan.recompute_segments
    predicted = autoremat.simulate(graph, plan).peak_bytes
    autoremat.apply(model, plan)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no StateGuardWarning: the plan runs
        counter = LiveStorageCounter()
        with counter:
            run_step(model, (x,))
    run_step(plain, (x,))
    assert counter.peak <= predicted + 64
    assert gradients_equal(gradients(plain), gradients(model))
    assert len(seen) == len(seen_plain) == 1 and seen == seen_plain
    autoremat.restore(model)


def test_fx_mode_refuses_a_hooked_block_and_names_it() -> None:
    model = _hooked(_model(), [])
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=r"hooks on module 'blocks.2'.*mode='module'"):
        autoremat.capture(model, (torch.randn(8, 32),), mode="fx")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert len(model.blocks[2]._forward_hooks) == 1


def test_a_hooked_leaf_stays_at_fx_level() -> None:
    """A leaf's hooks run in its own ``__call__``, which the fx forward calls: no fallback."""
    model = _model()
    model.blocks[2][0].register_forward_hook(lambda m, a, out: None)
    assert autoremat.capture(model, (torch.randn(8, 32),), repeats=1, warmup=0).meta["mode"] == "fx"
