"""The callback's first input recording (``record_inputs``, issue 29/20): it stops the step at
the target's first call, so the target never runs at the user's batch outside profiling; an
out-of-memory error before that call leaves the module as it was and says what to change. On
the simulated device of ``tests/_oom.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from _oom import SimulatedDevice

import autoremat
from autoremat.zoo.lightning import LitClassifier

SOLVER = "chen"
"""The callback's solver in fits whose question is not the plan: chen plans in well under
a second where auto's search on measured times took most of each fit (the default solver through
the callback: test_lightning's test_fit_cnn_meets_budget_and_restores and batch-raising tests)."""


class _Augmenting(LitClassifier):
    """Builds a large tensor from the batch before calling the model (an augmentation step)."""

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        views = x.repeat(64, 1, 1, 1)
        x = x + views.mean() * 0
        return torch.nn.functional.cross_entropy(self.model(x), y)


def _trainer(cb: Any, tmp_path: Path, steps: int = 1) -> pl.Trainer:
    return pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                      callbacks=[] if cb is None else [cb])


def _snapshot(lit: pl.LightningModule) -> dict[str, Any]:
    out: dict[str, Any] = {k: v.clone() for k, v in lit.state_dict().items()}
    out.update({f"rg:{n}": p.requires_grad for n, p in lit.named_parameters()})
    out.update({f"grad:{n}": p.grad for n, p in lit.named_parameters()})
    out.update({f"hooks:{n}": len(m._forward_pre_hooks) + len(m._forward_hooks) for n, m in lit.named_modules()})
    return out


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) else x == y
        for x, y in ((a[k], b[k]) for k in a))


def _resident(lit: pl.LightningModule) -> list[torch.Tensor]:
    return [*lit.parameters(), *lit.buffers()]


def test_recording_never_runs_the_model_at_the_users_batch(tmp_path: Path) -> None:
    """A device on which even a no-grad forward of the model at the user's batch does not fit:
    recording the inputs does not run it (before: the raw ``OutOfMemoryError`` of that forward);
    the callback then says clearly that the budget is too small, and the module is as it was."""
    torch.manual_seed(0)
    lit = LitClassifier(batch_size=8, samples=16)
    x = lit.images[:8]
    with torch.no_grad(), SimulatedDevice(10**12, _resident(lit)) as probe:
        lit.model(x.clone())  # the batch on the device, then the forward
    capacity = probe.peak - 1
    with pytest.raises(torch.OutOfMemoryError), torch.no_grad(), SimulatedDevice(capacity, _resident(lit)):
        lit.model(x.clone())
    before = _snapshot(lit)
    device = SimulatedDevice(capacity, _resident(lit))
    cb = autoremat.AutoRemat(budget=capacity, module="model", raise_batch_size=False, verbose=False)
    with pytest.raises((ValueError, autoremat.CaptureDoesNotFitError, autoremat.InfeasibleBudgetError),
                       match="budget") as err, device:
        _trainer(cb, tmp_path).fit(lit)
    assert not isinstance(err.value, torch.OutOfMemoryError) and device.ooms == 0
    assert _same(before, _snapshot(lit))


def test_out_of_memory_before_the_model_is_called_is_a_clear_error(tmp_path: Path) -> None:
    torch.manual_seed(0)
    lit = _Augmenting(batch_size=8, samples=16)
    x = lit.images[:8]
    capacity = sum(t.numel() * t.element_size() for t in _resident(lit)) + 16 * x.numel() * x.element_size()
    before = _snapshot(lit)
    cb = autoremat.AutoRemat(budget=capacity, module="model", raise_batch_size=False, verbose=False)
    with pytest.raises(torch.OutOfMemoryError, match=r"recording the inputs of model ran out of memory before the "
                       r"model was called.*Lower the batch size") as err, SimulatedDevice(capacity, _resident(lit)):
        _trainer(cb, tmp_path).fit(lit)
    assert isinstance(err.value.__cause__, torch.OutOfMemoryError)  # the device's own error, kept
    assert _same(before, _snapshot(lit))
    assert not autoremat.is_patched(lit.model)


