"""A layer that applies one linear twice (LongT5's key projection, on the hidden states and on the
global inputs) under bf16 autocast reads one cached cast of its weight twice: a recomputed region
would cast it at each use and sum the weight's gradient in float32. Capture pins those call regions
(:mod:`autoremat.capture.shared_casts`), so every plan trains bit for bit; in float32 nothing is pinned.
The same holds for module calls and fx nodes that share a cast: a leaf module applying its weight twice,
two modules sharing a tied weight."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from _stacked import Stacked, step_gradients
from torch import nn

import autoremat
from autoremat.measure import gradients_equal


class _Twice(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.k, self.mix = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mix(self.k(x) * self.k(x.flip(1)))


@pytest.mark.parametrize("amp", [False, True])
def test_regions_reading_a_cast_twice_are_kept_and_plans_train_bit_for_bit(amp: bool) -> None:
    torch.manual_seed(0)
    model, x = Stacked(_Twice, d=16), torch.randn(4, 8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        graph = autoremat.capture(model, (x,), loss_fn=lambda y: y.float().sum(), mode="module", times="flops")
        reference = step_gradients(model, x)
        plan = autoremat.solve(graph, "min")
        patched = copy.deepcopy(model)
        autoremat.apply(patched, plan)
        assert gradients_equal(reference, step_gradients(patched, x))
    pinned = set(graph.meta["pinned_regions"])
    if amp:  # each layer; not the calls of its k (run twice per step: they keep the step's casts)
        assert pinned == {f"layers.{i}" for i in range(3)}, pinned
        assert not any(graph.node(s.nodes[0])["scope"] and s.nodes[0] in plan.module_calls
                       and plan.module_calls[s.nodes[0]][0] in pinned for s in plan.recompute_segments)
    else:
        assert not pinned


def test_a_capture_within_a_limit_pins_them_too() -> None:
    """The meta-device capture and the small real ones of :func:`autoremat.capture_within` (a step that
    does not fit) see the same cached casts."""
    torch.manual_seed(0)
    model, x = Stacked(_Twice, d=16), torch.randn(4, 8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        graph = autoremat.capture_within(model, (x,), loss_fn=lambda y: y.float().sum(), mode="module",
                                         limit_bytes=10**5)
    assert set(graph.meta["pinned_regions"]) == {f"layers.{i}" for i in range(3)}


class _TwiceF(nn.Module):
    """A leaf module (one node at module level) applying its weight ``w`` twice; ``m`` once."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(width, width) / width**0.5)
        self.m = nn.Parameter(torch.randn(width, width) / width**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.linear(F.linear(x, self.w) * F.linear(x.flip(1), self.w), self.m)


class _Tied(nn.Module):
    """``b`` shares ``a``'s weight; ``c`` and ``head`` own theirs."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.a, self.b, self.c, self.head = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, 4)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.b(torch.tanh(self.c(torch.tanh(self.a(x)))))))


_SHARING = {  # (model, capture mode) -> the nodes sharing a cast (fx: the F.linear calls reading w)
    ("twice", "module"): {f"layers.{i}": f"layers.{i}.w" for i in range(3)},
    ("twice", "fx"): {f"linear{s}": f"layers.{i}.w" for i, pair in enumerate((("", "_1"), ("_3", "_4"), ("_6", "_7")))
                      for s in pair},
    ("tied", "module"): {"a": "a.weight", "b": "a.weight"},
    ("tied", "fx"): {"a": "a.weight", "b": "a.weight"},
}


@pytest.mark.parametrize("mode", ["module", "fx"])
@pytest.mark.parametrize("name", ["twice", "tied"])
@pytest.mark.parametrize("amp", [False, True])
def test_nodes_sharing_a_cast_are_kept_and_plans_train_bit_for_bit(name: str, mode: str, amp: bool) -> None:
    """Recomputed, ``a`` or a node of ``_TwiceF`` trained with a weight gradient not bit for bit the
    unpatched step's (its own cast, summed in float32); ``c``, ``head`` and ``m`` are read once: free."""
    torch.manual_seed(0)
    model = Stacked(_TwiceF, d=16) if name == "twice" else _Tied()
    x = torch.randn(4, 8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        graph = autoremat.capture(model, (x,), loss_fn=lambda y: y.float().sum(), mode=mode, times="flops")
        reference = step_gradients(model, x)
        plan = autoremat.solve(graph, "min")
        patched = copy.deepcopy(model)
        autoremat.apply(patched, plan)
        assert gradients_equal(reference, step_gradients(patched, x))
    assert graph.meta["pinned_by_shared_cast"] == (_SHARING[name, mode] if amp else {})
    kept = {graph.node(v)["name"] for v in range(len(graph)) if not graph.node(v)["recomputable"]}
    assert set(graph.meta["pinned_by_shared_cast"]) <= kept
    if amp and (name, mode) != ("twice", "module"):  # there only the head is left
        assert plan.recompute_segments  # nodes reading a cast once are recomputed still


@pytest.mark.parametrize("mode", ["module", "fx"])
def test_a_capture_within_a_limit_pins_the_tied_modules(mode: str) -> None:
    torch.manual_seed(0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        graph = autoremat.capture_within(_Tied(), (torch.randn(4, 8, 16),), loss_fn=lambda y: y.float().sum(),
                                         mode=mode, limit_bytes=10**4)
    assert graph.meta["pinned_by_shared_cast"] == {"a": "a.weight", "b": "a.weight"}


def test_a_freed_cast_s_address_is_not_taken_for_the_cast() -> None:
    """A cast the model makes itself (``param.to(dtype)``), read once and freed: its storage's address
    is the key of its reads, and a later tensor given that address was read as the cast (a bf16 Mamba
    had 1-3 of its 3 layers pinned, run to run, so its least plan was 0.96x or 0.71x of the peak by
    chance). While watched, no other storage gets that address, and nothing is pinned."""
    from types import SimpleNamespace

    from autoremat.capture.shared_casts import CastReads

    w = nn.Parameter(torch.randn(64))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reads = CastReads([("w", w)])
    cast = w.to(torch.bfloat16)
    key = cast.untyped_storage()._cdata
    reads.note(torch.ops.aten._to_copy.default, [w], [cast], 0)
    reads.note(torch.ops.aten.sum.default, [cast], [cast.sum()], 1)
    del cast
    later = [torch.randn(64, dtype=torch.bfloat16) for _ in range(200)]
    assert all(t.untyped_storage()._cdata != key for t in later)
    for i, t in enumerate(later):
        reads.note(torch.ops.aten.mul.Tensor, [t], [t * 2], 2 + i % 2)
    nodes = [SimpleNamespace(kind="call", scope=(f"layers.{v}",), recomputable=True, name=f"n{v}") for v in range(4)]
    settled = reads.settle(nodes)
    assert not settled.regions and not settled.nodes
