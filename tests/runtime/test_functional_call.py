"""A patched model called through ``torch.func.functional_call`` with other parameters and buffers
(meta-learning, stateless training loops) trains as the user's model does: the call swaps its
tensors in for the forward only, and every recomputation in backward runs with the tensors its
region's forward ran with (:mod:`autoremat.runtime.substituted`). Before, the regions recomputed
with the model's own parameters: 128 of 161 gradients of ResNet-50's least plan and 44 of 52 of
GPT-2's were not the unpatched model's."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call

import autoremat

pytest.importorskip("transformers")
from autoremat.zoo import hf  # noqa: E402  (needs transformers)


def _substituted_step(model: nn.Module, args: tuple, kwargs: dict, loss_fn, buffers: bool) -> tuple[dict, dict]:
    """Gradients of the substituted parameters, and the substituted buffers, after one step through
    ``functional_call``; the model's own parameters get none and are back in place."""
    own = dict(model.named_parameters())
    params = {n: (p.detach() * 1.5).requires_grad_(True) for n, p in own.items()}
    subs = {n: b.clone() for n, b in model.named_buffers()} if buffers else {}
    torch.manual_seed(3)
    loss_fn(functional_call(model, {**params, **subs}, args, kwargs)).backward()
    assert all(p.grad is None for p in own.values())
    assert all(p is own[n] for n, p in model.named_parameters())
    return {n: p.grad for n, p in params.items()}, subs


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in zip(a.values(), (b[k] for k in a)))


@pytest.mark.parametrize("regions", ["lean", "torch"])
@pytest.mark.parametrize("budget", ["min", "60%"])  # 60 %: regions keeping ops (selective saves)
def test_module_level_plans_under_functional_call(budget: str, regions: str) -> None:
    ex = hf.example("gpt2")
    graph = autoremat.capture(ex.model, ex.args, kwargs=ex.kwargs, loss_fn=ex.loss_fn, times="flops")
    plan = autoremat.solve(graph, budget)
    assert plan.recompute_segments and (budget == "min" or any(ops for _p, ops in plan.module_calls.values()))
    patched = autoremat.apply(copy.deepcopy(ex.model), plan, regions=regions)
    reference, _ = _substituted_step(ex.model, ex.args, ex.kwargs, ex.loss_fn, False)
    got, _ = _substituted_step(patched, ex.args, ex.kwargs, ex.loss_fn, False)
    assert _equal(reference, got)


@pytest.fixture(scope="module")
def resnet_at_least() -> tuple:
    """The zoo ResNet-50 (small), its inputs and its plan at the least budget (FLOP times)."""
    model, args = autoremat.zoo.build("resnet50", size="small")
    return model, args, autoremat.solve(autoremat.capture(model, args, times="flops"), "min")


@pytest.mark.parametrize("regions", ["lean", "torch"])
def test_fx_plans_under_functional_call_with_buffers(regions: str, resnet_at_least: tuple) -> None:
    """Substituted batch-norm statistics are updated once, as by the unpatched model."""
    model, args, plan = resnet_at_least
    assert plan.recompute_segments
    patched = autoremat.apply(copy.deepcopy(model), plan, regions=regions)
    loss = lambda y: y.float().mean()  # noqa: E731
    reference, ref_buffers = _substituted_step(model, args, {}, loss, True)
    got, got_buffers = _substituted_step(patched, args, {}, loss, True)
    assert _equal(reference, got)
    assert _equal(ref_buffers, got_buffers)
