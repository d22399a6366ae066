"""Solvers: pure functions ``solve(graph, budget_bytes, *, config=None) -> Plan``, by paper.

Every solver sees only the :class:`~autoremat.graph.Graph` (no torch), returns a plan whose
simulated step peak is within the budget, and raises
:class:`~autoremat.errors.InfeasibleBudgetError` (with ``min_budget_bytes``) otherwise.

=====================  ===========================================================================
``none``, ``chen``     :mod:`.none`, :mod:`.chen` (Chen et al., sublinear memory)
``dp-exact``,          :mod:`.kusumoto` (Kusumoto et al., the DP over lower sets)
``dp-approx``
``reforward``          :mod:`.reforward` (Feng & Huang, Re-forwarding)
``xla-greedy``         :mod:`.xla_greedy` (XLA's greedy rematerialisation, as Kumar et al. run it)
``offload-greedy``,    :mod:`.beaumont` (Beaumont et al., GPU-CPU offloading; the chain solvers
``offload-dp``,        behind them in :mod:`.beaumont.chain_solvers`)
``vdnn``
``offload-dag``        :mod:`.offload_dag` (Beaumont et al.'s transfer model on the graph itself:
                       saved tensors and offloaded checkpoints, forward waits)
``combined``           :mod:`.combined` (recomputation plus offloading)
``milp``               :mod:`.milp` (the exact program over the same plan space, HiGHS)
``blocks``             :mod:`.blocks` (repeated blocks solved once, chained by dynamic programming;
                       rotor / Rockmate's structure in canonical plans)
=====================  ===========================================================================

Evaluation-only planners (brute force, TWRemat) are :mod:`.evaluation`; the cost models the
solvers price plans with are :mod:`autoremat.cost`.

:data:`SOLVERS` maps each name to a :class:`RegisteredSolver`: calling it runs the solver and
then :func:`finalize_plan`, exactly as :func:`solve` does, so ``SOLVERS[name](graph, b)`` returns a
plan :func:`autoremat.apply` can run (graph identity, replay tails, predictions), checked within
the budget. The bare solver is its :attr:`RegisteredSolver.solve`. Adding a solver touches its
module and one line of :data:`SOLVER_FUNCTIONS`.
"""

from __future__ import annotations

import math

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..budget import is_min, parse_budget
from ..errors import InfeasibleBudgetError
from ..graph import Graph
from ..plan import Plan, module_calls_of, release_waits, validate_plan
from ..plan_offload import offload_calls_of
from ..replay_tail import replay_tails
from ..cost import simulate, unoptimised_peak_bytes
from ._config import SolverConfig, check_budget, option_names
from .blocks import BlocksConfig, repeats, solve_blocks
from .chen import ChenConfig, solve_chen
from .combined import CombinedConfig, offload_allowed, solve_combined
from .kusumoto import DPApproxConfig, DPExactConfig, solve_dp_approx, solve_dp_exact
from .milp import solve_milp
from .milp.config import MilpConfig
from .minimum import min_budget
from .none import NoneConfig, solve_none
from .offload_dag import OffloadDagConfig, solve_offload_dag
from .beaumont import (OffloadDPConfig, OffloadGreedyConfig, VdnnConfig, solve_offload_dp, solve_offload_greedy,
                            solve_vdnn)
from .reforward import ReforwardConfig, solve_reforward
from .milp.chain import CHAIN_MAX_NODES
from .least import auto_lattice_least, auto_order, least_budget
from .unreached_regions import recompute_unreached
from .stable import DEFAULT_NOISE_TOLERANCE, is_measured, stable_plan
from .xla_greedy import XlaGreedyConfig, solve_xla_greedy

__all__ = ["SOLVERS", "SOLVER_FUNCTIONS", "RegisteredSolver", "CONFIGS", "OFFLOAD_ONLY", "AUTO_ORDER",
           "AUTO_BLOCKS_ENOUGH_NODES", "AUTO_SLOW_ON_LARGE", "AUTO_NOT_ON_OP_CAPTURES", "SolverFn", "SolverConfig",
           "solve", "finalize_plan", "bare_solver",
           "min_budget", "check_solver", "least_budget", "DEFAULT_NOISE_TOLERANCE", "REGION_SOLVERS",
           "plans_single_nodes", "ops_hint", "large_op_capture", "refuse_large_op_capture"]

