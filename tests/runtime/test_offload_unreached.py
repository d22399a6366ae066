"""Offloading never keeps a graph no gradient reaches alive (:mod:`autoremat.runtime.offload`).

A branch whose result the loss cannot depend on (codes picked by ``argmax``, as an audio codec's
quantizer does) runs with gradients on: autograd records it and frees it when the model drops it,
without its backward. An op that saves its own output (``exp``) handed to a pack hook that keeps the
tensor as it is holds its autograd node through it, a cycle only backward breaks: every step leaked
the branch (147,456 bytes a step on the network below, fx capture). The offloader and the saved-tensor
units keep tensors without their history.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch import nn

import autoremat
from autoremat.cost import no_recompute_plan
from autoremat.plan import Plan, saved_unit_nodes
from autoremat.solvers import finalize_plan


class Coded(nn.Module):
    """A linear map, and integer codes picked from a second one's output (no gradient reaches it);
    no submodules, so one node at module level. The sigmoid's saved output is the call's own saved
    tensor that backward reads (the exp's is freed with its branch inside the call: not held)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(32, 32) / 8)
        self.proj = nn.Parameter(torch.randn(32, 32) / 8)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tanh(torch.sigmoid(h @ self.w)), torch.exp(h @ self.proj).argmax(-1)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.coder, self.c, self.d = nn.Linear(32, 32), Coded(), nn.Linear(32, 32), nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, codes = self.coder(torch.tanh(self.a(x)))
        h = torch.tanh(self.c(h)) + codes.unsqueeze(-1).float() * 0
        return self.d(h).sum()


def _with_history() -> set[int]:
    """The ids of the tensors alive that have autograd history (the other tests' too: compare sets)."""
    gc.collect()
    return {id(o) for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.grad_fn is not None}


def _steps(model: nn.Module, x: torch.Tensor, n: int = 3) -> tuple[list[int], dict[str, torch.Tensor]]:
    """``n`` steps; the number of tensors with autograd history each leaves alive, and the gradients."""
    before, alive = _with_history(), []
    for _ in range(n):
        model.zero_grad(set_to_none=True)
        model(x).backward()
        alive.append(len(_with_history() - before))
    return alive, {k: p.grad for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("mode", ["fx", "module"])
def test_a_branch_no_gradient_reaches_is_freed_each_step(mode: str):
    torch.manual_seed(0)
    model, x = Net(), torch.randn(64, 32)
    g = autoremat.capture(model, (x,), loss_fn=lambda o: o, mode=mode, repeats=1, warmup=0)
    base = no_recompute_plan(g)
    if mode == "fx":  # the first tanh's output goes to the host; the exp runs inside the offloader's scope
        first = next(v for v in g.nodes if g.node(v)["target"] == "tanh")
        plan = finalize_plan(g, Plan(list(base.segments), offload=(first,)), 10**15, "manual")
    else:  # every module call's own saved tensors as one unit, the coded branch's call too
        units = tuple(sorted(saved_unit_nodes(g, base)))
        assert any(g.node(v)["module_path"] == "coder" for v in units)
        plan = finalize_plan(g, Plan(list(base.segments), offload_saved=units), 10**15, "manual")
    patched = copy.deepcopy(model)
    autoremat.apply(patched, plan)
    ref_alive, ref_grads = _steps(copy.deepcopy(model), x)
    alive, grads = _steps(patched, x)
    assert ref_alive == [0, 0, 0]
    assert alive == [0, 0, 0], f"tensors with autograd history left after each step: {alive}"
    assert grads.keys() == ref_grads.keys()
    assert all(torch.equal(grads[k], ref_grads[k]) for k in grads)
