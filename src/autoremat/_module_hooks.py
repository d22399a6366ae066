"""The names of ``nn.Module``'s hook dictionaries, per module and global: one list for every
part of autoremat that reads, silences or restores hooks (capture's tracing and hooked-block
check, the patched model's state guard, ``apply``'s rollback).

``_forward_hooks_with_kwargs``, ``_forward_hooks_always_called`` and
``_forward_pre_hooks_with_kwargs`` hold flags keyed by the ids of hooks in ``_forward_hooks`` /
``_forward_pre_hooks`` (they are never non-empty without them), so a check for "any hook" finds
the same modules with or without them; code that saves and restores hooks needs them all."""

from __future__ import annotations

from torch import nn
from torch.nn.modules import module as _module_mod

__all__ = ["GLOBAL_HOOK_DICTS", "HOOK_DICTS", "has_hooks", "global_hooks"]

HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
              "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks",
              "_backward_pre_hooks")
GLOBAL_HOOK_DICTS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                     "_global_backward_pre_hooks", "_global_forward_hooks_always_called",
                     "_global_forward_hooks_with_kwargs")


def has_hooks(module: nn.Module) -> bool:
    """Whether ``module`` has a hook of its own in any of :data:`HOOK_DICTS`."""
    return any(module.__dict__.get(h) for h in HOOK_DICTS)


def global_hooks() -> bool:
    """Whether any global module hook is registered (``register_module_forward_hook`` and co.)."""
    return any(getattr(_module_mod, h, None) for h in GLOBAL_HOOK_DICTS)
