"""The Kusumoto DP solvers as they were before the speed work (commit c114895), frozen as an oracle.

``test_kusumoto_fastpath.py`` checks that the optimised ``autoremat.solvers.kusumoto`` returns
the same plans, minimum budgets and costs as this implementation. Not collected for tests of its
own; do not edit (except imports) so that it stays the reference.


Problem: the general recomputation problem of [1]_ (§3). A plan is an increasing sequence of
lower sets ``L1 ⊂ … ⊂ Lk = V`` (a canonical strategy), run as the segments
:func:`~autoremat.plan.segments_from_lower_sets` builds from it. Time-centric
(``objective="time"``, the default): the least recomputation time whose step peak fits the
budget. Memory-centric (``objective="memory"``, §4.4): the most recomputation time at the least
budget the DP can meet (see below).

.. [1] M. Kusumoto, T. Inoue, G. Watanabe, T. Akiba, M. Koyama, "A Graph Theoretic Framework
   of Recomputation Algorithms for Memory-Efficient Backpropagation", NeurIPS 2019;
   Algorithm 1 (appendix A), §4.2-§4.4 and §5.1.

Algorithm (Algorithm 1 of [1]_). A table ``opt[(L, D)][t] = m`` over the lower sets ``L`` of a
family, kept as sparse dicts: the least kept bytes ``m`` over sequences ending in ``L`` with
recomputation time ``t`` whose every transition fits the budget. Transitions ``L -> L'`` go to
strict supersets in the family; entries dominated in ``(t, m)`` are dropped (§4.2). Lower sets
are integer bitsets. ``dp-exact`` runs on every lower set (§4.2); ``dp-approx`` on the pruned
family ``{L^v : v ∈ V} ∪ {∅, V}``, ``L^v`` = ``v`` and its ancestors (§4.3). The time-centric
table is filled as a label-setting search: recomputation time only grows along a sequence, so
labels are expanded in increasing ``t`` and the first label of ``V`` is the answer (same result as
filling the table; it only stops early; dp-exact also defers a transition's memory check until
its label is expanded). The memory-centric table picks the largest ``t`` (Algorithm 1 with max
for min).

Time quantum. Cells are indexed by ``floor(t / q)`` while each label carries its exact time
(rounding each transition instead makes short segments free). ``q`` is the nodes' common time
unit when ``T(V) / unit <= time_slots`` (then the DP is exact in time: paper times, integer test
times), else ``T(V) / time_slots``; ``time_slots`` (default 500) and ``time_quantum_s`` are
recorded in ``plan.options``.

Memory model. The step peak is the one :func:`autoremat.cost.simulate` predicts (eager
PyTorch, non-reentrant checkpoint), not the paper's ``M_v`` (every output kept, twice). Eq. (2)
becomes "kept bytes + the segment's own peak":

* ``dp-exact`` prices ``L -> L'`` by replaying the simulator's bookkeeping on ``S = L' \\ L``
  alone: the forward of ``S``; then, once everything after ``L'`` has run its backward, the
  gradients of ``∂(L')`` and of the outputs in ``L'`` (what node ``v``'s backward really keeps is
  the graph's ``saved_bytes``; boundary nodes cost their output storage), the parameter gradients
  of the nodes after ``L'``, the replay of ``S`` up to its last saving node and its backward. The
  state is ``m``, the bytes of ``L`` held for some later backward (the paper's ``M(U)``, restricted
  to what is held), plus ``D``, the *dangling* roots: boundary storages alive in forward that no
  backward holds yet (the paper charges them to ``M(U)`` at once; here a later segment that reads
  them makes them kept, one that does not lets them die). With this state the model equals the
  simulator on every graph we checked (random DAGs with views, extras, temporaries,
  parameters, non-recomputable nodes, module mode; the zoo's fx graphs), with two exceptions:
  a boundary node whose gradient arrives through a pass-through op (``add``, views) *and* other
  consumers may hold another buffer, which depends on the order later segments run backward (a
  forward DP cannot know it; the model assumes its own buffer); and the simulator's replay keeps
  a storage alive when a recomputed segment takes a view of its input (a quirk of the simulator,
  reported).
* ``dp-approx`` uses a closed form (:class:`_Closed`) so that a transition costs O(1): the state
  is the paper's ``M(U)`` (every boundary storage charged when its segment ends) and the segment's
  peak is a sparse-table range maximum, per run of consecutive node ids of ``S``, of "copies of the
  storages saved up to ``v`` + gradients whose last reader is at or after ``v`` + transients +
  parameter gradients". On the zoo graphs it is within 0-5% of the simulator on most sequences,
  more where ``M(U)`` keeps storages the simulator frees (up to ~30% on U-Net's skips), and it
  can be a few percent under.

Because the models are not the simulator, every plan is simulated: when its peak exceeds the
budget, the DP budget is lowered by the excess and the DP re-solved (``max_tightenings``, default
24); when that runs out, the plan found at the least DP budget is returned (it fits, see next).

Least budget (:func:`min_budget`). As in §5.1, a binary search over bytes on the DP's
feasibility finds the least DP budget ``B*`` (galloping up from 1/64 of the unoptimised need, by
x2 for dp-approx and x1.1 for dp-exact whose probes above the answer cost replays, then
alternating halving probes with probes one byte below the upper end, which a successful probe
lowers to its sequence's peak). The solver's minimum is the smaller of the unoptimised peak and
the simulated peak of the sequence found at ``B*``: a budget below it raises
:class:`~autoremat.errors.InfeasibleBudgetError` with it as ``min_budget_bytes``, and every
budget at or above it gets a plan. ``objective="memory"`` uses ``B*`` whatever the budget: it
returns the sequence with the most recomputation at ``B*`` when it simulates within the budget
(even if the budget would fit without recomputation: asking for memory-centric is asking for
the least memory), else the sequence found at ``B*``.

Complexity, with ``F`` the family size (``n + 2`` for dp-approx, up to ``2**n`` lower sets for
dp-exact) and ``Q`` the time slots: a DP run is O(F²) transitions times O(Q) labels, each
transition O(1) (closed form, plus its boundary) or O(|S| + edges of S) (replay, once per
transition and dangling set, cached); :func:`min_budget` adds O(log B) feasibility runs (about
15-50). Space O(F²) cached transitions plus O(Q·F) labels. Measured on one core with this
repository's zoo at paper size (fx capture, paper times): dp-approx, least budget included,
0.005-0.55 s up to 711 nodes (about twice that on a loaded machine); dp-exact's least budget
(loaded machine) 0.03 s (VGG19, 47 lower sets), ~10 s (ResNet50, 240; U-Net, 300), ~25 s
(DenseNet121, 432), ~70 s (ResNet152, 580), ~2.5 and ~4.7 min (DenseNet161 and 201, 572 and 712
lower sets over long segments). Beyond ``max_lower_sets`` (default 500) dp-exact falls back to
dp-approx with a warning (``fallback=False``: a ``ValueError``).

Exact / approximate: dp-exact is exact for the simulator's cost over all canonical strategies,
up to the two exceptions above and the time quantum; dp-approx is approximate (pruned family,
closed-form memory). Limitations: canonical strategies only (each node recomputed at most once,
no nesting, no offload). Module-level graphs run over the executable family: each transition is
priced as ``segments_from_lower_sets`` will run it (a segment of several module calls, or with a
non-recomputable node, runs plainly), so only single module calls are recomputed.

Options (``config``): ``objective`` (``"time"`` | ``"memory"``), ``time_slots`` (int),
``max_lower_sets`` (int, dp-exact), ``fallback`` (bool, dp-exact), ``max_tightenings`` (int);
other keys are ignored with a warning (``solve(solver="auto")`` passes one set to all solvers).
"""

from __future__ import annotations

import logging
import math
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from heapq import heappop, heappush
from typing import Any

from autoremat.errors import InfeasibleBudgetError
from autoremat.graph import Graph
from autoremat.plan import Plan, segments_from_lower_sets
from autoremat.cost import no_recompute_plan, simulate

__all__ = ["solve_dp_exact", "solve_dp_approx", "min_budget"]

logger = logging.getLogger("autoremat.solvers.kusumoto.reference")


