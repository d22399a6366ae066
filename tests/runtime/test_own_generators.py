"""A module drawing from its own ``torch.Generator`` (``torch.rand(..., generator=self.gen)``: a
custom dropout or stochastic depth seeded apart from the global RNG) trains bit for bit when its
layer is recomputed: the region replays the generator from the state its forward found it in and
leaves it where the forward left it (:class:`autoremat.runtime.substituted.HeldState`). Before, the
replay drew other numbers (wrong gradients, silently) and advanced the generator a second time."""

from __future__ import annotations

import copy

import pytest
import torch
from _stacked import Stacked, selective_plan
from torch import nn

import autoremat
from autoremat.measure import gradients, gradients_equal


class _OwnDrop(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.gen = torch.Generator().manual_seed(7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(x))
        return x + h * (torch.rand(h.shape, generator=self.gen) > 0.3).to(h.dtype) / 0.7


@pytest.mark.parametrize("kind", ["lean", "torch", "selective"])
def test_a_layer_with_its_own_generator_is_recomputed_exactly(kind: str) -> None:
    torch.manual_seed(0)
    model, x = Stacked(_OwnDrop, d=32, n=4), torch.randn(64, 32)
    graph = autoremat.capture(model, (x,), loss_fn=torch.sum, times="flops", mode="module")
    plan = selective_plan(graph, lambda t: "addmm" in t) if kind == "selective" else autoremat.solve(graph, "min")
    assert plan.recompute_segments and (kind != "selective" or all(ops for _p, ops in plan.module_calls.values()))
    patched = autoremat.apply(copy.deepcopy(model), plan, regions="torch" if kind == "torch" else "lean")
    for m in (model, patched):
        for layer in m.layers:
            layer.gen.manual_seed(11)
    for _ in range(3):  # the first step probes the regions, later ones use what it found
        grads = []
        for m in (model, patched):
            m.zero_grad(set_to_none=True)
            m(x).sum().backward()
            grads.append(gradients(m))
        assert gradients_equal(*grads)
        assert all(torch.equal(a.gen.get_state(), b.gen.get_state()) for a, b in zip(model.layers, patched.layers))
