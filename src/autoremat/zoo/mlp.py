"""Deep multilayer perceptron: a linear chain with configurable depth and width.

A stack of fully connected layers with ReLU, the classic multilayer perceptron
(D. E. Rumelhart, G. E. Hinton, R. J. Williams, "Learning representations by
back-propagating errors", Nature 1986). Its computation graph is a pure path,
the setting of the sqrt(n) checkpointing analysis of T. Chen, B. Xu, C. Zhang,
C. Guestrin, "Training Deep Nets with Sublinear Memory Cost", 2016
(arXiv:1604.06174), which makes it the simplest test case for a
recomputation planner.

Paper size (our choice, no reference network): 1024 inputs, 24 hidden layers
of 2048 units, 1000 outputs (about 100M parameters), batch 512.
"""

from __future__ import annotations

import torch
from torch import nn

from ._common import check_width, scaled

__all__ = ["MLP", "mlp"]


class MLP(nn.Module):
    """``depth`` hidden Linear+ReLU layers followed by a linear output layer.

    Args:
        in_features: input features.
        hidden: hidden width (before ``width`` scaling).
        depth: number of hidden layers (each Linear + ReLU).
        num_classes: output features.
        width: multiplier for ``hidden``.
        dropout: if positive, a Dropout layer follows every hidden ReLU.
    """

    def __init__(
        self,
        in_features: int = 1024,
        hidden: int = 2048,
        depth: int = 24,
        num_classes: int = 1000,
        *,
        width: float = 1.0,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        width = check_width(width)
        if depth < 1:
            raise ValueError(f"MLP depth must be >= 1, got {depth}")
        h = scaled(hidden, width)
        layers: list[nn.Module] = []
        features = in_features
        for _ in range(depth):
            layers.append(nn.Linear(features, h))
            layers.append(nn.ReLU(inplace=False))
            if dropout > 0.0:
                layers.append(nn.Dropout(dropout))
            features = h
        layers.append(nn.Linear(features, num_classes))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def mlp(*, width: float = 1.0, input_shape: tuple[int, ...] = (1024,), num_classes: int = 1000) -> MLP:
    """Deep MLP (24 hidden layers of 2048 units at ``width=1.0``) for ``(N, in_features)`` inputs."""
    if len(input_shape) != 1 or int(input_shape[0]) <= 0:
        raise ValueError(f"mlp expects an input shape (features,), got {input_shape!r}")
    return MLP(int(input_shape[0]), 2048, 24, num_classes, width=width)
