"""The capture's allocator meter (``autoremat.capture.allocator_meter.AllocatorMeter``) on a fake CUDA
allocator: a node's workspace is what the allocator handed out above the storages it made, less a
library allocation that outlives the node (cuBLAS's per-stream workspace, made on first use)."""

from __future__ import annotations

import pytest
import torch

from autoremat.capture.allocator_meter import AllocatorMeter

MiB = 2**20


class _FakeAllocator:
    """``memory_allocated`` / ``max_memory_allocated`` / ``reset_peak_memory_stats`` of one device."""

    def __init__(self) -> None:
        self.allocated = 100 * MiB
        self.peak = self.allocated

    def alloc(self, n: int) -> None:
        self.allocated += n
        self.peak = max(self.peak, self.allocated)

    def free(self, n: int) -> None:
        self.allocated -= n


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> _FakeAllocator:
    a = _FakeAllocator()
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: a.allocated)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: a.peak)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: setattr(a, "peak", a.allocated))
    return a


def test_a_transient_workspace_is_in_the_peak(fake: _FakeAllocator) -> None:
    live = [0]
    meter = AllocatorMeter(torch.device("cuda", 0), live=lambda: live[0])
    meter.start()
    fake.alloc(8 * MiB)   # the node's output, a live storage
    live[0] += 8 * MiB
    fake.alloc(40 * MiB)  # cuDNN workspace, freed before the node ends
    fake.free(40 * MiB)
    assert meter.peak_delta() == 48 * MiB


def test_a_library_allocation_that_outlives_the_node_is_no_workspace(fake: _FakeAllocator) -> None:
    live = [0]
    meter = AllocatorMeter(torch.device("cuda", 0), live=lambda: live[0])
    meter.start()
    fake.alloc(32 * MiB)  # cuBLAS workspace on first use: kept by the library
    fake.alloc(4 * MiB)   # the output
    live[0] += 4 * MiB
    assert meter.peak_delta() == 4 * MiB
    meter.start()  # the next node: the library's block is already there
    fake.alloc(4 * MiB)
    live[0] += 4 * MiB
    assert meter.peak_delta() == 4 * MiB


def test_backward_frees_and_rounding_are_not_taken_off(fake: _FakeAllocator) -> None:
    live = [50 * MiB]
    meter = AllocatorMeter(torch.device("cuda", 0), live=lambda: live[0])
    meter.start()
    fake.alloc(6 * MiB + 512)  # a gradient, rounded up by the allocator
    live[0] += 6 * MiB
    fake.free(10 * MiB)        # a saved tensor released
    live[0] -= 10 * MiB
    assert meter.peak_delta() == 6 * MiB + 512
    kept_meter = AllocatorMeter(torch.device("cuda", 0))  # the replay's form: the caller says what it keeps
    kept_meter.start()
    fake.alloc(32 * MiB)
    fake.alloc(2 * MiB)
    assert kept_meter.peak_delta(kept=2 * MiB) == 2 * MiB
    assert kept_meter.peak_delta() == 34 * MiB  # nothing said: the allocator's peak as it is


def test_off_cuda_the_meter_reads_nothing() -> None:
    meter = AllocatorMeter(None, live=lambda: 1)
    meter.start()
    assert meter.peak_delta() == 0 and meter.peak_delta(kept=5) == 0


def test_the_allocators_rounding_is_not_a_workspace(fake: _FakeAllocator) -> None:
    """What the meta device cannot see (no allocator, no rounding) is no workspace: an excess the
    rounding of the storages made explains gives the counter's peak; a real workspace the
    allocator's (an H200's Qwen2 layer measured 10,752 bytes of temporaries against the meta
    capture's 10,496 before)."""
    live, made = [0], [0]
    meter = AllocatorMeter(torch.device("cuda", 0), live=lambda: live[0], made=lambda: made[0])
    meter.start()
    for n in (10_240, 256):  # two storages, each rounded up to 512 bytes by the allocator
        fake.alloc(-(-n // 512) * 512)
        live[0] += n
        made[0] += 1
    assert meter.peak_delta() == 10_752
    assert meter.over(10_496) == 10_496
    fake.alloc(40 * MiB)  # a library workspace beside them
    fake.free(40 * MiB)
    assert meter.over(10_496) == 40 * MiB + 10_752
    cpu = AllocatorMeter(None, made=lambda: made[0])
    assert cpu.over(123) == 123


def test_a_small_library_allocation_that_outlives_the_node_is_no_workspace(fake: _FakeAllocator) -> None:
    """With a count of the storages made, an allocation that outlives the node is taken off where
    it is more than their rounding, also below STRAY_MIN_BYTES (a 256 KiB block kept by a library)."""
    live, made = [0], [0]
    meter = AllocatorMeter(torch.device("cuda", 0), live=lambda: live[0], made=lambda: made[0])
    meter.start()
    fake.alloc(256 * 1024)  # kept by the library after the node
    fake.alloc(4096)        # the node's output
    live[0] += 4000
    made[0] += 1
    assert meter.peak_delta() == 4000  # the kept block and the output's rounding both taken off
    assert meter.over(4000) == 4000
