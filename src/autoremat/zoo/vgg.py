"""VGG-19 (configuration "E", without batch normalisation).

Architecture: K. Simonyan, A. Zisserman, "Very Deep Convolutional Networks for
Large-Scale Image Recognition", ICLR 2015 (arXiv:1409.1556), Table 1 column E:
sixteen 3x3 convolutions in five blocks separated by 2x2 max-pooling, then
three fully connected layers (4096, 4096, classes) with dropout 0.5. As in the
common reference implementation an adaptive average pool to 7x7 sits before
the classifier, so smaller inputs keep the classifier shape. With
``width=1.0`` the network has 143,667,240 parameters.
"""

from __future__ import annotations

import torch
from torch import nn

from ._common import check_width, image_shape, scaled

__all__ = ["VGG", "VGG19_CONFIG", "vgg19"]

#: Convolution widths of VGG configuration E; ``"M"`` is a 2x2 max-pool.
VGG19_CONFIG: tuple[int | str, ...] = (
    64, 64, "M",
    128, 128, "M",
    256, 256, 256, 256, "M",
    512, 512, 512, 512, "M",
    512, 512, 512, 512, "M",
)  # fmt: skip


class VGG(nn.Module):
    """Plain VGG network (no batch norm) built from a layer configuration."""

    def __init__(
        self,
        config: tuple[int | str, ...] = VGG19_CONFIG,
        num_classes: int = 1000,
        *,
        width: float = 1.0,
        in_channels: int = 3,
        dropout: float = 0.5,
    ) -> None:
        super().__init__()
        width = check_width(width)
        layers: list[nn.Module] = []
        channels = in_channels
        for item in config:
            if item == "M":
                layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
            else:
                out = scaled(int(item), width)
                layers.append(nn.Conv2d(channels, out, kernel_size=3, padding=1))
                layers.append(nn.ReLU(inplace=False))
                channels = out
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        hidden = scaled(4096, width)
        self.classifier = nn.Sequential(
            nn.Linear(channels * 7 * 7, hidden),
            nn.ReLU(inplace=False),
            nn.Dropout(dropout),
            nn.Linear(hidden, hidden),
            nn.ReLU(inplace=False),
            nn.Dropout(dropout),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        return self.classifier(x)


def vgg19(*, width: float = 1.0, input_shape: tuple[int, ...] = (3, 224, 224), num_classes: int = 1000) -> VGG:
    """VGG-19 (Simonyan & Zisserman 2015, configuration E)."""
    c, h, w = image_shape(input_shape, "vgg19")
    if h < 32 or w < 32:
        raise ValueError(f"vgg19 needs inputs of at least 32x32 (five 2x2 poolings), got {h}x{w}")
    return VGG(VGG19_CONFIG, num_classes, width=width, in_channels=c)
