"""A stack of layers in an ``nn.ModuleList`` and a linear head (module-level capture takes the
layers op by op), and one patched step checked against the unpatched gradients: the small models
of the capture tests of what backward hands each input (``test_module_inplace``, ``test_input_grads``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

import autoremat
from autoremat.measure import gradients, gradients_equal, measure


class Stacked(nn.Module):
    def __init__(self, layer: Callable[[int], nn.Module], d: int = 16, n: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layer(d) for _ in range(n))
        self.head = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def step_gradients(model: nn.Module, x: torch.Tensor) -> dict:
    """The gradients of one ``sum`` step (dropout masks seeded)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    model(x).sum().backward()
    return gradients(model)


def planned_peak(model: nn.Module, x: torch.Tensor, plan: autoremat.Plan, reference: dict) -> int:
    """The measured step peak of ``model`` patched with ``plan``, whose gradients must equal ``reference``."""
    autoremat.apply(model, plan)
    try:
        assert gradients_equal(reference, step_gradients(model, x))
        return measure(model, (x,), steps=1, warmup=1).peak_bytes
    finally:
        autoremat.restore(model)
