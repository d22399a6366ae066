"""Module calls that draw from Python's ``random`` or numpy's global generator in forward are kept
from recomputation (:mod:`autoremat.capture.host_rng`): a recomputation replays torch's draws, not
these. Before: the least plan of the stack below recomputed its first block, whose replay drew
again, so both generators advanced twice per step and the outputs differed from the unpatched
model's from the second step on (module level; fx refuses such a forward)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import autoremat

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from semantics_cases import W, Case, _x, compare  # noqa: E402


class _HostDraws(nn.Module):
    def __init__(self, source: str) -> None:
        super().__init__()
        self.l, self.source = nn.Linear(W, W), source

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x + torch.tanh(self.l(x))
        if self.source == "random":
            scale = random.uniform(0.5, 1.5)
        elif self.source == "numpy":
            scale = 0.5 + float(np.random.rand())
        else:  # torch's generator: replayed, so recomputable
            scale = 0.5 + torch.rand(())
        return x + torch.tanh(self.l(x)) * scale


class _Stack(nn.Module):
    def __init__(self, source: str) -> None:
        super().__init__()
        self.b = nn.ModuleList(_HostDraws(source) for _ in range(4))
        self.head = nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.b:
            x = blk(x)
        return self.head(x)


def _reset() -> None:
    random.seed(3)
    np.random.seed(3)


@pytest.mark.parametrize("source", ["random", "numpy", "torch"])
def test_calls_drawing_from_host_generators_are_kept_and_the_model_trains_as_before(source: str) -> None:
    case = Case(f"host_rng_{source}", lambda: _Stack(source), lambda: (_x(8, W),), reset=_reset)
    assert compare(case, "module", "auto", "1%") is None
    _reset()
    graph = autoremat.capture(_Stack(source), (_x(8, W),), mode="module", repeats=1, warmup=0)
    pinned = graph.meta["pinned_by_host_rng"]
    if source == "torch":
        assert pinned == {}
    else:
        assert sorted(pinned) == [f"b.{i}" for i in range(4)]
        assert set(pinned.values()) == {"random" if source == "random" else "numpy.random"}
