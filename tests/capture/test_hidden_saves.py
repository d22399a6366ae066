"""A tensor autograd makes for an op's backward only (the copy of ``self`` an in-place op whose
gradient needs the original keeps, dispatched as a ``clone`` before the op) is that op's saved
bytes, not the output of a node nobody holds (Mixtral's router crashed ``simulate``)."""

from __future__ import annotations

import torch
from torch import nn

import autoremat
from autoremat.cost import no_recompute_plan, simulate
from autoremat.measure import gradients, gradients_equal, measure, run_step


class Router(nn.Module):
    def __init__(self, width: int, experts: int) -> None:
        super().__init__()
        self.gate = nn.Linear(width, experts, bias=False)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x), dim=-1)
        top, _ = torch.topk(probs, 2, dim=-1)
        top /= top.sum(dim=-1, keepdim=True)  # in place: autograd keeps a copy of the original
        return x + self.down(torch.relu(self.up(x))) * top[..., :1]


class Net(nn.Module):
    def __init__(self, width: int = 32, depth: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Router(width, 4) for _ in range(depth))
        self.head = nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_an_in_place_ops_copy_of_self_is_its_saved_bytes() -> None:
    torch.manual_seed(0)
    model, x = Net(), torch.randn(64, 32)
    graph = autoremat.capture(model, (x,), mode="module", repeats=1, warmup=0)
    clones = [v for v in graph.nodes if graph.node(v)["name"].endswith("clone.default")]
    assert clones, "the in-place division's copy of self is dispatched as a clone"
    for v in graph.nodes:
        d = graph.node(v)
        read = set(graph.nx.predecessors(v)) | {v}
        assert all(u in read or graph.node(u)["alias_of"] in read or list(graph.nx.successors(u))
                   for u in d["saves"]), (d["name"], d["saves"])
    predicted = simulate(graph, no_recompute_plan(graph)).peak_bytes
    measured = measure(model, (x,), steps=1, warmup=0).peak_bytes
    assert abs(predicted - measured) <= 0.1 * measured, (predicted, measured)
    torch.manual_seed(1)
    run_step(model, (x,))
    reference = gradients(model)
    plan = autoremat.solve(graph, "min")
    autoremat.apply(model, plan)
    try:
        torch.manual_seed(1)
        run_step(model, (x,))
        assert gradients_equal(reference, gradients(model))
    finally:
        autoremat.restore(model)


