"""Plans: what to recompute, as an ordered sequence of segments (Kusumoto et al. §3).

A :class:`Plan` is the canonical strategy of an increasing sequence of lower sets
``L1 ⊂ L2 ⊂ … ⊂ Lk = V``: segment ``i`` holds ``Vi = Li \\ L(i-1)``. A segment with
``recompute=True`` runs inside one non-reentrant checkpoint region: its outputs
(``Vi ∩ ∂(Li)`` plus model outputs) are kept, everything it saves for backward is dropped
and recomputed once when backward reaches it. A segment with ``recompute=False`` runs as
usual. :func:`validate_plan` checks every invariant; every solver test calls it.

A recomputed segment may *keep* some of its nodes' outputs (``Segment.keep``: selective saves,
``torch.utils.checkpoint.create_selective_checkpoint_contexts``): a kept output is stored in
forward and handed to the replay instead of being recomputed. At module level a recomputed
segment is one module call: a single node, or every node of one call region of the graph
(:meth:`~autoremat.graph.Graph.call_regions`: the ops of a block captured op by op); the plan
names the call and the kept ops in ``module_calls`` (filled by :func:`autoremat.solve`).
"""

from __future__ import annotations

import os

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from .call_names import is_per_call
from .errors import PlanFormatError, PlanMismatchError
from ._jsonio import dump_json
from .graph import Graph
from .plan_offload import (check_offload_saved, offload_units, offloadable_nodes, region_stop, release_waits,
                           saved_unit_nodes, wait_points)
from .plan_schema import check_plan_dict, load_plan_json

__all__ = ["Segment", "Plan", "proof_words", "validate_plan", "release_waits", "check_segments", "PLAN_FORMAT_VERSION",
           "segments_from_lower_sets",
           "offloadable_nodes", "region_stop", "wait_points", "GRAPH_FIELDS", "saved_unit_nodes", "offload_units",
           "ReplayTails", "ModuleCalls",
           "module_calls_of"]

PLAN_FORMAT_VERSION = 2
"""The plan document this autoremat writes; it reads this one and format 1 (see
:mod:`autoremat.plan_schema`)."""


