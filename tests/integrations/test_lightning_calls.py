"""A ``training_step`` that calls the planned module more than once (a contrastive encoder on two
views of the batch): both calls' activations are live until backward, so the callback shares a
byte budget between the calls. Before, it planned one call at the whole budget and the real
step, holding two calls, ran out of memory on a device the plan was made for (the simulated
device of ``tests/_oom.py``)."""

from __future__ import annotations

import copy
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from _oom import SimulatedDevice, storage_bytes
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import autoremat
from autoremat.integrations._lightning_steps import calls_per_step


class _TwoViews(pl.LightningModule):
    def __init__(self, manual: bool = False, batch_size: int = 8, size: int = 16) -> None:
        super().__init__()
        self.automatic_optimization = not manual
        layers: list[nn.Module] = [nn.Conv2d(3, 16, 3, padding=1), nn.ReLU()]
        for _ in range(5):
            layers += [nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU()]
        self.encoder = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 8))
        self.batch_size = batch_size
        self.images = torch.randn(2 * batch_size, 3, size, size, generator=torch.Generator().manual_seed(0))
        self.seen: dict[str, list[int]] = {"rows": []}  # a side effect of each step
        self.steps = 0

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        (x,) = batch
        z1 = F.normalize(self.encoder(x), dim=1)
        z2 = F.normalize(self.encoder(torch.flip(x, dims=[3])), dim=1)
        loss = F.cross_entropy(z1 @ z2.t() / 0.1, torch.arange(x.shape[0], device=x.device))
        self.seen["rows"].append(x.shape[0])
        self.steps += 1
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        self.encoder(x)  # after the backward: not a call whose activations the step holds
        return None

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.images), batch_size=self.batch_size)


def _trainer(callbacks: list[pl.Callback], tmp_path: Path) -> pl.Trainer:
    return pl.Trainer(max_steps=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                      callbacks=callbacks)


def _step_peak(lit: _TwoViews) -> int:
    """The unpatched two-call step's peak above what is live at its start."""
    x = lit.images[: lit.batch_size]
    from autoremat.measure import LiveStorageCounter

    with LiveStorageCounter() as counter:
        before = counter.live
        lit.training_step((x,), 0).backward()
    lit.zero_grad(set_to_none=True)
    return counter.peak - before


def test_a_byte_budget_is_shared_by_the_calls_and_the_real_step_fits(tmp_path: Path) -> None:
    torch.manual_seed(0)
    reference = _TwoViews()
    _trainer([], tmp_path).fit(reference)
    params = sum(p.numel() * p.element_size() for p in reference.parameters())
    batch = reference.images[:8].numel() * 4
    # room for the step: the two-call step peak / 1.7 (one call alone fits it unpatched)
    capacity = storage_bytes([*reference.parameters(), *reference.buffers()]) + 2 * params + batch + int(
        _step_peak(_TwoViews()) / 1.7)
    torch.manual_seed(0)
    lit = _TwoViews()
    device = SimulatedDevice(capacity, [*lit.parameters(), *lit.buffers()])
    cb = autoremat.AutoRemat(budget=capacity, raise_batch_size=False, verbose=False)
    torch.manual_seed(0)
    with device:
        _trainer([cb], tmp_path).fit(lit)
    assert device.ooms == 0, device.failed_ops
    assert cb.module == "encoder" and "2 calls per step" in cb.summary["budget_note"]
    assert lit.seen == reference.seen == {"rows": [8, 8]} and lit.steps == 2
    for (k, a), (_, b) in zip(reference.state_dict().items(), lit.state_dict().items()):
        assert torch.equal(a, b), k


