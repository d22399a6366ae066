"""diffusers U-Nets as a new user trains them (small configs built in place, nothing downloaded):
``UNet2DModel`` and ``UNet2DConditionModel`` with long skips, self- and cross-attention, timestep
embeddings and dropout, under capture + solve + apply, ``AutoRemat`` and ``prepare``; gradients and
trained weights bit for bit, step peaks predicted against measured. The first two tests are plain
torch copies of the pattern that diffusers' up blocks showed (no diffusers needed)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autoremat
from autoremat.measure import gradients, gradients_equal, measure


class _Block(nn.Module):
    def __init__(self, c: int, norm: bool) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(5, c) if norm else nn.Identity()
        self.conv = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(torch.relu(self.norm(x)))
        return (x + h) / 2  # h and the sum stay in this frame until it returns (diffusers' ResnetBlock2D)


class _Stage(nn.Module):
    """An up block: concatenates its input with a skip and runs repeated blocks (captured op by op)."""

    def __init__(self, c: int, norm: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(5 * c, norm) for _ in range(2))

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        h = torch.cat([x, skip], dim=1)
        for b in self.blocks:
            h = b(h)
        return h


class _SkipNet(nn.Module):
    def __init__(self, norm: bool, c: int = 8) -> None:
        super().__init__()
        self.stem, self.up = nn.Conv2d(3, c, 3, padding=1), nn.Conv2d(c, 4 * c, 3, padding=1)
        self.stage, self.head = _Stage(c, norm), nn.Conv2d(5 * c, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = self.stem(x)
        sample = self.up(skip)
        sample = self.stage(sample, skip)  # this frame holds the old sample while the stage runs
        return self.head(sample)


def _unpatched(model: nn.Module, args: tuple, kwargs: dict | None = None, loss_fn: Any = None,
               **capture_kw: Any) -> tuple[autoremat.Graph, int, int]:
    g = autoremat.capture(model, args, kwargs, loss_fn=loss_fn, **capture_kw)
    predicted = autoremat.simulate(g, autoremat.solve(g, "100%")).peak_bytes
    measured = measure(model, args, kwargs, loss_fn=loss_fn, steps=1, warmup=1).peak_bytes
    return g, predicted, measured


def test_an_argument_the_caller_holds_counts_while_the_callee_runs() -> None:
    """The up block's input is read by its first op (a concatenation, which saves nothing), but the
    caller's frame holds it until the block returns, under the temporaries of its last ResNet block:
    the unpatched step peak was predicted at 0.79x the measured one (diffusers' ``UNet2DModel``:
    0.977x)."""
    torch.manual_seed(0)
    model, x = _SkipNet(norm=False), torch.randn(4, 3, 16, 16)
    _, predicted, measured = _unpatched(model, (x,), mode="module")
    assert abs(predicted - measured) <= 64, (predicted, measured)


def test_an_op_saving_its_own_statistics_does_not_linger() -> None:
    """Group norm saves its mean and rstd (its own outputs) for backward, not its result: the result
    died after its last reader while the statistics lived on, and was counted as a lingering local to
    the end of the block call (1.025x the measured peak)."""
    torch.manual_seed(0)
    model, x = _SkipNet(norm=True), torch.randn(4, 3, 16, 16)
    _, predicted, measured = _unpatched(model, (x,), mode="module")
    assert abs(predicted - measured) <= 64, (predicted, measured)


def _skipnet_and_target() -> tuple[nn.Module, torch.Tensor, torch.Tensor, int]:
    torch.manual_seed(0)
    model, x = _SkipNet(norm=True), torch.randn(4, 3, 16, 16)
    target = torch.randn(4, 3, 16, 16)
    return model, x, target, measure(model, (x,), steps=1, warmup=0).peak_bytes


def test_a_loss_closing_over_its_target_runs_on_the_meta_capture(caplog: pytest.LogCaptureFixture) -> None:
    """A diffusion step's loss reads the noise it closes over (a real tensor) beside the meta output:
    it failed on meta ('Tensor on device cpu is not on the expected device meta'), and a step that fits
    was then profiled at smaller batches, where the target no longer matches (a RuntimeError)."""
    from autoremat.capture.scaled import capture_within

    model, x, target, _ = _skipnet_and_target()
    with caplog.at_level(logging.INFO, logger="autoremat.capture.scaled"):
        g = capture_within(model, (x,), limit_bytes=10 ** 10, loss_fn=lambda out: F.mse_loss(out, target),
                           mode="module")
    assert "cannot run on meta" not in caplog.text
    assert len(g) == len(autoremat.capture(model, (x,), loss_fn=lambda out: F.mse_loss(out, target), mode="module"))


def test_a_step_that_does_not_fit_takes_its_bytes_from_meta_with_a_closed_over_target(
        caplog: pytest.LogCaptureFixture) -> None:
    """A loss that slices its target to the output's rows runs at the cut batches (times) and, now, on
    meta at the full batch (bytes; a linear fit of real captures before)."""
    from autoremat.capture.scaled import capture_within

    model, x, target, peak = _skipnet_and_target()
    with caplog.at_level(logging.INFO, logger="autoremat.capture.scaled"):
        capture_within(model, (x,), limit_bytes=peak // 2, mode="module",
                       loss_fn=lambda out: F.mse_loss(out, target[: out.shape[0]]))
    assert "cannot run on meta" not in caplog.text and "bytes from meta" in caplog.text, caplog.text


def test_a_full_batch_target_at_a_cut_batch_says_what_to_do() -> None:
    from autoremat.capture.scaled import capture_within

    model, x, target, peak = _skipnet_and_target()
    with pytest.raises(RuntimeError, match=r"slice it to the output's rows"):  # (mse_loss broadcasts a cut of 1)
        capture_within(model, (x,), limit_bytes=peak // 2, mode="module",
                       loss_fn=lambda out: torch.dot(out.flatten(), target.flatten()))


# ------------------------------------------------------------------------------------------- diffusers


def _unet2d(dropout: float = 0.1, batch: int = 4, size: int = 16) -> tuple[nn.Module, tuple, dict, Any]:
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    unet = diffusers.UNet2DModel(
        sample_size=size, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"),
        norm_num_groups=8, dropout=dropout).train()
    x, t, noise, _ = _diffusion_batch(batch, 3, size)
    return unet, (x, t), {}, lambda out: F.mse_loss(out.sample.float(), noise)


def _diffusion_batch(batch: int, channels: int, size: int) -> tuple[torch.Tensor, ...]:
    """Latents, timesteps, the noise target and text embeddings (8 tokens of 32), seeded."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, channels, size, size, generator=g)
    t = torch.randint(0, 1000, (batch,), generator=g)
    cond = torch.randn(batch, 8, 32, generator=g)
    return x, t, torch.randn(batch, channels, size, size, generator=g), cond


