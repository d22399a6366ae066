"""A recomputed layer replays the module state its forward ran with and leaves the state its forward
left (:class:`autoremat.runtime.substituted.HeldState`):

* a module drawing from its own ``torch.Generator`` (``torch.rand(..., generator=self.gen)``: a
  custom dropout or stochastic depth seeded apart from the global RNG): before, the replay drew
  other numbers (wrong gradients, silently) and advanced the generator a second time;
* a forward updating plain attributes (a call counter later steps branch on, a tensor kept for
  inspection): before, the replay updated them again (the counter at twice the calls, and the
  gradients of later steps not the unpatched model's)."""

from __future__ import annotations

import copy

import pytest
import torch
from _stacked import Stacked, selective_plan, step_gradients
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
        assert gradients_equal(step_gradients(model, x), step_gradients(patched, x))
        assert all(torch.equal(a.gen.get_state(), b.gen.get_state()) for a, b in zip(model.layers, patched.layers))


class _Counting(nn.Module):
    """Counts its calls, halves its branch from the third on, keeps its last activation."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.last = torch.tanh(self.lin(x))
        return x + self.last * (1.0 if self.calls < 3 else 0.5)


@pytest.mark.parametrize("kind", ["lean", "torch", "selective"])
def test_a_layer_updating_attributes_is_recomputed_exactly(kind: str) -> None:
    torch.manual_seed(0)
    model, x = Stacked(_Counting, d=32, n=4), torch.randn(64, 32)
    graph = autoremat.capture(model, (x,), loss_fn=torch.sum, times="flops", mode="module")
    assert [layer.calls for layer in model.layers] == [0] * 4  # capture leaves them as they were
    plan = selective_plan(graph, lambda t: "addmm" in t) if kind == "selective" else autoremat.solve(graph, "min")
    assert plan.recompute_segments
    patched = autoremat.apply(copy.deepcopy(model), plan, regions="torch" if kind == "torch" else "lean")
    for step in range(1, 5):
        grads = []
        for m in (model, patched):
            m.zero_grad(set_to_none=True)
            out = m(x)
            kept = [layer.last for layer in m.layers]
            out.sum().backward()
            grads.append(gradients(m))
            assert all(layer.last is t for layer, t in zip(m.layers, kept))  # the forward's, not a replay's
        assert gradients_equal(*grads)
        assert [layer.calls for layer in patched.layers] == [step] * 4
        assert all(torch.equal(a.last, b.last) for a, b in zip(model.layers, patched.layers))
