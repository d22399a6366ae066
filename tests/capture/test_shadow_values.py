"""Values beside small meta tensors (``autoremat.capture.shadow_values``): Python that reads a
tensor derived from the inputs, buffers or constants runs on meta as on the CPU, with the same
ops dispatched; random ops never draw from the CPU generator; a write the shadows cannot follow
leaves no stale value behind."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from autoremat.capture.device_parity import as_device
from autoremat.capture.shadow_values import ShadowValues


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def, override]
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _branchy(ids: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
    """What transformers' mask code does: positions from ``arange``, a check whether they form one
    sequence per row, a padding check on the ids; then work that depends on the answers."""
    pos = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
    packed = (torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1) != 1).cumsum(-1)
    x = emb[ids]
    if (packed[:, -1] == 0).all():
        x = x * 2
    if 0 in ids[:, [-1, 0]]:
        x = x + 1
    n = int(ids.max().item()) + 1
    return x[:, :n].sum(-1)


def _run(device: str, shadows: ShadowValues | None) -> tuple[list[str], torch.Tensor]:
    ids = torch.tensor([[3, 1, 0, 2], [2, 2, 1, 0]])
    emb = torch.randn(5, 6, generator=torch.Generator().manual_seed(0))
    rec = _Ops()
    if device == "cpu":
        with rec:
            out = _branchy(ids, emb)
        return rec.ops, out
    mids, memb = ids.to("meta"), emb.to("meta")
    assert shadows is not None
    shadows.seed(mids, ids)
    with as_device(torch.device("cpu"), shadows), shadows, rec:
        out = _branchy(mids, memb)
    return rec.ops, out


def test_python_reading_values_runs_on_meta_as_on_the_cpu() -> None:
    cpu_ops, cpu_out = _run("cpu", None)
    shadows = ShadowValues()
    meta_ops, meta_out = _run("meta", shadows)
    assert meta_ops == cpu_ops
    assert meta_out.shape == cpu_out.shape and meta_out.device.type == "meta"
    assert shadows.answered >= 3  # the two branches and the item()


def test_without_values_meta_raises_where_python_reads_one() -> None:
    with pytest.raises(RuntimeError, match="meta"):
        _branchy(torch.zeros(2, 4, dtype=torch.long, device="meta"), torch.zeros(5, 6, device="meta"))


def test_random_ops_leave_the_cpu_generator_alone() -> None:
    shadows = ShadowValues()
    x = torch.arange(8.0)
    mx = x.to("meta")
    shadows.seed(mx, x)
    torch.manual_seed(3)
    state = torch.get_rng_state()
    with shadows:
        y = torch.rand_like(mx) + mx
        z = torch.bernoulli(torch.full((8,), 0.5, device="meta"))
    assert torch.equal(torch.get_rng_state(), state)
    assert shadows.value(y) is None and shadows.value(z) is None
    assert shadows.value(mx) is not None


def test_a_write_the_shadows_cannot_follow_leaves_no_stale_value() -> None:
    shadows = ShadowValues()
    with shadows:
        t = torch.zeros(4, device="meta")
        view = t[:2]
        assert shadows.value(view) is not None
        t.add_(torch.empty(4, device="meta"))  # a value the shadows do not know
    assert shadows.value(t) is None and shadows.value(view) is None
    with pytest.raises(RuntimeError, match="meta"), shadows:
        view.sum().item()


def test_in_place_writes_through_views_are_followed() -> None:
    shadows = ShadowValues()
    with shadows:
        t = torch.zeros(4, dtype=torch.long, device="meta")
        t[1:3] += 5
        assert t.sum().item() == 10
        assert t[0].item() == 0


def test_large_tensors_get_no_values() -> None:
    shadows = ShadowValues(max_numel=16)
    big, small = torch.arange(32), torch.arange(8)
    mbig, msmall = big.to("meta"), small.to("meta")
    shadows.seed(mbig, big)
    shadows.seed(msmall, small)
    assert shadows.value(mbig) is None and shadows.value(msmall) is not None
