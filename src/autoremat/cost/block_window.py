"""One block's option simulated only where it differs from the reference step: how
:func:`autoremat.cost.block_chain.profile_chain` prices the options of the ``blocks`` solver.

The chain model needs, for a block ``k`` under an option ``o`` (every other block stored: the
reference plan ``R``), the levels of ``k``'s forward, replay and backward, its replayed time, and
the largest and smallest difference to ``R`` at the events between ``k``'s forward and its
backward. A whole simulated step per option made pricing O(options x n): on a 64-layer GPT-2
captured op by op (4,307 nodes, 85 options) it was 8.4 s of the 9.4 s ``solve(auto, 50%)`` took
under cProfile; without the profiler ``profile_chain`` took 3.24 s and 6.27 s whole-step against
0.57 s and 0.80 s windowed, same terms (one process each, the shared 2-core machine at load ~4).
The window:

1. The two steps are the same up to ``k``'s forward, so the option's step starts from ``R``'s
   state there (a copy taken while ``R`` runs once, :class:`ReferenceWindows`).
2. After the forward of block ``k + 1`` the two states differ on a set ``D`` of storages (what
   the option holds differently: a region's inputs, outputs it no longer saves…). When no event
   after that point and before block ``k + 1``'s backward reads, saves, views or releases a storage
   of ``D`` — known from the graph: the forward reads and saves of the nodes after block ``k + 1``,
   the loss's saves and the outputs — every event in between is ``R``'s event plus the constant
   difference of the live bytes, so the option's state at block ``k + 1``'s backward is ``R``'s
   there with ``D``'s storages as the option holds them. The step goes on from there through
   ``k``'s backward and stops.
3. Otherwise (a storage of ``D`` used later, e.g. one every block reads and only a region keeps),
   or for the last block, the option's step runs on from ``k + 1`` (or ``k``) through the loss to
   ``k``'s backward.

The simulator's own functions run every simulated event (no second copy of the memory rules);
what is skipped in step 2 is provably ``R`` plus a constant. ``tests/cost/test_block_window.py``
holds the priced terms equal to those of whole simulated steps on seeded random block chains
(shared storages included) and on a Hugging Face capture. Cost per option: the events of blocks
``k`` and ``k + 1`` plus copying the live storages' ledger twice, instead of the whole step. Plans
that offload are not windowed (chain plans never do): :meth:`ReferenceWindows.price` refuses them.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from ..graph import Graph
from ..plan import Plan
from ..replay_tail import tails_of
from .ledger import StepState
from .simulator import StepLevels, _backward_segment, _forward, _loss, _okey, _step_of, step_levels

__all__ = ["ReferenceWindows", "OptionTerms"]


@dataclass(frozen=True)
class OptionTerms:
    """What the chain model reads of one block under one option (see the module docstring)."""

    fwd_peak: int
    bwd_peak: int
    held_max: int
    held_min: int
    extra_time_s: float
    windowed: bool
    """Whether step 2 skipped the events between block ``k + 1``'s forward and its backward."""


@dataclass
class _Ledger:
    size: dict[Hashable, int]
    refs: dict[Hashable, set[Hashable]]
    live: int
    gid: int
    grad: dict[int, Hashable]
    pgrad: set[str]
    pgrad_bytes: int


def _copy(s: StepState) -> _Ledger:
    return _Ledger(dict(s.size), {k: set(v) for k, v in s.refs.items()}, s.live, s._gid, dict(s.grad), set(s.pgrad),
                   s.pgrad_bytes)


def _state(graph: Graph, snap: _Ledger) -> tuple[StepState, dict[str, dict[int, int]]]:
    levels: dict[str, dict[int, int]] = {p: {} for p in ("fwd", "bwd", "recompute", "loss fwd", "loss bwd",
                                                         "prefetch", "after bwd", "pgrad after bwd")}
    s = StepState(graph, record=False, levels=levels)
    s.size, s.refs, s.live, s._gid = dict(snap.size), {k: set(v) for k, v in snap.refs.items()}, snap.live, snap.gid
    s.grad, s.pgrad, s.pgrad_bytes = dict(snap.grad), set(snap.pgrad), snap.pgrad_bytes
    return s, levels


