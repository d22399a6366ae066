"""A recomputed call holds every tensor argument until its backward, read or not
(:meth:`autoremat.capture.blocks.BlockScopes.hold_args`).

``nn.Transformer``'s decoder layers take ``tgt_mask`` and, told ``tgt_is_causal``, never read it;
``torch.utils.checkpoint`` keeps it for the replay all the same. Captured op by op, no op read the
mask, so the cost model freed it after forward: plans that recompute the layers were predicted low
by the mask (0.16 % on a small ``nn.Transformer``; the whole mask here)."""

from __future__ import annotations

import copy

import torch
from torch import nn

import autoremat
from autoremat.cost import simulate

D, T = 32, 64


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, causal: bool = True) -> torch.Tensor:
        if not causal:  # like nn.MultiheadAttention told is_causal: the mask is not read
            x = x + mask[: x.shape[1], : x.shape[1]].sum(-1, keepdim=True)
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Stack(nn.Module):
    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(layers))
        self.head = nn.Linear(D, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.full((4 * T, 4 * T), float("-inf")).triu(1)  # 256 KiB, made in forward
        for layer in self.layers:
            x = layer(x, mask)
        return self.head(x)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def test_an_unread_argument_is_an_input_of_the_call():
    torch.manual_seed(0)
    model, x = Stack(), torch.randn(2, T, D)
    g = autoremat.capture(model, (x,), loss_fn=_loss, mode="module")
    mask = next(v for v in g.nodes if g.node(v)["name"] == "glue:triu.default")
    readers = [g.node(w)["scope"] for w in g.succ(mask)]
    # the layer's own first op (its gelu), not the first op it runs (inside ``up``, whose region does not hold it)
    assert sorted(readers) == [(f"layers.{i}",) for i in range(4)]


def test_plans_recomputing_the_calls_hold_the_mask():
    torch.manual_seed(0)
    model, x = Stack(), torch.randn(2, T, D)
    g = autoremat.capture(model, (x,), loss_fn=_loss, mode="module")
    plan = autoremat.solve(g, "min")
    assert plan.recompute_segments
    patched = copy.deepcopy(model)
    autoremat.apply(patched, plan)
    measured = autoremat.measure(patched, (x,), loss_fn=_loss, steps=1).peak_bytes
    predicted = simulate(g, plan).peak_bytes
    assert 0 <= predicted - measured <= 1024, (predicted, measured)  # the mask is 262,144 bytes
