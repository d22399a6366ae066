"""Plans on models sharded by FSDP2 (``fully_shard``) or FSDP1 (``FullyShardedDataParallel``).

An FSDP *unit* (:mod:`autoremat._fsdp`) owns its parameters through its ``__call__``: FSDP2's
hooks all-gather them before its forward, reshard them after it and reduce-scatter the
gradients after its backward; FSDP1's ``forward`` does the same with a flat parameter. A
generated forward that calls the leaf layers inside a unit directly (what an fx-level plan
runs) skips all of that: applied before ``fully_shard`` it met sharded ``DTensor`` parameters
("got mixed torch.Tensor and DTensor"), applied after it could not trace FSDP1's wrappers.

**Decision: regions never cross a unit's boundary; a unit the plan cuts is opened.** ``apply``
traces the model *through* its units under their pre-sharding names (the graph the plan was
made for, :func:`~autoremat.runtime._unit_trace.canonical_trace`) and maps the plan onto the
units:

* the plan's segments are cut where a unit starts or ends (:func:`snap_plan`): every segment
  then lies inside one *level* (the model's own code, or one unit's own code between the units
  below it), and is recomputed if it was. Executed in the order of their original segments (a
  topological order of units and ops with the unit called once, as the model calls it), the cut
  segments are again a plan of the same graph (lower sets), which the simulator predicts; only
  where a unit cuts a recomputed segment do they keep more (the unit's inputs and outputs);
* each level with a recomputed segment gets a generated forward of its own, made from a trace
  of that level with the units below it as leaves (:func:`~autoremat.runtime._unit_trace.level_trace`):
  the model's ``forward`` calls each unit through ``__call__`` (FSDP's hooks or wrapper run as
  without autoremat), and an opened unit's ``forward`` (FSDP1: the wrapped module's) runs its own
  segments. A unit that is a leaf layer (``fully_shard(model.lm_head)``) is a segment of its
  own.

Why not regions around units: a recomputed region that holds a unit's call replays it in
backward before that unit's backward has begun, so FSDP all-gathers its parameters once more
(its pre-forward in the replay; FSDP2 skips it only for a unit already in its pre-backward).
With regions inside units, every recomputation runs while FSDP has the unit unsharded for its
own backward: **a plan adds no collective** to the step (measured:
``benchmarks/results/cpu/fsdp/``: the same all-gathers and reduce-scatters, of the same sizes,
as the unpatched sharded model, and as FSDP with PyTorch's per-block checkpointing). The price
is memory where a unit cuts a recomputed segment; the simulator predicts the cut plan
(:func:`sharded_plan_of` holds it) and :mod:`autoremat.per_rank` charges it to the budget.

Both orders work: **shard, then apply** maps the plan at ``apply``; **apply, then shard**
installs a watcher on the patched forward that, at the first forward after FSDP units appear
(``fully_shard`` registered new modules, or an FSDP1 wrapper replaced a submodule), maps the plan
onto them the same way (once). Offload plans are refused on sharded models. Module-level plans
(:func:`apply_module_sharded`) wrap the recomputed modules found by canonical path: under FSDP1
the wrapped module (regions inside the wrapper), under FSDP2 the module itself (its ``forward``,
inside the unit's hooks) — FSDP2's and PyTorch's own activation-checkpointing composition.
"""

from __future__ import annotations

import dataclasses

import heapq
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch import nn

from .._fsdp import (UNKNOWN, canonical_modules, canonical_path, fsdp_state_count, has_sharded_params, has_units,
                     inner_module, logical_signature, units_of)
from ..capture.fx import fx_fingerprint, fx_ops
from ..capture.module import module_fingerprint, node_modules
from ..capture.signature import first_difference, tensor_signature
from ..errors import PlanMismatchError
from ..plan import Plan, Segment, check_segments
from ._unit_trace import CanonicalTrace, Item, canonical_trace, level_items, level_trace, map_level

__all__ = ["ShardedPatch", "snap_plan", "apply_fx_sharded", "ShardingWatch", "sharded_plan_of",
           "canonical_node_modules", "module_plan_fingerprint", "is_sharded"]

logger = logging.getLogger(__name__)


@dataclass
class ShardedPatch:
    """How a plan runs on a sharded model: the plan cut at unit boundaries (``plan``, over the
    same graph), the units, and the levels that got a generated forward (canonical path, ``""``
    for the model)."""

    plan: Plan
    units: dict[str, nn.Module]
    levels: list[str] = field(default_factory=list)


def sharded_plan_of(model: nn.Module) -> Plan | None:
    """The plan a sharded, patched model runs (cut at its FSDP units, see :func:`snap_plan`),
    or ``None`` when it is not sharded or not patched."""
    from . import _STATE_ATTR

    state = inner_module(model).__dict__.get(_STATE_ATTR)
    sharded = getattr(state, "sharded", None)
    return sharded.plan if isinstance(sharded, ShardedPatch) else None


