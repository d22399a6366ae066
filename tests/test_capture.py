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
        g = autoremat.capture(model, (x,))
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
    g = autoremat.capture(model, (x,))
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
        (nn.Linear(2, 2), (1, 2), None, "auto", TypeError, "no tensor"),
        (nn.Linear(2, 2), (torch.randn(2, 2),), [1], "auto", TypeError, "dict of keyword"),
        (nn.Linear(2, 2), (torch.randn(2, 2),), None, "jit", ValueError, "capture mode"),
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
    g = autoremat.capture(model, (x,), mode="fx", repeats=1, warmup=0)
    names = [g.node(v)["name"] for v in g.nodes]
    assert names == ["lin", "tanh", "view", "sum_1"]  # call_module, call_function, call_method
    times = [g.node(v)["time_s"] for v in g.nodes]
    assert all(0 < t < delay / 2 for t in times), dict(zip(names, times))
