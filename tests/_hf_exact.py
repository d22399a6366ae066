"""One check for every Hugging Face model the tests train: capture, plans, apply; gradients bit for
bit the unpatched model's and the step peak within 10 % of the prediction (CPU storage counter)."""

from __future__ import annotations

from typing import Any

import torch

import autoremat
from autoremat.cost import no_recompute_plan, simulate
from autoremat.measure import gradients, gradients_equal, measure, run_step

TOLERANCE = 0.10


def _grads(model: torch.nn.Module, args: tuple, kwargs: dict, loss: Any) -> dict:
    torch.manual_seed(11)  # the same dropout masks in every run
    run_step(model, args, kwargs, loss)
    return gradients(model)


def plans_at(graph: autoremat.Graph, fractions: tuple[float, ...]) -> list[autoremat.Plan]:
    """Plans at these fractions of the predicted peak and at the least budget (a budget below the
    least one gives the least plan instead), one per budget, the least one last."""
    plans: list[autoremat.Plan] = []
    at: dict[int, autoremat.Plan] = {}  # by the budget solved at: a fraction below the least is the least

    def solve(budget: int) -> autoremat.Plan:
        if budget not in at:
            at[budget] = autoremat.solve(graph, budget)
        return at[budget]

    vanilla = simulate(graph, no_recompute_plan(graph)).peak_bytes
    for budget in (*(int(f * vanilla) for f in fractions), 1):
        try:
            plan = solve(budget)
        except autoremat.InfeasibleBudgetError as err:
            assert err.min_budget_bytes is not None and err.min_budget_bytes > budget
            plan = solve(err.min_budget_bytes)
        plans.append(plan)
    return plans


def trains_exactly(name: str, model: torch.nn.Module, args: tuple, kwargs: dict, loss: Any,
                   fractions: tuple[float, ...] = (0.5,), output_kept: str = "loss",
                   mode: str = "auto", solved: list[autoremat.Plan] | None = None,
                   times: str = "flops") -> autoremat.Graph:
    """The check (module docstring) at :func:`plans_at` ``fractions``; returns the graph.
    ``output_kept``: the graph's ``meta["output_kept"]``, and the measured steps keep the returned
    object to the end of backward where it is ``"step"``; ``mode``: :func:`autoremat.capture`'s;
    ``solved``: where given, :func:`plans_at`'s plans are appended to it (the least budget's last),
    each trained (a plan equal to an earlier one is trained once); ``times``: the capture's."""
    # FLOP times by default: the question is the runtime (exact gradients, predicted peaks), not the
    # timing; a deterministic graph is solved once per budget, where measured times add auto's
    # reference-cost solve (solvers.stable) to each. Measured captures of these models: test_hf_zoo's
    # refusal test, test_hf_breadth's bf16 captures, test_held_outputs (times="measured").
    graph = autoremat.capture(model, args, kwargs, loss_fn=loss, repeats=1, warmup=0, mode=mode, times=times)
    graph.meta["output_kept"] = output_kept
    keep = output_kept == "step"
    vanilla = measure(model, args, kwargs, loss_fn=loss, steps=1, warmup=0, keep_output=keep).peak_bytes
    predicted = simulate(graph, no_recompute_plan(graph)).peak_bytes
    assert abs(predicted - vanilla) <= TOLERANCE * vanilla, (name, predicted, vanilla)
    reference = _grads(model, args, kwargs, loss)
    plans = plans_at(graph, fractions)
    if solved is not None:
        solved.extend(plans)
    assert any(p.recompute_segments for p in plans), f"{name}: no plan recomputes anything"
    for k, plan in enumerate(plans):
        if any(p.segments == plan.segments for p in plans[:k]):
            continue
        autoremat.apply(model, plan)
        try:
            peak = measure(model, args, kwargs, loss_fn=loss, steps=1, warmup=0, keep_output=keep).peak_bytes
            grads = _grads(model, args, kwargs, loss)
        finally:
            autoremat.restore(model)
        assert gradients_equal(reference, grads), f"{name}: gradients changed under {plan.describe()}"
        assert abs(plan.predicted_peak_bytes - peak) <= TOLERANCE * peak, (name, plan.predicted_peak_bytes, peak)
        assert peak <= vanilla
        # a plan predicted below the unpatched peak measures below it (within the tolerance a plan
        # that is not applied at all would pass: the HF ResNet's plans are 0.967x)
        assert peak < vanilla or plan.predicted_peak_bytes >= vanilla, (name, plan.predicted_peak_bytes, peak, vanilla)
    return graph
