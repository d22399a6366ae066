"""A stack of layers in an ``nn.ModuleList`` and a linear head (module-level capture takes the
layers op by op), and one patched step checked against the unpatched gradients: the small models
of the capture tests of what backward hands each input (``test_module_inplace``, ``test_input_grads``), and of
what a node saves or uses (``test_unread_saves``, ``test_first_call``, ``test_inplace_on_view``)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

import autoremat
from autoremat.cost import no_recompute_plan, simulate
from autoremat.measure import LiveStorageCounter, gradients, gradients_equal, measure


class Stacked(nn.Module):
    def __init__(self, layer: Callable[[int], nn.Module], d: int = 16, n: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layer(d) for _ in range(n))
        self.head = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def step_gradients(model: nn.Module, x: torch.Tensor) -> dict:
    """The gradients of one ``sum`` step (dropout masks seeded)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    model(x).sum().backward()
    return gradients(model)


def planned_peak(model: nn.Module, x: torch.Tensor, plan: autoremat.Plan, reference: dict) -> int:
    """The measured step peak of ``model`` patched with ``plan``, whose gradients must equal ``reference``."""
    autoremat.apply(model, plan)
    try:
        assert gradients_equal(reference, step_gradients(model, x))
        return measure(model, (x,), steps=1, warmup=1).peak_bytes
    finally:
        autoremat.restore(model)


def predicted_and_measured(model: nn.Module, x: torch.Tensor, budget: str | None) -> tuple[autoremat.Graph, int, int]:
    """Capture ``model`` at module level (FLOP times), plan at ``budget`` (``None``: nothing
    recomputed) and run one ``sum`` step of a patched copy, whose gradients must equal the model's:
    ``(graph, predicted step peak, measured step peak)``."""
    graph = autoremat.capture(model, (x,), loss_fn=torch.sum, mode="module", times="flops")
    plan = no_recompute_plan(graph) if budget is None else autoremat.solve(graph, budget)
    return graph, simulate(graph, plan).peak_bytes, measured_under(model, x, None if budget is None else plan)


def measured_under(model: nn.Module, x: torch.Tensor, plan: autoremat.Plan | None) -> int:
    """The measured peak of one ``sum`` step of a copy of ``model`` patched with ``plan`` (``None``:
    unpatched), whose gradients must equal the model's."""
    patched = copy.deepcopy(model)
    if plan is not None:
        autoremat.apply(patched, plan)
    reference = step_gradients(model, x)
    counter = LiveStorageCounter()
    with counter:
        grads = step_gradients(patched, x)
    assert gradients_equal(reference, grads)
    return counter.peak


def selective_plan(graph: autoremat.Graph, keeps: Callable[[str], bool]) -> autoremat.Plan:
    """Every call region of ``layers.<i>`` recomputed, keeping the outputs of its ops whose target
    ``keeps`` names (a plan of selective regions, whatever a solver would choose)."""
    from autoremat.plan import Segment

    regions = {v[0]: v for path, v in graph.call_regions().items() if path.count(".") == 1 and path[:7] == "layers."}
    segs, v = [], 0
    while v < len(graph):
        if v in regions:
            nodes = regions[v]
            segs.append(Segment(nodes, True, tuple(u for u in nodes if keeps(graph.node(u)["target"]))))
            v = nodes[-1] + 1
        else:
            segs.append(Segment((v,), False))
            v += 1
    plan = autoremat.solve(graph, 10**12, solver="none")
    plan.segments = segs
    return autoremat.solvers.finalize_plan(graph, plan, 10**12, "hand")
