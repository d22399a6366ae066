"""``autoremat.grad_sums``: which ``add`` in backward is the engine's sum of two gradients, whether the
plain engine makes it in place, and which gradients had a first part that was a view."""

from __future__ import annotations

import torch

from autoremat.grad_sums import GradSums, dense, engine_sum
from autoremat.measure import LiveStorageCounter

_ADD = torch.ops.aten.add.Tensor


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def test_dense_is_some_order_of_the_dimensions_without_gaps() -> None:
    x = torch.zeros(4, 6, 5)
    assert dense(x) and dense(x.transpose(0, 2)) and dense(x.permute(1, 2, 0))
    assert not dense(x[:, ::2]) and not dense(torch.zeros(6).expand(4, 6))
    assert dense(torch.zeros(2, 3, 4, 5).to(memory_format=torch.channels_last))


def test_an_engine_sum_is_an_add_in_backward_of_a_gradient_made_before() -> None:
    a, b = torch.zeros(4, 6), torch.ones(4, 6)
    seen, made = {_key(a): 96, _key(b): 96}, ("MulBackward0", 7)
    assert engine_sum(_ADD, (a, b), None, made, seen, {}) is True
    assert engine_sum(_ADD, (a.t().contiguous().t(), b), None, made, {_key(a): 96}, {}) is None  # not counted
    view = torch.zeros(6, 4)
    assert engine_sum(_ADD, (view.t(), b), None, made, {_key(view): 96}, {}) is False  # a transpose: out of place
    assert engine_sum(_ADD, (a, b), None, None, seen, {}) is None  # forward
    assert engine_sum(_ADD, (a, b), None, made, seen, {_key(a): made}) is None  # the running node made a
    assert engine_sum(torch.ops.aten.mul.Tensor, (a, b), None, made, seen, {}) is None
    assert engine_sum(_ADD, (a, b[:, :3]), None, made, seen, {}) is None


def test_a_first_part_that_is_a_view_is_remembered_through_later_sums() -> None:
    sums, calls = GradSums(), []
    sums.on_sum = lambda a, b, out: calls.append(out)
    first, s1, s2, plain = torch.zeros(3), torch.zeros(3), torch.zeros(3), torch.zeros(3)
    sums.note(first, torch.ones(3), s1, False, 12)
    sums.note(s1, torch.ones(3), s2, True, 12)
    sums.note(torch.zeros(3), torch.ones(3), plain, True, 12)
    assert sums.view_sums == [12] and sums.origin(s1) == sums.origin(s2) == 0 and sums.origin(plain) is None
    assert calls == [s1, s2, plain]
    sums.release(_key(s2))
    assert sums.origin(s2) is None


def test_the_counter_finds_a_transposed_first_gradient() -> None:
    """``w`` read transposed (its first gradient, in backward order, a view) and then plainly."""
    w = torch.randn(16, 8, requires_grad=True)
    x = torch.randn(4, 16)
    counter = LiveStorageCounter()
    got = []
    with counter:
        y = w * 2
        y.register_hook(lambda g: got.append(counter.sums.origin(g)))
        ((x @ y) @ y.t()).sum().backward()
    assert got == [0] and len(counter.sums.view_sums) == 1
