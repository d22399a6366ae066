"""The step that does not fit: Lightning and Accelerate on a simulated device (tests/_oom.py) whose
capacity leaves the unpatched step 1.5-2x too little room. Profiling never runs a step above it,
training runs to the end with every step under it, and the trained weights (so every gradient)
equal an unpatched run's on a machine where it fits. GPU variants use the real CUDA allocator."""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from _oom import SimulatedDevice, storage_bytes
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import autoremat
import autoremat.integrations.accelerate as ar
from autoremat.measure import default_loss, gradients, gradients_equal, measure
from autoremat.zoo.lightning import LitClassifier, LitGPT2

RATIO = 1.7
"""Unpatched step peak over the room the device leaves for a step."""


class _LitSegmentation(pl.LightningModule):
    """A zoo U-Net (fx level) on random tiles; loss: the mean of the logits."""

    def __init__(self, batch_size: int = 2, samples: int = 8) -> None:
        super().__init__()
        self.model, (x,) = autoremat.zoo.build("unet", size="small", batch_size=1)
        self.batch_size = batch_size
        self.images = torch.randn((samples, *x.shape[1:]), generator=torch.Generator().manual_seed(0))

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        (x,) = batch
        return self.model(x).float().mean()

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.images), batch_size=self.batch_size)


def _cnn() -> pl.LightningModule:
    return LitClassifier(batch_size=8, samples=32)


def _unet() -> pl.LightningModule:
    return _LitSegmentation()


def _gpt2() -> pl.LightningModule:
    pytest.importorskip("transformers")
    return LitGPT2(batch_size=8, samples=32, n_layer=2)  # dropout on


def _first_batch(lit: pl.LightningModule) -> tuple[tuple, dict, Any]:
    """Inputs of ``lit.model`` in a training step, their bytes, and the loss that step takes."""
    if isinstance(lit, LitGPT2):
        ids = lit.tokens[: lit.batch_size]
        return (), {"input_ids": ids, "labels": ids}, lambda out: out.loss
    if isinstance(lit, LitClassifier):
        x, y = lit.images[: lit.batch_size], lit.labels[: lit.batch_size]
        return (x,), {}, None
    return (lit.images[: lit.batch_size],), {}, None


def _capacity(lit: pl.LightningModule, slots: int, ratio: float = RATIO, precision: str = "32-true") -> int:
    """Parameters, buffers, ``slots`` optimizer tensors and the gradients per parameter, the batch,
    and a step allowance of the unpatched step peak (under ``precision``) / RATIO."""
    args, kwargs, loss = _first_batch(lit)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
        peak = measure(lit.model, args, kwargs, loss_fn=loss, steps=1, warmup=0).peak_bytes
    params = sum(p.numel() * p.element_size() for p in lit.parameters())
    batch = sum(t.numel() * t.element_size() for t in (*args, *kwargs.values()))
    if isinstance(lit, LitClassifier):
        batch += lit.labels[: lit.batch_size].numel() * 8
    return storage_bytes([*lit.parameters(), *lit.buffers()]) + (slots + 1) * params + batch + int(peak / ratio)


def _trainer(callbacks: list[pl.Callback], tmp_path: Path, steps: int = 2, precision: str = "32-true") -> pl.Trainer:
    return pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                      callbacks=callbacks, precision=precision)


class _StepPeaks(pl.Callback):
    def __init__(self, device: SimulatedDevice) -> None:
        self.device = device
        self.peaks: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
        self.device.reset_peak()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        self.peaks.append(self.device.peak)


