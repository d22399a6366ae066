"""A parameter used more than once per step (a weight-shared layer, tied embeddings): its gradient
is allocated by the first use in backward, and each later use adds a contribution of the same
size, a transient the cost model charges beside the gradient. The capture counted that
contribution in the later node's ``bwd_temp_bytes`` too, so the step peak was predicted one
weight too high where it sits in a later use's backward (a Linear run three times, batch 4:
798,720 B predicted against 536,584 B measured)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autoremat
from autoremat.cost import no_recompute_plan, simulate
from autoremat.measure import measure


class _Thrice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(256, 256, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            x = torch.tanh(self.lin(x))
        return x


@pytest.mark.parametrize("mode", ["module", "fx"])
def test_a_weight_used_three_times_is_predicted_exactly(mode: str) -> None:
    torch.manual_seed(0)
    model, x = _Thrice(), torch.randn(4, 256)
    loss = lambda out: out.sum()  # noqa: E731
    graph = autoremat.capture(model, (x,), loss_fn=loss, repeats=1, warmup=0, mode=mode)
    predicted = simulate(graph, no_recompute_plan(graph)).peak_bytes
    measured = measure(model, (x,), loss_fn=loss, steps=1, warmup=0).peak_bytes
    assert abs(predicted - measured) <= 0.01 * measured, (predicted, measured)
