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

:func:`record_seeds` measures the seed itself: the storage bytes of the gradient the loss's
autograd nodes hand each output (``grad_seed_bytes``; an expanded scalar for ``out.sum()``, see
:mod:`autoremat._graph_rules`). A hook on the autograd node that hands it (its ``grad_inputs``)
reads the seed before anything is added to it; a hook on the output tensor would see the sum.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch.utils.hooks import RemovableHandle

from .._graph_rules import grad_bytes_of

import torch

__all__ = ["outputs_fed_by_loss", "record_seeds", "seed_bytes", "seed_only_what_the_loss_reads"]


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


def record_seeds(nodes: Sequence[Any], loss: torch.Tensor, producers: Mapping[Any, set[int]]) -> list[RemovableHandle]:
    """Hook the loss's autograd nodes so that backward sets ``grad_seed_bytes`` on the record in
    ``nodes`` of each output the loss seeds, where the seed's storage is smaller than its
    ``out_bytes``. Left ``None`` (``out_bytes``): an autograd node that makes several outputs, an
    output the loss hands more than one gradient (their sum is a new dense tensor), and a tensor
    that is not all of its node's output (one of a module's several, a part of a view). Returns
    the hooks' handles (remove them after backward)."""
    edges: dict[Any, list[tuple[Any, int]]] = {}  # an output's autograd node -> (loss node, input index)
    start = loss.grad_fn
    seen = {start} if start is not None else set()
    stack = [start] if start is not None else []
    while stack:
        fn = stack.pop()
        for i, (nxt, _) in enumerate(fn.next_functions):
            if nxt in producers:
                edges.setdefault(nxt, []).append((fn, i))
            elif nxt is not None and nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    wanted: dict[Any, list[tuple[int, int]]] = {}  # loss node -> (input index, graph node)
    for out_fn, into in edges.items():
        if len(into) == 1 and len(producers[out_fn]) == 1:
            fn, i = into[0]
            wanted.setdefault(fn, []).append((i, next(iter(producers[out_fn]))))
    return [fn.register_hook(_seed_hook(nodes, todo)) for fn, todo in wanted.items()]


def _seed_hook(nodes: Sequence[Any], todo: list[tuple[int, int]]) -> Any:
    def hook(grad_inputs: tuple, _grad_outputs: tuple) -> None:
        for i, v in todo:
            g = grad_inputs[i]
            if g is not None and g.numel() * g.element_size() == nodes[v].out_bytes:  # all of v's output
                nbytes = int(g.untyped_storage().nbytes())
                nodes[v].grad_seed_bytes = nbytes if nbytes < nodes[v].out_bytes else None
    return hook


def seed_bytes(nodes: Sequence[Any], succs: Mapping[int, Sequence[int]], v: int) -> int:
    """:meth:`autoremat.graph.Graph.grad_bytes` of record ``v`` of ``nodes`` (``succs``: the
    records' successors): what the cost model allocates for an output at the loss."""
    r = nodes[v]
    return grad_bytes_of(r.out_bytes, r.grad_seed_bytes, is_output=r.is_output, passthrough=r.grad_passthrough,
                         read_with_grad=any(nodes[w].requires_grad for w in succs.get(v, ())))
