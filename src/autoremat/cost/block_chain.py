"""The chain-of-blocks model: a step's peak as a sum of what each block's local plan holds,
read from the simulator (the cost model of the ``blocks`` solver, :mod:`autoremat.solvers.blocks`).

The graph's nodes fall into consecutive *blocks* ``B_0..B_{L-1}`` (contiguous ranges of node
ids: the repeated layers) and *gaps* ``G_0..G_L`` around them (``G_0`` before the first block,
``G_L`` after the last one; the loss belongs to ``G_L``). Each block runs one *local plan* (an
option: segments over its own nodes, stored, recomputed, keeping ops), the gaps are stored.
Relative to the plan ``R`` that stores every block, option ``o`` of block ``j``

* holds ``h_j(o)`` more bytes (negative: fewer) from the end of the block's forward to the
  start of its backward (the largest difference to ``R`` over that time: where the difference
  changes, for instance when the next block's forward releases the block's output, the model
  is above the simulator by at most the change, :func:`chain_slack`);
* peaks at ``F_j(o)`` during the block's forward and at ``B_j(o)`` during its replay and
  backward, every other block being stored;

and the model predicts the step peak of a choice ``o_0..o_{L-1}`` as::

    max( max_j max(F_j(o_j), B_j(o_j), G_j) + H_j ,  G_L + H_L ),   H_j = sum(h_i(o_i), i < j)

where ``G_j`` is the highest level of the gap's events (forward, loss, backward) under ``R``.
Blocks before ``j`` are held while ``B_j`` and ``G_j`` run in forward and backward alike; blocks
after it have run their backward already. The extra time of a choice is the sum of the
options' replayed forward times.

Where the numbers come from: :func:`autoremat.cost.step_levels` of ``R`` and, for each
*context* (a class of identical blocks between given classes of neighbours, :func:`contexts`)
and each option of its class, of ``R`` with one representative block under the option (``h``
is the largest difference to ``R`` between the block's forward and backward); a block of the
context gets ``F`` and ``B`` as its own levels under ``R`` plus the representative's
difference. So the model is exact when each block's holdings are constant from its forward
to its backward and blocks interact only through them; it is above the simulator (never
below) by at most :func:`chain_slack` where a holding changes in between, plus the bytes of a
storage that several blocks read and only their recomputed regions keep, counted once per
block. ``tests/cost/test_block_chain.py`` holds both on seeded random block chains; on the
Hugging Face zoo's captures the difference was 0 on every random choice tried, and the
solver checks every plan it returns with the simulator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..graph import Graph
from ..plan import Plan, Segment
from ..replay_tail import replay_tails
from .block_window import ReferenceWindows
from .simulator import StepLevels, step_levels
from .unreached import recomputing, unreached_units

__all__ = ["BlockChain", "ChainProfile", "chain_plan", "profile_chain", "chain_peak", "chain_time", "chain_slack",
           "contexts"]


@dataclass(frozen=True)
class BlockChain:
    """Blocks (contiguous node ranges, in order), their classes (identical blocks share one) and
    each class's options (local plans: segments over node offsets from the block's first node;
    option 0 stores the block)."""

    blocks: tuple[tuple[int, ...], ...]
    classes: tuple[int, ...]
    options: tuple[tuple[tuple[Segment, ...], ...], ...]
    names: tuple[tuple[str, ...], ...] = ()
    """Per class, a short name of each option (for logs and plan options)."""

    def __post_init__(self) -> None:
        for j, nodes in enumerate(self.blocks):
            if list(nodes) != list(range(nodes[0], nodes[0] + len(nodes))):
                raise ValueError(f"block {j} is not a contiguous range of node ids")
            if j and nodes[0] <= self.blocks[j - 1][-1]:
                raise ValueError(f"block {j} does not start after block {j - 1}")


@dataclass
class ChainProfile:
    """The model's terms for one :class:`BlockChain` (see the module docstring)."""

    held: list[list[int]]
    """Per block, per option: ``h_j(o)``."""
    held_min: list[list[int]]
    """Per block, per option: the smallest difference to ``R`` over the same time."""
    fwd_peak: list[list[int]]
    bwd_peak: list[list[int]]
    gap_peak: list[int]
    """``G_0..G_L``."""
    time_s: list[list[float]]
    """Per block, per option: replayed forward time."""
    sims: int = 0
    """Simulated steps it took."""
    reference: StepLevels | None = field(default=None, repr=False)