def _cond_unet(dropout: float = 0.1, batch: int = 4, size: int = 16) -> tuple[nn.Module, tuple, dict, Any]:
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    unet = diffusers.UNet2DConditionModel(
        sample_size=size, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8, dropout=dropout).train()
    x, t, noise, cond = _diffusion_batch(batch, 4, size)
    return unet, (x, t), {"encoder_hidden_states": cond}, lambda out: F.mse_loss(out.sample.float(), noise)


def _grads(model: nn.Module, args: tuple, kwargs: dict, loss_fn: Any) -> dict:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(5)  # dropout masks
    loss_fn(model(*args, **kwargs)).backward()
    return gradients(model)


@pytest.fixture(scope="module")
def unet2d() -> tuple[nn.Module, tuple, dict, Any, autoremat.Graph]:
    model, args, kwargs, loss_fn = _unet2d()
    # FLOP times: the same plans on every machine (the peaks do not depend on times)
    return model, args, kwargs, loss_fn, autoremat.capture(model, args, kwargs, loss_fn=loss_fn, times="flops")


def test_unet2d_unpatched_peak_is_predicted_to_the_byte(unet2d: tuple) -> None:
    """With attention and dropout: the caller's hold on each up block's input (the previous
    upsampler's output) is what the prediction missed (0.977x the measured peak before)."""
    model, args, kwargs, loss_fn, g = unet2d
    predicted = autoremat.simulate(g, autoremat.solve(g, "100%")).peak_bytes
    torch.manual_seed(0)
    measured = measure(model, args, kwargs, loss_fn=loss_fn, steps=1, warmup=1).peak_bytes
    assert abs(predicted - measured) <= 0.001 * measured, (predicted, measured)


@pytest.mark.parametrize("budget", ["50%", "min"])
def test_unet2d_plans_train_bit_for_bit_at_the_predicted_peak(unet2d: tuple, budget: str) -> None:
    """Predicted at or above the measured peak, within 0.1 %: on the CPU ``F.mse_loss`` returns its
    scalar in a storage the size of its input (12,288 bytes here), which the loop holds through
    backward (``loss_held_bytes``; not counted before, these plans measured about 0.25 % above
    their prediction). Before the lingering rule they were predicted 1.1-1.5 % high: the up blocks'
    inputs their caller's frame held in forward were counted again in the replays of the blocks' ResNets."""
    model, args, kwargs, loss_fn, g = unet2d
    assert g.meta["loss_held_bytes"] == 12_288 + 4  # and the gradient backward() seeds the loss with
    reference = _grads(model, args, kwargs, loss_fn)
    unpatched = measure(model, args, kwargs, loss_fn=loss_fn, steps=1, warmup=1).peak_bytes
    plan = autoremat.solve(g, budget)
    autoremat.apply(model, plan)
    try:
        assert gradients_equal(reference, _grads(model, args, kwargs, loss_fn))
        peak = measure(model, args, kwargs, loss_fn=loss_fn, steps=1, warmup=1).peak_bytes
    finally:
        autoremat.restore(model)
    assert peak <= 0.5 * unpatched, (peak, unpatched)
    assert 0 <= plan.predicted_peak_bytes - peak <= 0.001 * peak, (plan.predicted_peak_bytes, peak)


