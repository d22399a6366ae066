"""``torch.nn.utils.parametrize.cached()``: a parametrized weight (``orthogonal`` here) is computed
once in the block and reused. With the backward inside the block, a recomputed region's replay found
the weight its forward computed in the cache and skipped the parametrization's ops: before,
``RecomputationMismatchError`` ("saved 2 tensors where its forward saved 4") on the least plan of the
stack below. The recomputation now runs with the cache as the region's forward found it
(:class:`autoremat.runtime.substituted.HeldState`) and leaves it as it was."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.utils.parametrize as P
from torch import nn
from torch.nn.utils.parametrizations import orthogonal

import autoremat


class _Orthogonal(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.ModuleList(orthogonal(nn.Linear(16, 16)) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in self.l:
            x = torch.tanh(lin(x))
        return self.l[0](x)  # the first weight read twice: a cache hit in the forward too


@pytest.mark.parametrize("regions", ["lean", "torch"])
@pytest.mark.parametrize("mode", ["module", "fx"])
def test_a_backward_inside_parametrize_cached_recomputes_as_the_forward_ran(mode: str, regions: str) -> None:
    torch.manual_seed(0)
    ref, x = _Orthogonal(), torch.randn(8, 16)
    model = copy.deepcopy(ref)
    plan = autoremat.solve(autoremat.capture(model, (x,), mode=mode, repeats=1, warmup=0), "min")
    assert plan.recompute_segments
    autoremat.apply(model, plan, regions=regions)
    for inside in (True, False, True):
        grads = []
        for m in (ref, model):
            m.zero_grad(set_to_none=True)
            with P.cached():
                loss = m(x).sum()
                if inside:
                    loss.backward()
                    assert P._cache_enabled == 1 and len(P._cache) == 4  # left as the forward filled it
            if not inside:
                loss.backward()
            grads.append([p.grad for p in m.parameters()])
        assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert P._cache_enabled == 0 and not P._cache
