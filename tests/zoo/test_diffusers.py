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


# ------------------------------------------------------------------------------------------- diffusers


def _unet2d(dropout: float = 0.1, batch: int = 4, size: int = 16) -> tuple[nn.Module, tuple, dict, Any]:
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    unet = diffusers.UNet2DModel(
        sample_size=size, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"),
        norm_num_groups=8, dropout=dropout).train()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 3, size, size, generator=g)
    t = torch.randint(0, 1000, (batch,), generator=g)
    noise = torch.randn(batch, 3, size, size, generator=g)
    return unet, (x, t), {}, lambda out: F.mse_loss(out.sample.float(), noise)


def _cond_unet(dropout: float = 0.1, batch: int = 4, size: int = 16) -> tuple[nn.Module, tuple, dict, Any]:
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    unet = diffusers.UNet2DConditionModel(
        sample_size=size, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8, dropout=dropout).train()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 4, size, size, generator=g)
    t = torch.randint(0, 1000, (batch,), generator=g)
    cond = torch.randn(batch, 8, 32, generator=g)
    noise = torch.randn(batch, 4, size, size, generator=g)
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
    """Within 3 %: a local that the unpatched step saves anyway is not counted as lingering, but
    under a plan that recomputes its saver Python may still hold it (0.976-0.985x on some budgets
    between 50 and 60 %; see the report)."""
    model, args, kwargs, loss_fn, g = unet2d
    reference = _grads(model, args, kwargs, loss_fn)
    unpatched = measure(model, args, kwargs, loss_fn=loss_fn, steps=1, warmup=1).peak_bytes
    plan = autoremat.solve(g, budget)
    autoremat.apply(model, plan)
    try:
        assert gradients_equal(reference, _grads(model, args, kwargs, loss_fn))
        peak = measure(model, args, kwargs, loss_fn=loss_fn, steps=1, warmup=1).peak_bytes
    finally:
        autoremat.restore(model)
    assert peak <= 0.5 * unpatched
    assert abs(plan.predicted_peak_bytes - peak) <= 0.03 * peak, (plan.predicted_peak_bytes, peak)


def test_cond_unet_least_plan_trains_bit_for_bit() -> None:
    """Cross-attention, GEGLU feed-forward, dropout: the least plan measures about 0.4x the unpatched
    peak. Its prediction is high by one half of a GEGLU projection (the cost model hands the
    gradient of one ``chunk`` half to the whole projection: see the report), so within 7 %."""
    model, args, kwargs, loss_fn = _cond_unet()
    g = autoremat.capture(model, args, kwargs, loss_fn=loss_fn, times="flops")
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
    assert peak <= plan.predicted_peak_bytes <= 1.07 * peak, (plan.predicted_peak_bytes, peak)
