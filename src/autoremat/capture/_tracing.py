"""How :func:`autoremat.capture.fx.trace` runs ``torch.fx``, so that the traced graph keeps the
model's semantics (issue 29):

* **buffers are proxied** (``proxy_buffer_attributes``): a buffer read in arithmetic
  (``0.9 * self.mean``) is a ``get_attr`` read at run time, not a constant frozen at trace time,
  and an in-place update of a buffer (``self.mean.copy_(...)``) is an op of the graph instead of
  being run once on the real buffer while tracing;
* **user hooks are silenced while tracing**: module hooks (and the global module hooks) are
  taken off for the trace and put back after it, so no hook is ever handed an fx ``Proxy``;
  the patched forward calls leaf modules through ``__call__``, so their hooks run as before;
* **assignments to module state are refused**: a forward that assigns a module attribute, buffer
  or parameter (``self.calls += 1`` on a buffer, ``self.last = x``) would, traced, assign an fx
  ``Proxy`` once and never again at run time; the trace puts every such entry back and raises
  :class:`StateAssignmentError` (``mode="auto"`` then captures at module level); so does a forward
  changing a list, dict or set attribute in place (``self.features.append(h)``: the generated
  forward would never do it, :mod:`autoremat.capture.container_writes`);
* **no-grad blocks are refused**: ``torch.fx`` does not record ``with torch.no_grad():``, so a
  traced graph would run such a block with gradients on (a buffer updated there would get a
  ``grad_fn``). A graph with an op traced under disabled grad raises :class:`NoGradBlockError`;
  ``capture(mode="auto")`` then captures at module level, which runs the model's own code. The
  same holds for a custom ``torch.autograd.Function`` (fx traces into its ``forward``, which runs
  without gradients, and would lose its ``backward``);
* **autocast blocks are refused**: nor does it record ``with torch.autocast(...):`` inside
  forward, so the ops of such a block would run in the caller's precision. An op traced under
  another autocast state than the one the trace started in raises :class:`AutocastBlockError`
  (``mode="auto"``: module level). Autocast around the whole forward, set by the caller, is not
  affected: the patched forward runs in the caller's autocast state, as the model's own does;
* **the model's own checkpoints are refused**: fx traces through a non-reentrant
  ``torch.utils.checkpoint`` call and would drop it; a node traced inside one raises
  :class:`~autoremat.capture.own_recompute.SelfCheckpointTraceError` (``mode="auto"``: module
  level, which keeps them);
* **random draws are refused**: a draw forward makes outside the traced tensor ops (numpy,
  Python's ``random``, ``torch.rand(())`` on no traced input) would be frozen into the graph
  (:mod:`autoremat.capture.host_rng`): :class:`RandomDrawError` (``mode="auto"``: module level);
* **attribute reads are recorded**: while tracing, every module's instance-attribute reads are
  logged (:func:`recorded_reads`; ``gm.meta["autoremat_reads"]``: module path -> names), and
  whether forward asked for the autocast state (``torch.is_autocast_enabled()``, ...;
  ``gm.meta["autoremat_reads_autocast"]``), so that the runtime guards exactly the Python state
  the trace specialised on (:mod:`autoremat.runtime.guard`), not a list the training loop
  appends to.
"""

from __future__ import annotations

import contextlib
import sys
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.nn.modules import module as _module_mod

from .._module_hooks import GLOBAL_HOOK_DICTS as _GLOBAL_HOOK_DICTS
from .._module_hooks import HOOK_DICTS as _HOOK_DICTS
from .container_writes import changed_containers, held_containers, put_back
from .host_rng import draws, host_rng_kept, rng_states
from .own_recompute import SelfCheckpointTraceError, checkpoint_call
from ._code_reads import QUERIES, _foreign, code_reads, traced_through

__all__ = ["NoGradBlockError", "AutocastBlockError", "StateAssignmentError", "FxTracingBranchError", "RandomDrawError", "SemanticTracer", "semantic_trace",
           "silenced_hooks", "recorded_reads", "autocast_state"]



class NoGradBlockError(TypeError):
    """The traced forward runs ops with gradients disabled (``torch.no_grad()`` inside forward),
    which ``torch.fx`` cannot record."""


class AutocastBlockError(TypeError):
    """The traced forward enters or leaves ``torch.autocast`` itself, which ``torch.fx`` cannot record."""


class StateAssignmentError(TypeError):
    """The traced forward assigns a module attribute, buffer or parameter."""


class RandomDrawError(TypeError):
    """The traced forward drew random numbers outside the traced tensor ops
    (:mod:`autoremat.capture.host_rng`): the trace would freeze the draw."""


class FxTracingBranchError(TypeError):
    """The traced forward asks whether fx traces it (``is_fx_tracing()``): the trace would keep the
    branch for tracing, not the one the model runs."""


