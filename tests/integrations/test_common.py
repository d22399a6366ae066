"""Shared integration glue: the device budget turned into a step budget."""

from __future__ import annotations

import pytest

from autoremat import Graph
from autoremat.integrations._common import is_percentage, step_budget_bytes
from autoremat.cost import unoptimised_peak_bytes


def test_step_budget_forms() -> None:
    g = Graph.chain([100, 200, 300])
    peak = unoptimised_peak_bytes(g)
    assert step_budget_bytes("50%", g, "cpu", resident_bytes=10**9) == peak // 2
    assert step_budget_bytes(0.5, g, "cpu", resident_bytes=10**9) == peak // 2
    assert step_budget_bytes(5000, g, "cpu", resident_bytes=1000) == 4000
    assert step_budget_bytes("1KiB", g, "cpu", resident_bytes=24) == 1000
    assert step_budget_bytes("auto", g, "cpu", resident_bytes=10**15) > 0  # free memory excludes resident
    with pytest.raises(ValueError, match="resident before a step"):
        step_budget_bytes(1000, g, "cpu", resident_bytes=1000)


def test_is_percentage() -> None:
    assert is_percentage("40%") and is_percentage(0.4)
    assert not is_percentage("4GB") and not is_percentage(4) and not is_percentage("auto")


def test_auto_keeps_room_for_the_resident_bytes_not_allocated_yet(monkeypatch: pytest.MonkeyPatch) -> None:
    """Free memory already excludes what is allocated; optimizer state created at the first step
    and expected gradients are not allocated when the plan is made and must come off the budget."""
    import autoremat.budget as budget_mod

    monkeypatch.setattr(budget_mod, "device_free_bytes", lambda device=None: 10_000)
    g = Graph.chain([100])
    everything_there = step_budget_bytes("auto", g, "cpu", resident_bytes=3_000)
    assert everything_there == step_budget_bytes("auto", g, "cpu", resident_bytes=3_000, allocated_bytes=3_000) == 9_000
    assert step_budget_bytes("auto", g, "cpu", resident_bytes=3_000, allocated_bytes=1_000) == 7_000
    assert step_budget_bytes("auto", g, "cpu", resident_bytes=3_000, allocated_bytes=5_000) == 9_000  # never adds


def test_allocated_resident_bytes_counts_what_exists_on_the_device() -> None:
    import torch
    from torch import nn

    from autoremat.resident import allocated_resident_bytes, resident_bytes

    model = nn.Linear(10, 10)  # 440 bytes of parameters
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(4, 10)
    kw = {"inputs": (x,), "optimizers": [opt]}
    assert allocated_resident_bytes(model, device="cpu", **kw) == 440 + 160
    assert resident_bytes(model, grads="expected", **kw) == 440 + 440 + 440 + 160  # grads, momentum to come
    assert allocated_resident_bytes(model, device="meta", **kw) == 0
    model(x).sum().backward()
    opt.step()
    assert allocated_resident_bytes(model, device="cpu", **kw) == resident_bytes(model, grads="expected", **kw)