# ---------------------------------------------------------------------------- the plan
def _unit_order(canon: CanonicalTrace, seg_of: list[int]) -> list[int]:
    """Canonical op indices in an execution order that calls each unit once, in one piece, and
    otherwise follows the plan's segments (ties: trace order)."""
    index = {n: i for i, n in enumerate(canon.ops)}
    preds = [{index[u] for u in n.all_input_nodes if u in index} for n in canon.ops]

    def order(path: str | None) -> list[int]:
        items = level_items(canon, path)
        item_of = {v: k for k, it in enumerate(items) for v in it.ops}
        users: list[list[int]] = [[] for _ in items]
        indeg = [0] * len(items)
        for k, it in enumerate(items):
            inner = set(it.ops)
            deps = {item_of[u] for v in it.ops for u in preds[v] if u not in inner and u in item_of}
            indeg[k] = len(deps)
            for d in deps:
                users[d].append(k)
        key = [(min(seg_of[v] for v in it.ops), it.ops[0]) for it in items]
        heap = [(key[k], k) for k in range(len(items)) if indeg[k] == 0]
        heapq.heapify(heap)
        out: list[int] = []
        while heap:
            _, k = heapq.heappop(heap)
            it = items[k]
            out.extend(order(it.unit) if it.unit is not None else it.ops)
            for w in users[k]:
                indeg[w] -= 1
                if indeg[w] == 0:
                    heapq.heappush(heap, (key[w], w))
        assert len(out) == sum(len(it.ops) for it in items), "unit order is not total, please report"
        return out

    return order(None)


def snap_plan(plan: Plan, canon: CanonicalTrace) -> Plan:
    """``plan`` with its segments cut where an FSDP unit starts or ends (module docstring):
    the same graph, nodes and recompute choices; replay tails are dropped (a cut segment's tail
    is another one). Raises :class:`PlanMismatchError` for an offload plan."""
    if plan.offloads:
        raise PlanMismatchError("offload plans are not supported on FSDP-sharded models (FSDP moves the parameters "
                                "itself); solve without offload (solver other than 'combined'/'offload-*', or "
                                "AutoRemat(offload=False))")
    n = len(canon.ops)
    seg_of = [0] * n
    for si, seg in enumerate(plan.segments):
        for v in seg.nodes:
            seg_of[v] = si
    segments: list[Segment] = []
    run: list[int] = []
    last: tuple[int, tuple[str, ...]] | None = None
    for v in _unit_order(canon, seg_of):
        here = (seg_of[v], canon.units[v][-1:])
        if run and here != last:
            segments.append(Segment(tuple(run), plan.segments[seg_of[run[0]]].recompute))
            run = []
        run.append(v)
        last = here
    if run:
        segments.append(Segment(tuple(run), plan.segments[seg_of[run[0]]].recompute))
    options = {k: v for k, v in plan.options.items() if k != "replay_tails"}
    options["sharded_cuts"] = len(segments) - len(plan.segments)
    snapped = dataclasses.replace(plan, segments=segments, options=options, replay_tails={})
    index = {node: i for i, node in enumerate(canon.ops)}
    preds = [{index[u] for u in node.all_input_nodes if u in index} for node in canon.ops]
    check_segments(snapped, n, is_lower_set=lambda seen: all(preds[v] <= seen for v in seen))
    return snapped


def _level_plan(snapped: Plan, canon: CanonicalTrace, items: list[Item], names: list[str]) -> Plan:
    """The segments of ``snapped`` that run at one level (its items, as matched with the level's
    trace): its own ops as cut, each unit call below it a plain segment (a leaf unit: as cut)."""
    seg_of = {v: si for si, seg in enumerate(snapped.segments) for v in seg.nodes}
    groups: dict[int, list[int]] = {}
    recompute: dict[int, bool] = {}
    for k, it in enumerate(items):
        si = seg_of[it.ops[0]]
        leaf_unit = it.unit is not None and len(it.ops) == 1 and canon.ops[it.ops[0]].op == "call_module" \
            and str(canon.ops[it.ops[0]].target) == it.unit
        if it.unit is not None and not leaf_unit:
            key = -1 - k  # a unit call: a segment of its own, run plainly
            recompute[key] = False
        else:
            key = si
            recompute[key] = snapped.segments[si].recompute
        groups.setdefault(key, []).append(k)
    first = {key: min(min(seg_of[v] for v in items[k].ops) for k in ks) for key, ks in groups.items()}
    order = sorted(groups, key=lambda key: (first[key], groups[key][0]))
    segments = [Segment(tuple(groups[key]), recompute[key]) for key in order]
    return Plan(segments, solver=snapped.solver, options={"graph_mode": "fx", "node_names": names})


