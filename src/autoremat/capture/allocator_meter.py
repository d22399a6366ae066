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
    where that exceeds the allocator's rounding of the storages made since :meth:`start` (with a
    count of them, ``made``) or else :data:`STRAY_MIN_BYTES` (H200 runs of 2026-11-28 still saw
    backward regions of Qwen2, GPT-NeoX, Whisper and SegFormer 32-260 KiB above their meta
    captures, under the 1 MiB threshold; whether those are such library allocations or
    transient workspaces, no GPU run has shown yet).

    The allocator rounds every block up to a multiple of :data:`ROUND_BYTES`; the meta device,
    which has no allocator, cannot. :meth:`over` takes the allocator's peak only where it exceeds
    the counter's by more than that rounding of the storages made since :meth:`start` could
    (``made``: the count of storages the counter has seen made), so a node with no workspace has
    the bytes of its meta capture (found on an H200: a Qwen2 layer's forward temporaries measured
    10,752 bytes, its meta capture 10,496).
    """

    STRAY_MIN_BYTES = 2**20
    ROUND_BYTES = 512
    """The CUDA caching allocator's block size granularity (``kMinBlockSize``)."""

    def __init__(self, device: torch.device | None, live: Callable[[], int] | None = None,
                 made: Callable[[], int] | None = None) -> None:
        self.device = device
        self._live = live
        self._made = made
        self._start = 0
        self._live0 = 0
        self._made0 = 0

    def start(self) -> None:
        if self.device is not None:
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
            self._live0 = self._live() if self._live is not None else 0
            self._made0 = self._made() if self._made is not None else 0

    def _rounding(self) -> int | None:
        """The most the allocator's rounding adds to the storages made since :meth:`start`
        (``None`` without a count of them)."""
        return None if self._made is None else self.ROUND_BYTES * (self._made() - self._made0)

    def over(self, counted: int) -> int:
        """The larger of ``counted`` (the live-storage counter's peak above the start) and the
        allocator's, where the allocator's is more than rounding (class docstring)."""
        peak = self.peak_delta()
        return counted if peak - counted <= (self._rounding() or 0) else max(counted, peak)

    def peak_delta(self, kept: int | None = None) -> int:
        if self.device is None:
            return 0
        peak = torch.cuda.max_memory_allocated(self.device) - self._start
        if kept is None and self._live is not None:
            kept = self._live() - self._live0
        if kept is not None:
            stray = torch.cuda.memory_allocated(self.device) - self._start - kept
            # more than the rounding of the storages made since start explains, else (no count
            # of them) more than STRAY_MIN_BYTES
            rounding = self._rounding()
            if stray > (self.STRAY_MIN_BYTES if rounding is None else rounding):
                peak -= stray
        return peak
