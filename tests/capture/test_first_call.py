"""A model that does something on its first call only (a tensor built once by an ``lru_cache``d
function, as the Hugging Face BEiT builds its relative position index) is recorded as every later
call runs: module-level capture runs one forward without gradients first
(:func:`autoremat.capture._first_call`)."""

from __future__ import annotations

import copy
import functools

import torch
from torch import nn

import autoremat
from autoremat.measure import gradients, gradients_equal


@functools.lru_cache(maxsize=4)
def _relative_index(n: int) -> torch.Tensor:
    coords = torch.arange(n)
    return (coords[:, None] - coords[None, :] + n - 1).reshape(-1)


class _Attention(nn.Module):
    def __init__(self, n: int = 16, width: int = 32) -> None:
        super().__init__()
        self.n, self.qkv, self.out = n, nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.bias_table = nn.Parameter(torch.randn(2 * n - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        bias = self.bias_table[_relative_index(self.n)].view(self.n, self.n)
        scores = torch.softmax(q @ k.transpose(-1, -2) + bias, dim=-1)
        return x + self.out(torch.relu(scores @ v))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Attention() for _ in range(4))
        self.head = nn.Linear(32, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def test_a_cache_filled_on_the_first_call_is_not_recorded_as_every_calls_ops() -> None:
    _relative_index.cache_clear()
    torch.manual_seed(0)
    model, x = _Net(), torch.randn(8, 16, 32)
    graph = autoremat.capture(model, (x,), loss_fn=_loss, mode="module", times="flops")
    ops = {i: [graph.node(v)["name"].split(":")[-1] for v in graph.nodes
               if graph.node(v)["name"].startswith(f"layers.{i}")] for i in range(4)}
    assert "arange.default" not in ops[0]
    assert ops[0] == ops[1] == ops[3]
    for budget in ("60%", "min"):
        plan = autoremat.solve(graph, budget)
        patched = copy.deepcopy(model)
        autoremat.apply(patched, plan)
        want, got = {}, {}
        for m, out in ((model, want), (patched, got)):
            m.zero_grad(set_to_none=True)
            _loss(m(x)).backward()
            out.update(gradients(m))
        assert gradients_equal(want, got)