def _fit_on_device(make: Any, slots: int, tmp_path: Path, caplog: pytest.LogCaptureFixture,
                   loss_fn: Any = None, check_baseline: bool = False, ratio: float = RATIO,
                   precision: str = "32-true") -> None:
    torch.manual_seed(0)
    reference = make()
    _trainer([], tmp_path, precision=precision).fit(reference)  # unpatched, no limit: fits on this machine
    capacity = _capacity(make(), slots, ratio, precision)  # a throwaway instance: measuring updates batch norms
    torch.manual_seed(0)
    lit = make()
    if check_baseline:  # the unpatched step does not fit the simulated device
        torch.manual_seed(0)
        plain = make()
        with pytest.raises(torch.OutOfMemoryError), \
                SimulatedDevice(capacity, [*plain.parameters(), *plain.buffers()]):
            _trainer([], tmp_path, precision=precision).fit(plain)
    device = SimulatedDevice(capacity, [*lit.parameters(), *lit.buffers()])
    probe = _StepPeaks(device)
    cb = autoremat.AutoRemat(budget=capacity, module="model", raise_batch_size=False, verbose=False,
                             loss_fn=loss_fn)
    torch.manual_seed(0)
    with caplog.at_level(logging.INFO, logger="autoremat.capture.scaled"), device:
        _trainer([cb, probe], tmp_path, precision=precision).fit(lit)
    assert device.ooms == 0, device.failed_ops
    assert "profiled at batch sizes" in caplog.text  # the full-size unpatched step never ran
    assert cb.plan is not None and cb.plan.recompute_segments
    assert len(probe.peaks) == 2 and all(p <= capacity for p in probe.peaks)
    for (k, a), (_, b) in zip(reference.state_dict().items(), lit.state_dict().items()):
        assert torch.equal(a, b), k


def test_lightning_fx_cnn_fits_a_device_the_unpatched_step_does_not(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    _fit_on_device(_cnn, 1, tmp_path, caplog, check_baseline=True)


UNET_RATIO = 1.5
"""The U-Net's least plan needs about 64 % of its unpatched step peak (long skips keep their
activations): a device 1.5x too small for the unpatched step, not 1.7x."""


def test_lightning_fx_unet_fits_the_device(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _fit_on_device(_unet, 1, tmp_path, caplog, check_baseline=True, ratio=UNET_RATIO)


class _LitWideInput(pl.LightningModule):
    """A conv net whose batch (32 channels in) outweighs its step's activations (4 channels): a
    device with room for one batch beside the step has none for two."""

    def __init__(self, batch_size: int = 8, samples: int = 32) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(32, 4, 1)]
        for _ in range(6):
            layers += [nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1)]
        self.model = nn.Sequential(*layers)
        self.batch_size = batch_size
        self.images = torch.randn(samples, 32, 32, 32, generator=torch.Generator().manual_seed(0))

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        (x,) = batch
        return self.model(x).mean()

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.images), batch_size=self.batch_size)


def test_lightning_holds_one_batch_at_a_time_while_planning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The profiling batch is let go before the measured step loads its own: the device has room
    for one batch (an H200 run ran out loading the second batch of 48 MiB under its cap)."""
    _fit_on_device(_LitWideInput, 1, tmp_path, caplog, ratio=1.4)


def test_a_failed_confirming_step_leaves_nothing_on_the_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The confirming step runs out of memory in the forward (as on an H200, where a prediction
    missed a workspace): the retry starts with the device as it was before the failed try (no
    activation of it kept), plans again below, and the fit ends with no out-of-memory error of
    the device; the final message would name every try."""
    import autoremat.integrations.lightning as lightning_cb

    torch.manual_seed(0)
    capacity = _capacity(_LitWideInput(), 1, 1.2)  # room to plan again at 85 %
    torch.manual_seed(0)
    lit = _LitWideInput()
    device = SimulatedDevice(capacity, [*lit.parameters(), *lit.buffers()])
    original, levels = lightning_cb.trial_step, []

    def failing_once(target, args, kwargs, loss_fn, trainer):  # type: ignore[no-untyped-def]
        levels.append(device.live)
        if len(levels) > 1:
            return original(target, args, kwargs, loss_fn, trainer)

        def oom(module, inputs, output):  # type: ignore[no-untyped-def]
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (simulated)")
        handle = list(target.children())[-1].register_forward_hook(oom)
        try:
            return original(target, args, kwargs, loss_fn, trainer)
        finally:
            handle.remove()

    monkeypatch.setattr(lightning_cb, "trial_step", failing_once)
    cb = autoremat.AutoRemat(budget=capacity, module="model", raise_batch_size=False, verbose=False)
    with pytest.warns(UserWarning, match="ran out of memory although its predicted peak"), device:
        _trainer([cb], tmp_path).fit(lit)
    assert len(levels) == 2 and levels[1] <= levels[0], levels
    assert device.ooms == 0, device.failed_ops


