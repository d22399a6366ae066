"""``"dp-exact"`` and ``"dp-approx"``: Kusumoto et al.'s dynamic programme over lower sets.

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
for min); dp-exact finds it with the same label-setting search run on the time each transition
leaves out, ``T(L' \\ L) - t(L -> L')`` (its boundary, and the whole last segment): every
sequence ends in ``V``, so these sum to ``T(V)`` less its recomputation time, and the first label
of ``V`` has the most. Its buckets are the nodes' common time unit where they have one (exact in
time whatever ``T(V)`` spans: only the buckets it reaches exist), else a sixteenth of the table's
quantum (PSPNet, FLOP times: with the table's width the search found 0.24 % less time than the
table, with a quarter or a sixteenth of it the same, at the same speed). A decision: ties (same time, same kept bytes at ``V``) may go to another sequence than the table's
(on 600 seeded random DAGs with 3-12 nodes both fell back to the least budget's sequence on the
same 5 (graph, budget) pairs and nowhere else; on one graph of the tests the search's sequence
simulated above the least budget where the table's did not, and the plan fell back).

Speed (same results as the direct implementation, whose answers ``tests/solvers/kusumoto/golden``
keeps as data and compares against, but for dp-exact's memory-centric ties and time grid, above). dp-approx: the time-centric search relaxes each expanded
label's successors with numpy into a dense ``(time bucket, set)`` table of pending labels (least
``m``, then least ``t``, first arrival kept, as the dict buckets did; grids above ``2**23``
cells use dict buckets); an expansion costs ~20 numpy calls on short arrays, so their per-call
overhead is the search's cost (``count_nonzero`` rather than ``ndarray.any()``, ``bisect`` on a
list of keys rather than ``searchsorted``: 15-25 % per search, same sequences). Finding the
least budget is the direct implementation (its cost is pricing the transitions, ~2-3 µs each in
Python; at DenseNet-161's least budget with FLOP times 30k of them, 0.08 s).
dp-exact: a transition's time, kept bytes and dangling roots come from the lower set's boundary
(a few nodes; kept per state, as array columns aligned with its successor list), and its replay is skipped when a lower bound of its need already
exceeds what the budget leaves: the kept bytes it adds and the gradients alive when its backward
starts; for a recomputed segment also, when its replay reaches its last saving node, the copies of
the storages its own nodes save, their extras, the parameter gradients of the nodes after ``L'``,
the dangling roots it holds and the gradient buffers no backward of the segment touches, and at
its last holding node that node's own backward and the own gradient buffers of the segment's
nodes up to it still alive (:meth:`autoremat.cost.backward_floor.BackwardFloor.at_stop`). When
that bound fits, a tighter one is tried before the replay (:meth:`.exact.ExactDP.tight_need`,
a sweep of the segment's backward without the replay's bookkeeping, :mod:`autoremat.cost.backward_floor`,
cached per pair): at each node's backward, its inputs' and parameters' gradients and workspace,
the gradient buffers alive then (own or shared by pass-through readers) and the recomputed
storages still saved. Finding
PSPNet's least budget (paper size, papers' times) replays ~10k transitions instead of ~115k (on
the transitions it replays, the first bound is ~50% of the need, the tighter one ~80%). Both:
the search is cached per graph object (held weakly; a signature of its content detects edits;
its last three option sets), so that ``min_budget(g)`` — or a solve that raises
:class:`~autoremat.errors.InfeasibleBudgetError` — followed by ``solve(g, b)`` finds the least
budget once; a call interrupted mid-way drops its search from the cache.

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
* ``dp-approx`` uses a closed form (:class:`autoremat.cost.closed_form.ClosedForm`) so that a transition costs O(1): the state
  is the paper's ``M(U)`` (every boundary storage charged when its segment ends) and the segment's
  peak is a sparse-table range maximum, per run of consecutive node ids of ``S``, of "copies of the
  storages saved up to ``v`` + gradients whose last reader is at or after ``v`` + transients +
  parameter gradients". On the zoo graphs it is within 0-5% of the simulator on most sequences,
  more where ``M(U)`` keeps storages the simulator frees (up to ~30% on U-Net's skips), and it
  can be a few percent under.

Checks. Because the models are not the simulator, every plan is simulated: when its peak exceeds
the budget, the DP budget is lowered by the excess and the DP re-solved (``max_tightenings``,
default 24). The closed form can be wrong both ways, so that dp-approx used to miss plans the
simulator admits (over) and to run out of tightenings (under): then it returned the sequence
found at the least DP budget, at up to 9.8x Chen's extra time (a U-Net-like network, least budget)
or failed where Chen's plan fit (Inception-v3 at CPU size, Chen's least budget; 6-layer
transformer blocks). Now each solve also reads Chen's plans (:func:`~autoremat.solvers.chen.chen_plans`,
simulated once per search) and dp-approx has a *second opinion*, :class:`~.exact.ExactDP` (the
exact model) over its family plus the lower sets of Chen's plans, asked where the closed form's
plan does not fit after its tightenings, where it recomputes more than Chen's cheapest plan
that fits, and on every budget of a graph of at most :data:`.search.EXACT_ALWAYS_NODES` (40)
nodes (where it costs little: that keeps the cost non-increasing in the budget on the small
graphs the tests enumerate); its least budget is the exact model's where Chen's least plan is
below the closed form's. The answer is the cheapest (then the first) of: the DP's plan, the exact
model's, Chen's cheapest plan that fits and the least-budget plan; so dp-approx (and dp-exact)
never recompute more than Chen's method wherever its plan fits, and their least budget is never
above Chen's (``tests/solvers/kusumoto/test_search.py``: a few networks of each family fast; the zoo,
100 seeded networks of four families and 6-layer BERT/Llama under ``-m slow``). Measured by the
session that wrote this (x86_64, 2 cores, shared; 100 seeded networks of 30-300 nodes and the zoo at
CPU size, at Chen's least budget, 50/60/75/90 % of the unoptimised peak and halfway between Chen's
least and the peak): before, 31 of ~550 (graph, budget) pairs recomputed more than Chen's plan
or had none (23 fell back, all on transformer blocks; up to 1.17x Chen's on chains with skips);
after, none; the exact model decided 31 of 545 solves and Chen's or the least-budget plan none;
dp-approx then spent 1.0-2.3 s on 9 transformer solves at low budgets (the exact model), a
tenth of a second or less elsewhere. Re-measured by ``benchmarks/optimum_gaps.py`` (x86_64,
2 cores, CPU only, shared/loaded): on the 7 zoo models (24 budgets) and 12 seeded networks (36
budgets) dp-approx was never behind Chen's plan and logged no warning. The chosen plan's origin is ``plan.options["chosen"]``.

Feasibility. dp-approx fills the table with the least kept bytes per set. dp-exact searches
depth first (:meth:`.dive.Dive.run`): from a state it follows the first
transition that fits, largest lower set first, and backtracks; a state is expanded again only
when reached with fewer kept bytes, so a ``None`` proves that no sequence fits. Whether ``V``
can be reached from a state depends on the budget only through the room ``B - m``, so the
probes of one least-budget search share what they learn (the rooms at which a state failed or
succeeded). Its successors are priced lazily (a cheap bound first, the bookkeeping only for
those it admits). Dijkstra on ``m``, the search before, settles every state whose ``m`` is
below that of ``V`` and prices all their successors: on GoogLeNet (8838 lower sets, thousands
of successors per state early in the network) one probe did not finish in 264 s.

Least budget (:func:`min_budget`). As in §5.1, a binary search over bytes on the DP's
feasibility finds the least DP budget ``B*`` (galloping up from 1/64 of the unoptimised need, by
x1.25 for dp-approx and x1.1 for dp-exact, then alternating halving probes with probes one byte
below the upper end, which a successful probe lowers to its sequence's peak). A probe above the
answer prices every transition its budget admits (dp-approx's feasibility table visits every
set; dp-exact's probes pay replays), so the gallop climbs in small steps: with x2, dp-approx's
first successful probe on DenseNet-121 (FLOP times) landed at 1.79x the answer and priced 47.6k
transitions, 80 % of the whole search. Side by side (5 interleaved rounds, least budget plus a
solve at it, same answers): x2 -> x1.25 took DenseNet-121 0.66/0.76 s -> 0.47/0.53 s (FLOP
times), ResNet-152 0.46 -> 0.16 s, Inception-v3 0.34 -> 0.23 s, GoogLeNet 0.13 -> 0.09 s, PSPNet
(papers' times) 0.15 -> 0.09 s; DenseNet-161 stayed at 0.69-0.75 s (load average ~1). The
solver's minimum is the smaller of the unoptimised peak and the simulated peak of the sequence
found at ``B*`` (or Chen's least plan, or for dp-approx the exact model's, when lower: see
"Checks"). For dp-exact two sequences are found there and the one that simulates lower is
kept (the least-kept one on ties): the depth-first dive's (the first that fits) and, when it
takes at most 20k labels (``_LEAST_KEPT_LABELS``), the one with the least kept bytes
(:meth:`.dive.Dive.least_kept`, what the search before the dive returned). Either may
simulate lower: on 300 seeded random DAGs of 12-15 nodes the dive's alone simulated higher on 6
(by up to 23 %) and lower on 11; with both, never higher. On the zoo at paper size the
least-kept search completes on ResNet-50, ResNet-152 and U-Net and gives up at the limit on the
DenseNets, PSPNet and GoogLeNet, adding 0.04-0.5 s to the minimum (DenseNet-121 the most); where
run without the limit (those seven and GoogLeNet without batch norm) it never simulated lower
than the dive's (higher on PSPNet, by 0.02 %). A budget below the
minimum raises
:class:`~autoremat.errors.InfeasibleBudgetError` with it as ``min_budget_bytes``, and every
budget at or above it gets a plan. ``objective="memory"`` uses ``B*`` whatever the budget: it
returns the sequence with the most recomputation at ``B*`` when it simulates within the budget
(even if the budget would fit without recomputation: asking for memory-centric is asking for
the least memory), else the sequence found at ``B*``.

Complexity, with ``F`` the family size (``n + 2`` for dp-approx, up to ``2**n`` lower sets for
dp-exact) and ``Q`` the time slots: a DP run is O(F²) transitions times O(Q) labels, each
transition O(1) (closed form, plus its boundary) or O(|S| + edges of S) (replay, once per
transition and dangling set, cached, and only where the lower bound admits it);
:func:`min_budget` adds O(log B) feasibility runs (about 15-50). Space O(F²) priced transitions
plus O(Q·F) labels (a dense ``Q × F`` table for dp-approx's time-centric search). Measured on one
core of a 2-core machine shared with other jobs, zoo at paper size (fx capture on the meta
device, papers' times), the least budget plus one solve at it on a fresh graph, medians:
dp-approx: one search (the least budget) as before, 0.2-0.3 s up to 571 nodes and 0.3-0.4 s on
DenseNet-201 (711 nodes) at load average ~1, about twice that at load ~3; the solve at the least
budget that follows reuses it (before: a second search), and a solve at a budget between the
least and the unoptimised peak spends 0.02-0.1 s (papers' times) or up to ~0.5 s (FLOP-based
times, 500 time buckets; before: 2-4 s) in the time-centric search;
dp-exact, 0.03 s (VGG19, 47 lower sets), 0.6 s (ResNet-50, 240; before this version, side by
side at the same load: 12 s), 3 s (U-Net, 300; before: 10.7 s), 3 s (ResNet-152, 580), 9 s
(DenseNet-121, 432), ~23 s (DenseNet-161, 572), ~53 s (DenseNet-201, 712, long segments),
17-35 s (PSPNet, 1545; before: 252 s; ~1 GB of caches); GoogLeNet (8838 lower sets) did not
finish and exhausted 23 GB of memory (per-state transition caches), so it stays on the
fallback. The tighter bound then took, side by side with the code before it on the same machine
(interleaved, two rounds): PSPNet 28-34 s -> 18-24 s (time-centric), 45-52 s -> 33 s
(memory-centric); DenseNet-121 14-15 s -> 8-10 s, 29-33 s -> 26-28 s; GoogLeNet still used
11 GB within 5 minutes without an answer. The depth-first feasibility search, the per-state
columns of priced transitions and the memory-centric table's replay filter (see "Feasibility"
and "Algorithm") then took, side by side with the code before them (fresh processes,
interleaved, papers' times unless said, least budget plus one solve at it): PSPNet 8.3 / 8.2 s
-> 5.5 / 5.5 s (time-centric), 12.6 / 12.4 s -> 6.6 / 6.5 s (memory-centric), 10.6 / 10.6 s ->
8.2 / 8.3 s (time-centric, FLOP times); DenseNet-121 3.5 / 3.4 s -> 3.0 / 3.0 s, 11.1 / 10.9 s
-> 2.4 / 2.4 s; DenseNet-161 7.1 / 7.1 s -> 4.2 / 4.1 s, 29.0 / 29.3 s -> 4.6 / 4.6 s;
DenseNet-201 9.2 / 9.0 s -> 6.5 / 6.5 s, 41.9 / 42.0 s -> 8.1 / 8.1 s; ResNet-152 1.5 / 1.5 s ->
1.2 / 1.2 s, 2.7 / 2.7 s -> 1.3 / 1.3 s; ResNet-50 0.29 / 0.29 s -> 0.19 / 0.19 s, 0.46 / 0.45 s
-> 0.24 / 0.24 s; U-Net 1.5 / 1.5 s -> 1.6 / 1.7 s (its time-centric solve no longer finds the
transitions Dijkstra priced), 2.0 / 2.0 s -> 1.7 / 1.7 s (time-centric, then memory-centric; two
rounds each, the order of old and new flipped between them). GoogLeNet (8838 lower sets) now
gets an answer: its least budget in 0.8 s, the time-centric plan at it in ~2 min (peak RSS 3.6
GB) and the memory-centric one in ~5 min (2.6 GB); both price ~7-10 million transitions, a few
microseconds of Python each. Pricing a state's successors at once (:mod:`autoremat.cost.batch_pricing`) and
keeping the time-centric search's candidate labels in numpy chunks (see
:meth:`.labels.LabelSearch.run`) then took the time-centric solve at the least budget,
side by side with the code before (fresh processes, interleaved, two rounds, papers' times):
GoogLeNet 152 / 148 s -> 30 / 25 s (peak RSS 3.5 -> 2.4 GB), GoogLeNet without batch norm (140
nodes, 2715 lower sets, near the papers' 134 nodes) 16.6 / 13.9 s -> 4.6 / 4.1 s, PSPNet 0.39 /
0.35 s -> 0.22 / 0.25 s, DenseNet-201 4.0 / 4.0 s -> 3.6 / 4.0 s, with numpy's overhead on small
graphs (ResNet-50 0.03 -> 0.05 s, U-Net 0.13 -> 0.20 s). What remains on GoogLeNet is the
deferred checks' replays and the batch pricing (23 million candidate labels from 9k expansions);
the memory-centric table was bound by its replays and backward floors (GoogLeNet ~2 min). The
memory-centric search on the time left out (see "Algorithm") then took, side by side with that
table (fresh processes, interleaved, two rounds, least budget, the solve alone): GoogLeNet without
batch norm 16.0 / 16.0 s -> 7.1 / 6.7 s (papers' times), 21.9 / 22.6 s -> 7.4 / 7.7 s (FLOP
times); DenseNet-121 / 161 / 201 1.9 / 3.5 / 5.8 s -> 1.2 / 2.3 / 3.4 s, each with 1-3 more time
units of recomputation (the table's quantum is above the unit there); PSPNet 1.65 -> 2.09 s and
ResNet-152 0.19 -> 0.31 s (numpy's overhead per bucket); U-Net, ResNet-50 unchanged; GoogLeNet
with batch norm 130 s -> 103 s (one round; 79 s once those runs were sorted by state id alone),
its peak RSS 2.8 -> 5.9 GB (56 million candidate labels from 25k expansions pile up in the few
buckets of little time left out, and the per-state columns hold 52 million priced transitions; a
state whose least candidate fails its check reads the others through per-bucket runs sorted by
state). What remains there is the deferred checks (~440k, nearly all rejected by the backward
floor sweep of a pair never swept before; ~21k replays). Adding the level at the segment's last
holding node to the bound priced with each transition (measured before: it would have rejected
76-77 % of the checks the sweep rejected in GoogLeNet's time-centric and googlenet_original's
memory-centric searches, 32 % in googlenet_original's time-centric one) then
took it to 60 s and 4.9 GB (one round each, side by side); the other searches stayed within noise.
Inception-v3 (35684 lower sets) stays out of reach: its least-budget search, watched for 3
minutes, ran 33 probes and then explored a probe near the minimum exhaustively (11.6k states,
84M successor entries, 100M priced transitions, 2.5M backward floors, 4.9 GB); a 10-minute run
reached 20 GB without an answer. Beyond ``max_lower_sets`` (default 500) dp-exact falls back to
dp-approx with a warning at every call (``fallback=False``: a ``ValueError``).

Exact / approximate: dp-exact is exact for the simulator's cost over all canonical strategies,
up to the two exceptions above and the time quantum; dp-approx is approximate (pruned family,
closed-form memory). Limitations: canonical strategies only (each node recomputed at most once,
no nesting, no offload). Module-level graphs run over the executable family: each transition is
priced as ``segments_from_lower_sets`` will run it (a segment of several module calls, or with a
non-recomputable node, runs plainly), so only single module calls are recomputed.

Progress: a dp-exact search (a least-budget probe, the least-kept search, the time- or
memory-centric search) that runs longer than 10 s logs where it is every 10 s at INFO on
``autoremat.solvers.kusumoto`` (its phase and budget, states priced, transitions listed,
replays; :data:`.dive.PROGRESS_EVERY_S`).

Options (``config``): ``objective`` (``"time"`` | ``"memory"``), ``time_slots`` (int),
``max_lower_sets`` (int, dp-exact), ``fallback`` (bool, dp-exact), ``max_tightenings`` (int);
(:class:`~.config.DPConfig`; an unknown key is a ``ValueError``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ...graph import Graph
from ...plan import Plan
from .._config import check_budget
from .config import DPApproxConfig, DPConfig, DPExactConfig
from .search import parse_config, search_for

__all__ = ["solve_dp_exact", "solve_dp_approx", "min_budget", "DPConfig", "DPExactConfig", "DPApproxConfig"]

logger = logging.getLogger(__name__)


def solve_dp_exact(graph: Graph, budget_bytes: int, *, config: Mapping[str, Any] | DPConfig | None = None) -> Plan:
    """Kusumoto et al.'s exact DP (all lower sets) under a step-peak budget; see the package docstring."""
    budget = check_budget(budget_bytes)
    cfg = parse_config(config, "dp-exact")
    return search_for(graph, "dp-exact", cfg).solve(budget, cfg)


