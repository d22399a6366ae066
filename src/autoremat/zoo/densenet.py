"""DenseNet-121, DenseNet-161 and DenseNet-201 (DenseNet-BC).

Architecture: G. Huang, Z. Liu, L. van der Maaten, K. Q. Weinberger, "Densely
Connected Convolutional Networks", CVPR 2017 (arXiv:1608.06993), Table 1:
four dense blocks of BN-ReLU-Conv1x1 (4k channels) - BN-ReLU-Conv3x3 (k
channels) layers joined by transition layers with compression 0.5.

Each dense layer concatenates *all* earlier feature maps of its block with
``torch.cat`` (the straightforward, memory-hungry formulation whose
activation memory grows quadratically with block depth; this is the case
that the memory-efficient DenseNet work and recomputation papers target).

Parameter counts with ``width=1.0``: DenseNet-121 7,978,856,
DenseNet-161 28,681,000, DenseNet-201 20,013,928.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ._common import check_width, image_shape, scaled

__all__ = ["DenseBlock", "DenseLayer", "DenseNet", "Transition", "densenet121", "densenet161", "densenet201"]


class DenseLayer(nn.Module):
    """Bottleneck dense layer: BN-ReLU-Conv1x1 then BN-ReLU-Conv3x3."""

    def __init__(self, in_channels: int, growth_rate: int, bn_size: int) -> None:
        super().__init__()
        inner = bn_size * growth_rate
        self.norm1 = nn.BatchNorm2d(in_channels)
        self.relu1 = nn.ReLU(inplace=False)
        self.conv1 = nn.Conv2d(in_channels, inner, kernel_size=1, bias=False)
        self.norm2 = nn.BatchNorm2d(inner)
        self.relu2 = nn.ReLU(inplace=False)
        self.conv2 = nn.Conv2d(inner, growth_rate, kernel_size=3, padding=1, bias=False)

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        x = torch.cat(features, 1)
        x = self.conv1(self.relu1(self.norm1(x)))
        return self.conv2(self.relu2(self.norm2(x)))


class DenseBlock(nn.Module):
    """``num_layers`` dense layers; every layer sees all earlier outputs."""

    def __init__(self, num_layers: int, in_channels: int, growth_rate: int, bn_size: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            DenseLayer(in_channels + i * growth_rate, growth_rate, bn_size) for i in range(num_layers)
        )
        self.out_channels: int = in_channels + num_layers * growth_rate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [x]
        for layer in self.layers:
            features.append(layer(features))
        return torch.cat(features, 1)


class Transition(nn.Sequential):
    """BN-ReLU-Conv1x1-AvgPool2x2 between dense blocks."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__(
            nn.BatchNorm2d(in_channels),
            nn.ReLU(inplace=False),
            nn.Conv2d(in_channels, out_channels, kernel_size=1, bias=False),
            nn.AvgPool2d(kernel_size=2, stride=2),
        )


class DenseNet(nn.Module):
    """DenseNet-BC for ImageNet-style classification.

    Args:
        growth_rate: channels added by every dense layer (k).
        block_config: number of dense layers in each of the four blocks.
        num_init_features: channels of the 7x7 stem convolution.
        bn_size: bottleneck multiplier (the 1x1 convolution has
            ``bn_size * growth_rate`` channels).
        num_classes: classifier outputs.
        width: multiplier applied to ``growth_rate`` and ``num_init_features``.
        in_channels: input image channels.
    """

    def __init__(
        self,
        growth_rate: int = 32,
        block_config: Sequence[int] = (6, 12, 24, 16),
        num_init_features: int = 64,
        bn_size: int = 4,
        num_classes: int = 1000,
        *,
        width: float = 1.0,
        in_channels: int = 3,
    ) -> None:
        super().__init__()
        width = check_width(width)
        growth = scaled(growth_rate, width)
        channels = scaled(num_init_features, width)
        layers: list[nn.Module] = [
            nn.Conv2d(in_channels, channels, kernel_size=7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(channels),
            nn.ReLU(inplace=False),
            nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
        ]
        for i, num_layers in enumerate(block_config):
            block = DenseBlock(num_layers, channels, growth, bn_size)
            layers.append(block)
            channels = block.out_channels
            if i != len(block_config) - 1:
                layers.append(Transition(channels, channels // 2))
                channels = channels // 2
        layers.append(nn.BatchNorm2d(channels))
        layers.append(nn.ReLU(inplace=False))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.classifier = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        return self.classifier(x)


def densenet121(
    *, width: float = 1.0, input_shape: tuple[int, ...] = (3, 224, 224), num_classes: int = 1000
) -> DenseNet:
    """DenseNet-121 (k=32, blocks 6-12-24-16)."""
    c, _, _ = image_shape(input_shape, "densenet121")
    return DenseNet(32, (6, 12, 24, 16), 64, num_classes=num_classes, width=width, in_channels=c)


def densenet161(
    *, width: float = 1.0, input_shape: tuple[int, ...] = (3, 224, 224), num_classes: int = 1000
) -> DenseNet:
    """DenseNet-161 (k=48, blocks 6-12-36-24, 96 stem channels)."""
    c, _, _ = image_shape(input_shape, "densenet161")
    return DenseNet(48, (6, 12, 36, 24), 96, num_classes=num_classes, width=width, in_channels=c)


def densenet201(
    *, width: float = 1.0, input_shape: tuple[int, ...] = (3, 224, 224), num_classes: int = 1000
) -> DenseNet:
    """DenseNet-201 (k=32, blocks 6-12-48-32)."""
    c, _, _ = image_shape(input_shape, "densenet201")
    return DenseNet(32, (6, 12, 48, 32), 64, num_classes=num_classes, width=width, in_channels=c)
