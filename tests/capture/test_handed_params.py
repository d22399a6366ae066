"""A module call that uses parameters it is handed (another module, a parameter or a view of one)
lists them: their gradients are made by its backward (the Hugging Face Perceiver's decoder
multiplies by the input embedding's weight; its queries are an expanded parameter)
(:mod:`autoremat.capture.handed_params`)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import autoremat
from autoremat.cost import no_recompute_plan, simulate
from autoremat.measure import LiveStorageCounter, gradients, gradients_equal

V, D = 4096, 64


class _TiedDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(V))

    def forward(self, hidden: torch.Tensor, embedding: nn.Embedding) -> torch.Tensor:
        return hidden @ embedding.weight.T + self.bias


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(D), nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.queries = nn.Parameter(torch.randn(8, D))
        self.query_norm = nn.LayerNorm(D)
        self.layers = nn.ModuleList(_Block() for _ in range(4))
        self.decoder = _TiedDecoder()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        q = self.query_norm(self.queries.expand(ids.shape[0], -1, -1))
        x = torch.cat([q, x], dim=1)
        for layer in self.layers:
            x = layer(x)
        return self.decoder(x.mean(dim=1), self.embed)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def _step(model: nn.Module, ids: torch.Tensor) -> tuple[int, dict]:
    model.zero_grad(set_to_none=True)
    counter = LiveStorageCounter()
    with counter:
        _loss(model(ids)).backward()
    return counter.peak, gradients(model)


def test_the_calls_list_the_parameters_they_are_handed() -> None:
    torch.manual_seed(0)
    model, ids = _Net(), torch.randint(0, V, (4, 24))
    graph = autoremat.capture(model, (ids,), loss_fn=_loss, mode="module", times="flops")
    params = {graph.node(v)["name"]: graph.node(v)["params"] for v in graph.nodes}
    assert "embed.weight" in params["decoder"] and "decoder.bias" in params["decoder"]
    assert "queries" in params["query_norm"]


@pytest.mark.parametrize("budget", [None, "min"])
def test_a_tied_decoder_is_predicted(budget: str | None) -> None:
    torch.manual_seed(0)
    model, ids = _Net(), torch.randint(0, V, (4, 24))
    graph = autoremat.capture(model, (ids,), loss_fn=_loss, mode="module", times="flops")
    plan = no_recompute_plan(graph) if budget is None else autoremat.solve(graph, budget)
    patched = copy.deepcopy(model)
    if budget is not None:
        autoremat.apply(patched, plan)
    _, want = _step(model, ids)
    peak, got = _step(patched, ids)
    assert gradients_equal(want, got)
    assert peak <= simulate(graph, plan).peak_bytes <= 1.01 * peak
