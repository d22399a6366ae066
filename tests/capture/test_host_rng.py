"""A forward that draws random numbers in Python (numpy, ``random``, ``torch.rand(())`` on no traced
input) is not captured by fx, which would freeze the draw into every step: ``mode="auto"`` captures
it at module level, whose plans keep the model's gradients bit for bit (the calls drawing from numpy or
``random`` kept from recomputation, whose replay would draw again); and autoremat's own runs of the
model leave numpy's and Python's generators as they were (:mod:`autoremat.capture.host_rng`)."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch
from torch import nn

import autoremat

DRAW = {"torch": lambda: float(torch.rand(()) > 0.3), "numpy.random": lambda: float(np.random.rand() > 0.3),
        "random": lambda: float(random.random() > 0.3)}


class _Block(nn.Module):
    def __init__(self, source: str) -> None:
        super().__init__()
        self.source, self.f, self.g = source, nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + DRAW[self.source]() * self.g(torch.tanh(self.f(x)))  # stochastic depth drawn in Python


class _Net(nn.Module):
    def __init__(self, source: str) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Block(source) for _ in range(6))
        self.head = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def _grads(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    np.random.seed(3)
    random.seed(3)
    _loss(model(x)).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("source", sorted(DRAW))
def test_python_draws_are_captured_at_module_level_and_plans_keep_the_gradients(source: str) -> None:
    torch.manual_seed(0)
    model, x = _Net(source), torch.randn(64, 32)
    with pytest.raises(ValueError, match=f"drew random numbers from {source} while torch.fx traced it"):
        autoremat.capture(model, (x,), loss_fn=_loss, mode="fx", times="flops")
    np.random.seed(7)
    random.seed(7)
    torch.manual_seed(7)
    states = (np.random.get_state()[1].copy(), random.getstate(), torch.get_rng_state())
    graph = autoremat.capture(model, (x,), loss_fn=_loss, times="flops")
    assert np.array_equal(np.random.get_state()[1], states[0]) and random.getstate() == states[1]
    assert torch.equal(torch.get_rng_state(), states[2])
    assert graph.meta["mode"] == "module"
    # a call drawing from Python's or numpy's generator is kept (a replay would draw again: the
    # generator advanced twice per step, so the next steps' draws differed); torch's draws are replayed
    kept = set(graph.meta["pinned_by_host_rng"])
    assert kept == (set() if source == "torch" else {f"layers.{i}" for i in range(6)})
    plan = autoremat.solve(graph, "min")
    assert bool(plan.recompute_segments) == (source == "torch")
    patched = copy.deepcopy(model)
    autoremat.apply(patched, plan)
    for _ in range(3):
        want, got = _grads(model, x), _grads(patched, x)
        assert all(torch.equal(want[k], got[k]) for k in want)
