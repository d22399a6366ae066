"""Rollback for :func:`autoremat.apply`: what patching may change on a model, saved before it
starts and put back when it fails part-way, so that a failed ``apply`` leaves the model exactly
as it was (hooks, instance ``forward`` attributes, the patch-state attribute)."""

from __future__ import annotations

from typing import Any

from torch import nn

from .._module_hooks import HOOK_DICTS as _HOOK_DICTS

__all__ = ["PatchPoints"]

_MISSING = object()


class PatchPoints:
    """The hook dicts and instance ``forward`` of every submodule of ``model``, and the
    instance attribute ``state_attr`` of ``model``, as they are now."""

    def __init__(self, model: nn.Module, state_attr: str) -> None:
        self.model = model
        self.state_attr = state_attr
        self.state = model.__dict__.get(state_attr, _MISSING)
        self.modules: list[tuple[nn.Module, Any, dict[str, dict[Any, Any]]]] = [
            (m, m.__dict__.get("forward", _MISSING),
             {name: dict(getattr(m, name)) for name in _HOOK_DICTS if hasattr(m, name)})
            for m in model.modules()
        ]

    def roll_back(self) -> None:
        """Put every saved attribute back."""
        for m, forward, hooks in self.modules:
            if forward is _MISSING:
                m.__dict__.pop("forward", None)
            else:
                m.__dict__["forward"] = forward
            for name, saved in hooks.items():
                current = getattr(m, name)
                current.clear()
                current.update(saved)
        if self.state is _MISSING:
            self.model.__dict__.pop(self.state_attr, None)
        else:
            self.model.__dict__[self.state_attr] = self.state
