"""``autoremat.offload.bandwidth``: the default without CUDA (logged), validation, and (marked gpu)
a real measurement of both directions with pinned buffers and CUDA events."""

from __future__ import annotations

import logging

import pytest
import torch

from autoremat.offload import DEFAULT_BANDWIDTH_BYTES_PER_S, LinkBandwidth, measure_bandwidth, measure_link
from autoremat.offload.bandwidth import MIN_NBYTES, shrinking
from autoremat.cost import DEFAULT_BANDWIDTH_BYTES_PER_S as SIMULATE_DEFAULT

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the path taken without CUDA")


def test_default_is_the_simulators():
    assert DEFAULT_BANDWIDTH_BYTES_PER_S == SIMULATE_DEFAULT == 12e9


@no_cuda
def test_without_cuda_returns_the_default_and_logs(caplog: pytest.LogCaptureFixture):
    with caplog.at_level(logging.INFO, logger="autoremat.offload.bandwidth"):
        b = measure_bandwidth()
    assert b == DEFAULT_BANDWIDTH_BYTES_PER_S
    rec = [r for r in caplog.records if r.name == "autoremat.offload.bandwidth"]
    assert len(rec) == 1 and rec[0].levelno == logging.INFO
    assert "is_available() is False" in rec[0].getMessage() and "1.2e+10" in rec[0].getMessage()


@no_cuda
def test_explicit_cuda_device_without_cuda_warns(caplog: pytest.LogCaptureFixture):
    with caplog.at_level(logging.INFO, logger="autoremat.offload.bandwidth"):
        link = measure_link("cuda:0", nbytes=1024, repeats=2)
    assert link == LinkBandwidth(12e9, 12e9, 1024, 2, "none", False)
    assert link.bytes_per_s == 12e9 and link.to_dict()["measured"] is False
    rec = [r for r in caplog.records if r.name == "autoremat.offload.bandwidth"]
    assert rec[0].levelno == logging.WARNING and "'cuda:0'" in rec[0].getMessage()


def test_a_cpu_device_is_not_measured(caplog: pytest.LogCaptureFixture):
    with caplog.at_level(logging.INFO, logger="autoremat.offload.bandwidth"):
        link = measure_link(torch.device("cpu"))
    assert not link.measured and link.bytes_per_s == DEFAULT_BANDWIDTH_BYTES_PER_S
    assert "'cpu' is not a CUDA device" in caplog.text


@pytest.mark.parametrize(("kwargs", "text"), [
    ({"nbytes": 0}, "nbytes=0"), ({"nbytes": 1.5}, "nbytes=1.5"), ({"nbytes": True}, "nbytes=True"),
    ({"repeats": 0}, "repeats=0"), ({"repeats": "3"}, "repeats='3'"),
])
def test_bad_arguments_name_themselves(kwargs, text):
    with pytest.raises(ValueError, match=text):
        measure_bandwidth(**kwargs)


def test_smaller_direction_is_reported():
    link = LinkBandwidth(20e9, 13e9, 10, 3, "cuda:0", True)
    assert link.bytes_per_s == 13e9
    assert link.to_dict()["bytes_per_s"] == 13e9


def _room_for(limit: int, tried: list[int]):  # type: ignore[no-untyped-def]
    def measure(size: int) -> LinkBandwidth:
        tried.append(size)
        if size > limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {size} bytes")
        return LinkBandwidth(2e10, 1e10, size, 3, "cuda:0", True)
    return measure


def test_a_full_device_measures_with_a_smaller_buffer(caplog: pytest.LogCaptureFixture):
    """A device without room for the 64 MiB copy buffer (nearly full, or under a memory fraction)
    is measured with the largest eighth that fits, and the retry is logged."""
    tried: list[int] = []
    with caplog.at_level(logging.INFO, logger="autoremat.offload.bandwidth"):
        link = shrinking(_room_for(5 * 2**20, tried), 64 * 2**20, 3)
    assert tried == [64 * 2**20, 8 * 2**20, 2**20]
    assert link.measured and link.nbytes == 2**20 and link.bytes_per_s == 1e10
    assert "no room on the device for a 67108864-byte copy buffer; measuring with 8388608 bytes" in caplog.text


