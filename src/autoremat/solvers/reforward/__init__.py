"""``"reforward"``: Feng & Huang's Re-forwarding on linear and arbitrary computation graphs.

Problem. Keep a subset ``V_R`` of the tensors during the first forward and re-forward the
missing ones segment by segment during backward, minimising the paper's memory cost
(Eqn. 1 of [1]): ``Σ_{v ∈ V_R} l(v) + max_segment l(segment)``, the bytes kept plus the
largest re-forward.

Code: :mod:`.tree` (the vertex model, closed sets and the division tree,
Algorithms 2-4), :mod:`.search` (Algorithms 1 and 5), this package (entry points,
solutions as plans, the budgeted solver).

Paper: .. [1] J. Feng, D. Huang, "Cutting Down Training Memory by Re-forwarding",
   ICLR 2019 submission (later published as "Optimal Gradient Checkpoint Search for
   Arbitrary Computation Graphs", CVPR 2021). Algorithm 1 (linear computation graphs),
   Algorithms 2-5 (arbitrary computation graphs), Appendices A (theory) and B (complexity).

Method.

* **Vertices and costs.** A vertex is a node's output tensor; a virtual source (the model
  input, before every node without predecessors) and a virtual sink (the loss, after every
  sink and every model output) close the graph, both of cost 0. The paper uses one cost
  ``l(v)``, the tensor size; we separate what a vertex costs in each term of Eqn. 1:
  ``keep(v)``, the bytes of the storage that keeping ``v`` holds (its own ``alloc_bytes``,
  the storage it lives in for a view), and ``inner(v)``, the bytes it brings back while its
  segment is re-forwarded (its storage when some node's backward saves it, plus its
  ``extra_saved_bytes``: batch-norm statistics, pooling indices…).
* **Linear graphs (Algorithm 1).** For every candidate max term ``C = l(v_i, v_j)``, in
  decreasing order, the accessibility graph links ``v_a → v_b`` iff ``l(v_a, v_b) ≤ C`` and
  the shortest source→target path (vertex weights ``keep``) is the kept set. The edges into
  ``v_b`` form a contiguous range of ``a`` (costs are non-negative), so the accessibility
  graph is never materialised: the shortest path is a sliding-window minimum, O(n) per
  max term instead of O(n²) (same paths). The skipping rule of Algorithm 1 (line 7) is
  applied: a solution whose actual max term is ``B < C`` is also the solution of every
  candidate in ``[B, C)``, which is skipped. :func:`reforward_linear`.
* **Arbitrary graphs (Algorithms 2-5).** Closed sets (Definition 1) are single-entry,
  single-exit regions between a head ``v_i`` and a tail ``v_j``. The division tree
  (Definition 9) is built top-down from the whole graph: a closed set with splitting
  vertices (Algorithm 2; found in one sweep, as a vertex splits ``[s_ij]`` iff no edge of
  it jumps over the vertex in topological order) is *type 1* and divides into the
  segments between them; a closed set without splitting vertex whose interior has
  several connected components, or which holds the edge ``v_i → v_j`` (Algorithm 3), is
  *type 2* and divides into its branches; otherwise it is *type 3* and divides into its
  maximal split (Algorithm 4). Algorithm 5 then runs, for every candidate max term ``m``
  (costs of the division-tree nodes and of every run of consecutive members of a type-1
  node: the segments a solution can use) in decreasing order with the same skipping
  rule: a closed set whose cost exceeds ``m`` is expanded; in a type-1 set the expanded
  members pin their endpoints and the remaining runs are solved by the linear solver
  with max term ``m``; in type-2/3 sets the other members stay whole and, in type 3, all
  the members' endpoints are kept. :func:`reforward_arbitrary`, :func:`division_tree`.
* **Executable form.** A solution (kept vertices + the interiors re-forwarded together)
  becomes an increasing lower-set sequence (:func:`solution_plan`): each re-forwarded
  interior is one recomputed segment; the tail of an interior runs inside that segment
  when its backward saves one of the interior's tensors (a conv after its input, a
  batch-norm…), as the paper back-propagates the operation (edge) into the tail with the
  re-forwarded tensors; every other kept vertex is a plain segment (so ``cat``/``add``
  tails, which save nothing, let their inputs die after forward: the paper's re-forward
  of each branch on its own). A kept vertex that keeps a tensor of an interior it does
  not close (through a view) just keeps it alive. Blocks are ordered topologically
  (contracting single-entry single-exit regions keeps the graph acyclic; a tail joins
  only the interiors it closes) and the segments are built with
  :func:`~autoremat.plan.segments_from_lower_sets`, whose rules (recomputable nodes, a
  segment that saves something, not the last one) are kept; kept segments are never
  recomputed. Module-level graphs (``meta["mode"] == "module"``) can only recompute one
  module call per segment: there every re-forwarded interior is recomputed one module
  call at a time (their outputs are then kept; module outputs are small next to what the
  calls save inside), which the simulator accounts for.
* **Multi-input operations (assumption 2 of [1] §4.1).** The paper assumes that an
  operation with several inputs computes its input gradients without their values
  (``cat``, ``add``). Our graph knows what every backward keeps (``saves``), so a node
  *breaks* the assumption iff it has two or more predecessors and saves one of them
  (``mul``, ``matmul``…); single-input operations that save their input are the paper's
  model. ``multi_input`` chooses the remedy: ``"store"``, the paper's own ("store all the
  input tensors of this multi-input operation"), pins the saved inputs of every breaking
  node as kept vertices and, unlike the paper, counts them in the kept term, so the
  plans agree with the cost model; ``"merge"`` pins nothing, and at mapping time the
  segments whose tensors a breaking node saves are merged with it into one re-forward
  (its unsaved inputs from other segments are then kept as that segment's inputs; not in
  Eqn. 1); ``"both"`` (default) explores both families. Graphs without breaking nodes get
  one family. Nodes the runtime cannot recompute (``recomputable=False``) and the tensors
  they save are always pinned.
* **Budget.** The paper minimises memory only. We compute its whole family of solutions
  (one per distinct max term, the least-Eqn.-1 one included), map each to a plan, judge
  each with :func:`autoremat.simulate` together with the plan that recomputes nothing,
  and return the plan with the least simulated extra time whose simulated peak fits the
  budget (ties: lower peak). A budget that does not bind recomputes nothing; the candidate
  set does not depend on the budget, so the extra time never rises as the budget grows.
  When no candidate fits, :class:`~autoremat.errors.InfeasibleBudgetError` reports the
  least simulated peak found. When the family is larger than ``max_candidates``
  (default 128), the quarter with the least Eqn.-1 cost (tight budgets) and an even
  spread over the rest of the family (the time-memory trade-off) are simulated.

Config (:class:`ReforwardConfig`, or a dict of its fields; an unknown key is a ``ValueError``):
``multi_input`` (``"both"``, ``"store"`` or ``"merge"``),
``max_candidates`` (int ≥ 1), ``method`` (``"auto"``: Algorithm 5, which reduces to
Algorithm 1 on chains; ``"linear"``: Algorithm 1 itself, only for chains).

Complexity (N vertices, E edges, w = ⌈N/64⌉ machine words per bitset). Ancestor and
descendant bitsets: O(E·w). Division tree: type-1/2 divisions O(p + e) per node of p
vertices and e edges; a type-3 node tests its O(p²) vertex pairs with O(1) bitset
operations each, O(p²·w) (a pair whose region is only partly independent and has two
branches at both ends adds an O(p·w) flood fill: O(p³·w) worst case, none on the zoo).
The interiors of one tree level are disjoint, so a level costs O(N²·w) and the tree
O(N³·w) in the worst case (the paper's Algorithm 5 steps 1-2: O(N⁴)); real networks
have a handful of levels. Max terms: R ≤ O(N²) candidates (all runs of every type-1
node), sorted in O(R log R); each solve costs O(N·w) (the shortest path is O(p) per
type-1 node instead of the paper's O(p²)), and the skipping rule bounds the number of
solves by the number S ≤ R of distinct solutions. Mapping and simulation: O(K·(k·N + E))
for K = min(S, max_candidates) plans of k segments. Space O(N·w + R + S·N). DenseNet-201
at paper size (711 nodes, 2513 edges) takes about 2-3 s on one core, most of it in the
simulator (the paper's prototype: 7335 s for its 506-vertex graph).

Exact / approximate. Exact for the paper's objective (Eqn. 1, with our ``keep``/``inner``
costs) under its two assumptions, as [1] proves; we do not re-prove the greedy step of
Algorithm 5, but the tests check both solvers against an exhaustive search of Eqn. 1 (every
kept set whose re-forwarded parts have one head and one tail) on small random graphs. For
the simulated step peak under a budget it is a heuristic: the candidate plans are the
paper's family, and the simulator chooses among them.

Known limitations. Segments are closed sets with one source and one target (assumption 1
of [1]): e.g. expanding a DenseNet block keeps every concatenation and every layer
output. Eqn. 1 ignores gradients, workspace, the checkpoint inputs the runtime keeps and
what kept nodes save besides their output; the simulator sees them, and the least-Eqn.-1
solution is not always the least simulated peak. Extra time is not optimised: every
vertex that is not kept is re-forwarded once, and the family trades memory for time only
through the max term. Long chains give O(p²) candidate max terms and O(p) distinct
solutions (a 2000-node chain takes about 10 s). Module-level graphs only approximate the
paper (one module call per recomputed segment). Keeping a view keeps its base storage;
``keep`` counts it, but a kept view of a re-forwarded tensor makes that re-forward useless
(the simulator sees it).
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ...errors import InfeasibleBudgetError
from ...graph import Graph
from ...plan import Plan, Segment, segments_from_lower_sets
from ...cost import no_recompute_plan, simulate
from .._config import SolverConfig
from .search import ReforwardSolution, chain_pre, max_terms, solution_family
from .tree import ClosedSet, TreeModel, breaks_multi_input_assumption, build_tree

__all__ = [
    "solve_reforward",
    "reforward_linear",
    "reforward_arbitrary",
    "solution_plan",
    "division_tree",
    "breaks_multi_input_assumption",
    "ReforwardSolution",
    "DivisionNode",
    "MULTI_INPUT_MODES",
]

logger = logging.getLogger(__name__)

MULTI_INPUT_MODES = ("both", "store", "merge")
"""Accepted values of the ``multi_input`` option (see the module docstring)."""

_METHODS = ("auto", "linear")
_DEFAULT_MAX_CANDIDATES = 128


# ====================================================================== public results
@dataclass
class DivisionNode:
    """A closed set of the division tree (Definition 9), in node ids.

    ``head``/``tail`` are ``None`` for the virtual source/sink. ``kind`` is the paper's type:
    1 (splittable), 2 (branched), 3 (non-branched) or 0 (an edge: no interior).
    """

    head: int | None
    tail: int | None
    interior: tuple[int, ...]
    kind: int
    has_edge: bool
    splits: tuple[int, ...] = ()
    """Type 1: the splitting vertices, in order."""
    endpoints: tuple[int, ...] = ()
    """Type 3: interior vertices that are endpoints of the maximal split's members."""
    children: list["DivisionNode"] = field(default_factory=list)
    """The division's members that have an interior (edges are left out)."""


