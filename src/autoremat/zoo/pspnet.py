"""PSPNet: dilated ResNet-50 + pyramid pooling module.

Architecture: H. Zhao, J. Shi, X. Qi, X. Wang, J. Jia, "Pyramid Scene Parsing
Network", CVPR 2017 (arXiv:1612.01105), Figure 3, in the layout of the
authors' reference implementation: a ResNet-50 backbone with the deep stem
(three 3x3 convolutions: 64, 64, 128 channels) whose last two stages are
dilated (dilation 2 and 4, stride 1) so the feature map has stride 8
(713x713 -> 90x90), a pyramid pooling module with bins 1, 2, 3, 6 (each
adaptive average pool -> 1x1 conv to 2048/4 = 512 channels -> BN -> ReLU ->
bilinear upsampling back to the feature size), concatenation with the
backbone features (4096 channels), a 3x3 conv to 512 channels + BN + ReLU +
dropout 0.1, a 1x1 classifier and bilinear upsampling to the input size.

The auxiliary (deep supervision) head on stage 3 is optional
(``aux=True`` makes the forward return ``(logits, aux_logits)``). All
interpolation sizes are fixed when the network is built from its input size,
so the graph traces without shape arithmetic. 19 classes (Cityscapes, the
dataset PSPNet used with 713x713 crops) by default.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ._common import check_width, image_shape, scaled
from .resnet import ResNet

__all__ = ["PSPNet", "PyramidPooling", "pspnet", "pspnet_feature_size"]


def _down(size: int) -> int:
    """Output size of a stride-2 layer with kernel 3 and padding 1."""
    return (size - 1) // 2 + 1


def pspnet_feature_size(input_size: int) -> int:
    """Side of the stride-8 backbone feature map (713 -> 90)."""
    return _down(_down(_down(input_size)))


class _PoolBranch(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, bin_size: int, feature_size: tuple[int, int]) -> None:
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(bin_size)
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size=1, bias=False)
        self.bn = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=False)
        self.feature_size = feature_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn(self.conv(self.pool(x))))
        return F.interpolate(x, size=self.feature_size, mode="bilinear", align_corners=True)


class PyramidPooling(nn.Module):
    """Pyramid pooling module; output has ``2 * in_channels`` channels for four bins."""

    def __init__(self, in_channels: int, bins: Sequence[int], feature_size: tuple[int, int]) -> None:
        super().__init__()
        reduction = in_channels // len(bins)
        self.branches = nn.ModuleList(_PoolBranch(in_channels, reduction, b, feature_size) for b in bins)
        self.out_channels: int = in_channels + reduction * len(bins)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, *(branch(x) for branch in self.branches)], 1)


class PSPNet(nn.Module):
    """PSPNet with a dilated ResNet-50 backbone (Zhao et al. 2017).

    Args:
        num_classes: classes of the per-pixel output map.
        width: channel multiplier for backbone and heads.
        in_channels: input image channels.
        input_size: input side length (or ``(H, W)``) the network is built
            for; fixes the interpolation sizes. The stride-8 feature map must
            be at least as large as the largest bin (6), i.e. input >= 41.
        bins: pyramid pooling bin sizes.
        aux: add the auxiliary head on stage 3 (forward returns a pair).
        dropout: dropout before the classifiers.
    """

    def __init__(
        self,
        num_classes: int = 19,
        *,
        width: float = 1.0,
        in_channels: int = 3,
        input_size: int | tuple[int, int] = 713,
        bins: Sequence[int] = (1, 2, 3, 6),
        aux: bool = False,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        width = check_width(width)
        h, w = (input_size, input_size) if isinstance(input_size, int) else input_size
        feature_size = (pspnet_feature_size(h), pspnet_feature_size(w))
        if min(feature_size) < max(bins):
            raise ValueError(
                f"PSPNet input {h}x{w} gives a {feature_size[0]}x{feature_size[1]} feature map, "
                f"smaller than the largest pyramid bin {max(bins)}"
            )
        self.input_size: tuple[int, int] = (h, w)
        self.backbone = ResNet(
            (3, 4, 6, 3), num_classes=0, width=width, in_channels=in_channels, dilations=(1, 2, 4), deep_stem=True
        )
        self.ppm = PyramidPooling(self.backbone.out_channels, bins, feature_size)
        mid = scaled(512, width)
        self.cls = nn.Sequential(
            nn.Conv2d(self.ppm.out_channels, mid, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(mid),
            nn.ReLU(inplace=False),
            nn.Dropout2d(dropout),
            nn.Conv2d(mid, num_classes, kernel_size=1),
        )
        self.aux: nn.Sequential | None = None
        if aux:
            aux_mid = scaled(256, width)
            self.aux = nn.Sequential(
                nn.Conv2d(self.backbone.stage_channels[2], aux_mid, kernel_size=3, padding=1, bias=False),
                nn.BatchNorm2d(aux_mid),
                nn.ReLU(inplace=False),
                nn.Dropout2d(dropout),
                nn.Conv2d(aux_mid, num_classes, kernel_size=1),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        c3, c4 = self.backbone.forward_features(x)
        out = self.cls(self.ppm(c4))
        out = F.interpolate(out, size=self.input_size, mode="bilinear", align_corners=True)
        if self.aux is not None:
            a = F.interpolate(self.aux(c3), size=self.input_size, mode="bilinear", align_corners=True)
            return out, a
        return out


def pspnet(*, width: float = 1.0, input_shape: tuple[int, ...] = (3, 713, 713), num_classes: int = 19) -> PSPNet:
    """PSPNet-50 (Zhao et al. 2017) built for ``input_shape``, without the auxiliary head."""
    c, h, w = image_shape(input_shape, "pspnet")
    return PSPNet(num_classes, width=width, in_channels=c, input_size=(h, w))
