"""U-Net for biomedical image segmentation.

Architecture: O. Ronneberger, P. Fischer, T. Brox, "U-Net: Convolutional
Networks for Biomedical Image Segmentation", MICCAI 2015 (arXiv:1505.04597),
Figure 1: a contracting path of four levels of two unpadded 3x3 convolutions
+ ReLU followed by 2x2 max-pooling (64, 128, 256, 512 channels), a 1024-channel
bottom level, and an expanding path of 2x2 up-convolutions that halve the
channels, concatenation with the centre-cropped contracting feature map, two
3x3 convolutions + ReLU, and a final 1x1 convolution to the class map.

Faithful by default: the convolutions are *unpadded* ("valid"), so a
572x572 single-channel tile gives a 388x388 two-class output map, and the
skip connections are centre-cropped. The crop offsets are computed when the
network is built from its ``input_size`` (only sizes ``16 * k + 124`` are
valid, e.g. 188, 204, 572), so the forward has no shape-dependent Python
code and the crops are constant slices in a traced graph. ``padding=True``
switches to padded ("same") convolutions, a common variant, where the output
has the input's size (which must then be a multiple of 16) and no cropping is
needed. As in the authors' Caffe model, dropout (p=0.5) follows the last two
levels of the contracting path. There is no batch normalisation (none in the
paper). At ``width=1.0`` the network has 31,030,658 parameters (1 input
channel, 2 classes).
"""

from __future__ import annotations

import torch
from torch import nn

from ._common import check_width, image_shape, scaled

__all__ = ["UNet", "unet", "unet_output_size", "unet_valid_input_sizes"]

_LEVEL_CHANNELS: tuple[int, ...] = (64, 128, 256, 512, 1024)


class _DoubleConv(nn.Sequential):
    def __init__(self, in_channels: int, out_channels: int, padding: int) -> None:
        super().__init__(
            nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=padding),
            nn.ReLU(inplace=False),
            nn.Conv2d(out_channels, out_channels, kernel_size=3, padding=padding),
            nn.ReLU(inplace=False),
        )


def _plan(input_size: int, padding: bool) -> tuple[list[int], list[int], int]:
    """Return (skip sizes, upsampled sizes, output size) or raise ValueError."""
    shrink = 0 if padding else 4
    size = input_size
    skips: list[int] = []
    for _ in range(4):
        size -= shrink
        if size <= 0 or size % 2 != 0:
            raise _bad_size(input_size, padding)
        skips.append(size)
        size //= 2
    size -= shrink
    if size <= 0:
        raise _bad_size(input_size, padding)
    ups: list[int] = []
    for _ in range(4):
        size *= 2
        ups.append(size)
        size -= shrink
        if size <= 0:
            raise _bad_size(input_size, padding)
    return skips, ups, size


def _bad_size(input_size: int, padding: bool) -> ValueError:
    if padding:
        return ValueError(f"padded U-Net needs an input size that is a positive multiple of 16, got {input_size}")
    return ValueError(
        f"unpadded U-Net needs an input size of the form 16*k + 124 (k >= 4), e.g. "
        f"{unet_valid_input_sizes(188, 620)}, got {input_size}"
    )


def unet_valid_input_sizes(lo: int, hi: int) -> list[int]:
    """Input sizes in ``[lo, hi]`` accepted by the unpadded U-Net."""
    return [n for n in range(lo, hi + 1) if n >= 188 and (n - 124) % 16 == 0]


def unet_output_size(input_size: int, padding: bool = False) -> int:
    """Side length of the output map for a square input tile (572 -> 388)."""
    return _plan(input_size, padding)[2]


