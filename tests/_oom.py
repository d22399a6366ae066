"""A simulated device for tests: the CPU with a hard memory capacity.

:class:`SimulatedDevice` is :class:`autoremat.measure.LiveStorageCounter` (the live-storage
counter every CPU step-peak measurement uses) that raises ``torch.OutOfMemoryError`` as soon
as the bytes it holds pass ``capacity_bytes``, the way the CUDA caching allocator does.
``resident`` tensors (parameters, buffers) count from the start, as they would on a GPU; meta
tensors count nothing. It records its peak, how many allocations it refused, and each op that
ran it out of memory. A gradient sum the engine would have made in place without a dispatch
mode (:mod:`autoremat.measure`) counts at its in-place level.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from autoremat.measure import LiveStorageCounter

__all__ = ["SimulatedDevice", "storage_bytes"]


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages of ``tensors`` (tied parameters count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st._cdata] = st.nbytes()
    return sum(seen.values())


class SimulatedDevice(LiveStorageCounter):
    """Raises ``torch.OutOfMemoryError`` when live bytes would pass ``capacity_bytes``."""

    count_meta = False

    def __init__(self, capacity_bytes: int, resident: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self.capacity_bytes = int(capacity_bytes)
        self.live = self.peak = storage_bytes(resident)
        self.ooms = 0
        self.failed_ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def, override]
        settled = self._settle()  # the last gradient sum, out of place after all: its level counts
        if settled is not None and settled > self.capacity_bytes:
            self.ooms += 1
            self.failed_ops.append("aten.add.Tensor (gradient accumulation)")
            raise torch.OutOfMemoryError(f"simulated device out of memory: {settled} bytes live, capacity "
                                         f"{self.capacity_bytes} bytes (gradient accumulation)")
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.live - self.accumulation_slack() > self.capacity_bytes:
            self.ooms += 1
            self.failed_ops.append(str(func))
            live = self.live
            del out  # its storages are released, as a refused allocation would be
            raise torch.OutOfMemoryError(f"simulated device out of memory: {live} bytes live, capacity "
                                         f"{self.capacity_bytes} bytes ({func})")
        return out
