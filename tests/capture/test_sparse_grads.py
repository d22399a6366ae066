"""Sparse parameter gradients (``nn.EmbeddingBag(sparse=True)``, ``nn.Embedding(sparse=True)``):
capture, plans and batch scaling (:mod:`autoremat.capture.sparse_grads`).

A recommender user's model: capture crashed on the sparse gradient (``Cannot access storage of
SparseTensorImpl``); after that, the cost model priced each table's gradient at the table's size
(predicted 1.72x the measured step peak on this model)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import autoremat
from autoremat.cost import simulate, unoptimised_peak_bytes


class Recommender(nn.Module):
    def __init__(self, tables: int = 3, rows: int = 1000, dim: int = 32) -> None:
        super().__init__()
        self.bags = nn.ModuleList(nn.EmbeddingBag(rows, dim, mode="sum", sparse=True) for _ in range(tables))
        self.item = nn.Embedding(rows, dim, sparse=True)
        self.bottom = nn.Sequential(nn.Linear(13, dim), nn.ReLU(), nn.Linear(dim, dim), nn.ReLU())
        self.top = nn.Sequential(nn.Linear(dim * (tables + 2), 128), nn.ReLU(), nn.Dropout(0.1),
                                 nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 1))

    def forward(self, dense: torch.Tensor, bags: torch.Tensor, item: torch.Tensor) -> torch.Tensor:
        z = [self.bottom(dense), self.item(item)] + [bag(bags[:, i]) for i, bag in enumerate(self.bags)]
        return self.top(torch.cat(z, 1)).squeeze(1)


def _inputs(batch: int, device: str = "cpu") -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(batch)
    out = (torch.randn(batch, 13, generator=g), torch.randint(0, 1000, (batch, 3, 8), generator=g),
           torch.randint(0, 1000, (batch,), generator=g))
    return tuple(t.to(device) for t in out)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.to_dense() if p.grad.is_sparse else p.grad for p in model.parameters()]


@pytest.fixture(scope="module")
def captured():
    torch.manual_seed(0)
    model, x = Recommender(), _inputs(32)
    return model, x, autoremat.capture(model, x, loss_fn=_loss)


def test_sparse_gradients_are_priced_as_autograd_makes_them(captured):
    model, x, g = captured
    names = [f"bags.{i}.weight" for i in range(3)] + ["item.weight"]
    assert g.meta["mode"] == "fx" and g.meta["sparse_grad_params"] == sorted(names)
    ref = copy.deepcopy(model)
    ref.zero_grad(set_to_none=True)
    _loss(ref(*x)).backward()
    for name, p in ref.named_parameters():
        grad = p.grad
        want = (sum(t.untyped_storage().nbytes() for t in (grad._indices(), grad._values())) if grad.is_sparse
                else p.numel() * p.element_size())
        assert g.meta["param_bytes"][name] == want, name
    assert g.meta["param_bytes"]["bags.0.weight"] < 1000 * 32 * 4  # 24 lookups a row: smaller than the table
    measured = autoremat.measure(model, x, loss_fn=_loss, steps=1).peak_bytes
    assert abs(unoptimised_peak_bytes(g) - measured) <= 64


def test_plans_apply_with_sparse_gradients(captured):
    model, x, g = captured
    plan = autoremat.solve(g, "min")
    assert plan.recomputed_nodes
    patched, ref = copy.deepcopy(model), copy.deepcopy(model)
    autoremat.apply(patched, plan)
    for m in (patched, ref):
        m.zero_grad(set_to_none=True)
        torch.manual_seed(3)
        _loss(m(*x)).backward()
    assert all(torch.equal(a, b) for a, b in zip(_grads(patched), _grads(ref)))
    measured = autoremat.measure(patched, x, loss_fn=_loss, steps=1).peak_bytes
    assert abs(simulate(g, plan).peak_bytes - measured) <= 64


def test_sparse_gradients_scale_with_the_batch(captured):
    _, _, g = captured
    double = g.scaled(2.0)
    for name, nbytes in g.meta["param_bytes"].items():
        assert double.meta["param_bytes"][name] == (2 * nbytes if name in g.meta["sparse_grad_params"] else nbytes)
    user = next(v for v in g.nodes if "bags.1.weight" in g.node(v)["params"])
    assert double.node(user)["param_grad_bytes"] == 2 * g.node(user)["param_grad_bytes"]
    # a capture at twice the batch: one index and one row per lookup, so exactly twice
    big = autoremat.capture(Recommender(), _inputs(64), loss_fn=_loss, times="flops")
    assert big.meta["param_bytes"]["bags.1.weight"] == double.meta["param_bytes"]["bags.1.weight"]


def test_meta_capture_prices_sparse_gradients_too(captured):
    _, _, g = captured
    with torch.device("meta"):
        model = Recommender()
    meta = autoremat.capture(model, _inputs(32, "meta"), loss_fn=_loss)
    assert meta.meta["sparse_grad_params"] == g.meta["sparse_grad_params"]
    assert meta.meta["param_bytes"] == g.meta["param_bytes"]


def test_capture_within_a_limit_profiles_at_smaller_batches():
    """Sparse gradients grow with the batch: the sizes that fit a limit are not ruled out by them."""
    torch.manual_seed(0)
    model, x = Recommender(), _inputs(64)
    full = unoptimised_peak_bytes(autoremat.capture(model, x, loss_fn=_loss, times="flops"))
    g = autoremat.capture_within(model, x, loss_fn=_loss, limit_bytes=int(0.6 * full))
    scaled = g.meta["scaled"]
    assert scaled["sizes"] and max(scaled["sizes"]) < 64 and "times_from" not in scaled
    assert g.meta["sparse_grad_params"] and g.meta["param_bytes"]["item.weight"] == 64 * (32 * 4 + 8)
