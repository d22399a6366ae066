"""The gradient the loss seeds into a model output (``grad_seed_bytes``, :mod:`autoremat._graph_rules`):
``out.sum()`` hands the output an expanded scalar of one element, not a tensor of ``out_bytes``;
``out.mean()`` (PyTorch 2.13) and a cross-entropy hand it a dense one. Capture measures it, in
module and fx mode, and the predicted step peak then matches the measured one. Before the field,
the sum's step was predicted 17.6 % high (a Linear run three times with tanh, batch 512)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autoremat
from autoremat.cost import no_recompute_plan, simulate
from autoremat.graph import Graph
from autoremat.measure import measure

TOLERANCE = 0.01


class _Three(nn.Module):
    """One Linear run three times, a tanh after each; ``both`` also returns the middle value,
    which the third call reads too (an output whose seed meets a gradient from inside the model)."""

    def __init__(self, both: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(128, 128)
        self.both = both

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.lin(torch.tanh(self.lin(x))))
        y = torch.tanh(self.lin(h))
        return (h, y) if self.both else y


_LABELS = torch.randint(0, 128, (512,), generator=torch.Generator().manual_seed(1))
LOSSES = {
    "sum": lambda o: o.sum(),
    "mean": lambda o: o.mean(),
    "cross-entropy": lambda o: F.cross_entropy(o, _LABELS),
    "sum and mean": lambda o: o.sum() + o.mean(),  # two gradients for one output: their sum is dense
}
SEEDS = {"sum": 4, "mean": None, "cross-entropy": None, "sum and mean": None}  # fp32: one element; dense


def _captured(loss: str, mode: str, both: bool = False) -> tuple[Graph, int]:
    torch.manual_seed(0)
    model, x = _Three(both), torch.randn(512, 128)
    fn = (lambda o: o[0].sum() + o[1].sum()) if both else LOSSES[loss]
    graph = autoremat.capture(model, (x,), loss_fn=fn, mode=mode, repeats=1, warmup=0)
    return graph, measure(model, (x,), loss_fn=fn, steps=1, warmup=0).peak_bytes


@pytest.mark.parametrize("mode", ["module", "fx"])
@pytest.mark.parametrize("loss", list(LOSSES))
def test_seed_measured_and_step_predicted(loss: str, mode: str) -> None:
    graph, measured = _captured(loss, mode)
    (out,) = [v for v in graph.nodes if graph.node(v)["is_output"]]
    assert graph.node(out)["grad_seed_bytes"] == SEEDS[loss]
    assert graph.grad_bytes(out) == (SEEDS[loss] or graph.node(out)["out_bytes"])
    predicted = simulate(graph, no_recompute_plan(graph)).peak_bytes
    assert abs(predicted - measured) <= TOLERANCE * measured, (predicted, measured)


@pytest.mark.parametrize("mode", ["module", "fx"])
def test_a_seed_that_meets_a_gradient_from_inside_is_priced_dense(mode: str) -> None:
    """Autograd adds the third call's gradient of the middle value to its one-element seed out of
    place (a new dense buffer): the model prices that output's gradient at ``out_bytes`` from the
    loss on, high by at most ``out_bytes`` before that backward, never low."""
    graph, measured = _captured("sum", mode, both=True)
    outs = [v for v in graph.nodes if graph.node(v)["is_output"]]
    assert [graph.node(v)["grad_seed_bytes"] for v in outs] == [4, 4]
    inner = [v for v in outs if graph.succ(v)]
    assert len(inner) == 1 and graph.grad_bytes(inner[0]) == graph.node(inner[0])["out_bytes"]
    predicted = simulate(graph, no_recompute_plan(graph)).peak_bytes
    assert measured <= predicted <= measured + graph.node(inner[0])["out_bytes"], (predicted, measured)


def test_seed_survives_json_and_does_not_scale_with_the_batch() -> None:
    graph, _ = _captured("sum", "module")
    (out,) = [v for v in graph.nodes if graph.node(v)["is_output"]]
    back = Graph.from_json(graph.to_json())
    assert back.node(out)["grad_seed_bytes"] == 4
    assert simulate(back, no_recompute_plan(back)).peak_bytes == simulate(graph, no_recompute_plan(graph)).peak_bytes
    assert graph.scaled(8).grad_bytes(out) == 32  # scaled as out_bytes: a dense part would grow
    assert graph.scaled(1e-9).grad_bytes(out) == graph.scaled(1e-9).node(out)["out_bytes"]  # at most out_bytes
    old = graph.to_dict()
    for d in old["nodes"]:
        del d["grad_seed_bytes"]  # a graph written before the field: the seed is out_bytes
    assert Graph.from_dict(old).grad_bytes(out) == graph.node(out)["out_bytes"]


class _TwoOut(nn.Module):
    """A module node with two outputs (a leaf module: its ops are no nodes of their own)."""

    def __init__(self) -> None:
        super().__init__()
        self.wa = nn.Parameter(torch.randn(128, 128) / 12)
        self.wb = nn.Parameter(torch.randn(128, 128) / 12)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tanh(x @ self.wa), torch.tanh(x @ self.wb)


def _two_out() -> tuple[nn.Module, torch.Tensor, Callable[[Any], torch.Tensor]]:
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(128, 128), nn.Tanh(), _TwoOut()), torch.randn(512, 128)
    return model, x, lambda o: o[0].sum() + (o[1] * o[1]).mean()


def test_a_node_with_two_outputs_gets_the_sum_of_their_seeds() -> None:
    """The loss hands one output of the node an expanded scalar (4 bytes), the other a dense
    gradient (its 262,144 bytes): the node's seed is their sum, and the step is predicted."""
    model, x, fn = _two_out()
    graph = autoremat.capture(model, (x,), loss_fn=fn, mode="module", repeats=1, warmup=0)
    (out,) = [v for v in graph.nodes if graph.node(v)["is_output"]]
    assert graph.node(out)["out_bytes"] == 2 * 262144 and graph.node(out)["grad_seed_bytes"] == 262144 + 4
    measured = measure(model, (x,), loss_fn=fn, steps=1, warmup=0).peak_bytes
    predicted = simulate(graph, no_recompute_plan(graph)).peak_bytes
    assert abs(predicted - measured) <= TOLERANCE * measured, (predicted, measured)


