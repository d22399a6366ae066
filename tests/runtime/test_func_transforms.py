"""``torch.func`` transforms (``grad``, ``vjp``, ``jacrev``, ``vmap`` of them: per-sample gradients,
ensembles) take no saved-tensor hooks, which recomputed regions and offloading are built on: a
patched model runs as the user's model there (:mod:`autoremat.runtime.transforms`), with the same
values, where it raised "torch.func.{grad, vjp, jacrev, hessian} don't yet support saved tensor
hooks"; outside the transform it is patched as before."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import autoremat
from autoremat.runtime import offloader_of, transforms


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 32)) for _ in range(4)],
                         nn.Linear(32, 1))


def _per_sample(model: nn.Module, x: torch.Tensor) -> dict:
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(ps: dict, xi: torch.Tensor) -> torch.Tensor:
        return functional_call(model, ps, (xi[None],)).sum()

    return vmap(grad(loss), in_dims=(None, 0))(params, x)


@pytest.mark.parametrize(("mode", "solver"), [("fx", "auto"), ("module", "auto"), ("fx", "offload-dag")])
def test_per_sample_gradients_of_a_patched_model(mode: str, solver: str, caplog: pytest.LogCaptureFixture,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    model, x = _mlp(), torch.randn(64, 32)
    graph = autoremat.capture(model, (x,), loss_fn=torch.sum, times="flops", mode=mode)
    if solver == "auto":
        plan = autoremat.solve(graph, "min")
        assert plan.recompute_segments
    else:
        plan = autoremat.solve(graph, "90%", solver=solver, offload=True)
        assert plan.offload
    patched = autoremat.apply(copy.deepcopy(model), plan)
    monkeypatch.setattr(transforms, "_SAID", [])
    with caplog.at_level(logging.WARNING, logger="autoremat.runtime"):
        got = _per_sample(patched, x[:4])
    expected = _per_sample(model, x[:4])
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
    assert [r.message for r in caplog.records].count(next(r.message for r in caplog.records
                                                          if "torch.func transform" in r.message)) == 1
    # a plain step afterwards still runs the plan
    patched.zero_grad(set_to_none=True)
    patched(x).sum().backward()
    if solver != "auto":
        assert offloader_of(patched).stats.packed_nodes
