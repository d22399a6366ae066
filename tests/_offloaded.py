"""One step of a model unpatched and patched with an offload plan, shared by the offload runtime
tests (``tests/runtime/test_offload*.py``)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

import autoremat
from autoremat.measure import LiveStorageCounter, deterministic_kernels, gradients, gradients_equal, run_step
from autoremat.plan import Plan
from autoremat.runtime import offloader_of
from autoremat.runtime.offload import OffloadStats

__all__ = ["offloaded_step", "measured_with_host_tier"]


def offloaded_step(model: nn.Module, args: tuple, plan: Plan, *, loss_fn: Any = None, regions: str = "lean",
                   seed: int = 0) -> OffloadStats:
    """One seeded step of a copy of ``model`` and one of ``model`` patched with ``plan`` (restored
    afterwards): the offloader's stats; the gradients are checked equal."""
    reference = copy.deepcopy(model)
    with deterministic_kernels():
        torch.manual_seed(seed)
        run_step(reference, args, loss_fn=loss_fn)
        autoremat.apply(model, plan, regions=regions)
        try:
            torch.manual_seed(seed)
            run_step(model, args, loss_fn=loss_fn)
            stats = offloader_of(model).stats
        finally:
            autoremat.restore(model)
    assert gradients_equal(gradients(reference), gradients(model))
    return stats


def measured_with_host_tier(model: nn.Module, args: tuple, plan: Plan, *, loss_fn: Any = None) -> int:
    """The step peak a :class:`~autoremat.measure.LiveStorageCounter` measures with the CPU's host
    tier on (offloaded storages leave the counted memory once a holder took them, and come back
    when prefetched); gradients checked against the unpatched model."""
    reference = copy.deepcopy(model)
    torch.manual_seed(0)  # dropout
    run_step(reference, args, loss_fn=loss_fn)
    autoremat.apply(model, plan)
    try:
        offloader_of(model).host_tier = True
        model.zero_grad(set_to_none=True)
        counter = LiveStorageCounter()
        torch.manual_seed(0)
        with counter:
            run_step(model, args, loss_fn=loss_fn)
        assert offloader_of(model).stats.prefetched_ahead > 0
    finally:
        autoremat.restore(model)
    assert gradients_equal(gradients(reference), gradients(model))
    return counter.peak