# ---------------------------------------------------------------------------- apply
def _check_canonical(model: nn.Module, plan: Plan, canon: CanonicalTrace, names: list[str]) -> None:
    ops = [n.name for n in canon.ops]
    if ops != list(names):
        why = first_difference(list(names), ops, "node")
        raise PlanMismatchError(f"plan node names do not match the sharded model traced through its FSDP units ({why}); "
                                "capture the model (unsharded) and solve again")
    recorded = plan.tensors
    if recorded:
        why = first_difference(recorded, _comparable(tensor_signature(canon.gm), logical_signature(model), recorded),
                               "tensor")
        if why:
            raise PlanMismatchError(f"plan was made for other tensors than the sharded {type(model).__name__} holds "
                                    f"({why}); capture this model and solve again")
    fp = fx_fingerprint(canon.gm, tensors=recorded or None)
    if plan.graph_fingerprint and recorded and fp != plan.graph_fingerprint:
        raise PlanMismatchError(f"plan was made for graph {plan.graph_fingerprint} but the sharded "
                                f"{type(model).__name__} traces to {fp} (other edges or op kinds); capture this model "
                                "and solve again")


def _comparable(own: dict[str, str], logical: dict[str, str], recorded: dict[str, str]) -> dict[str, str]:
    """A sharded model's tensor signature to compare with the plan's: its own entries (buffers;
    parameters as :func:`~autoremat._fsdp.logical_signature` sees them unsharded), and the plan's
    parameters that sharding hides from the model's modules (FSDP1 flat parameters)."""
    out: dict[str, str] = {}
    for k, v in own.items():
        if k.rpartition(".")[2].removeprefix("param:") != "_flat_param":  # FSDP1's, not the model's
            out[k] = logical.get(k, v) if k.startswith("param:") else v
    for k in recorded:
        if k.startswith("param:") and k not in out and k in logical:
            out[k] = logical[k]
    return {k: (recorded.get(k, v) if v == UNKNOWN else v) for k, v in out.items()}


def apply_fx_sharded(model: nn.Module, plan: Plan, names: list[str], regions: str, state: Any) -> ShardedPatch:
    """Install ``plan`` on the sharded ``model`` (module docstring); records what it patched in
    ``state`` (:class:`autoremat.runtime._PatchState`). The caller rolls back on error."""
    from . import _Active, _Rebuild, _build_forward
    from .guard import GuardedForward, op_structure

    units = units_of(model)
    canon = canonical_trace(model, units)
    _check_canonical(model, plan, canon, names)
    snapped = snap_plan(plan, canon)
    patch = ShardedPatch(plan=snapped, units=units)
    owners: dict[str, nn.Module] = {"": model}
    owners.update({path: inner_module(m) for path, m in units.items()})
    for path, owner in owners.items():
        level = None if path == "" else path
        if not any(snapped.segments[si].recompute for si in _segments_at(snapped, canon, level)):
            continue
        gm = level_trace(owner, units)
        items = map_level(canon, level, gm)
        ops = fx_ops(gm)
        lplan = _level_plan(snapped, canon, items, [n.name for n in ops])
        check_segments(lplan, len(ops))
        fwd = _build_forward(gm, ops, lplan, None, regions, owner)
        build = _Rebuild(owner, lplan, None, regions, op_structure(gm, ops))
        guarded = GuardedForward(owner, gm, fwd.forward, build, _LevelTrace(owner, units), _Active(model, state))
        if owner is model:
            state.forward_module = fwd
            state.installed = guarded
            model.__dict__["forward"] = guarded
        else:
            state.wrapped.append((owner, "forward" in owner.__dict__, owner.__dict__.get("forward"), guarded))
            owner.__dict__["forward"] = guarded
        patch.levels.append(path)
    logger.info("autoremat: plan mapped onto %d FSDP units (%d segments cut at unit boundaries; own forwards for %s)",
                len(units), snapped.options["sharded_cuts"], ", ".join(p or "the model" for p in patch.levels) or "none")
    return patch


def _segments_at(snapped: Plan, canon: CanonicalTrace, level: str | None) -> list[int]:
    """Indices of the cut segments whose ops run at ``level`` (a leaf unit's at its parent's)."""
    out = []
    for si, seg in enumerate(snapped.segments):
        stack = canon.units[seg.nodes[0]]
        node = canon.ops[seg.nodes[0]]
        if stack and node.op == "call_module" and str(node.target) == stack[-1]:
            stack = stack[:-1]  # a leaf unit runs as one call of its parent's level
        if (stack[-1] if stack else None) == level:
            out.append(si)
    return out


