"""An in-place op on a view (``nn.ReLU(inplace=True)`` after a linear layer on a 4-d input, as in
Swin v2's continuous position-bias MLP) hides what its backward saves behind ``CopySlices``: the
capture takes it to save its result, which stays until its backward
(:func:`autoremat.capture.autograd_saves.behind_copy_slices`)."""

from __future__ import annotations

import pytest
import torch
from _stacked import Stacked, predicted_and_measured
from torch import nn


class _BiasedAttention(nn.Module):
    def __init__(self, width: int, n: int = 16, hidden: int = 2048) -> None:
        super().__init__()
        self.register_buffer("coords", torch.randn(1, n, n, 2))
        self.bias_mlp = nn.Sequential(nn.Linear(2, hidden), nn.ReLU(inplace=True), nn.Linear(hidden, 1, bias=False))
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias_mlp(self.coords).squeeze(-1)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return x + self.out(torch.softmax(q @ k.transpose(-1, -2) + bias, dim=-1) @ v)


@pytest.mark.parametrize("budget", [None, "min"])
def test_an_inplace_relu_on_a_view_holds_its_result_to_its_backward(budget: str | None) -> None:
    torch.manual_seed(0)
    graph, predicted, peak = predicted_and_measured(Stacked(_BiasedAttention, d=32), torch.randn(2, 16, 32), budget)
    relu = [v for v in graph.nodes if graph.node(v)["name"].endswith("relu_.default")]
    assert len(relu) == 3 and all(v in graph.node(v)["saves"] for v in relu)
    # the least plan (blocks 0 and 1 recomputed with kept ops) is 4 KB (0.04 %) under, before its first
    # replay: not this cause (1.25x under without it), not explained yet
    assert 0.999 * peak <= predicted <= 1.01 * peak
