"""The meta-device op cache (autoremat.capture.meta_cache) and the meta captures that use it."""

from __future__ import annotations

import pytest
import torch

import autoremat
from autoremat.capture.meta_cache import MetaOpCache


def test_meta_op_cache_answers_repeated_ops_with_the_same_metadata() -> None:
    x = torch.empty(4, 3, 8, 8, device="meta").contiguous(memory_format=torch.channels_last)
    w = torch.empty(5, 3, 1, 1, device="meta")
    cache = MetaOpCache()
    with cache:
        first = torch.nn.functional.conv2d(x, w)
        again = torch.nn.functional.conv2d(x, w)
        view = x.view(4, -1) if x.is_contiguous() else x.reshape(4, -1)
        x.add_(1)  # in place: never from the cache
        x.add_(1)
    assert cache.hits == 1 and cache.misses >= 1
    assert (again.shape, again.stride(), again.dtype) == (first.shape, first.stride(), first.dtype)
    assert again.untyped_storage()._cdata != first.untyped_storage()._cdata
    assert again.untyped_storage().nbytes() == first.untyped_storage().nbytes()
    assert view.shape == (4, 192)


def test_an_op_that_returns_its_input_storage_is_never_answered_from_the_cache() -> None:
    """``_unsafe_view`` declares no alias but returns its input's storage; a hit would make a new
    storage, so the recorder would count bytes a view does not have (found on GPT-2's attention)."""
    x = torch.empty(4, 6, device="meta")
    cache = MetaOpCache()
    with cache:
        first = torch.ops.aten._unsafe_view.default(x, [24])
        again = torch.ops.aten._unsafe_view.default(x, [24])
    assert cache.hits == 0
    assert first.untyped_storage()._cdata == again.untyped_storage()._cdata == x.untyped_storage()._cdata


def test_a_meta_capture_is_the_cpu_capture_with_flop_times_node_for_node() -> None:
    """The meta capture answers the repeated layers' ops from the cache; the graph must be the one
    the same model gives on the CPU with FLOP times (bytes, views, saves, edges, fingerprint)."""
    pytest.importorskip("transformers")
    from autoremat.capture.scaled.meta import on_meta
    from autoremat.zoo.hf import gpt2

    model = gpt2(n_layer=3)
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(2, 1, 64, 64)  # a 4-D mask: transformers' 2-D mask code calls .item()
    cpu = autoremat.capture(model, (ids,), {"attention_mask": mask}, times="flops", repeats=1)
    with on_meta(model):
        meta = autoremat.capture(model, (ids.to("meta"),), {"attention_mask": mask.to("meta")})
    assert meta.meta["blocks"] == "ops" and len(meta.nodes) == len(cpu.nodes) > 100
    for v in cpu.nodes:
        assert meta.node(v) == cpu.node(v), v
    assert set(meta.nx.edges) == set(cpu.nx.edges)
    assert meta.fingerprint == cpu.fingerprint
    assert {k: v for k, v in meta.meta.items() if k not in ("inputs", "device")} == \
        {k: v for k, v in cpu.meta.items() if k not in ("inputs", "device")}


def test_the_cyclic_collector_is_paused_during_a_meta_capture_only() -> None:
    """A meta capture runs with Python's cyclic collector paused (a fifth of a 64-layer GPT-2's
    capture time); a capture on a real device keeps it on outside its timed steps (garbage may
    hold device memory), and
    either leaves it as it found it."""
    import gc

    seen: list[bool] = []

    class Probe(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(gc.isenabled())
            return torch.relu(self.lin(x))

    assert gc.isenabled()
    for device in ("meta", "cpu"):
        seen.clear()
        model = Probe().to(device)
        autoremat.capture(model, (torch.randn(2, 4, device=device),), mode="module", repeats=1, warmup=0)
        # on the CPU it is paused only around the timed steps (paused_gc), not the recorded one
        assert seen and any(seen) is (device == "cpu"), (device, seen)
        assert gc.isenabled()