class _Frozen(LitClassifier):
    """``training_step`` runs a frozen input layer, then the network; the LightningModule's own
    ``forward`` is never called (as in most LightningModules wrapping a network)."""

    def __init__(self) -> None:
        super().__init__(batch_size=8, samples=16)
        self.stem = torch.nn.Conv2d(3, 3, 1).requires_grad_(False)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        with torch.no_grad():
            x = self.stem(x)
        return torch.nn.functional.cross_entropy(self.model(x), y)


def test_without_module_the_network_training_step_calls_is_planned(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Before: ``training_step never called module _Frozen; pass module=``."""
    torch.manual_seed(0)
    plain = _Frozen()
    torch.manual_seed(0)
    lit = _Frozen()
    _trainer(None, tmp_path, steps=2).fit(plain)
    cb = autoremat.AutoRemat(budget="50%", raise_batch_size=False, verbose=False, solver=SOLVER)
    seen = {}

    class Probe(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
            seen["patched"] = autoremat.is_patched(pl_module.model)

    trainer = _trainer(cb, tmp_path, steps=2)
    trainer.callbacks.append(Probe())
    with caplog.at_level("INFO"):
        trainer.fit(lit)
    assert cb.module == "model" and seen["patched"] and cb.state_dict()["module"] == "model"
    assert any("planning module 'model'" in r.getMessage() for r in caplog.records)
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), lit.parameters()))
    assert not autoremat.is_patched(lit.model)  # restored when fitting ends
    trainer.save_checkpoint(tmp_path / "last.ckpt")  # a resumed run plans the same module, unprofiled
    cb2 = autoremat.AutoRemat(budget="50%", raise_batch_size=False, verbose=False, solver=SOLVER)
    seen["patched"] = False
    resumed = _trainer(cb2, tmp_path, steps=3)
    resumed.callbacks.append(Probe())
    resumed.fit(_Frozen(), ckpt_path=tmp_path / "last.ckpt")
    assert cb2.module == "model" and seen["patched"] and cb2.plan.to_dict() == cb.plan.to_dict()


class _Seeded(LitClassifier):
    """Shuffles with its own generator, as a user wanting a reproducible order does; records the
    rows each step saw."""

    def __init__(self) -> None:
        super().__init__(batch_size=4, samples=16)
        self.rows: list[float] = []

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        self.rows.append(round(float(batch[0][0, 0, 0, 0]), 5))
        return super().training_step(batch, batch_idx)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        dataset = torch.utils.data.TensorDataset(self.images, self.labels)
        return torch.utils.data.DataLoader(dataset, batch_size=self.batch_size, shuffle=True,
                                           generator=torch.Generator().manual_seed(3))


def test_the_batches_drawn_for_profiling_leave_the_users_shuffle_as_it_was(tmp_path: Path) -> None:
    """Drawing a batch starts a dataloader iterator, which draws seeds from the dataloader's own
    generator (before: the user's steps saw their rows in another order than without autoremat)."""
    seen = []
    for cb in (None, autoremat.AutoRemat(budget="75%", module="model", raise_batch_size=False, verbose=False,
                                         solver=SOLVER)):
        torch.manual_seed(0)
        lit = _Seeded()
        _trainer(cb, tmp_path, steps=4).fit(lit)
        seen.append(lit.rows)
    assert len(seen[0]) == 4 and seen[0] == seen[1]


def test_the_generators_of_every_dataloader_and_sampler_are_found() -> None:
    from lightning.pytorch.utilities import CombinedLoader

    from autoremat.integrations._lightning_trainer import _generators

    data = torch.utils.data.TensorDataset(torch.arange(8.0))
    g1, g2, g3 = (torch.Generator() for _ in range(3))
    shuffled = torch.utils.data.DataLoader(data, shuffle=True, generator=g1)
    own_sampler = torch.utils.data.DataLoader(data, sampler=torch.utils.data.RandomSampler(data, generator=g2),
                                              generator=g3)
    plain = torch.utils.data.DataLoader(data)
    for loaders in ({"a": shuffled, "b": [own_sampler, plain]}, CombinedLoader({"a": shuffled, "b": own_sampler})):
        assert {id(g) for g in _generators(loaders)} == {id(g1), id(g2), id(g3)}
    assert _generators(plain) == [] and _generators(None) == []
