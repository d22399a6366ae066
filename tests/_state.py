"""Test helper: snapshot everything a public autoremat call may touch on a model, and assert
that a failed call left all of it exactly as it was.

What is compared: every parameter and buffer (the same object under the same name, its value,
dtype, ``requires_grad``, no ``grad_fn`` on a buffer, ``.grad`` bit for bit), every module's
hook dicts (forward, forward-pre, backward, with kwargs / always-called), instance attributes
(``forward`` in ``__dict__`` and autoremat's patch attribute included, by identity), every
module's ``training`` flag, and the CPU RNG state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["ModelState", "snapshot", "assert_unchanged"]

_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
               "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")


@dataclass
class ModelState:
    tensors: dict[str, tuple[torch.Tensor, torch.Tensor, bool, Any]]
    grads: dict[str, torch.Tensor | None]
    hooks: dict[str, dict[str, list[tuple[int, Any]]]]
    attrs: dict[str, dict[str, Any]]
    training: dict[str, bool]
    rng: torch.Tensor


def _instance_attrs(m: nn.Module) -> dict[str, Any]:
    return {k: v for k, v in m.__dict__.items() if not k.startswith("_") or k == "_autoremat_patch"}


def snapshot(model: nn.Module) -> ModelState:
    tensors: dict[str, tuple[torch.Tensor, torch.Tensor, bool, Any]] = {}
    grads: dict[str, torch.Tensor | None] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        tensors[f"param:{name}"] = (p, p.detach().clone(), p.requires_grad, p.grad_fn)
        grads[name] = None if p.grad is None else p.grad.detach().clone()
    for name, b in model.named_buffers(remove_duplicate=False):
        tensors[f"buffer:{name}"] = (b, b.detach().clone(), b.requires_grad, b.grad_fn)
    hooks = {name: {d: list(getattr(m, d).items()) for d in _HOOK_DICTS if hasattr(m, d)}
             for name, m in model.named_modules(remove_duplicate=False)}
    attrs = {name: _instance_attrs(m) for name, m in model.named_modules(remove_duplicate=False)}
    training = {name: m.training for name, m in model.named_modules(remove_duplicate=False)}
    return ModelState(tensors, grads, hooks, attrs, training, torch.get_rng_state())


def assert_unchanged(model: nn.Module, before: ModelState) -> None:
    """Fail, naming the first difference, unless ``model`` is as it was at ``snapshot``."""
    after = snapshot(model)
    assert after.tensors.keys() == before.tensors.keys(), "parameters/buffers added or removed"
    for key, (obj, value, requires_grad, grad_fn) in before.tensors.items():
        now = after.tensors[key]
        assert now[0] is obj, f"{key} was replaced by another tensor object"
        assert now[1].dtype == value.dtype and torch.equal(now[1], value), f"{key} changed value"
        assert now[2] == requires_grad, f"{key}.requires_grad changed to {now[2]}"
        assert now[3] is grad_fn, f"{key} has grad_fn {now[3]} (was {grad_fn})"
    for name, grad in before.grads.items():
        got = after.grads[name]
        assert (got is None) == (grad is None), f"param {name}.grad changed between None and a tensor"
        assert grad is None or torch.equal(got, grad), f"param {name}.grad changed"
    for name, dicts in before.hooks.items():
        for d, items in dicts.items():
            now = after.hooks[name][d]
            assert [(k, id(v)) for k, v in now] == [(k, id(v)) for k, v in items], \
                f"module {name or '<root>'}: {d} changed ({len(items)} -> {len(now)} hooks)"
    for name, attrs in before.attrs.items():
        now = after.attrs[name]
        assert now.keys() == attrs.keys(), f"module {name or '<root>'}: instance attributes " \
                                           f"{sorted(set(now) ^ set(attrs))} added or removed"
        for k, v in attrs.items():
            assert now[k] is v or (isinstance(v, (bool, int, float, str)) and now[k] == v), \
                f"module {name or '<root>'}: attribute {k!r} changed"
    assert after.training == before.training, "a module's training flag changed"
    assert torch.equal(after.rng, before.rng), "the CPU RNG state changed"
