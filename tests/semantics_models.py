"""More small models for the semantics table (:mod:`semantics_cases`, issue 29): the kinds the
issue's Tests section lists beyond the first twenty (dataclass outputs, keyword-only inputs, AMP,
more random ops, normalisation, recurrent and attention layers, parametrisations, custom autograd
functions, Python state in containers and plain tensor attributes, a self-checkpoint with dropout
inside). ``change_*`` functions change a model's Python state between phases (``Case.mutate``)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations
from torch.utils.checkpoint import checkpoint

W = 16


@dataclasses.dataclass
class Out:
    h: torch.Tensor
    y: torch.Tensor


class DataclassOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(W, W), nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> Out:
        h = torch.relu(self.a(x))
        return Out(h=h, y=self.b(h))


class KwargsOnly(nn.Module):
    """Every input keyword-only, one optional."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(W, W), nn.Linear(W, W)

    def forward(self, *, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = torch.relu(self.a(x))
        if mask is not None:
            h = h * mask
        return self.b(h)


class AmpNet(nn.Module):
    """Run under CPU autocast (bf16) by the harness: linear layers in bf16, norms in float32."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.n, self.b = nn.Linear(W, W), nn.LayerNorm(W), nn.Linear(W, W)
        self.d = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.d(torch.relu(self.n(self.a(x)))))


class AmpInside(nn.Module):
    """Autocast entered inside forward for part of the model (the rest in float32)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(W, W), nn.Linear(W, W), nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = torch.relu(self.b(h))
        return self.c(h.float())


class Noise(nn.Module):
    """Random ops whose names say nothing random: Gaussian noise in training (``randn_like``),
    ``gumbel_softmax`` (draws ``exponential_``) and ``empty_like(...).normal_()`` behind a helper."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(W, W), nn.Linear(W, W)
        self.sigma = 0.1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if self.training:
            h = h + torch.randn_like(h) * self.sigma
        h = F.gumbel_softmax(h, tau=0.7) + 0.1 * _noise(h)
        return self.b(h)


def _noise(h: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(h).normal_()


class FeatureDropouts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv1d(4, 4, 3, padding=1)
        self.d1 = nn.Dropout1d(0.3)
        self.fa = nn.FeatureAlphaDropout(0.2)
        self.c2 = nn.Conv1d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c2(F.dropout(self.fa(self.d1(torch.selu(self.c(x)))), 0.1, True))


class DropoutRate(nn.Module):
    """Functional dropout at a rate held in a plain attribute, and an ``nn.Dropout`` whose ``p``
    a schedule changes (:func:`change_rate` changes both)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(W, W), nn.Linear(W, W)
        self.d = nn.Dropout(0.3)
        self.p = 0.3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(torch.relu(self.a(x)), self.p, self.training)
        return self.b(self.d(h))


def change_rate(m: nn.Module) -> None:
    m.p = 0.1
    m.d.p = 0.5


class BatchNormCumulative(nn.Module):
    """``momentum=None``: a cumulative average that reads ``num_batches_tracked``."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4, momentum=None)
        self.c2 = nn.Conv2d(4, 4, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn2(self.c2(torch.relu(self.bn(self.c(x)))))


class GRUNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(W, W, batch_first=True, bidirectional=True)
        self.out = nn.Linear(2 * W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, h = self.rnn(x)
        return self.out(y) + h.sum(0).unsqueeze(1)


class EncoderLayer(nn.Module):
    """``nn.TransformerEncoderLayer`` (dropout, layer norm; a fused fast path in eval)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(W, 2, dim_feedforward=2 * W, dropout=0.2, batch_first=True)
        self.head = nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(x))


class MHA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(W, W)
        self.att = nn.MultiheadAttention(W, 2, dropout=0.25, batch_first=True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.inp(x))
        y, w = self.att(h, h, h, need_weights=True)
        return y, w


class PartlyFrozen(nn.Module):
    """Fine-tuning: the first layer's parameters do not require grad."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(W, W), nn.Linear(W, W), nn.Linear(W, W)
        self.a.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


class SharedModule(nn.Module):
    """One layer called three times (module reuse, not weight tying)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.shared = nn.Linear(W, W), nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        for _ in range(3):
            h = torch.tanh(self.shared(h)) + h
        return h


