"""Batch-size raising against a simulated device that enforces whole Lightning training steps.

The scenario benchmarks/compare.py found: AutoRemat raised the batch to a size whose own trial
steps passed but whose real training steps then ran out of the device, because under Lightning's
automatic optimisation the previous step's parameter gradients are still allocated during the next
forward (``optimizer.zero_grad`` runs in the closure after ``training_step``). Here the device is a
live-storage counter around the LightningModule's ``optimizer_step`` (``training_step``, backward and
the update) that raises ``torch.OutOfMemoryError`` once the bytes in use pass its capacity
(``tests/_oom.py``'s ``SimulatedDevice``, as ``benchmarks/compare/batch.py``'s does).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from _oom import SimulatedDevice

import autoremat
from autoremat.capture._recorder import tensors_in
from autoremat.integrations import lightning as lit
from autoremat.zoo.lightning import LitClassifier

CAPACITY_BYTES = 6 * 2**20
"""The simulated device (resnet50 at CPU size: ~1.1 MiB resident, ~30 samples fit)."""
TRAIN_STEPS = 3
MARGIN = 0.1
"""No autoremat plan trains a batch this much larger than the one AutoRemat chose."""


class _OutOfMemory(SimulatedDevice):
    """Live storages created since entry; fails like the device above ``limit`` bytes (a gradient
    sum the engine makes in place without a dispatch mode counts at its in-place level, as
    :class:`SimulatedDevice` counts it: checked at the sum itself, this device refused ResNet-50's
    training step 2 at 4 KB over its limit; the same step, its sums settled, measured 30 KB under)."""

    @property
    def limit(self) -> int:
        return self.capacity_bytes

    @limit.setter
    def limit(self, value: int) -> None:
        self.capacity_bytes = int(value)


def _storage_bytes(obj: Any) -> int:
    seen = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors_in(obj)}
    return sum(seen.values())


def _allocated(pl_module: pl.LightningModule) -> int:
    """What is allocated between steps: parameters, gradients, buffers, optimizer state."""
    params = list(pl_module.parameters())
    opt_state = [list(opt.state.values()) for opt in pl_module.trainer.optimizers]
    return _storage_bytes([params, [p.grad for p in params if p.grad is not None], list(pl_module.buffers()),
                           opt_state])


class _Device:
    """``capacity`` bytes: each optimisation step may create ``capacity`` minus what was allocated
    when it began minus its batch; AutoRemat's trial steps (forward+backward of the patched module)
    are held to the same device."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.steps: list[tuple[int, bool]] = []
        """(batch rows, succeeded) for each optimisation step."""
        self._counter: _OutOfMemory | None = None
        self._rows = 0

    def install(self, pl_module: pl.LightningModule, monkeypatch: pytest.MonkeyPatch) -> None:
        optimizer_step, training_step = pl_module.optimizer_step, pl_module.training_step

        def enforced_optimizer_step(*args: Any, **kwargs: Any) -> Any:
            self._counter = _OutOfMemory(self.capacity - _allocated(pl_module))
            self._rows, ok = 0, False
            try:
                with self._counter:
                    out = optimizer_step(*args, **kwargs)
                ok = True
                return out
            finally:
                self._counter = None
                self.steps.append((self._rows, ok))

        def enforced_training_step(batch: Any, *args: Any, **kwargs: Any) -> Any:
            if self._counter is not None and torch.is_grad_enabled():
                self._counter.limit -= _storage_bytes(batch)  # the batch was moved to the device before the step
                self._rows = int(batch[0].shape[0])
            return training_step(batch, *args, **kwargs)

        pl_module.optimizer_step = enforced_optimizer_step  # type: ignore[method-assign]
        pl_module.training_step = enforced_training_step  # type: ignore[method-assign]
        trial_step = lit.trial_step

        def enforced_trial_step(target, args, kwargs, loss_fn, trainer):  # type: ignore[no-untyped-def]
            limit = self.capacity - _allocated(trainer.lightning_module) - _storage_bytes((args, kwargs))
            with _OutOfMemory(limit):
                return trial_step(target, args, kwargs, loss_fn, trainer)

        monkeypatch.setattr(lit, "trial_step", enforced_trial_step)


def _trainer(callbacks: list[pl.Callback], tmp_path: Path) -> pl.Trainer:
    return pl.Trainer(max_steps=TRAIN_STEPS, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                      callbacks=callbacks)


def test_raised_batch_trains_on_a_device_enforcing_whole_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = LitClassifier(samples=256)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    device = _Device(CAPACITY_BYTES)
    device.install(model, monkeypatch)
    before_training: dict[str, Any] = {}

    class Probe(pl.Callback):
        def on_train_start(self, trainer, pl_module):  # type: ignore[no-untyped-def]
            before_training["state_equal"] = all(torch.equal(initial[k], v) for k, v in pl_module.state_dict().items())
            before_training["keys"] = set(pl_module.state_dict())
            before_training["optimizer_state"] = [dict(opt.state) for opt in trainer.optimizers]
            before_training["grads"] = [p.grad for p in pl_module.parameters() if p.grad is not None]

    cb = autoremat.AutoRemat(budget=CAPACITY_BYTES, module="model", raise_batch_size=True, verbose=False,
                             profile_steps=1)
    _trainer([cb, Probe()], tmp_path).fit(model)  # raises the simulated out-of-memory if a step does not fit

    chosen = cb.batch_size
    assert chosen is not None and chosen >= 4 * cb.original_batch_size, (cb.original_batch_size, chosen)
    assert model.batch_size == chosen
    assert device.steps == [(chosen, True)] * TRAIN_STEPS
    # the search (capture, solves, trial steps) left model and optimizer as they were
    assert before_training == {"state_equal": True, "keys": set(initial), "optimizer_state": [{}], "grads": []}
    assert not autoremat.is_patched(model.model)

    # near the largest that trains: MARGIN more rows do not train even under the plan with the
    # smallest step peak any registered solver finds for them
    bigger = math.ceil(chosen * (1 + MARGIN))
    torch.manual_seed(0)
    big = LitClassifier(samples=256, batch_size=bigger)
    graph = autoremat.capture(big.model, (big.images[:bigger],), repeats=1, warmup=0)
    with pytest.raises(autoremat.InfeasibleBudgetError) as info:
        autoremat.solve(graph, 0)
    assert info.value.min_budget_bytes is not None
    autoremat.apply(big.model, autoremat.solve(graph, info.value.min_budget_bytes))
    _Device(CAPACITY_BYTES).install(big, monkeypatch)
    with pytest.raises(torch.OutOfMemoryError, match="simulated device out of memory"):
        _trainer([], tmp_path).fit(big)
