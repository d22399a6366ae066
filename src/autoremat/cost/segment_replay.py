"""The exact model of ``dp-exact``: the simulator's rules replayed on one segment.

A lower-set sequence ``L1 ⊂ … ⊂ Lk = V`` (Kusumoto et al.'s canonical strategy) is priced one
transition ``L -> L'`` at a time: :func:`replay_segment` runs the events of
:func:`autoremat.cost.simulate` (storages with sets of holders, the same rules) for the segment
``S = L' \\ L`` alone: its forward; then, once everything after ``L'`` has run its backward, the
gradients alive at ``L'``'s boundary and the parameter gradients of the nodes after ``L'``; the
replay of ``S`` up to its last saving node and its backward (with :attr:`GraphBits.tails
<autoremat.cost.bitsets.GraphBits.tails>` the replay's time is that up to its tail,
:func:`replay_time`, as the plan with its tails runs; its bytes stay the whole replay's). The
state between transitions is ``m``, the bytes of ``L`` held for some later backward, plus the
*dangling* roots: boundary storages alive in forward that no backward holds yet. :func:`exact_transition` turns a replay
into the DP's ``(need, time, added kept bytes, dangling roots)``; :func:`bookkeeping` gives all
but the need from set operations alone (the replay is the DP's cost, so the search defers it
and prunes it with the bounds of :mod:`.backward_floor`). :func:`exact_peak` chains the
transitions of a whole sequence.

Held to the simulator (``tests/cost/test_segment_replay.py``, seeded random DAGs with views,
extras, workspace, parameters, non-recomputable nodes, module mode): :func:`exact_peak` equals
:func:`~autoremat.cost.simulate`'s peak and extra time of the same plan, with two documented
exceptions: a boundary node whose gradient arrives through a pass-through op (``add``, views)
*and* other consumers may hold another buffer, which depends on the order later segments run
backward (a forward DP cannot know it; the model assumes its own buffer); and the simulator's
replay keeps a storage alive when a recomputed segment takes a view of its input. Where they
apply the test holds the model within the bound stated there.

O(|S| + edges of S) per replay, O(|∂L| + |S|) per bookkeeping.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..replay_tail import tail_start
from .bitsets import GraphBits, bit_list, bits

__all__ = ["SegmentCost", "replay_segment", "replay_time", "TAIL_TIE", "exact_transition", "pair_bookkeeping",
           "bookkeeping", "exact_peak", "grad_floor"]


class SegmentCost:
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


def replay_segment(p: GraphBits, lower: int, upper: int, dangling: int, recompute: bool) -> SegmentCost:
    """Replay the simulator's events for segment ``S = upper \\ lower``.

    ``dangling`` holds the roots of ``lower`` that are alive in forward but held by no
    backward (only those ``S`` touches matter). Peaks are relative to the kept bytes ``m``:
    storages of ``lower`` held for some backward, which stay constant during ``S`` and are not
    tracked here. The bookkeeping is the simulator's (storages with sets of holders), inlined:
    storage keys are ints (``r`` a node's storage, ``n + v`` its saved extras, ``2n + v`` its
    recomputed copy, ``3n + v`` the copy's extras, ``4n`` the loss's, ``> 4n`` gradients) and
    so are holders.

    Long by design: the replay is dp-exact's cost (every transition a search admits), so the
    simulator's events for forward, loss, backward and recomputation are inlined on local lists and
    dicts rather than dispatched to the ledger's methods."""
    n = p.n
    final = upper == p.full
    seg = upper & ~lower
    nodes = bit_list(seg)
    inseg = bytearray(n)  # membership tests on ints of a few hundred bits are the replay's cost
    for v in nodes:
        inseg[v] = 1
    beyond_of = p.beyond_flags(upper)  # node's storage is read after upper
    root, succ, pred, saves, alloc_b = p.root, p.succ, p.pred, p.saves, p.alloc
    rg, extra, ftemp, held_to_loss = p.rg, p.extra, p.ftemp, p.held
    nn = n * n
    beyond, seg_ref, end = -1, -2 - 2 * n, -3 - 2 * n  # holders; ("out", v) is -2 - v; end: the step's end
    s_base, rs_base, rf_base, gb_base = nn, nn + n + 1, 2 * nn + 2 * n + 2, 3 * nn + 3 * n + 3
    size: dict[int, int] = {}
    refs: dict[int, set[int]] = {}
    live = peak = 0

    def hold(held: set[int], u: int) -> None:
        """The holders of ``u``'s output while ``S`` runs: its consumers in ``S``, and one for
        readers after ``upper`` (the step's output in the final segment)."""
        for w in succ[u]:
            if inseg[w]:
                held.add(w * n + u)
        if beyond_of[u]:
            held.add(beyond)
        if held_to_loss[u]:
            held.add(-2 - u if final else beyond)
    for r in bits(dangling):
        size[r] = alloc_b[r]
        live += alloc_b[r]
        held = refs[r] = set()
        for u in p.members[r]:
            if not lower >> u & 1:
                continue
            hold(held, u)
    if recompute:
        for v in nodes:
            for u in pred[v]:
                if lower >> u & 1:
                    got = refs.get(root[u])
                    if got is not None:
                        got.add(seg_ref)
    # ---------------------------------------------------------------- forward
    end_mask = p.end_mask
    for v in nodes:
        if root[v] == v:
            size[v] = alloc_b[v]
            refs[v] = {end} if end_mask >> v & 1 else set()  # the output object, kept through backward
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
            hold(held, v)
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
    viewed: set[int] = set()  # nodes whose gradient is the first one, a view (StepState.viewed)
    next_gid = 4 * n + 1
    if final:
        level = live + p.loss_extra + p.loss_held + p.loss_ftemp
        if level > peak:
            peak = level
        live += p.loss_extra + p.loss_held  # the loss tensor's storage stays to the step's end
        for u in p.loss_saves:
            got = refs.get(root[u])
            if got is not None:
                got.add(s_base + n)
        for v in bits(p.held_mask):  # the output object is dropped
            key = root[v]
            got = refs.get(key)
            if got is not None:
                got.discard(-2 - v)
                if not got:
                    live -= size.pop(key)
                    del refs[key]
        for v in bits(p.out_mask):
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
        pg_after: frozenset[str] = frozenset()
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
        # backward of everything after upper has run: gradients of upper's boundary are alive, and
        # the storages made after upper that the output object holds to the step's end, and the loss's
        live += p.nbytes(end_mask & ~upper) + p.loss_held
        peak = live
        shared: dict[int, int] = {}
        after = p.after(upper)
        grads_after, pg_after, pg_bytes = after.grads, after.params, after.param_bytes
        for u, owner in grads_after:
            key = shared.get(owner)
            if key is None:
                key = shared[owner] = next_gid
                next_gid += 1
                size[key] = p.out[owner]
                refs[key] = set()
                live += p.out[owner]
            refs[key].add(gb_base + u)
            grad[u] = key
        viewed.update(after.viewed)
        live += pg_bytes
        if live > peak:
            peak = live
    # ---------------------------------------------------------------- backward
    stop = -1
    if recompute:
        hold = p.holder_mask & seg
        stop = hold.bit_length() - 1 if hold else -1
    rroot: dict[int, int] = {}
    pgrad: set[str] = set()  # parameter gradients allocated during this backward
    spent = 0.0
    out_b, passthru, btemp, alias_of, cast = p.out, p.passthru, p.btemp, p.alias_of, p.grad_new
    first_view = p.first_view
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
                        if inseg[w] and w <= stop:
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
            transient = first = 0
            for u in pred[v]:
                if not rg[u]:
                    continue
                old = grad.get(u)
                passes = passthru[v] and u not in cast[v]
                if old is None:
                    if first_view[u]:
                        viewed.add(u)
                    if passes:
                        refs[gv].add(gb_base + u)
                        grad[u] = gv
                        continue
                else:
                    alone = len(refs[old]) == 1
                    if u in viewed:  # summed out of place, the first alive through the sum
                        viewed.discard(u)
                        if alone:
                            first += size[old]
                    elif alone and not passes:
                        transient += out_b[u]
                        continue
                    if not passes:
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
            for q, nbytes in p.params[v]:  # the first use in backward allocates the gradient
                if q in pg_after or q in pgrad:
                    transient += nbytes
                else:
                    pgrad.add(q)
                    live += nbytes
            level = live + transient + max(btemp[v], first)
            if level > peak:
                peak = level
            got = refs[gv]
            got.discard(gb_base + v)
            if not got:
                live -= size.pop(gv)
                del refs[gv]
        elif btemp[v] and alias_of[v] is not None and rg[v] and root[v] in grad:  # a view's backward (.grad_handoff)
            level = live + sum(out_b[u] for u in pred[v] if rg[u]) + btemp[v]
            if level > peak:
                peak = level
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
    if recompute and p.tails:  # the time of the replay as it runs, its bytes those of the whole replay
        spent = replay_time(p, seg)
    return SegmentCost(recompute, spent, fwd_peak, bwd_peak, held_ext, kept_new, kept_add)