# ====================================================================== public entry points
def _check_graph(graph: Graph) -> None:
    if not isinstance(graph, Graph):
        raise TypeError(f"graph must be an autoremat.Graph (from autoremat.capture), got {type(graph).__name__}")


def _is_chain(graph: Graph) -> bool:
    n = len(graph)
    for v in graph.nodes:
        if graph.succ(v) != ([v + 1] if v + 1 < n else []):
            return False
        if graph.pred(v) != ([v - 1] if v else []):
            return False
    return True


def reforward_linear(graph: Graph) -> list[ReforwardSolution]:
    """Algorithm 1 (LCG solver) on a chain: one solution per distinct max term, decreasing.

    Raises ``ValueError`` unless ``graph`` is a chain ``0 → 1 → … → n-1``.
    """
    _check_graph(graph)
    if not _is_chain(graph):
        raise ValueError("graph must be a chain 0 -> 1 -> ... -> n-1 for the linear solver "
                         "(method='linear'); use method='auto' for arbitrary graphs")
    M = TreeModel(graph, pins_multi_input=True)
    # the chain S*, 0, …, n-1, T* as a type-1 closed set whose members are all edges
    full = sum(1 << x for x in range(1, M.N - 1))
    node = ClosedSet(0, M.N - 1, full, list(range(1, M.N - 1)), M.has_edge(0, M.N - 1))
    node.kind = 1
    node.chain = [0] + node.verts + [M.N - 1]
    node.members = [None] * (len(node.chain) - 1)
    node.cost = M.cost(full)
    pre = chain_pre(M, node)
    # line 1-2: every vertex pair (v_i, v_j) gives a candidate max term l(v_i, v_j)
    terms: set[int] = {0}
    for a in range(pre.p):
        for b in range(a + 1, pre.p + 1):
            if b > a + 1 and pre.pinned[b - 1]:
                break
            terms.add(pre.run_cost(a, b))
    return solution_family(M, node, sorted(terms, reverse=True), "store")


