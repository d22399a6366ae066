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

:class:`SeedMeter` measures the seed itself: the storage bytes of the gradient the loss's
autograd nodes hand each output (``grad_seed_bytes``; an expanded scalar for ``out.sum()``, see
:mod:`autoremat._graph_rules`). A hook on the autograd node that hands it (its ``grad_inputs``)
reads the seed before anything is added to it; a hook on the output tensor would see the sum.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .._graph_rules import grad_bytes_of

__all__ = ["SeedMeter", "outputs_fed_by_loss", "seed_bytes", "seed_only_what_the_loss_reads"]


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


class SeedMeter:
    """Measures the seed the loss hands each output (``grad_seed_bytes`` on the records in
    ``nodes``): built after the loss, before backward, it hooks the loss's autograd nodes that hand
    a gradient to an output tensor (``producers``: their autograd nodes -> graph nodes); call
    :meth:`close` after backward. A node's seed is the sum over its output tensors the loss hands
    a gradient: the storage bytes of that gradient, or the tensor's bytes where the loss hands it
    several (their sum is a new dense tensor); set where smaller than ``out_bytes``. Left ``None``
    (``out_bytes``): the nodes of an autograd node that makes the tensors of several nodes."""

    def __init__(self, nodes: Sequence[Any], loss: torch.Tensor, producers: Mapping[Any, set[int]]) -> None:
        self.nodes = nodes
        self.handed: dict[tuple[int, int], int] = {}  # (id of output's autograd node, output index) -> bytes
        edges: dict[tuple[int, int], list[tuple[Any, int]]] = {}  # ... -> (loss node, input index)
        fns = {id(fn): fn for fn in producers}  # ids as keys: the meter holds no autograd node
        start = loss.grad_fn
        seen = {start} if start is not None else set()
        stack = [start] if start is not None else []
        while stack:
            fn = stack.pop()
            for i, (nxt, nr) in enumerate(fn.next_functions):
                if nxt in producers:
                    edges.setdefault((id(nxt), nr), []).append((fn, i))
                elif nxt is not None and nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        self.of: dict[int, list[tuple[int, int]]] = {}  # graph node -> its tensors' keys
        self.unknown: set[int] = set()
        wanted: dict[Any, list[tuple[int, tuple[int, int], bool]]] = {}  # loss node -> (input, key, summed)
        for key, into in edges.items():
            vs = producers[fns[key[0]]]
            if len(vs) > 1:
                self.unknown |= vs
                continue
            self.of.setdefault(next(iter(vs)), []).append(key)
            for fn, i in into:
                wanted.setdefault(fn, []).append((i, key, len(into) > 1))
        self.handles = [fn.register_hook(self._hook(todo)) for fn, todo in wanted.items()]

    def _hook(self, todo: list[tuple[int, tuple[int, int], bool]]) -> Callable[[tuple, tuple], None]:
        def hook(grad_inputs: tuple, _grad_outputs: tuple) -> None:
            for i, key, summed in todo:
                g = grad_inputs[i]
                if g is not None:
                    self.handed[key] = g.numel() * g.element_size() if summed else int(g.untyped_storage().nbytes())
        return hook

    def close(self) -> None:
        """Remove the hooks; set ``grad_seed_bytes`` from what backward handed."""
        for h in self.handles:
            h.remove()
        for v, keys in self.of.items():
            total = sum(self.handed.get(k, 0) for k in keys)
            if v not in self.unknown and total < self.nodes[v].out_bytes:
                self.nodes[v].grad_seed_bytes = total


def seed_bytes(nodes: Sequence[Any], succs: Mapping[int, Sequence[int]], v: int) -> int:
    """:meth:`autoremat.graph.Graph.grad_bytes` of record ``v`` of ``nodes`` (``succs``: the
    records' successors): what the cost model allocates for an output at the loss."""
    r = nodes[v]
    return grad_bytes_of(r.out_bytes, r.grad_seed_bytes, is_output=r.is_output, passthrough=r.grad_passthrough,
                         read_with_grad=any(nodes[w].requires_grad for w in succs.get(v, ())))