class UNet(nn.Module):
    """U-Net (Ronneberger et al. 2015).

    Args:
        in_channels: input image channels (1 in the paper).
        num_classes: output channels of the final 1x1 convolution (2 in the paper).
        width: channel multiplier (``1.0`` gives 64 ... 1024 channels).
        input_size: side length (or ``(H, W)``) of the input tile the network is
            built for; fixes the crop offsets of the skip connections.
        padding: use padded 3x3 convolutions (output size = input size).
        dropout: dropout probability after the last two contracting levels.
    """

    def __init__(
        self,
        in_channels: int = 1,
        num_classes: int = 2,
        *,
        width: float = 1.0,
        input_size: int | tuple[int, int] = 572,
        padding: bool = False,
        dropout: float = 0.5,
    ) -> None:
        super().__init__()
        width = check_width(width)
        h, w = (input_size, input_size) if isinstance(input_size, int) else input_size
        skips_h, ups_h, out_h = _plan(h, padding)
        skips_w, ups_w, out_w = _plan(w, padding)
        self.output_size: tuple[int, int] = (out_h, out_w)
        # Crop windows (top, left, height, width) of the skip maps, from the deepest level up.
        self._crops: list[tuple[int, int, int, int]] = [
            ((sh - uh) // 2, (sw - uw) // 2, uh, uw)
            for sh, uh, sw, uw in zip(reversed(skips_h), ups_h, reversed(skips_w), ups_w)
        ]
        chans = [scaled(c, width) for c in _LEVEL_CHANNELS]
        pad = 1 if padding else 0
        self.down1 = _DoubleConv(in_channels, chans[0], pad)
        self.pool1 = nn.MaxPool2d(2)
        self.down2 = _DoubleConv(chans[0], chans[1], pad)
        self.pool2 = nn.MaxPool2d(2)
        self.down3 = _DoubleConv(chans[1], chans[2], pad)
        self.pool3 = nn.MaxPool2d(2)
        self.down4 = _DoubleConv(chans[2], chans[3], pad)
        self.drop4 = nn.Dropout(dropout)
        self.pool4 = nn.MaxPool2d(2)
        self.bottom = _DoubleConv(chans[3], chans[4], pad)
        self.drop5 = nn.Dropout(dropout)
        self.upconv4 = nn.ConvTranspose2d(chans[4], chans[3], kernel_size=2, stride=2)
        self.up4 = _DoubleConv(2 * chans[3], chans[3], pad)
        self.upconv3 = nn.ConvTranspose2d(chans[3], chans[2], kernel_size=2, stride=2)
        self.up3 = _DoubleConv(2 * chans[2], chans[2], pad)
        self.upconv2 = nn.ConvTranspose2d(chans[2], chans[1], kernel_size=2, stride=2)
        self.up2 = _DoubleConv(2 * chans[1], chans[1], pad)
        self.upconv1 = nn.ConvTranspose2d(chans[1], chans[0], kernel_size=2, stride=2)
        self.up1 = _DoubleConv(2 * chans[0], chans[0], pad)
        self.head = nn.Conv2d(chans[0], num_classes, kernel_size=1)

    def _merge(self, skip: torch.Tensor, up: torch.Tensor, level: int) -> torch.Tensor:
        top, left, height, width = self._crops[level]
        if top != 0 or left != 0:
            skip = skip[:, :, top : top + height, left : left + width]
        return torch.cat([skip, up], 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s1 = self.down1(x)
        s2 = self.down2(self.pool1(s1))
        s3 = self.down3(self.pool2(s2))
        s4 = self.drop4(self.down4(self.pool3(s3)))
        b = self.drop5(self.bottom(self.pool4(s4)))
        x = self.up4(self._merge(s4, self.upconv4(b), 0))
        x = self.up3(self._merge(s3, self.upconv3(x), 1))
        x = self.up2(self._merge(s2, self.upconv2(x), 2))
        x = self.up1(self._merge(s1, self.upconv1(x), 3))
        return self.head(x)


def unet(*, width: float = 1.0, input_shape: tuple[int, ...] = (1, 572, 572), num_classes: int = 2) -> UNet:
    """U-Net (Ronneberger et al. 2015), unpadded convolutions, built for ``input_shape``."""
    c, h, w = image_shape(input_shape, "unet")
    return UNet(c, num_classes, width=width, input_size=(h, w))