logger = logging.getLogger(__name__)

SolverFn = Callable[..., Plan]


SOLVER_FUNCTIONS: dict[str, SolverFn] = {
    "none": solve_none,
    "chen": solve_chen,
    "dp-exact": solve_dp_exact,
    "dp-approx": solve_dp_approx,
    "xla-greedy": solve_xla_greedy,
    "reforward": solve_reforward,
    "combined": solve_combined,
    "offload-greedy": solve_offload_greedy,
    "offload-dp": solve_offload_dp,
    "vdnn": solve_vdnn,
    "offload-dag": solve_offload_dag,
    "milp": solve_milp,
    "blocks": solve_blocks,
}
"""The bare solvers: name -> ``solve(graph, budget_bytes, *, config=None) -> Plan`` (segments and
the solver's own options; :data:`SOLVERS` adds the finalisation)."""


class RegisteredSolver:
    """A registered solver: calling it is ``finalize_plan(graph, solve(graph, budget_bytes,
    config=config), ...)``, what :func:`autoremat.solve` does for a solver named explicitly."""

    def __init__(self, name: str, solve: SolverFn) -> None:
        self.name = name
        self.solve = solve
        functools.update_wrapper(self, solve)

    def __call__(self, graph: Graph, budget_bytes: int, *, config: Any = None) -> Plan:
        budget = check_budget(budget_bytes)
        options = config.as_dict() if isinstance(config, SolverConfig) else dict(config or {})
        return finalize_plan(graph, self.solve(graph, budget, config=config), budget, self.name, options)

    def __repr__(self) -> str:
        return f"RegisteredSolver({self.name!r}, {self.solve.__module__}.{self.solve.__qualname__})"


SOLVERS: dict[str, RegisteredSolver] = {name: RegisteredSolver(name, fn) for name, fn in SOLVER_FUNCTIONS.items()}
"""Registry: solver name -> ``solve(graph, budget_bytes, *, config=None) -> Plan``, finalised."""

CONFIGS: dict[str, type[SolverConfig]] = {
    "none": NoneConfig,
    "chen": ChenConfig,
    "dp-exact": DPExactConfig,
    "dp-approx": DPApproxConfig,
    "xla-greedy": XlaGreedyConfig,
    "reforward": ReforwardConfig,
    "combined": CombinedConfig,
    "offload-greedy": OffloadGreedyConfig,
    "offload-dp": OffloadDPConfig,
    "vdnn": VdnnConfig,
    "offload-dag": OffloadDagConfig,
    "milp": MilpConfig,
    "blocks": BlocksConfig,
}
"""Solver name -> its typed options (``config``); an option it does not list is a ``ValueError``."""

AUTO_ORDER = ("none", "blocks", "chen", "dp-approx", "combined")

AUTO_BLOCKS_ENOUGH_NODES = 400
"""``"auto"`` stops after ``"blocks"`` when it found a plan over repeated blocks (:func:`.blocks.repeats`)
on a graph of at least this many nodes:
on deep models the chain program is exact over per-block options in well under a second, where
the node-by-node solvers after it take seconds to minutes (a 64-layer GPT at op level: dp-approx
~16 s, issue 24)."""

AUTO_SLOW_ON_LARGE = ("combined",)
"""What ``"auto"`` leaves out on a graph of at least :data:`AUTO_BLOCKS_ENOUGH_NODES` nodes whose
``blocks`` plan has no repeated blocks (:func:`.blocks.repeats`), where it tries the node-by-node
solvers after all: there the blocks are a coarse partition that ``dp-approx`` plans better in about
a second (DenseNet-201 at CPU size, 711 nodes, 50 %: 6.98e-6 s of extra time against blocks'
7.57e-6 s, 1.0 s each), but ``combined``'s offload search took ~14 s more for the same plan. Up
to :data:`.milp.chain.CHAIN_MAX_NODES` nodes (1000) only: dp-approx's time grows about with the
square of the nodes (0.4 s at 431, 2.8 s at 966, 10 s at 1,926 on op-level GPTs, x86_64)."""

