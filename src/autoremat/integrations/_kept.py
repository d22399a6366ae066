"""What the callback's own runs of ``training_step`` change outside parameters and buffers, put
back: they run only to record the target's inputs (:func:`~._lightning_steps.record_inputs`) or
to count its calls (:func:`~._lightning_steps.calls_per_step`), and nothing they do may reach
the user's training.

:func:`kept_attributes` restores, for the LightningModule and every submodule, the attributes
as they were (added ones removed, rebound ones rebound), the contents of the lists, dicts and
sets they hold (two levels: a dict of lists), and the values of the tensors they hold, which a
step may update in place. The last is what a ``torchmetrics`` metric's state is (``self.tp +=
...`` in its ``update``): without it a training accuracy accumulated in ``training_step``
counted the counting run's rows in its epoch value (66 of 64 samples, measured). A tensor is
copied beforehand only where a submodule holds it and up to :data:`KEEP_BYTES` (metric states,
counters), not the LightningModule's own (it often holds its dataset in a tensor attribute: a
copy would take memory the user's budget did not give, and on the simulated device of the tests
a step that fitted ran out of memory); one changed in place without a copy is left changed, with
a warning naming it (its version counter tells). Parameters and buffers are
:func:`~autoremat.capture._recorder.preserved_state`'s; private attributes (``_``-prefixed:
hooks, caches PyTorch keeps) are rebound but their contents are left alone.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["kept_attributes", "KEEP_BYTES"]

logger = logging.getLogger("autoremat.integrations.lightning")

KEEP_BYTES = 256 * 1024
"""The largest tensor attribute :func:`kept_attributes` copies to restore (a 100-class confusion
matrix of int64 is 80 KB)."""

_OWN = ("_parameters", "_buffers", "_modules")  # preserved_state's


@contextlib.contextmanager
def kept_attributes(obj: nn.Module, depth: int = 2) -> Iterator[None]:
    """``obj``'s and its submodules' attributes as they were before the block (module docstring)."""
    before = {m: {k: v for k, v in vars(m).items() if k not in _OWN} for m in obj.modules()}
    held = [(v, _contents(v, depth)) for attrs in before.values() for k, v in attrs.items() if not k.startswith("_")]
    values = [(f"{type(m).__name__}.{k}", v, v._version, v.detach().clone() if m is not obj and _small(v) else None)
              for m, attrs in before.items() for k, v in attrs.items()
              if not k.startswith("_") and isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter)
              and not v.is_inference()]  # (no version counter; nor can it change outside inference mode)
    try:
        yield
    finally:
        for m, attrs in before.items():
            now = vars(m)
            for k in [k for k in now if k not in attrs and k not in _OWN]:
                del now[k]
            now.update(attrs)
        for v, contents in held:
            _put_back(v, contents)
        _restore(values)


def _small(v: torch.Tensor) -> bool:
    return v.numel() * v.element_size() <= KEEP_BYTES


def _restore(values: list[tuple[str, torch.Tensor, int, torch.Tensor | None]]) -> None:
    """Copy the old values back into the tensors the block changed in place (their version moved)."""
    with torch.no_grad():
        for name, v, version, old in values:
            if v._version == version:
                continue
            if old is not None and v.shape == old.shape and v.dtype == old.dtype and v.device == old.device:
                v.copy_(old)
            else:
                logger.warning("AutoRemat: the callback's own run of training_step (to record the module's inputs "
                               "or count its calls) changed tensor attribute %s (%s, %s) in place, and it was too "
                               "large to copy beforehand: it keeps that change; register it as a buffer to have "
                               "it restored", name, tuple(v.shape), v.dtype)


def _contents(v: Any, depth: int) -> Any:
    """A copy of container ``v``'s items (and of its containers', ``depth`` levels), or ``None``."""
    if depth <= 0 or not isinstance(v, (list, dict, set)):
        return None
    items = list(v.items()) if isinstance(v, dict) else list(v)
    inner = [(x, _contents(x, depth - 1)) for x in (v.values() if isinstance(v, dict) else v)]
    return items, inner


def _put_back(v: Any, contents: Any) -> None:
    if contents is None:
        return
    items, inner = contents
    if isinstance(v, list):
        v[:] = items
    else:  # a dict (from its item pairs) or a set
        v.clear()
        v.update(items)
    for x, c in inner:
        _put_back(x, c)
