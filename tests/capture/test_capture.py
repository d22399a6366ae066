"""Capture: structure, saved-bytes attribution, state preservation, fallbacks, bad input."""

from __future__ import annotations

import logging
import time

import pytest
import torch
from torch import nn

import autoremat


class _Untraceable(nn.Module):
    """Data-dependent control flow: fx cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 32))
                                    for _ in range(4))
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if x.sum() > -1e9:  # data-dependent branch
                x = block(x) + x
        return self.head(x)


def test_fx_capture_attributes_saved_tensors() -> None:
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(8, 16)
    g = autoremat.capture(model, (x,))
    assert g.meta["mode"] == "fx" and len(g) == 3
    lin0, relu, lin1 = (g.node(v) for v in g.nodes)
    assert [lin0["kind"], relu["kind"], lin1["kind"]] == ["linear", "act", "linear"]
    assert list(g.nx.edges) == [(0, 1), (1, 2)]
    assert lin0["saves"] == ()  # its input is the batch: resident, not a node
    assert relu["saves"] == (1,)  # ReLU keeps its output
    assert lin1["saves"] == (1,)  # the next linear keeps its input (the ReLU output)
    assert relu["out_bytes"] == 8 * 16 * 4 and relu["saved_bytes"] == 8 * 16 * 4
    assert lin1["is_output"] and not lin0["is_output"]
    assert g.meta["param_bytes"]["0.weight"] == 16 * 16 * 4
    assert set(lin0["params"]) == {"0.weight", "0.bias"}


def test_capture_leaves_model_state_unchanged() -> None:
    model, (x,) = autoremat.zoo.build("resnet50", size="small")
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    rng = torch.get_rng_state()
    autoremat.capture(model, (x,))
    assert all(torch.equal(buffers[k], v) for k, v in model.named_buffers())
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(rng, torch.get_rng_state())


def test_module_level_fallback_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    model = _Untraceable()
    x = torch.randn(4, 32)
    with caplog.at_level(logging.INFO, logger="autoremat.capture"):
        g = autoremat.capture(model, (x,), blocks="module")
    assert g.meta["mode"] == "module"
    assert "capturing at module level" in caplog.text
    names = [g.node(v)["name"] for v in g.nodes if g.node(v)["kind"] != "glue"]
    assert names == ["blocks.0", "blocks.1", "blocks.2", "blocks.3", "head"]
    with pytest.raises(ValueError, match="mode='module'"):
        autoremat.capture(model, (x,), mode="fx")


def test_module_level_plan_runs_with_equal_gradients() -> None:
    torch.manual_seed(0)
    model = _Untraceable()
    x = torch.randn(1024, 32)
    g = autoremat.capture(model, (x,), blocks="module")  # chen recomputes module calls, not ops of blocks
    plan = autoremat.solve(g, "60%", solver="chen")
    assert plan.recompute_segments
    model.zero_grad()
    model(x).mean().backward()
    ref = [p.grad.clone() for p in model.parameters()]
    autoremat.apply(model, plan)
    model.zero_grad()
    model(x).mean().backward()
    autoremat.restore(model)
    assert all(torch.equal(a, p.grad) for a, p in zip(ref, model.parameters()))


def test_meta_device_capture_of_paper_size_model() -> None:
    model, args = autoremat.zoo.build("resnet50", size="paper", device="meta")
    g = autoremat.capture(model, args)
    assert g.meta["time_source"] == "flops" and g.meta["device"] == "meta"
    assert len(g) == 175
    convs = [v for v in g.nodes if g.node(v)["kind"] == "conv"]
    assert all(g.node(v)["time_s"] > 0 for v in convs)
    # batch 96 at 224x224: the first conv's output alone is 96*64*112*112*4 bytes
    assert g.node(convs[0])["out_bytes"] == 96 * 64 * 112 * 112 * 4
    peak = autoremat.simulate(g, autoremat.solve(g, "100%", solver="none")).peak_bytes
    assert peak > 5 * 2**30


def test_graph_json_round_trip_of_capture() -> None:
    model, args = autoremat.zoo.build("densenet121", size="small")
    g = autoremat.capture(model, args)
    again = autoremat.Graph.from_json(g.to_json())
    assert again.fingerprint == g.fingerprint
    assert again.to_dict() == g.to_dict()


@pytest.mark.parametrize(
    ("model", "args", "kwargs", "mode", "error", "match"),
    [
        ("nope", (torch.randn(2, 2),), None, "auto", TypeError, "torch.nn.Module"),
        (nn.Linear(2, 2), "x", None, "auto", TypeError, "tuple of positional inputs"),
        (nn.Linear(2, 2), {"x": torch.randn(2, 2)}, None, "auto", TypeError, r"a mapping: .*capture\(model, \(\), batch\)"),
        (nn.Linear(2, 2), (1, 2), None, "auto", TypeError, "no tensor"),
        (nn.Linear(2, 2), (torch.randn(2, 2),), [1], "auto", TypeError, "dict of keyword"),
        (nn.Linear(2, 2), (torch.randn(2, 2),), None, "jit", ValueError, "capture mode"),
        # lazy modules: before, PyTorch's "Attempted to use an uninitialized parameter in numel" from inside capture
        (nn.Sequential(nn.LazyLinear(4), nn.ReLU()), (torch.randn(2, 3),), None, "auto", ValueError,
         r"2 uninitialized lazy parameters or buffers \(0.weight, 0.bias\).*Run the model once on a batch"),
    ],
)
def test_capture_rejects_bad_input(model, args, kwargs, mode, error, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(error, match=match):
        autoremat.capture(model, args, kwargs, mode=mode)


def test_custom_loss_fn_and_kwargs() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    x = torch.randn(5, 8)
    target = torch.randint(0, 3, (5,))
    g = autoremat.capture(model, (x,), loss_fn=lambda out: nn.functional.cross_entropy(out, target))
    assert g.meta["loss_saves"] or g.meta["loss_extra_bytes"] > 0  # log-softmax keeps something
    with pytest.raises(ValueError, match="scalar"):
        autoremat.capture(model, (x,), loss_fn=lambda out: out)


class _ReturnsItsLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.lin(x) ** 2).mean()


@pytest.mark.parametrize("case", ["mse", "cross entropy", "saves its output", "returned by the model"])
def test_the_loss_tensor_is_held_to_the_steps_end(case: str) -> None:
    """``loss_held_bytes``: the loss tensor's storage, which the loop holds through ``backward()`` (on
    the CPU ``mse_loss`` returns its mean in a storage the size of its input: 8,192 bytes here; a
    scalar's 4 bytes otherwise, also where the loss saved it or the model returned it), plus the 4 bytes
    of the gradient ``backward()`` seeds it with. The unpatched step is predicted to the byte (before:
    8 bytes under, 8,196 with ``mse_loss``)."""
    from autoremat.cost import unoptimised_peak_bytes
    from autoremat.measure import measure

    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    x, target = torch.randn(32, 64), torch.randn(32, 64)
    loss_fn, held, extra = {
        "mse": (lambda out: nn.functional.mse_loss(out, target), 8192 + 4, 8192),  # it saves the target
        "cross entropy": (lambda out: nn.functional.cross_entropy(out, torch.zeros(32, dtype=torch.long)), 4 + 4,
                          None),
        "saves its output": (lambda out: out.sum().exp(), 4 + 4, 0),  # exp keeps its result: held, not extra
        "returned by the model": (lambda out: out, 4 + 4, 0),
    }[case]
    if case == "returned by the model":
        model = _ReturnsItsLoss()
    g = autoremat.capture(model, (x,), loss_fn=loss_fn)
    assert g.meta["loss_held_bytes"] == held
    assert extra is None or g.meta["loss_extra_bytes"] == extra
    measured = measure(model, (x,), loss_fn=loss_fn, steps=1, warmup=1).peak_bytes
    assert unoptimised_peak_bytes(g) == measured


class _Methods(nn.Module):
    """call_module, call_function and call_method nodes."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.lin(x))
        return y.view(-1, 4).sum(dim=1)


