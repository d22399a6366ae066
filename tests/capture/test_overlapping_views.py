"""A view with overlapping windows (``as_strided`` over a padded projection, Longformer's sliding-window
chunks) runs a slow backward: an index tensor and a copy beside its input's gradient, which capture
measures as the view's backward workspace. At module level the view has no readers of its own (they
read its root), so the cost model gets that workspace from :mod:`autoremat.cost.grad_handoff`: without
it the unpatched step below was predicted 0.852x its measured peak and the least plan 0.818x."""

from __future__ import annotations

import pytest
import torch
from _stacked import Stacked, predicted_and_measured
from torch import nn


class _SlidingChunks(nn.Module):
    def __init__(self, width: int, window: int = 8, step: int = 2) -> None:
        super().__init__()
        self.proj, self.mix = nn.Linear(width, width), nn.Linear(width, width)
        self.window, self.step = window, step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.pad(self.proj(x), (0, 0, self.window // 2, self.window // 2))
        b, s, d = x.shape
        st = h.stride()
        windows = h.as_strided((b, s // self.step, self.window, d), (st[0], self.step * st[1], st[1], st[2]))
        y = (windows * windows).sum(2)
        return x + self.mix(torch.repeat_interleave(y, self.step, dim=1))


@pytest.mark.parametrize("budget", [None, "min"])
def test_an_overlapping_views_backward_workspace_is_in_the_prediction(budget: str | None) -> None:
    torch.manual_seed(0)
    graph, predicted, peak = predicted_and_measured(Stacked(_SlidingChunks, d=32), torch.randn(4, 64, 32), budget)
    views = [v for v in graph.nodes if graph.node(v)["name"].endswith("as_strided.default")]
    assert len(views) == 3
    assert all(graph.node(v)["bwd_temp_bytes"] > 0 and not list(graph.succ(v)) for v in views)
    assert 0.99 * peak <= predicted <= 1.01 * peak
