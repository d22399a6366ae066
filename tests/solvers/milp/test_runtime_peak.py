"""``milp``'s plans on the real runtime: the measured step peak against the simulator's.

``milp`` finds plans no other solver makes (plain segments in a new order, one small
recomputed segment between plain ones), so it reaches the corners where the simulator and the
runtime may differ. Measured on the CPU-size U-Net (x86_64, 2 cores, CPU only): the plan that
only reorders (3 plain segments, 85.6 % of the unoptimised peak) is predicted within 8 bytes;
the 75 % plan (recomputing ``pool1`` alone between plain segments) was measured at 7,038,912 B
against 6,700,856 B predicted, 4.2 % over its budget, until the CPU meter counted a gradient sum
the autograd engine makes in place under a dispatch mode as out of place (issue 28, fixed in the
live-storage counter): it now measures its prediction within 64 B.
"""

from __future__ import annotations

import copy

import pytest

import autoremat
from autoremat import zoo
from autoremat.cost import unoptimised_peak_bytes
from autoremat.measure import measure

pytest.importorskip("highspy")


def _unet():
    model, args = zoo.build("unet", size="small")[:2]
    return model, args, autoremat.capture(model, args)


def _measured(model, args, plan) -> int:
    m = copy.deepcopy(model)
    autoremat.apply(m, plan)
    return measure(m, args, steps=1).peak_bytes


@pytest.mark.slow
def test_a_reordering_plan_is_predicted_exactly():
    model, args, g = _unet()
    budget = int(0.856 * unoptimised_peak_bytes(g))
    plan = autoremat.solve(g, budget, solver="milp", time_limit_s=30)
    assert not plan.recompute_segments and len(plan.segments) > 1  # a new order, nothing recomputed
    assert abs(_measured(model, args, plan) - plan.predicted_peak_bytes) <= 64


@pytest.mark.slow
def test_the_75_percent_plan_fits_on_the_runtime():
    model, args, g = _unet()
    budget = int(0.75 * unoptimised_peak_bytes(g))
    plan = autoremat.solve(g, budget, solver="milp", time_limit_s=30)
    measured = _measured(model, args, plan)
    assert measured <= budget
    assert abs(measured - plan.predicted_peak_bytes) <= 64