@contextlib.contextmanager
def _queries_recorded(seen: dict[str, str]) -> Iterator[None]:
    """The functions of :data:`QUERIES` (where their module is loaded) record ``kind -> caller``
    in ``seen`` when called from code outside torch while the block runs."""
    saved = [(sys.modules[mod], name, kind, getattr(sys.modules[mod], name)) for mod, name, kind in QUERIES
             if mod in sys.modules and hasattr(sys.modules[mod], name)]

    def recording(fn: Any, kind: str) -> Any:
        def query(*args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1)
            if not _foreign(caller.f_globals.get("__name__")):
                seen.setdefault(kind, f"{caller.f_globals.get('__name__')}.{caller.f_code.co_qualname}")
            return fn(*args, **kwargs)
        return query

    try:
        for mod, name, kind, fn in saved:
            setattr(mod, name, recording(fn, kind))
        yield
    finally:
        for mod, name, _, fn in saved:
            setattr(mod, name, fn)


@contextlib.contextmanager
def _state_kept(model: nn.Module) -> Iterator[None]:
    """Puts back every module's ``__dict__``, ``_buffers`` and ``_parameters`` entries the block
    assigned and the container attributes it changed in place (also on error); raises
    :class:`StateAssignmentError` naming the first one."""
    tables = [(path, kind, table, dict(table)) for path, m in model.named_modules()
              for kind, table in (("attribute", m.__dict__), ("buffer", m._buffers), ("parameter", m._parameters))]
    changed: list[str] = []
    containers = held_containers(model.named_modules())
    try:
        yield
    finally:
        written = changed_containers(containers)
        for _label, v, items in containers:
            put_back(v, items)
        for path, kind, table, before in tables:
            for k in list(table):
                if k not in before:
                    del table[k]
                    changed.append(f"{kind} {path + '.' if path else ''}{k}")
            for k, v in before.items():
                if table.get(k, _MISSING) is not v:
                    table[k] = v
                    changed.append(f"{kind} {path + '.' if path else ''}{k}")
    if written and not changed:
        raise StateAssignmentError(
            f"forward changes {written[0]} in place (e.g. `self.features.append(x)`), which a torch.fx trace runs "
            "once and the traced graph never again: capture with mode='module' (mode='auto' does so by itself)")
    if changed:
        raise StateAssignmentError(
            f"forward assigns {changed[0]} (e.g. `self.x += 1` or `self.x = ...`), which a torch.fx trace cannot "
            "replay: capture with mode='module' (mode='auto' does so by itself), or update it in place "
            "(self.x.add_(1), self.x.copy_(...))")


_MISSING = object()


@contextlib.contextmanager
def silenced_hooks(model: nn.Module) -> Iterator[None]:
    """Every module hook of ``model`` (and every global module hook) off while the block runs,
    put back exactly (same dictionaries, same order) after it, also on error."""
    saved: list[tuple[Any, str, Any]] = []
    try:
        for m in model.modules():
            for name in _HOOK_DICTS:
                d = m.__dict__.get(name)
                if d:
                    saved.append((m.__dict__, name, d))
                    m.__dict__[name] = OrderedDict()
        for name in _GLOBAL_HOOK_DICTS:
            d = getattr(_module_mod, name, None)
            if d:
                saved.append((_module_mod.__dict__, name, d))
                setattr(_module_mod, name, OrderedDict())
        yield
    finally:
        for table, name, d in reversed(saved):
            table[name] = d


_AUTOCAST_DEVICES = ("cpu", "cuda")


_AUTOCAST_QUERIES = ("is_autocast_enabled", "get_autocast_dtype", "is_autocast_cpu_enabled", "get_autocast_cpu_dtype",
                     "get_autocast_gpu_dtype", "is_autocast_ipu_enabled", "is_autocast_cache_enabled")
_is_autocast_enabled, _get_autocast_dtype = torch.is_autocast_enabled, torch.get_autocast_dtype


def autocast_state() -> tuple[Any, ...]:
    """Whether autocast is on, and its dtype, for the CPU and CUDA."""
    return tuple((_is_autocast_enabled(d), _get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES)


@contextlib.contextmanager
def _autocast_queries_recorded(seen: list[bool]) -> Iterator[None]:
    """``torch``'s autocast queries (``torch.is_autocast_enabled`` ...) append to ``seen`` when
    called while the block runs: a forward that branches on them is guarded on the autocast state
    (:mod:`autoremat.runtime.guard`)."""
    saved = {name: getattr(torch, name) for name in _AUTOCAST_QUERIES if hasattr(torch, name)}

    def recording(fn: Any) -> Any:
        def query(*args: Any, **kwargs: Any) -> Any:
            seen.append(True)
            return fn(*args, **kwargs)
        return query

    try:
        for name, fn in saved.items():
            setattr(torch, name, recording(fn))
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch, name, fn)


