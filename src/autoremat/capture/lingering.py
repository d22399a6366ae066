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
(``fwd_temp_bytes``), which the simulator counts while the op runs, and lists them by the node that
made them (``lingering``).

Not only the block call's own ops linger: a caller's frame holds what it passed to a module call until
the call returns. diffusers' ``UNet2DModel`` hands an up block its input (``sample``, the previous up
block's upsampler output), the block concatenates it with a skip and runs its ResNet blocks, and the
UNet's frame keeps ``sample`` alive all the while: the unpatched step peak was predicted 2.2 % under
the measured one. So an op output counts while it is alive after its last reader, wherever it was made,
up to its death in the forward. An output that outlives the forward is held by something the graph
models otherwise (autocast's cache of weight casts, freed when the autocast region exits), or by a
local to the end of its block call: it counts to the end of the call that made it; an output a node
no gradient reaches made (:mod:`.dead_nodes`) counts to the end of the forward, since no save
models what holds it (autocast's weight casts in Encodec's encoder under bf16: its unpatched step
was predicted 0.987x the measured peak with the end of the call, 1.0006x with the forward's). Glue ops and module
calls between the block calls carry lingering bytes too (a module call those alive when it starts):
SegFormer's decode head keeps its upsampled maps in a list under the calls that follow, and its
unpatched step was predicted 0.952x the measured peak without them.

Lingering bytes are the unpatched step's: a plan can hold the same storage for its own reasons (a
recomputed region keeps its inputs), and a replay runs only the region's calls, so what a caller's
frame held in forward is gone from it (the embeddings GPT-2's model frame keeps through its forward;
the block input the frame of the block holds while its attention runs, which a replay of the
attention keeps as the region's input anyway). The simulator therefore counts a maker's lingering
bytes only where its storage is not otherwise held and, in a replay, only where the replay makes it
again (:mod:`autoremat.cost.simulator`). Measured (CPU, peft LoRA on GPT-2 under bf16 autocast, the
least-budget plan): without that rule the prediction was 8.8 % above the measured peak.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection
from typing import Any

__all__ = ["Lingering"]


class Lingering:
    """Live outputs per op of the block calls (see the module docstring)."""

    def __init__(self, *, on: bool = True) -> None:
        self.on = on
        """Off: nothing is recorded (a capture without blocks captured op by op)."""
        self.live: dict[int, dict[int, int]] = {}
        """Node -> its output storages alive (key -> bytes)."""
        self.made: dict[int, int] = {}
        """Node -> the bytes of all its output storages (its own saved ones too: layer norm's statistics)."""
        self.deaths: dict[int, list[tuple[int, int]]] = {}
        """Node -> (the number of nodes of :attr:`ops` that had run when one of its storages died, its bytes)."""
        self.ops: list[int] = []
        """The nodes in the order they ran (ascending: nodes are numbered in execution order): the
        block ops, and the glue ops and module calls of the forward between them."""
        self.call_end: dict[int, int] = {}
        """Block op -> the number of block ops run when its call ended (set as the next call starts)."""
        self._call: list[int] = []
        self.closed = False
        """The forward is over: a storage that dies now outlived it."""
        self.outlived: set[int] = set()
        """The nodes with a storage still alive when the forward ended (set by :meth:`close`)."""

    def owned(self, v: int, storage: Any, prev: int | None) -> None:
        """Node ``v`` made ``storage`` (an in-place op takes it over from ``prev``)."""
        if not self.on:
            return
        if prev is not None and prev != v:
            self.died(prev, storage._cdata)
        self.born(v, storage._cdata, storage.nbytes())

    def born(self, v: int, key: int, nbytes: int) -> None:
        mine = self.live.setdefault(v, {})
        if key not in mine:
            mine[key] = nbytes
            self.made[v] = self.made.get(v, 0) + nbytes

    def died(self, v: int, key: int) -> None:
        nbytes = self.live.get(v, {}).pop(key, None) if self.on else None
        if nbytes is not None and not self.closed:
            self.deaths.setdefault(v, []).append((len(self.ops), nbytes))

    def enter_call(self) -> None:
        """A block call starts (its ops are recorded by :meth:`after_op` as they run)."""
        self.close_call()

    def close_call(self) -> None:
        for u in self._call:
            self.call_end[u] = len(self.ops)
        self._call = []

    def close(self) -> None:
        """The forward (and the loss) is over."""
        self.close_call()
        self.closed = True
        self.outlived = {v for v, mine in self.live.items() if mine}

    def after_op(self, v: int) -> None:
        """Op node ``v`` of a block call has run."""
        self.ops.append(v)
        self._call.append(v)

    def outside_call(self, v: int) -> None:
        """Node ``v`` outside the block calls: a glue op that has run, or a module call that starts
        (what is alive when it starts counts for all of it: its measured workspace is relative to the
        level then, including what dies during the call)."""
        if self.on and not self.closed:
            self.ops.append(v)

    def apply(self, rec: Any, unreached: Collection[int] = ()) -> None:
        """Add each op's lingering bytes to its ``fwd_temp_bytes`` and list them by maker in its
        ``lingering`` (``rec``: the capture's recorder; ``unreached``: the nodes no gradient reaches,
        :mod:`.dead_nodes`, whose own saved storages linger too: no backward holds them)."""
        nodes = rec.nodes
        last = {u: max(vs) for u, vs in rec.succs.items() if vs}
        for w in range(len(nodes)):  # a view's consumers read its root's storage
            root = rec.root(w)
            if w != root and w in last:
                last[root] = max(last.get(root, -1), last[w])
        # storages saved for backward or held by the output, also through a view or an in-place write
        kept = {rec.root(u) for r in nodes for u in r.saves} | {rec.root(u) for u in rec.loss_saves}
        kept |= {rec.root(u) for u, r in enumerate(nodes) if r.is_output or r.held_by_output}
        for u, r in enumerate(nodes):
            if u in kept or not r.alloc_bytes or u not in self.made:
                continue
            own = 0 if u in unreached else self.made[u] - r.alloc_bytes  # its own saved storages: extra_saved_bytes
            at = bisect.bisect_right(self.ops, last.get(u, u))  # the first block op after its last reader
            end = len(self.ops) if u in unreached else self.call_end.get(u, at)  # what outlives the forward: to the end of its call
            deaths = list(self.deaths.get(u, ()))
            if (dead := sum(nbytes for _, nbytes in deaths)) < self.made[u]:
                deaths.append((max(at, end), self.made[u] - dead))
            deaths.sort()
            alive = self.made[u] - sum(nbytes for pos, nbytes in deaths if pos <= at)
            steps = [(at, max(0, alive - own))]  # (first block op position, bytes lingering from there)
            for pos, nbytes in deaths:  # a storage alive after op i: it died after i + 1 ops had run
                if pos > at:
                    alive -= nbytes
                    steps.append((pos, max(0, alive - own)))
            for (start, level), (stop, _) in zip(steps, steps[1:]):
                for v in self.ops[start:stop] if level else ():
                    nodes[v].fwd_temp_bytes += level
                    nodes[v].lingering.append((u, level))
