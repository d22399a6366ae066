"""Model zoo: the networks of the activation-recomputation literature in plain torch.

The zoo holds plain-PyTorch definitions (no torchvision) of the networks that
recomputation papers benchmark, at their published architecture: ResNet-50
and ResNet-152, VGG-19, DenseNet-121/161/201, GoogLeNet (with batch norm, and as
published: ``googlenet_original``), Inception-v3, U-Net,
PSPNet, plus a deep MLP and a GPT-style transformer. Each family lives in its
own module, whose docstring cites the original paper and lists any deviation
from it.

Design rules shared by every model:

* **Traceable.** Every model traces with :func:`torch.fx.symbolic_trace`: no
  data-dependent control flow and no shape arithmetic in ``forward``. Sizes
  that depend on the input resolution (U-Net skip crops, PSPNet upsampling
  sizes, the transformer's causal mask and positions) are fixed when the model
  is built for its input shape. Layers are ``nn.Module`` leaves (``nn.Conv2d``,
  ``nn.BatchNorm2d``, ``nn.ReLU``, pooling, ``nn.Linear``, ``nn.Dropout``,
  ``nn.LayerNorm``, ...) joined by ``torch.cat``, ``torch.flatten``, ``+`` and
  ``F.interpolate`` with fixed sizes.
* **No in-place activations.** Every ReLU is ``nn.ReLU(inplace=False)``.
  In-place activations make an output alias its input's storage, which would
  complicate the memory model of the recomputation planner (a tensor's memory
  would no longer be freed when the tensor dies); without them every node
  owns the storage it produces. The one exception is opt-in:
  ``resnet50(inplace=True)`` / ``resnet152(inplace=True)`` build torchvision's
  in-place form, the test model of in-place support (issue 26).
* **Width multiplier, real depth.** ``width`` scales channel counts and hidden
  sizes (never below 4 channels); the number of layers and blocks and the
  graph topology are the published ones at every width, so small models have
  the paper's graph shape at a fraction of the cost.

``ZOO`` maps each model name to a :class:`ZooSpec` with a paper size (full
width at the input resolution and batch size of the recomputation
benchmarks) and a small size for fast CPU runs; :func:`build` makes a model
and example inputs at either size.

Paper batch sizes follow Kusumoto et al., "A Graph Theoretic Framework of
Recomputation Algorithms for Memory-Efficient Backpropagation", NeurIPS 2019,
Table 1, where the network appears there (PSPNet 2, U-Net 8, ResNet-50 96,
ResNet-152 48, VGG-19 64, DenseNet-161 32, GoogLeNet 256). For the others we
chose: DenseNet-121 and DenseNet-201 32 (as DenseNet-161), Inception-v3 32
(the per-replica batch of Szegedy et al. 2016), the MLP 512 and the
transformer 8 sequences of 1024 tokens (GPT-2 small). U-Net uses the paper's
single-channel 572x572 tile (output 388x388, two classes); PSPNet uses
713x713 crops and 19 classes (Cityscapes); Inception-v3 uses 299x299.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from .densenet import densenet121, densenet161, densenet201
from .inception import googlenet, googlenet_original, inception_v3
from .mlp import mlp
from .pspnet import pspnet
from .resnet import resnet50, resnet152
from .transformer import transformer
from .unet import unet
from .vgg import vgg19

__all__ = ["SIZES", "ZOO", "ZooSpec", "build", "names"]

#: Accepted values of the ``size`` argument of :func:`build`.
SIZES: tuple[str, ...] = ("small", "paper")

InputKind = Literal["image", "tokens", "features"]


@dataclass(frozen=True)
class ZooSpec:
    """How to build one zoo model at paper size and at small (CPU) size.

    Attributes:
        name: key in :data:`ZOO`.
        builder: ``builder(width=..., input_shape=..., num_classes=...)`` returning the model.
        paper_batch: batch size of the recomputation benchmarks (see module docstring).
        paper_input: per-sample input shape at paper size; ``(C, H, W)`` for images,
            ``(T,)`` for token sequences, ``(features,)`` for the MLP.
        small_input: per-sample input shape at small size.
        small_batch: batch size at small size.
        small_width: width multiplier at small size (paper size uses 1.0).
        paper_classes: classifier outputs / segmentation classes / vocabulary at paper size.
        small_classes: the same at small size.
        inputs: kind of example input: float images, int64 token ids or float features.
        task: ``"classification"`` (N, classes), ``"segmentation"`` (N, classes, H, W)
            or ``"language_model"`` (N, T, vocab).
    """

    name: str
    builder: Callable[..., nn.Module]
    paper_batch: int
    paper_input: tuple[int, ...]
    small_input: tuple[int, ...]
    small_batch: int
    small_width: float
    paper_classes: int = 1000
    small_classes: int = 10
    inputs: InputKind = "image"
    task: str = "classification"

    def config(self, size: str = "small") -> tuple[float, tuple[int, ...], int, int]:
        """Return ``(width, input_shape, num_classes, batch)`` for ``size``."""
        _check_size(size)
        if size == "paper":
            return 1.0, self.paper_input, self.paper_classes, self.paper_batch
        return self.small_width, self.small_input, self.small_classes, self.small_batch


_IMAGENET = (3, 224, 224)

ZOO: dict[str, ZooSpec] = {
    spec.name: spec
    for spec in (
        ZooSpec("resnet50", resnet50, 96, _IMAGENET, (3, 64, 64), 4, 1 / 16),
        ZooSpec("resnet152", resnet152, 48, _IMAGENET, (3, 64, 64), 4, 1 / 16),
        ZooSpec("vgg19", vgg19, 64, _IMAGENET, (3, 32, 32), 4, 1 / 16),
        ZooSpec("densenet121", densenet121, 32, _IMAGENET, (3, 64, 64), 4, 1 / 8),
        ZooSpec("densenet161", densenet161, 32, _IMAGENET, (3, 64, 64), 4, 1 / 12),
        ZooSpec("densenet201", densenet201, 32, _IMAGENET, (3, 64, 64), 4, 1 / 8),
        ZooSpec("googlenet", googlenet, 256, _IMAGENET, (3, 64, 64), 4, 1 / 8),
        ZooSpec("googlenet_original", googlenet_original, 256, _IMAGENET, (3, 64, 64), 4, 1 / 8),
        ZooSpec("inception_v3", inception_v3, 32, (3, 299, 299), (3, 75, 75), 4, 1 / 8),
        ZooSpec(
            "unet", unet, 8, (1, 572, 572), (1, 204, 204), 2, 1 / 16,
            paper_classes=2, small_classes=2, task="segmentation",
        ),
        ZooSpec(
            "pspnet", pspnet, 2, (3, 713, 713), (3, 64, 64), 2, 1 / 16,
            paper_classes=19, small_classes=19, task="segmentation",
        ),
        ZooSpec("mlp", mlp, 512, (1024,), (64,), 32, 1 / 16, inputs="features"),
        ZooSpec(
            "transformer", transformer, 8, (1024,), (64,), 4, 1 / 16,
            paper_classes=50257, small_classes=256, inputs="tokens", task="language_model",
        ),
    )
}  # fmt: skip


def names() -> list[str]:
    """Names of the zoo models, in :data:`ZOO` order."""
    return list(ZOO)


def _check_size(size: str) -> None:
    if size not in SIZES:
        raise ValueError(f"unknown zoo size {size!r}; expected one of {list(SIZES)}")


def _spec(name: str) -> ZooSpec:
    try:
        return ZOO[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown zoo model {name!r}; expected one of {names()}") from None


def _make_inputs(
    spec: ZooSpec, batch: int, input_shape: tuple[int, ...], num_classes: int, device: torch.device, seed: int
) -> tuple[torch.Tensor, ...]:
    shape = (batch, *input_shape)
    if spec.inputs == "tokens":
        if device.type == "meta":
            return (torch.empty(shape, dtype=torch.long, device=device),)
        gen = torch.Generator().manual_seed(seed)
        return (torch.randint(0, num_classes, shape, generator=gen).to(device),)
    if device.type == "meta":
        return (torch.empty(shape, device=device),)
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen).to(device),)


def build(
    name: str,
    *,
    size: str = "small",
    batch_size: int | None = None,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Build zoo model ``name`` and example positional inputs for it.

    Args:
        name: a key of :data:`ZOO` (see :func:`names`).
        size: ``"paper"`` (full width, paper input resolution and batch) or
            ``"small"`` (reduced width and resolution for fast CPU runs).
        batch_size: overrides the spec's batch size.
        device: device for parameters, buffers and inputs; ``"meta"`` allocates
            nothing (parameters and inputs are meta tensors).
        seed: seeds parameter initialisation and the random inputs; the global
            RNG state is left untouched.

    Returns:
        ``(model, inputs)``: the model in training mode and a tuple of example
        inputs (float images / features, or int64 token ids) so that
        ``model(*inputs)`` runs.

    Raises:
        ValueError: unknown ``name`` or ``size``, or a non-positive ``batch_size``.
    """
    spec = _spec(name)
    _check_size(size)
    width, input_shape, num_classes, batch = spec.config(size)
    if batch_size is not None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        batch = batch_size
    dev = torch.device(device)
    rng_devices: list[int] = []
    if dev.type == "cuda":
        rng_devices = [dev.index if dev.index is not None else torch.cuda.current_device()]
    with torch.random.fork_rng(devices=rng_devices):
        torch.manual_seed(seed)
        with dev:
            model = spec.builder(width=width, input_shape=input_shape, num_classes=num_classes)
    model.train()
    return model, _make_inputs(spec, batch, input_shape, num_classes, dev, seed)