class _OOMsInTraining(pl.Callback):
    """Out-of-memory errors of the device during training steps (the batch-size search before
    them may run into some on purpose: a trial step that does not fit backs off)."""

    def __init__(self, device: SimulatedDevice) -> None:
        self.device = device
        self.during: list[int] = []
        self._before = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
        self._before = self.device.ooms

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        self.during.append(self.device.ooms - self._before)


def test_lightning_raises_the_batch_from_a_scaled_graph(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The unpatched step at the original batch is RATIO x the room the device leaves: profiling
    scales, the batch is raised from the scaled graph (solves and patched trial steps on the
    device), training at the chosen batch runs with every step under the capacity, and ends with
    the weights of an unpatched run at that batch on a machine where it fits."""
    torch.manual_seed(0)
    capacity = _capacity(_cnn(), 1)
    torch.manual_seed(0)
    lit = _cnn()
    device = SimulatedDevice(capacity, [*lit.parameters(), *lit.buffers()])
    peaks, ooms = _StepPeaks(device), _OOMsInTraining(device)
    cb = autoremat.AutoRemat(budget=capacity, module="model", raise_batch_size=True, verbose=False)
    torch.manual_seed(0)
    with caplog.at_level(logging.INFO, logger="autoremat.capture.scaled"), device:
        _trainer([cb, peaks, ooms], tmp_path).fit(lit)
    assert "profiled at batch sizes" in caplog.text  # the unpatched step at the original batch never ran
    assert cb.batch_size is not None and cb.batch_size > cb.original_batch_size == 8, cb.batch_size
    assert lit.batch_size == cb.batch_size
    assert ooms.during == [0, 0] and len(peaks.peaks) == 2 and all(p <= capacity for p in peaks.peaks)
    torch.manual_seed(0)
    reference = LitClassifier(batch_size=cb.batch_size, samples=32)
    torch.manual_seed(0)
    _trainer([], tmp_path).fit(reference)  # unpatched, no limit
    for (k, a), (_, b) in zip(reference.state_dict().items(), lit.state_dict().items()):
        assert torch.equal(a, b), k


def test_lightning_module_level_gpt2_fits_the_device(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _fit_on_device(_gpt2, 2, tmp_path, caplog, loss_fn=lambda out: out.loss)


def test_lightning_gpt2_under_bf16_mixed_fits_the_device(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``precision="bf16-mixed"``: the unpatched step does not fit; the full-size bytes come from the
    meta capture with the device's autocast emulated (it fell back to a linear fit of small real
    captures before), every step's peak stays under the device, and the parameters equal plain
    bf16 training's."""
    _fit_on_device(_gpt2, 2, tmp_path, caplog, loss_fn=lambda out: out.loss, check_baseline=True,
                   precision="bf16-mixed")
    assert "emulated on meta tensors" in caplog.text and "bytes from meta" in caplog.text


def _accelerate_on_device(model: nn.Module, args: tuple, kwargs: dict, loss_fn: Any, ratio: float = RATIO,
                          check_baseline: bool = False) -> None:
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    loss_fn = loss_fn or default_loss
    peak = measure(copy.deepcopy(model), args, kwargs, loss_fn=loss_fn, steps=1, warmup=0).peak_bytes
    inputs = [*args, *kwargs.values()]
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    capacity = storage_bytes([*model.parameters(), *model.buffers(), *inputs]) + params + int(peak / ratio)
    if check_baseline:  # the unpatched step does not fit the device
        plain = copy.deepcopy(model)
        with pytest.raises(torch.OutOfMemoryError), \
                SimulatedDevice(capacity, [*plain.parameters(), *plain.buffers(), *inputs]):
            loss_fn(plain(*args, **kwargs)).backward()
    device = SimulatedDevice(capacity, [*model.parameters(), *model.buffers(), *inputs])
    accelerator = Accelerator(cpu=True)
    peaks = []
    with device:
        ar.prepare(accelerator, model, args, kwargs, budget=capacity, optimizer=opt)
        model, opt = accelerator.prepare(model, opt)
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            device.reset_peak()
            torch.manual_seed(1)
            accelerator.backward(loss_fn(model(*args, **kwargs)))
            peaks.append(device.peak)
            opt.step()
    assert device.ooms == 0, device.failed_ops
    assert autoremat.is_patched(model) and all(p <= capacity for p in peaks)
    for _ in range(2):
        ref_opt.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        loss_fn(reference(*args, **kwargs)).backward()
        ref_opt.step()
    assert gradients_equal(gradients(reference), gradients(model))  # the last step's
    for (k, a), (_, b) in zip(reference.state_dict().items(), model.state_dict().items()):
        assert torch.equal(a, b), k
    autoremat.restore(model)


def test_accelerate_fx_cnn_fits_the_device() -> None:
    model, (x,) = autoremat.zoo.build("resnet50", size="small", batch_size=8)
    _accelerate_on_device(model, (x,), {}, None, check_baseline=True)


def test_accelerate_fx_unet_fits_the_device() -> None:
    model, (x,) = autoremat.zoo.build("unet", size="small", batch_size=2)
    _accelerate_on_device(model, (x,), {}, None, ratio=UNET_RATIO, check_baseline=True)


@pytest.mark.slow
def test_accelerate_module_level_gpt2_fits_the_device() -> None:
    pytest.importorskip("transformers")
    from autoremat.zoo.hf import gpt2, logits_mean

    ids = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(0))
    _accelerate_on_device(gpt2(n_layer=2), (), {"input_ids": ids}, logits_mean)


