"""The CUDA caching allocator's view of what one node uses beyond the storages it makes (the
capture's workspace meter; see :class:`AllocatorMeter`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["AllocatorMeter"]


class AllocatorMeter:
    """Peak bytes the CUDA caching allocator handed out since :meth:`start` (0 off CUDA).

    The live-storage counter sees storages only; on a GPU, library workspaces (cuDNN
    convolutions, cuBLAS) are allocator blocks that are no storage, and every block is rounded up
    to the allocator's granularity. A node's workspace is the larger of the two measures above
    what the model accounts for (found on an H200: a U-Net convolution's 41 MB backward workspace
    was invisible to the counter, and a plan whose peak sat in that backward measured 23 % above
    its prediction).

    A library allocation that outlives the node is no workspace of it: cuBLAS keeps a 32 MiB
    workspace per handle and stream from its first matrix product on (also found on an H200: a
    ResNet's only linear layer, first run inside the capture, was predicted 34 MB above the
    measured step, where that workspace was already allocated). :meth:`peak_delta` takes off what
    the allocator still holds beyond the storages made since :meth:`start` (``live``: the bytes of
    live storages, read at start and at the end; or ``kept``: the bytes the node made and keeps),
    where that exceeds :data:`STRAY_MIN_BYTES` (less is the allocator's rounding of those storages).
    """

    STRAY_MIN_BYTES = 2**20

    def __init__(self, device: torch.device | None, live: Callable[[], int] | None = None) -> None:
        self.device = device
        self._live = live
        self._start = 0
        self._live0 = 0

    def start(self) -> None:
        if self.device is not None:
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
            self._live0 = self._live() if self._live is not None else 0

    def peak_delta(self, kept: int | None = None) -> int:
        if self.device is None:
            return 0
        peak = torch.cuda.max_memory_allocated(self.device) - self._start
        if kept is None and self._live is not None:
            kept = self._live() - self._live0
        if kept is not None:
            stray = torch.cuda.memory_allocated(self.device) - self._start - kept
            if stray > self.STRAY_MIN_BYTES:
                peak -= stray
        return peak