def reforward_arbitrary(graph: Graph, *, multi_input: str = "store") -> list[ReforwardSolution]:
    """Algorithm 5 (ACG solver): one solution per distinct max term, decreasing.

    ``multi_input`` is ``"store"`` or ``"merge"`` (see the module docstring); the plans of
    ``"merge"`` solutions merge segments at mapping time (:func:`solution_plan`).
    """
    _check_graph(graph)
    if multi_input not in ("store", "merge"):
        raise ValueError(f"multi_input={multi_input!r} is not accepted here; expected 'store' or 'merge'")
    M = TreeModel(graph, pins_multi_input=multi_input == "store")
    root = build_tree(M)
    return solution_family(M, root, max_terms(M, root), multi_input)


def division_tree(graph: Graph, *, multi_input: str = "store") -> DivisionNode:
    """The division tree of ``graph`` (with the virtual source and sink), in node ids."""
    _check_graph(graph)
    if multi_input not in ("store", "merge"):
        raise ValueError(f"multi_input={multi_input!r} is not accepted here; expected 'store' or 'merge'")
    M = TreeModel(graph, pins_multi_input=multi_input == "store")
    root = build_tree(M)

    def end(x: int) -> int | None:
        return None if x in (0, M.N - 1) else x - 1

    def conv(node: ClosedSet) -> DivisionNode:
        return DivisionNode(
            head=end(node.head), tail=end(node.tail), interior=M.nodes_of(node.mask), kind=node.kind,
            has_edge=node.has_edge, splits=tuple(x - 1 for x in node.chain[1:-1]),
            endpoints=M.nodes_of(node.ends_mask), children=[conv(c) for c in node.children])

    return conv(root)