AUTO_NOT_ON_OP_CAPTURES = ("dp-approx",)
"""What ``"auto"`` leaves out on every module-level graph whose repeated blocks were captured op by
op (``capture``'s ``blocks="auto"`` on transformers; on those of at least
:data:`AUTO_BLOCKS_ENOUGH_NODES` nodes every solver that plans single nodes is left out,
:func:`large_op_capture`). ``dp-approx`` recomputes single recomputable nodes, and an op inside
such a block is not one, so it reaches what Chen's plans over whole module calls reach, which it
checks its own against. Measured (x86_64, 2 cores, shared; ``times="flops"`` captures of the 39
such graphs of under 400 nodes among :mod:`autoremat.zoo.hf` and :mod:`autoremat.zoo.hf_breadth`):
without it ``auto``'s least budget was the same on all 39 and its plans at 50 % and 75 % recomputed
the same time on all 78; it had cost 0.2-5.0 s per least budget (a LeViT: 5.0 s) and up to 1.8 s
per solve. ``solver="dp-approx"`` still plans such a graph when asked."""

OFFLOAD_ONLY = ("offload-greedy", "offload-dp", "vdnn", "offload-dag")
"""Registered solvers that only offload (no recomputation)."""


def check_solver(name: str, *, allow_auto: bool = True) -> str:
    """``name`` if it is registered (or ``"auto"`` where allowed); else a ``ValueError`` listing them."""
    if (allow_auto and name == "auto") or name in SOLVERS:
        return name
    expected = f"'auto' or one of {sorted(SOLVERS)}" if allow_auto else f"one of {sorted(SOLVERS)}"
    raise ValueError(f"solver={name!r} is not registered; expected {expected}")


def bare_solver(name: str) -> SolverFn:
    """The solver registered as ``name`` without the finalisation (what :func:`solve`, ``min_budget``
    and ``combined`` run before they check the plan themselves)."""
    fn = SOLVERS[name]
    return fn.solve if isinstance(fn, RegisteredSolver) else fn


def finalize_plan(graph: Graph, plan: Plan, budget_bytes: int, solver: str,
                  options: Mapping[str, Any] | None = None) -> Plan:
    """Stamp a solver's plan with its graph, budget and predictions, and check it: what
    :func:`autoremat.apply` reads (``graph_mode``, ``node_names``, ``tensors``, ``inputs``, the
    replay tails of an fx graph, the module calls of a module-level one, the order of first
    backward use of the offloaded nodes) and the simulated peak and extra time, at the link the
    solver planned with (``options["bandwidth_bytes_per_s"]``, else the graph's). Regions no
    gradient reaches that the plan stores are recomputed where that lowers the peak for no time
    (:mod:`.unreached_regions`; the plan returned is then a new one)."""
    plan.solver = solver
    plan.budget_bytes = int(budget_bytes)
    plan.graph_fingerprint = graph.fingerprint
    plan.options = {**dict(options or {}), **plan.options}
    plan.graph_mode = graph.meta.get("mode")
    plan.node_names = tuple(graph.node(v)["module_path"] if graph.meta.get("mode") == "module"
                            else graph.node(v)["name"] for v in graph.nodes)
    plan.tensors = graph.meta.get("tensors")  # what apply / check_inputs compare (autoremat.capture.signature)
    plan.inputs = graph.meta.get("inputs")
    validate_plan(graph, plan)
    plan = recompute_unreached(graph, plan)  # free, where a region no gradient reaches holds something
    plan.replay_tails = replay_tails(graph, plan)
    plan.module_calls = module_calls_of(graph, plan)  # module level: the calls apply wraps, the ops they keep
    if plan.bandwidth_bytes_per_s is None:
        plan.bandwidth_bytes_per_s = plan.options.get("bandwidth_bytes_per_s")
    sim = simulate(graph, plan, check=False, record=False, bandwidth_bytes_per_s=plan.bandwidth_bytes_per_s)
    if plan.offloads and not plan.offload_order:  # what the runtime prefetches in (it has no graph)
        plan.offload_order = tuple(sim.offload_order)
    if plan.offloads:  # releases in the GPU's order, where the simulator makes them (same prediction)
        plan.offload_waits = release_waits(graph, plan, sim.offload_releases)
        plan.offload_calls = offload_calls_of(graph, plan)  # one call of a shared module: the runtime's hooks
    plan.predicted_peak_bytes = sim.peak_bytes
    plan.predicted_extra_time_s = sim.extra_time_s
    if sim.peak_bytes > budget_bytes:  # the contract: never a plan over budget, whatever the solver
        logger.warning("solver %r returned a plan simulating to %d bytes over a %d-byte budget; rejecting it",
                       solver, sim.peak_bytes, budget_bytes)
        raise InfeasibleBudgetError(budget_bytes, sim.peak_bytes, solver=solver)
    return plan


