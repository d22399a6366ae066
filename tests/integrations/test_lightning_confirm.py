"""The callback's confirming step: a chosen plan whose measured step runs out of memory (the
allocator's fragmentation or a workspace the profile missed; seen on an H200) is planned again at
85 % of the step budget, said in a warning, and never costs the run; a raised batch goes back first."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

import autoremat
from autoremat.integrations import _lightning_steps as steps
from autoremat.integrations import lightning as lit
from autoremat.zoo.lightning import LitClassifier


def _trainer(cb: pl.Callback, tmp_path: Path) -> pl.Trainer:
    return pl.Trainer(max_steps=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path, callbacks=[cb])


def _failing(monkeypatch: pytest.MonkeyPatch, times: int) -> list[Any]:
    """The first ``times`` measured steps of a chosen plan run out of memory."""
    calls: list[Any] = []
    measure = lit.AutoRemat._measure_patched

    def flaky(self, target, trainer, pl_module, plan, loss_fn, size):  # type: ignore[no-untyped-def]
        calls.append((plan.budget_bytes, size))
        if len(calls) <= times:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 MiB")
        return measure(self, target, trainer, pl_module, plan, loss_fn, size)

    monkeypatch.setattr(lit.AutoRemat, "_measure_patched", flaky)
    return calls


def test_a_plan_whose_step_runs_out_is_planned_again_lower(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _failing(monkeypatch, 1)
    model = LitClassifier()
    cb = autoremat.AutoRemat(budget="60%", module="model", raise_batch_size=False, verbose=False)
    with pytest.warns(UserWarning, match="ran out of memory although its predicted peak"):
        _trainer(cb, tmp_path).fit(model)
    (first, _), (second, _) = calls
    assert second == int(first * 0.85) == cb.step_budget_bytes
    assert cb.plan is not None and cb.plan.predicted_peak_bytes <= cb.step_budget_bytes
    assert cb.summary["measured_peak_bytes"] is not None and len(model.step_losses) == 2


@pytest.mark.slow
def test_a_raised_batch_goes_back_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _failing(monkeypatch, 1)
    model = LitClassifier(batch_size=4, samples=64)
    cb = autoremat.AutoRemat(budget="60%", module="model", raise_batch_size=True, max_batch_size=16, verbose=False)
    with pytest.warns(UserWarning, match=r"at the raised batch size \d+ ran out of memory; keeping batch size 4"):
        _trainer(cb, tmp_path).fit(model)
    assert calls[0][1] > 4 and [size for _, size in calls[1:]] == [4] and cb.batch_size == model.batch_size == 4


def test_a_step_that_never_fits_ends_in_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _failing(monkeypatch, 10**6)
    model = LitClassifier()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cb = autoremat.AutoRemat(budget="auto", module="model", raise_batch_size=False, verbose=False)
    with pytest.warns(UserWarning), pytest.raises(torch.OutOfMemoryError, match="AUTOREMAT_MARGIN") as err:
        _trainer(cb, tmp_path).fit(model)
    assert len(calls) == steps.CONFIRM_TRIES
    # every try named with its budget and its error (an H200 run said only the last one's)
    budgets = [budget for budget, _ in calls]
    assert all(f"{i + 1}) {b} bytes: " in str(err.value) for i, b in enumerate(budgets)), str(err.value)
    assert not autoremat.is_patched(model.model)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


class _Strategy:
    def __init__(self, answer: Any = None) -> None:
        self.sent: list[Any] = []
        self.answer = answer

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        self.sent.append(obj)
        return obj if self.answer is None else self.answer


def _fake_trainer(zero: bool, strategy: _Strategy) -> Any:
    import types

    loop = types.SimpleNamespace(_combined_loader=object())
    return types.SimpleNamespace(is_global_zero=zero, strategy=strategy, fit_loop=loop,
                                 _accelerator_connector=None)


@pytest.mark.parametrize("kind", ["ddp", "fsdp1", "fsdp2"])
def test_rank_zero_tells_the_other_ranks_when_planning_fails(monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """The other ranks wait for rank 0's plan in a broadcast: a failure on rank 0 is broadcast
    before it is raised, so they stop with it instead of hanging. Under FSDP every rank takes
    part in the capture first (before: rank 0's failure was raised without a word there, and the
    other ranks failed with gloo's 'Connection closed by peer', or waited had its process lived)."""
    monkeypatch.setattr(lit, "strategy_kind", lambda trainer: kind)
    cb = autoremat.AutoRemat(budget="60%", raise_batch_size=False, verbose=False)
    cb._target = torch.nn.Linear(2, 2)

    def boom(trainer: Any, *args: Any) -> None:
        if trainer.is_global_zero:
            raise ValueError("budget='60%' is below the least step peak")

    if kind == "ddp":
        monkeypatch.setattr(cb, "_profile_and_solve", boom)
    else:
        monkeypatch.setattr(lit, "profile_and_solve_sharded", lambda cb, trainer, *args: boom(trainer))
    zero = _Strategy()
    with pytest.raises(ValueError, match="below the least step peak"):
        cb._fit_start(_fake_trainer(True, zero), None)  # type: ignore[arg-type]
    assert zero.sent == [{"error": "ValueError: budget='60%' is below the least step peak"}]
    other = _Strategy(answer=zero.sent[0])
    with pytest.raises(RuntimeError, match="rank 0 failed while planning, so every rank stops: ValueError"):
        cb._fit_start(_fake_trainer(False, other), None)  # type: ignore[arg-type]
    assert other.sent == [None]
