"""The module-level capture reads what each op of a block saved by unpacking its autograd node's
fields, which runs ``detach`` ops: they are not the model's ops and must not be nodes. Before, each
block got two such nodes, aliases of real outputs with saves of their own (a MobileViT: the
``blocks`` solver's window pricing failed with ``KeyError: ('o', 12)``)."""

from __future__ import annotations

import torch
from torch import nn

import autoremat
from autoremat.measure import measure


class _Inverted(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.expand = nn.Sequential(nn.Conv2d(c, 2 * c, 3, padding=1), nn.BatchNorm2d(2 * c), nn.SiLU())
        self.reduce = nn.Sequential(nn.Conv2d(2 * c, c, 1), nn.BatchNorm2d(c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.expand(x))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.layers = nn.ModuleList(_Inverted(8) for _ in range(3))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        if h.sum() > -1e9:  # Python reading a tensor: fx cannot trace it, capture is module level
            h = h * 1.0
        for layer in self.layers:
            h = layer(h)
        return self.head(h.mean((2, 3)))


def test_no_node_for_the_captures_own_detach_and_plans_predict_their_peak() -> None:
    torch.manual_seed(0)
    model, x = _Net(), torch.randn(4, 3, 32, 32)
    graph = autoremat.capture(model, (x,), repeats=1, warmup=0, times="flops")
    assert graph.meta["mode"] == "module"
    assert not [graph.node(v)["name"] for v in graph.nodes if "detach" in graph.node(v)["target"]]
    plan = autoremat.solve(graph, "50%", solver="blocks")
    autoremat.apply(model, plan)
    try:
        peak = measure(model, (x,), steps=1, warmup=0).peak_bytes
    finally:
        autoremat.restore(model)
    assert peak == plan.predicted_peak_bytes
