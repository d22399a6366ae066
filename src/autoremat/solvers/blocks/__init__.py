"""``"blocks"``: repeated blocks solved once, then the chain of blocks by dynamic programming.

Problem. Most models people train are a chain of identical blocks (transformer layers, residual
stages). Per-layer checkpointing is one point of a large space: inside a layer a plan may
recompute all of it, some of its sub-modules (each its own region: a smaller replay at a time),
or keep the outputs of its expensive ops (selective saves); across layers each may choose
differently. This solver

1. finds the blocks and groups identical ones (:mod:`.detect`: same module class, same shapes,
   same subgraph);
2. lists, once per class, the block's options (:mod:`.options`: store, whole, split into
   sub-module regions, and at module level keep-sets from a knapsack over the ops' bytes and
   times) and prices each with the simulator on one representative block
   (:func:`autoremat.cost.block_chain.profile_chain`);
3. chooses one option per block by the chain's dynamic program (:mod:`.dp`): the least extra
   time whose model peak fits the budget;
4. checks the plan with :func:`autoremat.simulate`; if the model was optimistic (the blocks
   interact beyond what they hold), it lowers its internal budget by the excess and solves
   again (at most ``retries`` times), logging why; when none of those fits, the plan of the
   chain's least-peak choice is the last resort, and its simulated peak is the least budget an
   :class:`~autoremat.errors.InfeasibleBudgetError` reports (a budget this solver meets).

Related work: the chain structure is the one of rotor [1]_, whose dynamic program for
heterogeneous chains also recomputes blocks several times (nested checkpoints); Rockmate [2]_
solves each block's options once and chains them with rotor's program. This solver stays in
the canonical plans autoremat's runtime executes (every op recomputed at most once: a block's
option is a set of flat regions), where the chain program is a multiple-choice knapsack with
prefix constraints (exact for the model, up to the byte quantisation of the state).

Complexity: ``1 + sum over classes (options - 1)`` simulated steps (each O(n + e)) to price the
options, O(L · K · S) for the program (``L`` blocks, ``K`` options, ``S`` states), plus one
simulated step per attempt. Profiles are cached per graph object, so ``min_budget`` and
repeated solves price once.

Limitations: gaps between blocks (embeddings, the head, the loss) are stored; a graph without
repeated blocks gets the plan without recomputation or an infeasible-budget error. The model's
peak is exact when blocks interact only through what they hold (tested on the zoo); otherwise
step 4 corrects it.

.. [1] O. Beaumont, L. Eyraud-Dubois, J. Herrmann, A. Joly, A. Shilova, "Optimal checkpointing
   for heterogeneous chains: how to train deep neural networks with limited memory", ACM TOMS
   2024 (arXiv:1911.13214); the ``rotor`` package.
.. [2] X. Zhao, T. Le Hellard, L. Eyraud-Dubois, J. Gusak, O. Beaumont, "Rockmate: an Efficient,
   Fast, Automatic and Generic Tool for Re-materialization in PyTorch", ICML 2023.
"""

from __future__ import annotations

import logging
import statistics
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ...cost import no_recompute_plan, simulate, unoptimised_peak_bytes
from ...cost.block_chain import BlockChain, ChainProfile, chain_plan, profile_chain
from ...errors import InfeasibleBudgetError
from ...graph import Graph
from ...plan import Plan
from .._config import SolverConfig
from .detect import Blocks, find_blocks
from .dp import least_peak, solve_chain
from .options import block_options

