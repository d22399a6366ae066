"""ResNet-50 and ResNet-152 (bottleneck residual networks).

Architecture: K. He, X. Zhang, S. Ren, J. Sun, "Deep Residual Learning for
Image Recognition", CVPR 2016 (arXiv:1512.03385), Table 1, 50- and 152-layer
columns. The stride of a down-sampling bottleneck sits on its 3x3 convolution
("ResNet v1.5", the layout of the common reference implementations); with
``width=1.0`` the parameter counts are 25,557,032 (ResNet-50) and 60,192,808
(ResNet-152).

The :class:`ResNet` class also supports dilated stages and a deep
(three 3x3 convolutions) stem, which :mod:`autoremat.zoo.pspnet` uses for its
dilated ResNet-50 backbone.

``inplace=True`` writes the network as torchvision does: one shared
``nn.ReLU(inplace=True)`` per block (called three times), ``out += identity``,
in-place stem ReLU. Same parameters (same names, same initialisation for a
given seed) and the same values as the default out-of-place form; it is the
test model of in-place support (issue 26, :mod:`autoremat.capture.inplace`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ._common import check_width, image_shape, scaled

__all__ = ["Bottleneck", "ResNet", "resnet50", "resnet152"]


class Bottleneck(nn.Module):
    """1x1 -> 3x3 -> 1x1 bottleneck block with an identity or projection shortcut."""

    expansion: int = 4

    def __init__(self, in_channels: int, planes: int, stride: int = 1, dilation: int = 1,
                 inplace: bool = False) -> None:
        super().__init__()
        self.in_place = inplace
        out_channels = planes * self.expansion
        self.conv1 = nn.Conv2d(in_channels, planes, kernel_size=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        if inplace:  # torchvision's layout: one in-place ReLU, called three times
            self.relu = nn.ReLU(inplace=True)
        else:
            self.relu1 = nn.ReLU(inplace=False)
        self.conv2 = nn.Conv2d(
            planes, planes, kernel_size=3, stride=stride, padding=dilation, dilation=dilation, bias=False
        )
        self.bn2 = nn.BatchNorm2d(planes)
        if not inplace:
            self.relu2 = nn.ReLU(inplace=False)
        self.conv3 = nn.Conv2d(planes, out_channels, kernel_size=1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        if not inplace:
            self.relu3 = nn.ReLU(inplace=False)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, kernel_size=1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.in_place:
            return self._forward_inplace(x)
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.relu2(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu3(out + identity)

    def _forward_inplace(self, x: torch.Tensor) -> torch.Tensor:
        """torchvision's ``Bottleneck.forward``."""
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    """Bottleneck ResNet for ImageNet-style classification.

    Args:
        layers: number of bottleneck blocks in each of the four stages.
        num_classes: size of the classifier output (``0`` drops the head and
            returns the last feature map; used by the PSPNet backbone).
        width: channel multiplier (``1.0`` is the published network).
        in_channels: input image channels.
        dilations: dilation of stages 2-4; a stage with dilation > 1 keeps
            stride 1 (dilated / atrous ResNet, as in PSPNet and DeepLab).
        deep_stem: replace the 7x7 stem convolution by three 3x3 convolutions
            (64, 64, 128 channels) as in the PSPNet backbone.
        inplace: in-place ReLUs and ``out += identity`` (torchvision's form;
            see the module docstring).
    """

    def __init__(
        self,
        layers: Sequence[int],
        num_classes: int = 1000,
        *,
        width: float = 1.0,
        in_channels: int = 3,
        dilations: Sequence[int] = (1, 1, 1),
        deep_stem: bool = False,
        inplace: bool = False,
    ) -> None:
        super().__init__()
        width = check_width(width)
        if len(layers) != 4 or len(dilations) != 3:
            raise ValueError("ResNet needs four stage depths and three stage dilations")
        self.stem: nn.Sequential
        if deep_stem:
            c1, c3 = scaled(64, width), scaled(128, width)
            self.stem = nn.Sequential(
                nn.Conv2d(in_channels, c1, kernel_size=3, stride=2, padding=1, bias=False),
                nn.BatchNorm2d(c1),
                nn.ReLU(inplace=False),
                nn.Conv2d(c1, c1, kernel_size=3, padding=1, bias=False),
                nn.BatchNorm2d(c1),
                nn.ReLU(inplace=False),
                nn.Conv2d(c1, c3, kernel_size=3, padding=1, bias=False),
                nn.BatchNorm2d(c3),
                nn.ReLU(inplace=False),
                nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
            )
            channels = c3
        else:
            c1 = scaled(64, width)
            self.stem = nn.Sequential(
                nn.Conv2d(in_channels, c1, kernel_size=7, stride=2, padding=3, bias=False),
                nn.BatchNorm2d(c1),
                nn.ReLU(inplace=inplace),
                nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
            )
            channels = c1
        strides = (1, 2, 2, 2)
        stage_dilations = (1, *dilations)
        stages: list[nn.Sequential] = []
        for i, (depth, stride, dilation) in enumerate(zip(layers, strides, stage_dilations)):
            planes = scaled(64 * 2**i, width)
            blocks: list[nn.Module] = []
            for j in range(depth):
                block_stride = stride if (j == 0 and dilation == 1) else 1
                blocks.append(Bottleneck(channels, planes, stride=block_stride, dilation=dilation, inplace=inplace))
                channels = planes * Bottleneck.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.out_channels: int = channels
        self.stage_channels: tuple[int, ...] = tuple(
            scaled(64 * 2**i, width) * Bottleneck.expansion for i in range(4)
        )
        self.head: nn.Module | None = None
        if num_classes > 0:
            self.head = nn.Sequential(
                nn.AdaptiveAvgPool2d((1, 1)),
                nn.Flatten(1),
                nn.Linear(channels, num_classes),
            )

    def forward_features(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the outputs of stage 3 and stage 4."""
        x = self.stem(x)
        x = self.layer1(x)
        x = self.layer2(x)
        c3 = self.layer3(x)
        c4 = self.layer4(c3)
        return c3, c4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = self.layer1(x)
        x = self.layer2(x)
        x = self.layer3(x)
        x = self.layer4(x)
        if self.head is not None:
            x = self.head(x)
        return x


def resnet50(
    *, width: float = 1.0, input_shape: tuple[int, ...] = (3, 224, 224), num_classes: int = 1000,
    inplace: bool = False,
) -> ResNet:
    """ResNet-50 (He et al. 2016): bottleneck stages of 3, 4, 6, 3 blocks;
    ``inplace=True``: torchvision's in-place form (see the module docstring)."""
    return _bottleneck_resnet("resnet50", (3, 4, 6, 3), width, input_shape, num_classes, inplace)


def resnet152(
    *, width: float = 1.0, input_shape: tuple[int, ...] = (3, 224, 224), num_classes: int = 1000,
    inplace: bool = False,
) -> ResNet:
    """ResNet-152 (He et al. 2016): bottleneck stages of 3, 8, 36, 3 blocks;
    ``inplace=True``: torchvision's in-place form (see the module docstring)."""
    return _bottleneck_resnet("resnet152", (3, 8, 36, 3), width, input_shape, num_classes, inplace)


def _bottleneck_resnet(name: str, stages: tuple[int, ...], width: float, input_shape: tuple[int, ...],
                       num_classes: int, inplace: bool) -> ResNet:
    c, _, _ = image_shape(input_shape, name)
    return ResNet(stages, num_classes, width=width, in_channels=c, inplace=inplace)
