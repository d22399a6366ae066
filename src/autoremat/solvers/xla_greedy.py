"""``"xla-greedy"``: XLA's GreedyRemat heuristic, as a schedule and as an executable plan.

Problem. Keep the memory of a training step under a limit by rematerializing tensors, greedily:
XLA's ``HloRematerialization`` pass, the GreedyRemat baseline of Kumar et al. [1]_ (§4):
"Starting with a topological sort of all operations, it processes each operation
sequentially. At each stage, if the current memory usage is over a specified memory limit,
the algorithm attempts to rematerialize an already scheduled operation. In particular, the
operation whose rematerialization maximizes the amount of reduction in memory usage is
chosen greedily at each step. If the memory usage cannot be reduced, the algorithm moves on
to the next operation."

Paper: .. [1] R. Kumar, M. Purohit, Z. Svitkina, E. Vee, J. R. Wang, "Efficient
   Rematerialization for Deep Networks", NeurIPS 2019 (§4, GreedyRemat); the heuristic is
   XLA's ``xla/service/hlo_rematerialization.cc`` (TensorFlow, 2017-2019).

Two forms.

:func:`xla_greedy_schedule` (the paper's baseline) works on the joint forward+backward graph
(:class:`~autoremat.cost.schedule.JointGraph`, the papers' memory model). It walks the
NoRemat order; after placing each operation, while the tracked memory (tensors with a pending
use) exceeds ``memory_limit_bytes`` it picks, among resident tensors with a pending use, the
one with XLA's least cost: 0 when none of its users has been placed since it was computed (a
*move* of the operation later in the sequence), else ``limit / memory_reduced``, where
``memory_reduced`` is the tensor's size minus the sizes of its inputs that are no longer live
and would have to be kept (XLA's ``MemoryReducedIfRematerialized``). The chosen tensor is
dropped and a copy of its operation is inserted right before its next use; copies are never
rematerialized again (XLA blacklists them), so every node is computed at most twice. An
operation whose inputs are not all computed yet (a moved one) is no candidate. The frees of
the result are re-derived from its computations
(:func:`~autoremat.cost.schedule.with_liveness_frees`), so the measured peak is exact on
the joint model even where XLA's running estimate is not.

:func:`solve_xla_greedy` (registered as ``"xla-greedy"``) maps the same decisions to
autoremat's canonical plan form, which the runtime executes: a node "rematerialized" is a node
put in a recompute segment (a maximal run of consecutive rematerialized nodes in execution
order is one non-reentrant checkpoint region; in module-level graphs every such node is its
own region). Each round scores every node not yet chosen by XLA's metric, adapted to what a
plan keeps for backward: the storages that only this node keeps (its ``saves`` held by no
other kept node, plus its ``extra_saved_bytes``), minus the storages that its checkpoint
region would newly have to keep as inputs (a non-reentrant region keeps its inputs until its
backward), counting regions merged by the choice. The best node (largest reduction; ties:
less forward time, then earlier) is added and the plan is judged by
:func:`autoremat.simulate`. The first plan of this sequence whose simulated step peak fits the
budget is returned; the sequence does not depend on the budget and each step only grows
what is recomputed, so the extra time never rises as the budget grows.

Budget cases: not binding (the plan without recomputation fits) → no recomputation;
binding → the first fitting plan (simulated peak ≤ budget); infeasible (the sequence ends
with no positive reduction left and nothing fitted) → :class:`InfeasibleBudgetError` whose
``min_budget_bytes`` is the least simulated peak seen.

Complexity. Schedule form: O(N² · d) time for ``N`` joint nodes of in-degree ≤ ``d`` (a scan of
the resident tensors per rematerialization attempt), O(N) space, length ≤ 2N. Plan form: at
most ``n`` rounds, each O(n + e) for the scores plus one simulation O(n + e): O(n · (n + e)).
Heuristic: no approximation guarantee; the paper observes ~2x savings on ResNets and little on
feed-forward chains, growing linearly with depth.

Limitations. The plan form recomputes each chosen node once, inside flat checkpoint regions
(the runtime's form), not at arbitrary points as XLA does; the score is XLA's static memory
reduction and ignores compute cost, as XLA's does. The score looks at one node at a time:
where two nodes keep the same storage (a ReLU keeps its output, the next Linear keeps it as
its input) neither alone frees anything, so on a plain MLP the greedy stops almost at once
(the paper reports the same: "very little memory savings on the feed forward network");
``"chen"`` does far better there.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, ClassVar

from ..errors import InfeasibleBudgetError
from ..graph import Graph
from ..plan import Plan, Segment
from ..cost import no_recompute_plan, simulate
from ._config import SolverConfig
from ..cost.schedule import JointGraph, Schedule, with_liveness_frees

__all__ = ["xla_greedy_schedule", "solve_xla_greedy", "plan_from_recomputed", "XlaGreedyConfig"]

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------- schedule form
def xla_greedy_schedule(graph: Graph | JointGraph, memory_limit_bytes: int = 0) -> Schedule:
    """XLA's GreedyRemat on the joint graph under ``memory_limit_bytes`` (0: as low as it goes).

    Returns a :class:`~autoremat.cost.schedule.Schedule` with liveness frees; its
    ``options`` record the limit and the numbers of rematerializations and moves.

    Long by design: XLA's pass (candidate order, the rematerialisation and move decisions, the
    liveness bookkeeping they update) keeps one state."""
    joint = JointGraph.coerce(graph)
    if isinstance(memory_limit_bytes, bool) or not isinstance(memory_limit_bytes, int) or memory_limit_bytes < 0:
        raise ValueError(f"memory_limit_bytes={memory_limit_bytes!r} must be a non-negative int")
    n = len(joint)
    pred, succ, size = joint.pred, joint.succ, joint.size_bytes
    final = joint.final
    future: list[tuple[int, bool]] = [(v, False) for v in range(n)]  # (node, is a remat copy)
    pos = 0
    placed: list[int | None] = []
    uses_left = [len(succ[v]) for v in range(n)]
    resident = [False] * n
    copy_at = [-1] * n  # index in `placed` of the node's current placed copy
    used_since = [False] * n  # a placed operation used the current copy
    blocked = [False] * n  # rematerialized once: never again (XLA's blacklist)
    live: set[int] = set()
    mem = 0
    remats = moves = 0
    while pos < len(future):
        w, _ = future[pos]
        pos += 1
        for p in pred[w]:
            assert copy_at[p] >= 0 and resident[p], "input not resident in GreedyRemat, please report"
            uses_left[p] -= 1
            used_since[p] = True
        if not resident[w]:
            resident[w] = True
            live.add(w)
            mem += size[w]
        copy_at[w] = len(placed)
        placed.append(w)
        used_since[w] = False
        for p in (*pred[w], w):
            if resident[p] and uses_left[p] == 0 and p != final:
                resident[p] = False
                live.discard(p)
                mem -= size[p]
        while mem > memory_limit_bytes:
            best: tuple[tuple[int, int, int], int, bool] | None = None
            for c in live:
                if c == w or c == final or blocked[c] or size[c] == 0 or uses_left[c] == 0:
                    continue
                if any(copy_at[p] < 0 for p in pred[c]):
                    continue
                reduced = size[c] - sum(size[p] for p in pred[c] if not resident[p])
                if reduced <= 0:
                    continue
                move = not used_since[c]
                key = (0 if move else 1, -reduced, c)
                if best is None or key < best[0]:
                    best = (key, c, move)
            if best is None:
                break
            _, c, move = best
            blocked[c] = True
            if move:
                placed[copy_at[c]] = None
                copy_at[c] = -1
                moves += 1
            else:
                remats += 1
            for p in pred[c]:
                uses_left[p] += 1
                if not resident[p]:  # XLA extends the input's live range to the new use
                    resident[p] = True
                    live.add(p)
                    mem += size[p]
            resident[c] = False
            live.discard(c)
            mem -= size[c]
            users = set(succ[c])
            at = next(i for i in range(pos, len(future)) if future[i][0] in users)
            future.insert(at, (c, True))
    computes = [v for v in placed if v is not None]
    return with_liveness_frees(joint, computes, algorithm="xla-greedy",
                               options={"memory_limit_bytes": memory_limit_bytes, "remats": remats,
                                        "moves": moves})


# ---------------------------------------------------------------------------- plan form
def plan_from_recomputed(graph: Graph, recomputed: set[int]) -> Plan:
    """The plan whose recompute segments are the maximal runs of ``recomputed`` (execution
    order), or single nodes in module-level graphs; everything else runs as usual."""
    module = graph.meta.get("mode") == "module"
    segs: list[Segment] = []
    run: list[int] = []
    flag: bool | None = None
    for v in graph.nodes:
        r = v in recomputed
        if run and (r != flag or (module and r)):
            segs.append(Segment(tuple(run), recompute=bool(flag)))
            run = []
        run.append(v)
        flag = r
    if run:
        segs.append(Segment(tuple(run), recompute=bool(flag)))
    return Plan(segs, solver="xla-greedy", options={"recomputed_nodes": len(recomputed)})


class _Scorer:
    """XLA's memory reduction of putting one more node in a recompute region (plan form)."""

    def __init__(self, graph: Graph) -> None:
        self.g = graph
        self.module = graph.meta.get("mode") == "module"
        nd = [graph.node(v) for v in graph.nodes]
        self.alloc = [int(graph.node(graph.root(v))["alloc_bytes"]) for v in graph.nodes]
        self.keeps = [tuple(sorted({graph.root(u) for u in d["saves"]})) if d["requires_grad"] else ()
                      for d in nd]
        self.extra = [int(d["extra_saved_bytes"]) if d["requires_grad"] else 0 for d in nd]
        self.loss_keeps = [graph.root(int(u)) for u in graph.meta["loss_saves"]]

    def runs(self, chosen: set[int]) -> dict[int, tuple[int, int]]:
        """Node -> (first, last) of its recompute region."""
        out: dict[int, tuple[int, int]] = {}
        n = len(self.g)
        v = 0
        while v < n:
            if v not in chosen:
                v += 1
                continue
            if self.module:
                out[v] = (v, v)
                v += 1
                continue
            a = v
            while v + 1 < n and v + 1 in chosen:
                v += 1
            for u in range(a, v + 1):
                out[u] = (a, v)
            v += 1
        return out

    def region_inputs(self, a: int, b: int) -> set[int]:
        g = self.g
        return {g.root(u) for v in range(a, b + 1) for u in g.pred(v) if u < a}

    def holds(self, chosen: set[int], runs: dict[int, tuple[int, int]]) -> dict[int, int]:
        cnt: dict[int, int] = {}
        for v in self.g.nodes:
            if v not in chosen:
                for r in self.keeps[v]:
                    cnt[r] = cnt.get(r, 0) + 1
        for r in self.loss_keeps:
            cnt[r] = cnt.get(r, 0) + 1
        for a, b in set(runs.values()):
            for r in self.region_inputs(a, b):
                cnt[r] = cnt.get(r, 0) + 1
        return cnt

    def reduction(self, c: int, chosen: set[int], runs: dict[int, tuple[int, int]], cnt: dict[int, int]) -> int:
        lo = hi = c
        old_regions: list[tuple[int, int]] = []
        if not self.module:
            if c - 1 in runs:
                old_regions.append(runs[c - 1])
                lo = runs[c - 1][0]
            if c + 1 in runs:
                old_regions.append(runs[c + 1])
                hi = runs[c + 1][1]
        delta: dict[int, int] = {}
        for r in self.keeps[c]:
            delta[r] = delta.get(r, 0) - 1
        for a, b in old_regions:
            for r in self.region_inputs(a, b):
                delta[r] = delta.get(r, 0) - 1
        for r in self.region_inputs(lo, hi):
            delta[r] = delta.get(r, 0) + 1
        reduced = self.extra[c]
        for r, d in delta.items():
            before = cnt.get(r, 0)
            after = before + d
            if before > 0 and after <= 0:
                reduced += self.alloc[r]
            elif before <= 0 and after > 0:
                reduced -= self.alloc[r]
        return reduced


