"""Layout rules of the meta capture's op cache: learned from kernels, verified, then used; a rule
that mispredicts is retired; what a rule answers equals what the kernel returns."""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F

from autoremat.capture.meta_rules import CONFIRMATIONS, LayoutRules, ruled, structure

meta = importlib.import_module("autoremat.capture.meta_cache")


def _layout(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.dtype


def _batch_norm_step(x: torch.Tensor) -> list[torch.Tensor]:
    """Batch norm (training, affine) forward and backward: the outputs of both ops."""
    c = x.shape[1]
    w = torch.empty(c, device=x.device, requires_grad=True)
    b = torch.empty(c, device=x.device, requires_grad=True)
    rm, rv = torch.empty(c, device=x.device), torch.empty(c, device=x.device)
    x = x.detach().requires_grad_()
    y = F.batch_norm(x, rm, rv, w, b, training=True)
    gx, gw, gb = torch.autograd.grad(y, (x, w, b), torch.empty_like(y))
    return [y, gx, gw, gb]


def _inputs(channels_last: bool) -> list[torch.Tensor]:
    shapes = [(4, c, 6, 5) for c in (3, 5, 7, 9, 11)] + [(2, 13, 4, 4)]
    xs = [torch.empty(s, device="meta") for s in shapes]
    return [x.contiguous(memory_format=torch.channels_last) for x in xs] if channels_last else xs


def test_batch_norm_layouts_from_rules_equal_the_kernels() -> None:
    for channels_last in (False, True):
        xs = _inputs(channels_last)
        expected = [[_layout(t) for t in _batch_norm_step(x)] for x in xs]  # the kernels, no cache
        cache = meta.MetaOpCache()
        with cache:
            got = [_batch_norm_step(x) for x in xs]
        # the first shape teaches, the next CONFIRMATIONS verify, the rest are answered by the rules
        assert cache.rules.used >= 2 * (len(xs) - 1 - CONFIRMATIONS)
        assert [[_layout(t) for t in outs] for outs in got] == expected
        storages = {t.untyped_storage()._cdata for outs in got for t in outs}
        assert len(storages) == sum(len(outs) for outs in got)  # every output a fresh storage


def test_pointwise_rules_keep_the_layout_and_broadcasting_is_left_to_the_kernel() -> None:
    xs = _inputs(channels_last=True)
    cache = meta.MetaOpCache()
    with cache:
        outs = [torch.relu(x) + x for x in xs]
        before = cache.rules.used
        wide = xs[-1] + torch.empty(1, 13, 1, 1, device="meta")  # broadcast: no rule
    assert cache.rules.used > 0 and cache.rules.used == before
    assert all(_layout(o) == _layout(torch.relu(x) + x) for o, x in zip(outs, xs))
    assert _layout(wide) == _layout(xs[-1] + torch.empty(1, 13, 1, 1, device="meta"))
    assert ruled(torch.ops.aten.relu.default) and not ruled(torch.ops.aten.convolution.default)


def test_a_rule_that_mispredicts_is_retired_and_never_used() -> None:
    rules = LayoutRules()
    op = torch.ops.aten.relu.default
    xs = [torch.empty(2, c, device="meta") for c in (3, 4, 5, 6)]
    flat = [[x] for x in xs]
    key = structure(op, None, flat[0])
    assert key is not None and key == structure(op, None, flat[1])  # one structure for all sizes
    rules.learn(key, flat[0], [_layout(xs[0])], None)
    rules.learn(key, flat[1], [((99,), (1,), torch.float32)], None)  # not what the template predicts
    for x, f in zip(xs[2:], flat[2:]):
        rules.learn(key, f, [_layout(x)], None)
    assert rules.predict(key, flat[3]) is None and rules.used == 0
    good = LayoutRules()
    for x, f in zip(xs, flat):
        good.learn(key, f, [_layout(x)], None)
    assert good.predict(key, [torch.empty(2, 40, device="meta")]) == ([((2, 40), (40, 1), torch.float32)], None)
