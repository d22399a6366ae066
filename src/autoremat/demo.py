"""The main job: train a zoo model a few steps without and with a plan, side by side.

Both runs start from the same weights and see the same synthetic batches and RNG; after every
step the gradients are compared bit for bit and the step peak is measured
(:func:`autoremat.measure.measure`'s definition). The result is a :class:`DemoReport`.

Step times are the median of seven interleaved pairs of timed runs; the report keeps each
pair's ratio, so that the table can say how noisy the timing was on this machine.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from . import zoo
from ._units import fmt_bytes
from .budget import is_min
from .capture import capture
from .capture.signature import check_inputs
from .errors import InfeasibleBudgetError
from .graph import Graph
from .measure import LiveStorageCounter, gradients, gradients_equal, measure, run_step
from .plan import Plan
from .progress import Progress
from .runtime import apply, restore
from .cost import no_recompute_plan, simulate
from .solvers import least_budget, solve

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
    least_bytes: int | None = None
    """The least step peak the solver reaches (the low end of the reachable range)."""
    peak_bytes: int = 0
    """The unoptimised step peak (predicted)."""
    budget_note: str | None = None
    """What happened to the budget (``"min"``, or below the least with ``on_infeasible="min"``)."""
    pair_ratios: list[float] = field(default_factory=list)
    """Patched / plain step time of each interleaved timing pair: their spread is the timing noise."""
    plan_source: str = "solved"


def _step(model: torch.nn.Module, x: torch.Tensor, seed: int) -> int:
    counter = LiveStorageCounter()
    torch.manual_seed(seed)
    with counter:
        run_step(model, (x,))
    return counter.peak


_TIMING_PAIRS = 7


def _choose(graph: Graph, budget: str, solver: str, on_infeasible: str) -> tuple[Plan, str | None]:
    """The plan for ``budget`` and a note on what happened to it (``None``: as asked)."""
    if is_min(budget):
        return solve(graph, "min", solver=solver), "min: the least reachable"
    try:
        return solve(graph, budget, solver=solver), None
    except InfeasibleBudgetError:
        if on_infeasible != "min":
            raise
    plan = solve(graph, "min", solver=solver)
    return plan, (f"below the least reachable, {fmt_bytes(int(plan.budget_bytes or 0))}; planned at the least "
                  "(--on-infeasible error to fail instead)")


def run_demo(model_name: str = "resnet50", budget: str = "50%", solver: str = "auto", steps: int = 4,
             seed: int = 0, *, plan: Plan | None = None, on_infeasible: str = "min", times: str | None = None,
             progress: Progress | None = None, timing_pairs: int = _TIMING_PAIRS) -> DemoReport:
    """Train ``model_name`` (small zoo size, CPU) ``steps`` steps plain and patched; compare.

    ``plan``: a saved plan to use instead of solving (refused, naming the difference, when made
    for another model or batch). ``on_infeasible``: ``"min"`` plans at the least reachable budget
    when ``budget`` is below it (and says so), ``"error"`` raises. ``times``: ``"measured"`` or
    ``"flops"`` (see :func:`autoremat.capture`). ``timing_pairs``: interleaved pairs of timed runs.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if timing_pairs < 1:
        raise ValueError(f"timing_pairs must be >= 1, got {timing_pairs}")
    progress = progress or Progress(enabled=False)
    base, (x,) = zoo.build(model_name, size="small", seed=seed)
    patched = copy.deepcopy(base)
    if plan is not None:  # before anything runs: another batch, or another model (apply traces it)
        check_inputs(plan, (x,))
        apply(patched, plan)
        restore(patched)
    with progress.phase(f"capture {model_name}") as phase:
        graph = capture(patched, (x,), times=times)
    capture_s = phase.elapsed_s
    note, source = None, "solved" if plan is None else "saved plan"
    with progress.phase("solve" if plan is None else "reachable range") as phase:
        if plan is None:
            plan, note = _choose(graph, budget, solver, on_infeasible)
        least = least_budget(graph, solver)
    solve_s = phase.elapsed_s
    apply(patched, plan)  # a plan made for another model: PlanMismatchError naming the first difference
    opt_a = torch.optim.SGD(base.parameters(), lr=0.01, momentum=0.9)
    opt_b = torch.optim.SGD(patched.parameters(), lr=0.01, momentum=0.9)
    peaks_a, peaks_b, equal = [], [], True
    gen = torch.Generator().manual_seed(seed)
    with progress.phase(f"train {steps} steps plain and patched, gradients compared") as phase:
        for i in range(steps):
            phase.step(f"step {i + 1}/{steps}")
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
    with progress.phase(f"time {timing_pairs} interleaved pairs of steps") as phase:
        for i in range(timing_pairs):
            phase.step(f"pair {i + 1}/{timing_pairs}")
            for model, measured in (runs if i % 2 == 0 else runs[::-1]):
                measured.append(measure(model, (x,), steps=3, warmup=1).step_time_s)
    restore(patched)
    vanilla_pred = simulate(graph, no_recompute_plan(graph), check=False, record=False).peak_bytes
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    report = DemoReport(model=model_name, nodes=len(graph), budget=budget, plan=plan, capture_s=capture_s,
                        solve_s=solve_s, least_bytes=least, peak_bytes=vanilla_pred, budget_note=note,
                        pair_ratios=[b / a for a, b in zip(times_a, times_b)], plan_source=source)
    report.rows.append(DemoRow("no recomputation", peaks_a[-1], vanilla_pred, med(times_a), None))
    report.rows.append(DemoRow(f"autoremat ({plan.solver})", peaks_b[-1], int(plan.predicted_peak_bytes or 0),
                               med(times_b), equal))
    return report
