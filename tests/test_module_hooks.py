"""The one list of ``nn.Module`` hook dictionaries covers every one this PyTorch has: a hook in a
dictionary it missed would escape capture's hooked-block check, the guard and the rollback."""

from torch import nn
from torch.nn.modules import module as module_mod

from autoremat._module_hooks import GLOBAL_HOOK_DICTS, HOOK_DICTS


def _call_hooks(name: str) -> bool:
    """A dictionary of hooks run around a call (not state-dict or registration hooks)."""
    return "hooks" in name and ("forward" in name or "backward" in name)


def test_every_module_hook_dict_is_listed():
    calls = {k for k, v in nn.Module().__dict__.items() if _call_hooks(k) and isinstance(v, dict)}
    assert calls == set(HOOK_DICTS)


def test_every_global_hook_dict_is_listed():
    found = {k for k, v in vars(module_mod).items() if k.startswith("_global_") and _call_hooks(k) and isinstance(v, dict)}
    assert found == set(GLOBAL_HOOK_DICTS)