@dataclass(frozen=True)
class XlaGreedyConfig(SolverConfig):
    """``xla-greedy`` takes no options."""

    solver: ClassVar[str] = "xla-greedy"


def solve_xla_greedy(graph: Graph, budget_bytes: int, *, config: dict[str, Any] | XlaGreedyConfig | None = None
                     ) -> Plan:
    """GreedyRemat mapped to a canonical plan (module docstring); judged by :func:`simulate`.

    ``config`` takes no options (an unknown key is a ``ValueError``).
    """
    XlaGreedyConfig.parse(config)
    plan = no_recompute_plan(graph)
    plan.solver = "xla-greedy"
    sim = simulate(graph, plan, check=False, record=False)
    least = sim.peak_bytes
    if sim.peak_bytes <= budget_bytes:
        return plan
    scorer = _Scorer(graph)
    candidates = [v for v in graph.nodes if graph.node(v)["recomputable"] and graph.node(v)["requires_grad"]]
    time_s = [float(graph.node(v)["time_s"]) for v in graph.nodes]
    chosen: set[int] = set()
    while True:
        runs = scorer.runs(chosen)
        cnt = scorer.holds(chosen, runs)
        best: tuple[int, float, int] | None = None
        for c in candidates:
            if c in chosen:
                continue
            red = scorer.reduction(c, chosen, runs, cnt)
            if red <= 0:
                continue
            key = (-red, time_s[c], c)
            if best is None or key < best:
                best = key
        if best is None:
            break
        chosen.add(best[2])
        plan = plan_from_recomputed(graph, chosen)
        sim = simulate(graph, plan, check=False, record=False)
        least = min(least, sim.peak_bytes)
        if sim.peak_bytes <= budget_bytes:
            logger.debug("xla-greedy: %d nodes recomputed, simulated peak %d <= budget %d",
                         len(chosen), sim.peak_bytes, budget_bytes)
            return plan
    raise InfeasibleBudgetError(budget_bytes, least, solver="xla-greedy")