def exact_transition(p: GraphBits, lower: int, upper: int, dangling: int, cache: dict[tuple, SegmentCost],
                      recompute: bool | None = None) -> tuple[int, float, int, int]:
    """``(need, dt_s, add, dangling')`` of ``lower -> upper`` in the exact model.

    The transition fits when ``m + need <= B``; then ``m += add`` and the dangling roots
    become ``dangling'``. ``cache`` keeps segment replays by ``(lower, upper, roots touched)``
    (and the flag, when given). ``recompute``: whether the segment is recomputed (default:
    :meth:`GraphBits.recompute_flag`, as :func:`~autoremat.plan.segments_from_lower_sets` runs it;
    the ``milp`` plan space chooses it freely, the last segment included).
    """
    final = upper == p.full
    held = dangling if final or not dangling else dangling & p.touched(lower, upper)
    key = (lower, upper, held) if recompute is None else (lower, upper, held, recompute)
    seg = cache.get(key)
    if seg is None:
        flag = p.recompute_flag(lower, upper) if recompute is None else recompute
        seg = cache[key] = replay_segment(p, lower, upper, held, flag)
    if final:
        return seg.bwd_peak, seg.dt_s, 0, 0
    need = max(p.nbytes(dangling & ~held) + seg.fwd_peak, seg.bwd_peak)
    alive = p.info(upper).alive
    fresh = upper & ~lower
    dangling = ((dangling & ~seg.held_ext) & alive) | (alive & fresh & ~seg.kept_new)
    return need, seg.dt_s, seg.kept_add, dangling