# ---------------------------------------------------------------------- the real CUDA allocator
# Sizes: step peaks of a few hundred MiB. The caching allocator hands out 2 MiB-rounded blocks
# from 20 MiB segments (tensors of 1-10 MiB), so at a step peak of a few MiB (the CPU tests' sizes)
# its rounding, not the activations, decides what fits (an H200 run at those sizes ran out moving
# a 20 MiB batch under a 27 MiB cap). The caps count from the reserved memory (the allocator's
# cached blocks count against a memory fraction) and include the batch.
def _cuda_fraction(step_bytes: int) -> float:
    total = torch.cuda.get_device_properties(0).total_memory
    return (torch.cuda.memory_reserved() + step_bytes) / total


@pytest.mark.gpu
def test_gpu_lightning_cnn_under_a_memory_fraction(tmp_path: Path) -> None:
    """``set_per_process_memory_fraction`` leaves the unpatched step RATIO x too little room;
    AutoRemat(budget="auto") profiles within it, and training ends with no out-of-memory error."""
    torch.manual_seed(0)
    lit = LitClassifier(batch_size=1024, samples=2048).cuda()
    x = lit.images[:1024].cuda()
    peak = measure(lit.model, (x,), steps=1, warmup=0).peak_bytes
    params = sum(p.numel() * p.element_size() for p in lit.parameters())
    batch = x.numel() * x.element_size()
    del x
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(_cuda_fraction(3 * params + batch + int(peak / RATIO)))
    try:
        cb = autoremat.AutoRemat(budget="auto", module="model", raise_batch_size=False, verbose=False)
        with _live_blocks_on_oom():
            pl.Trainer(max_steps=2, accelerator="gpu", devices=1, logger=False, enable_checkpointing=False,
                       enable_progress_bar=False, callbacks=[cb], default_root_dir=tmp_path).fit(lit)
        assert cb.plan is not None
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


