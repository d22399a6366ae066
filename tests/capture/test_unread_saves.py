"""An op called with a conjugate view runs on the copy the conjugate fallback makes, while autograd
saves the view: the saver holds the view's storage as an input (Autoformer's auto-correlation
crashed the simulator); an in-place op's copy of ``self`` stays the saver's extra bytes
(:mod:`autoremat.capture.unread_saves`)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import autoremat
from autoremat.cost import no_recompute_plan, simulate
from autoremat.measure import LiveStorageCounter, gradients, gradients_equal


class _AutoCorrelation(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.q, self.k, self.o = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q_fft = torch.fft.rfft(self.q(x), dim=1)
        k_fft = torch.fft.rfft(self.k(x), dim=1)
        corr = torch.fft.irfft(q_fft * torch.conj(k_fft), n=x.shape[1], dim=1)
        return x + self.o(torch.tanh(corr))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_AutoCorrelation() for _ in range(3))
        self.head = nn.Linear(32, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def _step(model: nn.Module, x: torch.Tensor) -> tuple[int, dict]:
    model.zero_grad(set_to_none=True)
    counter = LiveStorageCounter()
    with counter:
        _loss(model(x)).backward()
    return counter.peak, gradients(model)


@pytest.mark.parametrize("budget", [None, "50%", "min"])
def test_a_conjugate_view_read_through_its_copy_is_held_to_its_saver(budget: str | None) -> None:
    torch.manual_seed(0)
    model, x = _Net(), torch.randn(8, 64, 32)
    graph = autoremat.capture(model, (x,), loss_fn=_loss, mode="module", times="flops")
    held = [v for v in graph.nodes if any(b == 0 for _u, b in graph.node(v)["grad_part"])]
    assert held and all(graph.node(v)["name"].endswith("mul.Tensor") for v in held)
    plan = no_recompute_plan(graph) if budget is None else autoremat.solve(graph, budget)
    predicted = simulate(graph, plan).peak_bytes
    patched = copy.deepcopy(model)
    if budget is not None:
        autoremat.apply(patched, plan)
    _, want = _step(model, x)
    peak, got = _step(patched, x)
    assert gradients_equal(want, got)
    assert peak <= predicted <= 1.01 * peak