def _shifted(seg: Segment, offset: int) -> Segment:
    return Segment(tuple(v + offset for v in seg.nodes), seg.recompute, tuple(v + offset for v in seg.keep))


def chain_plan(graph: Graph, chain: BlockChain, choice: Sequence[int],
               units: Sequence[tuple[int, ...]] | None = None) -> Plan:
    """The plan of a choice of options (one per block): gaps stored (their regions no gradient reaches
    recomputed: :mod:`.unreached`; ``units``: the graph's :func:`~.unreached.unreached_units`, where
    the caller has them), each block's local plan."""
    if len(choice) != len(chain.blocks):
        raise ValueError(f"choice names {len(choice)} options for {len(chain.blocks)} blocks")
    segs: list[Segment] = []
    v = 0
    for j, nodes in enumerate(chain.blocks):
        if nodes[0] > v:
            segs.append(Segment(tuple(range(v, nodes[0])), recompute=False))
        segs.extend(_shifted(seg, nodes[0]) for seg in chain.options[chain.classes[j]][choice[j]])
        v = nodes[-1] + 1
    if v < len(graph):
        segs.append(Segment(tuple(range(v, len(graph))), recompute=False))
    # the gaps' regions no gradient reaches: free (.unreached)
    segs = recomputing(segs, unreached_units(graph) if units is None else units)
    plan = Plan(segs, solver="blocks", graph_fingerprint=graph.fingerprint)
    plan.replay_tails = replay_tails(graph, plan)  # as finalize_plan does: the replays the runtime shortens
    return plan


def _max(values: Sequence[int | None]) -> int:
    return max((x for x in values if x is not None), default=0)


def _block_levels(levels: StepLevels, nodes: Sequence[int]) -> tuple[int, int]:
    fwd = _max([levels.fwd_touch[v] for v in nodes])
    bwd = max(_max([levels.bwd_touch[v] for v in nodes]), _max([levels.recompute_touch[v] for v in nodes]))
    return fwd, bwd


def _held(levels: StepLevels, ref: StepLevels, after: int) -> tuple[int, int]:
    """The largest and smallest difference to ``R`` at the events between a block's forward
    (ending with node ``after``) and its backward."""
    diffs = [levels.loss_fwd_touch - ref.loss_fwd_touch, levels.loss_bwd_touch - ref.loss_bwd_touch]
    for touch, rtouch in ((levels.fwd_touch, ref.fwd_touch), (levels.bwd_touch, ref.bwd_touch)):
        diffs.extend(touch[v] - rtouch[v] for v in range(after + 1, len(touch))
                     if touch[v] is not None and rtouch[v] is not None)
    return max(diffs), min(diffs)


def contexts(chain: BlockChain) -> list[tuple[int | None, int, int | None]]:
    """Each block's context: the classes of the block before it, its own, and the one after it
    (``None`` at the ends): what decides, besides the block itself, how long its storages live."""
    c = chain.classes
    return [(c[j - 1] if j else None, c[j], c[j + 1] if j + 1 < len(c) else None) for j in range(len(c))]


