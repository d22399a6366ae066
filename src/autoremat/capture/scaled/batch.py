"""The batch of an example input: its size, and the same inputs cut to fewer rows."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .._recorder import tensors_in

__all__ = ["batch_size_of", "map_batch", "cut_rows", "cut_bytes_per_row", "input_bytes"]


def batch_size_of(args: Sequence[Any], kwargs: Mapping[str, Any], batch_dim: int = 0) -> int:
    """The batch size: dimension ``batch_dim`` of the first input tensor that has it."""
    for t in tensors_in((tuple(args), dict(kwargs))):
        if t.dim() > batch_dim:
            return int(t.shape[batch_dim])
    raise ValueError(f"no input tensor has a batch dimension {batch_dim}; pass batch_dim= the dimension "
                     "that holds the batch")


def map_batch(obj: Any, batch: int, batch_dim: int, fn: Callable[[torch.Tensor, bool], torch.Tensor]) -> Any:
    """``obj`` with every tensor ``t`` replaced by ``fn(t, batched)``; ``batched`` says whether
    dimension ``batch_dim`` of ``t`` holds the batch (has size ``batch``)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj, obj.dim() > batch_dim and obj.shape[batch_dim] == batch)
    if isinstance(obj, Mapping):
        return {k: map_batch(v, batch, batch_dim, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_batch(v, batch, batch_dim, fn) for v in obj)
    return obj


def cut_rows(args: tuple, kwargs: dict, batch: int, size: int, batch_dim: int) -> tuple[tuple, dict]:
    """The inputs with their first ``size`` rows of the batch (copies, ``requires_grad`` kept)."""
    def cut(t: torch.Tensor, batched: bool) -> torch.Tensor:
        if not batched:
            return t
        # a copy, not a view: the recorder counts the storages of its inputs as resident
        return t.narrow(batch_dim, 0, size).clone().requires_grad_(t.requires_grad)
    return map_batch(args, batch, batch_dim, cut), map_batch(kwargs, batch, batch_dim, cut)


def cut_bytes_per_row(args: tuple, kwargs: dict, batch: int, batch_dim: int) -> float:
    """Bytes per row of the copies :func:`cut_rows` makes: while a cut batch runs, they are
    live beside the whole batch (the example inputs), so a size fits where its step peak plus
    ``size`` times this does."""
    seen: dict[int, float] = {}

    def note(t: torch.Tensor, batched: bool) -> torch.Tensor:
        if batched:
            seen[id(t)] = t.numel() * t.element_size() / batch
        return t
    map_batch((args, kwargs), batch, batch_dim, note)
    return sum(seen.values())


def input_bytes(args: tuple, kwargs: dict) -> int:
    """Bytes of the storages of the input tensors, as a capture counts them."""
    return int(sum(t.untyped_storage().nbytes() for t in tensors_in((args, kwargs))))