def test_cpu_node_times_cover_only_the_op_call(monkeypatch: pytest.MonkeyPatch) -> None:
    # the interpreter's per-node work (argument lookup, submodule fetch) is not the model's:
    # slowed down here to 0.1 s per node, it must not show in the node times
    fetch_args = torch.fx.Interpreter.fetch_args_kwargs_from_env
    fetch_attr = torch.fx.Interpreter.fetch_attr
    delay = 0.1

    def slow_args(self, n):  # type: ignore[no-untyped-def]
        time.sleep(delay)
        return fetch_args(self, n)

    def slow_attr(self, target):  # type: ignore[no-untyped-def]
        time.sleep(delay)
        return fetch_attr(self, target)

    model = _Methods()
    x = torch.randn(4, 8)
    monkeypatch.setattr(torch.fx.Interpreter, "fetch_args_kwargs_from_env", slow_args)
    monkeypatch.setattr(torch.fx.Interpreter, "fetch_attr", slow_attr)
    g = autoremat.capture(model, (x,), mode="fx", repeats=3, warmup=0)
    names = [g.node(v)["name"] for v in g.nodes]
    assert names == ["lin", "tanh", "view", "sum_1"]  # call_module, call_function, call_method
    times = [g.node(v)["time_s"] for v in g.nodes]
    # a node time holding the interpreter's work is >= delay in every repeat; the op alone is far
    # below it (a median of 3, so one preempted repeat on a loaded machine does not reach it)
    assert all(0 < t < delay for t in times), dict(zip(names, times))


