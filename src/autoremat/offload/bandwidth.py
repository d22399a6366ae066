"""Host<->device bandwidth, measured: the ``B`` of the offload transfer model.

:func:`measure_link` times copies between one pinned host buffer and one device buffer of
``nbytes`` bytes: a warm-up copy each way, then ``repeats`` copies per direction, each issued with
``non_blocking=True`` on a side stream (the path the runtime's offloader uses) between two CUDA
events, and timed by ``Event.elapsed_time`` after synchronising. Each direction reports the
median of its repeats (one stray slow copy does not move it).

:func:`measure_bandwidth` returns one number, the *smaller* of the two medians: the transfer
model (:mod:`autoremat.cost`, :class:`~autoremat.cost.chain.Chain`) has a single link with
one ``B`` for offloads (device to host) and prefetches (host to device), and the slower direction
is the conservative choice (predicted transfers are never shorter than the slower real ones). On
PCIe the two directions usually agree within ~10 %; ``measure_link`` gives both.

Without CUDA (no device, or ``device`` not a CUDA device) nothing is measured: the functions
return :data:`~autoremat.cost.DEFAULT_BANDWIDTH_BYTES_PER_S` (12e9, the simulator's
default) and log that they did (INFO; WARNING when a CUDA device was asked for and none is
available). torch is imported inside the functions, so ``autoremat.offload`` stays importable
without torch.

Time: ``2 (repeats + 1)`` copies of ``nbytes``; the default 64 MiB x 5 takes well under a second
on PCIe 4. Space: ``nbytes`` of pinned host memory and ``nbytes`` on the device, freed on return.

The device buffer must not cost a run: on a device that is nearly full (the very case autoremat is
for, or under ``torch.cuda.set_per_process_memory_fraction``) the copy buffer may not fit. An
out-of-memory error while measuring empties the allocator's cache and retries with an eighth of
the bytes, down to :data:`MIN_NBYTES` (1 MiB: launch latency is then a few per cent of a copy on
PCIe, still far better than a guess); below that the default is returned with a WARNING that says
why. The retry is logged at INFO with the size that fitted.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

from ..cost import DEFAULT_BANDWIDTH_BYTES_PER_S

__all__ = ["measure_bandwidth", "measure_link", "record_link", "LinkBandwidth", "DEFAULT_NBYTES", "DEFAULT_REPEATS",
           "MIN_NBYTES", "shrinking"]

logger = logging.getLogger(__name__)

DEFAULT_NBYTES = 64 * 2**20
"""Bytes per timed copy: large enough that launch latency (~10 us) is under 1 % on PCIe."""
DEFAULT_REPEATS = 5
"""Timed copies per direction (the median is reported)."""
MIN_NBYTES = 2**20
"""The smallest copy buffer tried when the device has no room for a larger one."""


@dataclass(frozen=True)
class LinkBandwidth:
    """What :func:`measure_link` found."""

    host_to_device_bytes_per_s: float
    device_to_host_bytes_per_s: float
    nbytes: int
    repeats: int
    device: str
    """The CUDA device measured, or ``"none"`` when nothing was measured."""
    measured: bool
    """False when the defaults were returned (no CUDA)."""

    @property
    def bytes_per_s(self) -> float:
        """The smaller direction: the ``B`` to plan with (see the module docstring)."""
        return min(self.host_to_device_bytes_per_s, self.device_to_host_bytes_per_s)

    def to_dict(self) -> dict[str, Any]:
        return {"host_to_device_bytes_per_s": self.host_to_device_bytes_per_s,
                "device_to_host_bytes_per_s": self.device_to_host_bytes_per_s, "bytes_per_s": self.bytes_per_s,
                "nbytes": self.nbytes, "repeats": self.repeats, "device": self.device, "measured": self.measured}


def _check(nbytes: Any, repeats: Any) -> None:
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 1:
        raise ValueError(f"nbytes={nbytes!r} must be an int >= 1 (bytes per timed copy, default {DEFAULT_NBYTES})")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r} must be an int >= 1 (timed copies per direction, "
                         f"default {DEFAULT_REPEATS})")


def _default(nbytes: int, repeats: int, why: str, level: int) -> LinkBandwidth:
    logger.log(level, "not measuring host<->device bandwidth (%s): using the default %.3g bytes/s", why,
               DEFAULT_BANDWIDTH_BYTES_PER_S)
    b = float(DEFAULT_BANDWIDTH_BYTES_PER_S)
    return LinkBandwidth(b, b, nbytes, repeats, "none", False)


def measure_link(device: Any = None, nbytes: int = DEFAULT_NBYTES, repeats: int = DEFAULT_REPEATS) -> LinkBandwidth:
    """Both directions' median bandwidth between pinned host memory and ``device``.

    ``device``: ``None`` (the current CUDA device if there is one), or anything
    ``torch.device`` accepts (``"cuda:1"``, ``1``...). See the module docstring.
    """
    import torch

    _check(nbytes, repeats)
    if device is None:
        if not torch.cuda.is_available():
            return _default(nbytes, repeats, "torch.cuda.is_available() is False", logging.INFO)
        dev = torch.device("cuda", torch.cuda.current_device())
    else:
        dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        if dev.type != "cuda":
            return _default(nbytes, repeats, f"device {str(dev)!r} is not a CUDA device", logging.INFO)
        if not torch.cuda.is_available():
            return _default(nbytes, repeats, f"device {str(dev)!r} was asked for but CUDA is not available",
                            logging.WARNING)
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    return shrinking(lambda size: _timed_link(dev, size, repeats), nbytes, repeats)


def shrinking(measure: Callable[[int], LinkBandwidth], nbytes: int, repeats: int) -> LinkBandwidth:
    """``measure(nbytes)``, retried with an eighth of the bytes (down to :data:`MIN_NBYTES`) while
    the device runs out of memory; the default bandwidth (WARNING) when even that does not fit."""
    import torch

    size = nbytes
    while True:
        try:
            out = measure(size)
        except torch.OutOfMemoryError:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            if size <= MIN_NBYTES:
                return _default(nbytes, repeats, f"the device has no room for a {size}-byte copy buffer",
                                logging.WARNING)
            smaller = max(MIN_NBYTES, size // 8)
            logger.info("no room on the device for a %d-byte copy buffer; measuring with %d bytes", size, smaller)
            size = smaller
            continue
        return out


def _timed_link(dev: Any, nbytes: int, repeats: int) -> LinkBandwidth:
    """Both directions' medians with ``nbytes`` buffers on ``dev`` (a CUDA device)."""
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    stream = torch.cuda.Stream(dev)

    def timed(dst: Any, src: Any) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            dst.copy_(src, non_blocking=True)
            end.record(stream)
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    with torch.cuda.device(dev):
        torch.cuda.synchronize(dev)
        timed(on_device, host)  # warm-up: first-use costs (context, pinned mapping) are not the link
        timed(host, on_device)
        h2d = [timed(on_device, host) for _ in range(repeats)]
        d2h = [timed(host, on_device) for _ in range(repeats)]
    del host, on_device
    resolution_s = 1e-6  # CUDA events resolve about 0.5 us: a tiny copy must not divide by zero
    out = LinkBandwidth(nbytes / max(statistics.median(h2d), resolution_s),
                        nbytes / max(statistics.median(d2h), resolution_s), nbytes, repeats, str(dev), True)
    logger.info("host->device %.3g bytes/s, device->host %.3g bytes/s on %s (%d x %d bytes); planning with %.3g",
                out.host_to_device_bytes_per_s, out.device_to_host_bytes_per_s, dev, repeats, nbytes, out.bytes_per_s)
    return out