@pytest.mark.gpu
def test_gpu_accelerate_cnn_under_a_memory_fraction() -> None:
    model, (x,) = autoremat.zoo.build("resnet50", size="small", batch_size=1024, device="cuda")
    peak = measure(model, (x,), steps=1, warmup=0).peak_bytes
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(_cuda_fraction(2 * params + int(peak / RATIO)))
    try:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        ar.prepare(Accelerator(), model, (x,), budget="auto", optimizer=opt)
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            default_loss(model(x)).backward()
            opt.step()
        assert autoremat.is_patched(model)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        autoremat.restore(model)


class _CudaStepPeaks(pl.Callback):
    """The allocator's peak of every training step."""

    def __init__(self) -> None:
        self.peaks: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        torch.cuda.synchronize()
        self.peaks.append(torch.cuda.max_memory_allocated())


@contextlib.contextmanager
def _live_blocks_on_oom() -> Iterator[None]:
    """On an out-of-memory error inside, the allocator's live blocks of 1 MiB or more with the
    Python frames that allocated them, added to the error (what held the memory: two H200 runs
    ran out loading a 48 MiB batch under a cap that should have left room for it)."""
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    try:
        yield
    except torch.OutOfMemoryError as err:
        lines = [f"allocated {torch.cuda.memory_allocated()} reserved {torch.cuda.memory_reserved()}"]
        try:
            for seg in torch.cuda.memory._snapshot()["segments"]:
                for b in seg["blocks"]:
                    if b["state"] == "active_allocated" and b["size"] >= 2**20:
                        frames = [f"{f['filename'].rsplit('/', 2)[-1]}:{f['line']}:{f['name']}"
                                  for f in b.get("frames", [])
                                  if f["filename"].endswith(".py") and "/torch/" not in f["filename"]][:8]
                        lines.append(f"{b['size']} bytes: {' < '.join(frames)}")
        except Exception as exc:  # noqa: BLE001 - a diagnosis that fails must not hide the error
            lines.append(f"(no snapshot: {type(exc).__name__}: {exc})")
        raise torch.OutOfMemoryError(f"{err}\nlive blocks:\n" + "\n".join(lines)) from err
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def _gpu_trainer(callbacks: list[pl.Callback], tmp_path: Path) -> pl.Trainer:
    return pl.Trainer(max_steps=2, accelerator="gpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                      default_root_dir=tmp_path)


def _unpatched_step_runs_out(model: nn.Module, x: torch.Tensor) -> bool:
    """Whether one unpatched step of ``model`` on ``x`` runs out of the capped memory; the model's
    buffers (batch-norm statistics), gradients and the RNG are left as they were."""
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    try:
        with torch.random.fork_rng(devices=[x.device]):
            default_loss(model(x)).backward()
        return False
    except torch.OutOfMemoryError:
        return True
    finally:
        with torch.no_grad():
            for k, v in model.named_buffers():
                v.copy_(buffers[k])
        model.zero_grad(set_to_none=True)
        del buffers
        torch.cuda.empty_cache()


def _gpu_fit_under_a_fraction(make: Any, slots: int, tmp_path: Path, *, ratio: float,
                              raise_batch_size: bool = False) -> tuple[pl.LightningModule, autoremat.AutoRemat]:
    """An unpatched reference fit on the whole GPU, then the fit under a memory fraction that leaves
    the unpatched step ``ratio`` x too little room: the unpatched step runs out there, the fit with
    ``AutoRemat(budget="auto")`` does not, and every step stays under the cap."""
    torch.manual_seed(0)
    reference = make()
    _gpu_trainer([], tmp_path).fit(reference)
    ref_state = {k: v.detach().cpu() for k, v in reference.state_dict().items()}
    del reference
    torch.cuda.empty_cache()
    torch.manual_seed(0)
    lit = make().cuda()
    args, _kwargs, _loss = _first_batch(lit)
    x = args[0].cuda()
    peak = measure(copy.deepcopy(lit.model), (x,), steps=1, warmup=0).peak_bytes
    torch.cuda.empty_cache()
    params = sum(p.numel() * p.element_size() for p in lit.parameters())
    cap = torch.cuda.memory_reserved() + (slots + 1) * params + int(peak / ratio)
    torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.get_device_properties(0).total_memory)
    try:
        assert _unpatched_step_runs_out(lit.model, x)
        del x
        torch.cuda.empty_cache()
        probe = _CudaStepPeaks()
        cb = autoremat.AutoRemat(budget="auto", module="model", raise_batch_size=raise_batch_size, verbose=False)
        torch.manual_seed(0)
        with _live_blocks_on_oom():
            _gpu_trainer([cb, probe], tmp_path).fit(lit)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert cb.plan is not None and cb.plan.recompute_segments
    assert len(probe.peaks) == 2 and all(p <= cap for p in probe.peaks), (probe.peaks, cap)
    if not raise_batch_size:  # the same training as the unpatched reference (cuDNN: equal to rounding)
        for k, v in lit.state_dict().items():
            torch.testing.assert_close(v.detach().cpu(), ref_state[k], rtol=1e-4, atol=1e-5, msg=k)
    return lit, cb