@pytest.mark.parametrize("manual", [False, True])
def test_calls_are_counted_up_to_the_first_backward_and_leave_the_module_as_it_was(
        manual: bool, tmp_path: Path) -> None:
    lit = _TwoViews(manual)
    trainer = _trainer([], tmp_path)
    trainer.fit(lit)  # a trainer with its dataloader and optimizers, as on_fit_start sees it
    cb = autoremat.AutoRemat(budget="50%", module="encoder")
    cb._target = lit.encoder
    state = {k: v.clone() for k, v in lit.state_dict().items()}
    rng = torch.get_rng_state()
    seen, steps = copy.deepcopy(lit.seen), lit.steps
    assert calls_per_step(cb, trainer, lit) == 2
    assert lit.seen == seen and lit.steps == steps  # the counting step's own side effects are undone
    assert all(torch.equal(v, lit.state_dict()[k]) for k, v in state.items())
    assert torch.equal(rng, torch.get_rng_state())


class _Tally(nn.Module):
    """A submodule keeping state outside its parameters and buffers, as a ``torchmetrics`` metric
    does: a tensor updated in place, a list appended to, an attribute rebound."""

    def __init__(self) -> None:
        super().__init__()
        self.rows = torch.zeros(())
        self.sizes: list[int] = []
        self.last = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.rows += x.shape[0]
        self.sizes.append(x.shape[0])
        self.last = x.shape
        return x


class _Tallied(_TwoViews):
    def __init__(self) -> None:
        super().__init__()
        self.tally = _Tally()

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        self.tally(batch[0])
        return super().training_step(batch, batch_idx)


def test_the_counting_step_leaves_submodules_state_as_it_was(tmp_path: Path) -> None:
    """The callback's own run of ``training_step`` (2 rows, to count the calls) reached the
    state of submodules (before: ``rows`` 18 after two steps of 8, ``sizes`` [2, 8, 8])."""
    lit = _Tallied()
    cb = autoremat.AutoRemat(budget="75%", module="encoder", raise_batch_size=False, verbose=False, solver="chen")
    _trainer([cb], tmp_path).fit(lit)
    assert cb.plan is not None and lit.tally.rows.item() == 16 and lit.tally.sizes == [8, 8]


