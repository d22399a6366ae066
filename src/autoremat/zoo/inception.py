"""GoogLeNet (Inception v1) and Inception-v3.

GoogLeNet: C. Szegedy et al., "Going Deeper with Convolutions", CVPR 2015
(arXiv:1409.4842), Table 1: 7x7/2 stem, nine inception modules (3a-5b) with
1x1, 3x3, 5x5 and pool-projection branches, global average pooling,
dropout 0.4 and a linear classifier. Two deviations, both documented here:
every convolution is followed by batch normalisation (the usual modern
"BN-GoogLeNet" form; it replaces the two local response normalisation
layers), and the auxiliary classifiers are optional (``aux_logits=False`` by
default). ``googlenet_original`` (``batch_norm=False``) is the published form,
without batch normalisation and with the two LRN layers: the graph Kusumoto et
al. benchmark (Chainer's GoogLeNet; 134 nodes in their count, 142 at autoremat's
fx level, 197 for the BN variant). Unlike the torchvision port, the 5x5 branch really uses a 5x5
kernel, so at ``width=1.0`` (no aux heads) the network has 7,005,832
parameters where torchvision's version (3x3 kernels in that branch) has
6,624,904.

Inception-v3: C. Szegedy, V. Vanhoucke, S. Ioffe, J. Shlens, Z. Wojna,
"Rethinking the Inception Architecture for Computer Vision", CVPR 2016
(arXiv:1512.00567), Table 1 / Figures 5-7, in the layout of the reference
implementation (Mixed_5b ... Mixed_7c). 299x299 input; 23,834,568 parameters
without and 27,161,264 with the auxiliary classifier at ``width=1.0``. The
auxiliary head pools with ``AdaptiveAvgPool2d(5)`` instead of a fixed 5x5/3
average pool so it also works at small resolutions (identical shapes and
parameter count at 299x299).

All convolutions are conv(no bias) + BatchNorm(eps=1e-3) + ReLU.
"""

from __future__ import annotations

import torch
from torch import nn

from ._common import check_width, image_shape, scaled

__all__ = ["BasicConv2d", "GoogLeNet", "InceptionV3", "googlenet", "googlenet_original", "inception_v3"]

_IntPair = int | tuple[int, int]