class WeightNorm(nn.Module):
    """A parametrised weight (``parametrizations.weight_norm``): computed from g and v per access."""

    def __init__(self) -> None:
        super().__init__()
        self.a = parametrizations.weight_norm(nn.Linear(W, W))
        self.b = nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class SpectralNorm(nn.Module):
    """``parametrizations.spectral_norm``: power iteration updates buffers under no_grad in training."""

    def __init__(self) -> None:
        super().__init__()
        self.a = parametrizations.spectral_norm(nn.Linear(W, W))
        self.b = nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class _Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        return 2 * x * g


class CustomFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(W, W), nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(_Square.apply(torch.tanh(self.a(x))))


class ContainerAttrs(nn.Module):
    """Plain values inside a dict and a list (an fx trace bakes them into the graph)."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.ModuleList(nn.Linear(W, W) for _ in range(3))
        self.cfg = {"scale": 2.0, "act": "tanh", "skip": [False, False]}
        self.gains = [1.0, 0.5, 2.0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = torch.tanh if self.cfg["act"] == "tanh" else torch.relu
        for i, lin in enumerate(self.l):
            h = act(lin(x)) * self.gains[i]
            x = x if i < 2 and self.cfg["skip"][i] else h + x * self.cfg["scale"]
        return x


def change_values(m: nn.Module) -> None:
    """Values inside the containers change: the same ops with other constants."""
    m.cfg["scale"] = 0.5
    m.gains[1] = 3.0


def change_branch(m: nn.Module) -> None:
    """A nested value changes which ops run."""
    m.cfg["act"] = "relu"
    m.cfg["skip"][1] = True


class TensorAttr(nn.Module):
    """A plain tensor attribute (not a buffer), replaced between phases."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(W, W), nn.Linear(W, W)
        self.mask = torch.ones(W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)) * self.mask)


def replace_mask(m: nn.Module) -> None:
    m.mask = torch.arange(W, dtype=torch.float32) % 2


class Routed(nn.Module):
    """A task name (a plain string attribute) picks the head of an ``nn.ModuleDict``."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(W, W)
        self.heads = nn.ModuleDict({"a": nn.Linear(W, W), "b": nn.Linear(W, 4)})
        self.task = "a"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.heads[self.task](torch.relu(self.body(x)))


def switch_task(m: nn.Module) -> None:
    m.task = "b"


class LossInside(nn.Module):
    """Computes its own loss from ``labels`` (Hugging Face style) and returns it with the logits."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(W, W), nn.Linear(W, 5)
        self.d = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        logits = self.b(self.d(torch.relu(self.a(x))))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels)
        return out


class MixedOut(nn.Module):
    """Outputs mixing tensors with Python values and ``None``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(W, W), nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None, int, torch.Tensor]:
        h = torch.relu(self.a(x))
        return h, None, 3, self.b(h)


class SelfCheckpointDropout(nn.Module):
    """The model's own non-reentrant checkpoint around a block that draws dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.blk, self.b = nn.Linear(W, W), nn.Linear(W, W), nn.Linear(W, W)
        self.d = nn.Dropout(0.3)

    def _block(self, h: torch.Tensor) -> torch.Tensor:
        return self.d(torch.tanh(self.blk(h)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        return self.b(checkpoint(self._block, h, use_reentrant=False))


def freeze_batchnorm(m: nn.Module) -> None:
    """A leaf switched to eval inside a training model (frozen statistics)."""
    m.bn.eval()


def unfreeze(m: nn.Module) -> None:
    """Fine-tuning unfreezes the first layer."""
    m.a.requires_grad_(True)


class FunctionalWeight(nn.Module):
    """A parameter used functionally (``F.linear(h, self.w)``): fx reads it as an attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(W, W), nn.Linear(W, W)
        self.w = nn.Parameter(torch.randn(W, W) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(F.linear(torch.tanh(self.a(x)), self.w)))


def replace_parameter_and_head(m: nn.Module) -> None:
    """A parameter and a submodule assigned anew (the optimizer keeps updating the old ones)."""
    g = torch.Generator().manual_seed(9)
    m.w = nn.Parameter(torch.randn(W, W, generator=g) * 0.1)
    m.b = nn.Linear(W, W)
    with torch.no_grad():
        m.b.weight.copy_(torch.randn(W, W, generator=g) * 0.1)
        m.b.bias.zero_()