@pytest.mark.slow  # about 8 s alone, 17 s on a loaded machine
def test_cond_unet_least_plan_trains_bit_for_bit() -> None:
    """Cross-attention, GEGLU feed-forward, dropout: the least plan measures about 0.4x the unpatched
    peak, predicted at or above it within 0.1 % (the loss's own storage counted: CPU ``F.mse_loss``,
    see the ``UNet2DModel`` test). Before ``grad_part`` it was predicted 1.057x: each half of a GEGLU
    projection's ``chunk`` got a gradient of the whole projection output."""
    model, args, kwargs, loss_fn = _cond_unet()
    g = autoremat.capture(model, args, kwargs, loss_fn=loss_fn, times="flops")
    assert g.meta["loss_held_bytes"] > 4
    reference = _grads(model, args, kwargs, loss_fn)
    unpatched = measure(model, args, kwargs, loss_fn=loss_fn, steps=1, warmup=1).peak_bytes
    plan = autoremat.solve(g, "min")
    autoremat.apply(model, plan)
    try:
        assert gradients_equal(reference, _grads(model, args, kwargs, loss_fn))
        peak = measure(model, args, kwargs, loss_fn=loss_fn, steps=1, warmup=1).peak_bytes
    finally:
        autoremat.restore(model)
    assert peak <= 0.45 * unpatched, (peak, unpatched)
    assert 0 <= plan.predicted_peak_bytes - peak <= 0.001 * peak, (plan.predicted_peak_bytes, peak)


def _accelerate_steps(model: nn.Module, args: tuple, kwargs: dict, loss_fn: Any, plan: bool, mixed: str) -> nn.Module:
    from accelerate import Accelerator

    import autoremat.integrations.accelerate as ar

    accelerator = Accelerator(cpu=True, mixed_precision=mixed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if plan:
        ar.prepare(accelerator, model, args, kwargs, budget="50%", loss_fn=loss_fn, optimizer=opt)
        assert autoremat.is_patched(model)
    model, opt = accelerator.prepare(model, opt)
    for step in range(2):
        opt.zero_grad(set_to_none=True)
        torch.manual_seed(10 + step)  # dropout masks
        with accelerator.autocast():
            loss = loss_fn(model(*args, **kwargs))
        accelerator.backward(loss)
        opt.step()
    return model


@pytest.mark.slow  # about 25 s alone at one thread, minutes on a loaded machine
def test_cond_unet_trains_under_prepare_with_its_noise_target_bit_for_bit() -> None:
    """The usual diffusion loss closes over its noise target: ``prepare`` failed on it (the meta capture
    could not run it, and the smaller batches it fell back to did not match the target)."""
    reference = _accelerate_steps(*_cond_unet(), plan=False, mixed="no")
    model = _accelerate_steps(*_cond_unet(), plan=True, mixed="no")
    for (k, a), (_, b) in zip(reference.state_dict().items(), model.state_dict().items()):
        assert torch.equal(a, b), k


class _LitDiffusion:
    """A Lightning module around the conditional U-Net: noise, timesteps, MSE on the predicted noise."""

    @staticmethod
    def make() -> Any:
        import lightning.pytorch as pl
        from torch.utils.data import DataLoader, TensorDataset

        class Lit(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.model = _cond_unet()[0]
                g = torch.Generator().manual_seed(2)
                self.data = TensorDataset(torch.randn(8, 4, 16, 16, generator=g), torch.randn(8, 8, 32, generator=g))

            def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
                x, cond = batch
                noise = torch.randn_like(x)
                t = torch.randint(0, 1000, (x.shape[0],))
                return F.mse_loss(self.model(x * 0.8 + noise * 0.6, t, encoder_hidden_states=cond).sample.float(), noise)

            def configure_optimizers(self) -> torch.optim.Optimizer:
                return torch.optim.AdamW(self.parameters(), lr=1e-3)

            def train_dataloader(self) -> DataLoader:
                return DataLoader(self.data, batch_size=4)

        return Lit()


@pytest.mark.slow  # about 10 s each alone, a minute on a loaded machine
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_cond_unet_fits_under_autoremat_bit_for_bit(tmp_path: Path, precision: str) -> None:
    import lightning.pytorch as pl

    def fit(callbacks: list) -> Any:
        torch.manual_seed(0)
        lit = _LitDiffusion.make()
        torch.manual_seed(3)
        pl.Trainer(max_steps=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                   callbacks=callbacks, precision=precision).fit(lit)
        return lit

    reference = fit([])
    cb = autoremat.AutoRemat(budget="50%", module="model", raise_batch_size=False, verbose=False)
    lit = fit([cb])
    assert cb.plan is not None and cb.plan.recompute_segments
    for (k, a), (_, b) in zip(reference.state_dict().items(), lit.state_dict().items()):
        assert torch.equal(a, b), k