@dataclass(frozen=True)
class Segment:
    """One segment ``Vi`` of a canonical strategy."""

    nodes: tuple[int, ...]
    recompute: bool = True
    keep: tuple[int, ...] = ()
    """Nodes of a recomputed segment whose outputs are stored in forward and reused by the
    replay instead of recomputed (selective saves; module-level graphs)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "nodes", tuple(sorted(int(v) for v in self.nodes)))
        object.__setattr__(self, "keep", tuple(sorted({int(v) for v in self.keep})))
        if type(self.recompute).__name__ in ("bool_", "bool"):  # numpy booleans too; never a string
            object.__setattr__(self, "recompute", bool(self.recompute))


ReplayTails = dict[int, tuple[int, tuple[int, ...]]]
"""Segment index -> (first node of its replay tail, the tail inputs): see :mod:`autoremat.replay_tail`."""

GRAPH_FIELDS = ("graph_mode", "node_names", "replay_tails", "tensors", "inputs")
"""What :func:`autoremat.apply` reads besides the segments: typed fields of :class:`Plan`. Plan
format 1 kept them in ``options``; a plan given them there (an older file, or code written for
it) has them moved to the fields."""


ModuleCalls = dict[int, tuple[str, tuple[tuple[int, str], ...]]]
"""Segment index -> (path of the module call a module-level recomputed segment runs as, the ops
its region keeps as ``(index in the call's op sequence, op name)``): what :func:`autoremat.apply`
wraps (:mod:`autoremat.runtime.selective`)."""


def _calls(value: Any) -> ModuleCalls:
    """Module calls in their typed form, from the typed form or the JSON one."""
    out: ModuleCalls = {}
    for k, v in dict(value or {}).items():
        if isinstance(v, Mapping):
            path, ops = v["path"], list(zip(v.get("keep_ops", ()), v.get("keep_names", ())))
        else:
            path, ops = v[0], v[1]
        out[int(k)] = (str(path), tuple((int(i), str(name)) for i, name in ops))
    return out


def _tails(value: Any) -> ReplayTails:
    """Replay tails in their typed form, from the typed form or the JSON one (string keys)."""
    return {int(k): (int(v[0]), tuple(int(u) for u in v[1])) for k, v in dict(value or {}).items()}


def proof_words(basis: str | None) -> str:
    """How a ``milp`` bound of ``basis`` (``milp_bound_basis``) is proven, in a summary's words: in the
    exact model (the lattice search's bases, :mod:`autoremat.solvers.milp.exact`) or over the simulator."""
    return {"exact model": "proven in the exact model",
            "exact model, replay tails": "proven in the exact model, replays priced to their tails",
            }.get(basis or "", "proven")


@dataclass
class Plan:
    """An executable recomputation plan for one graph.

    Besides what to recompute and offload (``segments``, ``offload``) a plan records what it was
    solved for (``solver``, ``options``: the solver's options and diagnostics, ``budget_bytes``,
    the predictions) and what :func:`autoremat.apply` checks it against and runs: the graph it
    was made for (``graph_fingerprint``, ``graph_mode``, ``node_names``, ``tensors``,
    ``inputs``) and the shortened replays (``replay_tails``). :func:`autoremat.solve` and every
    solver of :data:`autoremat.SOLVERS` fill them in.
    """

    segments: list[Segment]
    solver: str = "none"
    options: dict[str, Any] = field(default_factory=dict)
    budget_bytes: int | None = None
    graph_fingerprint: str = ""
    predicted_peak_bytes: int | None = None
    predicted_extra_time_s: float | None = None
    offload: tuple[int, ...] = ()
    """Nodes whose output storage the plan keeps for backward in host memory (see
    :func:`offloadable_nodes`): every holder of it — each node outside a recomputed segment that
    saves it, and each recomputed segment that takes it as an input (an offloaded checkpoint) —
    reads the host copy. It is copied to host when its first holder takes it, its device memory
    released once the copy is complete and forward no longer reads it, and it is prefetched back
    in order of first backward use (the transfer model: :mod:`autoremat.cost.offload_link`). Views
    share their base's storage: name the base node."""
    offload_saved: tuple[int, ...] = ()
    """Nodes whose own saved tensors (``extra_saved_bytes``: what a module call's autograd graph keeps
    besides node outputs) live in host memory as one unit between the node's forward and its
    backward: ``save_on_cpu`` scoped to that call (:mod:`autoremat.plan_offload`); never a node of a
    recomputed segment. Where blocks were captured op by op, a block's first op stands for all the
    block's call saves (:mod:`autoremat.region_units`)."""
    offload_waits: dict[int, int] = field(default_factory=dict)
    """Forward waits: node ``v`` -> offloaded unit ``r`` (a node of ``offload``, or ``-1 - w`` for
    ``w`` of ``offload_saved``): before ``v`` runs, the forward waits until the copy of ``r`` to
    host is complete (so its device memory is free). ``v`` must be a :func:`wait_points` node;
    without a wait the forward never waits for a copy."""
    offload_order: tuple[int, ...] = ()
    """The offloaded units (``offload``, and ``-1 - w`` for ``w`` of ``offload_saved``) in order of
    first backward use: the order the runtime prefetches in (:func:`autoremat.solvers.finalize_plan`
    fills it from the simulator; empty: the runtime prefetches the storage whose holder was
    registered last in forward first)."""
    offload_prefetch_depth: int = 1
    """How many offloaded storages backward prefetches ahead of their first use: the first this
    many when backward starts, then one more at each first use (memory reserved at each start)."""
    graph_mode: str | None = None
    """``"fx"`` or ``"module"``: the capture the plan's node ids refer to (``None``: not from a
    capture, so :func:`autoremat.apply` refuses it)."""
    node_names: tuple[str, ...] | None = None
    """The name of every node of the graph (fx node names, or module paths at module level)."""
    replay_tails: ReplayTails = field(default_factory=dict)
    """Recomputed segments whose replay ends early (:mod:`autoremat.replay_tail`)."""
    tensors: dict[str, str] | None = None
    """The captured model's parameters and buffers, name -> ``"dtype[shape]"``."""
    inputs: list[dict[str, Any]] | None = None
    """The example batch's tensors (path, shape, dtype, device type) the plan was made for."""
    bandwidth_bytes_per_s: float | None = None
    """The host<->device link the predictions assumed for ``offload`` (``None``: the graph's, else
    :data:`autoremat.cost.DEFAULT_BANDWIDTH_BYTES_PER_S`)."""
    module_calls: ModuleCalls = field(default_factory=dict)
    """Module-level recomputed segments that are a call region or keep ops (see :data:`ModuleCalls`)."""
    offload_calls: dict[int, str] = field(default_factory=dict)
    """Offload nodes (of ``offload``, ``offload_saved``, or waited before in ``offload_waits``) in one
    call of a module run more than once per step -> that call, ``"<path>@<k>/<n>"``: the runtime's
    hooks act in that call only (:mod:`autoremat.runtime.offload_calls`; filled by
    :func:`autoremat.solve`, or :func:`autoremat.plan_offload.offload_calls_of`)."""
    version: int = PLAN_FORMAT_VERSION

    def __post_init__(self) -> None:
        self.offload = tuple(sorted({int(v) for v in self.offload}))
        self.offload_saved = tuple(sorted({int(v) for v in self.offload_saved}))
        if any(key in self.options for key in GRAPH_FIELDS):  # plan format 1: in options
            self.options = dict(self.options)
            for key in GRAPH_FIELDS:
                if key in self.options:
                    value = self.options.pop(key)
                    if getattr(self, key) in (None, {}):
                        setattr(self, key, value)
        if self.node_names is not None:
            self.node_names = tuple(self.node_names)
        self.replay_tails = _tails(self.replay_tails)
        self.module_calls = _calls(self.module_calls)
        self.offload_waits = {int(k): int(v) for k, v in dict(self.offload_waits or {}).items()}
        self.offload_order = tuple(int(v) for v in self.offload_order)
        self.offload_calls = {int(k): str(v) for k, v in dict(self.offload_calls or {}).items()}
        self.offload_prefetch_depth = int(self.offload_prefetch_depth)
        self.version = PLAN_FORMAT_VERSION

    @property
    def recompute_segments(self) -> list[Segment]:
        return [s for s in self.segments if s.recompute]

    @property
    def offloads(self) -> bool:
        """Whether the plan offloads anything (node outputs or nodes' own saved tensors)."""
        return bool(self.offload or self.offload_saved)

    @property
    def recomputed_nodes(self) -> set[int]:
        return {v for s in self.segments if s.recompute for v in s.nodes}

    def describe(self) -> str:
        k = len(self.recompute_segments)
        tails = len(self.replay_tails)
        short = f" ({tails} with a shortened replay)" if tails else ""
        kept = sum(len(s.keep) for s in self.segments)
        short += f", {kept} op outputs kept in them" if kept else ""
        waits = f" ({len(self.offload_waits)} forward waits)" if self.offload_waits else ""
        inner = f", {len(self.offload_saved)} nodes' saved tensors offloaded" if self.offload_saved else ""
        off = f", {len(self.offload)} offloaded{inner}{waits}" if self.offloads else ""
        gap = self.options.get("optimality_gap")  # "milp": proven distance from the optimum
        proof = proof_words(self.options.get("milp_bound_basis"))
        opt = "" if gap is None else (f", optimal ({proof})" if gap <= 1e-9
                                      else f", within {100 * gap:.3g} % of the optimum ({proof})")
        return f"{self.solver}: {len(self.segments)} segments, {k} recomputed{short}{off}{opt}"

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["format"] = "autoremat.plan"
        d["segments"] = [{"nodes": list(s.nodes), "recompute": s.recompute,
                          **({"keep": list(s.keep)} if s.keep else {})} for s in self.segments]
        d["offload"] = list(self.offload)
        d["offload_saved"] = list(self.offload_saved)
        d["node_names"] = None if self.node_names is None else list(self.node_names)
        d["replay_tails"] = {str(k): [first, list(inputs)] for k, (first, inputs) in sorted(self.replay_tails.items())}
        d["module_calls"] = {str(k): {"path": path, "keep_ops": [i for i, _ in ops], "keep_names": [n for _, n in ops]}
                             for k, (path, ops) in sorted(self.module_calls.items())}
        d["offload_waits"] = {str(k): v for k, v in sorted(self.offload_waits.items())}
        d["offload_order"] = list(self.offload_order)
        d["offload_calls"] = {str(k): v for k, v in sorted(self.offload_calls.items())}
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str | None = None) -> "Plan":
        """A plan from its :meth:`to_dict` form (format 2) or an older file (format 1), checked
        strictly (:mod:`autoremat.plan_schema`); a malformed one raises
        :class:`~autoremat.errors.PlanFormatError` naming the field."""
        check_plan_dict(data, source=source)
        return cls(
            segments=[Segment(tuple(s["nodes"]), s["recompute"], tuple(s.get("keep", ()))) for s in data["segments"]],
            solver=data.get("solver", "none"),
            options=dict(data.get("options", {})),
            budget_bytes=data.get("budget_bytes"),
            graph_fingerprint=data.get("graph_fingerprint", ""),
            predicted_peak_bytes=data.get("predicted_peak_bytes"),
            predicted_extra_time_s=data.get("predicted_extra_time_s"),
            offload=tuple(data.get("offload", ())),
            offload_saved=tuple(data.get("offload_saved", ())),
            offload_waits=data.get("offload_waits") or {},
            offload_order=tuple(data.get("offload_order") or ()),
            offload_prefetch_depth=data.get("offload_prefetch_depth", 1),
            graph_mode=data.get("graph_mode"),
            node_names=data.get("node_names"),
            replay_tails=data.get("replay_tails") or {},
            tensors=data.get("tensors"),
            inputs=data.get("inputs"),
            bandwidth_bytes_per_s=data.get("bandwidth_bytes_per_s"),
            module_calls=data.get("module_calls") or {},
            offload_calls=data.get("offload_calls") or {},
        )

    def to_json(self, path: str | None = None) -> str:
        return dump_json(self.to_dict(), path)

    @classmethod
    def from_json(cls, text_or_path: str | os.PathLike[str]) -> "Plan":
        """From JSON text (starting with ``{``), or from the plan file at ``text_or_path``;
        anything malformed raises :class:`~autoremat.errors.PlanFormatError`."""
        data, source = load_plan_json(text_or_path)
        return cls.from_dict(data, source=source)


def segments_from_lower_sets(
    graph: Graph, lower_sets: Sequence[Iterable[int]], *, recompute_last: bool = False
) -> list[Segment]:
    """Segments ``Vi = Li \\ L(i-1)`` of an increasing lower-set sequence.

    A segment is marked for recomputation when recomputing it can save anything: it is not
    the last one (unless ``recompute_last``) and some node in it saves a tensor. In
    module-level graphs a segment is only recomputed when it is a single recomputable node.
    """
    segs: list[Segment] = []
    prev: set[int] = set()
    for i, lower in enumerate(lower_sets):
        cur = set(lower)
        part = tuple(sorted(cur - prev))
        prev = cur
        if not part:
            continue
        last = i == len(lower_sets) - 1
        saves = any(graph.node(v)["saved_bytes"] > 0 for v in part)
        ok = all(graph.node(v)["recomputable"] for v in part)
        if graph.meta.get("mode") == "module":
            ok = (ok and len(part) == 1) or graph.region_of(part) is not None
        segs.append(Segment(part, recompute=bool(saves and ok and (recompute_last or not last))))
    return segs


def check_segments(plan: Plan, num_nodes: int, *, is_lower_set: Callable[[set[int]], bool] | None = None,
                   module_level: bool = False) -> None:
    """The structural invariants of ``plan`` against a graph of ``num_nodes`` nodes: segments
    non-empty, disjoint, covering ``0..num_nodes-1``, every prefix union a lower set (when
    ``is_lower_set`` is given), one node per recomputed segment at module level, offloaded
    node ids in range. Used by :func:`validate_plan` and by :func:`autoremat.apply` (which has
    the traced model, not a :class:`Graph`).

    A plan that contradicts itself raises :class:`PlanFormatError`; one that does not fit this
    graph (a node id out of range, segments out of dependency order) :class:`PlanMismatchError`.
    """
    n = num_nodes
    seen: set[int] = set()
    for i, seg in enumerate(plan.segments):
        field = f"segments[{i}].nodes"
        if not seg.nodes:
            raise PlanFormatError(field, f"segment {i} is empty; a segment must hold at least one node")
        if len(set(seg.nodes)) != len(seg.nodes):
            raise PlanFormatError(field, f"segment {i} names a node more than once: {list(seg.nodes)[:10]}")
        for v in seg.nodes:
            if not 0 <= v < n:
                raise PlanMismatchError(f"segment {i} names node {v}, but the graph has {n} nodes (ids 0..{n - 1}); "
                                        "the plan was made for another model: capture this one and solve again")
            if v in seen:
                raise PlanFormatError(field, f"node {v} appears in more than one segment; every node belongs "
                                      "to exactly one segment")
        seen.update(seg.nodes)
        if is_lower_set is not None and not is_lower_set(seen):
            raise PlanMismatchError(f"segments 0..{i} do not form a lower set: a node in them depends on a node "
                                    "of a later segment (segments out of order: at module level they follow the forward's "
                                    "own order; or a plan for another model)")
        if module_level and seg.recompute and len(seg.nodes) != 1 and i not in plan.module_calls:
            raise PlanFormatError(field, f"segment {i}: module-level graphs recompute one module call per "
                                  f"segment, got {len(seg.nodes)} nodes and no module_calls entry naming the call")
        if seg.keep and not seg.recompute:
            raise PlanFormatError(f"segments[{i}].keep", f"segment {i} is not recomputed; only a recomputed "
                                  "segment keeps op outputs (selective saves)")
        if not set(seg.keep) <= set(seg.nodes):
            raise PlanFormatError(f"segments[{i}].keep", f"segment {i} keeps nodes "
                                  f"{sorted(set(seg.keep) - set(seg.nodes))[:5]} that are not in it")
    if len(seen) != n:
        missing = sorted(set(range(n)) - seen)
        raise PlanFormatError("segments", f"segments do not cover the graph; missing nodes {missing[:10]} "
                              f"of 0..{n - 1}")
    for v in plan.offload:
        if not 0 <= v < n:
            raise PlanMismatchError(f"offload names node {v}, but the graph has {n} nodes (ids 0..{n - 1}); "
                                    "capture this model and solve again")
    recomputed = plan.recomputed_nodes
    for v in plan.offload_saved:
        if not 0 <= v < n:
            raise PlanMismatchError(f"offload_saved names node {v}, but the graph has {n} nodes (ids 0..{n - 1}); "
                                    "capture this model and solve again")
        if v in recomputed:
            raise PlanFormatError("offload_saved", f"node {v} is in a recomputed segment: it saves nothing in forward "
                                  "(its replay saves again just before its backward); drop it from offload_saved")
    units = offload_units(plan)
    for v, r in plan.offload_waits.items():
        if not 0 <= v < n:
            raise PlanMismatchError(f"offload_waits names node {v}, but the graph has {n} nodes (ids 0..{n - 1}); "
                                    "capture this model and solve again")
        if r not in units:
            raise PlanFormatError(f"offload_waits.{v}", f"waits for the copy of unit {r}, which the plan does not "
                                  f"offload (units: {list(units)[:10]}; -1 - w is node w's own saved tensors)")
    if plan.offload_order and sorted(plan.offload_order) != sorted(units):
        raise PlanFormatError("offload_order", "must list every offloaded unit once (the order of first backward "
                              f"use; -1 - w for node w of offload_saved), got {list(plan.offload_order)[:10]} for "
                              f"units {sorted(units)[:10]}")
    if plan.offload_prefetch_depth < 1:
        raise PlanFormatError("offload_prefetch_depth", f"must be >= 1 (storages prefetched ahead of their first "
                              f"backward use), got {plan.offload_prefetch_depth}")


def validate_plan(graph: Graph, plan: Plan) -> None:
    """Raise ``ValueError`` (:class:`PlanMismatchError`, :class:`PlanFormatError`) unless
    ``plan`` is valid for ``graph``.

    Checks: the fingerprint matches; segments are non-empty, disjoint and cover V; every
    prefix union is a lower set; recomputed segments only hold recomputable nodes, and in
    module-level graphs are single nodes or one call region; kept nodes lie in their
    recomputed segment.
    """
    fp = graph.fingerprint
    if plan.graph_fingerprint and plan.graph_fingerprint != fp:
        raise PlanMismatchError(
            f"plan was made for graph {plan.graph_fingerprint}, not this one ({fp}); "
            "capture the model again and re-solve"
        )
    check_segments(plan, len(graph), is_lower_set=graph.is_lower_set)
    module = graph.meta.get("mode") == "module"
    for i, seg in enumerate(plan.segments):
        if not seg.recompute:
            continue
        path = graph.region_of(seg.nodes) if module else None
        if path is None:
            bad = [v for v in seg.nodes if not graph.node(v)["recomputable"]]
            if bad:
                raise ValueError(f"segment {i} recomputes nodes the runtime cannot wrap: {bad[:5]}")
            if module and len(seg.nodes) != 1:
                raise PlanMismatchError(f"segment {i} recomputes {len(seg.nodes)} nodes: module-level graphs recompute "
                                        "one module call per segment (a single node, or one call region of "
                                        "Graph.call_regions)")
        named = plan.module_calls.get(i)
        if named is not None and path is not None and named[0] != path:
            raise PlanMismatchError(f"module_calls names {named[0]!r} for segment {i}, whose nodes are the call "
                                    f"{path!r}")
    if plan.offload:
        offloadable = offloadable_nodes(graph, plan)
        bad = [v for v in plan.offload if v not in offloadable]
        if bad:
            raise ValueError(f"offload names nodes {bad[:5]} whose output the plan does not keep for backward (no "
                             "node outside a recomputed segment saves it and no recomputed segment that replays "
                             "anything takes it as an input), or that are views, glue ops, or out of range: "
                             "nothing to offload there")
    check_offload_saved(graph, plan)
    if plan.offload_waits:
        points = wait_points(graph, plan)
        bad = sorted(v for v in plan.offload_waits if v not in points)
        if bad:
            raise PlanFormatError("offload_waits", f"nodes {bad[:5]} are not places the runtime can wait at (a "
                                  "node outside the recomputed segments, the first node of a recomputed segment; "
                                  "at module level a module call, or the first op of a block captured op by op)")


def module_calls_of(graph: Graph, plan: Plan) -> ModuleCalls:
    """What :func:`autoremat.apply` wraps for each module-level recomputed segment that is a call
    region (one call of a shared module among them, ``"<path>@<k>/<n>"``) or keeps ops: the call's path and the kept ops as (index in the call's op sequence,
    op name), from the nodes' ``op_index`` within their outermost call (``graph.meta
    ["call_op_start"]`` gives where each call's sequence starts)."""
    if graph.meta.get("mode") != "module":
        return {}
    starts: Mapping[str, int] = graph.meta.get("call_op_start", {})
    out: ModuleCalls = {}
    for i, seg in enumerate(plan.segments):
        path = graph.region_of(seg.nodes) if seg.recompute else None
        single = len(seg.nodes) == 1 and not seg.keep and graph.node(seg.nodes[0])["op_index"] < 0
        if not seg.recompute or (single and (path is None or not is_per_call(path))):
            continue  # a module node of a module called once: its node name is the call
        if path is None and len(seg.nodes) == 1 and graph.node(seg.nodes[0])["op_index"] < 0:
            path = graph.node(seg.nodes[0])["module_path"]
        if path is None:
            raise PlanMismatchError(f"segment {i} is not one module call of the graph; please report")
        if seg.keep and path not in starts:
            raise PlanMismatchError(f"segment {i} keeps ops of {path!r}, whose ops were not captured one by one")
        ops = tuple((int(graph.node(v)["op_index"]) - int(starts[path]), str(graph.node(v)["target"]))
                    for v in seg.keep)
        out[i] = (str(path), ops)
    return out
