"""The issue-25 target, slow: ten captures of a zoo model on this machine give one plan at 50 %."""

from __future__ import annotations

import pytest

import autoremat


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet50", "densenet121"])
def test_ten_captures_give_one_plan_at_half_the_peak(name: str) -> None:
    model, inputs = autoremat.zoo.build(name, size="small")
    plans = set()
    for _ in range(10):
        plan = autoremat.solve(autoremat.capture(model, inputs), "50%")
        plans.add((plan.solver, tuple((s.nodes, s.recompute) for s in plan.segments)))
    assert len(plans) == 1
