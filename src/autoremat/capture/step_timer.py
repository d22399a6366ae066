"""Per-node forward and backward times of the timed steps of fx and module-level capture: a
:class:`Timer` (CUDA events on a GPU, ``perf_counter`` otherwise), the :func:`timing_noise` of its
repeats, and :func:`paused_gc`, the collector off while timing."""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ._recorder import tensors_in

__all__ = ["Clock", "Timer", "timing_noise", "paused_gc"]


class Clock:
    """Points in time on ``device``: a recorded CUDA event on a GPU, ``perf_counter`` otherwise."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def now(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def seconds(self, a: Any, b: Any, *, sync: bool = True) -> float:
        """Seconds from ``a`` to ``b`` (``sync``: wait for the device first)."""
        if self.cuda:
            if sync:
                torch.cuda.synchronize()
            return a.elapsed_time(b) / 1000.0
        return b - a


class Timer:
    """Per-node forward and backward times: CUDA events on a GPU, ``perf_counter`` otherwise."""

    def __init__(self, n: int, device: torch.device) -> None:
        self.n = n
        self.clock = Clock(device)
        self.cuda = self.clock.cuda
        self.fwd: list[list[float]] = [[] for _ in range(n)]
        self.bwd: list[list[float]] = [[] for _ in range(n)]
        self._t0: float | Any = 0.0
        self._marks: list[tuple[int | str, Any]] = []

    def begin(self, v: int) -> None:
        self._t0 = self.clock.now()

    def end(self, v: int, out: Any) -> None:
        t1 = self.clock.now()
        self._pending_fwd.append((v, self._t0, t1))
        for t in tensors_in(out):
            if t.requires_grad:
                t.register_hook(self._marker(v))
                break

    def _marker(self, v: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            self._marks.append((v, self.clock.now()))
        return hook

    def start_step(self) -> None:
        self._pending_fwd: list[tuple[int, Any, Any]] = []
        self._marks = []

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        self._marks.append(("end", self.clock.now()))
        if self.cuda:
            torch.cuda.synchronize()
        for v, a, b in self._pending_fwd:
            self.fwd[v].append(self.clock.seconds(a, b, sync=False))
        for (v, a), (_w, b) in zip(self._marks, self._marks[1:]):
            if isinstance(v, int):
                self.bwd[v].append(self.clock.seconds(a, b, sync=False))

    def run_steps(self, module: nn.Module, forward: Callable[[], Any], loss_fn: Callable[[Any], torch.Tensor],
                  warmup: int, repeats: int, before_step: Callable[[], None] = lambda: None
                  ) -> tuple[list[float], list[float], float]:
        """Time ``warmup + repeats`` steps of ``forward()`` and its loss's backward (each from no
        gradients, as the recorded step; the collector paused): the medians of the last
        ``repeats`` and their :meth:`noise`."""
        with paused_gc():
            for i in range(warmup + repeats):
                module.zero_grad(set_to_none=True)
                before_step()
                self.start_step()
                out = forward()
                loss = loss_fn(out)
                del out
                self.backward(loss)
                del loss
                if i < warmup:
                    self.fwd = [[] for _ in range(self.n)]
                    self.bwd = [[] for _ in range(self.n)]
        return (*self.medians(), self.noise())

    def medians(self) -> tuple[list[float], list[float]]:
        f = [statistics.median(x) if x else 0.0 for x in self.fwd]
        b = [statistics.median(x) if x else 0.0 for x in self.bwd]
        return f, b

    def noise(self) -> float:
        """:func:`timing_noise` of every node's forward and backward repeats."""
        return timing_noise(self.fwd + self.bwd)


def timing_noise(samples: Iterable[Sequence[float]]) -> float:
    """The share of the median times that lies above each time's fastest repeat:
    ``sum(median - min) / sum(median)`` over every timed quantity (a node's forward or backward),
    in ``[0, 1)``; 0 with one repeat or no time.

    Interference only ever slows an op down, so the fastest repeat is the best estimate of its
    own time and what a median holds above it is noise. Measured on the development machine
    (x86_64, 2 cores, CPU only, CPU-size ResNet-50 and DenseNet-121, 3 repeats): 0.11-0.95 in
    36 captures while other processes kept both cores busy (load average 1-16); not measured
    on an idle machine (the synthetic quiet captures of ``tests/solvers/test_stable.py``, 5 %
    jitter, give 0.04)
    (:mod:`autoremat.solvers.stable` keeps the reference plan within this share of the step).
    """
    med = spread = 0.0
    for xs in samples:
        if xs:
            m = statistics.median(xs)
            med += m
            spread += m - min(xs)
    return spread / med if med > 0 else 0.0


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Python's cyclic garbage collector off while timing (as ``timeit`` does): its collections
    start at fixed allocation counts, so one lands on the same node of every timed step and added
    0.1-0.2 ms to a 15 us ReLU of ResNet-50 (CPU); it is back on, as it was, afterwards."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
