"""An op called with a conjugate view runs on the copy the conjugate fallback makes, while autograd
saves the view: the saver holds the view's storage as an input (Autoformer's auto-correlation
crashed the simulator) (:mod:`autoremat.capture.unread_saves`)."""

from __future__ import annotations

import pytest
import torch
from _stacked import Stacked, predicted_and_measured
from torch import nn


class _AutoCorrelation(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.q, self.k, self.o = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q_fft = torch.fft.rfft(self.q(x), dim=1)
        k_fft = torch.fft.rfft(self.k(x), dim=1)
        corr = torch.fft.irfft(q_fft * torch.conj(k_fft), n=x.shape[1], dim=1)
        return x + self.o(torch.tanh(corr))


@pytest.mark.parametrize("budget", [None, "50%", "min"])
def test_a_conjugate_view_read_through_its_copy_is_held_to_its_saver(budget: str | None) -> None:
    torch.manual_seed(0)
    graph, predicted, peak = predicted_and_measured(Stacked(_AutoCorrelation, d=32), torch.randn(8, 64, 32), budget)
    held = [v for v in graph.nodes if any(b == 0 for _u, b in graph.node(v)["grad_part"])]
    assert held and all(graph.node(v)["name"].endswith("mul.Tensor") for v in held)
    assert peak <= predicted <= 1.01 * peak