def solve(graph: Graph, budget: Any, *, solver: str = "auto", auto_solvers: Sequence[str] | None = None,
          noise_tolerance: float = DEFAULT_NOISE_TOLERANCE, first_fit: bool = False, **options: Any) -> Plan:
    """Choose what to recompute so that one step of ``graph`` fits ``budget``.

    ``budget``: see :func:`autoremat.budget.parse_budget`, or ``"min"``: the least budget the
    solver (``"auto"``: any solver it tries) meets (:func:`.least.least_budget`). ``solver``: a
    key of :data:`SOLVERS`, or ``"auto"`` (no recomputation when it fits, else the best plan of
    the solvers of :data:`AUTO_ORDER` that fits, stopping after ``"blocks"`` on a large graph
    where it found one over repeated blocks, see :data:`AUTO_BLOCKS_ENOUGH_NODES` and
    :data:`AUTO_SLOW_ON_LARGE`; ``auto_solvers`` narrows the
    solvers ``"auto"`` tries; on graphs of at most 120 nodes with deterministic times (not module-level
    graphs whose blocks were captured op by op) it also gives
    ``milp``'s exact lattice search a bounded amount of work (about 2 s on an idle machine; a count,
    not a clock, so the same plan at any load) to find a cheaper plan, or one at all where no other
    solver fits, :func:`autoremat.solvers.milp.exact.auto_improve`; without ``highspy`` too; where
    no other solver fits, its least-peak search on graphs of up to 300 nodes too, and a wider chain
    beam, :data:`.milp.exact.AUTO_LEAST_MAX_NODES`; on
    graphs of at most 300 nodes with deterministic times it then polishes the plan's boundaries,
    :mod:`.polish`, and on graphs of at most 1000 runs a bounded beam search over the prefixes of
    the plan's order with free flags, :mod:`.milp.chain`, keeping what recomputes less; above 300
    nodes its segments span at most 32 nodes). ``noise_tolerance``: on measured times, the plan chosen from per-node reference costs is
    kept unless a plan is predicted faster by more than this fraction of the step time, so that
    captures differing only by timing noise give one plan (:mod:`.stable`; 0 turns it off).
    Extra keyword options go to the solver as its ``config`` (see :data:`CONFIGS`; an unknown
    option is a ``ValueError`` naming the accepted ones). Under ``"auto"`` each solver tried gets
    the options it accepts, and an option that none of them accepts is a ``ValueError``.
    An infeasible budget raises :class:`InfeasibleBudgetError` stating the reachable range.
    ``first_fit``: the first plan ``"auto"`` finds that fits, not the best (no polish, chain or
    lattice search where one fits, no reference plan): whether a plan exists, as cheaply; it
    raises exactly where the full solve does (the batch-size search's probes).
    """
    if not isinstance(graph, Graph):
        raise TypeError(f"graph must be an autoremat.Graph (from autoremat.capture), got {type(graph).__name__}")
    check_solver(solver)
    refuse_large_op_capture(graph, solver, "solve")
    if is_min(budget):
        budget_bytes = least_budget(graph, solver, auto_solvers=auto_solvers, **options)
    else:
        budget_bytes = parse_budget(
            budget,
            unoptimised_peak_bytes=unoptimised_peak_bytes(graph) if _needs_peak(budget) else None,
            device=graph.meta.get("device"),
            resident_bytes=int(graph.meta.get("resident_bytes", 0)),
        )
    try:
        plan = _solve_bytes(graph, budget_bytes, solver, auto_solvers, options, first_fit)
        if first_fit:
            return plan
        return stable_plan(graph, plan, lambda g: _solve_bytes(g, budget_bytes, solver, auto_solvers, options),
                           lambda p: finalize_plan(graph, p, budget_bytes, p.solver, options if solver != "auto"
                                                   else _accepted(p.solver, options)), noise_tolerance,
                           key=(budget_bytes, solver, None if auto_solvers is None else tuple(auto_solvers),
                                repr(sorted(options.items()))))
    except InfeasibleBudgetError as err:
        raise _with_hints(graph, solver, err).with_peak(unoptimised_peak_bytes(graph)) from None


