"""Issue 29: the integrations either succeed or leave the model (and optimizer) exactly as they
were: parameters, buffers, ``requires_grad``, gradients, hooks, ``forward``, ``training``
flags, device and RNG state (``tests/_state.py`` checks all of it after every failing case).

Failing cases: the user's forward raising during profiling, an infeasible budget, profiling out
of memory on a simulated device (``tests/_oom.py``), and, for Accelerate, every failure after
``prepare`` moved the model to the accelerator's device (a stand-in accelerator on the ``meta``
device plays the GPU) including a plan that cannot be applied; for Lightning, a failure after
the batch size was raised and the dataloaders rebuilt."""

from __future__ import annotations

import contextlib
import copy
import logging
import types
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from _oom import SimulatedDevice, storage_bytes
from _state import assert_unchanged, snapshot
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import autoremat
import autoremat.integrations.accelerate as ar
from autoremat.capture import CaptureDoesNotFitError
from autoremat.runtime import InstanceForwardError

W = 16


class _Net(nn.Module):
    """A counter bumped in forward (a buffer a failed capture must put back), batch norm, and a
    switch that makes forward raise (a user's bug met while profiling)."""

    def __init__(self, norm: type[nn.Module] = nn.BatchNorm1d) -> None:
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(W, W), norm(W), nn.Linear(W, W)
        self.d = nn.Dropout(0.2)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.broken = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        h = self.d(torch.relu(self.norm(self.a(x))))
        if self.broken and torch.is_grad_enabled():
            raise RuntimeError("a bug in the user's forward")
        return self.b(h)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("AUTOREMAT_BUDGET", "AUTOREMAT_SOLVER", "AUTOREMAT_ENABLED", "AUTOREMAT_CONFIG",
                "AUTOREMAT_PROFILE_STEPS"):
        monkeypatch.delenv(key, raising=False)


def _optimizer_state(opt: torch.optim.Optimizer) -> dict[str, Any]:
    return copy.deepcopy(opt.state_dict())


def _assert_same_optimizer(opt: torch.optim.Optimizer, params: list[nn.Parameter], before: dict[str, Any]) -> None:
    assert [p for g in opt.param_groups for p in g["params"]] == params  # the same objects, same order
    now = opt.state_dict()
    assert now["param_groups"] == before["param_groups"]
    assert now["state"].keys() == before["state"].keys()
    for k, state in before["state"].items():
        for name, value in state.items():
            got = now["state"][k][name]
            assert torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value, (k, name)


def _trained(net: nn.Module) -> tuple[torch.Tensor, torch.optim.Optimizer]:
    """A model one Adam step into training: gradients and optimizer state exist."""
    x = torch.randn(8, W, generator=torch.Generator().manual_seed(1))
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    net(x).square().mean().backward()
    opt.step()
    return x, opt


def _meta_accelerator() -> Any:
    """A single-process accelerator whose device is ``meta`` (where the model is moved to before
    capture, as it would be moved to a GPU)."""
    return types.SimpleNamespace(is_main_process=True, num_processes=1, device=torch.device("meta"),
                                 autocast=contextlib.nullcontext)


def _capacity_without_room(net: nn.Module) -> int:
    """A simulated device holding the resident tensors and a forward without gradients, but no
    training step (the parameter gradients alone do not fit)."""
    return storage_bytes([*net.parameters(), *net.buffers()]) + sum(p.numel() * 4 for p in net.parameters()) * 9 // 10


# ---------------------------------------------------------------------- Accelerate
def _broken(net: _Net) -> None:
    net.broken = True


def _instance_forward(net: _Net) -> None:
    net.forward = types.MethodType(type(net).forward, net)  # type: ignore[method-assign]


ACCELERATE_FAILURES = [
    # (id, accelerator, model tweak, prepare kwargs, error, message)
    ("capture-error", "cpu", _broken, {"budget": "50%"}, RuntimeError, "bug in the user's forward"),
    ("infeasible", "cpu", None, {"budget": "1%", "solver": "chen"}, autoremat.InfeasibleBudgetError, "Raise the budget"),
    ("moved-then-capture-error", "meta", _broken, {"budget": "50%"}, RuntimeError, "bug in the user's forward"),
    ("moved-then-infeasible", "meta", None, {"budget": "1%", "solver": "chen"}, autoremat.InfeasibleBudgetError,
     "Raise the budget"),
    ("moved-then-apply-refused", "meta", _instance_forward, {"budget": "100%", "solver": "none"},
     InstanceForwardError, "del model.forward"),
]


