"""The closed-form memory model of ``dp-approx``: Kusumoto et al.'s eq. (2) on saved bytes.

A transition ``L -> L'`` of a lower-set sequence is priced in O(1) plus its boundary from
per-set terms (:class:`SetTerms`) and sparse-table range maxima over node ids. The state ``m``
is the paper's ``M(U)``: every boundary storage is charged when its segment ends, where the
simulator lets a storage that no later segment reads die; and the backward of a segment is
assumed to run in reverse id order. So it is an approximation of
:func:`autoremat.cost.simulate`, not a copy of its rules: ``dp-approx`` simulates every plan it
returns and tightens its budget when the model was under.

The bound it is held to (``tests/cost/test_closed_form.py``): its extra time equals the
simulator's, and its peak is between :data:`UNDER_BOUND` and :data:`OVER_BOUND` times the
simulated one, on random lower-set sequences of seeded random DAGs of 3-11 nodes with views,
pass-through nodes, extras, workspace and shared parameters (measured there: 0.67x to 2.44x,
median 1.05x; 2 in 7 sequences exact, 1 in 7 under; such tiny graphs, a few bytes a tensor,
exaggerate both ways). On the zoo at paper size (random sequences of the pruned family):
ResNet-50 1.00-1.06x, GoogLeNet 1.00-1.12x, DenseNet-121 1.00-1.02x, U-Net 1.00-1.20x (its
skips: ``M(U)`` keeps storages the simulator frees).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .bitsets import GraphBits, bits

__all__ = ["SetTerms", "ClosedForm", "closed_peak", "sparse_table", "UNDER_BOUND", "OVER_BOUND"]

UNDER_BOUND = 0.6
"""The closed form's peak is at least this share of the simulated peak (tested)."""
OVER_BOUND = 2.5
"""The closed form's peak is at most this multiple of the simulated peak (tested)."""


@dataclass(slots=True)
class SetTerms:
    """Per-set terms of a lower set ``L`` (:meth:`ClosedForm.terms`). A *group* is
    ``(bytes, mask)``, so that a sum of bytes over a set is a few popcounts."""

    rho: int
    """``ρ(L)``: bytes of the saved storages and extras of ``L``'s nodes."""
    pg: int
    """``PG(V \\ L)``: parameter-gradient bytes of the nodes outside ``L``."""
    time_s: float
    """``T(L)``."""
    charge: tuple[tuple[int, int], ...]
    """Groups of ``L``'s boundary storages (charged when a recomputed segment ends in ``L``)."""
    plain_charge: tuple[tuple[int, int], ...]
    """The groups of those no node saves (charged when a plain segment ends in ``L``)."""
    views: tuple[tuple[int, int, int, bool], ...]
    """``(bit, root, bytes, saved)`` of each view in the boundary (charged once per storage)."""
    holders: tuple[tuple[int, int], ...]
    """Groups of the boundary nodes whose gradient buffer is alive after ``L``."""
    fresh: tuple[tuple[int, int, int], ...]
    """``(bytes, readers, savers)`` of the boundary storages nothing in ``L`` reads."""


def sparse_table(values: Sequence[int]) -> list[list[int]]:
    """Sparse table: ``max(values[lo..hi])`` is ``max(t[k][lo], t[k][hi - 2**k + 1])``, ``k = log2(hi - lo + 1)``."""
    table = [list(values)]
    k = 1
    while 2 * k <= len(values):
        prev = table[-1]
        table.append([max(prev[i], prev[i + k]) for i in range(len(values) - 2 * k + 1)])
        k *= 2
    return table


