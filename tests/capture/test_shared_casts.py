"""A layer that applies one linear twice (LongT5's key projection, on the hidden states and on the
global inputs) under bf16 autocast reads one cached cast of its weight twice: a recomputed region
would cast it at each use and sum the weight's gradient in float32. Capture pins those call regions
(:mod:`autoremat.capture.shared_casts`), so every plan trains bit for bit; in float32 nothing is pinned."""

from __future__ import annotations

import copy

import pytest
import torch
from _stacked import Stacked, step_gradients
from torch import nn

import autoremat
from autoremat.measure import gradients_equal


class _Twice(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.k, self.mix = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mix(self.k(x) * self.k(x.flip(1)))


@pytest.mark.parametrize("amp", [False, True])
def test_regions_reading_a_cast_twice_are_kept_and_plans_train_bit_for_bit(amp: bool) -> None:
    torch.manual_seed(0)
    model, x = Stacked(_Twice, d=16), torch.randn(4, 8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        graph = autoremat.capture(model, (x,), loss_fn=lambda y: y.float().sum(), mode="module", times="flops")
        reference = step_gradients(model, x)
        plan = autoremat.solve(graph, "min")
        patched = copy.deepcopy(model)
        autoremat.apply(patched, plan)
        assert gradients_equal(reference, step_gradients(patched, x))
    pinned = set(graph.meta["pinned_regions"])
    if amp:  # each layer; not the calls of its k (run twice per step: they keep the step's casts)
        assert pinned == {f"layers.{i}" for i in range(3)}, pinned
        assert not any(graph.node(s.nodes[0])["scope"] and s.nodes[0] in plan.module_calls
                       and plan.module_calls[s.nodes[0]][0] in pinned for s in plan.recompute_segments)
    else:
        assert not pinned


def test_a_capture_within_a_limit_pins_them_too() -> None:
    """The meta-device capture and the small real ones of :func:`autoremat.capture_within` (a step that
    does not fit) see the same cached casts."""
    torch.manual_seed(0)
    model, x = Stacked(_Twice, d=16), torch.randn(4, 8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        graph = autoremat.capture_within(model, (x,), loss_fn=lambda y: y.float().sum(), mode="module",
                                         limit_bytes=10**5)
    assert set(graph.meta["pinned_regions"]) == {f"layers.{i}" for i in range(3)}