class BasicConv2d(nn.Module):
    """Convolution (no bias) + BatchNorm + ReLU; with ``batch_norm=False``, convolution (with
    bias) + ReLU."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: _IntPair,
        stride: _IntPair = 1,
        padding: _IntPair = 0,
        batch_norm: bool = True,
    ) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, stride=stride, padding=padding,
                              bias=not batch_norm)
        self.bn = nn.BatchNorm2d(out_channels, eps=0.001) if batch_norm else None
        self.relu = nn.ReLU(inplace=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        if self.bn is not None:
            x = self.bn(x)
        return self.relu(x)


# --------------------------------------------------------------------------- GoogLeNet


class InceptionV1Block(nn.Module):
    """GoogLeNet inception module: 1x1 | 1x1-3x3 | 1x1-5x5 | maxpool-1x1."""

    def __init__(
        self, in_channels: int, ch1x1: int, ch3x3red: int, ch3x3: int, ch5x5red: int, ch5x5: int, pool_proj: int,
        batch_norm: bool = True,
    ) -> None:
        super().__init__()
        bn = batch_norm
        self.branch1 = BasicConv2d(in_channels, ch1x1, 1, batch_norm=bn)
        self.branch2 = nn.Sequential(BasicConv2d(in_channels, ch3x3red, 1, batch_norm=bn),
                                     BasicConv2d(ch3x3red, ch3x3, 3, padding=1, batch_norm=bn))
        self.branch3 = nn.Sequential(BasicConv2d(in_channels, ch5x5red, 1, batch_norm=bn),
                                     BasicConv2d(ch5x5red, ch5x5, 5, padding=2, batch_norm=bn))
        self.branch4 = nn.Sequential(
            nn.MaxPool2d(kernel_size=3, stride=1, padding=1, ceil_mode=True),
            BasicConv2d(in_channels, pool_proj, 1, batch_norm=bn),
        )
        self.out_channels: int = ch1x1 + ch3x3 + ch5x5 + pool_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.branch1(x), self.branch2(x), self.branch3(x), self.branch4(x)], 1)


class GoogLeNetAux(nn.Module):
    """Auxiliary classifier of GoogLeNet (after 4a and 4d)."""

    def __init__(self, in_channels: int, num_classes: int, width: float, batch_norm: bool = True) -> None:
        super().__init__()
        c = scaled(128, width)
        hidden = scaled(1024, width)
        self.pool = nn.AdaptiveAvgPool2d((4, 4))
        self.conv = BasicConv2d(in_channels, c, 1, batch_norm=batch_norm)
        self.fc1 = nn.Linear(c * 16, hidden)
        self.relu = nn.ReLU(inplace=False)
        self.dropout = nn.Dropout(0.7)
        self.fc2 = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(self.pool(x))
        x = torch.flatten(x, 1)
        return self.fc2(self.dropout(self.relu(self.fc1(x))))


#: (in, 1x1, 3x3 reduce, 3x3, 5x5 reduce, 5x5, pool proj) of GoogLeNet Table 1; in is implied.
_GOOGLENET_BLOCKS: dict[str, tuple[int, int, int, int, int, int]] = {
    "inception3a": (64, 96, 128, 16, 32, 32),
    "inception3b": (128, 128, 192, 32, 96, 64),
    "inception4a": (192, 96, 208, 16, 48, 64),
    "inception4b": (160, 112, 224, 24, 64, 64),
    "inception4c": (128, 128, 256, 24, 64, 64),
    "inception4d": (112, 144, 288, 32, 64, 64),
    "inception4e": (256, 160, 320, 32, 128, 128),
    "inception5a": (256, 160, 320, 32, 128, 128),
    "inception5b": (384, 192, 384, 48, 128, 128),
}


class GoogLeNet(nn.Module):
    """GoogLeNet / Inception v1 (Szegedy et al. 2015): the BN variant, or (``batch_norm=False``)
    the published one, with its two local response normalisations.

    With ``aux_logits=True`` the forward returns ``(logits, aux1, aux2)``.
    """

    def __init__(
        self,
        num_classes: int = 1000,
        *,
        width: float = 1.0,
        in_channels: int = 3,
        aux_logits: bool = False,
        dropout: float = 0.4,
        batch_norm: bool = True,
    ) -> None:
        super().__init__()
        width = check_width(width)
        bn = batch_norm
        c64, c192 = scaled(64, width), scaled(192, width)
        self.conv1 = BasicConv2d(in_channels, c64, 7, stride=2, padding=3, batch_norm=bn)
        self.maxpool1 = nn.MaxPool2d(3, stride=2, ceil_mode=True)
        # the paper's LRN (size 5, alpha 1e-4, beta 0.75, as in the Caffe / Chainer models)
        self.lrn1 = None if bn else nn.LocalResponseNorm(5, alpha=1e-4, beta=0.75)
        self.conv2 = BasicConv2d(c64, c64, 1, batch_norm=bn)
        self.conv3 = BasicConv2d(c64, c192, 3, padding=1, batch_norm=bn)
        self.lrn2 = None if bn else nn.LocalResponseNorm(5, alpha=1e-4, beta=0.75)
        self.maxpool2 = nn.MaxPool2d(3, stride=2, ceil_mode=True)
        channels = c192
        blocks: dict[str, InceptionV1Block] = {}
        for name, cfg in _GOOGLENET_BLOCKS.items():
            block = InceptionV1Block(channels, *(scaled(c, width) for c in cfg), batch_norm=bn)
            blocks[name] = block
            channels = block.out_channels
        self.inception3a = blocks["inception3a"]
        self.inception3b = blocks["inception3b"]
        self.maxpool3 = nn.MaxPool2d(3, stride=2, ceil_mode=True)
        self.inception4a = blocks["inception4a"]
        self.inception4b = blocks["inception4b"]
        self.inception4c = blocks["inception4c"]
        self.inception4d = blocks["inception4d"]
        self.inception4e = blocks["inception4e"]
        self.maxpool4 = nn.MaxPool2d(2, stride=2, ceil_mode=True)
        self.inception5a = blocks["inception5a"]
        self.inception5b = blocks["inception5b"]
        self.aux1: GoogLeNetAux | None = None
        self.aux2: GoogLeNetAux | None = None
        if aux_logits:
            self.aux1 = GoogLeNetAux(self.inception4a.out_channels, num_classes, width, batch_norm=bn)
            self.aux2 = GoogLeNetAux(self.inception4d.out_channels, num_classes, width, batch_norm=bn)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = self.maxpool1(self.conv1(x))
        if self.lrn1 is not None:
            x = self.lrn1(x)
        x = self.conv3(self.conv2(x))
        if self.lrn2 is not None:
            x = self.lrn2(x)
        x = self.maxpool2(x)
        x = self.maxpool3(self.inception3b(self.inception3a(x)))
        x = self.inception4a(x)
        a1 = self.aux1(x) if self.aux1 is not None else None
        x = self.inception4d(self.inception4c(self.inception4b(x)))
        a2 = self.aux2(x) if self.aux2 is not None else None
        x = self.maxpool4(self.inception4e(x))
        x = self.inception5b(self.inception5a(x))
        x = torch.flatten(self.avgpool(x), 1)
        x = self.fc(self.dropout(x))
        if a1 is not None and a2 is not None:
            return x, a1, a2
        return x


def googlenet(
    *, width: float = 1.0, input_shape: tuple[int, ...] = (3, 224, 224), num_classes: int = 1000
) -> GoogLeNet:
    """GoogLeNet (Szegedy et al. 2015) without auxiliary classifiers, with batch normalisation."""
    c, _, _ = image_shape(input_shape, "googlenet")
    return GoogLeNet(num_classes, width=width, in_channels=c)


def googlenet_original(
    *, width: float = 1.0, input_shape: tuple[int, ...] = (3, 224, 224), num_classes: int = 1000
) -> GoogLeNet:
    """GoogLeNet as published (Szegedy et al. 2015) and as Kusumoto et al. benchmark it (the
    Chainer model): no batch normalisation, convolutions with bias, the two local response
    normalisations; no auxiliary classifiers."""
    c, _, _ = image_shape(input_shape, "googlenet_original")
    return GoogLeNet(num_classes, width=width, in_channels=c, batch_norm=False)


# --------------------------------------------------------------------------- Inception-v3


class InceptionA(nn.Module):
    """35x35 module (Figure 5): 1x1 | 1x1-5x5 | 1x1-3x3-3x3 | avgpool-1x1."""

    def __init__(self, in_channels: int, pool_features: int, width: float) -> None:
        super().__init__()
        c48, c64, c96 = scaled(48, width), scaled(64, width), scaled(96, width)
        pf = scaled(pool_features, width)
        self.branch1x1 = BasicConv2d(in_channels, c64, 1)
        self.branch5x5 = nn.Sequential(BasicConv2d(in_channels, c48, 1), BasicConv2d(c48, c64, 5, padding=2))
        self.branch3x3dbl = nn.Sequential(
            BasicConv2d(in_channels, c64, 1), BasicConv2d(c64, c96, 3, padding=1), BasicConv2d(c96, c96, 3, padding=1)
        )
        self.branch_pool = nn.Sequential(nn.AvgPool2d(3, stride=1, padding=1), BasicConv2d(in_channels, pf, 1))
        self.out_channels: int = 2 * c64 + c96 + pf

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.branch1x1(x), self.branch5x5(x), self.branch3x3dbl(x), self.branch_pool(x)], 1)


class InceptionB(nn.Module):
    """35x35 -> 17x17 grid reduction (Figure 10)."""

    def __init__(self, in_channels: int, width: float) -> None:
        super().__init__()
        c64, c96, c384 = scaled(64, width), scaled(96, width), scaled(384, width)
        self.branch3x3 = BasicConv2d(in_channels, c384, 3, stride=2)
        self.branch3x3dbl = nn.Sequential(
            BasicConv2d(in_channels, c64, 1), BasicConv2d(c64, c96, 3, padding=1), BasicConv2d(c96, c96, 3, stride=2)
        )
        self.branch_pool = nn.MaxPool2d(3, stride=2)
        self.out_channels: int = c384 + c96 + in_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.branch3x3(x), self.branch3x3dbl(x), self.branch_pool(x)], 1)


class InceptionC(nn.Module):
    """17x17 module with factorised 7x7 convolutions (Figure 6)."""

    def __init__(self, in_channels: int, channels_7x7: int, width: float) -> None:
        super().__init__()
        c7, c192 = scaled(channels_7x7, width), scaled(192, width)
        self.branch1x1 = BasicConv2d(in_channels, c192, 1)
        self.branch7x7 = nn.Sequential(
            BasicConv2d(in_channels, c7, 1),
            BasicConv2d(c7, c7, (1, 7), padding=(0, 3)),
            BasicConv2d(c7, c192, (7, 1), padding=(3, 0)),
        )
        self.branch7x7dbl = nn.Sequential(
            BasicConv2d(in_channels, c7, 1),
            BasicConv2d(c7, c7, (7, 1), padding=(3, 0)),
            BasicConv2d(c7, c7, (1, 7), padding=(0, 3)),
            BasicConv2d(c7, c7, (7, 1), padding=(3, 0)),
            BasicConv2d(c7, c192, (1, 7), padding=(0, 3)),
        )
        self.branch_pool = nn.Sequential(nn.AvgPool2d(3, stride=1, padding=1), BasicConv2d(in_channels, c192, 1))
        self.out_channels: int = 4 * c192

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.branch1x1(x), self.branch7x7(x), self.branch7x7dbl(x), self.branch_pool(x)], 1)


class InceptionD(nn.Module):
    """17x17 -> 8x8 grid reduction."""

    def __init__(self, in_channels: int, width: float) -> None:
        super().__init__()
        c192, c320 = scaled(192, width), scaled(320, width)
        self.branch3x3 = nn.Sequential(BasicConv2d(in_channels, c192, 1), BasicConv2d(c192, c320, 3, stride=2))
        self.branch7x7x3 = nn.Sequential(
            BasicConv2d(in_channels, c192, 1),
            BasicConv2d(c192, c192, (1, 7), padding=(0, 3)),
            BasicConv2d(c192, c192, (7, 1), padding=(3, 0)),
            BasicConv2d(c192, c192, 3, stride=2),
        )
        self.branch_pool = nn.MaxPool2d(3, stride=2)
        self.out_channels: int = c320 + c192 + in_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.branch3x3(x), self.branch7x7x3(x), self.branch_pool(x)], 1)


class InceptionE(nn.Module):
    """8x8 module with expanded filter banks (Figure 7)."""

    def __init__(self, in_channels: int, width: float) -> None:
        super().__init__()
        c192, c320, c384, c448 = (scaled(c, width) for c in (192, 320, 384, 448))
        self.branch1x1 = BasicConv2d(in_channels, c320, 1)
        self.branch3x3_1 = BasicConv2d(in_channels, c384, 1)
        self.branch3x3_2a = BasicConv2d(c384, c384, (1, 3), padding=(0, 1))
        self.branch3x3_2b = BasicConv2d(c384, c384, (3, 1), padding=(1, 0))
        self.branch3x3dbl_1 = BasicConv2d(in_channels, c448, 1)
        self.branch3x3dbl_2 = BasicConv2d(c448, c384, 3, padding=1)
        self.branch3x3dbl_3a = BasicConv2d(c384, c384, (1, 3), padding=(0, 1))
        self.branch3x3dbl_3b = BasicConv2d(c384, c384, (3, 1), padding=(1, 0))
        self.branch_pool = nn.Sequential(nn.AvgPool2d(3, stride=1, padding=1), BasicConv2d(in_channels, c192, 1))
        self.out_channels: int = c320 + 4 * c384 + c192

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b1 = self.branch1x1(x)
        b3 = self.branch3x3_1(x)
        b3 = torch.cat([self.branch3x3_2a(b3), self.branch3x3_2b(b3)], 1)
        bd = self.branch3x3dbl_2(self.branch3x3dbl_1(x))
        bd = torch.cat([self.branch3x3dbl_3a(bd), self.branch3x3dbl_3b(bd)], 1)
        return torch.cat([b1, b3, bd, self.branch_pool(x)], 1)


class InceptionAux(nn.Module):
    """Auxiliary classifier on the 17x17 grid (after Mixed_6e)."""

    def __init__(self, in_channels: int, num_classes: int, width: float) -> None:
        super().__init__()
        c128, c768 = scaled(128, width), scaled(768, width)
        self.pool = nn.AdaptiveAvgPool2d((5, 5))
        self.conv0 = BasicConv2d(in_channels, c128, 1)
        self.conv1 = BasicConv2d(c128, c768, 5)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(c768, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv1(self.conv0(self.pool(x)))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class InceptionV3(nn.Module):
    """Inception-v3 (Szegedy et al. 2016).

    With ``aux_logits=True`` the forward returns ``(logits, aux_logits)``.
    Needs inputs of at least 75x75.
    """

    def __init__(
        self,
        num_classes: int = 1000,
        *,
        width: float = 1.0,
        in_channels: int = 3,
        aux_logits: bool = False,
        dropout: float = 0.5,
    ) -> None:
        super().__init__()
        width = check_width(width)
        c32, c64, c80, c192 = (scaled(c, width) for c in (32, 64, 80, 192))
        self.Conv2d_1a_3x3 = BasicConv2d(in_channels, c32, 3, stride=2)
        self.Conv2d_2a_3x3 = BasicConv2d(c32, c32, 3)
        self.Conv2d_2b_3x3 = BasicConv2d(c32, c64, 3, padding=1)
        self.maxpool1 = nn.MaxPool2d(3, stride=2)
        self.Conv2d_3b_1x1 = BasicConv2d(c64, c80, 1)
        self.Conv2d_4a_3x3 = BasicConv2d(c80, c192, 3)
        self.maxpool2 = nn.MaxPool2d(3, stride=2)
        self.Mixed_5b = InceptionA(c192, 32, width)
        self.Mixed_5c = InceptionA(self.Mixed_5b.out_channels, 64, width)
        self.Mixed_5d = InceptionA(self.Mixed_5c.out_channels, 64, width)
        self.Mixed_6a = InceptionB(self.Mixed_5d.out_channels, width)
        self.Mixed_6b = InceptionC(self.Mixed_6a.out_channels, 128, width)
        self.Mixed_6c = InceptionC(self.Mixed_6b.out_channels, 160, width)
        self.Mixed_6d = InceptionC(self.Mixed_6c.out_channels, 160, width)
        self.Mixed_6e = InceptionC(self.Mixed_6d.out_channels, 192, width)
        self.AuxLogits: InceptionAux | None = None
        if aux_logits:
            self.AuxLogits = InceptionAux(self.Mixed_6e.out_channels, num_classes, width)
        self.Mixed_7a = InceptionD(self.Mixed_6e.out_channels, width)
        self.Mixed_7b = InceptionE(self.Mixed_7a.out_channels, width)
        self.Mixed_7c = InceptionE(self.Mixed_7b.out_channels, width)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(self.Mixed_7c.out_channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        x = self.Conv2d_2b_3x3(self.Conv2d_2a_3x3(self.Conv2d_1a_3x3(x)))
        x = self.maxpool1(x)
        x = self.maxpool2(self.Conv2d_4a_3x3(self.Conv2d_3b_1x1(x)))
        x = self.Mixed_5d(self.Mixed_5c(self.Mixed_5b(x)))
        x = self.Mixed_6a(x)
        x = self.Mixed_6e(self.Mixed_6d(self.Mixed_6c(self.Mixed_6b(x))))
        aux = self.AuxLogits(x) if self.AuxLogits is not None else None
        x = self.Mixed_7c(self.Mixed_7b(self.Mixed_7a(x)))
        x = torch.flatten(self.avgpool(x), 1)
        x = self.fc(self.dropout(x))
        if aux is not None:
            return x, aux
        return x


def inception_v3(
    *, width: float = 1.0, input_shape: tuple[int, ...] = (3, 299, 299), num_classes: int = 1000
) -> InceptionV3:
    """Inception-v3 (Szegedy et al. 2016) without the auxiliary classifier."""
    c, h, w = image_shape(input_shape, "inception_v3")
    if h < 75 or w < 75:
        raise ValueError(f"inception_v3 needs inputs of at least 75x75, got {h}x{w}")
    return InceptionV3(num_classes, width=width, in_channels=c)