def _first_segment_after(plan: Plan, bound: int) -> int:
    """Index of the first segment whose nodes all come after node ``bound`` (chain plans: blocks
    and gaps are contiguous ranges in order)."""
    return next((i for i, seg in enumerate(plan.segments) if min(seg.nodes) > bound), len(plan.segments))


class ReferenceWindows:
    """``R``'s step, run once, with copies of its state where the options of the blocks
    ``representatives`` start and where their windows jump (module docstring)."""

    def __init__(self, graph: Graph, reference: Plan, blocks: Sequence[Sequence[int]], representatives: Iterable[int]):
        self.graph, self.reference, self.blocks = graph, reference, blocks
        self._want: dict[tuple[str, int], list[tuple[str, int]]] = {}
        for k in set(representatives):
            self._want.setdefault(("fwd", _first_segment_after(reference, blocks[k][0] - 1)), []).append(("start", k))
            if k + 1 < len(blocks):
                c = _first_segment_after(reference, blocks[k + 1][-1]) - 1
                self._want.setdefault(("fwd end", c), []).append(("jump from", k))
                self._want.setdefault(("bwd", c), []).append(("jump to", k))
        self._snaps: dict[tuple[str, int], _Ledger] = {}
        self._nd = [graph.node(v) for v in graph.nodes]
        self._ok = [_okey(graph, v) for v in graph.nodes]
        self.levels: StepLevels = step_levels(graph, reference, at=self._at)
        self._last_use, self._loss_roots = _uses(graph)

    def _at(self, phase: str, si: int, s: StepState) -> None:
        for key in self._want.get((phase, si), ()):
            self._snaps[key] = _copy(s)

    def price(self, plan: Plan, k: int) -> OptionTerms:
        """The chain terms of ``plan``: ``R`` with block ``k``'s segments replaced."""
        if plan.offload:
            raise ValueError("ReferenceWindows prices plans without offload only (chain plans)")
        g, ref = self.graph, self.levels
        s, levels = _state(g, self._snaps[("start", k)])
        st = _step_of(g, plan, s, None, nd=self._nd, ok=self._ok)
        start = _first_segment_after(plan, self.blocks[k][0] - 1)
        inputs: dict[int, set[int]] = {}
        end = len(plan.segments)
        jump = ("jump from", k) in self._snaps
        last = _first_segment_after(plan, self.blocks[k + 1][-1]) - 1 if jump else end - 1
        for si in range(start, last + 1):
            inputs[si] = _forward(s, st, si, plan.segments[si])
        delta = None
        if jump:
            snap = self._snaps[("jump from", k)]
            differ = _differing(s, snap)
            own = _Own(self.blocks[k], range(start, _first_segment_after(plan, self.blocks[k][-1])),
                       self.blocks[k + 1][-1])
            held = {key for key in differ if own.holds_both(key, s, snap)}
            jump = self._unused(differ - held, self.blocks[k + 1][-1])
            if jump:
                delta, mine = s.live - snap.live, s
                s = _patched(g, self._snaps[("jump to", k)], mine, snap, differ - held, levels)
                for key in held:  # the window's holders as R's, block k's as the option's
                    s.refs[key] = {h for h in s.refs[key] if not own(h)} | {h for h in mine.refs[key] if own(h)}
                st = _step_of(g, plan, s, None, nd=self._nd, ok=self._ok)
        if not jump:
            for si in range(last + 1, end):
                inputs[si] = _forward(s, st, si, plan.segments[si])
            _loss(s, st)
            last = end - 1
        st.off.start_backward()
        tails = tails_of(plan)
        param_bytes: dict[str, int] = g.meta.get("param_bytes", {})
        extra = 0.0
        for si in range(last, start - 1, -1):
            extra += _backward_segment(s, st, si, inputs[si], tails.get(si), param_bytes)
        nodes = self.blocks[k]
        after = range(nodes[-1] + 1, (self.blocks[k + 1][-1] if delta is not None else len(g) - 1) + 1)
        diffs = [delta] if delta is not None else [levels["loss fwd"][-1] - ref.loss_fwd_touch,
                                                   levels["loss bwd"][-1] - ref.loss_bwd_touch]
        for phase, rtouch in (("fwd", ref.fwd_touch), ("bwd", ref.bwd_touch)):
            mine = levels[phase]
            diffs.extend(mine[v] - rtouch[v] for v in after if rtouch[v] is not None and mine.get(v) is not None)
        fwd = max((levels["fwd"][v] for v in nodes if v in levels["fwd"]), default=0)
        bwd = max((levels[p][v] for p in ("bwd", "recompute") for v in nodes if v in levels[p]), default=0)
        return OptionTerms(fwd, bwd, max(diffs), min(diffs), float(extra + st.off.stall_s), delta is not None)

    def _unused(self, differ: set[Hashable], bound: int) -> bool:
        """Whether no event after node ``bound``'s forward and before its backward touches ``differ``."""
        for key in differ:
            kind = key[0] if isinstance(key, tuple) and key else None
            if kind in ("x", "kx") and isinstance(key[1], int) and key[1] <= bound:  # a node's extras, to its backward
                continue
            if kind == "o" and self._last_use.get(key[1], -1) <= bound and key[1] not in self._loss_roots:
                continue
            return False
        return True