REGION_SOLVERS = ("auto", "blocks", "chen", "none")
"""The solvers that choose module-call regions on a module-level graph whose repeated blocks were
captured op by op (``capture(blocks="auto")``, the default): ``blocks`` inside the blocks, ``chen``
a block as one call (:meth:`~autoremat.graph.Graph.recompute_units`). The others recompute single
recomputable nodes, and an op inside such a block is not one (:mod:`autoremat.capture.blocks`);
they may still reach a block as a segment of a lower-set plan, but not reliably (dp-approx found
nothing below 100 % on op-by-op GPT-2 captures): the integrations and the CLI capture blocks whole
for them (:func:`autoremat.integrations._common.capture_blocks`)."""


def plans_single_nodes(solver: str) -> bool:
    """Whether ``solver`` recomputes single recomputable nodes (not module-call regions, and not
    an offload-only solver): on a graph whose blocks were captured op by op it cannot recompute
    inside the blocks (:data:`REGION_SOLVERS`)."""
    return solver not in REGION_SOLVERS and solver not in OFFLOAD_ONLY


def large_op_capture(graph: Graph) -> bool:
    """Whether ``graph`` is a module-level capture with its repeated blocks op by op and at least
    :data:`AUTO_BLOCKS_ENOUGH_NODES` nodes: there ``auto`` does not ask the solvers that plan
    single nodes and their ``min_budget`` refuses (:func:`autoremat.solvers.least.auto_order`)."""
    return graph.ops_blocks and len(graph) >= AUTO_BLOCKS_ENOUGH_NODES


def refuse_large_op_capture(graph: Graph, solver: str, call: str) -> None:
    """A ``ValueError`` naming the way out, before any solve runs, when ``solver`` plans single
    nodes and ``graph`` is a large op-by-op capture (:func:`large_op_capture`): there it searches
    for minutes (dp-approx 16 s+ on a 64-layer GPT-2) to reach what ``chen`` reaches at once."""
    if plans_single_nodes(solver) and large_op_capture(graph):
        raise ValueError(f"{call}(solver={solver!r}) is not computed on this graph of {len(graph)} nodes "
                         f"(autoremat.solvers.large_op_capture). {ops_hint(solver)}")


def ops_hint(solver: str) -> str:
    """Why ``solver`` reaches little on an op-by-op capture, and what to do instead."""
    return (f"This module-level graph has its repeated blocks captured op by op (capture's default blocks='auto'): "
            f"an op inside a block is not recomputable on its own, only whole module calls are, and solver "
            f"{solver!r} chooses single nodes, so it cannot recompute inside the blocks. Use solver='blocks', 'chen' "
            f"(or 'auto'), or capture with blocks='module' (one node per block) to use {solver!r}.")


def _with_hints(graph: Graph, solver: str, err: InfeasibleBudgetError) -> InfeasibleBudgetError:
    """``err`` with what keeps the least budget up on this graph: module calls kept because they
    write a key/value cache (:mod:`autoremat.capture.kv_cache`), and why a node-by-node solver
    reaches little on an op-by-op capture (the activations inside the blocks, nearly all of them on
    a transformer, are out of its reach)."""
    hints = [err.reason] if err.reason else []
    cached = graph.meta.get("pinned_by_cache") or {}
    if cached:
        hints.append(f"{len(cached)} module call(s) (e.g. {next(iter(cached))}) write a key/value cache and are "
                     "kept, not recomputed: pass use_cache=False to the model (as gradient_checkpointing_enable() "
                     "does) to let them be recomputed.")
    if plans_single_nodes(solver) and graph.ops_blocks:
        hints.append(ops_hint(solver))
    own = graph.meta.get("recomputed_by_model") or {}
    if own:
        more = f" (and {len(own) - 1} more module(s))" if len(own) > 1 else ""
        hints.append(f"The model already recomputes {next(iter(own))}{more} itself (torch.utils.checkpoint in its "
                     "forward), which the unoptimised step peak includes; remove those checkpoint calls and capture "
                     "again to let autoremat choose what to recompute.")
    if not hints or hints == [err.reason]:
        return err
    return InfeasibleBudgetError(err.budget_bytes, err.min_budget_bytes, solver=err.solver,
                                 unoptimised_peak_bytes=err.unoptimised_peak_bytes, reason=" ".join(hints))