def solution_plan(graph: Graph, solution: ReforwardSolution) -> Plan:
    """The executable plan of one solution (see "Executable form" in the module docstring)."""
    _check_graph(graph)
    segs = _plan_segments(graph, TreeModel(graph, pins_multi_input=False), solution.groups)
    if segs is None:
        raise ValueError("the solution's segments cannot be ordered as lower sets (a kept node saves "
                         "a tensor of a segment it does not close); please report")
    return Plan(segs, solver="reforward", graph_fingerprint=graph.fingerprint,
                options={"max_term_bytes": solution.max_term_bytes, "multi_input": solution.multi_input})


def _plan_segments(graph: Graph, M: TreeModel, groups: Sequence[Sequence[int]]) -> list[Segment] | None:
    """Map re-forwarded interiors to segments of an increasing lower-set sequence.

    Long by design: the mapping from the paper's kept vertices to lower-set segments handles the
    multi-input remedies and non-recomputable nodes in one pass over the groups."""
    n = len(graph)
    if n == 0:
        return []
    owner = [-1] * n
    for gi, grp in enumerate(groups):
        for v in grp:
            owner[v] = gi
    uf = list(range(len(groups)))

    def find(a: int) -> int:
        while uf[a] != a:
            uf[a] = uf[uf[a]]
            a = uf[a]
        return a

    joined = [-1] * n
    for v in range(n):
        if owner[v] >= 0:
            continue
        # v closes the segments it is the tail of (a predecessor inside) and saves a tensor of;
        # a tensor of another segment that v keeps (through a view) just stays alive
        tails_of = {owner[u] for u in graph.pred(v) if owner[u] >= 0}
        gs = {owner[x - 1] for x in M.saves[v + 1] if owner[x - 1] in tails_of}
        if gs:
            first, *rest = sorted(gs)
            r = find(first)
            for o in rest:
                uf[find(o)] = r
            joined[v] = first
    # blocks: merged groups (+ the kept nodes that joined them) and single kept nodes
    block = [0] * n
    rep_block: dict[int, int] = {}
    members: list[list[int]] = []
    wanted: list[bool] = []
    for v in range(n):
        gi = owner[v] if owner[v] >= 0 else joined[v]
        if gi >= 0:
            r = find(gi)
            b = rep_block.get(r)
            if b is None:
                b = rep_block[r] = len(members)
                members.append([])
                wanted.append(True)
        else:
            b = len(members)
            members.append([])
            wanted.append(False)
        block[v] = b
        members[b].append(v)
    nb = len(members)
    succ_b: list[set[int]] = [set() for _ in range(nb)]
    indeg = [0] * nb
    for v in range(n):
        bv = block[v]
        for w in graph.succ(v):
            bw = block[w]
            if bw != bv and bw not in succ_b[bv]:
                succ_b[bv].add(bw)
                indeg[bw] += 1
    heap = [(members[b][0], b) for b in range(nb) if indeg[b] == 0]
    heapq.heapify(heap)
    order: list[int] = []
    while heap:
        _, b = heapq.heappop(heap)
        order.append(b)
        for c in succ_b[b]:
            indeg[c] -= 1
            if indeg[c] == 0:
                heapq.heappush(heap, (members[c][0], c))
    if len(order) != nb:
        return None
    module = graph.meta.get("mode") == "module"
    parts: list[list[int]] = []
    flags: list[bool] = []
    for b in order:
        if not wanted[b]:
            if parts and not flags[-1]:
                parts[-1].extend(members[b])
            else:
                parts.append(list(members[b]))
                flags.append(False)
        elif module:
            for v in members[b]:
                parts.append([v])
                flags.append(True)
        else:
            parts.append(list(members[b]))
            flags.append(True)
    lower: list[list[int]] = []
    acc: list[int] = []
    for part in parts:
        acc = acc + part
        lower.append(acc)
    segs = segments_from_lower_sets(graph, lower)
    assert len(segs) == len(flags), "segments lost in segments_from_lower_sets, please report"
    return [Segment(s.nodes, recompute=s.recompute and f) for s, f in zip(segs, flags)]