TAIL_TIE = 1e-6
"""With :attr:`GraphBits.tails`, a recomputed segment costs its replay up to its tail plus this
share of its whole replay: of plans that run alike, the searches keep the one whose replays are
shorter whole, which is what a forward replays where the runtime cannot vouch for a tail
(:mod:`autoremat.replay_tail`). (Without it, ``auto`` at 75 % of the CPU-size U-Net swapped its
plan for one as fast with its tails and 1.57x as slow replayed whole.)"""


def replay_time(p: GraphBits, seg: int) -> float:
    """The time of a recomputed segment's replay: its nodes up to its last holding node (the
    simulator's replay of a plan without tails), or with :attr:`GraphBits.tails` up to its tail
    (:func:`autoremat.replay_tail.tail_start`; the simulator's rule for a plan with tails) plus
    :data:`TAIL_TIE` of the former."""
    stop = (seg & p.holder_mask).bit_length() - 1
    whole = _time_through(p, seg, stop)
    if not p.tails:
        return whole
    first = tail_start(p, seg)
    return (whole if first < 0 else _time_through(p, seg, first - 1)) + TAIL_TIE * whole


def _time_through(p: GraphBits, seg: int, stop: int) -> float:
    """The summed times of the nodes of ``seg`` up to node ``stop`` (in node order)."""
    if stop < 0:
        return 0.0
    part = seg & ((2 << stop) - 1)
    if p.time_groups is not None:  # integer times: every partial sum is exact
        total = 0
        for value, mask in p.time_groups:
            total += value * (part & mask).bit_count()
        return float(total)
    dt = 0.0
    time = p.time
    for v in bit_list(part):
        dt += time[v]
    return dt


