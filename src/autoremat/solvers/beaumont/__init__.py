"""``"offload-greedy"``, ``"offload-dp"``, ``"vdnn"``: Beaumont et al.'s chain offloading as plan solvers.

Problem: without recomputing anything, choose the stored activations to copy to host memory
after they are produced and to prefetch back for backward (``Plan.offload``) so that the step
peak that :func:`autoremat.cost.simulate` predicts fits the budget, at little extra time.

Paper: .. [1] O. Beaumont, L. Eyraud-Dubois, A. Shilova, "Optimal GPU-CPU Offloading Strategies
   for Deep Neural Network Training", hal-02316266, 2019 (GREEDY §4.2, DYNPROG §5.3, VDNN §6.1;
   the chain solvers live in :mod:`.chain_solvers`).

Method (a heuristic: the chain solvers are the paper's, the mapping and repair are ours):

1. *Not binding*: when the plan without recomputation or offloading fits, it is returned with an
   empty ``offload`` (except ``vdnn`` with ``mode="all"``, vDNN_all, which offloads everything
   by definition).
2. *Chain*: :func:`~autoremat.cost.chain.chain_from_graph` with the same bandwidth ``B`` the plan
   is simulated with, then :func:`offloadable_chain`: each activation ``x_j`` keeps only the
   bytes the runtime can offload, the storages of :func:`offload_candidates` created in layer
   ``G_{j-1}``; the rest of ``x_j`` (saved extras such as batch-norm statistics, storages
   only the loss saves) moves into ``ex^F_i`` and ``ex^B_i`` of every operation ``i >= j - 1``.
   That leaves every ``m_F[i]``, ``m_B[i]`` and ``M_peak`` unchanged, so the solvers only count
   savings the plan can realise.
3. *Budget -> memory limit*: the identity. The chain's memory is, like every budget here, the
   step peak of DESIGN.md (bytes above what is live when the step starts), and ``M_peak`` of a
   chain from a graph equals the simulated step peak without offloading (``>=`` where
   :func:`chain_from_graph`'s clamp acts, i.e. conservative). So ``M = budget_bytes``.
4. *Chain solver*: :func:`~.chain_solvers.offload_greedy` (integral GREEDY),
   :func:`~.chain_solvers.offload_dp` (DYNPROG, ``slots``, ``rounding``) or
   :func:`~.chain_solvers.vdnn` (``mode``) at ``M``; if it finds ``M`` infeasible (below the
   chain's ``min_memory_bytes``) the set is empty and step 6 decides.
5. *Layers -> nodes*: every offloaded activation ``x_j`` becomes the offload candidates created
   in ``G_{j-1}`` (``chain.layer_nodes[j - 1]``), see :func:`layer_offload_nodes`.
6. *Verify and repair*: the plan is simulated with the same ``B``. The simulator (and the
   runtime) model offloading more strictly than the chain: forward never waits for a copy to
   free memory (the chain's integral schedule does), a copy starts when a node first saves the
   storage, and backward prefetches one storage ahead as soon as the link is free (the chain
   waits until memory allows). So the chain's set can simulate over the budget; then the other
   candidates are added in production order (the earliest are needed last in backward, so their
   copies have the most compute to hide behind), one at a time, up to the first set that fits
   (recorded in ``options["repaired_nodes"]``, logged). If none does, the production-order
   prefixes of all candidates are scanned (``options["fallback"]``, logged): the first that fits
   is returned.
7. *Infeasible*: :class:`~autoremat.errors.InfeasibleBudgetError` with ``min_budget_bytes`` the
   least simulated peak over the production-order prefixes (the empty one, i.e. no offloading,
   included; for vDNN_all, the peak of offloading everything). Step 6 guarantees that solving at
   that budget succeeds; a smaller budget may still be met by some chain solver's own set.

Candidates: the storages of :func:`~autoremat.plan.offloadable_nodes`. That includes storages
their own producer saves (ReLU, sigmoid, softmax... save their output): the runtime opens a
window before an offloaded node runs and sends that save to the host too (see
:mod:`autoremat.runtime.offload`), so offloading them frees device memory as the simulator says.

Where offloading applies (decision, as :mod:`autoremat.solvers.combined`): offloading saves
device memory only where host and device memory differ, so these solvers plan offloads when the
graph was captured on CUDA or on the meta device (a model of one), or with ``offload=True``. On a
CPU capture (or with ``offload=False``) the only plan they have is the one without offloading:
they return it when it fits and otherwise raise ``InfeasibleBudgetError`` with its peak as the
minimum, and a message saying why and what to do (capture on CUDA/meta, ``offload=True``, or a
recomputation solver). An error, not a fallback to recomputation, because the solver named was
asked for an offload plan; ``"combined"`` is the one that mixes both.

Options (``config``): ``bandwidth_bytes_per_s`` (default ``graph.meta["bandwidth_bytes_per_s"]``,
else :data:`~autoremat.cost.DEFAULT_BANDWIDTH_BYTES_PER_S`: the simulator's own default, so
pass the same value to :func:`~autoremat.cost.simulate` or set it in ``graph.meta``; measure
it with :func:`autoremat.offload.bandwidth.measure_bandwidth`), ``grouping`` (``"fine"`` or
``"split-points"``, the chain's virtual layers), ``offload`` (``True``, ``False`` or ``"auto"``),
``slots`` and ``rounding`` (``offload-dp``), ``mode`` (``vdnn``: ``"conv"`` or ``"all"``).

Predicted time against the chain's makespan: ``plan.options`` records the chain schedule's
``chain_makespan_s``, ``chain_idle_s`` and Proposition 3's ``chain_lower_bound_s``. The plan's
predicted step time (``simulate(...).step_time_s`` = forward + backward + stalls) and the
makespan share their compute part exactly (``sum(u_F + u_B)`` is the graph's total time); both
are at least the lower bound (the simulated plan moves every offloaded byte out and back on one
link, and must offload at least ``M_peak - M`` bytes to fit); their stalls differ in general: the
chain waits in forward for memory where the simulator instead exceeds the budget (and repairs).

Time: O(n) for the chain, the chain solver's time (GREEDY O(L^2), VDNN O(L^3), DYNPROG
pseudo-polynomial, see :mod:`.chain_solvers`), and at most ``2 |C|`` simulations of
O(n) each for ``|C|`` offload candidates. Space O(n + |C|) plus the solver's. Not exact: the
chain problem is NP-complete (Theorem 1 of [1]) and the graph's model is not the chain's.
Limitations: no recomputation (``"combined"`` mixes both); the repair only adds candidates; the
runtime prefetches lazily (the first unpack of backward), so it holds no more than predicted.
"""