class _NoGradStats(nn.Module):
    """A forward that updates a buffer inside ``torch.no_grad()`` and counts its calls: fx drops
    the no_grad block (the traced copy_ makes the buffer require grad) and tracing itself runs
    ``self.calls += 1`` on the real buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("mean", torch.zeros(8))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        with torch.no_grad():
            self.mean.copy_(0.9 * self.mean + 0.1 * y.mean(0))
            self.calls += 1
        return torch.relu(y - self.mean)


def test_a_failed_capture_leaves_the_model_unchanged() -> None:
    """Issue 29 item 7: buffers were left requiring grad with a grad_fn, counters incremented."""
    from _state import assert_unchanged, snapshot

    model = _NoGradStats()
    model.lin.weight.grad = torch.ones_like(model.lin.weight)
    x = torch.randn(4, 8)
    before = snapshot(model)
    try:
        autoremat.capture(model, (x,), mode="fx")
    except Exception:  # noqa: BLE001 - whether fx capture of this model may succeed is not this test's concern
        pass
    assert_unchanged(model, before)
    assert model.mean.grad_fn is None and not model.mean.requires_grad and int(model.calls) == 0


def test_a_loss_fn_that_raises_leaves_the_model_unchanged() -> None:
    from _state import assert_unchanged, snapshot

    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU())
    x = torch.randn(4, 8)
    before = snapshot(model)

    def bad_loss(out: torch.Tensor) -> torch.Tensor:
        raise ValueError("no loss today")

    for mode in ("fx", "module"):
        with pytest.raises(ValueError, match="no loss today"):
            autoremat.capture(model, (x,), mode=mode, loss_fn=bad_loss)
        assert_unchanged(model, before)


def test_fingerprint_covers_parameter_shapes_and_dtypes() -> None:
    """Issue 29 item 6: a plan for width 128 applied to width 256 without a word."""
    from autoremat.capture.fx import fx_fingerprint, trace
    from autoremat.capture.module import module_fingerprint

    def mlp(width: int) -> nn.Module:
        return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))

    x = torch.randn(4, 128)
    g = autoremat.capture(mlp(128), (x,), mode="fx")
    assert g.fingerprint == fx_fingerprint(trace(mlp(128)))  # the graph's fingerprint is the apply-time one
    assert fx_fingerprint(trace(mlp(256))) != g.fingerprint
    assert fx_fingerprint(trace(mlp(128).double())) != g.fingerprint
    gm = autoremat.capture(mlp(128), (x,), mode="module")
    assert gm.fingerprint == module_fingerprint(mlp(128)) != module_fingerprint(mlp(256))
    assert g.meta["tensors"]["param:0.weight"] == "float32[128, 128]"
    assert g.meta["inputs"] == [{"path": "args[0]", "shape": [4, 128], "dtype": "float32", "device": "cpu"}]
    plan = autoremat.solve(g, "100%")
    assert plan.inputs == g.meta["inputs"] and plan.tensors == g.meta["tensors"]
    autoremat.check_inputs(plan, (x,))
    autoremat.check_inputs(plan, (x[:3],))  # a smaller batch: the plan is exact, its budget holds
    with pytest.raises(autoremat.PlanMismatchError, match=r"8 rows, the plan was made for 4"):
        autoremat.check_inputs(plan, torch.randn(8, 128))
    with pytest.raises(autoremat.PlanMismatchError, match=r"float32\[4, 64\].*float32\[4, 128\]"):
        autoremat.check_inputs(plan, torch.randn(4, 64))
    with pytest.raises(autoremat.PlanMismatchError, match="solve again"):
        autoremat.apply(mlp(256), plan)


def test_dataclass_outputs_are_outputs() -> None:
    """Issue 29 item 11: a model returning a dataclass (fields live until the loss)."""
    import dataclasses

    @dataclasses.dataclass
    class Out:
        logits: torch.Tensor
        hidden: torch.Tensor

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> Out:
            h = torch.relu(self.a(x))
            return Out(self.b(h), h)

    for mode in ("fx", "module"):
        g = autoremat.capture(M(), (torch.randn(32, 16),), mode=mode)
        outs = sorted(g.node(v)["name"] for v in g.nodes if g.node(v)["is_output"])
        assert outs == (["b", "relu"] if mode == "fx" else ["b", "glue:relu.default"]), outs
        plan = autoremat.solve(g, "100%")
        autoremat.simulate(g, plan)
