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
  :class:`StateAssignmentError` (``mode="auto"`` then captures at module level);
* **no-grad blocks are refused**: ``torch.fx`` does not record ``with torch.no_grad():``, so a
  traced graph would run such a block with gradients on (a buffer updated there would get a
  ``grad_fn``). A graph with an op traced under disabled grad raises :class:`NoGradBlockError`;
  ``capture(mode="auto")`` then captures at module level, which runs the model's own code.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.nn.modules import module as _module_mod

__all__ = ["NoGradBlockError", "StateAssignmentError", "SemanticTracer", "semantic_trace", "silenced_hooks"]

_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
               "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOK_DICTS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                      "_global_backward_pre_hooks", "_global_forward_hooks_always_called",
                      "_global_forward_hooks_with_kwargs")


class NoGradBlockError(TypeError):
    """The traced forward runs ops with gradients disabled (``torch.no_grad()`` inside forward),
    which ``torch.fx`` cannot record."""


class StateAssignmentError(TypeError):
    """The traced forward assigns a module attribute, buffer or parameter."""


@contextlib.contextmanager
def _state_kept(model: nn.Module) -> Iterator[None]:
    """Puts back every module's ``__dict__``, ``_buffers`` and ``_parameters`` entries the block
    assigned (also on error); raises :class:`StateAssignmentError` naming the first one."""
    tables = [(path, kind, table, dict(table)) for path, m in model.named_modules()
              for kind, table in (("attribute", m.__dict__), ("buffer", m._buffers), ("parameter", m._parameters))]
    changed: list[str] = []
    try:
        yield
    finally:
        for path, kind, table, before in tables:
            for k in list(table):
                if k not in before:
                    del table[k]
                    changed.append(f"{kind} {path + '.' if path else ''}{k}")
            for k, v in before.items():
                if table.get(k, _MISSING) is not v:
                    table[k] = v
                    changed.append(f"{kind} {path + '.' if path else ''}{k}")
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


class SemanticTracer(torch.fx.Tracer):
    """The tracer of :func:`semantic_trace`; a subclass may decide leaves and names differently
    (:mod:`autoremat.runtime.sharding` traces through FSDP units) and build the module itself."""

    proxy_buffer_attributes = True

    def graph_module(self, graph: torch.fx.Graph, class_name: str) -> torch.fx.GraphModule:
        """The ``GraphModule`` running ``graph`` (the traced root's attributes)."""
        return torch.fx.GraphModule(self.root, graph, class_name)

    def create_node(self, *args: Any, **kwargs: Any) -> torch.fx.Node:
        node = super().create_node(*args, **kwargs)
        if node.op in ("call_module", "call_function", "call_method") and not torch.is_grad_enabled():
            raise NoGradBlockError(
                f"{node.name} runs with gradients disabled (a torch.no_grad() block in forward), which torch.fx "
                "cannot record: capture with mode='module' (mode='auto' does so by itself), or move the no-grad "
                "block out of forward")
        return node


def semantic_trace(model: nn.Module, tracer: SemanticTracer | None = None) -> torch.fx.GraphModule:
    """``torch.fx.symbolic_trace(model)`` with proxied buffers, hooks silenced and no-grad blocks
    refused (see the module docstring); ``tracer``: a :class:`SemanticTracer` (subclass) to use."""
    tracer = SemanticTracer() if tracer is None else tracer
    with _state_kept(model), silenced_hooks(model), torch.enable_grad():  # a no-grad caller is not a no-grad block
        graph = tracer.trace(model)
    return tracer.graph_module(graph, model.__class__.__name__)