def _uses(graph: Graph) -> tuple[dict[int, int], set[int]]:
    """Per storage root, the last node whose forward reads, views or saves it; the roots the loss
    reads (its saves and the outputs) or the returned object holds until it."""
    last: dict[int, int] = {}
    for w in graph.nodes:
        d = graph.node(w)
        for u in (*graph.pred(w), *d["saves"], w):
            r = graph.root(u)
            last[r] = max(last.get(r, -1), w)
    loss = {graph.root(u) for u in graph.meta.get("loss_saves", ())}
    loss |= graph.held_roots()
    return last, loss


class _Own:
    """Block ``k``'s holders in the option and in ``R``: the saves and kept outputs of its nodes and
    the inputs of its recomputed segments (``segments``: the option's), which both plans release in
    its backward; ``bound``: block ``k + 1``'s last node, the window's end."""

    def __init__(self, nodes: Sequence[int], segments: range, bound: int) -> None:
        self.nodes, self.segments, self.bound = frozenset(nodes), segments, bound

    def __call__(self, h: Hashable) -> bool:
        if not isinstance(h, tuple) or len(h) != 2:
            return False
        kind, x = h
        return (kind in ("s", "keep") and x in self.nodes) or (kind == "seg" and x in self.segments)

    def _lasts(self, h: Hashable) -> bool:
        """A holder released only in the backward of a node up to ``bound`` (after the window)."""
        if not isinstance(h, tuple) or len(h) != 2 or not isinstance(h[1], int):
            return False
        kind, x = h
        return (kind in ("s", "keep") and x <= self.bound) or (kind == "seg" and x < self.segments.stop)

    def holds_both(self, key: Hashable, mine: StepState, ref: _Ledger) -> bool:
        """Whether the two steps hold storage ``key`` alike but for block ``k``'s holders, each by a
        holder lasting through the window: alive in both there, every other holder comes and goes as
        in ``R`` (a mask every block reads, which a recomputed block keeps as an input)."""
        if key not in mine.size or mine.size[key] != ref.size.get(key):
            return False
        a, b = mine.refs.get(key, set()), ref.refs.get(key, set())
        others = {h for h in a if not self(h)}
        return (others == {h for h in b if not self(h)} and any(map(self._lasts, a))
                and any(map(self._lasts, b)))


def _differing(s: StepState, snap: _Ledger) -> set[Hashable]:
    keys = set(s.size) | set(snap.size)
    return {k for k in keys if s.size.get(k) != snap.size.get(k) or s.refs.get(k) != snap.refs.get(k)}


def _patched(graph: Graph, to: _Ledger, mine: StepState, at: _Ledger, differ: set[Hashable],
             levels: dict[str, dict[int, int]]) -> StepState:
    """``R``'s state ``to`` with the storages ``differ`` as ``mine`` holds them (``at``: ``R``'s
    state where ``mine`` was taken, which ``to`` keeps for those storages)."""
    s, _ = _state(graph, to)
    s.levels = levels
    for key in differ:
        if key in at.size:
            assert s.size.get(key) == at.size[key] and s.refs.get(key) == at.refs[key], \
                f"storage {key} changed inside a skipped window, please report"
            s.live -= s.size.pop(key)
            del s.refs[key]
        else:
            assert key not in s.size, f"storage {key} made inside a skipped window, please report"
        if key in mine.size:
            s.size[key] = mine.size[key]
            s.refs[key] = set(mine.refs[key])
            s.live += mine.size[key]
    return s
