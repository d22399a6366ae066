"""Measuring one configuration: step peak (live-storage counter / CUDA allocator), step time,
gradients against the reference, and a wall-clock limit for compiles."""

from __future__ import annotations

import contextlib
import math
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch

from autoremat.measure import LiveStorageCounter, deterministic_kernels, measure

from .runners import Runner, _Step
from .settings import GRAD_SEED
from .workloads import Workload


class CompileAwareCounter(LiveStorageCounter):
    """The live-storage counter, left on while compiled code runs.

    Dynamo falls back to eager under a user ``TorchDispatchMode``; a mode that ignores compile
    internals is switched off while compiling and on while the compiled artefacts run. Inductor's
    CPU wrapper allocates its buffers with ``torch._C._dynamo.guards._empty_strided_cpu``, which
    bypasses the dispatcher; :func:`counted_inductor_buffers` routes it through
    ``torch.empty_strided`` so those buffers are counted too.
    """

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


@contextlib.contextmanager
def counted_inductor_buffers() -> Iterator[None]:
    """Make Inductor's CPU buffer allocations visible to dispatch modes (see CompileAwareCounter).

    Generated wrapper modules bind ``empty_strided_cpu = torch._C._dynamo.guards._empty_strided_cpu``
    (a C function that bypasses the dispatcher) as a module global; for the duration of the block
    that global is swapped, in every loaded module, for a function calling ``torch.empty_strided``.
    Only the peak measurement runs inside: timed steps keep the C function (the swap costs a few
    microseconds per buffer).
    """
    from torch._inductor.codecache import PyCodeCache

    original = torch._C._dynamo.guards._empty_strided_cpu

    def empty_strided_cpu(size: Any, stride: Any, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty_strided(size, stride, dtype=dtype, device="cpu")

    mods = {id(m): m for m in [*PyCodeCache.modules, *PyCodeCache.modules_no_attr.values()]
            if getattr(m, "empty_strided_cpu", None) is original}
    for m in mods.values():
        m.empty_strided_cpu = empty_strided_cpu
    try:
        yield
    finally:
        for m in mods.values():
            m.empty_strided_cpu = original


class _Timeout(BaseException):
    """Raised by the alarm in :func:`time_limit` (a BaseException, so no ``except Exception`` eats it)."""


@contextlib.contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Interrupt the block after ``seconds`` (main thread only; otherwise no limit)."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    outer_left, outer_interval = signal.getitimer(signal.ITIMER_REAL)  # e.g. pytest-timeout's alarm
    if outer_left and outer_left <= seconds:  # the outer alarm fires first anyway
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise _Timeout(f"did not finish within {seconds:g} s")

    old = signal.signal(signal.SIGALRM, handler)
    t0 = time.monotonic()
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        if outer_left:
            signal.setitimer(signal.ITIMER_REAL, max(1e-3, outer_left - (time.monotonic() - t0)), outer_interval)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_step(r: Runner, w: Workload, device: torch.device) -> float:
    """Wall time of one step (CUDA events on a GPU)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        r.step(w.args, w.loss_fn)
        end.record()
        torch.cuda.synchronize(device)
        s = start.elapsed_time(end) / 1e3
    else:
        t0 = time.perf_counter()
        r.step(w.args, w.loss_fn)
        s = time.perf_counter() - t0
    r.model.zero_grad(set_to_none=True)  # untimed: many configurations share the device
    return s


def measure_peak(r: Runner, w: Workload, device: torch.device) -> int:
    """Step peak of one configuration (it has run at least once before)."""
    if r.compiled and device.type != "cuda":
        r.model.zero_grad(set_to_none=True)
        counter = CompileAwareCounter()
        with counted_inductor_buffers(), counter:
            r.step(w.args, w.loss_fn)
        r.model.zero_grad(set_to_none=True)
        return int(counter.peak)
    return int(measure(_Step(r), w.args, loss_fn=w.loss_fn, steps=1, warmup=0).peak_bytes)


def _param_name(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


@contextlib.contextmanager
def deterministic(device: torch.device) -> Iterator[None]:
    """On CUDA, deterministic kernels for the gradient check (cuDNN and atomics otherwise reorder sums)."""
    if device.type != "cuda":
        yield
        return
    with deterministic_kernels():
        yield


def grads_of(r: Runner, w: Workload) -> dict[str, torch.Tensor | None]:
    """Parameter gradients of one step from a fixed RNG state (dropout masks alike in every config)."""
    device = w.args[0].device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), deterministic(device):
        torch.manual_seed(GRAD_SEED)
        r.step(w.args, w.loss_fn)
    out = {_param_name(n): (None if p.grad is None else p.grad.detach().clone()) for n, p in r.model.named_parameters()}
    r.model.zero_grad(set_to_none=True)
    return out


def compare_grads(ref: dict[str, torch.Tensor | None], got: dict[str, torch.Tensor | None]) -> tuple[bool, float]:
    """(bit-for-bit equal, largest absolute difference)."""
    if ref.keys() != got.keys():
        return False, math.inf
    equal, diff = True, 0.0
    for k, a in ref.items():
        b = got[k]
        if (a is None) != (b is None):
            return False, math.inf
        if a is None:
            continue
        if a.dtype != b.dtype or a.shape != b.shape:
            return False, math.inf
        if not torch.equal(a, b):
            equal = False
            diff = max(diff, float((a.double() - b.double()).abs().max()))
    return equal, diff