def _bits(mask: int) -> Iterator[int]:
    """Indices of the set bits of ``mask``, lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class _Prep:
    """Per-graph arrays and bitsets the DP reads (built once per solve)."""

    def __init__(self, graph: Graph) -> None:
        n = len(graph)
        nd = [graph.node(v) for v in range(n)]
        meta = graph.meta
        self.n = n
        self.full = (1 << n) - 1
        self.succ = [tuple(graph.succ(v)) for v in range(n)]
        self.pred = [tuple(graph.pred(v)) for v in range(n)]
        self.root = [graph.root(v) for v in range(n)]
        self.alloc = [int(d["alloc_bytes"]) for d in nd]
        self.out = [int(d["out_bytes"]) for d in nd]
        self.rg = [bool(d["requires_grad"]) for d in nd]
        self.passthru = [bool(d["grad_passthrough"]) for d in nd]
        self.is_out = [bool(d["is_output"]) for d in nd]
        self.saves = [tuple(d["saves"]) for d in nd]
        self.extra = [int(d["extra_saved_bytes"]) for d in nd]
        self.ftemp = [int(d["fwd_temp_bytes"]) for d in nd]
        self.btemp = [int(d["bwd_temp_bytes"]) for d in nd]
        self.time = [float(d["time_s"]) for d in nd]
        self.recomputable = [bool(d["recomputable"]) for d in nd]
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
        self.view_mask = sum(bit[v] for v in range(n) if self.root[v] != v)
        self.members: list[tuple[int, ...]] = [() for _ in range(n)]  # nodes living in root r's storage
        tmp: dict[int, list[int]] = {}
        for v in range(n):
            tmp.setdefault(self.root[v], []).append(v)
        for r, vs in tmp.items():
            self.members[r] = tuple(vs)
        self.holder_mask = sum(bit[v] for v in range(n) if self.holder[v])
        self.saver_mask = sum(bit[v] for v in range(n) if self.saver[v])
        self.nonrecomp_mask = sum(bit[v] for v in range(n) if not self.recomputable[v])
        # roots of the storages each node saves
        self.saves_roots = [0] * n
        for x in range(n):
            for u in self.saves[x]:
                self.saves_roots[x] |= bit[self.root[u]]
        self.alias_of = [d["alias_of"] for d in nd]
        # whose gradient buffer a node holds when its backward runs (pass-through chains share)
        owner = list(range(n))
        for v in range(n - 1, -1, -1):
            if not self.is_out[v] and len(self.succ[v]) == 1 and self.passthru[self.succ[v][0]]:
                owner[v] = owner[self.succ[v][0]]
        self.buf_owner = owner
        self._info: dict[int, tuple[int, int]] = {}
        self._sweeps()

    # -------------------------------------------------------------- set helpers
    def roots(self, mask: int) -> int:
        """Storage roots of the nodes in ``mask``."""
        views = mask & self.view_mask
        out = mask & ~self.view_mask
        for v in _bits(views):
            out |= self.bit[self.root[v]]
        return out

    def nbytes(self, root_mask: int) -> int:
        """Bytes of the storages whose roots are in ``root_mask``."""
        alloc = self.alloc
        return sum(alloc[r] for r in _bits(root_mask))

    def recompute_flag(self, lower: int, upper: int) -> bool:
        """Whether :func:`segments_from_lower_sets` recomputes the segment ``upper \\ lower``."""
        if upper == self.full:
            return False
        seg = upper & ~lower
        if not seg & self.saver_mask or seg & self.nonrecomp_mask:
            return False
        return not self.module_mode or seg & (seg - 1) == 0

    def touched(self, lower: int, upper: int) -> int:
        """Roots of ``lower`` that the segment ``upper \\ lower`` reads or saves."""
        if upper == self.full:
            return self.roots(lower)
        seg = upper & ~lower
        out = 0
        for v in _bits(seg):
            out |= self.predmask[v] | self.saves_roots[v]
        return self.roots(out & lower)

    def info(self, lower: int) -> tuple[int, int]:
        """``(∂(L), R(L))``: boundary nodes, and roots alive in forward after ``L`` (boundary, outputs)."""
        got = self._info.get(lower)
        if got is None:
            bnd = self.boundary(lower)
            got = self._info[lower] = (bnd, self.roots(bnd | (self.out_mask & lower)))
        return got

    def boundary(self, lower: int) -> int:
        """Nodes of ``lower`` whose storage a node outside it reads (``∂(L)``, plus saved-by)."""
        if not lower:
            return 0
        hi = lower.bit_length() - 1
        out = self.open_at[hi] & lower
        reads = self.reads
        for w in _bits(((1 << (hi + 1)) - 1) & ~lower):
            out |= reads[w] & lower
        return out

    def _sweeps(self) -> None:
        """``open_at[h]``: nodes ``u <= h`` read by some node after ``h`` (for :meth:`boundary`)."""
        n = self.n
        reads = [0] * n
        last = [-1] * n
        for u in range(n):
            for w in _bits(self.need[u]):
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


class _Seg:
    """What one transition ``L -> L'`` costs, from a replay of the simulator on ``S = L' \\ L``."""

    __slots__ = ("recompute", "dt_s", "fwd_peak", "bwd_peak", "held_ext", "kept_new", "kept_add")

    def __init__(self, recompute: bool, dt_s: float, fwd_peak: int, bwd_peak: int,
                 held_ext: int, kept_new: int, kept_add: int) -> None:
        self.recompute = recompute
        self.dt_s = dt_s
        self.fwd_peak = fwd_peak    # peak above the kept bytes m, forward of S (final: whole step)
        self.bwd_peak = bwd_peak    # peak above m during the backward of S
        self.held_ext = held_ext    # dangling roots of L that S holds until its backward (mask)
        self.kept_new = kept_new    # roots of S kept for backward (plain saves; mask)
        self.kept_add = kept_add    # bytes that join the kept set


def _segment(p: _Prep, lower: int, upper: int, dangling: int, recompute: bool) -> _Seg:
    """Replay the simulator's events for segment ``S = upper \\ lower``.

    ``dangling`` holds the roots of ``lower`` that are alive in forward but held by no
    backward (only those ``S`` touches matter). Peaks are relative to the kept bytes ``m``:
    storages of ``lower`` held for some backward, which stay constant during ``S`` and are not
    tracked here. The bookkeeping is the simulator's (storages with sets of holders), inlined:
    storage keys are ints (``r`` a node's storage, ``n + v`` its saved extras, ``2n + v`` its
    recomputed copy, ``3n + v`` the copy's extras, ``4n`` the loss's, ``> 4n`` gradients) and
    so are holders.
    """
    n = p.n
    final = upper == p.full
    seg = upper & ~lower
    nodes = list(_bits(seg))
    root, succ, pred, saves, alloc_b = p.root, p.succ, p.pred, p.saves, p.alloc
    rg, extra, ftemp, need, is_out = p.rg, p.extra, p.ftemp, p.need, p.is_out
    nn = n * n
    beyond, seg_ref = -1, -2 - 2 * n          # holders; ("out", v) is -2 - v
    s_base, rs_base, rf_base, gb_base = nn, nn + n + 1, 2 * nn + 2 * n + 2, 3 * nn + 3 * n + 3
    size: dict[int, int] = {}
    refs: dict[int, set[int]] = {}
    live = peak = 0
    outside = ~upper
    for r in _bits(dangling):
        size[r] = alloc_b[r]
        live += alloc_b[r]
        held = refs[r] = set()
        for u in p.members[r]:
            if not lower >> u & 1:
                continue
            for w in succ[u]:
                if seg >> w & 1:
                    held.add(w * n + u)
            if need[u] & outside:
                held.add(beyond)
            if is_out[u]:
                held.add(-2 - u if final else beyond)
    if recompute:
        for v in nodes:
            for u in pred[v]:
                if lower >> u & 1:
                    got = refs.get(root[u])
                    if got is not None:
                        got.add(seg_ref)
    # ---------------------------------------------------------------- forward
    for v in nodes:
        if root[v] == v:
            size[v] = alloc_b[v]
            refs[v] = set()
            live += alloc_b[v]
        ok = root[v]
        level = live + extra[v] + ftemp[v]
        if level > peak:
            peak = level
        saving = not recompute and rg[v]
        if saving and extra[v]:
            size[n + v] = extra[v]
            refs[n + v] = set()
            live += extra[v]
        held = refs.get(ok)
        if held is not None:
            for w in succ[v]:
                if seg >> w & 1:
                    held.add(w * n + v)
            if need[v] & outside:
                held.add(beyond)
            if is_out[v]:
                held.add(-2 - v if final else beyond)
        if saving:
            for u in saves[v]:
                got = refs.get(root[u])
                if got is not None:
                    got.add(s_base + v)
        for u in pred[v]:
            key = root[u]
            got = refs.get(key)
            if got is not None:
                got.discard(v * n + u)
                if not got:
                    live -= size.pop(key)
                    del refs[key]
        held = refs.get(ok)
        if held is not None and not held:
            live -= size.pop(ok)
            del refs[ok]
    fwd_peak = peak
    grad: dict[int, int] = {}
    next_gid = 4 * n + 1
    if final:
        level = live + p.loss_extra + p.loss_ftemp
        if level > peak:
            peak = level
        live += p.loss_extra
        for u in p.loss_saves:
            got = refs.get(root[u])
            if got is not None:
                got.add(s_base + n)
        for v in _bits(p.out_mask):
            key = root[v]
            got = refs.get(key)
            if got is not None:
                got.discard(-2 - v)
                if not got:
                    live -= size.pop(key)
                    del refs[key]
        for v in _bits(p.out_mask):
            if rg[v]:
                size[next_gid] = p.out[v]
                refs[next_gid] = {gb_base + v}
                live += p.out[v]
                grad[v] = next_gid
                next_gid += 1
        if live + p.loss_btemp > peak:
            peak = live + p.loss_btemp
        for u in p.loss_saves:
            key = root[u]
            got = refs.get(key)
            if got is not None:
                got.discard(s_base + n)
                if not got:
                    live -= size.pop(key)
                    del refs[key]
        live -= p.loss_extra
        pgrad: set[str] = set()
        held_ext = kept_new = kept_add = 0
    else:
        for key, held in list(refs.items()):
            if beyond in held:  # later segments and the loss are done with it
                held.discard(beyond)
                if not held:
                    live -= size.pop(key)
                    del refs[key]
        kept_add = live
        held_ext = kept_new = 0
        for key in size:
            if key < n:
                if lower >> key & 1:
                    held_ext |= 1 << key
                else:
                    kept_new |= 1 << key
        # backward of everything after upper has run: gradients of upper's boundary are alive
        peak = live
        shared: dict[int, int] = {}
        for u in _bits(upper):
            if not rg[u]:
                continue
            out_succ = p.succmask[u] & outside
            if not out_succ and not is_out[u]:
                continue
            owner = u
            if not is_out[u] and out_succ & (out_succ - 1) == 0:
                w = out_succ.bit_length() - 1
                if p.passthru[w]:
                    owner = p.buf_owner[w]
            key = shared.get(owner)
            if key is None:
                key = shared[owner] = next_gid
                next_gid += 1
                size[key] = p.out[owner]
                refs[key] = set()
                live += p.out[owner]
            refs[key].add(gb_base + u)
            grad[u] = key
        pgrad = {q for q, users in p.param_users.items() if users & outside}
        live += sum(p.param_size[q] for q in pgrad)
        if live > peak:
            peak = live
    # ---------------------------------------------------------------- backward
    stop = -1
    if recompute:
        hold = p.holder_mask & seg
        stop = hold.bit_length() - 1 if hold else -1
    rroot: dict[int, int] = {}
    spent = 0.0
    out_b, passthru, btemp, alias_of = p.out, p.passthru, p.btemp, p.alias_of
    for v in reversed(nodes):
        if v == stop:
            for x in nodes:
                if x > stop:
                    break
                spent += p.time[x]
                a = alias_of[x]
                if a is None:
                    key = rroot[x] = 2 * n + x
                    size[key] = alloc_b[x]
                    refs[key] = set()
                    live += alloc_b[x]
                elif a in rroot:
                    rroot[x] = rroot[a]
                key = rroot.get(x, root[x])
                level = live + extra[x] + ftemp[x]
                if level > peak:
                    peak = level
                if rg[x]:
                    if extra[x]:
                        size[3 * n + x] = extra[x]
                        refs[3 * n + x] = set()
                        live += extra[x]
                    for u in saves[x]:
                        got = refs.get(rroot.get(u, root[u]))
                        if got is not None:
                            got.add(rs_base + x)
                held = refs.get(key)
                if held is not None:
                    for w in succ[x]:
                        if seg >> w & 1 and w <= stop:
                            held.add(rf_base + w * n + x)
                for u in pred[x]:
                    ukey = rroot.get(u)
                    if ukey is not None:
                        got = refs.get(ukey)
                        if got is not None:
                            got.discard(rf_base + x * n + u)
                            if not got:
                                live -= size.pop(ukey)
                                del refs[ukey]
                if x in rroot:
                    held = refs.get(key)
                    if held is not None and not held:
                        live -= size.pop(key)
                        del refs[key]
        gv = grad.pop(v, None)
        if gv is not None:
            transient = 0
            for u in pred[v]:
                if not rg[u]:
                    continue
                old = grad.get(u)
                if passthru[v]:
                    if old is None:
                        refs[gv].add(gb_base + u)
                        grad[u] = gv
                        continue
                elif old is None:
                    pass
                elif len(refs[old]) == 1:
                    transient += out_b[u]
                    continue
                else:
                    transient += out_b[u]
                new = grad[u] = next_gid
                next_gid += 1
                size[new] = out_b[u]
                refs[new] = {gb_base + u}
                live += out_b[u]
                if old is not None:
                    got = refs[old]
                    got.discard(gb_base + u)
                    if not got:
                        live -= size.pop(old)
                        del refs[old]
            for q, nbytes in p.params[v]:
                if q in pgrad:
                    transient += nbytes
                else:
                    pgrad.add(q)
                    live += nbytes
            level = live + transient + btemp[v]
            if level > peak:
                peak = level
            got = refs[gv]
            got.discard(gb_base + v)
            if not got:
                live -= size.pop(gv)
                del refs[gv]
        if rg[v]:
            holder = (rs_base if recompute else s_base) + v
            for u in saves[v]:
                key = rroot.get(u, root[u]) if recompute else root[u]
                got = refs.get(key)
                if got is not None:
                    got.discard(holder)
                    if not got:
                        live -= size.pop(key)
                        del refs[key]
            xkey = (3 * n + v) if recompute else (n + v)
            if xkey in size:
                live -= size.pop(xkey)
                del refs[xkey]
    bwd_peak = peak
    if final:
        fwd_peak = bwd_peak = max(fwd_peak, bwd_peak)
    return _Seg(recompute, spent, fwd_peak, bwd_peak, held_ext, kept_new, kept_add)


def _exact_transition(p: _Prep, lower: int, upper: int, dangling: int,
                      cache: dict[tuple[int, int, int], _Seg]) -> tuple[int, float, int, int]:
    """``(need, dt_s, add, dangling')`` of ``lower -> upper`` in the exact model.

    The transition fits when ``m + need <= B``; then ``m += add`` and the dangling roots
    become ``dangling'``. ``cache`` keeps segment replays by ``(lower, upper, roots touched)``.
    """
    final = upper == p.full
    held = dangling if final or not dangling else dangling & p.touched(lower, upper)
    key = (lower, upper, held)
    seg = cache.get(key)
    if seg is None:
        seg = cache[key] = _segment(p, lower, upper, held, p.recompute_flag(lower, upper))
    if final:
        return seg.bwd_peak, seg.dt_s, 0, 0
    need = max(p.nbytes(dangling & ~held) + seg.fwd_peak, seg.bwd_peak)
    _, alive = p.info(upper)
    fresh = upper & ~lower
    dangling = ((dangling & ~seg.held_ext) & alive) | (alive & fresh & ~seg.kept_new)
    return need, seg.dt_s, seg.kept_add, dangling


def _bookkeeping(p: _Prep, lower: int, upper: int, dangling: int) -> tuple[float, int, int]:
    """``(dt_s, add, dangling')`` of ``lower -> upper`` without the replay (set operations only).

    Equal to what :func:`_exact_transition` returns; only the peak needs the replay.
    """
    if upper == p.full:
        return 0.0, 0, 0
    seg = upper & ~lower
    dt = 0.0
    if p.recompute_flag(lower, upper):
        stop = (seg & p.holder_mask).bit_length() - 1
        inputs = 0
        for v in _bits(seg):
            inputs |= p.predmask[v]
            if v <= stop:
                dt += p.time[v]
        held = dangling & p.roots(inputs & lower)
        kept_new = 0
        add = p.nbytes(held)
    else:
        saved = 0
        add = 0
        for v in _bits(seg):
            if p.rg[v]:
                saved |= p.saves_roots[v]
                add += p.extra[v]
        held = dangling & saved
        kept_new = saved & seg
        add += p.nbytes(held | kept_new)
    _, alive = p.info(upper)
    dangling = ((dangling & ~held) & alive) | (alive & seg & ~kept_new)
    return dt, add, dangling


def _model_peak(p: _Prep, seq: Sequence[int]) -> tuple[int, float]:
    """The exact model's step peak and extra time of a lower-set sequence (bitsets, ending in V)."""
    cache: dict[tuple[int, int, int], _Seg] = {}
    lower = dangling = m = peak = 0
    t = 0.0
    for upper in seq:
        need, dt, add, dangling = _exact_transition(p, lower, upper, dangling, cache)
        peak = max(peak, m + need)
        m += add
        t += dt
        lower = upper
    return peak, t


def _sparse_table(values: Sequence[int]) -> list[list[int]]:
    """Sparse table: ``max(values[lo..hi])`` is ``max(t[k][lo], t[k][hi - 2**k + 1])``, ``k = log2(hi - lo + 1)``."""
    table = [list(values)]
    k = 1
    while 2 * k <= len(values):
        prev = table[-1]
        table.append([max(prev[i], prev[i + k]) for i in range(len(values) - 2 * k + 1)])
        k *= 2
    return table


class _Closed:
    """The additive memory model of dp-approx: Kusumoto eq. (2) on our saved-bytes model.

    State ``m`` is ``M(U)``: bytes of every storage a later segment reads, charged when the
    segment that made it ends (the paper's cache of boundaries), plus what plain segments
    save. For the backward of ``S`` (node ids ``lo..hi``) backward is assumed to run in
    reverse id order: when it reaches ``v`` the copies of the storages saved in ``lo..v``, the
    gradients whose last reader is at or after ``v`` (``cut(v)``) and the parameter gradients
    of ``v..hi`` and of every node after ``L'`` are alive; the replay of ``S`` (up to its last
    saving node ``stop``) sees the copies made so far and the gradients alive above ``stop``.
    Each is one sparse-table range maximum per run of consecutive ids, so a transition costs
    O(1) plus its boundary.
    """

    def __init__(self, p: _Prep) -> None:
        self.p = p
        n = p.n
        saved_root = [False] * n
        for x in range(n):
            for u in p.saves[x]:
                saved_root[p.root[u]] = True
        self.saved_root = saved_root
        rho = [(p.alloc[v] if p.root[v] == v and saved_root[v] else 0) + (p.extra[v] if p.rg[v] else 0)
               for v in range(n)]
        self.rho = rho
        prefix = [0] * (n + 1)
        tpre = [0.0] * (n + 1)
        for v in range(n):
            prefix[v + 1] = prefix[v] + rho[v]
            tpre[v + 1] = tpre[v] + p.time[v]
        self.prefix = prefix
        self.tpre = tpre
        # single-user parameters are additive over nodes; shared ones are checked per set
        single = [0] * n
        self.shared: list[tuple[int, int]] = []
        for q, users in p.param_users.items():
            if users & (users - 1):
                self.shared.append((users, p.param_size[q]))
            else:
                single[users.bit_length() - 1] += p.param_size[q]
        self.single = single
        spre = [0] * (n + 1)
        for v in range(n):
            spre[v + 1] = spre[v] + single[v]
        self.spre = spre
        # cut(v): gradients alive when backward reaches v (u <= v, last reader of u's grad >= v)
        diff = [0] * (n + 1)
        last = [-1] * n
        for u in range(n):
            if not p.rg[u] or (not p.succ[u] and not p.is_out[u]):
                continue
            last[u] = n - 1 if p.is_out[u] else max(p.succ[u])
            diff[u] += p.out[u]
            diff[last[u] + 1] -= p.out[u]
        # pgc(v): parameter gradients allocated once backward has reached v (first use = last user)
        pdiff = [0] * (n + 2)
        for q, users in p.param_users.items():
            pdiff[users.bit_length() - 1] += p.param_size[q]
        pgc = [0] * (n + 1)
        for v in range(n - 1, -1, -1):
            pgc[v] = pgc[v + 1] + pdiff[v]
        self.pgc = pgc
        steps = [0] * n
        replay = [0] * n
        cut_above = [0] * n
        f = [0] * n
        cut = 0
        for v in range(n):
            cut += diff[v]
            cut_above[v] = cut - (p.out[v] if last[v] == v else 0) - sum(
                p.out[u] for u in p.pred[v] if last[u] == v)
            acc = p.btemp[v]
            if not p.passthru[v]:
                acc += sum(p.out[u] for u in p.pred[v] if last[u] > v)
            steps[v] = prefix[v + 1] + cut + acc + pgc[v]
            inflight = p.ftemp[v] + (0 if saved_root[p.root[v]] else p.alloc[v])
            inflight += sum(p.alloc[u] for u in p.pred[v] if not saved_root[p.root[u]])
            replay[v] = prefix[v + 1] + inflight
            f[v] = p.alloc[v] + p.extra[v] + p.ftemp[v] + max((p.alloc[u] for u in p.pred[v]), default=0)
        self.cut_above = cut_above
        self.steps = _sparse_table(steps)
        self.replay = _sparse_table(replay)
        self.f = _sparse_table(f)
        self.loss = max(p.loss_extra + p.loss_ftemp, p.loss_btemp)
        self.grad_src = [p.rg[u] and (bool(p.succ[u]) or p.is_out[u]) for u in range(n)]
        saved_by = [0] * n
        for x in range(n):
            for u in p.saves[x]:
                saved_by[u] |= p.bit[x]
        self.saved_by = saved_by
        self._terms: dict[int, tuple] = {}

    def terms(self, lower: int) -> tuple:
        """Per-set terms of ``L``, cached.

        ``(ρ(L), PG(V \\ L), T(L), charge groups, plain charge groups, view entries,
        gradient-holder groups, fresh storages)``; a group is ``(bytes, mask)`` so that a sum of
        bytes over a set is a few popcounts; a fresh storage is one nothing in ``L`` reads,
        ``(bytes, readers, savers)``.
        """
        got = self._terms.get(lower)
        if got is not None:
            return got
        p = self.p
        if not lower:
            got = (0, sum(self.single) + sum(b for _, b in self.shared), 0.0, (), (), (), (), ())
            self._terms[lower] = got
            return got
        hi = lower.bit_length() - 1
        gap = ((1 << (hi + 1)) - 1) & ~lower
        rho = self.prefix[hi + 1]
        tsum = self.tpre[hi + 1]
        inside = self.spre[hi + 1]
        for w in _bits(gap):
            rho -= self.rho[w]
            tsum -= p.time[w]
            inside -= self.single[w]
        pg = self.spre[p.n] - inside + sum(b for users, b in self.shared if users & ~lower)
        rn = p.boundary(lower) | (p.out_mask & lower)
        plain_groups: dict[int, int] = {}
        groups: dict[int, int] = {}
        holders: dict[int, int] = {}
        views = []
        # storages nothing in L reads: held during the next segment's backward only if it does
        fresh = []
        for u in _bits(rn):
            if p.root[u] == u and len(p.members[u]) == 1 and not p.need[u] & lower:
                fresh.append((p.alloc[u], p.succmask[u], self.saved_by[u]))
        for u in _bits(rn):
            bit = p.bit[u]
            root = p.root[u]
            saved = self.saved_root[root]
            if root != u:
                views.append((bit, root, p.alloc[root], saved))
            else:
                groups[p.alloc[u]] = groups.get(p.alloc[u], 0) | bit
                if not saved:
                    plain_groups[p.alloc[u]] = plain_groups.get(p.alloc[u], 0) | bit
            if self.grad_src[u] and (p.succmask[u] & ~lower or p.is_out[u]):
                holders[p.out[u]] = holders.get(p.out[u], 0) | bit
        got = self._terms[lower] = (rho, pg, tsum, tuple(groups.items()), tuple(plain_groups.items()),
                                    tuple(views), tuple(holders.items()), tuple(fresh))
        return got

    def extend(self, lower: int, tl: tuple, uppers: Sequence[tuple[int, tuple]]) -> list[tuple[int, float, int]]:
        """``(need, dt_s, charge)`` for each ``(upper, terms)``: a transition fits when
        ``m + need <= B``, then ``m += charge``; ``dt_s`` is its recomputation time."""
        p = self.p
        full, saver_mask, nonrecomp, holder_mask = p.full, p.saver_mask, p.nonrecomp_mask, p.holder_mask
        module = p.module_mode
        prefix, pgc, cut_above, time = self.prefix, self.pgc, self.cut_above, p.time
        steps, replay, ftab = self.steps, self.replay, self.f
        hold_groups = tl[6]
        fresh = tl[7]
        rho_l, t_l = tl[0], tl[2]
        loss = self.loss
        out: list[tuple[int, float, int]] = []
        notl = ~lower
        for upper, tu in uppers:
            seg = upper & notl
            lo = (seg & -seg).bit_length() - 1
            hi = seg.bit_length() - 1
            final = upper == full
            recompute = (not final and seg & saver_mask != 0 and not seg & nonrecomp
                         and (not module or seg & (seg - 1) == 0))
            stop = (seg & holder_mask).bit_length() - 1 if recompute else -1
            base = tu[1] - pgc[hi + 1]
            if hold_groups:
                for nbytes, mask in hold_groups:
                    base += nbytes * (mask >> (lo + 1)).bit_count()
            if seg.bit_count() == hi - lo + 1:  # one run of consecutive ids
                k = (hi - lo + 1).bit_length() - 1
                row = steps[k]
                a, b = row[lo], row[hi - (1 << k) + 1]
                bwd = (a if a > b else b) - prefix[lo]
                rep = 0
                if stop >= lo:
                    k = (stop - lo + 1).bit_length() - 1
                    row = replay[k]
                    a, b = row[lo], row[stop - (1 << k) + 1]
                    rep = (a if a > b else b) - prefix[lo]
            else:  # one range maximum per run; the copies of earlier runs carry over
                bwd = rep = carried = 0
                x = seg >> lo
                start = lo
                while x:
                    run = (x & ~(x + 1)).bit_length()
                    end = start + run - 1
                    shift = carried - prefix[start]
                    k = run.bit_length() - 1
                    row = steps[k]
                    a, b = row[start], row[end - (1 << k) + 1]
                    val = (a if a > b else b) + shift
                    if val > bwd:
                        bwd = val
                    if start <= stop:
                        top = end if end < stop else stop
                        k = (top - start + 1).bit_length() - 1
                        row = replay[k]
                        a, b = row[start], row[top - (1 << k) + 1]
                        val = (a if a > b else b) + shift
                        if val > rep:
                            rep = val
                    carried += prefix[end + 1] - prefix[start]
                    x >>= run
                    if not x:
                        break
                    gap = (x & -x).bit_length() - 1
                    x >>= gap
                    start = end + 1 + gap
            bwd += base
            for nbytes, readers, savers in fresh:  # dead in S's backward unless S holds it
                if not (readers if recompute else savers) & seg:
                    bwd -= nbytes
            if final:
                out.append((bwd + loss, 0, 0))
                continue
            charge = 0
            for nbytes, mask in (tu[3] if recompute else tu[4]):
                charge += nbytes * (mask & notl).bit_count()
            if tu[5]:  # views in the boundary: charge each storage once
                charged: set[int] = set()
                for bit, root, nbytes, saved in tu[5]:
                    if lower & bit or not (recompute or not saved) or root in charged:
                        continue
                    charged.add(root)
                    if seg >> root & 1 and any(mask >> root & 1 for _, mask in tu[3]):
                        continue  # the root itself is charged above
                    charge += nbytes
            dt = 0.0
            if recompute:
                dt = tu[2] - t_l
                if stop < hi:
                    above = seg >> (stop + 1)
                    while above:
                        low = above & -above
                        dt -= time[low.bit_length() + stop]
                        above ^= low
                if stop >= lo:
                    rep += base + pgc[stop + 1] + cut_above[stop]
                    if rep > bwd:
                        bwd = rep
            else:
                charge += tu[0] - rho_l
            k = (hi - lo + 1).bit_length() - 1
            row = ftab[k]
            a, b = row[lo], row[hi - (1 << k) + 1]
            fwd = charge + (a if a > b else b)
            out.append(((bwd if bwd > fwd else fwd), dt, charge))
        return out

    def pair(self, lower: int, upper: int) -> tuple[int, float, int]:
        """``(need, dt_s, charge)`` of one transition."""
        return self.extend(lower, self.terms(lower), [(upper, self.terms(upper))])[0]


def _closed_peak(p: _Prep, seq: Sequence[int], closed: _Closed | None = None) -> tuple[int, float]:
    """The closed-form model's step peak and extra time of a lower-set sequence."""
    c = closed or _Closed(p)
    lower = m = peak = 0
    t = 0.0
    for upper in seq:
        need, dt, charge = c.pair(lower, upper)
        peak = max(peak, m + need)
        m += charge
        t += dt
        lower = upper
    return peak, t


def _grad_floor(p: _Prep, lower: int) -> int:
    """Bytes of the gradient buffers alive when the backward of a segment ending in ``L`` starts."""
    if lower == p.full:
        return 0
    owners: set[int] = set()
    for u in _bits(p.boundary(lower) | (p.out_mask & lower)):
        if not p.rg[u]:
            continue
        outside = p.succmask[u] & ~lower
        if not outside and not p.is_out[u]:
            continue
        owner = u
        if not p.is_out[u] and outside & (outside - 1) == 0:
            w = outside.bit_length() - 1
            if p.passthru[w]:
                owner = p.buf_owner[w]
        owners.add(owner)
    return sum(p.out[o] for o in owners)


# ---------------------------------------------------------------------------------------- families
def _all_lower_sets(p: _Prep, limit: int) -> list[int] | None:
    """Every lower set as a bitset, in order of size; ``None`` when there are more than ``limit``."""
    sources = sum(p.bit[v] for v in range(p.n) if not p.pred[v])
    out = [0]
    frontier: list[tuple[int, int]] = [(0, sources)]  # (lower set, nodes that can join it)
    seen = {0}
    while frontier:
        nxt: list[tuple[int, int]] = []
        for mask, addable in frontier:
            for v in _bits(addable):
                child = mask | p.bit[v]
                if child in seen:
                    continue
                seen.add(child)
                if len(seen) > limit:
                    return None
                grow = addable & ~p.bit[v]
                for w in p.succ[v]:
                    if p.predmask[w] & ~child == 0:
                        grow |= p.bit[w]
                nxt.append((child, grow))
                out.append(child)
        frontier = nxt
    return out


def _pruned_lower_sets(p: _Prep) -> list[int]:
    """Kusumoto §4.3: ``{L^v : v ∈ V} ∪ {∅, V}`` where ``L^v`` is ``v`` and its ancestors."""
    anc = [0] * p.n
    for v in range(p.n):
        mask = p.bit[v]
        for u in p.pred[v]:
            mask |= anc[u]
        anc[v] = mask
    return sorted(set(anc) | {0, p.full}, key=lambda m: m.bit_count())


def _time_quantum(p: _Prep, slots: int) -> float:
    """Seconds per DP time unit: the nodes' common unit when it gives ≤ ``slots`` units, else T(V)/slots."""
    total = sum(p.time)
    if total <= 0:
        return 1.0
    ints = [round(t) for t in p.time]
    if all(abs(t - i) <= 1e-9 * max(1.0, abs(t)) for t, i in zip(p.time, ints)):
        unit = 0
        for i in ints:
            unit = math.gcd(unit, i)
        if unit and total / unit <= slots:
            return float(unit)
    return total / slots


# ---------------------------------------------------------------------------------------- the DP
class _DP:
    """Algorithm 1 of Kusumoto et al. on a family of lower sets, with sparse dict tables.

    ``cells[k][D][t] = (m, back)``: the least kept bytes ``m`` over sequences ending in the
    ``k``-th set with (quantised) recomputation time ``t`` whose every transition fits the
    budget; ``D`` is the set of dangling roots (always 0 for the closed-form model). Entries
    dominated in ``(t, m)`` are skipped (§4.2). The successors of a set are visited in order of
    a lower bound of their cost (the model's key), and stop once that bound alone exceeds
    what the budget leaves; their transition terms are computed once and kept.
    """

    def __init__(self, p: _Prep, family: list[int], quantum: float, exact: bool) -> None:
        self.p = p
        self.fam = family
        self.quantum = quantum
        self.exact = exact
        n = len(family)
        if exact:
            # held from the end of S's replay (or forward) to its own backward: saved outputs, extras
            lb = [0] * p.n
            for v in range(p.n):
                if p.rg[v]:
                    lb[v] = (p.alloc[v] if p.root[v] == v and v in p.saves[v] else 0) + p.extra[v]
            keys = [sum(lb[v] for v in _bits(m)) for m in family]
            self._seg: dict[tuple[int, int, int], _Seg] = {}
            self._step: dict[tuple[int, int], tuple[int, float, int, int]] = {}
            self._book: dict[tuple[int, int], tuple[float, int, int]] = {}
            # the backward of a segment ending in L' starts with L''s boundary gradients and the
            # parameter gradients of the nodes after L' alive: a lower bound of its need
            closed = _Closed(p)
            self.floor = [_grad_floor(p, m) + closed.terms(m)[1] for m in family]
        else:
            self.closed = _Closed(p)
            self.terms = [self.closed.terms(m) for m in family]
            keys = [t[0] for t in self.terms]
        self.keys = keys
        self.order = sorted(range(n), key=keys.__getitem__)
        ordered = [keys[k] for k in self.order]
        self.scan = [bisect_left(ordered, keys[k]) for k in range(n)]
        self.scanned = [-1] * n
        self.succ: list[list[tuple]] = [[] for _ in range(n)]
        self.runs = 0
        self.transitions = 0

    # -------------------------------------------------------------- transitions
    def successors(self, i: int, limit: int) -> list[tuple]:
        """Successors of set ``i`` with key ``<= limit``, by key: ``(key, j, need, dt_s, add)``
        (closed-form model) or ``(key, j)`` (exact model, priced per state by :meth:`exact_step`)."""
        lst = self.succ[i]
        if limit <= self.scanned[i]:
            return lst
        fam, keys, order = self.fam, self.keys, self.order
        lower = fam[i]
        pos = self.scan[i]
        n = len(fam)
        found: list[int] = []
        while pos < n:
            j = order[pos]
            if keys[j] > limit:
                break
            pos += 1
            if j != i and not lower & ~fam[j]:
                found.append(j)
        self.scan[i] = pos
        self.scanned[i] = limit if pos < n else 1 << 62
        self.transitions += len(found)
        if self.exact:
            lst.extend((keys[j], j) for j in found)
        else:
            terms = self.terms
            priced = self.closed.extend(lower, terms[i], [(fam[j], terms[j]) for j in found])
            lst.extend((keys[j], j, need, dt, add) for j, (need, dt, add) in zip(found, priced))
        return lst

    def exact_step(self, i: int, j: int, dang: int) -> tuple[int, float, int, int]:
        """:func:`_exact_transition` of ``L_i -> L_j`` from the dangling roots ``dang`` (cached)."""
        key = (i * len(self.fam) + j, dang)
        got = self._step.get(key)
        if got is None:
            got = self._step[key] = _exact_transition(self.p, self.fam[i], self.fam[j], dang, self._seg)
        return got

    def vanilla_need(self) -> int:
        """The model's peak of the plan without recomputation (one segment ``V``)."""
        last = len(self.fam) - 1
        if self.exact:
            return self.exact_step(0, last, 0)[0]
        return self.closed.extend(0, self.terms[0], [(self.fam[last], self.terms[last])])[0][0]

    # -------------------------------------------------------------- the table
    def run(self, budget: int, mode: str) -> tuple[list[int], float] | None:
        """``(lower-set sequence ending in V, its recomputation time)`` the DP picks, or ``None``.

        ``mode``: ``"time"`` (least recomputation time), ``"memory"`` (most, §4.4) or
        ``"feasible"`` (any; least kept bytes per state). Times are exact sums; a table cell
        is indexed by ``floor(t / quantum)`` and keeps its least ``m`` (ties: least ``t``).
        """
        self.runs += 1
        if mode == "time":
            return self._search_exact(budget) if self.exact else self._search_closed(budget)
        if mode == "feasible":
            return self._feasible_exact(budget) if self.exact else self._feasible_closed(budget)
        fam, keys = self.fam, self.keys
        nsets = len(fam)
        last = nsets - 1
        quantum = self.quantum
        exact = self.exact
        feasible = mode == "feasible"
        # cells[k][D][tq] = (m, t, back); back = (k', D', tq') or None
        cells: list[dict[int, dict[int, tuple[int, float, Any]]] | None] = [None] * nsets
        cells[0] = {0: {0: (0, 0.0, None)}}
        for i in range(last):
            tab = cells[i]
            if not tab:
                continue
            for dang, entries in tab.items():
                front = _front(entries, mode)
                m_min = front[-1][1]
                limit = keys[i] + budget - m_min
                for item in self.successors(i, limit):
                    if item[0] > limit:
                        break
                    if exact:
                        j = item[1]
                        if m_min + self.floor[j] > budget:
                            continue
                        need, dt, add, dang2 = self.exact_step(i, j, dang)
                    else:
                        _, j, need, dt, add = item
                        dang2 = 0
                    thr = budget - need
                    if m_min > thr:
                        continue
                    tgt = cells[j]
                    if tgt is None:
                        tgt = cells[j] = {}
                    cell = tgt.get(dang2)
                    if cell is None:
                        cell = tgt[dang2] = {}
                    for tq, m, t in front:
                        if m > thr:
                            continue
                        t2 = 0.0 if feasible else t + dt
                        q2 = int(t2 // quantum)
                        m2 = m + add
                        old = cell.get(q2)
                        if old is None or m2 < old[0] or (m2 == old[0] and t2 < old[1]):
                            cell[q2] = (m2, t2, (i, dang, tq))
        final = cells[last]
        if not final:
            return None
        cell = final[0]
        q_best = max(cell) if mode == "memory" else min(cell)
        t_best = cell[q_best][1]
        seq: list[int] = []
        back: Any = (last, 0, q_best)
        while back is not None and back[0] != 0:
            k, dang, tq = back
            seq.append(fam[k])
            back = cells[k][dang][tq][2]  # type: ignore[index]
        seq.reverse()
        return seq, t_best

    def _feasible_closed(self, budget: int) -> tuple[list[int], float] | None:
        """``"feasible"`` :meth:`run` for the closed-form model: least kept bytes per set."""
        fam, keys = self.fam, self.keys
        last = len(fam) - 1
        inf = 1 << 126
        best = [inf] * len(fam)
        back = [-1] * len(fam)
        best[0] = 0
        for i in range(last):
            m = best[i]
            if m == inf:
                continue
            room = budget - m
            limit = keys[i] + room
            for kj, j, need, _, add in self.successors(i, limit):
                if kj > limit:
                    break
                if need <= room and m + add < best[j]:
                    best[j] = m + add
                    back[j] = i
        if best[last] == inf:
            return None
        seq: list[int] = []
        k = last
        while k > 0:
            seq.append(fam[k])
            k = back[k]
        seq.reverse()
        return seq, 0.0

    def _search_closed(self, budget: int) -> tuple[list[int], float] | None:
        """Time-centric :meth:`run` for the closed-form model as a label-setting search.

        Times only grow along a sequence, so labels ``(set, t, m)`` are expanded in increasing
        ``floor(t / quantum)`` (a bucket queue; sets in order within a bucket); a label whose
        ``m`` is not below the least ``m`` already expanded for its set is dominated (§4.2) and
        dropped, and the first label of ``V`` is the answer. It finds what the table of
        :meth:`run` would, but only expands labels up to the answer.
        """
        fam, keys = self.fam, self.keys
        quantum = self.quantum
        last = len(fam) - 1
        inf = 1 << 126
        best = [inf] * len(fam)
        labels: list[dict[int, tuple[int, float, int, int]]] = [{} for _ in fam]
        # buckets[tq][set] = (m, t, previous set, previous tq)
        buckets: dict[int, dict[int, tuple[int, float, int, int]]] = {0: {0: (0, 0.0, -1, 0)}}
        pending = [0]
        while pending:
            tq = heappop(pending)
            bucket = buckets.pop(tq)
            queue = sorted(bucket)
            while queue:
                i = heappop(queue)
                label = bucket[i]
                m, t = label[0], label[1]
                if m >= best[i]:
                    continue
                best[i] = m
                labels[i][tq] = label
                if i == last:
                    seq: list[int] = []
                    k, kq = last, tq
                    while k > 0:
                        seq.append(fam[k])
                        _, _, k, kq = labels[k][kq]
                    seq.reverse()
                    return seq, t
                limit = keys[i] + budget - m
                for kj, j, need, dt, add in self.successors(i, limit):
                    if kj > limit:
                        break
                    m2 = m + add
                    if m + need > budget or m2 >= best[j]:
                        continue
                    t2 = t + dt
                    q2 = int(t2 // quantum)
                    if q2 != tq:
                        tgt = buckets.get(q2)
                        if tgt is None:
                            tgt = buckets[q2] = {}
                            heappush(pending, q2)
                    else:
                        tgt = bucket
                    old = tgt.get(j)
                    if old is None or m2 < old[0] or (m2 == old[0] and t2 < old[1]):
                        if old is None and q2 == tq:
                            heappush(queue, j)
                        tgt[j] = (m2, t2, i, tq)
        return None


    def _exact_moves(self, i: int, dang: int, m: int,
                     budget: int) -> Iterator[tuple[int, tuple[float, int, int]]]:
        """Transitions of the exact model out of state ``(set i, dangling roots)`` with kept bytes
        ``m``: each larger lower set ``j`` that the budget can still admit, with its (cached)
        ``(time, added kept bytes, dangling roots)`` from :func:`_bookkeeping`."""
        fam, floor, nsets, book = self.fam, self.floor, len(self.fam), self._book
        limit = self.keys[i] + budget - m
        for item in self.successors(i, limit):
            if item[0] > limit:
                break
            j = item[1]
            if m + floor[j] > budget:
                continue
            bk = (i * nsets + j, dang)
            got = book.get(bk)
            if got is None:
                got = book[bk] = _bookkeeping(self.p, fam[i], fam[j], dang)
            yield j, got

    def _feasible_exact(self, budget: int) -> tuple[list[int], float] | None:
        """``"feasible"`` :meth:`run` for the exact model: Dijkstra on the kept bytes ``m``.

        The least ``m`` of each state ``(set, dangling roots)`` is all feasibility needs, and
        transitions only add bytes, so states are settled in increasing ``m``; a candidate's
        memory check (a segment replay) is deferred until it is popped, and the search stops
        at the first label of ``V``.
        """
        fam = self.fam
        last = len(fam) - 1
        settled: dict[tuple[int, int], Any] = {}
        heap: list[tuple[int, int, tuple[int, int], Any, int]] = [(0, 0, (0, 0), None, 0)]
        count = 1
        while heap:
            m, _, state, back, m_src = heappop(heap)
            if state in settled:
                continue
            if back is not None and m_src + self.exact_step(back[0], state[0], back[1])[0] > budget:
                continue
            settled[state] = back
            i, dang = state
            if i == last:
                seq: list[int] = []
                node: Any = state
                while node is not None and node[0] != 0:
                    seq.append(fam[node[0]])
                    node = settled[node]
                seq.reverse()
                return seq, 0.0
            for j, got in self._exact_moves(i, dang, m, budget):
                nxt = (j, got[2])
                if nxt in settled:
                    continue
                heappush(heap, (m + got[1], count, nxt, state, m))
                count += 1
        return None

    def _search_exact(self, budget: int) -> tuple[list[int], float] | None:
        """:meth:`_search_closed` for the exact model: labels of states ``(set, dangling roots)``.

        A transition's time and kept bytes come from set operations (:func:`_bookkeeping`); its
        peak needs a segment replay, which is only paid when the label it produced is popped
        (a label beyond the optimum never is).
        """
        fam = self.fam
        quantum = self.quantum
        last = len(fam) - 1
        inf = 1 << 126
        best: dict[tuple[int, int], int] = {}
        labels: dict[tuple[int, int, int], tuple[int, float, Any]] = {}
        # buckets[tq][(set, dangling)] = candidate labels (m, t, back, source m), back = (set,
        # dangling, tq): all of them, since the least m may fail its deferred check
        buckets: dict[int, dict[tuple[int, int], list[tuple[int, float, Any, int]]]] = {
            0: {(0, 0): [(0, 0.0, None, 0)]}}
        pending = [0]
        while pending:
            tq = heappop(pending)
            bucket = buckets.pop(tq)
            queue = sorted(bucket)
            while queue:
                state = heappop(queue)
                accepted = None
                for m, t, back, m_src in sorted(bucket[state], key=lambda c: (c[0], c[1])):
                    if m >= best.get(state, inf):
                        break
                    if back is not None:  # the deferred memory check of the transition into state
                        if m_src + self.exact_step(back[0], state[0], back[1])[0] > budget:
                            continue
                    accepted = (m, t, back)
                    break
                if accepted is None:
                    continue
                m, t, back = accepted
                best[state] = m
                labels[(state[0], state[1], tq)] = (m, t, back)
                i, dang = state
                if i == last:
                    seq: list[int] = []
                    node: Any = (i, dang, tq)
                    while node is not None and node[0] != 0:
                        seq.append(fam[node[0]])
                        node = labels[node][2]
                    seq.reverse()
                    return seq, t
                for j, (dt, add, dang2) in self._exact_moves(i, dang, m, budget):
                    m2 = m + add
                    nxt = (j, dang2)
                    if m2 >= best.get(nxt, inf):
                        continue
                    t2 = t + dt
                    q2 = int(t2 // quantum)
                    if q2 != tq:
                        tgt = buckets.get(q2)
                        if tgt is None:
                            tgt = buckets[q2] = {}
                            heappush(pending, q2)
                    else:
                        tgt = bucket
                    cands = tgt.get(nxt)
                    if cands is None:
                        cands = tgt[nxt] = []
                        if q2 == tq:
                            heappush(queue, nxt)
                    cands.append((m2, t2, (i, dang, tq), m))
        return None


def _front(entries: dict[int, tuple], mode: str) -> list[tuple[int, int, float]]:
    """Non-dominated ``(tq, m, t)`` of one DP cell (§4.2: skip ``t' > t`` with ``m' >= m``).

    Ordered so that ``m`` strictly decreases: ``tq`` ascending (time), descending (memory);
    in ``"feasible"`` mode only the least ``m``.
    """
    if mode == "feasible":
        tq = min(entries, key=lambda k: entries[k][0])
        return [(tq, entries[tq][0], entries[tq][1])]
    out: list[tuple[int, int, float]] = []
    best = -1
    for tq in sorted(entries, reverse=mode == "memory"):
        m, t = entries[tq][0], entries[tq][1]
        if best < 0 or m < best:
            out.append((tq, m, t))
            best = m
    return out


# ---------------------------------------------------------------------------------------- solving
_OBJECTIVES = ("time", "memory")
_DEFAULTS: dict[str, Any] = {
    "objective": "time",
    "time_slots": 500,
    "max_lower_sets": 500,
    "fallback": True,
    "max_tightenings": 24,
}


class _Search:
    """One graph, one family, one model: the DP plus the simulator checks around it."""

    def __init__(self, graph: Graph, solver: str, cfg: dict[str, Any]) -> None:
        self.graph = graph
        self.solver = solver
        self.cfg = cfg
        p = self.p = _Prep(graph)
        self.quantum = _time_quantum(p, cfg["time_slots"])
        self.fallback_reason = ""
        family: list[int] | None = None
        exact = solver == "dp-exact"
        if exact:
            limit = cfg["max_lower_sets"]
            family = _all_lower_sets(p, limit)
            if family is None:
                msg = (f"dp-exact: the graph has more than max_lower_sets={limit} lower sets "
                       "(the exact DP is quadratic in their number)")
                if not cfg["fallback"]:
                    raise ValueError(msg + "; raise max_lower_sets, or pass fallback=True to use dp-approx")
                logger.warning("%s; falling back to dp-approx (pruned family, closed-form model)", msg)
                self.fallback_reason = f"more than {limit} lower sets"
                exact = False
        if exact:
            assert family is not None, "please report"
            self.family_name = "all lower sets"
            self.model_name = "segment replay"
        else:
            family = _pruned_lower_sets(p)
            self.family_name = "pruned: {L^v} + {∅, V}"
            self.model_name = "closed form"
        self.dp = _DP(p, family, self.quantum, exact)
        self._vanilla: tuple[Plan, int] | None = None
        self._min: tuple[int, int, Plan | None] | None = None

    # -------------------------------------------------------------- plans and the simulator
    def plan_of(self, seq: Sequence[int]) -> Plan:
        lists = [list(_bits(m)) for m in seq]
        return Plan(segments_from_lower_sets(self.graph, lists), solver=self.solver)

    def peak(self, plan: Plan) -> int:
        return simulate(self.graph, plan, check=False, record=False).peak_bytes

    def vanilla(self) -> tuple[Plan, int]:
        if self._vanilla is None:
            plan = no_recompute_plan(self.graph)
            plan.solver = self.solver
            self._vanilla = (plan, self.peak(plan))
        return self._vanilla

    # -------------------------------------------------------------- the least budget
    def least_dp_budget(self) -> tuple[int, list[int]]:
        """The least budget at which the DP's model admits a sequence, and that sequence.

        Binary search over bytes (Kusumoto §5.1) on the DP's feasibility. It gallops up from
        1/64 of the unoptimised need so that probes stay near the answer, where the DP is
        cheap; a probe that succeeds lowers the upper end to its sequence's model peak, and
        halving probes alternate with probes one byte below the upper end (the answer is the
        peak of some sequence, so such a probe often closes the search at once).
        """
        seq = [self.p.full]
        hi = self.model_peak(seq)  # the one-segment sequence always fits its own need
        lo = -1
        probe = hi >> 6
        # a probe above the answer prices transitions up to its budget: replays (exact) are
        # dear, so the exact DP climbs in small steps
        growth = 1.1 if self.dp.exact else 2.0
        while lo + 1 < probe < hi:
            found = self.dp.run(probe, "feasible")
            if found is not None:
                seq = found[0]
                hi = self.model_peak(seq)
                break
            lo = probe
            probe = max(probe + 1, int(probe * growth))
        below = True  # alternate "just below hi" (proves hi least when it fails) and halving probes
        while hi - lo > 1:
            mid = hi - 1 if below else (lo + hi) // 2
            below = not below
            found = self.dp.run(mid, "feasible")
            if found is not None:
                seq = found[0]
                hi = self.model_peak(seq)
            else:
                lo = mid
        return hi, seq

    def model_peak(self, seq: Sequence[int]) -> int:
        """The DP model's peak of a sequence (the least budget at which the DP accepts it)."""
        return (_model_peak(self.p, seq) if self.dp.exact else _closed_peak(self.p, seq, self.dp.closed))[0]

    def minimum(self) -> tuple[int, int, Plan | None]:
        """``(min_budget_bytes, least DP budget, the DP's plan there or None)`` (cached).

        The solver's minimum is the smaller of the unoptimised peak and the simulated peak of
        the sequence the DP finds at the least budget its model accepts.
        """
        if self._min is not None:
            return self._min
        _, van_peak = self.vanilla()
        dp_min, seq = self.least_dp_budget()
        plan = self.plan_of(seq)
        peak = self.peak(plan)
        self._min = (peak, dp_min, plan) if peak < van_peak else (van_peak, dp_min, None)
        return self._min

    # -------------------------------------------------------------- solve
    def solve(self, budget: int) -> Plan:
        van_plan, van_peak = self.vanilla()
        if len(self.graph) == 0:
            return self._stamp(van_plan, "no nodes")
        objective = self.cfg["objective"]
        if objective == "time" and van_peak <= budget:
            return self._stamp(van_plan, "no recomputation: the budget does not bind")
        need, dp_min, min_plan = self.minimum()
        if budget < need:
            raise InfeasibleBudgetError(budget, need, solver=self.solver)
        fallback = min_plan or van_plan
        if objective == "memory":
            found = self.dp.run(dp_min, "memory")
            if found is not None:
                plan = self.plan_of(found[0])
                if self.peak(plan) <= budget:
                    return self._stamp(plan, "memory-centric: most recomputation at the least DP budget",
                                       dp_budget=dp_min)
            logger.warning("%s: the memory-centric plan does not fit %d bytes in simulation; using "
                           "the sequence found at the least DP budget (%d bytes)", self.solver, budget, dp_min)
            return self._stamp(fallback, "the sequence found at the least DP budget", dp_budget=dp_min)
        dp_budget = budget
        for attempt in range(self.cfg["max_tightenings"] + 1):
            if dp_budget < dp_min:
                break
            found = self.dp.run(dp_budget, "time")
            if found is None:
                break
            plan = self.plan_of(found[0])
            peak = self.peak(plan)
            if peak <= budget:
                return self._stamp(plan, "time-centric", dp_budget=dp_budget, tightenings=attempt)
            logger.info("%s: the DP's plan for %d bytes simulates to %d bytes; tightening the DP budget",
                        self.solver, dp_budget, peak)
            dp_budget -= max(peak - budget, 1)
        logger.warning("%s: no DP plan for %d bytes passed the simulator check; using the sequence "
                       "found at the least DP budget (%d bytes)", self.solver, budget, dp_min)
        return self._stamp(fallback, "the sequence found at the least DP budget", dp_budget=dp_min)

    def _stamp(self, plan: Plan, why: str, *, dp_budget: int | None = None, tightenings: int = 0) -> Plan:
        """A copy of ``plan`` with the solver's options recorded."""
        plan = Plan(list(plan.segments), solver=self.solver, options=dict(plan.options))
        plan.options.update({
            "objective": self.cfg["objective"],
            "family": self.family_name,
            "family_size": len(self.dp.fam),
            "memory_model": self.model_name,
            "time_slots": self.cfg["time_slots"],
            "time_quantum_s": self.quantum,
            "dp_budget_bytes": dp_budget,
            "tightenings": tightenings,
            "chosen": why,
        })
        if self.fallback_reason:
            plan.options["fallback"] = f"dp-approx ({self.fallback_reason})"
        return plan


def _config(config: dict[str, Any] | None, solver: str) -> dict[str, Any]:
    given = dict(config or {})
    unknown = sorted(set(given) - set(_DEFAULTS))
    if unknown:  # solve(solver="auto", **options) hands every solver the same options
        logger.warning("%s ignores unknown options %s (it accepts %s)", solver, unknown, sorted(_DEFAULTS))
        for key in unknown:
            del given[key]
    cfg = {**_DEFAULTS, **given}
    if cfg["objective"] not in _OBJECTIVES:
        raise ValueError(f"objective={cfg['objective']!r} is not supported; expected one of {_OBJECTIVES}")
    for key, least in (("time_slots", 1), ("max_lower_sets", 1), ("max_tightenings", 0)):
        value = cfg[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{key}={value!r} must be an int >= {least}")
    cfg["fallback"] = bool(cfg["fallback"])
    return cfg


def _check_budget(budget_bytes: Any) -> int:
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
        raise ValueError(f"budget_bytes={budget_bytes!r} must be an int >= 0 (bytes of step peak)")
    return int(budget_bytes)


def solve_dp_exact(graph: Graph, budget_bytes: int, *, config: dict[str, Any] | None = None) -> Plan:
    """Kusumoto et al.'s exact DP (all lower sets) under a step-peak budget; see the module docstring."""
    budget = _check_budget(budget_bytes)
    return _Search(graph, "dp-exact", _config(config, "dp-exact")).solve(budget)


def solve_dp_approx(graph: Graph, budget_bytes: int, *, config: dict[str, Any] | None = None) -> Plan:
    """Kusumoto et al.'s approximate DP (pruned family) under a step-peak budget; see the module docstring."""
    budget = _check_budget(budget_bytes)
    return _Search(graph, "dp-approx", _config(config, "dp-approx")).solve(budget)


def min_budget(graph: Graph, solver: str = "dp-approx", *, config: dict[str, Any] | None = None) -> int:
    """The smallest step-peak budget for which ``solver`` (``"dp-approx"`` or ``"dp-exact"``) finds a plan.

    ``solver(graph, b)`` returns a plan for every ``b >= min_budget(graph, solver)`` and raises
    :class:`~autoremat.errors.InfeasibleBudgetError` below it (see the module docstring).
    """
    if solver not in ("dp-approx", "dp-exact"):
        raise ValueError(f"solver={solver!r} is not a Kusumoto DP; expected 'dp-approx' or 'dp-exact'")
    if len(graph) == 0:
        return 0
    return _Search(graph, solver, _config(config, solver)).minimum()[0]
