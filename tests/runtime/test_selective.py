"""Selective saves inside module regions: gradients bit-for-bit, the kept op outputs really kept
(the step peak lies between per-layer checkpointing and no checkpointing), exact restore."""

from __future__ import annotations

import copy

import pytest
import torch

from autoremat.measure import gradients, gradients_equal, measure, run_step
from autoremat.runtime.selective import apply_selective, is_selective, layer_paths, restore_selective

pytest.importorskip("transformers")
from autoremat.zoo import hf  # noqa: E402  (needs transformers)


def _grads(ex: hf.HFExample) -> dict:
    torch.manual_seed(5)  # BERT has dropout on: same masks in every run
    run_step(ex.model, ex.args, ex.kwargs, ex.loss_fn)
    return gradients(ex.model)


def _peak(ex: hf.HFExample) -> int:
    return measure(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, steps=1, warmup=0).peak_bytes


@pytest.mark.parametrize("name", ["bert", "llama"])
def test_selective_layers_gradients_and_peaks(name: str) -> None:
    ex = hf.example(name)
    paths = layer_paths(ex.model)
    assert len(paths) == 4 and all(".layer" in p for p in paths)
    reference, vanilla = _grads(ex), _peak(ex)
    peaks = {}
    for policy in ("none", "matmuls", {0, 3}):
        apply_selective(ex.model, {p: policy for p in paths})
        try:
            peaks[str(policy)] = _peak(ex)
            assert gradients_equal(reference, _grads(ex)), policy
        finally:
            restore_selective(ex.model)
    # keeping matmul outputs costs memory over full recomputation and stays below no checkpointing
    assert peaks["none"] < peaks["matmuls"] < vanilla, peaks
    assert peaks["none"] <= peaks["{0, 3}"] <= peaks["matmuls"], peaks


def test_restore_leaves_no_trace_and_errors_name_the_fix() -> None:
    ex = hf.example("llama")
    before = {k: v.clone() for k, v in ex.model.state_dict().items()}
    paths = layer_paths(ex.model)
    with pytest.raises(ValueError, match="has no submodule"):
        apply_selective(ex.model, {"model.nope": "matmuls"})
    with pytest.raises(ValueError, match="a set of op indices"):
        apply_selective(ex.model, {paths[0]: "everything"})
    assert not is_selective(ex.model)
    apply_selective(ex.model, {paths[0]: "matmuls"})
    with pytest.raises(ValueError, match="restore_selective"):
        apply_selective(ex.model, {paths[1]: "matmuls"})
    restore_selective(ex.model)
    assert not is_selective(ex.model)
    assert all("forward" not in m.__dict__ for m in ex.model.modules())
    assert all(torch.equal(before[k], v) for k, v in ex.model.state_dict().items())


def test_batchnorm_modules_refused() -> None:
    ex = hf.example("resnet")
    bn_owner = next(p for p, m in ex.model.named_modules()
                    if any(isinstance(c, torch.nn.BatchNorm2d) for c in m.children()))
    with pytest.raises(ValueError, match="running statistics"):
        apply_selective(ex.model, {bn_owner: "matmuls"})


# ---------------------------------------------------------------------- SelectiveCall (plans)
def _bn_net() -> torch.nn.Module:
    torch.manual_seed(0)
    block = lambda: torch.nn.Sequential(torch.nn.Conv2d(4, 4, 3, padding=1), torch.nn.BatchNorm2d(4),  # noqa: E731
                                        torch.nn.ReLU(), torch.nn.Conv2d(4, 4, 3, padding=1))
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), block(), block())  # the blocks: members "1", "2"