class _LevelTrace:
    """A fresh trace of one level (for the runtime's guard); a class, so a patched model pickles."""

    def __init__(self, owner: nn.Module, units: dict[str, nn.Module]) -> None:
        self.owner, self.units = owner, units

    def __call__(self) -> torch.fx.GraphModule:
        return level_trace(self.owner, self.units)


class ShardingWatch:
    """The patched forward of a model patched before it was sharded: runs ``inner`` (the
    guarded generated forward) until FSDP units appear in the model, then maps the plan onto
    them (:func:`apply_fx_sharded`, once) and runs the result. The check per training forward
    is one counter (FSDP2) and the identities of the traced-through modules' children (FSDP1
    wrappers replace them), only while a process group is initialised."""

    def __init__(self, model: nn.Module, inner: Any, plan: Plan, names: list[str], regions: str, state: Any,
                 traced: list[nn.Module]) -> None:
        self.model, self.inner, self.plan, self.names, self.regions, self.state = model, inner, plan, names, regions, state
        self.traced = traced
        self.__self__ = getattr(inner, "__self__", None)
        self._token = self._now()
        self.sharded: Any = None

    def __getattr__(self, name: str) -> Any:  # the guarded forward's attributes (its variants, say)
        inner = self.__dict__.get("inner")
        if inner is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(inner, name)

    def _now(self) -> tuple[Any, ...]:
        return (fsdp_state_count(), tuple(id(c) for m in self.traced for c in m._modules.values()))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.sharded is not None:
            return self.sharded(*args, **kwargs)
        if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.is_grad_enabled():
            token = self._now()
            if token != self._token:
                self._token = token
                if has_units(self.model):
                    self._shard()
                    return self.sharded(*args, **kwargs)
        return self.inner(*args, **kwargs)

    def _shard(self) -> None:
        from ._rollback import PatchPoints
        from . import _STATE_ATTR

        points = PatchPoints(self.model, _STATE_ATTR)
        wrapped = list(self.state.wrapped)
        try:
            self.state.sharded = apply_fx_sharded(self.model, self.plan, self.names, self.regions, self.state)
        except BaseException:
            points.roll_back()
            self.state.wrapped[:] = wrapped
            raise
        installed = self.model.__dict__.get("forward")
        # the model's own level may need no generated forward (nothing recomputed at it)
        self.sharded = installed if installed is not None and installed is not self else \
            (lambda *a, **k: type(self.model).forward(self.model, *a, **k))
        self.model.__dict__["forward"] = self
        self.state.installed = self
        logger.info("autoremat: %s was sharded after apply; the plan now runs on its FSDP units",
                    type(self.model).__name__)


# ---------------------------------------------------------------------------- module level
def canonical_node_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The node modules of a (sharded) model by canonical path, each the module whose code runs
    (FSDP1: the wrapped module), in the order :func:`~autoremat.capture.module.node_modules`
    finds them."""
    out: dict[str, nn.Module] = {}
    for path, m in node_modules(model):
        key = canonical_path(path)
        if key not in out:
            out[key] = inner_module(m)
    return list(out.items())


def module_plan_fingerprint(model: nn.Module, plan: Plan) -> tuple[str, list[tuple[str, nn.Module]]]:
    """The module-level fingerprint of a sharded model (canonical node modules; parameters as
    before sharding), and its canonical node modules. The fingerprint is the one of the capture
    the plan names when it is either (repeated blocks as one node each, or op by op: the default
    ``capture(blocks="auto")``), as for an unsharded model."""
    nodes = canonical_node_modules(model)
    recorded = plan.tensors or {}
    own = {_canonical_key(k): v for k, v in tensor_signature(model).items()}
    sig = _comparable(own, logical_signature(model), recorded)
    if recorded:
        why = first_difference(recorded, sig, "tensor")
        if why:
            raise PlanMismatchError(f"plan was made for other tensors than the sharded {type(model).__name__} holds "
                                    f"({why}); capture this model and solve again")
    tensors = recorded or sig
    fp = module_fingerprint(model, nodes=nodes, tensors=tensors)
    if plan.graph_fingerprint and plan.graph_fingerprint != fp:  # blocks captured op by op?
        fp = module_fingerprint(model, "ops", nodes=nodes, tensors=tensors, modules=canonical_modules(model))
    return fp, nodes


def _canonical_key(key: str) -> str:
    kind, _, name = key.partition(":")
    return f"{kind}:{canonical_path(name)}"


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` holds FSDP units below it or sharded parameters (FSDP2's
    ``fully_shard(model)`` alone, an FSDP1 wrapper of the whole model): the plan is then checked
    against the parameters as they were before sharding, and run around the units."""
    return bool(units_of(model)) or has_sharded_params(model)
