"""Which model outputs the loss reads: the outputs whose gradient the loss seeds.

A Hugging Face model given ``labels`` computes its loss inside ``forward`` and returns it beside
the logits; the user's loss function picks ``out.loss``. The logits are then an output that the
loss does not read: no gradient is seeded into them at the loss, theirs arrives through the
cross-entropy ops recorded as glue nodes, and the output object that holds them is dropped
before backward (as in :func:`autoremat.measure.run_step`). Capture therefore marks as graph
outputs (``is_output``: kept until the loss, gradient seeded there) only the outputs the loss
reaches directly. An output it does not reach is still held until the loss by the returned object,
without a gradient seed: capture marks it ``held_by_output`` when the object's drop frees it
(:mod:`.held_outputs`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["outputs_fed_by_loss", "seed_only_what_the_loss_reads"]


def outputs_fed_by_loss(loss: torch.Tensor, producers: Mapping[Any, set[int]]) -> set[int]:
    """The nodes of ``producers`` (autograd node of output tensors -> their graph nodes) that the
    loss's autograd graph reaches without passing through another output's autograd node."""
    fed: set[int] = set()
    start = loss.grad_fn
    if start is None:
        return fed
    seen = {start}
    stack = [start]
    while stack:
        fn = stack.pop()
        if fn in producers:
            fed.update(producers[fn])
            continue
        for nxt, _ in fn.next_functions:
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return fed


def seed_only_what_the_loss_reads(nodes: Sequence[Any], loss: torch.Tensor, producers: Mapping[Any, set[int]]) -> None:
    """Clear ``is_output`` on the records in ``nodes`` of the outputs in ``producers`` that the
    loss does not reach (:func:`outputs_fed_by_loss`): they get no gradient seed."""
    fed = outputs_fed_by_loss(loss, producers)
    for vs in producers.values():
        for v in vs - fed:
            nodes[v].is_output = False
