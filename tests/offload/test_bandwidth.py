"""``autoremat.offload.bandwidth``: the default without CUDA (logged), validation, and (marked gpu)
a real measurement of both directions with pinned buffers and CUDA events."""

from __future__ import annotations

import logging

import pytest
import torch

from autoremat.offload import DEFAULT_BANDWIDTH_BYTES_PER_S, LinkBandwidth, measure_bandwidth, measure_link
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
