"""A network with an encoder no gradient reaches (its output only picks integer codes, as the Hugging
Face ``EncodecModel``'s does): the capture tests of :mod:`autoremat.capture.dead_nodes` and the
solver tests of :mod:`autoremat.solvers.unreached_regions`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(c, c, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(F.elu(x))


class Codec(nn.Module):
    """Encoder blocks, codes by the nearest codebook row (``argmin``), decoder blocks on the codes."""

    def __init__(self, c: int = 16, n: int = 3) -> None:
        super().__init__()
        self.inp = nn.Conv1d(1, c, 3, padding=1)
        self.encoder = nn.ModuleList(Block(c) for _ in range(n))
        self.register_buffer("codebook", torch.randn(32, c))
        self.decoder = nn.ModuleList(Block(c) for _ in range(n))
        self.out = nn.Conv1d(c, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(x))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.encoder:
            h = block(h)
        return h

    def decode(self, h: torch.Tensor) -> torch.Tensor:
        z = h.transpose(1, 2)
        dist = z.pow(2).sum(-1, keepdim=True) - 2 * z @ self.codebook.t() + self.codebook.pow(2).sum(-1)
        q = F.embedding(dist.argmin(-1), self.codebook).transpose(1, 2)
        for block in self.decoder:
            q = block(q)
        return self.out(q)