def test_selective_call_keeps_ops_updates_statistics_once_and_checks_op_names() -> None:
    import autoremat
    from autoremat.plan import Segment

    model, x = _bn_net(), torch.randn(2, 3, 8, 8)
    g = autoremat.capture(model, (x,), mode="module", blocks="ops", repeats=1, warmup=0)
    calls = g.call_regions()
    conv = [v for v in calls["1"] if "convolution" in g.node(v)["target"]]
    segs, v = [], 0
    while v < len(g):
        if v == calls["1"][0]:
            segs.append(Segment(calls["1"], True, tuple(conv)))
            v = calls["1"][-1] + 1
        else:
            segs.append(Segment((v,), False))
            v += 1
    plan = autoremat.solve(g, 10**12, solver="none")
    plan.segments = segs
    plan = autoremat.solvers.finalize_plan(g, plan, 10**12, "hand")
    assert plan.module_calls[[i for i, s in enumerate(segs) if s.recompute][0]][0] == "1"
    reference = copy.deepcopy(model)
    torch.manual_seed(1)
    run_step(reference, (x,))
    autoremat.apply(model, plan)
    torch.manual_seed(1)
    run_step(model, (x,))
    assert gradients_equal(gradients(reference), gradients(model))
    assert torch.equal(reference[1][1].running_mean, model[1][1].running_mean)  # updated once
    assert reference[1][1].num_batches_tracked == model[1][1].num_batches_tracked == 1
    autoremat.restore(model)
    # a plan naming another op at a kept index: the call refuses with what it found
    i = next(iter(plan.module_calls))
    path, ops = plan.module_calls[i]
    plan.module_calls[i] = (path, tuple((k, "aten.mul.Tensor") for k, _ in ops))
    autoremat.apply(model, plan)
    with pytest.raises(RuntimeError, match="other ops than when it was captured"):
        run_step(model, (x,))
    autoremat.restore(model)


def _dispatched(block: torch.nn.Module, x: torch.Tensor) -> list[str]:
    """The ops one forward of ``block`` dispatches, as selective checkpointing's policy counts them."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.checkpoint import SAC_IGNORED_OPS

    ops: list[str] = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func not in SAC_IGNORED_OPS:
                ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with Ops():
        block(x)
    return ops


class _CastBlock(torch.nn.Module):
    """Two linears with a float32 cast between them: under bf16 autocast the region dispatches
    activation casts and parameter casts (``aten._to_copy``) interleaved."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)).float())


def test_selective_call_under_autocast_with_backward_inside_it() -> None:
    """A replay inside the forward's autocast region finds the parameter casts in autocast's cache
    and does not dispatch them; selective checkpointing pairs stored outputs with ops by count, so a
    kept parameter cast went to an activation cast (Mixtral under AMP: a metadata error). The region
    runs without the cache, and keeps what it kept."""
    from autoremat.runtime.region import stateful_buffers
    from autoremat.runtime.selective import SelectiveCall

    torch.manual_seed(0)
    block, x = _CastBlock(), torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ops = _dispatched(block, x)
    casts = [i for i, name in enumerate(ops) if name == "aten._to_copy.default"]
    assert len(casts) >= 4, ops  # x, a's weight and bias, the float32 cast, b's casts
    keep = {casts[1]: ops[casts[1]]}  # a's weight cast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.manual_seed(1)
        block(x).float().sum().backward()
        reference = gradients(block)
        block.zero_grad(set_to_none=True)
        call = SelectiveCall(block.forward, stateful_buffers([block]), tuple(block.parameters()), keep, "block")
        call(x).float().sum().backward()
    assert gradients_equal(reference, gradients(block))


class _DropPathBlock(torch.nn.Module):
    """Stochastic depth then dropout (ConvNeXt, Swin): two random ops in one call."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = (torch.rand(x.shape[0], 1) > 0.3).to(x.dtype)  # drop path's per-sample draw
        h = torch.nn.functional.dropout(torch.relu(self.a(x)) * keep, 0.5, training=True)
        return self.b(h)


def test_selective_call_keeping_a_random_op_replays_the_later_draws() -> None:
    """A kept op's output comes from selective checkpointing's cache, so the replay does not run
    it: a kept random op (drop path's ``torch.rand``) left the RNG behind, and the dropout after
    it drew another mask in the replay (Swin with drop path and dropout: gradients off by 2e-3).
    Random ops are replayed, never served from the cache."""
    from autoremat.runtime.region import stateful_buffers
    from autoremat.runtime.selective import SelectiveCall

    torch.manual_seed(0)
    block, x = _DropPathBlock(), torch.randn(16, 8, requires_grad=True)
    ops = _dispatched(block, x)
    keep = {i: name for i, name in enumerate(ops) if name in ("aten.rand.default", "aten.addmm.default")}
    first = min(keep)
    assert keep[first] == "aten.rand.default" and any("dropout" in o or "bernoulli" in o for o in ops[first:]), ops
    torch.manual_seed(1)
    block(x).sum().backward()
    reference = {**gradients(block), "x": x.grad}
    block.zero_grad(set_to_none=True)
    x.grad = None
    call = SelectiveCall(block.forward, stateful_buffers([block]), tuple(block.parameters()), keep, "block")
    torch.manual_seed(1)
    call(x).sum().backward()
    assert gradients_equal(reference, {**gradients(block), "x": x.grad})
