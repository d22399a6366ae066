"""Stable plans: the same plan from two captures of one model unless the times really differ.

Measured op times are noisy (on a shared 2-core CPU the per-node times of two captures of a
CPU-size ResNet-50 differed by a median 5-18 %, some nodes by 10x), and a solver that picks
the fastest plan flips between plans whose extra times are within that noise: the same
``autoremat demo`` gave 6 segments then 8. Quantising or smoothing the times did not help
(measured on ten captures each of ResNet-50 and DenseNet-121 under load: the plans still
differed, because a node near a quantisation step still moves and the plans are near-ties),
so stability is decided on the plans instead:

1. the plan is solved on the measured times, as before (the *measured plan*);
2. the same solver solves the same graph with *reference costs*, which do not depend on the
   measurement: every node costs the same (forward ``t``, backward ``2 t``, with ``t`` the
   measured mean node time rounded to a power of two, so the scale is kept for offload plans
   and sums stay exact); the bytes are the measured graph's, so both plans meet the budget;
3. both plans are judged on the measured times, and the *reference plan* is kept unless the
   measured plan is predicted faster by more than ``tolerance`` of its step time (recomputation
   included) (default :data:`DEFAULT_NOISE_TOLERANCE`, 5 %) *and* by more than the capture's own
   timing noise, ``graph.meta["time_noise"]`` (:func:`autoremat.capture.timing_noise`: the share
   of the median node times above each node's fastest repeat).

The reference plan is a function of the graph's structure, bytes and ``t`` only (and of the
budget, the solver and its options), so it is solved once per process: the reference graphs and their
plans are kept by content (:func:`shared_reference`; the last :data:`REFERENCE_GRAPHS_KEPT` graphs
and :data:`REFERENCE_PLANS_KEPT` plans; :func:`clear_reference_memo` forgets them). Solving one
capture at several budgets solves one reference graph, whose per-graph caches (the chain beam's
replays, ``blocks``' profiles) serve every budget; a new capture of the same model (or another
rank's identical graph) at a budget solved before meets its reference plan at once where its
reference costs are the same (``t`` of item 2 rounds to the same power of two; on a machine whose
load changes between captures it may not: ``benchmarks/results/cpu/reference_speed/``). The memo
is keyed by content, not by the solvers' module constants: a program that changes those between
solves clears it. Captures that differ only in their times give the same plan whenever it is
within the tolerance; a plan clearly better on the measured times still wins. The plan records the decision in
``plan.options["stability"]``. Graphs whose times are not measured (synthetic graphs, FLOP
times, the papers' unit times) are solved once, as before: their times are already
deterministic.

Measured on the development machine (x86_64, 2 cores, CPU only; ten captures per model and
load, 2026-11-26): the tolerance that makes every pair of captures agree was 0 % idle, 0.5 %
with one busy process beside the capture and 4.7 % at most (ResNet-50 at 50 %); the reference
plans judged on an idle capture's times were at most 3.3 % slower in extra time than the
measured plans (DenseNet-121 at 35 %), and 2.5 % faster on DenseNet-121 at 50 % (dp-approx is
approximate). With two busy processes on the two cores (every parallel op waits for a time
slice; per-node times up to 100x) the measured plans differ by up to 29 % of the step and the
measured plan won where it was predicted that much faster.

That last case is where the issue-25 target failed on the shared machine (2026-11-27, x86_64, 2
cores, CPU only; ten captures of CPU-size ResNet-50 and DenseNet-121 at 50 %, median of 3
repeats, two busy processes beside them): 2 distinct plans each with the 5 % tolerance alone.
In the ResNet-50 capture whose measured plan won (by 25 % of the step), the first convolution's
median forward was 37.7 ms against 0.48 ms in a quiet capture (78x: slow in most repeats, so
the median kept it) and seven backward times were 18-430x, while the median node was 1.10x.
One capture cannot tell such interference from a real cost, but its repeats show it: the timing
noise of 36 loaded captures was 0.11-0.95 (30 of them over 0.5), so the plan they prefer
must be that much faster, and the reference plan is kept (with it, ten captures each under a load average of 13-14 gave
one plan per model, where the 5 % rule alone gave 1 and 4; see ``CHANGELOG.md``). A capture on
a quiet machine (noise of a few per cent; not measured idle, the machine stayed loaded) still
picks a measured plan that is really faster (``tests/solvers/test_stable.py``).
"""

from __future__ import annotations

import copy
import hashlib
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

from ..errors import InfeasibleBudgetError
from ..graph import Graph
from ..plan import Plan
from ..cost import simulate

__all__ = ["DEFAULT_NOISE_TOLERANCE", "MEASURED_TIME_SOURCES", "REFERENCE_TIME_SOURCE", "REFERENCE_GRAPHS_KEPT",
           "REFERENCE_PLANS_KEPT", "is_measured", "reference_graph", "shared_reference", "clear_reference_memo",
           "stable_plan"]

DEFAULT_NOISE_TOLERANCE = 0.05
"""Fraction of the planned step time by which a measured plan must beat the reference plan."""

MEASURED_TIME_SOURCES = ("perf_counter", "cuda-events")
"""``graph.meta["time_source"]`` prefixes of measured (noisy) times."""


def is_measured(graph: Graph) -> bool:
    """Whether ``graph``'s node times were measured (and so carry timing noise)."""
    return str(graph.meta.get("time_source", "")).startswith(MEASURED_TIME_SOURCES)