def test_no_room_at_all_falls_back_to_the_default_and_warns(caplog: pytest.LogCaptureFixture):
    tried: list[int] = []
    with caplog.at_level(logging.INFO, logger="autoremat.offload.bandwidth"):
        link = shrinking(_room_for(0, tried), 64 * 2**20, 3)
    assert tried == [64 * 2**20, 8 * 2**20, MIN_NBYTES]
    assert not link.measured and link.bytes_per_s == DEFAULT_BANDWIDTH_BYTES_PER_S
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and f"no room for a {MIN_NBYTES}-byte copy buffer" in warned[0].getMessage()


def test_other_errors_are_not_swallowed():
    def broken(size: int) -> LinkBandwidth:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    with pytest.raises(RuntimeError, match="illegal memory access"):
        shrinking(broken, 64 * 2**20, 3)


@pytest.mark.gpu
def test_measures_both_directions_on_cuda():
    before = torch.cuda.memory_allocated()
    link = measure_link(nbytes=32 * 2**20, repeats=3)
    assert link.measured and link.device.startswith("cuda:")
    for b in (link.host_to_device_bytes_per_s, link.device_to_host_bytes_per_s):
        assert 1e8 < b < 2e12  # between a slow PCIe slot and any NVLink-C2C host link
    assert link.bytes_per_s == min(link.host_to_device_bytes_per_s, link.device_to_host_bytes_per_s)
    assert measure_bandwidth(torch.cuda.current_device(), nbytes=8 * 2**20, repeats=2) > 1e8
    assert torch.cuda.memory_allocated() == before  # the device buffers are released


@pytest.mark.gpu
def test_measures_with_a_smaller_buffer_under_a_memory_fraction():
    """Under a memory fraction with no room for the 64 MiB buffer, the link is still measured."""
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + 24 * 2**20) / total)
    try:
        link = measure_link(nbytes=64 * 2**20, repeats=2)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert link.measured and link.nbytes == 8 * 2**20 and link.bytes_per_s > 1e8


def test_a_cuda_capture_records_the_link_once_per_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """``record_link`` (what ``capture`` and ``capture_within`` call): a graph captured on a CUDA
    device gets the measured link in its meta, measured once per device and process; a CPU graph
    keeps the simulator's default, and a link already set is kept."""
    import autoremat
    from autoremat.offload import bandwidth

    calls: list[str] = []

    def fake(device):  # type: ignore[no-untyped-def]
        calls.append(str(device))
        return 3.0e10

    monkeypatch.setattr(bandwidth, "measure_bandwidth", fake)
    monkeypatch.setattr(bandwidth, "_LINKS", {})
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    x = torch.randn(3, 4)
    cpu = autoremat.capture(model, (x,), repeats=1, warmup=0)
    assert "bandwidth_bytes_per_s" not in cpu.meta and not calls
    graphs = [autoremat.capture(model, (x,), repeats=1, warmup=0) for _ in range(3)]
    for g in graphs:
        g.meta["device"] = "cuda:0"  # as captured there
        bandwidth.record_link(g)
    assert calls == ["cuda:0"] and all(g.meta["bandwidth_bytes_per_s"] == 3.0e10 for g in graphs)
    graphs[0].meta.update(device="cuda:1", bandwidth_bytes_per_s=5e10)
    bandwidth.record_link(graphs[0])
    assert graphs[0].meta["bandwidth_bytes_per_s"] == 5e10 and calls == ["cuda:0"]


@pytest.mark.gpu
def test_capture_on_cuda_records_the_measured_link() -> None:
    import autoremat
    from autoremat.capture.scaled import capture_within

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).cuda()
    x = torch.randn(32, 64, device="cuda")
    for g in (autoremat.capture(model, (x,), repeats=1, warmup=0), capture_within(model, (x,), limit_bytes=2**30)):
        assert 1e8 < g.meta["bandwidth_bytes_per_s"] < 2e12