from __future__ import annotations

import bisect
import logging
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ...cost import DEFAULT_BANDWIDTH_BYTES_PER_S, no_recompute_plan
from ...cost.chain import GROUPINGS, Chain, chain_from_graph
from ...cost.chain_schedule import OffloadSchedule
from ...errors import InfeasibleBudgetError
from ...graph import Graph
from ...plan import Plan, offloadable_nodes
from .._config import SolverConfig
from ..combined import offload_allowed
from ..offload_sims import OffloadSims
from .chain_solvers import DEFAULT_SLOTS, ROUNDINGS, VDNN_MODES, lower_bound, offload_dp, offload_greedy, vdnn

__all__ = ["solve_offload_greedy", "solve_offload_dp", "solve_vdnn", "offload_candidates", "offloadable_chain",
           "layer_offload_nodes", "OffloadGreedyConfig", "OffloadDPConfig", "VdnnConfig", "offload_bandwidth",
           "offload_flag", "offload_refused", "solve_chain_offload"]

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------- chain <-> graph
def offload_candidates(graph: Graph, plan: Plan | None = None) -> list[int]:
    """Storages whose offload can lower the device peak when the runtime executes ``plan``
    (default: no recomputation), in production order: :func:`~autoremat.plan.offloadable_nodes`.
    """
    plan = no_recompute_plan(graph) if plan is None else plan
    return sorted(offloadable_nodes(graph, plan))