def test_a_large_tensor_changed_in_place_is_named_not_copied(caplog: pytest.LogCaptureFixture) -> None:
    from autoremat.capture.preserved import KEEP_BYTES, kept_attributes

    outer = nn.Module()
    outer.inner = nn.Module()
    outer.inner.small, outer.inner.large = torch.zeros(4), torch.zeros(KEEP_BYTES // 4 + 1)
    outer.data, outer.total = torch.ones(KEEP_BYTES), torch.zeros(())  # the LightningModule's own: no copies
    with kept_attributes(outer, private_root=True):
        outer.inner.small += 1
        outer.inner.large += 1
        outer.inner.added = 1
        outer.total += 1
    assert not outer.inner.small.any() and outer.inner.large.eq(1).all() and not hasattr(outer.inner, "added")
    assert outer.total.item() == 1
    assert "attribute Module.large" in caplog.text and "attribute Module.total" in caplog.text
    assert ".data" not in caplog.text  # never changed: no warning


def test_a_training_metric_counts_the_users_rows_only(tmp_path: Path) -> None:
    torchmetrics = pytest.importorskip("torchmetrics")

    class _Metered(_TwoViews):
        def __init__(self) -> None:
            super().__init__()
            self.acc = torchmetrics.Accuracy(task="multiclass", num_classes=8)

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            (x,) = batch
            self.acc(self.encoder(x), torch.arange(x.shape[0]) % 8)
            return super().training_step(batch, batch_idx)

    seen = []
    for callbacks in ([], [autoremat.AutoRemat(budget="75%", module="encoder", raise_batch_size=False,
                                               verbose=False, solver="chen")]):
        torch.manual_seed(0)
        lit = _Metered()
        _trainer(callbacks, tmp_path).fit(lit)
        seen.append((int(lit.acc.tp.sum() + lit.acc.fn.sum()), lit.acc.compute().item()))
    assert seen[0] == seen[1] and seen[0][0] == 16, seen


def test_the_plan_cache_key_follows_training_step(tmp_path: Path) -> None:
    """How often ``training_step`` calls the module sets each call's budget: a cached decision
    made for one ``training_step`` is not reused for another (before: same key)."""
    from types import SimpleNamespace

    from autoremat.integrations._lightning_reuse import cache_key

    class _OneView(_TwoViews):
        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            (x,) = batch
            return self.encoder(x).square().mean()

    keys = []
    for cls in (_TwoViews, _OneView):
        lit = cls()
        cb = autoremat.AutoRemat(budget="50%", module="encoder", cache_dir=str(tmp_path))
        cb._target = lit.encoder
        trainer = SimpleNamespace(precision="32-true", lightning_module=lit)
        keys.append(cache_key(cb, trainer, (lit.images[:8],), {}))  # type: ignore[arg-type]
    assert keys[0] is not None and keys[0] != keys[1]


def test_a_cached_plan_is_reused_only_where_each_call_fits_its_share(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """``budget="auto"`` reuses a cached decision where its plan fits the memory free now; the
    room is shared between the calls as planning shares it (before: the whole room, so a plan of
    one call at 1.5x its share was reused on a device its two-call step does not fit)."""
    from autoremat import budget as budget_mod

    free = [10**10]
    monkeypatch.setattr(budget_mod, "device_free_bytes", lambda device=None: free[0])
    monkeypatch.setenv("AUTOREMAT_MARGIN", "0")
    sources = []
    for room in ("plenty", "the same", "1.5 calls"):
        if room == "1.5 calls":
            free[0] = int(1.5 * per_call)
        cb = autoremat.AutoRemat(budget="auto", raise_batch_size=False, verbose=False, cache_dir=str(tmp_path))
        _trainer([cb], tmp_path).fit(_TwoViews())
        sources.append(cb.summary["source"])
        per_call = cb.summary["predicted_peak_bytes"]
        assert "2 calls per step" in cb.summary["budget_note"]
    assert [s.startswith("cache") for s in sources] == [False, True, False], sources


def test_the_cached_plans_room_check_reads_the_budget_as_planning_does() -> None:
    """One check for both integrations (Accelerate passes ``calls_per_step``, Lightning the count
    stored with the decision): relative budgets always fit; a byte budget's room, net of the
    resident bytes, is shared by the calls, and a misfit says so."""
    from autoremat.integrations._planning import cached_plan_misfit

    entry = {"summary": {"predicted_peak_bytes": 600}}
    assert cached_plan_misfit(entry, "10%", "cpu", 0, None, calls=4) is None
    assert cached_plan_misfit(entry, "min", "cpu", 0, None) is None
    assert cached_plan_misfit(entry, 1100, "cpu", 100, None) is None
    misfit = cached_plan_misfit(entry, 1100, "cpu", 100, None, calls=2)
    assert misfit is not None and "(500 bytes per call, 2 calls per step)" in misfit
    assert "(no room above the resident bytes)" in (cached_plan_misfit(entry, 100, "cpu", 100, None) or "")


@pytest.mark.gpu
def test_gpu_two_views_fit_under_a_memory_fraction(tmp_path: Path) -> None:
    """The same on the CUDA allocator: ``set_per_process_memory_fraction`` leaves the two-call step
    1.7x too little room (one call alone fits), ``budget="auto"``; two steps, no out-of-memory."""
    torch.manual_seed(0)
    lit = _TwoViews(batch_size=256, size=64).cuda()
    x = lit.images[:256].cuda()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    lit.training_step((x,), 0).backward()
    peak = torch.cuda.max_memory_allocated() - base
    lit.zero_grad(set_to_none=True)
    params = sum(p.numel() * p.element_size() for p in lit.parameters())
    del x
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(
        (torch.cuda.memory_reserved() + 3 * params + lit.images[:256].numel() * 4 + int(peak / 1.7)) / total)
    try:
        cb = autoremat.AutoRemat(budget="auto", raise_batch_size=False, verbose=False)
        pl.Trainer(max_steps=2, accelerator="gpu", devices=1, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, callbacks=[cb],
                   default_root_dir=tmp_path).fit(lit)
        assert cb.plan is not None and "2 calls per step" in cb.summary["budget_note"]
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
