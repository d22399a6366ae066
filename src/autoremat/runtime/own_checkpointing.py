"""A patched model whose own gradient checkpointing is turned on after ``apply``.

Capture refuses a model that checkpoints by itself (:class:`~autoremat.errors.ModelRecomputesError`),
but nothing stops a user from turning Hugging Face's checkpointing on afterwards:
``model.gradient_checkpointing_enable()``, or ``TrainingArguments(gradient_checkpointing=True)``,
which the Hugging Face ``Trainer`` applies when training starts. The step stays exact (its layers
are recomputed by their own checkpoint inside autoremat's regions), but pays for recomputation
that buys no memory: measured (x86_64 CPU, 1 thread, a 4-layer GPT-2 of width 256 at sequence 256,
batch 4, under its least plan): 0.565 -> 0.614 s per step and 0.580 -> 0.630 s in a second pair,
+8.6 %, at the same peak.

:func:`watch` adds a forward pre-hook to the patched model that, on a training step (``training``
and gradients on), looks at the flags Hugging Face sets (``gradient_checkpointing`` on the model and
on each layer that checkpoints; the modules that have the attribute are listed once, at ``apply``)
and warns once per patch (:class:`OwnCheckpointingWarning`), saying how to turn it off. The check
reads one attribute per such module per step; ``restore`` removes the hook.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

__all__ = ["OwnCheckpointingWarning", "watch"]


class OwnCheckpointingWarning(UserWarning):
    """The model's own gradient checkpointing runs inside an autoremat plan (module docstring)."""


class _Watch:
    """The forward pre-hook :func:`watch` installs (a class, so a patched model pickles)."""

    def __init__(self, flagged: list[tuple[str, nn.Module]]) -> None:
        self.flagged = flagged
        self.said = False

    def __call__(self, module: nn.Module, _args: Any) -> None:
        if self.said or not (module.training and torch.is_grad_enabled()):
            return
        on = [name or type(module).__name__ for name, m in self.flagged if m.gradient_checkpointing is True]
        if on:
            self.said = True
            warnings.warn(
                f"autoremat: {type(module).__name__} has its own gradient checkpointing on ({', '.join(on[:3])}"
                f"{', ...' if len(on) > 3 else ''}), turned on after autoremat.apply (model.gradient_checkpointing_enable(), "
                "or TrainingArguments(gradient_checkpointing=True), which the Trainer applies when training starts). "
                "The step stays exact but recomputes twice for no memory (a 4-layer GPT-2: +8.6 % step time, the same "
                "peak): call model.gradient_checkpointing_disable() and leave TrainingArguments(gradient_checkpointing="
                "False); autoremat's plan replaces it", OwnCheckpointingWarning, stacklevel=2)


def watch(model: nn.Module, hooks: list[Any]) -> None:
    """Warn once when a training step of ``model`` (patched) runs with Hugging Face's gradient
    checkpointing on; the hook's handle goes to ``hooks`` (removed by ``restore``)."""
    flagged = [(name, m) for name, m in model.named_modules() if isinstance(getattr(m, "gradient_checkpointing", None), bool)]
    if flagged:
        hooks.append(model.register_forward_pre_hook(_Watch(flagged)))
