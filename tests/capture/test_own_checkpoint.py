"""A model that calls ``torch.utils.checkpoint`` itself (the users autoremat is for placed such
calls by hand): a module-level capture sees its blocks run again during backward, says so, and an
infeasible budget's error says what keeps the least budget up. Before, the error stated a reachable
range of one value (the model's own checkpointed peak) with no reason."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import autoremat


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n, self.a, self.b = nn.LayerNorm(16), nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(F.gelu(self.a(self.n(x))))


class _Net(nn.Module):
    def __init__(self, reentrant: bool, own: bool) -> None:
        super().__init__()
        self.reentrant, self.own = reentrant, own
        self.stem = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(_Block() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        if h.sum() > -1e9:  # Python reading a tensor: fx cannot trace it, capture is module level
            h = h * 1.0
        for b in self.blocks:
            h = checkpoint(b, h, use_reentrant=self.reentrant) if self.own else b(h)
        return h


@pytest.mark.parametrize("reentrant", [False, True])
def test_the_models_own_recomputation_is_said_and_explains_the_least_budget(
        reentrant: bool, caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 32, 8)
    with caplog.at_level(logging.WARNING, logger="autoremat"):
        g = autoremat.capture(_Net(reentrant, own=True), (x,), times="flops")
    assert g.meta["mode"] == "module"
    assert g.meta["recomputed_by_model"] == {f"blocks.{i}": 1 for i in range(4)}
    assert "recomputes 4 module call(s) itself during backward" in caplog.text
    with pytest.raises(autoremat.InfeasibleBudgetError, match="already recomputes blocks"):
        autoremat.solve(g, "30%")


def test_a_model_without_its_own_checkpoint_records_none(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    with caplog.at_level(logging.WARNING, logger="autoremat"):
        g = autoremat.capture(_Net(False, own=False), (torch.randn(4, 32, 8),), times="flops")
    assert g.meta["recomputed_by_model"] == {} and "itself during backward" not in caplog.text
