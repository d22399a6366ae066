"""How much a profiling step may use, and what happens when it uses more: the step limit a
device budget allows before any capture, out-of-memory detection, and the error when nothing fits."""

from __future__ import annotations

import gc
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["CaptureDoesNotFitError", "is_oom", "free_cache", "profile_limit_bytes", "resident_bytes_of"]

_OOM_MARKERS = ("out of memory", "can't allocate memory", "cannot allocate memory")


class CaptureDoesNotFitError(RuntimeError):
    """Profiling ran out of memory (or was predicted to) even at the smallest batch size tried."""

    def __init__(self, smallest_size: int, limit_bytes: int, batch_size: int) -> None:
        self.smallest_size = int(smallest_size)
        self.limit_bytes = int(limit_bytes)
        self.batch_size = int(batch_size)
        super().__init__(
            f"profiling does not fit: even a batch of {smallest_size} (of {batch_size}) needs more than the "
            f"{limit_bytes}-byte step limit. Free device memory or give a larger budget, make one sample "
            "smaller (sequence length, image size), or plan from a meta-device capture "
            "(autoremat profile --device meta)."
        )


def is_oom(err: BaseException) -> bool:
    """Whether ``err`` is an out-of-memory error (CUDA, or the CPU allocator's)."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    return isinstance(err, RuntimeError) and any(m in str(err).lower() for m in _OOM_MARKERS)


def free_cache() -> None:
    """Collect garbage and empty the CUDA allocator's cache (after an out-of-memory error)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def resident_bytes_of(model: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None) -> int:
    """What a capture counts as resident before a step (``graph.meta["resident_bytes"]``, see
    :mod:`autoremat.resident`), known before capturing."""
    from ...resident import resident_bytes  # the one definition of resident bytes

    return resident_bytes(model, inputs=(tuple(args), dict(kwargs or {})))


def profile_limit_bytes(budget: Any, *, device: Any, resident_bytes: int) -> int:
    """The step limit profiling may use under a *device* budget, known before any capture.

    ``"auto"`` and budgets relative to the unoptimised step peak (``"50%"``, ``0.5``; that peak
    is what profiling is to find out) take the device's capacity: free memory from NVML /
    ``torch.cuda.mem_get_info`` on a GPU, available host memory on a CPU, minus the ``"auto"``
    margin (free memory already excludes what is resident). A byte count or size string is the
    device's capacity: ``resident_bytes`` are subtracted.
    """
    from ...budget import parse_budget

    if isinstance(budget, float) or (isinstance(budget, str) and budget.strip().lower() == "auto") \
            or (isinstance(budget, str) and budget.strip().endswith("%")):
        return parse_budget("auto", device=device, resident_bytes=0)
    step = parse_budget(budget) - int(resident_bytes)
    if step <= 0:
        from ..._units import fmt_bytes

        raise ValueError(f"budget={budget!r} is below what is resident before a step ({fmt_bytes(resident_bytes)}, "
                         f"{int(resident_bytes)} bytes: parameters, buffers, optimizer state, the batch); raise it, "
                         "or pass budget='min' / on_infeasible='min' to plan at the least")
    return step
