"""A backward through a retained graph (``loss.backward(retain_graph=True)`` then another backward,
as multi-loss training does; ``torch.autograd.grad(..., create_graph=True)``, as a gradient penalty
does) runs on a patched model as on the user's: selective regions keep their stored outputs for the
next backward (:class:`autoremat.runtime.selective._RetainedCache`; PyTorch's own selective
checkpointing raised "Trying to backward an extra time"), and the gradients are bit for bit equal."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from _stacked import Stacked, selective_plan
from torch import nn

import autoremat
from autoremat.measure import gradients, gradients_equal
from autoremat.runtime.selective import apply_selective

pytest.importorskip("transformers")
from autoremat.zoo import hf  # noqa: E402  (needs transformers)


def _twice(model: nn.Module, run: Callable[[], torch.Tensor]) -> dict:
    """Gradients of two backwards of one forward's loss, the first retaining the graph."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(5)
    loss = run()
    loss.backward(retain_graph=True)
    (2 * loss).backward()
    return gradients(model)


def test_a_plan_with_selective_regions_backwards_twice_through_a_retained_graph() -> None:
    ex = hf.example("gpt2")
    graph = autoremat.capture(ex.model, ex.args, kwargs=ex.kwargs, loss_fn=ex.loss_fn, times="flops")
    plan = autoremat.solve(graph, "60%")
    assert plan.module_calls, "no region keeping ops in the plan"
    patched = copy.deepcopy(ex.model)
    autoremat.apply(patched, plan)
    reference = _twice(ex.model, lambda: ex.loss_fn(ex.model(*ex.args, **ex.kwargs)))
    assert gradients_equal(reference, _twice(patched, lambda: ex.loss_fn(patched(*ex.args, **ex.kwargs))))


def test_selective_layers_backward_twice_through_a_retained_graph() -> None:
    ex = hf.example("bert")  # dropout on: the seeded masks must match in both runs
    patched = apply_selective(copy.deepcopy(ex.model), {p: "matmuls" for p in ("bert.encoder.layer.0",
                                                                               "bert.encoder.layer.1")})
    reference = _twice(ex.model, lambda: ex.loss_fn(ex.model(*ex.args, **ex.kwargs)))
    assert gradients_equal(reference, _twice(patched, lambda: ex.loss_fn(patched(*ex.args, **ex.kwargs))))


class _Mlp(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


def test_a_gradient_penalty_through_selective_regions() -> None:
    """``create_graph=True`` keeps the graph: the penalty's backward runs the regions' backward again."""
    torch.manual_seed(0)
    model, x = Stacked(_Mlp, d=16, n=3), torch.randn(8, 16)
    graph = autoremat.capture(model, (x,), loss_fn=torch.sum, mode="module", times="flops")
    plan = selective_plan(graph, lambda target: "mm" in target)
    assert len(plan.module_calls) == 3 and all(ops for _path, ops in plan.module_calls.values())
    patched = copy.deepcopy(model)
    autoremat.apply(patched, plan)

    def penalised(m: nn.Module) -> dict:
        m.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        loss = m(xi).sum()
        (g,) = torch.autograd.grad(loss, xi, create_graph=True)
        (loss + g.square().sum()).backward()
        return gradients(m)

    assert gradients_equal(penalised(model), penalised(patched))
    assert gradients_equal(_twice(model, lambda: model(x).sum()), _twice(patched, lambda: patched(x).sum()))