class ClosedForm:
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

    def __init__(self, p: GraphBits) -> None:
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
            acc += sum(p.out[u] for u in (p.grad_new[v] if p.passthru[v] else p.pred[v]) if last[u] > v)
            steps[v] = prefix[v + 1] + cut + acc + pgc[v]
            inflight = p.ftemp[v] + (0 if saved_root[p.root[v]] else p.alloc[v])
            inflight += sum(p.alloc[u] for u in p.pred[v] if not saved_root[p.root[u]])
            replay[v] = prefix[v + 1] + inflight
            f[v] = p.alloc[v] + p.extra[v] + p.ftemp[v] + max((p.alloc[u] for u in p.pred[v]), default=0)
        self.cut_above = cut_above
        self.steps = sparse_table(steps)
        self.replay = sparse_table(replay)
        self.f = sparse_table(f)
        self.loss = max(p.loss_extra + p.loss_ftemp, p.loss_btemp)
        self.grad_src = [p.rg[u] and (bool(p.succ[u]) or p.is_out[u]) for u in range(n)]
        saved_by = [0] * n
        for x in range(n):
            for u in p.saves[x]:
                saved_by[u] |= p.bit[x]
        self.saved_by = saved_by
        self.end_roots = [(p.bit[r], p.alloc[r]) for r in bits(p.end_mask)]  # alive in every backward
        self._terms: dict[int, SetTerms] = {}

    def terms(self, lower: int) -> SetTerms:
        """The per-set terms of ``L`` (cached)."""
        got = self._terms.get(lower)
        if got is not None:
            return got
        p = self.p
        if not lower:
            got = SetTerms(0, sum(self.single) + sum(b for _, b in self.shared), 0.0, (), (), (), (), ())
            self._terms[lower] = got
            return got
        hi = lower.bit_length() - 1
        gap = ((1 << (hi + 1)) - 1) & ~lower
        rho = self.prefix[hi + 1]
        tsum = self.tpre[hi + 1]
        inside = self.spre[hi + 1]
        for w in bits(gap):
            rho -= self.rho[w]
            tsum -= p.time[w]
            inside -= self.single[w]
        pg = self.spre[p.n] - inside + sum(b for users, b in self.shared if users & ~lower)
        rn = p.boundary(lower) | (p.held_mask & lower)
        plain_groups: dict[int, int] = {}
        groups: dict[int, int] = {}
        holders: dict[int, int] = {}
        views = []
        # storages nothing in L reads: held during the next segment's backward only if it does
        fresh = []
        for u in bits(rn):
            if p.root[u] == u and len(p.members[u]) == 1 and not p.need[u] & lower and not p.end_mask >> u & 1:
                fresh.append((p.alloc[u], p.succmask[u], self.saved_by[u]))
        for u in bits(rn):
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
        got = self._terms[lower] = SetTerms(rho, pg, tsum, tuple(groups.items()), tuple(plain_groups.items()),
                                            tuple(views), tuple(holders.items()), tuple(fresh))
        return got

    def extend(self, lower: int, tl: SetTerms, uppers: Sequence[tuple[int, SetTerms]]) -> list[tuple[int, float, int]]:
        """``(need, dt_s, charge)`` for each ``(upper, terms)``: a transition fits when
        ``m + need <= B``, then ``m += charge``; ``dt_s`` is its recomputation time.

        Long by design: the DP's inner loop (every successor of a set, priced in one call, per
        transition only local integer operations); a helper call per successor would be most of its
        cost."""
        p = self.p
        full, saver_mask, nonrecomp, holder_mask = p.full, p.saver_mask, p.nonrecomp_mask, p.holder_mask
        module = p.module_mode
        prefix, pgc, cut_above, time = self.prefix, self.pgc, self.cut_above, p.time
        steps, replay, ftab = self.steps, self.replay, self.f
        hold_groups = tl.holders
        fresh = tl.fresh
        rho_l, t_l = tl.rho, tl.time_s
        loss = self.loss
        out: list[tuple[int, float, int]] = []
        notl = ~lower
        ends = sum(nbytes for bit, nbytes in self.end_roots if not lower & bit)  # L's own are charged in m
        ends += p.loss_held  # the loss tensor, alive in every backward
        for upper, tu in uppers:
            seg = upper & notl
            lo = (seg & -seg).bit_length() - 1
            hi = seg.bit_length() - 1
            final = upper == full
            recompute = (not final and seg & saver_mask != 0 and not seg & nonrecomp
                         and (not module or seg & (seg - 1) == 0))
            stop = (seg & holder_mask).bit_length() - 1 if recompute else -1
            base = tu.pg - pgc[hi + 1] + ends
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
            for nbytes, mask in (tu.charge if recompute else tu.plain_charge):
                charge += nbytes * (mask & notl).bit_count()
            if tu.views:  # views in the boundary: charge each storage once
                charged: set[int] = set()
                for bit, root, nbytes, saved in tu.views:
                    if lower & bit or not (recompute or not saved) or root in charged:
                        continue
                    charged.add(root)
                    if seg >> root & 1 and any(mask >> root & 1 for _, mask in tu.charge):
                        continue  # the root itself is charged above
                    charge += nbytes
            dt = 0.0
            if recompute:
                dt = tu.time_s - t_l
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
                charge += tu.rho - rho_l
            k = (hi - lo + 1).bit_length() - 1
            row = ftab[k]
            a, b = row[lo], row[hi - (1 << k) + 1]
            fwd = charge + (a if a > b else b)
            out.append(((bwd if bwd > fwd else fwd), dt, charge))
        return out

    def pair(self, lower: int, upper: int) -> tuple[int, float, int]:
        """``(need, dt_s, charge)`` of one transition."""
        return self.extend(lower, self.terms(lower), [(upper, self.terms(upper))])[0]


def closed_peak(p: GraphBits, seq: Sequence[int], closed: ClosedForm | None = None) -> tuple[int, float]:
    """The closed-form model's step peak and extra time of a lower-set sequence."""
    c = closed or ClosedForm(p)
    lower = m = peak = 0
    t = 0.0
    for upper in seq:
        need, dt, charge = c.pair(lower, upper)
        peak = max(peak, m + need)
        m += charge
        t += dt
        lower = upper
    return peak, t
