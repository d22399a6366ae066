"""``torch.compile`` of a patched model: each recomputed region becomes PyTorch's checkpoint
higher-order op (no graph break), the compiled step trains like the unpatched model (gradients,
batch-norm statistics, dropout masks), and eager steps of the same patched model still use
autoremat's own runtime."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import autoremat
from autoremat.measure import gradients, run_step

torch._dynamo.config.cache_size_limit = 64  # every test compiles fresh models


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Conv2d(3, 8, 3, padding=1)]
    for _ in range(4):
        layers += [nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.2), nn.Conv2d(8, 8, 3, padding=1)]
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4)]
    return nn.Sequential(*layers).train()


class _Recorder:
    """A ``torch.compile`` backend that keeps the Dynamo graphs and runs them with ``aot_eager``
    (AOTAutograd with eager kernels: the same random numbers as eager for the same seed)."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        self.graphs.append(gm)
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend("aot_eager")(gm, example_inputs)

    def checkpoints(self) -> int:
        return sum(1 for gm in self.graphs for n in gm.graph.nodes
                   if n.op == "call_function" and "checkpoint" in str(n.target))


def _step(model: nn.Module, x: torch.Tensor, seed: int) -> tuple[dict, dict]:
    torch.manual_seed(seed)
    run_step(model, (x,))
    return gradients(model), {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("regions", ["lean", "torch"])
def test_a_patched_model_compiles_in_one_graph_and_trains_like_the_unpatched_one(regions: str) -> None:
    torch._dynamo.reset()
    model, x = _cnn(), torch.randn(4, 3, 16, 16)
    plan = autoremat.solve(autoremat.capture(model, (x,)), "60%", solver="dp-approx")
    assert plan.recompute_segments
    ref_grads, ref_state = _step(copy.deepcopy(model), x, seed=5)

    patched = autoremat.apply(copy.deepcopy(model), plan, regions=regions)
    backend = _Recorder()
    compiled = torch.compile(patched, backend=backend, fullgraph=True)  # a graph break would raise
    torch.manual_seed(5)
    loss = compiled(x).float().mean()
    loss.backward()
    assert backend.checkpoints() == len(plan.recompute_segments)
    for name, g in gradients(patched).items():
        assert torch.allclose(g, ref_grads[name], rtol=1e-5, atol=1e-6), name  # dropout masks agree too
    for name, v in patched.state_dict().items():
        assert torch.allclose(v.float(), ref_state[name].float(), rtol=1e-6, atol=1e-7), name  # stats updated once

    eager_grads, _ = _step(copy.deepcopy(patched), x, seed=5)  # the patched model itself, not compiled
    assert all(torch.equal(g, ref_grads[k]) for k, g in eager_grads.items())


def test_a_module_level_plan_compiles_too() -> None:
    """Module-level graphs wrap submodule calls (``ProbedCall``)."""
    torch._dynamo.reset()
    model, x = _cnn(), torch.randn(4, 3, 16, 16)
    graph = autoremat.capture(model, (x,), mode="module")
    plan = autoremat.solve(graph, autoremat.min_budget(graph, "dp-approx"), solver="dp-approx")
    assert plan.recompute_segments
    ref_grads, _ = _step(copy.deepcopy(model), x, seed=3)
    for regions in ("lean", "torch"):
        patched = autoremat.apply(copy.deepcopy(model), plan, regions=regions)
        backend = _Recorder()
        compiled = torch.compile(patched, backend=backend, fullgraph=True)
        torch.manual_seed(3)
        compiled(x).float().mean().backward()
        assert backend.checkpoints() == len(plan.recompute_segments)
        for name, g in gradients(patched).items():
            assert torch.allclose(g, ref_grads[name], rtol=1e-5, atol=1e-6), (regions, name)


def test_capture_apply_and_restore_see_through_a_compile_wrapper() -> None:
    """``torch.compile(model)`` wraps ``model``; autoremat works on the module inside, and Dynamo
    recompiles when ``apply`` / ``restore`` change its ``forward`` after a compiled step."""
    torch._dynamo.reset()
    model, x = _cnn(), torch.randn(4, 3, 16, 16)
    backend = _Recorder()
    compiled = torch.compile(model, backend=backend)
    compiled(x).float().mean().backward()  # compiled before any plan
    assert backend.checkpoints() == 0

    graph = autoremat.capture(compiled, (x,))
    plain = autoremat.capture(model, (x,))
    assert graph.meta["mode"] == "fx" and graph.fingerprint == plain.fingerprint
    assert len(backend.graphs) == 1  # capturing ran the module eagerly, not through Dynamo
    plan = autoremat.solve(graph, "60%", solver="dp-approx")

    assert autoremat.apply(compiled, plan) is compiled
    assert autoremat.is_patched(compiled) and autoremat.is_patched(model)
    compiled(x).float().mean().backward()
    assert backend.checkpoints() == len(plan.recompute_segments)
    with pytest.raises(ValueError, match="already patched"):
        autoremat.apply(model, plan)
    assert autoremat.restore(compiled) is compiled
    assert not autoremat.is_patched(model) and "forward" not in model.__dict__


def test_an_offload_plan_runs_eagerly_under_compile() -> None:
    """The offloader (streams, pinned buffers, per-step state) is eager code: Dynamo skips the
    patched forward, and the step offloads and trains as without compile."""
    from autoremat.plan import Plan, offloadable_nodes
    from autoremat.runtime import offloader_of
    from autoremat.solvers import finalize_plan

    torch._dynamo.reset()
    model, x = _cnn(), torch.randn(4, 3, 16, 16)
    g = autoremat.capture(model, (x,))
    base = autoremat.solve(g, "80%", solver="chen")
    order = sorted(offloadable_nodes(g, base))[:4]
    plan = finalize_plan(g, Plan(list(base.segments), solver="manual", offload=tuple(order)), 10**12, "manual")
    ref_grads, _ = _step(copy.deepcopy(model), x, seed=2)
    backend = _Recorder()
    compiled = torch.compile(autoremat.apply(model, plan), backend=backend)
    torch.manual_seed(2)
    compiled(x).float().mean().backward()
    assert backend.graphs == []  # nothing traced
    assert sorted(offloader_of(compiled).stats.packed_nodes) == order
    assert all(torch.equal(grad, ref_grads[k]) for k, grad in gradients(model).items())


def test_a_compiled_plan_under_autocast_matches_the_eager_autocast_step() -> None:
    torch._dynamo.reset()
    model, x = _cnn(), torch.randn(4, 3, 16, 16)
    plan = autoremat.solve(autoremat.capture(model, (x,)), "60%", solver="dp-approx")
    ref = copy.deepcopy(model)
    torch.manual_seed(1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ref(x)
    out.float().mean().backward()
    patched = autoremat.apply(copy.deepcopy(model), plan)
    backend = _Recorder()
    compiled = torch.compile(patched, backend=backend, fullgraph=True)
    torch.manual_seed(1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = compiled(x)
    assert out.dtype == torch.bfloat16
    out.float().mean().backward()
    assert backend.checkpoints() == len(plan.recompute_segments)
    expected = gradients(ref)
    for name, g in gradients(patched).items():
        assert torch.allclose(g, expected[name], rtol=1e-3, atol=1e-5), name
