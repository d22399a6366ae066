"""A forward that writes its input in place (``x.mul_(0.5).add_(0.1)``: normalising the batch):

* a capture leaves the example batch as it was (:mod:`autoremat.capture.param_writes`). Before, the
  batch came back normalised once per run of the capture;
* at fx level, the readers of the input after the write follow the in-place op in the graph
  (:func:`autoremat.capture.inplace.write_order`): ``self.a(x)`` takes the placeholder, not the in-place
  op's result, so before, a plan could run ``a`` first (measured: every plan recomputing ``a`` did,
  and the backward raised, the forward having read the batch unnormalised)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import autoremat

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from semantics_cases import plan_for  # noqa: E402

W = 16


class Normalising(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.bn, self.b = nn.Linear(W, W), nn.BatchNorm1d(W), nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(0.5).add_(0.1)
        return self.b(torch.relu(self.bn(self.a(x))))


class ViewBeforeWrite(nn.Module):
    """A view of the input taken before the write, read after it (reads the written values)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(W // 2, W), nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = x[:, : W // 2]
        x.mul_(2.0)
        return self.b(torch.tanh(self.a(v)))


@pytest.mark.parametrize("mode", ["fx", "module"])
def test_capture_leaves_the_batch_its_forward_normalises_as_it_was(mode: str) -> None:
    x = torch.randn(8, W)
    before = x.clone()
    autoremat.capture(Normalising(), (x,), mode=mode, repeats=2, warmup=1)
    assert torch.equal(x, before)


@pytest.mark.parametrize("model_cls", [Normalising, ViewBeforeWrite])
@pytest.mark.parametrize("mode", ["fx", "module"])
def test_every_plan_reads_the_input_after_the_forward_wrote_it(model_cls: type, mode: str) -> None:
    torch.manual_seed(0)
    model, x = model_cls(), torch.randn(8, W)
    graph = autoremat.capture(model, (x,), mode=mode, repeats=1, warmup=0)
    if mode == "fx" and model_cls is Normalising:
        names = {graph.node(v)["name"]: v for v in graph.nodes}
        assert names["add_"] in graph.pred(names["a"])  # the order edge
    ref = copy.deepcopy(model)
    x_ref = x.clone()
    ref(x_ref).sum().backward()
    plans = [autoremat.solve(graph, "min", solver=s) for s in ("auto", "chen", "dp-approx", "xla-greedy")]
    plans.append(plan_for(graph, "each", None))  # every recomputable node its own recomputed region
    for plan in plans:
        patched = autoremat.apply(copy.deepcopy(model), plan)
        x_pat = x.clone()
        patched(x_pat).sum().backward()
        assert torch.equal(x_pat, x_ref)
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(ref.parameters(), patched.parameters()))
    assert all(plan.recompute_segments for plan in plans[-1:] + (plans[:1] if model_cls is Normalising else []))


class _ManyWrites(nn.Module):
    """Twenty writes of the input, each read before and after."""

    def __init__(self) -> None:
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(W, W) for _ in range(20))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros_like(x)
        for lin in self.lins:
            h = h + lin(x)
            x.mul_(0.9)
        return h


def test_order_edges_grow_with_the_writes_and_readers_not_their_product() -> None:
    from autoremat.capture.fx import trace
    from autoremat.capture.inplace import write_order

    order = write_order(trace(_ManyWrites()))
    edges = sum(len(v) for v in order.values())
    assert 20 * 2 <= edges <= 3 * (20 + 21)  # each reader tied to the writes on either side; writes chained
