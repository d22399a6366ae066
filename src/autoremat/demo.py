"""The main job: train a zoo model a few steps without and with a plan, side by side.

Both runs start from the same weights and see the same synthetic batches and RNG; after every
step the gradients are compared bit for bit and the step peak is measured
(:func:`autoremat.measure.measure`'s definition). The result is a :class:`DemoReport`.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import torch

from . import zoo
from .capture import capture
from .errors import InfeasibleBudgetError
from .measure import LiveStorageCounter, gradients, gradients_equal, measure, run_step
from .plan import Plan
from .runtime import apply, restore
from .cost import no_recompute_plan, simulate
from .solvers import solve

__all__ = ["DemoRow", "DemoReport", "run_demo"]


@dataclass
class DemoRow:
    label: str
    measured_peak_bytes: int
    predicted_peak_bytes: int
    step_time_s: float
    grads_equal: bool | None


@dataclass
class DemoReport:
    model: str
    nodes: int
    budget: str
    plan: Plan
    rows: list[DemoRow] = field(default_factory=list)
    capture_s: float = 0.0
    solve_s: float = 0.0


def _step(model: torch.nn.Module, x: torch.Tensor, seed: int) -> int:
    counter = LiveStorageCounter()
    torch.manual_seed(seed)
    with counter:
        run_step(model, (x,))
    return counter.peak


_TIMING_PAIRS = 7


def run_demo(model_name: str = "resnet50", budget: str = "50%", solver: str = "auto", steps: int = 4,
             seed: int = 0) -> DemoReport:
    """Train ``model_name`` (small zoo size, CPU) ``steps`` steps plain and patched; compare."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    base, (x,) = zoo.build(model_name, size="small", seed=seed)
    patched = copy.deepcopy(base)
    t0 = time.perf_counter()
    graph = capture(patched, (x,))
    capture_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    try:
        plan = solve(graph, budget, solver=solver)
    except InfeasibleBudgetError as err:
        if err.min_budget_bytes is None:
            raise
        plan = solve(graph, err.min_budget_bytes, solver=solver)
        budget = f"{budget} (infeasible; used the minimum {err.min_budget_bytes} B)"
    solve_s = time.perf_counter() - t0
    apply(patched, plan)
    opt_a = torch.optim.SGD(base.parameters(), lr=0.01, momentum=0.9)
    opt_b = torch.optim.SGD(patched.parameters(), lr=0.01, momentum=0.9)
    peaks_a, peaks_b, equal = [], [], True
    gen = torch.Generator().manual_seed(seed)
    for i in range(steps):
        batch = torch.randn(x.shape, generator=gen) if x.is_floating_point() else x
        peaks_a.append(_step(base, batch, seed + i))
        peaks_b.append(_step(patched, batch, seed + i))
        equal = equal and gradients_equal(gradients(base), gradients(patched))
        opt_a.step()
        opt_b.step()
    # Step time apart from the counted steps (the counter slows every op): interleaved pairs,
    # the order flipped every pair
    times_a: list[float] = []
    times_b: list[float] = []
    runs = ((base, times_a), (patched, times_b))
    for i in range(_TIMING_PAIRS):
        for model, times in (runs if i % 2 == 0 else runs[::-1]):
            times.append(measure(model, (x,), steps=3, warmup=1).step_time_s)
    restore(patched)
    vanilla_pred = simulate(graph, no_recompute_plan(graph), check=False, record=False).peak_bytes
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    report = DemoReport(model=model_name, nodes=len(graph), budget=budget, plan=plan,
                        capture_s=capture_s, solve_s=solve_s)
    report.rows.append(DemoRow("no recomputation", peaks_a[-1], vanilla_pred, med(times_a), None))
    report.rows.append(DemoRow(f"autoremat ({plan.solver})", peaks_b[-1], int(plan.predicted_peak_bytes or 0),
                               med(times_b), equal))
    return report