def _solve_bytes(graph: Graph, budget_bytes: int, solver: str, auto_solvers: Sequence[str] | None,
                 options: Mapping[str, Any], first_fit: bool = False) -> Plan:
    if solver != "auto":
        plan = bare_solver(solver)(graph, budget_bytes, config=dict(options))
        return finalize_plan(graph, plan, budget_bytes, solver, options)
    best: Plan | None = None
    least_min: int | None = None
    order = auto_order(graph, options, auto_solvers)
    _check_auto_options(options, AUTO_ORDER if auto_solvers is None else
                        tuple(n for n in AUTO_ORDER if n in auto_solvers or n == "none"))
    skipped: tuple[str, ...] = ()
    for name in order:
        if name in skipped:
            continue
        mine = _accepted(name, options)
        try:
            plan = finalize_plan(graph, bare_solver(name)(graph, budget_bytes, config=mine), budget_bytes, name, mine)
        except InfeasibleBudgetError as err:
            if err.min_budget_bytes is not None:
                least_min = err.min_budget_bytes if least_min is None else min(least_min, err.min_budget_bytes)
            continue
        if first_fit:
            return plan
        if best is None or (plan.predicted_extra_time_s or 0.0) < (best.predicted_extra_time_s or 0.0):
            best = plan
        if name == "none":
            break
        if name == "blocks" and len(graph) >= AUTO_BLOCKS_ENOUGH_NODES:
            if repeats(plan) or len(graph) > CHAIN_MAX_NODES:
                logger.info("solver='auto': %d nodes and a plan of the blocks solver%s; not trying the node-by-node "
                            "solvers (AUTO_BLOCKS_ENOUGH_NODES)", len(graph),
                            " over repeated blocks" if repeats(plan) else f", over {CHAIN_MAX_NODES} nodes")
                break
            skipped = AUTO_SLOW_ON_LARGE
            logger.info("solver='auto': %d nodes, but the blocks solver's blocks all differ; trying the node-by-node "
                        "solvers but %s (AUTO_SLOW_ON_LARGE)", len(graph), ", ".join(skipped))
    best = _lattice_for_auto(graph, budget_bytes, best)
    if best is None or not first_fit:  # (first_fit reaches here with no plan yet)
        best = _polished(graph, budget_bytes, best)
        found = _chain_for_auto(graph, budget_bytes, best)
        if found is not best:  # the chain search's plan recomputes less; polished in turn
            best = _polished(graph, budget_bytes, found)
    if best is None:
        lattice = auto_lattice_least(graph)
        if lattice is not None and (least_min is None or lattice < least_min):
            least_min = lattice
        raise InfeasibleBudgetError(budget_bytes, least_min, solver="auto")
    logger.info("solver='auto' chose %s (extra time %.6g s)", best.solver, best.predicted_extra_time_s or 0.0)
    return best


def _polished(graph: Graph, budget_bytes: int, best: Plan | None) -> Plan | None:
    """``best`` after :func:`.polish.polish` (a hill climb on its segment boundaries, judged by the
    simulator) where that recomputes less and still fits once finalised; deterministic times only
    (as the lattice search, :func:`_lattice_for_auto`)."""
    if best is None or best.solver == "none" or is_measured(graph):
        return best
    from .polish import polish

    found = polish(graph, best, budget_bytes)
    if found is None:
        return best
    try:
        plan = finalize_plan(graph, found, budget_bytes, best.solver, best.options)
    except (InfeasibleBudgetError, ValueError):  # over budget with its replay tails, or not executable: keep best
        return best
    if (plan.predicted_extra_time_s or 0.0) >= (best.predicted_extra_time_s or 0.0):
        return best
    logger.info("solver='auto': %s's plan polished (%d moves): extra time %.6g s -> %.6g s", best.solver,
                plan.options.get("polished_moves", 0), best.predicted_extra_time_s or 0.0,
                plan.predicted_extra_time_s or 0.0)
    return plan