def solve_dp_approx(graph: Graph, budget_bytes: int, *, config: Mapping[str, Any] | DPConfig | None = None) -> Plan:
    """Kusumoto et al.'s approximate DP (pruned family) under a step-peak budget; see the package docstring."""
    budget = check_budget(budget_bytes)
    cfg = parse_config(config, "dp-approx")
    return search_for(graph, "dp-approx", cfg).solve(budget, cfg)


def min_budget(graph: Graph, solver: str = "dp-approx", *, config: Mapping[str, Any] | DPConfig | None = None) -> int:
    """The smallest step-peak budget for which ``solver`` (``"dp-approx"`` or ``"dp-exact"``) finds a plan.

    ``solver(graph, b)`` returns a plan for every ``b >= min_budget(graph, solver)`` and raises
    :class:`~autoremat.errors.InfeasibleBudgetError` below it (see the package docstring).
    """
    if solver not in ("dp-approx", "dp-exact"):
        raise ValueError(f"solver={solver!r} has no least-budget search here; expected 'dp-approx' or "
                         "'dp-exact' (autoremat.min_budget takes every solver)")
    if len(graph) == 0:
        return 0
    search = search_for(graph, solver, parse_config(config, solver))
    if search.fallback_reason:
        logger.warning("%s", search.fallback_message)
    return search.minimum().budget_bytes
