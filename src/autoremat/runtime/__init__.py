"""Runtime: patch a model in place so that it runs a plan, and undo it exactly.

``apply(model, plan)`` replaces the *instance's* ``forward`` (fx graphs: a generated forward
that runs each recomputed segment as one :class:`~autoremat.runtime.checkpoint_region.CheckpointRegion`;
module-level graphs: the ``forward`` of each recomputed submodule is wrapped). A region is
autoremat's own non-reentrant checkpoint (:func:`~autoremat.runtime.region.recomputed_call`,
little work per saved tensor) or, with ``regions="torch"``, ``torch.utils.checkpoint``.
Parameters, buffers, ``state_dict`` keys and optimizer references are untouched: nothing is
registered on the model except a plain attribute holding the patch state.

Recomputation reproduces the first forward exactly: the RNG state is restored for dropout,
autocast state is the one of the first forward, and running statistics of batch-norm layers
are put back after each recomputation, so a recomputed segment does not update them a second
time.

The patched model is the user's model (issue 29). At fx level the installed forward is a
:class:`~autoremat.runtime.guard.GuardedForward`: with gradients off (``no_grad``,
``inference_mode``) or in eval mode it runs the model's own ``forward``; in training it runs the
generated forward while the Python state the trace specialised on (``training`` flags and the
attributes the trace read on the modules whose code was traced, values in containers and config
objects included; their submodules, parameters and hooks) is unchanged, re-traces when it
changed and the plan still maps, and otherwise runs the model's own forward with one
:class:`StateGuardWarning` (:mod:`autoremat.runtime.guard`). Buffers and tensor attributes are
read live, buffers recomputed from a snapshot (a buffer update in forward runs once per step),
random ops are recognised by their ATen tag, a parameter changed
in place between forward and backward raises, and hooks of modules inside a recomputed region run
again during recomputation, as under ``torch.utils.checkpoint`` (:func:`is_recomputing` tells
them). A model with an instance-level ``forward`` is refused at fx level
(:class:`InstanceForwardError`); a ``forward`` set after ``apply`` is left in place by ``restore``.

``torch.compile`` of a patched model: each region is traced as PyTorch's checkpoint higher-order
op (:func:`~autoremat.runtime.region.compiled_region`), so the compiled backward recomputes the
plan's segments and the model compiles without graph breaks. An offload plan's forward runs
eagerly under ``torch.compile`` (``torch.compiler.disable``: the offloader is eager code). The
checkpoint operator relies on AOTAutograd: the default backend (inductor) and ``"aot_eager"``
give the compiled unpatched model's gradients (measured on CPU with dropout in the regions); the
debugging backend ``"eager"`` does not replay the regions' random ops, and PyTorch's own
``torch.utils.checkpoint`` compiled with it gives other gradients too (pytorch/pytorch#160773).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import operator
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch import nn

from .._compiled import uncompiled
from .._fsdp import inner_module
from ..capture.fx import fx_fingerprint, fx_ops, trace
from ..capture.module import module_fingerprint, node_modules
from ..capture.preserved import preserved_state
from ..capture.signature import as_recorded, check_inputs, first_difference, tensor_signature
from ..errors import PlanMismatchError
from ..plan import Plan, check_segments
from ._rollback import PatchPoints
from .buffers import buffer_slot, dynamic_buffer_reads
from .guard import GuardedForward, StateGuardWarning, UnguardedStateWarning, op_structure, traced_through
from .module_targets import module_targets as _module_targets
from .offload import OffloadBegin, OffloadMark, OffloadWait, Offloader
from .offload_forward import new_offloader as _new_offloader
from .offload_forward import offloading_forward as _offloading_forward
from .offload_calls import install_offload_hooks
from .offload_saved import hooked_path, install_saved_units
from . import own_checkpointing
from .sharding import ShardingWatch, apply_fx_sharded, is_sharded, module_plan_fingerprint
from .per_call import install_calls
from .checkpoint_region import CheckpointRegion
from .region import REGION_MODES, is_recomputing, tail_mark
from .region_graph import may_draw_random, trim_replay
from ..replay_tail import tails_of

__all__ = ["apply", "restore", "is_patched", "CheckpointRegion", "offloader_of", "REGION_MODES", "is_recomputing",
           "StateGuardWarning", "UnguardedStateWarning", "InstanceForwardError"]

logger = logging.getLogger(__name__)

_STATE_ATTR = "_autoremat_patch"


class InstanceForwardError(TypeError):
    """The model has an instance-level ``forward`` (``model.forward = ...``) an fx plan cannot honour."""


@dataclass
class _PatchState:
    plan: Plan
    had_instance_forward: bool
    instance_forward: Any = None
    wrapped: list[tuple[nn.Module, bool, Any, Any]] = field(default_factory=list)
    """(module, had an instance forward, that forward, the installed call: a ProbedCall, or an FSDP level's GuardedForward)."""
    forward_module: Any = None
    offloader: Offloader | None = None
    hooks: list[Any] = field(default_factory=list)
    installed: Any = None
    sharded: Any = None  # a ShardedPatch when the plan runs on FSDP units (autoremat.runtime.sharding)


def offloader_of(model: nn.Module) -> Offloader | None:
    """The offloader of a patched model (its ``stats`` describe the last step), if it offloads."""
    state = inner_module(uncompiled(model)).__dict__.get(_STATE_ATTR)
    return state.offloader if isinstance(state, _PatchState) else None


def is_patched(model: nn.Module) -> bool:
    """Whether ``apply`` has patched ``model`` (and ``restore`` has not undone it)."""
    return isinstance(inner_module(uncompiled(model)).__dict__.get(_STATE_ATTR), _PatchState)


def apply(model: nn.Module, plan: Plan, *, regions: str = "lean", inputs: Any = None) -> nn.Module:
    """Patch ``model`` in place to run ``plan``; returns the same object.

    ``regions``: ``"lean"`` runs recomputed segments with autoremat's own checkpoint,
    ``"torch"`` with non-reentrant ``torch.utils.checkpoint`` (same memory and gradients, more
    Python work per saved tensor; its error checks are more detailed). ``inputs``: the
    positional inputs of a batch the model will run (a tensor or a tuple); when given, the plan
    is refused unless it was captured with the same input shapes, dtypes and device type
    (:func:`~autoremat.capture.signature.check_inputs`).

    Raises ``TypeError`` for a non-module or non-plan, ``ValueError`` when the model is already
    patched, and :class:`~autoremat.errors.PlanMismatchError` when the plan was made for
    another model or graph (other structure, parameter shapes or dtypes: the message names the
    first difference) or its segments do not fit the model. Everything is checked before the
    model is touched, and a failure part-way is rolled back: on error nothing is changed. A
    ``torch.compile`` wrapper is patched through the module it holds
    (:mod:`autoremat._compiled`) and returned as given.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    given, model = model, inner_module(uncompiled(model))  # an FSDP1 wrapper: the module it wraps
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be an autoremat.Plan, got {type(plan).__name__}")
    if regions not in REGION_MODES:
        raise ValueError(f"regions must be one of {REGION_MODES}, got {regions!r}")
    if is_patched(model):
        raise ValueError("model is already patched by autoremat; call autoremat.restore(model) before "
                         "applying another plan")
    mode = plan.graph_mode
    names = plan.node_names
    if mode not in ("fx", "module") or names is None:
        raise PlanMismatchError("this plan does not come from a captured model (its graph_mode / node_names are "
                                "not set); solve a graph returned by autoremat.capture, or give a hand-made plan "
                                "those fields of a solved one")
    if inputs is not None:
        check_inputs(plan, inputs)
    points = PatchPoints(model, _STATE_ATTR)
    try:
        if mode == "fx":
            state = _apply_fx(model, plan, names, regions)
        else:
            state = _apply_module(model, plan, names, regions)
        own_checkpointing.watch(model, state.hooks)
        model.__dict__[_STATE_ATTR] = state
    except BaseException:
        points.roll_back()
        raise
    logger.info("autoremat: applied %s", plan.describe())
    return given


def restore(model: nn.Module) -> nn.Module:
    """Undo :func:`apply` exactly; a model that is not patched is returned unchanged (a
    ``torch.compile`` wrapper: the module it holds, see :func:`apply`)."""
    given, model = model, inner_module(uncompiled(model))
    state = model.__dict__.get(_STATE_ATTR)
    if not isinstance(state, _PatchState):
        return given
    for h in state.hooks:
        h.remove()
    if state.installed is not None and model.__dict__.get("forward") is state.installed:
        del model.__dict__["forward"]  # a forward the user set after apply stays
        if state.had_instance_forward:
            model.__dict__["forward"] = state.instance_forward
    for mod, had, fwd, call in state.wrapped:
        call.active = False
        if mod.__dict__.get("forward") is call:  # a forward the user set after apply stays
            del mod.__dict__["forward"]
            if had:
                mod.__dict__["forward"] = fwd
    del model.__dict__[_STATE_ATTR]
    return given


# ---------------------------------------------------------------------- fx
def _apply_fx(model: nn.Module, plan: Plan, names: list[str], regions: str) -> _PatchState:
    if "forward" in model.__dict__:
        raise InstanceForwardError(
            f"{type(model).__name__} has an instance-level forward (model.forward = ...), which a torch.fx trace does "
            "not see and an fx plan would replace: remove it (del model.forward) and wrap the model in a module "
            "instead, or capture with mode='module'")
    if is_sharded(model):  # FSDP units or sharded parameters: the plan runs around them (autoremat.runtime.sharding)
        state = _PatchState(plan=plan, had_instance_forward=False)
        with preserved_state(model, [], attributes=False):  # (the block patches the model)
            state.sharded = apply_fx_sharded(model, plan, names, regions, state)
        return state
    with preserved_state(model, []):  # tracing runs forward's Python on the real attributes
        gm = trace(model)
    ops = fx_ops(gm)
    sig = as_recorded(tensor_signature(gm), plan.tensors)  # (buffers the forward resizes: dtype only)
    fp = fx_fingerprint(gm, tensors=sig)
    if plan.graph_fingerprint and fp != plan.graph_fingerprint:
        why = (first_difference(list(names), [n.name for n in ops], "node")
               or first_difference(plan.tensors or {}, sig, "tensor"))
        raise PlanMismatchError(f"plan was made for graph {plan.graph_fingerprint} but {type(model).__name__} "
                                f"traces to {fp}{f' ({why})' if why else ''}; capture this model and solve again")
    if [n.name for n in ops] != list(names):
        why = first_difference(list(names), [n.name for n in ops], "node")
        raise PlanMismatchError(f"plan node names do not match the traced model ({why}); capture and solve again")
    _check_fx_plan(plan, ops)
    offloader = _new_offloader(plan)
    forward_module = _build_forward(gm, ops, plan, offloader, regions, model)
    state = _PatchState(plan=plan, had_instance_forward=False, forward_module=forward_module, offloader=offloader)
    build = _Rebuild(model, plan, offloader, regions, op_structure(gm, ops))
    guarded = GuardedForward(model, gm, forward_module.forward, build, functools.partial(trace, model),
                             _Active(model, state))
    state.installed = guarded if offloader is None else _offloading_forward(guarded, offloader)
    if offloader is None and torch.distributed.is_available() and torch.distributed.is_initialized():
        # sharded after apply (the order torchtitan uses): map the plan onto the units when they appear
        state.installed = ShardingWatch(model, guarded, plan, list(names), regions, state, traced_through(model, gm))
    model.__dict__["forward"] = state.installed
    return state


def _check_fx_plan(plan: Plan, ops: list[torch.fx.Node]) -> None:
    """The plan's segments, offloads and replay tails against the traced ops (before any patching)."""
    index = {n: i for i, n in enumerate(ops)}
    preds = [{index[u] for u in n.all_input_nodes if u in index} for n in ops]
    check_segments(plan, len(ops), is_lower_set=lambda seen: all(preds[v] <= seen for v in seen))
    segment_of = {v: i for i, seg in enumerate(plan.segments) for v in seg.nodes}
    for si, (first, tail_inputs) in tails_of(plan).items():
        if not (0 <= si < len(plan.segments) and plan.segments[si].recompute) or segment_of.get(first) != si \
                or any(not 0 <= u < len(ops) for u in tail_inputs):
            raise PlanMismatchError(f"replay_tails: segment {si}'s replay tail (from node {first}) does not "
                                    "match the plan's recomputed segments; capture and solve again")


class _Rebuild:
    """The generated forward of a fresh trace, when the plan still maps onto it (same op names
    and edges), else ``None``; a class, not a closure: a patched model pickles."""

    def __init__(self, model: nn.Module, plan: Plan, offloader: Offloader | None, regions: str,
                 structure: list[Any]) -> None:
        self.model, self.plan, self.offloader, self.regions, self.structure = model, plan, offloader, regions, structure

    def __call__(self, gm: torch.fx.GraphModule) -> Any:
        ops = fx_ops(gm)
        if op_structure(gm, ops) != self.structure:
            return None
        return _build_forward(gm, ops, self.plan, self.offloader, self.regions, self.model).forward


class _Active:
    """Whether ``state`` is still the model's patch (not restored)."""

    def __init__(self, model: nn.Module, state: Any) -> None:
        self.model, self.state = model, state

    def __call__(self) -> bool:
        return self.model.__dict__.get(_STATE_ATTR) is self.state


def _lookup_attr(gm: nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _flat_module(gm: torch.fx.GraphModule, graph: torch.fx.Graph, class_name: str,
                 attrs: dict[str, Any] | None = None, model: nn.Module | None = None) -> torch.fx.GraphModule:
    """A ``GraphModule`` running ``graph`` whose submodule calls each reach their module in one
    attribute lookup.

    fx generates ``getattr(self.layer1, "0").conv1(x)`` for a call of ``layer1.0.conv1``: three
    ``nn.Module.__getattr__`` calls per op where the model's own forward, iterating its blocks,
    makes about one (measured on the CPU-size ResNet-50: 0.14 ms of a 3.1 ms forward). Every
    ``call_module`` target is renamed to a flat, unique attribute holding the same module object
    (nothing is copied; hooks on it still run), ``get_attr`` targets are looked up in ``gm``.
    ``attrs``: attributes the graph's own targets already name (kept as they are). Buffer reads
    become reads of ``model``'s current buffers (:mod:`autoremat.runtime.buffers`; a traced
    ``GraphModule`` holds placeholder modules, not the buffers' owners)."""
    root: dict[str, Any] = dict(attrs or {})
    dynamic_buffer_reads(gm if model is None else model, graph, root)  # buffer reads stay reads of the current buffer
    flat: dict[str, str] = {}
    for n in graph.nodes:
        if n.op == "call_module" and str(n.target) not in root:
            target = str(n.target)
            if target not in flat:
                base = "m_" + "".join(c if c.isalnum() else "_" for c in target)
                name, k = base, 1
                while name in root:
                    name, k = f"{base}_{k}", k + 1
                flat[target] = name
                root[name] = gm.get_submodule(target)
            n.target = flat[target]
        elif n.op == "get_attr" and str(n.target) not in root:
            root[str(n.target)] = _lookup_attr(gm, str(n.target))
    return torch.fx.GraphModule(root, graph, class_name=class_name)


class _OffloadCalls:
    """The offload modules a generated forward calls around the traced nodes: ``begin`` before an
    offloaded node, ``wait`` before a node that must wait for a transfer, ``mark`` on the output of
    an offloaded node (all nothing without an offloader)."""

    def __init__(self, new: torch.fx.Graph, attrs: dict[str, Any], ops: list[torch.fx.Node], plan: Plan,
                 offloader: Offloader | None) -> None:
        self.new, self.attrs, self.offloader = new, attrs, offloader
        self.offload = {ops[v]: v for v in plan.offload} if offloader is not None else {}
        self.waits = {ops[v]: v for v in plan.offload_waits} if offloader is not None else {}

    def _call(self, kind: type, prefix: str, v: int, args: tuple[Any, ...]) -> torch.fx.Node:
        key = f"autoremat_offload{prefix}_{v}"
        self.attrs[key] = kind(self.offloader, v)
        return self.new.call_module(key, args)

    def begin(self, n: torch.fx.Node) -> None:
        if n in self.offload:
            self._call(OffloadBegin, "_begin", self.offload[n], ())

    def wait(self, n: torch.fx.Node) -> None:
        if n in self.waits:
            self._call(OffloadWait, "_wait", self.waits[n], ())

    def mark(self, n: torch.fx.Node, env: dict[torch.fx.Node, torch.fx.Node]) -> None:
        if n in self.offload:
            env[n] = self._call(OffloadMark, "", self.offload[n], (env[n],))


def _need(n: torch.fx.Node, graph: torch.fx.Graph, local: dict[torch.fx.Node, torch.fx.Node]) -> torch.fx.Node:
    """``n``'s copy in ``graph``: already computed there, or a ``get_attr`` copied on first use (its
    target is looked up by :func:`_flat_module`)."""
    if n in local:
        return local[n]
    if n.op == "get_attr":
        local[n] = graph.node_copy(n)
        return local[n]
    raise AssertionError(f"node {n.name} used before it is computed; please report")


def _region_graph(inputs: list[torch.fx.Node], nodes: list[torch.fx.Node], mark: torch.fx.Node | None = None,
                  tail_inputs: list[torch.fx.Node] = ()) -> tuple[torch.fx.Graph, dict[torch.fx.Node, torch.fx.Node]]:
    """``nodes`` copied into a graph taking the segment's ``inputs`` (no output yet), with a
    :func:`tail_mark` call of ``tail_inputs`` before ``mark``."""
    graph = torch.fx.Graph()
    local = {u: graph.placeholder(f"in_{u.name}") for u in inputs}
    for n in nodes:
        for u in n.all_input_nodes:
            if u not in local:
                _need(u, graph, local)
        if n is mark:
            graph.call_function(tail_mark, tuple(local[u] for u in tail_inputs))
        local[n] = graph.node_copy(n, lambda u: local[u])
    return graph, local


def _segment_region(gm: torch.fx.GraphModule, si: int, members: list[torch.fx.Node], inputs: list[torch.fx.Node],
                    outputs: list[torch.fx.Node], tail: tuple[torch.fx.Node, list[torch.fx.Node]] | None,
                    regions: str, model: nn.Module | None) -> CheckpointRegion:
    """The :class:`CheckpointRegion` of recomputed segment ``si``: its body (inputs to outputs),
    its replay (trimmed, see :class:`CheckpointRegion`), and with a replay tail (see
    :mod:`autoremat.replay_tail`) the short replay up to the tail's first node."""
    first, tail_inputs = tail if tail is not None else (None, [])
    sub, local = _region_graph(inputs, members, first, tail_inputs)
    sub.output(tuple(local[n] for n in outputs))
    replay, _ = _region_graph(inputs, members)
    replay.output(())  # see CheckpointRegion: the replay holds no outputs
    ends_at_save = trim_replay(gm, replay)
    short = None
    if first is not None:
        short, slocal = _region_graph(inputs, members[:members.index(first)])
        short.output(tuple(slocal[u] for u in tail_inputs))
    body = _flat_module(gm, sub, f"AutorematSegment{si}", model=model)
    modules = [gm.get_submodule(str(n.target)) for n in members if n.op == "call_module"]
    owner = gm if model is None else model
    attrs_read = [u for n in members for u in n.all_input_nodes if u.op == "get_attr"]
    read = [buffer_slot(owner, str(u.target)) for u in attrs_read]
    params = tuple(p for u in attrs_read for p in [_lookup_attr(gm, str(u.target))] if isinstance(p, nn.Parameter))
    return CheckpointRegion(body, modules, preserve_rng=True if may_draw_random(gm, members) else None,
                            mode=regions, buffers=[slot for slot in read if slot is not None], params=params,
                            replay=_flat_module(gm, replay, f"AutorematReplay{si}", model=model),
                            replay_ends_at_last_save=ends_at_save,
                            short_replay=None if short is None else
                            _flat_module(gm, short, f"AutorematShortReplay{si}", model=model))


def _build_forward(gm: torch.fx.GraphModule, ops: list[torch.fx.Node], plan: Plan,
                   offloader: Offloader | None = None, regions: str = "lean",
                   model: nn.Module | None = None) -> torch.fx.GraphModule:
    """A GraphModule running the traced graph segment by segment, recomputed ones as regions
    (:func:`_segment_region`); outputs of offloaded nodes pass through an :class:`OffloadMark`."""
    new = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    attrs: dict[str, Any] = {}
    calls = _OffloadCalls(new, attrs, ops, plan, offloader)
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            env[n] = new.node_copy(n)
            # no annotation: under ``from __future__ import annotations`` fx records it as a string,
            # which the generated module then cannot be pickled with (torch.save of the model)
            env[n].type = None
    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    tails = tails_of(plan)
    for si, seg in enumerate(plan.segments):
        members = [ops[v] for v in seg.nodes]
        member_set = set(members)
        if not seg.recompute:
            for n in members:
                for u in n.all_input_nodes:
                    if u not in env:
                        _need(u, new, env)
                calls.wait(n)
                calls.begin(n)
                env[n] = new.node_copy(n, lambda u: env[u])  # a call_module target: see _flat_module
                calls.mark(n, env)
            continue
        inputs: list[torch.fx.Node] = []
        for n in members:
            for u in n.all_input_nodes:
                if u not in member_set and u.op != "get_attr" and u not in inputs:
                    inputs.append(u)
        outputs = [n for n in members if any(w not in member_set for w in n.users)]
        tail = None
        if si in tails:  # see autoremat.replay_tail
            tail = ops[tails[si][0]], [ops[u] for u in tails[si][1]]
            if tail[0] not in member_set or any(u not in member_set and u not in inputs for u in tail[1]):
                raise PlanMismatchError(f"segment {si}'s replay tail does not match the traced model; capture and "
                                        "solve again")
        key = f"autoremat_segment_{si}"
        attrs[key] = _segment_region(gm, si, members, inputs, outputs, tail, regions, model)
        for u in inputs:
            if u not in env:
                _need(u, new, env)
        calls.wait(members[0])
        call = new.call_module(key, tuple(env[u] for u in inputs))
        for i, n in enumerate(outputs):
            env[n] = new.call_function(operator.getitem, (call, i))
            calls.mark(n, env)
    new.output(torch.fx.map_arg(output_node.args[0], lambda u: env[u] if u in env else _need(u, new, env)))
    return _flat_module(gm, new, "AutorematForward", attrs, model)


# ---------------------------------------------------------------------- module level
def _apply_module(model: nn.Module, plan: Plan, names: list[str], regions: str) -> _PatchState:
    sharded = is_sharded(model)  # FSDP units: modules by their names before sharding (autoremat.runtime.sharding)
    sig = as_recorded(tensor_signature(model), plan.tensors)  # (buffers the forward resizes: dtype only)
    fp, canonical = module_plan_fingerprint(model, plan) if sharded else (module_fingerprint(model, tensors=sig), None)
    if not sharded and plan.graph_fingerprint and plan.graph_fingerprint != fp:  # blocks captured op by op?
        fp = module_fingerprint(model, "ops", tensors=sig)
    if plan.graph_fingerprint and fp != plan.graph_fingerprint:
        why = first_difference(plan.tensors or {}, sig, "tensor")
        raise PlanMismatchError(f"plan was made for graph {plan.graph_fingerprint} but {type(model).__name__} "
                                f"has module structure {fp}{f' ({why})' if why else ''}; capture this model and "
                                "solve again")
    check_segments(plan, len(names), module_level=True)
    mods = dict(node_modules(model) if canonical is None else canonical)
    if sharded and plan.offloads:
        raise PlanMismatchError("offload plans are not supported on FSDP-sharded models; solve without offload")
    calls = {v: hooked_path(names, v, mods) for v in plan.offload}  # a module call, or a block's output
    for v, path in calls.items():
        if path is None:
            raise PlanMismatchError(f"plan offloads {names[v]!r}, which is not a module call of {type(model).__name__}")
    targets = _module_targets(model, plan, names, sharded)
    offloader = _new_offloader(plan)
    state = _PatchState(plan=plan, had_instance_forward="forward" in model.__dict__,
                        instance_forward=model.__dict__.get("forward"), offloader=offloader)
    if offloader is not None:
        install_saved_units(mods, names, plan, offloader, state.wrapped)
        install_offload_hooks(plan, names, calls, mods, offloader, state.hooks)
        state.installed = _offloading_forward(model.forward, offloader)
        model.__dict__["forward"] = state.installed
    install_calls(model, targets, regions, state.wrapped, state.hooks)  # one call of a shared module: per_call
    return state


@contextlib.contextmanager
def patched(model: nn.Module, plan: Plan) -> Iterator[nn.Module]:
    """``with patched(model, plan):`` applies the plan for the block and restores it after."""
    apply(model, plan)
    try:
        yield model
    finally:
        restore(model)