GPU_UNET_RATIO = 1.3
"""On an H200 the U-Net's least plan needed 57 % of its unpatched step peak (cuDNN's backward
workspace of the long-skip convolutions is in it): at 1.5x the ``"auto"`` budget (52 %, after
the margin) had no plan. (H200 run 7, 2026-11-28: 63 % under Accelerate, where the test still used
the CPU's 1.5x.)"""


@pytest.mark.gpu
def test_gpu_lightning_unet_under_a_memory_fraction(tmp_path: Path) -> None:
    _gpu_fit_under_a_fraction(lambda: _LitSegmentation(batch_size=64, samples=128), 1, tmp_path,
                              ratio=GPU_UNET_RATIO)


@pytest.mark.gpu
def test_gpu_lightning_raises_the_batch_under_a_memory_fraction(tmp_path: Path) -> None:
    lit, cb = _gpu_fit_under_a_fraction(lambda: LitClassifier(batch_size=512, samples=4096), 1, tmp_path, ratio=RATIO,
                                        raise_batch_size=True)
    assert cb.batch_size is not None and cb.batch_size > 64 and lit.batch_size == cb.batch_size


@pytest.mark.gpu
def test_gpu_accelerate_unet_under_a_memory_fraction() -> None:
    torch.manual_seed(0)
    model, (x,) = autoremat.zoo.build("unet", size="small", batch_size=64, device="cuda")
    reference = copy.deepcopy(model)
    peak = measure(copy.deepcopy(model), (x,), steps=1, warmup=0).peak_bytes
    torch.cuda.empty_cache()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    cap = torch.cuda.memory_reserved() + 2 * params + int(peak / GPU_UNET_RATIO)
    torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.get_device_properties(0).total_memory)
    peaks = []
    try:
        assert _unpatched_step_runs_out(model, x)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        ar.prepare(Accelerator(), model, (x,), budget="auto", optimizer=opt)
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            torch.cuda.reset_peak_memory_stats()
            default_loss(model(x)).backward()
            peaks.append(torch.cuda.max_memory_allocated())
            opt.step()
        assert autoremat.is_patched(model) and all(p <= cap for p in peaks), (peaks, cap)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        autoremat.restore(model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    for _ in range(2):
        ref_opt.zero_grad(set_to_none=True)
        default_loss(reference(x)).backward()
        ref_opt.step()
    for (k, a), (_, b) in zip(reference.state_dict().items(), model.state_dict().items()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=k)