def profile_chain(graph: Graph, chain: BlockChain, representative: Sequence[int] | None = None, *,
                  windows: bool = True) -> ChainProfile:
    """The model's terms from the simulator: one step of ``R`` and one per (context, option)
    with a representative block of the context (:func:`contexts`; default: its middle block,
    or the blocks ``representative`` names, one per context in order of first appearance)
    under the option. ``windows``: simulate each option only where it differs from ``R``
    (:mod:`.block_window`, the same terms); ``False``: a whole step each."""
    n_blocks = len(chain.blocks)
    members: dict[tuple, list[int]] = {}
    ctx = contexts(chain)
    for j, key in enumerate(ctx):
        members.setdefault(key, []).append(j)
    rep = {key: (representative[i] if representative is not None else js[len(js) // 2])
           for i, (key, js) in enumerate(members.items())}
    units = unreached_units(graph)  # once: a scan of every node (87 plans on a 64-layer GPT-2)
    reference = chain_plan(graph, chain, [0] * n_blocks, units)
    window = ReferenceWindows(graph, reference, chain.blocks, rep.values()) if windows else None
    ref = window.levels if window is not None else step_levels(graph, reference)
    ref_levels = [_block_levels(ref, nodes) for nodes in chain.blocks]
    per_class: dict[tuple, list[tuple[tuple[int, int], int, int, float]]] = {}
    sims = 1
    for key, k in rep.items():
        rows = [((0, 0), ref_levels[k][0], ref_levels[k][1], 0.0)]
        for o in range(1, len(chain.options[key[1]])):
            choice = [0] * n_blocks
            choice[k] = o
            plan = chain_plan(graph, chain, choice, units)
            sims += 1
            if window is not None:
                t = window.price(plan, k)
                rows.append(((t.held_max, t.held_min), t.fwd_peak, t.bwd_peak, t.extra_time_s))
                continue
            lv = step_levels(graph, plan)
            fwd, bwd = _block_levels(lv, chain.blocks[k])
            rows.append((_held(lv, ref, chain.blocks[k][-1]), fwd, bwd, lv.extra_time_s))
        per_class[key] = rows
    held, held_min, fwd_peak, bwd_peak, times = [], [], [], [], []
    for j, key in enumerate(ctx):
        k = rep[key]
        rows = per_class[key]
        held.append([h[0] for h, _f, _b, _t in rows])
        held_min.append([h[1] for h, _f, _b, _t in rows])
        fwd_peak.append([ref_levels[j][0] + f - ref_levels[k][0] for _h, f, _b, _t in rows])
        bwd_peak.append([ref_levels[j][1] + b - ref_levels[k][1] for _h, _f, b, _t in rows])
        times.append([t for _h, _f, _b, t in rows])
    return ChainProfile(held=held, held_min=held_min, fwd_peak=fwd_peak, bwd_peak=bwd_peak,
                        gap_peak=_gap_peaks(graph, chain, ref), time_s=times, sims=sims, reference=ref)


def _gap_peaks(graph: Graph, chain: BlockChain, ref: StepLevels) -> list[int]:
    """``G_0..G_L``: the highest level of each gap's forward and backward events under ``R``
    (the loss in ``G_L``)."""
    gap = [0] * (len(chain.blocks) + 1)
    starts = [nodes[0] for nodes in chain.blocks]
    ends = [nodes[-1] for nodes in chain.blocks]
    j = 0
    for v in range(len(graph)):
        while j < len(starts) and v > ends[j]:
            j += 1
        if j < len(starts) and starts[j] <= v <= ends[j]:
            continue
        gap[j] = max(gap[j], _max([ref.fwd_touch[v], ref.bwd_touch[v]]))
    gap[-1] = max(gap[-1], ref.loss_fwd_touch, ref.loss_bwd_touch)
    return gap


def chain_peak(profile: ChainProfile, choice: Sequence[int]) -> int:
    """The model's step peak of a choice (module docstring)."""
    held = 0
    peak = 0
    for j, o in enumerate(choice):
        peak = max(peak, profile.fwd_peak[j][o] + held, profile.bwd_peak[j][o] + held, profile.gap_peak[j] + held)
        held += profile.held[j][o]
    return max(peak, profile.gap_peak[-1] + held)


def chain_time(profile: ChainProfile, choice: Sequence[int]) -> float:
    """The model's extra time of a choice: the options' replayed forward times."""
    return float(sum(profile.time_s[j][o] for j, o in enumerate(choice)))


def chain_slack(profile: ChainProfile, choice: Sequence[int]) -> int:
    """How far above the simulator the model's peak of a choice may be because holdings change
    between a block's forward and backward: the sum of the chosen options' changes."""
    return int(sum(profile.held[j][o] - profile.held_min[j][o] for j, o in enumerate(choice)))