class _Gelu(torch.autograd.Function):
    """A tanh GELU with its own backward (as Bloom's): saves its input, computes in backward."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(x)
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        (x,) = ctx.saved_tensors
        t = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
        d = 0.5 * x * ((1 - t * t) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + t)
        return d * g


class _FunctionBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(_Gelu.apply(self.up(x)))


def test_a_custom_functions_saves_and_backward_workspace_are_counted() -> None:
    """The Function's ops run without history: its last op's output gets the Function's, its saved
    input is read from ``ctx``, its backward's workspace is its own (was 22 % under on Bloom)."""
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([_FunctionBlock(32) for _ in range(3)])
            self.head = nn.Linear(32, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for b in self.blocks:
                x = b(x)
            return self.head(x)

    net, x = Net(), torch.randn(128, 32)
    graph = autoremat.capture(net, (x,), mode="module", repeats=1, warmup=0)
    outs = [v for v in graph.nodes if graph.node(v)["saves"] and "up" not in graph.node(v)["name"]
            and graph.node(v)["name"].startswith("blocks.0:")]
    assert outs, "the Function's output node saves its input"
    predicted = simulate(graph, no_recompute_plan(graph)).peak_bytes
    measured = measure(net, (x,), steps=1, warmup=0).peak_bytes
    assert abs(predicted - measured) <= 0.02 * measured, (predicted, measured)
    plan = autoremat.solve(graph, "min")
    autoremat.apply(net, plan)
    try:
        peak = measure(net, (x,), steps=1, warmup=0).peak_bytes
    finally:
        autoremat.restore(net)
    assert abs(plan.predicted_peak_bytes - peak) <= 0.02 * peak, (plan.predicted_peak_bytes, peak)


class _NormBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class _NormNet(nn.Module):
    def __init__(self, width: int = 64, depth: int = 4, classes: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_NormBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _amp_peak(model: nn.Module, x: torch.Tensor) -> int:
    """One step as Lightning and Accelerate run it: forward and loss under bf16 autocast, backward
    outside (autocast's cache of parameter casts is dropped when its region exits)."""
    from autoremat.measure import LiveStorageCounter

    model.zero_grad(set_to_none=True)
    counter = LiveStorageCounter()
    with counter:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().mean()
        loss.backward()
    model.zero_grad(set_to_none=True)
    return counter.peak


def test_under_autocast_an_ops_own_saved_outputs_and_recomputed_casts_are_what_they_are() -> None:
    """Layer norm saves its mean and rstd, not its result, which under autocast the next linear
    saves a bf16 cast of: the result is freed after that cast (it was held to the norm's backward,
    1.07x-1.13x on DistilBERT, BART, CLIP), and recomputing the norm frees the statistics only (it
    was credited the result too: least plans measured up to 1.3x their prediction). A recomputed
    region's parameter casts are freed with it, not kept in autocast's cache to the end of forward."""
    torch.manual_seed(0)
    model, x = _NormNet(width=128, classes=512), torch.randn(8, 64, 128)  # the step peak: the loss's forward
    with torch.autocast("cpu", dtype=torch.bfloat16):
        graph = autoremat.capture(model, (x,), loss_fn=lambda y: y.float().mean(), mode="module",
                                  repeats=1, warmup=0)
    norms = [v for v in graph.nodes if graph.node(v)["target"] == "aten.native_layer_norm.default"]
    assert norms and all(v not in graph.node(v)["saves"] and graph.node(v)["extra_saved_bytes"] > 0 for v in norms)
    measured = _amp_peak(model, x)
    predicted = simulate(graph, no_recompute_plan(graph)).peak_bytes
    assert abs(predicted - measured) <= 0.03 * measured, (predicted, measured)
    plan = autoremat.solve(graph, "min")
    assert plan.recompute_segments
    autoremat.apply(model, plan)
    try:
        peak = _amp_peak(model, x)
    finally:
        autoremat.restore(model)
    assert peak < measured and abs(plan.predicted_peak_bytes - peak) <= 0.03 * peak, (plan.predicted_peak_bytes, peak)


class _LocalsBlock(nn.Module):
    """Keeps fp32 intermediates in locals to the end of forward while autograd saves bf16 casts of
    them (as Swin's attention does under autocast)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = self.up(x).float()
        shifted = wide + 1.0
        scaled = shifted * 0.5
        out = self.down(scaled)
        return x + out


def test_python_locals_outliving_their_consumers_count_in_forward_and_replay() -> None:
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(_LocalsBlock(64) for _ in range(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for b in self.blocks:
                x = b(x)
            return x

    model, x = Net(), torch.randn(8, 64, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        graph = autoremat.capture(model, (x,), loss_fn=lambda y: y.float().mean(), mode="module",
                                  repeats=1, warmup=0)
    print("fwd_temp", sum(graph.node(v)["fwd_temp_bytes"] for v in graph.nodes))
    measured = _amp_peak(model, x)
    assert abs(simulate(graph, no_recompute_plan(graph)).peak_bytes - measured) <= 0.03 * measured
    plan = autoremat.solve(graph, "min")
    assert plan.recompute_segments
    autoremat.apply(model, plan)
    try:
        _amp_peak(model, x)  # the first step probes each region and replays it to its end
        peak = _amp_peak(model, x)
    finally:
        autoremat.restore(model)
    # without the locals the unpatched step was predicted at 0.72x of measured
    assert abs(plan.predicted_peak_bytes - peak) <= 0.03 * peak, (plan.predicted_peak_bytes, peak)