class SemanticTracer(torch.fx.Tracer):
    """The tracer of :func:`semantic_trace`; a subclass may decide leaves and names differently
    (:mod:`autoremat.runtime.sharding` traces through FSDP units) and build the module itself."""

    proxy_buffer_attributes = True

    def __init__(self) -> None:
        super().__init__()
        self.autocast = autocast_state()

    def graph_module(self, graph: torch.fx.Graph, class_name: str) -> torch.fx.GraphModule:
        """The ``GraphModule`` running ``graph`` (the traced root's attributes)."""
        return torch.fx.GraphModule(self.root, graph, class_name)

    def create_node(self, *args: Any, **kwargs: Any) -> torch.fx.Node:
        node = super().create_node(*args, **kwargs)
        if node.op not in ("call_module", "call_function", "call_method"):
            return node
        if (call := checkpoint_call()) is not None:
            raise SelfCheckpointTraceError(
                f"{node.name} runs inside {call}, which torch.fx would trace through and drop: capture with "
                "mode='module' (mode='auto' does so by itself), which keeps the model's own checkpoints")
        if not torch.is_grad_enabled():
            raise NoGradBlockError(
                f"{node.name} runs with gradients disabled (a torch.no_grad() block in forward, or a custom "
                "torch.autograd.Function, whose forward fx would trace into and whose backward it would lose), which "
                "torch.fx cannot record: capture with mode='module' (mode='auto' does so by itself), or move the "
                "no-grad block out of forward")
        if autocast_state() != self.autocast:
            raise AutocastBlockError(
                f"{node.name} runs under another autocast state than forward was called in (a torch.autocast block "
                "inside forward), which torch.fx cannot record: capture with mode='module' (mode='auto' does so by "
                "itself), or enter autocast around the model call instead")
        return node


_READS: dict[int, set[str]] = {}
_RECORDING: dict[type, type] = {}


def _recording_class(cls: type) -> type:
    """A subclass of ``cls`` that logs each attribute name read on an instance in :data:`_READS`
    (same ``__module__`` and name: fx decides leaf modules by ``__module__``)."""
    sub = _RECORDING.get(cls)
    if sub is None:
        base_get = cls.__getattribute__

        def __getattribute__(self: Any, name: str) -> Any:
            log = _READS.get(id(self))
            if log is not None:
                log.add(name)
            return base_get(self, name)

        sub = type(cls.__name__, (cls,), {"__getattribute__": __getattribute__, "__module__": cls.__module__,
                                           "__qualname__": cls.__qualname__})
        _RECORDING[cls] = sub
    return sub


@contextlib.contextmanager
def recorded_reads(model: nn.Module) -> Iterator[dict[str, set[str]]]:
    """Yields ``{module path: names of attributes read on it}``, filled while the block runs.

    Each module's class is swapped for a recording subclass for the block (and put back after
    it, also on error); a module whose class cannot be swapped (``__class__`` assignment refused)
    gets no entry: the guard then treats every attribute of it as read."""
    out: dict[str, set[str]] = {}
    swapped: list[tuple[nn.Module, type]] = []
    try:
        for path, m in model.named_modules():
            cls = type(m)
            try:
                m.__class__ = _recording_class(cls)
            except Exception:  # noqa: BLE001 - a class refusing subclasses (__init_subclass__) or the swap
                continue  # (layout): no record for it, the guard then takes every attribute as read
            swapped.append((m, cls))
            _READS[id(m)] = out.setdefault(path, set())
        yield out
    finally:
        for m, cls in swapped:
            m.__class__ = cls
            _READS.pop(id(m), None)


def semantic_trace(model: nn.Module, tracer: SemanticTracer | None = None) -> torch.fx.GraphModule:
    """``torch.fx.symbolic_trace(model)`` with proxied buffers, hooks silenced, no-grad and
    autocast blocks refused and attribute reads recorded (see the module docstring);
    ``tracer``: a :class:`SemanticTracer` (subclass) to use."""
    with _state_kept(model), silenced_hooks(model), torch.enable_grad():  # a no-grad caller is not a no-grad block
        tracer = SemanticTracer() if tracer is None else tracer
        amp: list[bool] = []
        queries: dict[str, str] = {}
        with recorded_reads(model) as reads, _autocast_queries_recorded(amp), _queries_recorded(queries), \
                host_rng_kept(), torch.random.fork_rng(devices=[]):
            before = rng_states()
            graph = tracer.trace(model)
            drawn = draws(before)
    if drawn:
        raise RandomDrawError(
            f"forward drew random numbers from {', '.join(drawn)} while torch.fx traced it, outside the traced "
            "tensor ops (np.random.rand(), random.random(), torch.rand(()) on no traced input): the trace would "
            "freeze that one draw into every step. Capture with mode='module' (mode='auto' does so by itself)")
    gm = tracer.graph_module(graph, model.__class__.__name__)
    queries = {**code_reads(traced_through(model, gm)).queries, **queries}
    if "fx" in queries:
        raise FxTracingBranchError(
            f"{queries['fx']} asks whether torch.fx is tracing it (is_fx_tracing()): the trace keeps the branch for "
            "tracing, the model runs the other one, so a traced graph would run other ops: capture with "
            "mode='module' (mode='auto' does so by itself)")
    gm.meta["autoremat_reads"] = {path: frozenset(names) for path, names in reads.items()}
    gm.meta["autoremat_reads_autocast"] = bool(amp)
    gm.meta["autoremat_queries"] = tuple(sorted(queries))
    return gm