def reference_graph(graph: Graph) -> Graph:
    """``graph`` with every node at one cost: forward ``t``, backward ``2 t`` (``t`` the mean
    measured forward time rounded to a power of two; 1 s when the graph has no time)."""
    ref = graph.copy()
    n = max(1, len(graph))
    mean = graph.total("time_s") / n
    t = 2.0 ** round(math.log2(mean)) if mean > 0 else 1.0
    for v in ref.nodes:
        ref.node(v)["time_s"] = t
        ref.node(v)["bwd_time_s"] = 2.0 * t
    ref.meta["time_source"] = REFERENCE_TIME_SOURCE
    ref.meta.pop("time_noise", None)  # the capture's, not the reference costs' (no solver reads it)
    return ref


REFERENCE_GRAPHS_KEPT = 4
"""Reference graphs kept per process, least recently used out first (module docstring); each keeps
its solvers' per-graph caches alive."""

REFERENCE_PLANS_KEPT = 64
"""Reference plans kept per process (as dicts), least recently used out first."""

_lock = threading.Lock()
_graphs: OrderedDict[str, Graph] = OrderedDict()
_plans: OrderedDict[tuple[str, Hashable], dict[str, Any]] = OrderedDict()


def shared_reference(graph: Graph) -> tuple[str, Graph]:
    """``(key, reference graph)`` of ``graph``: :func:`reference_graph`, as the one object kept
    for its content (``key``: a hash of its nodes, edges and meta), so that solvers' per-graph
    caches serve every solve of it."""
    ref = reference_graph(graph)
    text = repr(sorted(ref.meta.items(), key=lambda kv: kv[0])) + repr(
        [tuple(d.items()) for _, d in ref.nx.nodes(data=True)]) + repr(sorted(ref.nx.edges))
    key = hashlib.sha256(text.encode()).hexdigest()
    with _lock:
        got = _graphs.setdefault(key, ref)
        _graphs.move_to_end(key)
        while len(_graphs) > REFERENCE_GRAPHS_KEPT:
            _graphs.popitem(last=False)
    return key, got


def clear_reference_memo() -> None:
    """Forget the kept reference graphs and plans (the next solve of each solves it again)."""
    with _lock:
        _graphs.clear()
        _plans.clear()


def _reference_plan(graph: Graph, solve_bytes: Callable[[Graph], Plan], key: Hashable | None) -> Plan:
    """The reference plan of ``graph`` (a fresh :class:`Plan`), from the memo where ``key`` (the
    budget, solver and options of ``solve_bytes``) was solved on the same reference graph."""
    ref_key, ref = shared_reference(graph)
    if key is None:
        return Plan.from_dict(solve_bytes(ref).to_dict())
    memo = (ref_key, key)
    with _lock:
        got = _plans.get(memo)
    if got is None:
        got = solve_bytes(ref).to_dict()
    with _lock:
        _plans[memo] = got
        _plans.move_to_end(memo)
        while len(_plans) > REFERENCE_PLANS_KEPT:
            _plans.popitem(last=False)
    return Plan.from_dict(copy.deepcopy(got))


REFERENCE_TIME_SOURCE = "reference (one cost per node)"
"""``time_source`` of :func:`reference_graph`: a stand-in for a measured capture."""


def stable_plan(graph: Graph, measured: Plan, solve_bytes: Callable[[Graph], Plan],
                finalize: Callable[[Plan], Plan], tolerance: float, key: Hashable | None = None) -> Plan:
    """The reference plan where the measured plan is not faster by more than ``tolerance`` (or
    the graph's ``time_noise``, if larger) of the step time, else ``measured`` (module docstring).
    ``solve_bytes(g)`` solves ``g`` at the budget ``measured`` was solved at; ``finalize(plan)``
    stamps a plan's predictions on ``graph``; ``key``: what ``solve_bytes`` depends on besides its
    graph (budget, solver, options), under which the reference plan is kept (``None``: not kept)."""
    if not (isinstance(tolerance, (int, float)) and not isinstance(tolerance, bool) and 0 <= tolerance < 1):
        raise ValueError(f"noise_tolerance={tolerance!r} must be a fraction in [0, 1) of the step time "
                         f"(default {DEFAULT_NOISE_TOLERANCE}; 0 keeps the fastest measured plan)")
    if tolerance == 0 or not is_measured(graph) or not (measured.recompute_segments or measured.offloads):
        return measured  # deterministic times, or nothing recomputed (nothing faster exists)
    noise = float(graph.meta.get("time_noise") or 0.0)
    try:
        ref = finalize(_reference_plan(graph, solve_bytes, key))
    except InfeasibleBudgetError:  # cannot happen with equal bytes; kept measured, and said so
        measured.options["stability"] = _record("measured", tolerance, noise, None)
        return measured
    base = simulate(graph, measured, check=False, record=False,
                    bandwidth_bytes_per_s=measured.bandwidth_bytes_per_s)
    step = max(base.step_time_s, 1e-12)  # the planned step, recomputation included
    gain = float(ref.predicted_extra_time_s or 0.0) - float(measured.predicted_extra_time_s or 0.0)
    chosen = ref if gain <= max(tolerance, noise) * step else measured
    chosen.options["stability"] = _record("reference" if chosen is ref else "measured", tolerance, noise, gain / step)
    return chosen


def _record(chosen: str, tolerance: float, noise: float, gain: float | None) -> dict[str, Any]:
    """``tolerance``: the one asked for; ``time_noise``: the capture's; the larger one decided."""
    return {"chosen": chosen, "tolerance": tolerance, "time_noise": round(noise, 6),
            "measured_plan_faster_by": None if gain is None else round(gain, 6)}
