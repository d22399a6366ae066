"""The one definition of resident bytes (autoremat.resident)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autoremat.resident import device_of, optimizer_state_bytes, resident_bytes, storage_bytes


def _model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 8))
    m[0].weight.requires_grad_(False)  # a frozen parameter is still resident
    return m


def _param_bytes(m: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in m.parameters())


def test_parameters_buffers_and_inputs_counted_once() -> None:
    m = _model()
    x = torch.randn(4, 8)
    buffers = sum(b.numel() * b.element_size() for b in m.buffers())
    assert resident_bytes(m) == _param_bytes(m) + buffers
    assert resident_bytes(m, inputs=(x, {"again": x[:2]})) == _param_bytes(m) + buffers + x.numel() * 4


def test_tied_weights_counted_once() -> None:
    a, b = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)
    b.weight = a.weight
    m = nn.Sequential(a, b)
    assert resident_bytes(m) == 16 * 4


def test_gradients_present_or_expected() -> None:
    m = _model()
    trainable = sum(p.numel() * 4 for p in m.parameters() if p.requires_grad)
    base = resident_bytes(m)
    assert resident_bytes(m, grads="present") == base  # none allocated yet
    assert resident_bytes(m, grads="expected") == base + trainable
    m(torch.randn(4, 8)).sum().backward()
    assert resident_bytes(m, grads="present") == base + trainable
    with pytest.raises(ValueError, match="grads="):
        resident_bytes(m, grads="all")  # type: ignore[arg-type]


def test_optimizer_state_estimated_before_the_first_step() -> None:
    m = _model()
    trainable = sum(p.numel() * 4 for p in m.parameters() if p.requires_grad)
    opt = torch.optim.Adam(m.parameters())
    assert optimizer_state_bytes(opt) == 2 * trainable
    assert resident_bytes(m, optimizers=[opt]) == resident_bytes(m) + 2 * trainable
    assert resident_bytes(m, optimizers=[opt], optimizer_state="present") == resident_bytes(m)
    assert optimizer_state_bytes(torch.optim.SGD(m.parameters(), lr=0.1)) == 0
    assert optimizer_state_bytes(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)) == trainable
    m(torch.randn(4, 8)).sum().backward()
    opt.step()
    measured = storage_bytes(list(opt.state.values()))
    assert optimizer_state_bytes(opt) == measured >= 2 * trainable
    assert resident_bytes(m, optimizers=[opt]) == resident_bytes(m) + measured


def test_device_of() -> None:
    assert device_of(nn.Linear(2, 2)) == torch.device("cpu")
    assert device_of(nn.ReLU(), (torch.empty(1, device="meta"),)) == torch.device("meta")
    assert device_of(nn.ReLU()) == torch.device("cpu")


def test_shard_over_predicts_a_rank_of_a_sharded_model() -> None:
    """``shard_over``: parameters, gradients and optimizer state divided by the world size;
    buffers and inputs are not sharded."""
    m = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16))
    opt = torch.optim.Adam(m.parameters())
    x = torch.randn(4, 8)
    params = sum(p.numel() * 4 for p in m.parameters())
    buffers = storage_bytes(list(m.buffers()))
    whole = resident_bytes(m, inputs=(x,), optimizers=[opt], grads="expected")
    assert whole == buffers + storage_bytes(x) + 4 * params
    assert resident_bytes(m, inputs=(x,), optimizers=[opt], grads="expected", shard_over=4) == \
        buffers + storage_bytes(x) + params
    with pytest.raises(ValueError, match="shard_over=0"):
        resident_bytes(m, shard_over=0)