def measure_bandwidth(device: Any = None, nbytes: int = DEFAULT_NBYTES, repeats: int = DEFAULT_REPEATS) -> float:
    """Host<->device bytes per second to plan offloads with: the smaller of the two directions'
    medians (:func:`measure_link`), or the default 12e9 without CUDA (logged)."""
    return measure_link(device, nbytes, repeats).bytes_per_s


_LINKS: dict[str, float] = {}
"""The link :func:`record_link` measured, per device, for this process."""


def record_link(graph: Any) -> Any:
    """``graph``, with ``graph.meta["bandwidth_bytes_per_s"]`` set to this machine's host<->device link
    (:func:`measure_bandwidth`, once per device and process: the link does not change) when the
    graph was captured on a CUDA device, so that offload plans are simulated (and solved) at it
    whoever captured it: :func:`autoremat.capture`, ``capture_within``, the integrations, the CLI.
    A value already there is kept; other devices keep the simulator's default
    (:data:`~autoremat.cost.DEFAULT_BANDWIDTH_BYTES_PER_S`)."""
    dev = str(graph.meta.get("device", ""))
    if dev.startswith("cuda") and not graph.meta.get("bandwidth_bytes_per_s"):
        if dev not in _LINKS:
            _LINKS[dev] = measure_bandwidth(dev)
        graph.meta["bandwidth_bytes_per_s"] = _LINKS[dev]
    return graph
