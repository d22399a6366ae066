"""A forward changing a list, dict or set attribute in place (``self.features.append(h)``) keeps
that side effect exact (:mod:`autoremat.capture.container_writes`): an fx trace refuses it (the
generated forward ran it never: an empty list after three patched steps), ``mode="auto"`` captures
at module level, and module calls doing it are kept from recomputation (a replay ran it twice)."""

from __future__ import annotations

import copy

import pytest
import torch
from _stacked import Stacked, step_gradients
from torch import nn

import autoremat
from autoremat.capture._tracing import StateAssignmentError, semantic_trace
from autoremat.measure import gradients_equal


class _Logging(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 1)
        self.log: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.log.append(1)
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def test_an_fx_trace_refuses_a_forward_appending_to_a_list() -> None:
    model, x = _Logging(), torch.randn(64, 32)
    with pytest.raises(StateAssignmentError, match=r"changes _Logging\.log in place"):
        semantic_trace(model)
    assert model.log == []  # put back
    with pytest.raises(ValueError, match=r"changes _Logging\.log in place.*mode='module'"):
        autoremat.capture(model, (x,), loss_fn=torch.sum, mode="fx")
    assert model.log == []  # put back
    graph = autoremat.capture(model, (x,), loss_fn=torch.sum, times="flops")  # auto: module level
    assert graph.meta["mode"] == "module" and model.log == []
    patched = autoremat.apply(model, autoremat.solve(graph, "min"))
    for _ in range(3):
        patched(x).sum().backward()
    assert patched.log == [1, 1, 1]


class _Seen(nn.Module):
    """Captured op by op (a block with a child); its branch halves from its third call on."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.shape[0])
        return x + torch.tanh(self.lin(x)) * (1.0 if len(self.seen) < 3 else 0.5)


class _Stats(nn.Module):
    """A leaf (one node): counts in a dict of lists."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d) / d**0.5)
        self.stats: dict[str, list[int]] = {"calls": []}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.stats["calls"].append(1)
        return x + torch.tanh(x @ self.w)


class _Plain(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


@pytest.mark.parametrize("layer", [_Seen, _Stats, _Plain])
def test_module_calls_changing_a_container_are_kept(layer: type[nn.Module]) -> None:
    torch.manual_seed(0)
    model, x = Stacked(layer, d=32, n=4), torch.randn(64, 32)
    graph = autoremat.capture(model, (x,), loss_fn=torch.sum, times="flops", mode="module")
    label = {_Seen: "_Seen.seen", _Stats: "_Stats.stats"}.get(layer)
    assert graph.meta["pinned_by_container_write"] == ({f"layers.{i}": label for i in range(4)} if label else {})
    assert set(graph.meta["pinned_regions"]) == (set(graph.meta["pinned_by_container_write"]) if layer is _Seen
                                                 else set())
    plan = autoremat.solve(graph, "min")
    assert bool(plan.recompute_segments) == (layer is _Plain)
    patched = autoremat.apply(copy.deepcopy(model), plan)
    for _ in range(3):
        assert gradients_equal(step_gradients(model, x), step_gradients(patched, x))
    if layer is _Seen:
        assert [len(m.seen) for m in patched.layers] == [len(m.seen) for m in model.layers] == [3] * 4