@pytest.mark.parametrize("bytes_from", ["meta", "linear fit"])
def test_scaled_capture_keeps_the_seed(bytes_from: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step profiled within a limit (:func:`autoremat.capture_within`): from the meta-device
    capture at full size, and from the linear fit of real captures at sizes that fit (the meta
    capture turned off), the output's seed is the full capture's one element."""
    from autoremat.capture import scaled
    from autoremat.cost import unoptimised_peak_bytes

    full, _ = _captured("sum", "module")
    if bytes_from == "linear fit":
        monkeypatch.setattr(scaled, "meta_capture", lambda *args, **kwargs: None)
    torch.manual_seed(0)
    model, x = _Three(), torch.randn(512, 128)
    limit = int(full.param_grad_bytes + 0.6 * (unoptimised_peak_bytes(full) - full.param_grad_bytes))
    g = autoremat.capture_within(model, (x,), loss_fn=LOSSES["sum"], limit_bytes=limit, repeats=1)
    assert g.meta["scaled"]["bytes_from"] == bytes_from
    (out,) = [v for v in g.nodes if g.node(v)["is_output"]]
    assert g.node(out)["grad_seed_bytes"] == 4 and g.grad_bytes(out) == full.grad_bytes(out) == 4
    model, x, fn = _two_out()  # a seed with a dense part: fitted like the other bytes
    full = autoremat.capture(model, (x,), loss_fn=fn, mode="module", repeats=1, warmup=0)
    limit = int(full.param_grad_bytes + 0.6 * (unoptimised_peak_bytes(full) - full.param_grad_bytes))
    g = autoremat.capture_within(model, (x,), loss_fn=fn, limit_bytes=limit, mode="module", repeats=1)
    assert g.meta["scaled"]["bytes_from"] == bytes_from and g.meta["scaled"]["sizes"][-1] < 512
    (out,) = [v for v in g.nodes if g.node(v)["is_output"]]
    assert g.node(out)["grad_seed_bytes"] == full.node(out)["grad_seed_bytes"] == 262144 + 4
