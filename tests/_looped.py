"""A model running one block more than once per step (weights shared), shared by the per-call
tests (``tests/runtime/test_per_call.py``, ``test_offload_per_call.py``, the blocks solver's)."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["looped_model", "looped_batch", "looped_loss"]


class _Block(nn.Module):
    def __init__(self, width: int, norm: bool) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.norm = nn.BatchNorm1d(2 * width) if norm else nn.LayerNorm(2 * width)
        self.act = nn.GELU()
        self.drop = nn.Dropout(0.25)
        self.down = nn.Linear(2 * width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(self.drop(self.act(self.norm(self.up(h)))))


class _Looped(nn.Module):
    """One block run ``steps`` times per forward (weights shared): ``shape="block"`` as a member
    of a ``ModuleList`` (captured op by op, a call region per call, as ALBERT's layer group),
    ``"leaf"`` as a ``Sequential`` of leaf modules (each leaf one node per call)."""

    def __init__(self, shape: str, norm: bool = False, steps: int = 4, width: int = 32) -> None:
        super().__init__()
        self.inp = nn.Linear(16, width)
        block = _Block(width, norm)
        self.layers = nn.ModuleList([block]) if shape == "block" else None
        self.seq = nn.Sequential(block.up, block.norm, block.act, block.drop, block.down) if shape == "leaf" else None
        self.head = nn.Linear(width, 4)
        self.steps = steps

    def forward(self, x: torch.Tensor, steps: int | None = None) -> torch.Tensor:
        h = self.inp(x)
        for _ in range(self.steps if steps is None else steps):
            h = h + self.layers[0](h) if self.seq is None else h + self.seq(h)
        return self.head(h)


def looped_loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def looped_batch() -> torch.Tensor:
    return torch.randn(64, 16, generator=torch.Generator().manual_seed(1))


def looped_model(shape: str, norm: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return _Looped(shape, norm).train()