def offloadable_chain(chain: Chain, graph: Graph, candidates: Iterable[int]) -> Chain:
    """``chain`` with each ``x_j`` cut to the bytes of the ``candidates`` created in ``G_{j-1}``.

    The removed bytes stay in memory for the same operations (they move into ``ex^F_i`` and
    ``ex^B_i`` for every ``i >= j - 1``), so ``m_F``, ``m_B`` and ``M_peak`` are unchanged.
    ``x_{L+1}`` (never offloaded) is kept as it is.
    """
    if not chain.layer_nodes:
        raise ValueError("the chain has no layer_nodes: build it with autoremat.cost.chain.chain_from_graph(graph)")
    firsts = [f for f, _ in chain.layer_nodes]
    x = [0] * (chain.n_ops + 1)
    for v in candidates:
        k = bisect.bisect_right(firsts, v) - 1
        x[k + 1] += int(graph.node(v)["alloc_bytes"])
    x[0], x[-1] = chain.x_bytes[0], chain.x_bytes[-1]
    moved = [a - b for a, b in zip(chain.x_bytes, x)]
    assert min(moved) >= 0, "offload candidates hold more bytes than the chain's activations, please report"
    ex_f, ex_b, acc = [], [], moved[0]
    for i in range(chain.n_ops):
        acc += moved[i + 1]
        ex_f.append(chain.fwd_extra_bytes[i] + acc)
        ex_b.append(chain.bwd_extra_bytes[i] + acc)
    out = Chain(fwd_time_s=chain.fwd_time_s, bwd_time_s=chain.bwd_time_s, x_bytes=tuple(x), y_bytes=chain.y_bytes,
                fwd_extra_bytes=tuple(ex_f), bwd_extra_bytes=tuple(ex_b),
                bandwidth_bytes_per_s=chain.bandwidth_bytes_per_s, layer_nodes=chain.layer_nodes,
                layer_names=chain.layer_names, meta={**chain.meta, "offloadable_only": True})
    assert out.fwd_memory_bytes == chain.fwd_memory_bytes and out.bwd_memory_bytes == chain.bwd_memory_bytes, \
        "cutting the chain to offloadable bytes changed its memory, please report"
    return out


def layer_offload_nodes(chain: Chain, activations: Iterable[int], candidates: Sequence[int]) -> list[int]:
    """The ``candidates`` (sorted node ids) created in the layers whose activations are offloaded.

    Activation ``x_j`` (``1 <= j <= L``) is what layer ``G_{j-1}`` creates; ``x_0`` holds no
    graph storage.
    """
    out: list[int] = []
    for j in sorted(set(activations)):
        if not 1 <= j <= chain.L:
            continue
        first, last = chain.layer_nodes[j - 1]
        out.extend(candidates[bisect.bisect_left(candidates, first):bisect.bisect_right(candidates, last)])
    return out


# ---------------------------------------------------------------------- options
def offload_bandwidth(graph: Graph, cfg: dict[str, Any]) -> float:
    """The link's bytes per second: ``cfg['bandwidth_bytes_per_s']``, else the graph's, else the default."""
    raw, source = cfg.get("bandwidth_bytes_per_s"), "config"
    if raw is None:
        raw, source = graph.meta.get("bandwidth_bytes_per_s"), "graph.meta"
    if raw is None:
        return float(DEFAULT_BANDWIDTH_BYTES_PER_S)
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not raw > 0 or math.isinf(raw):
        raise ValueError(f"bandwidth_bytes_per_s={raw!r} (from {source}) must be a positive finite number of bytes "
                         "per second, e.g. 12e9 or autoremat.offload.bandwidth.measure_bandwidth()")
    return float(raw)


def offload_flag(graph: Graph, cfg: dict[str, Any]) -> bool:
    """Whether to plan offloads: ``cfg['offload']`` (True, False, 'auto') checked, see :func:`offload_allowed`."""
    flag = cfg.get("offload", "auto")
    if flag is None:
        flag = "auto"
    if flag != "auto" and not isinstance(flag, bool):
        raise ValueError(f"offload={flag!r}; expected True, False or 'auto' (offload on CUDA and meta captures)")
    return offload_allowed(graph, {"offload": flag})