__all__ = ["solve_blocks", "BlocksConfig", "chain_of", "Blocks", "find_blocks", "repeats"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BlocksConfig(SolverConfig):
    """Options of ``blocks``."""

    solver: ClassVar[str] = "blocks"
    keep_fractions: tuple[float, ...] = field(default=(0.05, 0.1, 0.2, 0.35, 0.5, 0.75), metadata={
        "help": "fractions of a region's bytes a keep option may keep (module level; () for none)"})
    max_parts: int = field(default=5, metadata={"help": "a block with more parts lists fewer split options"})
    units: int = field(default=4096, metadata={"help": "states of the chain program (byte quantisation)"})
    retries: int = field(default=4, metadata={"help": "solves with a lowered budget after a plan over budget"})

    def __post_init__(self) -> None:
        if not all(isinstance(f, (int, float)) and 0 < f <= 1 for f in self.keep_fractions):
            raise ValueError(f"blocks: keep_fractions={self.keep_fractions!r} must be numbers in (0, 1]")
        for name in ("max_parts", "units", "retries"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"blocks: {name}={value!r} must be an int >= 1")


_CACHE: "weakref.WeakKeyDictionary[Graph, dict[Any, tuple[BlockChain, ChainProfile]]]" = weakref.WeakKeyDictionary()


def chain_of(graph: Graph, config: BlocksConfig | None = None) -> tuple[BlockChain, ChainProfile] | None:
    """The graph's chain of blocks with every class's options, priced (cached per graph object and
    options); ``None`` when the graph has no blocks."""
    cfg = config or BlocksConfig()
    key = (graph.fingerprint, cfg.keep_fractions, cfg.max_parts)
    cached = _CACHE.setdefault(graph, {})
    if key not in cached:
        built = _build(graph, cfg)
        if built is None:
            return None
        cached[key] = built
    return cached[key]


def _class_times(graph: Graph, blocks: Blocks, c: int) -> dict[int, float]:
    """Node of the class's first block -> the median forward time of that node over the class."""
    members = [blocks.nodes[j] for j, k in enumerate(blocks.classes) if k == c]
    first = members[0]
    return {v: statistics.median(graph.node(m[i])["time_s"] for m in members) for i, v in enumerate(first)}


def _build(graph: Graph, cfg: BlocksConfig) -> tuple[BlockChain, ChainProfile] | None:
    t0 = time.perf_counter()
    blocks = find_blocks(graph)
    if not blocks.nodes:
        return None
    index = {c: i for i, c in enumerate(dict.fromkeys(blocks.classes))}
    options, names = [], []
    for c in index:
        found = block_options(graph, blocks.paths[c], blocks.nodes[c], _class_times(graph, blocks, c),
                              keep_fractions=cfg.keep_fractions, max_parts=cfg.max_parts)
        names.append(tuple(name for name, _ in found))
        options.append(tuple(segs for _, segs in found))
    chain = BlockChain(blocks=blocks.nodes, classes=tuple(index[c] for c in blocks.classes), options=tuple(options),
                       names=tuple(names))
    logger.info("blocks: %d blocks in %d classes, %d options to price", len(blocks.nodes), len(index),
                sum(len(o) for o in options))
    profile = profile_chain(graph, chain)
    logger.info("blocks: priced with %d simulated steps in %.2f s", profile.sims, time.perf_counter() - t0)
    return chain, profile


def solve_blocks(graph: Graph, budget_bytes: int, *, config: dict[str, Any] | BlocksConfig | None = None) -> Plan:
    """The chain of blocks' least-time plan within ``budget_bytes`` (module docstring)."""
    cfg = BlocksConfig.parse(config)
    vanilla = no_recompute_plan(graph)
    if simulate(graph, vanilla, check=False, record=False).peak_bytes <= budget_bytes:
        vanilla.solver = "blocks"
        return vanilla
    built = chain_of(graph, cfg)
    if built is None:
        peak = simulate(graph, vanilla, check=False, record=False).peak_bytes
        logger.info("blocks: the graph has no repeated blocks (no scope entry names a container member)")
        raise InfeasibleBudgetError(budget_bytes, peak, solver="blocks")
    chain, profile = built
    target = budget_bytes
    for attempt in range(cfg.retries + 1):
        sol = solve_chain(profile, target, units=cfg.units)
        if sol is None:
            break
        plan = chain_plan(graph, chain, sol.choice)
        peak = simulate(graph, plan, check=False, record=False).peak_bytes
        if peak <= budget_bytes:
            plan.options = {"blocks": len(chain.blocks), "classes": len(chain.options),
                            "choice": _summary(chain, sol.choice), "attempts": attempt + 1}
            return plan
        logger.info("blocks: the chain model put the plan at %d bytes, the simulator at %d (over a %d-byte budget); "
                    "solving again %d bytes lower", peak - (peak - target), peak, budget_bytes, peak - budget_bytes)
        target -= peak - budget_bytes
    least = _least_plan(graph, chain, profile, cfg)
    if least is None:  # no choice at all below the unoptimised peak: the plan without recomputation is the least
        raise InfeasibleBudgetError(budget_bytes, simulate(graph, vanilla, check=False, record=False).peak_bytes,
                                    solver="blocks")
    plan, peak, choice = least
    if peak <= budget_bytes:  # the retries lowered the model's budget past the plan that fits
        logger.info("blocks: no least-time plan fit; using the chain's least-peak plan (%d bytes)", peak)
        plan.options = {"blocks": len(chain.blocks), "classes": len(chain.options),
                        "choice": _summary(chain, choice), "attempts": cfg.retries + 1, "least_peak_choice": True}
        return plan
    raise InfeasibleBudgetError(budget_bytes, peak, solver="blocks")


def repeats(plan: Plan) -> bool:
    """Whether ``plan`` is this solver's over a chain in which some blocks repeat (fewer classes
    than blocks): where it is exact over options solved once per class. A chain of blocks all
    different (DenseNet's dense blocks and transitions) is a coarse partition of the graph, which
    the node-by-node solvers plan better (``auto`` asks them there, :func:`autoremat.solve`)."""
    blocks, classes = plan.options.get("blocks", 0), plan.options.get("classes", 0)
    return plan.solver == "blocks" and 0 < classes < blocks


def _least_plan(graph: Graph, chain: BlockChain, profile: ChainProfile,
                cfg: BlocksConfig) -> tuple[Plan, int, tuple[int, ...]] | None:
    """The least-time choice at the least model budget the chain program meets, its plan and
    simulated peak: the least budget :func:`solve_blocks` reports is one it meets (this plan is
    its last resort). The program's least budget is found from :func:`least_peak` (its states
    merge by peak, the program's by time, so it may need more) by bisection up to the
    unoptimised peak; ``None`` when it meets none below that."""
    lo = least_peak(profile, units=cfg.units)
    sol = solve_chain(profile, lo, units=cfg.units)
    if sol is None:
        hi = unoptimised_peak_bytes(graph)
        best = solve_chain(profile, hi, units=cfg.units)
        if best is None:
            return None
        while hi - lo > 1:  # solve_chain(lo) is None, best = solve_chain(hi)
            mid = (lo + hi) // 2
            found = solve_chain(profile, mid, units=cfg.units)
            lo, hi, best = (lo, mid, found) if found is not None else (mid, hi, best)
        sol = best
    plan = chain_plan(graph, chain, sol.choice)
    return plan, simulate(graph, plan, check=False, record=False).peak_bytes, sol.choice


def _summary(chain: BlockChain, choice: tuple[int, ...]) -> dict[str, int]:
    out: dict[str, int] = {}
    for j, o in enumerate(choice):
        name = chain.names[chain.classes[j]][o] if chain.names else str(o)
        out[name] = out.get(name, 0) + 1
    return out
