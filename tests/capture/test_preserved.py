"""A capture runs the model several times (warm-up, timing repeats, the recorded step); what a
forward does to the modules' own attributes is put back (:mod:`autoremat.capture.preserved`).
Before: a module counting its calls counted 9 after one capture (18 after two), the list it
appends to grew as much, and a tensor it adds to in place moved with them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autoremat
from autoremat.capture.scaled import capture_within


class _Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.calls, self.seen, self.total = 0, [], torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.seen.append(x.shape[0])
        self.total += x.shape[0]
        self.cache = x.shape  # an attribute the forward adds
        return self.linear(x).relu()


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = _Counting(), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


@pytest.mark.parametrize("how", ["auto", "module", "within"])
def test_a_capture_leaves_the_modules_attributes_as_they_were(how: str) -> None:
    net = _Net()
    x = torch.randn(4, 8)
    if how == "within":
        capture_within(net, (x,), {}, limit_bytes=None, repeats=3, warmup=1)
    else:
        autoremat.capture(net, (x,), mode=how)
    body = net.body
    assert (body.calls, body.seen, body.total.item(), hasattr(body, "cache")) == (0, [], 0.0, False)
    net(x)
    assert (body.calls, body.seen, body.total.item()) == (1, [4], 4.0)  # the user's own call counts