def _grouping(cfg: dict[str, Any]) -> str:
    grouping = cfg.get("grouping", "fine")
    if grouping not in GROUPINGS:
        raise ValueError(f"grouping={grouping!r}; expected one of {GROUPINGS} (the chain's virtual layers)")
    return grouping


def offload_refused(graph: Graph, cfg: dict[str, Any], budget_bytes: int, peak: int, name: str
                    ) -> InfeasibleBudgetError:
    """The error of an offload solver asked to offload where it does not pay (CPU, offload=False)."""
    if cfg.get("offload") is False:
        why = "offload=False was passed"
    else:
        why = (f"the graph was captured on {graph.meta.get('device')!r}, where host and device memory are the "
               "same memory")
    return InfeasibleBudgetError(
        budget_bytes, peak, solver=name,
        reason=(f"Offloading cannot lower this step peak ({why}), so {name!r} only has the plan without "
                "offloading, whose peak is the minimum above. Capture the model on a CUDA device (or on 'meta' to "
                "plan for one), pass offload=True to plan offloads anyway (on a CPU the runtime then only does "
                "bookkeeping), or use a recomputation solver such as 'dp-approx' or 'combined'."))


def _simple(options: dict[str, Any]) -> dict[str, Any]:
    """JSON-safe scalars and lists of a chain schedule's options (infinities become None)."""
    out: dict[str, Any] = {}
    for k, v in options.items():
        if isinstance(v, float) and not math.isfinite(v):
            out[k] = None
        elif isinstance(v, (bool, int, float, str)) or v is None:
            out[k] = v
        elif isinstance(v, (list, tuple)) and all(isinstance(e, (int, float)) for e in v):
            out[k] = list(v)
    return out


# ---------------------------------------------------------------------- the common solver
class _Judge:
    """Simulated peaks of offload sets on the no-recomputation plan (depth 1, no waits), memoised
    in ``sims`` (shared with other solves of the same graph and bandwidth: :mod:`..offload_sims`)."""

    def __init__(self, graph: Graph, bandwidth: float, sims: OffloadSims | None = None) -> None:
        self.graph = graph
        self.bandwidth = bandwidth
        base = no_recompute_plan(graph)
        self.sims = sims if sims is not None and sims.matches(graph, base, bandwidth) else \
            OffloadSims(graph, base, bandwidth)
        self.segments = list(self.sims.base.segments)

    def plan(self, nodes: Iterable[int], name: str, options: dict[str, Any]) -> Plan:
        return Plan(list(self.segments), solver=name, options=options, offload=tuple(nodes))

    def peak(self, nodes: Iterable[int]) -> int:
        return self.sims.run(tuple(sorted(set(nodes)))).peak_bytes

    def fits(self, nodes: Iterable[int], budget: int, floors: bool = False) -> bool:
        """Whether ``nodes`` simulate within ``budget``; ``floors``: first, where ``offload-dag`` has
        simulated the set in its least-memory form (prefetch depth 1, waiting for every copy), a peak of
        that form over the budget says no (that form's peak is never above this one's: property test
        in tests/solvers/test_offload_dag.py)."""
        key = tuple(sorted(set(nodes)))
        floor = self.sims.memo.get((key, 1, 0)) if floors else None
        return (floor is None or floor.peak_bytes <= budget) and self.sims.run(key).peak_bytes <= budget

    def chain(self, grouping: str, candidates: list[int]) -> Chain:
        key = ("offloadable chain", grouping)
        if key not in self.sims.chains:
            self.sims.chains[key] = offloadable_chain(
                chain_from_graph(self.graph, bandwidth_bytes_per_s=self.bandwidth, grouping=grouping),
                self.graph, candidates)
        return self.sims.chains[key]