def pair_bookkeeping(p: GraphBits, lower: int, upper: int,
                      recompute: bool | None = None) -> tuple[float, int, int, int, int]:
    """The part of :func:`bookkeeping` that does not depend on the dangling roots.

    ``(dt_s, reach, add, alive, fresh)``: the recomputation time; the roots of ``lower`` the
    segment holds if they dangle (those it reads when recomputed, those it saves otherwise);
    the kept bytes it adds by itself; the roots alive after ``upper``; and the segment's roots
    that dangle after it. ``recompute``: :meth:`GraphBits.recompute_flag` of the pair, when the
    caller has it.
    """
    seg = upper & ~lower
    alive = p.info(upper).alive
    if recompute is None:
        recompute = p.recompute_flag(lower, upper)
    if recompute:
        dt = replay_time(p, seg)
        reads = 0  # the nodes of lower that the segment reads (all in the boundary of lower)
        for u, succ in p.boundary_succ(lower):
            if succ & seg:
                reads |= 1 << u
        kept_end = p.end_mask & seg  # held by the output object to the step's end: kept as a save is
        return dt, p.roots(reads), p.nbytes(kept_end), alive, alive & seg & ~kept_end
    saved = 0
    saves_roots, extra = p.saves_roots, p.extra
    nodes = bit_list(seg & p.rg_mask)
    for v in nodes:
        saved |= saves_roots[v]
    add = sum(map(extra.__getitem__, nodes))
    kept_new = (saved | p.end_mask) & seg
    return 0.0, saved, add + p.nbytes(kept_new), alive, alive & seg & ~kept_new


def bookkeeping(p: GraphBits, lower: int, upper: int, dangling: int,
                 pair: tuple[float, int, int, int, int] | None = None,
                 recompute: bool | None = None) -> tuple[float, int, int]:
    """``(dt_s, add, dangling')`` of ``lower -> upper`` without the replay (set operations only).

    Equal to what :func:`exact_transition` returns; only the peak needs the replay. ``pair``:
    :func:`pair_bookkeeping` of the transition, when the caller keeps it; ``recompute``: the
    pair's :meth:`GraphBits.recompute_flag`, when the caller has it.
    """
    if upper == p.full:
        if recompute:  # the milp space may recompute the last segment: its time, nothing kept
            return pair_bookkeeping(p, lower, upper, True)[0], 0, 0
        return 0.0, 0, 0
    dt, reach, add, alive, fresh = pair or pair_bookkeeping(p, lower, upper, recompute)
    held = dangling & reach
    if held:
        add += p.nbytes(held)
    return dt, add, ((dangling & ~held) & alive) | fresh


def exact_peak(p: GraphBits, seq: Sequence[int], flags: Sequence[bool] | None = None) -> tuple[int, float]:
    """The exact model's step peak and extra time of a lower-set sequence (bitsets, ending in V),
    its segments recomputed as ``flags`` says (default: as :meth:`GraphBits.recompute_flag`)."""
    cache: dict[tuple, SegmentCost] = {}
    lower = dangling = m = peak = 0
    t = 0.0
    for k, upper in enumerate(seq):
        flag = None if flags is None else bool(flags[k])
        need, dt, add, dangling = exact_transition(p, lower, upper, dangling, cache, flag)
        peak = max(peak, m + need)
        m += add
        t += dt
        lower = upper
    return peak, t


def grad_floor(p: GraphBits, lower: int) -> int:
    """Bytes of the gradient buffers alive when the backward of a segment ending in ``L`` starts
    (each buffer once: :meth:`GraphBits.after`'s owners)."""
    if lower == p.full:
        return 0
    return sum(p.out[o] for o in {owner for _, owner in p.after(lower).grads})
