"""One step of a model unpatched and patched with an offload plan, shared by the offload runtime
tests (``tests/runtime/test_offload*.py``)."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

import autoremat
from autoremat.measure import gradients, gradients_equal, run_step
from autoremat.plan import Plan
from autoremat.runtime import offloader_of
from autoremat.runtime.offload import OffloadStats

__all__ = ["offloaded_step", "deterministic"]


@contextlib.contextmanager
def deterministic() -> Iterator[None]:
    """Deterministic kernels, so that ``torch.equal`` compares the offload and not the reduction
    order of cuDNN's or cuBLAS's atomics (no-op kernels on a CPU)."""
    was, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True):
            yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn)


def offloaded_step(model: nn.Module, args: tuple, plan: Plan, *, loss_fn: Any = None, regions: str = "lean",
                   seed: int = 0) -> OffloadStats:
    """One seeded step of a copy of ``model`` and one of ``model`` patched with ``plan`` (restored
    afterwards): the offloader's stats; the gradients are checked equal."""
    reference = copy.deepcopy(model)
    with deterministic():
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