def _solve(graph: Graph, budget_bytes: int, config: dict[str, Any] | None, name: str,
           choose: Callable[[Chain, int], OffloadSchedule] | None, sims: OffloadSims | None = None,
           seed: bool = False) -> Plan:
    """Steps 1-7 of the module docstring; ``choose=None`` offloads every candidate (vDNN_all);
    ``sims``: simulations shared with other solves (:mod:`..offload_sims`); ``seed``: only the plan
    matters (``offload-dag``'s seeds): sets are ruled out by ``offload-dag``'s simulations where they
    can be (:meth:`_Judge.fits`), and an infeasible budget's error carries no minimum."""
    cfg = dict(config or {})  # the registered solvers parsed it with their config class
    bandwidth = offload_bandwidth(graph, cfg)
    grouping = _grouping(cfg)
    allow = offload_flag(graph, cfg)
    budget = int(budget_bytes)
    judge = _Judge(graph, bandwidth, sims)
    vanilla = judge.peak(())
    opts: dict[str, Any] = {"bandwidth_bytes_per_s": bandwidth, "offload_allowed": allow, "memory_limit_bytes": budget}
    if vanilla <= budget and (choose is not None or not allow):
        return judge.plan((), name, opts)
    if not allow:
        raise offload_refused(graph, cfg, budget, vanilla, name)
    candidates = judge.sims.chains.get("candidates")
    if candidates is None:
        candidates = judge.sims.chains["candidates"] = offload_candidates(graph)
    if choose is None:  # vDNN_all
        peak = judge.peak(candidates)
        if peak > budget:
            raise InfeasibleBudgetError(budget, peak, solver=name)
        return judge.plan(candidates, name, {**opts, "offload_candidates": len(candidates)})
    if not candidates:
        raise InfeasibleBudgetError(budget, vanilla, solver=name)

    chain = judge.chain(grouping, candidates)
    opts.update(grouping=grouping, chain_ops=chain.n_ops, offload_candidates=len(candidates))
    try:
        schedule: OffloadSchedule | None = choose(chain, budget)
    except InfeasibleBudgetError as err:
        logger.info("%s: the chain model needs at least %d bytes (budget %d); trying production-order prefixes "
                    "of the %d offload candidates", name, err.min_budget_bytes, budget, len(candidates))
        schedule = None
        opts["chain_min_memory_bytes"] = err.min_budget_bytes
    if schedule is not None:
        opts.update(chain_offloaded=list(schedule.offloaded), chain_makespan_s=schedule.makespan_s,
                    chain_idle_s=schedule.idle_s, chain_lower_bound_s=lower_bound(chain, budget),
                    chain_options=_simple(schedule.options))
    chosen = layer_offload_nodes(chain, schedule.offloaded if schedule is not None else (), candidates)
    if judge.fits(chosen, budget, seed):
        return judge.plan(chosen, name, opts)

    # repair: add the other candidates in production order up to the first set that fits
    taken = set(chosen)
    missing = [v for v in candidates if v not in taken]
    for k in range(1, len(missing) + 1):
        if judge.fits(chosen + missing[:k], budget, seed):
            if schedule is not None:
                logger.info("%s: the chain solver's offloads simulate to %d bytes over a %d-byte budget; added "
                            "%d candidates in production order", name, judge.peak(chosen), budget, k)
            return judge.plan(chosen + missing[:k], name, {**opts, "repaired_nodes": missing[:k]})

    # fallback: production-order prefixes of every candidate
    least = vanilla
    for k in range(1, len(candidates) + 1):
        if judge.fits(candidates[:k], budget, seed):
            logger.info("%s: no superset of the chain solver's offloads fits %d bytes; falling back to the first "
                        "%d of %d offload candidates in production order", name, budget, k, len(candidates))
            return judge.plan(candidates[:k], name, {
                **opts, "fallback": f"production-order prefix of {k} of {len(candidates)} offload candidates"})
        least = least if seed else min(least, judge.peak(candidates[:k]))
    raise InfeasibleBudgetError(budget, None if seed else least, solver=name)


# ---------------------------------------------------------------------- options
@dataclass(frozen=True)
class OffloadGreedyConfig(SolverConfig):
    """Options of ``offload-greedy`` (shared by the other chain offload solvers)."""

    solver: ClassVar[str] = "offload-greedy"
    bandwidth_bytes_per_s: float | None = field(default=None, metadata={
        "help": "host<->device bandwidth (default graph.meta's, else the simulator's default)"})
    grouping: str = field(default="fine", metadata={"help": f"the chain's virtual layers: one of {GROUPINGS}"})
    offload: bool | str | None = field(default="auto", metadata={
        "help": "True, False, or 'auto' (offload on CUDA and meta captures)"})


