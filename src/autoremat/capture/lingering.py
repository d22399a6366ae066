"""Op outputs that Python keeps alive after their last consumer, inside a block captured op by op.

The cost model frees a node's output after its last forward consumer unless a node saves it for
backward (or it is a graph output). Eager model code holds intermediates in local variables until
they are reassigned or the function returns: Swin's attention keeps its fp32 scores-plus-bias and
the upcast inputs of its matmuls in locals to the end of its ``forward``. In fp32 autograd saves
most such tensors anyway, so nothing changes; under autocast it saves bf16 casts of them, and the
fp32 originals outlive their consumers for nothing the graph shows: a recomputed block's replay
measured 1.26x its prediction (Swin, bf16). :class:`Lingering` records, after each op of a block
call, which earlier ops of that call still have a live output, and at the end of the capture adds
the bytes of those the model would already have freed (last consumer earlier, saved by nobody, not
an output, not held by the returned object: :mod:`.held_outputs`) to the op's forward workspace
(``fwd_temp_bytes``), which the simulator counts while the op runs, in forward and in a replay alike.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Lingering"]


class Lingering:
    """Live outputs per op of the block call running (see the module docstring)."""

    def __init__(self) -> None:
        self.live: dict[int, int] = {}
        """Node -> number of its output storages alive."""
        self.seen: list[tuple[int, tuple[int, ...]]] = []
        """(op node, the earlier nodes of its block call with an output alive after it ran)."""
        self._call: list[int] = []

    def born(self, v: int) -> None:
        self.live[v] = self.live.get(v, 0) + 1

    def died(self, v: int) -> None:
        n = self.live.get(v, 0) - 1
        if n > 0:
            self.live[v] = n
        else:
            self.live.pop(v, None)

    def enter_call(self) -> None:
        self._call = []

    def after_op(self, v: int) -> None:
        """Op node ``v`` of the block call running has run."""
        self.seen.append((v, tuple(u for u in self._call if u in self.live)))
        self._call.append(v)

    def apply(self, rec: Any) -> None:
        """Add each op's lingering bytes to its ``fwd_temp_bytes`` (``rec``: the capture's recorder)."""
        nodes = rec.nodes
        last = {u: max(vs) for u, vs in rec.succs.items() if vs}
        for w in range(len(nodes)):  # a view's consumers read its root's storage
            root = rec.root(w)
            if w != root and w in last:
                last[root] = max(last.get(root, -1), last[w])
        saved = {u for r in nodes for u in r.saves} | set(rec.loss_saves)
        for v, alive in self.seen:
            extra = sum(nodes[u].alloc_bytes for u in alive
                        if last.get(u, u) < v and u not in saved and not nodes[u].is_output
                        and not nodes[u].held_by_output)
            if extra:
                nodes[v].fwd_temp_bytes += extra