@dataclass(frozen=True)
class ReforwardConfig(SolverConfig):
    """Options of ``reforward`` (see the module docstring)."""

    solver: ClassVar[str] = "reforward"
    multi_input: str = field(default="both", metadata={"help": f"multi-input vertices: one of {MULTI_INPUT_MODES}"})
    max_candidates: int = field(default=_DEFAULT_MAX_CANDIDATES,
                                metadata={"help": "candidate plans simulated when the family is larger"})
    method: str = field(default="auto", metadata={"help": f"one of {_METHODS}: Algorithm 5, or Algorithm 1 (chains)"})


def solve_reforward(graph: Graph, budget_bytes: int, *, config: dict[str, Any] | ReforwardConfig | None = None
                    ) -> Plan:
    """Re-forwarding under a step-peak budget (see the module docstring)."""
    _check_graph(graph)
    cfg = ReforwardConfig.parse(config)
    multi_input = cfg.multi_input
    if multi_input not in MULTI_INPUT_MODES:
        raise ValueError(f"multi_input={multi_input!r} is not accepted; expected one of {list(MULTI_INPUT_MODES)}")
    max_candidates = cfg.max_candidates
    if isinstance(max_candidates, bool) or not isinstance(max_candidates, int) or max_candidates < 1:
        raise ValueError(f"max_candidates={max_candidates!r} must be an int >= 1")
    method = cfg.method
    if method not in _METHODS:
        raise ValueError(f"method={method!r} is not accepted; expected one of {list(_METHODS)}")

    if method == "linear":
        family = reforward_linear(graph)
    else:
        modes = ["store", "merge"] if multi_input == "both" else [multi_input]
        if multi_input == "both" and not breaks_multi_input_assumption(graph):
            modes = ["store"]  # the two remedies coincide
        family = []
        for mode in modes:
            family.extend(reforward_arbitrary(graph, multi_input=mode))
    chosen = _spread(family, max_candidates)
    if len(chosen) < len(family):
        logger.info("reforward: simulating %d of %d solutions (max_candidates=%d)",
                    len(chosen), len(family), max_candidates)

    base = no_recompute_plan(graph)
    sim = simulate(graph, base, check=False, record=False)
    tried: list[tuple[float, int, int, Plan]] = [(sim.extra_time_s, sim.peak_bytes, 0, base)]
    seen: set[tuple[tuple[tuple[int, ...], bool], ...]] = {tuple((s.nodes, s.recompute) for s in base.segments)}
    M_plain = TreeModel(graph, pins_multi_input=False)
    for sol in chosen:
        segs = _plan_segments(graph, M_plain, sol.groups)
        if segs is None:
            logger.warning("reforward: skipped a solution whose segments cannot be ordered (max term %d)",
                           sol.max_term_bytes)
            continue
        key = tuple((s.nodes, s.recompute) for s in segs)
        if key in seen:
            continue
        seen.add(key)
        plan = Plan(segs, solver="reforward", options={
            "multi_input": sol.multi_input, "max_term_bytes": sol.max_term_bytes,
            "paper_kept_bytes": sol.kept_bytes, "paper_reforward_bytes": sol.reforward_bytes,
            "kept_nodes": len(sol.kept)})
        s = simulate(graph, plan, check=False, record=False)
        tried.append((s.extra_time_s, s.peak_bytes, len(tried), plan))
    fits = [t for t in tried if t[1] <= budget_bytes]
    if not fits:
        raise InfeasibleBudgetError(budget_bytes, min(t[1] for t in tried), solver="reforward")
    extra, peak, _, plan = min(fits, key=lambda t: (t[0], t[1], t[2]))
    plan.solver = "reforward"
    plan.options.update({"solutions": len(family), "simulated": len(tried)})
    plan.budget_bytes = int(budget_bytes)
    plan.graph_fingerprint = graph.fingerprint
    plan.predicted_peak_bytes = int(peak)
    plan.predicted_extra_time_s = float(extra)
    return plan


def _spread(family: list[ReforwardSolution], k: int) -> list[ReforwardSolution]:
    """At most ``k`` solutions: the quarter with the least Eqn.-1 cost, the rest evenly spread.

    The family runs from "re-forward everything" to "keep everything"; the least-memory end
    matters for tight budgets and the spread for the time-memory trade-off of loose ones.
    """
    if len(family) <= k:
        return list(family)
    by_cost = sorted(range(len(family)), key=lambda i: (family[i].cost_bytes, i))
    picks = set(by_cost[: max(1, k // 4)])
    slots = k - len(picks)
    for s in range(slots):
        picks.add(round(s * (len(family) - 1) / max(slots - 1, 1)))
    return [family[i] for i in sorted(picks)]
