"""A graph as bitsets: the per-graph arrays every specialised Kusumoto model reads.

Lower sets are Python ints used as bitsets over the node ids (ids are a topological order).
:class:`GraphBits` reads a :class:`~autoremat.graph.Graph` once into plain lists and masks and
caches per-set quantities (boundary, what stays alive after a set, who reads a node from
outside it) that the exact model (:mod:`.segment_replay`), the closed form (:mod:`.closed_form`),
their bounds (:mod:`.backward_floor`, :mod:`.batch_pricing`) and the DP
(:mod:`autoremat.solvers.kusumoto`) use. It holds no rule of its own: each quantity is named
after the simulator's event it stands for (who holds a storage, whose gradient buffer a node
uses), and the models built on it are tested against :func:`autoremat.cost.simulate`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from ..graph import Graph
from ..replay_tail import takes_tails

__all__ = ["bits", "bit_list", "GraphBits", "SetInfo", "After"]


@dataclass(slots=True)
class SetInfo:
    """What a lower set ``L`` leaves for the rest of the step (:meth:`GraphBits.info`)."""

    boundary: int
    """``∂(L)``: nodes of ``L`` whose storage a node outside it reads (plus saved-by)."""
    alive: int
    """``R(L)``: storage roots alive in forward after ``L`` (its boundary, and what is held until
    the loss: its outputs and what the returned object holds)."""


@dataclass(slots=True)
class After:
    """What the backward of everything after a lower set leaves alive (:meth:`GraphBits.after`)."""

    grads: tuple[tuple[int, int], ...]
    """``(u, owner)`` for each node ``u`` of the set whose gradient buffer is alive (``owner``:
    the node whose buffer it shares, along pass-through chains), in increasing ``u``."""
    params: frozenset[str]
    """The parameters some node outside the set uses (their gradients are allocated)."""
    param_bytes: int
    """Their bytes."""
    viewed: frozenset[int] = frozenset()
    """Those of the ``grads`` whose gradient is still the first one and a view (``first_grad_view``:
    the simulator's :attr:`~.ledger.StepState.viewed`), so the next one is summed out of place."""


def bits(mask: int) -> Iterator[int]:
    """Indices of the set bits of ``mask``, lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


_BYTE_BITS = tuple(tuple(i for i in range(8) if b >> i & 1) for b in range(256))
_BYTE_AT = tuple(tuple(tuple(8 * k + i for i in _BYTE_BITS[b]) for b in range(256)) for k in range(64))
"""``_BYTE_AT[k][b]``: the bit indices of byte value ``b`` at byte ``k`` (masks of up to 512 bits)."""


def bit_list(mask: int) -> list[int]:
    """:func:`bits` as a list; decoded byte by byte from tables when there are many bits.

    A byte's bits come from a table (``_BYTE_AT`` below bit 512), so the work is one step per
    byte up to the highest bit plus the bits set: a segment of a few hundred nodes costs a few
    microseconds (the binary string decoded one character at a time cost 3-10x more, measured on
    431-bit masks, and was a quarter of ``auto``'s chain search on DenseNet-121)."""
    if mask.bit_count() <= 8:
        return list(bits(mask))
    out: list[int] = []
    at = _BYTE_AT
    for k, byte in enumerate(mask.to_bytes((mask.bit_length() + 7) // 8, "little")):
        if byte:
            if k < 64:
                out.extend(at[k][byte])
            else:
                out.extend([8 * k + i for i in _BYTE_BITS[byte]])
    return out


class GraphBits:
    """Per-graph arrays and bitsets the Kusumoto models and DP read (built once per search).

    ``tails``: the models built on it price a recomputed segment's replay up to its tail
    (:mod:`autoremat.replay_tail`), as the simulator runs a plan from :func:`autoremat.solve`,
    instead of up to its last saving node (the papers' ``T(Vi)``); on fx graphs only (the
    attribute ``tails`` is then true), where ``solve`` gives plans their tails."""

    def __init__(self, graph: Graph, tails: bool = False) -> None:
        n = len(graph)
        nd = [graph.node(v) for v in range(n)]
        meta = graph.meta
        self.n = n
        self.full = (1 << n) - 1
        self.succ = [tuple(graph.succ(v)) for v in range(n)]
        self.pred = [tuple(graph.pred(v)) for v in range(n)]
        self.root = [graph.root(v) for v in range(n)]
        self.alloc = [int(d["alloc_bytes"]) for d in nd]
        self.out = [graph.grad_bytes(v) for v in range(n)]  # its gradient's bytes (Graph.grad_bytes)
        self.rg = [bool(d["requires_grad"]) for d in nd]
        self.passthru = [bool(d["grad_passthrough"]) for d in nd]
        self.grad_new = [frozenset(d["grad_new"]) for d in nd]  # inputs a pass-through still gives a new one
        # inputs read through a split's view, whose gradient is the view's size (the simulator's
        # grad_part; the replay and closed-form models give them the whole input's, the floors the part's)
        self.part = [dict(d["grad_part"]) for d in nd]
        self.is_out = [bool(d["is_output"]) for d in nd]  # the loss seeds its gradient
        # its first gradient a view (.grad_handoff; an output's is the loss's seed, priced dense)
        self.first_view = [bool(d["first_grad_view"]) and not d["is_output"] for d in nd]
        self.held = [graph.held_to_loss(v) for v in range(n)]  # its storage is held until the loss
        self.held_end = graph.held_to_end()  # ... and to the end of backward (meta["output_kept"] "step")
        self.saves = [tuple(d["saves"]) for d in nd]
        self.extra = [int(d["extra_saved_bytes"]) for d in nd]
        self.ftemp = [int(d["fwd_temp_bytes"]) for d in nd]
        self.btemp = [int(d["bwd_temp_bytes"]) for d in nd]
        self.time = [float(d["time_s"]) for d in nd]
        self.recomputable = [bool(d["recomputable"]) for d in nd]
        self.kind = [d["kind"] for d in nd]
        # price a recomputed segment's replay as the plan runs it: without its tail (an fx graph's
        # plan from autoremat.solve has them; autoremat.replay_tail), not up to its last saving node
        self.tails = tails and takes_tails(graph)
        # the simulator's replay stops at the last node holding something for backward
        self.holder = [bool((d["saves"] or d["extra_saved_bytes"]) and d["requires_grad"]) for d in nd]
        # segments_from_lower_sets recomputes a segment when one of its nodes saves bytes
        self.saver = [int(d["saved_bytes"]) > 0 for d in nd]
        self.module_mode = meta.get("mode") == "module"
        param_bytes: dict[str, int] = meta.get("param_bytes", {})
        self.params = [tuple((p, int(param_bytes[p])) for p in d["params"] if p in param_bytes) for d in nd]
        users: dict[str, int] = {}
        for v in range(n):
            for p, _ in self.params[v]:
                users[p] = users.get(p, 0) | (1 << v)
        self.param_users = users
        self.param_size = {p: int(param_bytes[p]) for p in users}
        self.loss_saves = tuple(int(u) for u in meta.get("loss_saves", ()))
        self.loss_extra = int(meta.get("loss_extra_bytes", 0))
        self.loss_ftemp = int(meta.get("loss_fwd_temp_bytes", 0))
        self.loss_btemp = int(meta.get("loss_bwd_temp_bytes", 0))
        self.loss_held = int(meta.get("loss_held_bytes", 0))  # the loss tensor: from the loss to the step's end
        self.alias_of = [d["alias_of"] for d in nd]
        self._info: dict[int, SetInfo] = {}
        self._nbytes: dict[int, int] = {}
        self._bsucc: dict[int, tuple[tuple[int, int], ...]] = {}
        self._touched: dict[tuple[int, int], int] = {}
        self._beyond: dict[int, bytes] = {}
        self._after: dict[int, After] = {}
        self._masks()
        self._sweeps()

    def _masks(self) -> None:
        """The bitsets over nodes derived from the node arrays (who reads a storage, which nodes
        hold, save, are outputs or views; the roots each node saves; shared gradient buffers)."""
        n = self.n
        bit = [1 << v for v in range(n)]
        self.bit = bit
        self.succmask = [sum(bit[w] for w in self.succ[v]) for v in range(n)]
        self.predmask = [sum(bit[u] for u in self.pred[v]) for v in range(n)]
        # need[u]: nodes that read u's storage after u ran (successors, and nodes saving it)
        need = list(self.succmask)
        for x in range(n):
            for u in self.saves[x]:
                if u != x:
                    need[u] |= bit[x]
        self.need = need
        self.out_mask = sum(bit[v] for v in range(n) if self.is_out[v])
        self.held_mask = sum(bit[v] for v in range(n) if self.held[v])
        # storages the returned object holds to the end of backward (Graph.held_to_end)
        self.end_mask = sum(bit[r] for r in {self.root[v] for v in self.held_end})
        self.view_mask = sum(bit[v] for v in range(n) if self.root[v] != v)
        # whole_givers[u]: the nodes whose backward hands u a whole gradient (a part is joined later)
        has_grad = [False] * n
        for v in range(n - 1, -1, -1):
            has_grad[v] = self.rg[v] and (self.is_out[v] or any(has_grad[w] for w in self.succ[v]))
        self.whole_givers = [sum(bit[w] for w in self.succ[u] if has_grad[w] and u not in self.part[w])
                             if self.rg[u] else 0 for u in range(n)]
        self.members: list[tuple[int, ...]] = [() for _ in range(n)]  # nodes living in root r's storage
        tmp: dict[int, list[int]] = {}
        for v in range(n):
            tmp.setdefault(self.root[v], []).append(v)
        for r, vs in tmp.items():
            self.members[r] = tuple(vs)
        self.holder_mask = sum(bit[v] for v in range(n) if self.holder[v])
        self.saver_mask = sum(bit[v] for v in range(n) if self.saver[v])
        self.nonrecomp_mask = sum(bit[v] for v in range(n) if not self.recomputable[v])
        # the nodes that save each node for their backward; those with saved extras (replay tails)
        self.saved_by = [0] * n
        for x in range(n):
            if self.rg[x]:
                for u in set(self.saves[x]):
                    self.saved_by[u] |= bit[x]
        self.extra_mask = sum(bit[v] for v in range(n) if self.rg[v] and self.extra[v])
        # the roots of the storages each node saves
        self.saves_roots = [0] * n
        for x in range(n):
            for u in self.saves[x]:
                self.saves_roots[x] |= bit[self.root[u]]
        # whose gradient buffer a node holds when its backward runs (pass-through chains share)
        owner = list(range(n))
        for v in range(n - 1, -1, -1):
            w = self.succ[v][0] if len(self.succ[v]) == 1 else -1
            if not self.is_out[v] and w >= 0 and self.passthru[w] and v not in self.grad_new[w]:
                owner[v] = owner[self.succ[v][0]]
        self.buf_owner = owner
        # integer node times (the papers' convention, integer test times) with few distinct
        # values: a sum of times over a set is exact in any order, so it is counted by value
        values: dict[int, int] = {}
        if all(t == int(t) and 0 <= t < 2 ** 40 for t in self.time):
            for v in range(n):
                values[int(self.time[v])] = values.get(int(self.time[v]), 0) | bit[v]
        self.time_groups = tuple(values.items()) if 0 < len(values) <= 16 else None
        # roots of the views each node saves (a view's root may lie before the view's segment)
        self.view_saves_roots = [0] * n
        for x in range(n):
            for u in self.saves[x]:
                if self.root[u] != u:
                    self.view_saves_roots[x] |= bit[self.root[u]]
        self.view_saver_mask = sum(bit[x] for x in range(n) if self.view_saves_roots[x])
        self.rg_mask = sum(bit[v] for v in range(n) if self.rg[v])

    # -------------------------------------------------------------- set helpers
    def roots(self, mask: int) -> int:
        """Storage roots of the nodes in ``mask``."""
        views = mask & self.view_mask
        out = mask & ~self.view_mask
        for v in bits(views):
            out |= self.bit[self.root[v]]
        return out

    def nbytes(self, root_mask: int) -> int:
        """Bytes of the storages whose roots are in ``root_mask`` (cached: the DP asks about a
        few masks millions of times)."""
        got = self._nbytes.get(root_mask)
        if got is None:
            alloc = self.alloc
            got = self._nbytes[root_mask] = sum(map(alloc.__getitem__, bit_list(root_mask)))
        return got

    def boundary_succ(self, lower: int) -> tuple[tuple[int, int], ...]:
        """``(u, successors of u)`` for the nodes ``u`` of ``∂(L)`` (cached per set)."""
        got = self._bsucc.get(lower)
        if got is None:
            succ = self.succmask
            got = self._bsucc[lower] = tuple((u, succ[u]) for u in bits(self.info(lower).boundary))
        return got

    def recompute_flag(self, lower: int, upper: int) -> bool:
        """Whether :func:`segments_from_lower_sets` recomputes the segment ``upper \\ lower``."""
        if upper == self.full:
            return False
        seg = upper & ~lower
        if not seg & self.saver_mask or seg & self.nonrecomp_mask:
            return False
        return not self.module_mode or seg & (seg - 1) == 0

    def touched(self, lower: int, upper: int) -> int:
        """Roots of ``lower`` that the segment ``upper \\ lower`` reads or saves (cached).

        Such a node of ``lower`` is read from outside it, so it is in the boundary ``∂(L)``
        (usually a few nodes, where the segment may be long); a view of ``S`` that ``S`` saves
        adds its root directly.
        """
        if upper == self.full:
            return self.roots(lower)
        key = (lower, upper)
        got = self._touched.get(key)
        if got is None:
            seg = upper & ~lower
            need = self.need
            out = 0
            for u in bits(self.info(lower).boundary):
                if need[u] & seg:
                    out |= 1 << u
            got = self.roots(out)
            for x in bits(seg & self.view_saver_mask):
                got |= self.view_saves_roots[x] & lower
            self._touched[key] = got
        return got

    def info(self, lower: int) -> SetInfo:
        """``(∂(L), R(L))``: boundary nodes, and roots alive in forward after ``L`` (boundary, and
        what is held until the loss)."""
        got = self._info.get(lower)
        if got is None:
            bnd = self.boundary(lower)
            got = self._info[lower] = SetInfo(bnd, self.roots(bnd | (self.held_mask & lower)))
        return got

    def after(self, upper: int) -> After:
        """What the backward of everything after ``upper`` leaves alive (cached per set).

        ``(grads, params, param_bytes)``: ``(u, owner)`` for each node of ``upper`` whose gradient
        buffer is alive (it has a reader outside ``upper`` or is an output; ``owner`` is the node
        whose buffer it shares, pass-through chains), in increasing ``u``; the parameters some node
        outside ``upper`` uses, and their bytes.
        """
        got = self._after.get(upper)
        if got is None:
            outside = ~upper
            grads = []
            cand = (self.boundary(upper) | (self.out_mask & upper)) if upper else 0
            for u in bits(cand):
                if not self.rg[u]:
                    continue
                out_succ = self.succmask[u] & outside
                if not out_succ and not self.is_out[u]:
                    continue
                owner = u
                if not self.is_out[u] and out_succ & (out_succ - 1) == 0:
                    w = out_succ.bit_length() - 1
                    if self.passthru[w] and u not in self.grad_new[w]:
                        owner = self.buf_owner[w]
                grads.append((u, owner))
            params = frozenset(q for q, users in self.param_users.items() if users & outside)
            viewed = frozenset(u for u, _ in grads if self.first_view[u]  # (never an output's)
                               and (self.whole_givers[u] & outside).bit_count() == 1)
            got = self._after[upper] = After(tuple(grads), params, sum(self.param_size[q] for q in params), viewed)
        return got

    def beyond_flags(self, upper: int) -> bytes:
        """``flags[u]`` is 1 when a node outside ``upper`` reads ``u``'s storage (cached per set)."""
        got = self._beyond.get(upper)
        if got is None:
            flags = bytearray(self.n)
            outside = ~upper
            for u, needed in enumerate(self.need):
                if needed & outside:
                    flags[u] = 1
            got = self._beyond[upper] = bytes(flags)
        return got

    def boundary(self, lower: int) -> int:
        """Nodes of ``lower`` whose storage a node outside it reads (``∂(L)``, plus saved-by)."""
        if not lower:
            return 0
        hi = lower.bit_length() - 1
        out = self.open_at[hi] & lower
        reads = self.reads
        for w in bits(((1 << (hi + 1)) - 1) & ~lower):
            out |= reads[w] & lower
        return out

    def _sweeps(self) -> None:
        """``open_at[h]``: nodes ``u <= h`` read by some node after ``h`` (for :meth:`boundary`)."""
        n = self.n
        reads = [0] * n
        last = [-1] * n
        for u in range(n):
            for w in bits(self.need[u]):
                reads[w] |= self.bit[u]
            last[u] = self.need[u].bit_length() - 1
        closing = [0] * n
        for u in range(n):
            if last[u] > u:
                closing[last[u]] |= self.bit[u]
        open_at = [0] * n
        cur = 0
        for h in range(n):
            if last[h] > h:
                cur |= self.bit[h]
            cur &= ~closing[h]
            open_at[h] = cur
        self.reads = reads
        self.open_at = open_at