@pytest.mark.parametrize("name,where,tweak,kwargs,error,match", ACCELERATE_FAILURES,
                         ids=[c[0] for c in ACCELERATE_FAILURES])
def test_failed_prepare_leaves_model_and_optimizer_as_they_were(name: str, where: str, tweak: Any, kwargs: dict,
                                                                error: type[Exception], match: str) -> None:
    torch.manual_seed(0)
    net = _Net()
    x, opt = _trained(net)
    if tweak is not None:
        tweak(net)
    params, state, before = list(net.parameters()), _optimizer_state(opt), snapshot(net)
    accelerator = Accelerator(cpu=True) if where == "cpu" else _meta_accelerator()
    with pytest.raises(error, match=match):
        ar.prepare(accelerator, net, (x,), optimizer=opt, **kwargs)
    assert_unchanged(net, before)  # the meta cases: back on the CPU with their values
    assert all(t.device.type == "cpu" for t in (*net.parameters(), *net.buffers()))
    _assert_same_optimizer(opt, params, state)
    assert not autoremat.is_patched(net)


def _no_meta_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The model cannot run on meta tensors: no full-size bytes to plan on when no batch size
    fits (with them, ``capture_within`` plans on FLOP times instead of raising)."""
    import importlib

    monkeypatch.setattr(importlib.import_module("autoremat.capture.scaled"), "meta_capture", lambda *a, **k: None)


def test_prepare_out_of_memory_in_profiling_leaves_model_and_optimizer_as_they_were(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _no_meta_bytes(monkeypatch)
    torch.manual_seed(0)
    net = _Net(nn.LayerNorm)  # batch norm cannot train on the single row the last profiling try uses
    x, opt = _trained(net)
    params, state, before = list(net.parameters()), _optimizer_state(opt), snapshot(net)
    device = SimulatedDevice(_capacity_without_room(net), [*net.parameters(), *net.buffers()])
    with device, pytest.raises(CaptureDoesNotFitError, match="batch of 1"):
        ar.prepare(Accelerator(cpu=True), net, (x,), budget=10**9, optimizer=opt)
    assert device.ooms > 0
    assert_unchanged(net, before)
    _assert_same_optimizer(opt, params, state)


def test_prepare_that_succeeds_changes_no_value_and_not_the_rng() -> None:
    """The counterpart: a successful prepare changes nothing but the instance ``forward``."""
    torch.manual_seed(0)
    net = _Net()
    x, opt = _trained(net)
    ref = copy.deepcopy(net)
    rng = torch.get_rng_state()
    ar.prepare(Accelerator(cpu=True), net, (x,), budget="100%", optimizer=opt)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(a, b) for a, b in zip(ref.state_dict().values(), net.state_dict().values()))
    autoremat.restore(net)


# ---------------------------------------------------------------------- Lightning
class _Lit(pl.LightningModule):
    def __init__(self, norm: type[nn.Module] = nn.BatchNorm1d, batch_size: int | None = None) -> None:
        super().__init__()
        self.model = _Net(norm)
        self.rows = torch.randn(32, W, generator=torch.Generator().manual_seed(2))
        if batch_size is not None:
            self.batch_size = batch_size

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self.model(x).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.rows), batch_size=getattr(self, "batch_size", 8), shuffle=True)


def _trainer(tmp_path: Path, callback: pl.Callback) -> pl.Trainer:
    return pl.Trainer(max_steps=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                      callbacks=[callback])


def _callback(**kwargs: Any) -> Any:
    return autoremat.AutoRemat(module="model", **{"raise_batch_size": False, "verbose": False, **kwargs})


def _fit_fails(tmp_path: Path, lit: _Lit, callback: Any, error: type[BaseException], match: str,
               device: SimulatedDevice | None = None) -> pl.Trainer:
    before = snapshot(lit)
    own = dict(callback.__dict__)
    trainer = _trainer(tmp_path, callback)
    with pytest.raises(error, match=match), device or contextlib.nullcontext():
        trainer.fit(lit)
    assert_unchanged(lit, before)  # RNG included: setting up the dataloader draws from it
    assert not autoremat.is_patched(lit.model)
    assert trainer.fit_loop._combined_loader is None  # a later fit sets the loaders up again
    assert all(callback.__dict__[k] is v for k, v in own.items())  # Lightning adds `log` to a callback itself
    assert all(not o.state for o in trainer.optimizers)  # no step was taken
    return trainer


def test_failed_callback_capture_leaves_the_module_as_it_was(tmp_path: Path) -> None:
    torch.manual_seed(0)
    lit = _Lit()
    lit.model.broken = True
    _fit_fails(tmp_path, lit, _callback(budget="50%"), RuntimeError, "bug in the user's forward")


def test_infeasible_budget_in_the_callback_leaves_the_module_as_it_was(tmp_path: Path) -> None:
    torch.manual_seed(0)
    _fit_fails(tmp_path, _Lit(), _callback(budget="1%", solver="chen"), autoremat.InfeasibleBudgetError,
               "Raise the budget")


def test_callback_out_of_memory_in_profiling_leaves_the_module_as_it_was(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    _no_meta_bytes(monkeypatch)
    torch.manual_seed(0)
    lit = _Lit(nn.LayerNorm)
    device = SimulatedDevice(_capacity_without_room(lit), [*lit.parameters(), *lit.buffers()])
    _fit_fails(tmp_path, lit, _callback(budget=10**9), CaptureDoesNotFitError, "batch of 1", device)
    assert device.ooms > 0


def test_callback_failing_after_raising_the_batch_size_puts_it_back(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """The last step of ``on_fit_start`` (the summary) raises after the batch size was raised,
    the dataloaders rebuilt at the new size and the plan applied: all of it is undone."""
    torch.manual_seed(0)
    lit = _Lit(batch_size=4)
    callback = _callback(budget=10**9, solver="none", raise_batch_size=True, max_batch_size=16, verbose=True)
    raised: list[int | None] = []

    def summary(*args: Any, **kwargs: Any) -> None:  # the summary table, printed last in on_fit_start
        raised.append(lit.batch_size)
        assert autoremat.is_patched(lit.model)
        raise RuntimeError("summary failed")

    monkeypatch.setattr(autoremat.integrations.lightning, "print_summary", summary)
    with caplog.at_level(logging.WARNING):
        _fit_fails(tmp_path, lit, callback, RuntimeError, "summary failed")
    assert raised == [16] and lit.batch_size == 4
    # and the same callback then fits the same module from scratch
    monkeypatch.undo()
    callback.verbose = False
    _trainer(tmp_path, callback).fit(lit)
    assert callback.batch_size == 16 and lit.batch_size == 16
    assert not autoremat.is_patched(lit.model)  # restored when fitting ended


def test_resumed_plan_that_does_not_apply_leaves_batch_size_and_module_as_they_were(tmp_path: Path) -> None:
    """A resumed callback state whose plan was made for another model: the batch size it set and
    the dataloaders it rebuilt are put back when ``apply`` refuses the plan."""
    other = nn.Sequential(nn.Linear(W, 2 * W), nn.ReLU(), nn.Linear(2 * W, W))
    plan = autoremat.solve(autoremat.capture(other, (torch.randn(4, W),), repeats=1, warmup=0), "100%", solver="none")
    callback = _callback(budget="100%")
    callback.load_state_dict({"version": 1, "plan": plan.to_dict(), "batch_size": 16, "original_batch_size": 4,
                              "step_budget_bytes": 1})
    torch.manual_seed(0)
    lit = _Lit(batch_size=4)
    _fit_fails(tmp_path, lit, callback, autoremat.PlanMismatchError, "capture")
    assert lit.batch_size == 4 and callback.plan is not None and callback.batch_size == 16  # its resumed state kept


def test_rollback_leaves_alone_a_parameter_whose_storage_cannot_be_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """FSDP1's flat-parameter views can have no readable storage while sharded ("invalid python
    storage"); putting back must neither raise nor re-place such a parameter."""
    from autoremat.integrations._atomic import Rollback

    model = torch.nn.Linear(3, 3)
    rollback = Rollback(model)
    before = model.weight.data

    def unreadable(self):  # type: ignore[no-untyped-def]
        raise RuntimeError("Attempted to access the data pointer on an invalid python storage.")

    monkeypatch.setattr(torch.Tensor, "untyped_storage", unreadable)
    rollback.put_back()
    monkeypatch.undo()
    assert model.weight.data.data_ptr() == before.data_ptr()