def _chain_for_auto(graph: Graph, budget_bytes: int, best: Plan | None) -> Plan | None:
    """``best``, or the plan of ``milp``'s chain search (:func:`.milp.chain.chain_improve`: a beam
    search of the exact model's steps over the prefixes of ``best``'s order, free flags) where
    that recomputes less and still fits once finalised; deterministic times only (as
    :func:`_lattice_for_auto`), and not after the lattice proved ``best`` optimal. It runs after
    the polish (and its plan is polished in turn), so ``auto`` is never worse than without it.
    On a measured capture it runs on the uniform-cost stand-in (:func:`.stable.reference_graph`), as
    the polish does, not on the measured times. (It was off there too while its plan for the
    Lightning CPU CNN, ResNet-50 at 50 %, measured 4.2 KB over its prediction in the callback's
    measured step: that step was the plan's first, which made the recomputed batch norms' scratch
    statistics; ``apply`` makes them now, :func:`autoremat.runtime.recompute_state.prepare_scratch`.)"""
    if is_measured(graph) or (
            best is not None and (best.solver == "none" or best.options.get("milp_status") == "optimal")):
        return best
    from .milp.chain import chain_improve

    to_beat = math.inf if best is None else best.predicted_extra_time_s or 0.0
    return _if_cheaper(graph, budget_bytes, chain_improve(graph, best, budget_bytes, to_beat), best, "chain search")


def _if_cheaper(graph: Graph, budget_bytes: int, found: Plan | None, best: Plan | None, what: str) -> Plan | None:
    """``found`` (a bare ``milp`` plan from ``what``) finalised, where it fits with its replay
    tails, is executable and recomputes less than ``best``; else ``best``."""
    if found is None:
        return best
    to_beat = math.inf if best is None else best.predicted_extra_time_s or 0.0
    try:
        plan = finalize_plan(graph, found, budget_bytes, "milp")
    except (InfeasibleBudgetError, ValueError):  # over budget with its replay tails, or not executable
        logger.debug("solver='auto': the %s's plan fails once finalised; not taken", what)
        return best
    if (plan.predicted_extra_time_s or 0.0) >= to_beat:
        return best
    logger.info("solver='auto': the %s found a plan recomputing %.6g s (best other: %s)", what,
                plan.predicted_extra_time_s or 0.0, "none fits" if best is None else f"{to_beat:.6g} s")
    return plan


def _lattice_for_auto(graph: Graph, budget_bytes: int, best: Plan | None) -> Plan | None:
    """On small graphs ``auto`` also asks the exact lattice search (:func:`.milp.exact.auto_improve`,
    bounded by a count of work, :data:`.milp.exact.AUTO_WORK`, ~2 s idle) for a plan that recomputes less than ``best`` (any plan that fits
    where ``best`` is ``None``: no other solver fits the budget), on deterministic
    times only (FLOP counts, the meta device): on measured times the exact optimum among plans
    that differ by timing noise changes from capture to capture (two quiet captures of a
    two-branch graph, 5 % jitter, gave two lattice plans, each faster than the heuristics' by more
    than :mod:`.stable`'s tolerance)."""
    if is_measured(graph):
        logger.debug("solver='auto': not asking the lattice search (measured times)")
        return best
    from .milp.exact import auto_improve

    to_beat = math.inf if best is None else best.predicted_extra_time_s or 0.0
    return _if_cheaper(graph, budget_bytes, auto_improve(graph, budget_bytes, to_beat), best, "lattice search")


def _accepted(solver: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """The options ``solver`` accepts (all of them for a solver registered without a config)."""
    cls = CONFIGS.get(solver)
    return dict(options) if cls is None else {k: v for k, v in options.items() if k in option_names(cls)}


def _check_auto_options(options: Mapping[str, Any], order: Sequence[str]) -> None:
    accepted = {k for name in order for k in (option_names(CONFIGS[name]) if name in CONFIGS else options)}
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise ValueError(f"solver='auto': option(s) {unknown} are accepted by none of the solvers it tries "
                         f"({', '.join(order)}); they accept: {', '.join(sorted(accepted)) or 'none'}")


def _needs_peak(budget: Any) -> bool:
    return isinstance(budget, float) or (isinstance(budget, str) and budget.strip().endswith("%"))