@dataclass(frozen=True)
class OffloadDPConfig(OffloadGreedyConfig):
    """Options of ``offload-dp``."""

    solver: ClassVar[str] = "offload-dp"
    slots: int = field(default=DEFAULT_SLOTS, metadata={"help": "memory slots of DYNPROG (the paper uses 500)"})
    rounding: str = field(default="up", metadata={"help": f"how activation sizes become slots: one of {ROUNDINGS}"})


@dataclass(frozen=True)
class VdnnConfig(OffloadGreedyConfig):
    """Options of ``vdnn``."""

    solver: ClassVar[str] = "vdnn"
    mode: str = field(default="conv", metadata={"help": f"one of {VDNN_MODES}: thresholds, or offload everything"})


# ---------------------------------------------------------------------- registered solvers
_CONFIGS: dict[str, type[OffloadGreedyConfig]] = {"offload-greedy": OffloadGreedyConfig, "offload-dp": OffloadDPConfig,
                                                  "vdnn": VdnnConfig}


def _chooser(name: str, cfg: dict[str, Any]) -> Callable[[Chain, int], OffloadSchedule] | None:
    """The chain solver of ``name`` under ``cfg`` (its options checked); ``None``: vDNN_all."""
    if name == "offload-greedy":
        return lambda c, m: offload_greedy(c, m)
    if name == "offload-dp":
        slots, rounding = cfg["slots"], cfg["rounding"]
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots={slots!r} must be an int >= 1 (memory slots of DYNPROG; the paper uses 500)")
        if rounding not in ROUNDINGS:
            raise ValueError(f"rounding={rounding!r}; expected one of {ROUNDINGS} (how activation sizes become slots)")
        return lambda c, m: offload_dp(c, m, slots=slots, rounding=rounding)
    mode = cfg["mode"]
    if mode not in VDNN_MODES:
        raise ValueError(f"mode={mode!r} is not a vDNN mode; expected one of {VDNN_MODES}")
    return None if mode == "all" else (lambda c, m: vdnn(c, m, mode="conv"))


def solve_chain_offload(graph: Graph, budget_bytes: int, name: str, config: dict[str, Any] | None = None,
                        sims: OffloadSims | None = None, seed: bool = False) -> Plan:
    """The registered solver ``name`` (``offload-greedy``, ``offload-dp``, ``vdnn``) with its
    simulations in ``sims`` where they are this graph's at this bandwidth (:mod:`..offload_sims`);
    ``seed``: as a seed of ``offload-dag`` (the same plan; see :func:`_solve`)."""
    cfg = _CONFIGS[name].parse(config).as_dict()
    return _solve(graph, budget_bytes, cfg, name, _chooser(name, cfg), sims, seed)


def solve_offload_greedy(graph: Graph, budget_bytes: int, *,
                         config: dict[str, Any] | OffloadGreedyConfig | None = None) -> Plan:
    """GREEDY (integral, §4.2 of [1]) mapped to a plan; see the module docstring."""
    return solve_chain_offload(graph, budget_bytes, "offload-greedy", config)


def solve_offload_dp(graph: Graph, budget_bytes: int, *, config: dict[str, Any] | OffloadDPConfig | None = None
                     ) -> Plan:
    """DYNPROG (§5.3 of [1]) mapped to a plan; ``slots`` (default 500) and ``rounding`` as in
    :func:`~.chain_solvers.offload_dp`."""
    return solve_chain_offload(graph, budget_bytes, "offload-dp", config)


def solve_vdnn(graph: Graph, budget_bytes: int, *, config: dict[str, Any] | VdnnConfig | None = None) -> Plan:
    """vDNN++ (§6.1 of [1]) mapped to a plan; ``mode="conv"`` (thresholds, default) or ``"all"``
    (vDNN_all: offload every candidate, whatever the budget)."""
    return solve_chain_offload(graph, budget_bytes, "vdnn", config)
