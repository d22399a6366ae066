"""Tracing a model whose submodules are FSDP units (:mod:`autoremat._fsdp`), for
:mod:`autoremat.runtime.sharding`.

Two traces, both :class:`~autoremat.capture._tracing.SemanticTracer` (hooks silenced, buffers
proxied, state assignments and no-grad blocks refused) followed by the same out-of-place
rewrite as capture (:func:`autoremat.capture.fx.trace`):

* :func:`canonical_trace` goes *through* every unit and names everything by canonical path
  (an FSDP1 wrapper's ``forward`` is replaced by the wrapped module's, a class swapped by
  ``fully_shard`` is judged a leaf or not by its original class): the graph a capture of the
  unsharded model traced, op for op and name for name. It also records, for every op, the
  units it runs inside (outermost first).
* :func:`level_trace` traces one *level*: the model, or one unit's own code, with every unit
  below it a leaf, so that the generated forward of that level calls the units through
  ``__call__`` (their hooks, FSDP1's forward). :func:`map_level` matches its ops with the ops
  of the canonical trace (same order, same targets, same edges) or says where they differ.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch import nn

from .._fsdp import canonical_modules, canonical_path, is_fsdp1, original_class
from ..capture._tracing import SemanticTracer
from ..capture.fx import fx_ops, trace
from ..errors import PlanMismatchError

__all__ = ["canonical_trace", "level_trace", "map_level", "Item", "CanonicalTrace"]


def _default_leaf(m: nn.Module) -> bool:
    cls = original_class(m)
    return (cls.__module__.startswith("torch.nn") or cls.__module__.startswith("torch.ao.nn")) \
        and not issubclass(cls, nn.Sequential)


def _class_forward(m: nn.Module) -> Callable[..., Any]:
    """``m.__call__`` without its hooks (silenced while tracing anyway) and without an
    instance-level ``forward`` autoremat installed: the module's own code."""
    from .guard import GuardedForward

    installed = m.__dict__.get("forward")
    if isinstance(installed, GuardedForward) or type(installed).__name__ == "ProbedCall":
        return lambda *a, **k: type(m).forward(m, *a, **k)
    return m.forward


class _UnitTracer(SemanticTracer):
    """``through=True``: the canonical trace; ``False``: units (``unit_ids``) are leaves."""

    def __init__(self, unit_ids: set[int], through: bool) -> None:
        super().__init__()
        self.unit_ids = unit_ids
        self.through = through
        self.stack: list[str] = []
        self.node_units: dict[torch.fx.Node, tuple[str, ...]] = {}

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if id(m) in self.unit_ids and not self.through:
            return True
        if is_fsdp1(m):
            return False
        return _default_leaf(m)

    def path_of_module(self, mod: nn.Module) -> str:
        return canonical_path(super().path_of_module(mod)) if self.through else super().path_of_module(mod)

    def call_module(self, m: nn.Module, forward: Callable[..., Any], args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
        if not (self.through and id(m) in self.unit_ids):
            if is_fsdp1(m) and not self.is_leaf_module(m, ""):
                inner = m._fsdp_wrapped_module
                return self.call_module(inner, _class_forward(inner), args, kwargs)
            if self.through and not self.is_leaf_module(m, ""):
                forward = _class_forward(m)
            return super().call_module(m, forward, args, kwargs)
        self.stack.append(canonical_path(super().path_of_module(m)))
        try:
            if is_fsdp1(m):
                inner = m._fsdp_wrapped_module
                if _default_leaf(inner):
                    return super().call_module(inner, inner.forward, args, kwargs)
                return super().call_module(inner, _class_forward(inner), args, kwargs)
            if not self.is_leaf_module(m, ""):
                forward = _class_forward(m)
            return super().call_module(m, forward, args, kwargs)
        finally:
            self.stack.pop()

    def create_node(self, *args: Any, **kwargs: Any) -> torch.fx.Node:
        node = super().create_node(*args, **kwargs)
        self.node_units[node] = tuple(self.stack)
        return node

    def graph_module(self, graph: torch.fx.Graph, class_name: str) -> torch.fx.GraphModule:
        if not self.through:
            return super().graph_module(graph, class_name)
        mods = canonical_modules(self.root)
        attrs: dict[str, Any] = {}
        for n in graph.nodes:
            target = str(n.target)
            if n.op == "call_module":
                attrs[target] = mods[target]
            elif n.op == "get_attr":
                path, _, name = target.rpartition(".")
                attrs[target] = getattr(mods[path] if path else self.root, name)
        return torch.fx.GraphModule(attrs, graph, class_name)


@dataclass
class CanonicalTrace:
    """The canonical trace of a sharded model and the units each op runs inside."""

    gm: torch.fx.GraphModule
    ops: list[torch.fx.Node]
    units: list[tuple[str, ...]]
    """Per op (index as in ``ops``): canonical paths of the units it runs inside, outermost first."""


def canonical_trace(model: nn.Module, units: dict[str, nn.Module]) -> CanonicalTrace:
    """Trace ``model`` through its ``units`` (see the module docstring)."""
    tracer = _UnitTracer({id(m) for m in units.values()}, through=True)
    gm = trace(model, tracer)
    ops = fx_ops(gm)
    return CanonicalTrace(gm, ops, [tracer.node_units.get(n, ()) for n in ops])


def level_trace(owner: nn.Module, units: dict[str, nn.Module]) -> torch.fx.GraphModule:
    """Trace ``owner``'s own code with every unit below it a leaf."""
    return trace(owner, _UnitTracer({id(m) for m in units.values()}, through=False))


@dataclass(frozen=True)
class Item:
    """One op of a level: a canonical op (``op``) or a call of a unit below (``unit``, with the
    canonical ops inside it)."""

    ops: tuple[int, ...]
    unit: str | None = None


def level_items(canon: CanonicalTrace, path: str | None) -> list[Item]:
    """The level ``path`` (``None``: the root) as a sequence of items, in trace order."""
    depth = 0 if path is None else None
    items: list[Item] = []
    current: tuple[str, list[int]] | None = None
    for i, stack in enumerate(canon.units):
        if path is not None:
            if path not in stack:
                continue
            depth = stack.index(path) + 1
        assert depth is not None, "please report"
        child = stack[depth] if len(stack) > depth else None
        if child is None:
            if current is not None:
                items.append(Item(tuple(current[1]), current[0]))
                current = None
            items.append(Item((i,)))
        elif current is not None and current[0] == child:
            current[1].append(i)
        else:
            if current is not None:
                items.append(Item(tuple(current[1]), current[0]))
            current = (child, [i])
    if current is not None:
        items.append(Item(tuple(current[1]), current[0]))
    return items


def map_level(canon: CanonicalTrace, path: str | None, gm: torch.fx.GraphModule) -> list[Item]:
    """The items of level ``path`` matched one to one with the ops of its trace ``gm`` (same
    order, targets and edges); raises :class:`PlanMismatchError` naming the first difference."""
    items = level_items(canon, path)
    ops = fx_ops(gm)
    where = "the model" if path is None else f"unit {path!r}"
    if len(items) != len(ops):
        raise PlanMismatchError(f"{where} traces to {len(ops)} ops with its FSDP units as leaves, but to {len(items)} "
                                "in the traced-through graph the plan was made for; autoremat cannot map the plan onto "
                                "the sharded model (please report, with the model)")
    item_of = {v: k for k, it in enumerate(items) for v in it.ops}
    level_index = {n: k for k, n in enumerate(ops)}
    prefix = "" if path is None else path + "."
    for k, (it, n) in enumerate(zip(items, ops)):
        if it.unit is not None:
            same = n.op == "call_module" and canonical_path(prefix + str(n.target)) == it.unit
            inner = set(it.ops)
            preds = {item_of[u] for v in it.ops for u in _op_inputs(canon, v) if u not in inner and u in item_of}
        else:
            c = canon.ops[it.ops[0]]
            same = c.op == n.op and (canonical_path(prefix + str(n.target)) == str(c.target) if n.op == "call_module"
                                     else n.target == c.target)
            preds = {item_of[u] for u in _op_inputs(canon, it.ops[0]) if u in item_of}
        level_preds = {level_index[u] for u in n.all_input_nodes if u in level_index}
        # a unit may ignore an argument it is given: its ops then read less than its call passes
        fits = preds <= level_preds if it.unit is not None else preds == level_preds
        if not same or not fits:
            raise PlanMismatchError(f"{where}: op {k} ({n.name}) of its trace with FSDP units as leaves does not match "
                                    "the traced-through graph the plan was made for (other target or inputs); autoremat "
                                    "cannot map the plan onto the sharded model (please report, with the model)")
    return items


def _op_inputs(canon: CanonicalTrace, v: int) -> list[int]:
    index = canon.__dict__.setdefault("_index", {n: i for i, n in enumerate(canon.ops)})
    return [index[u] for u in canon.ops[v].all_input_nodes if u in index]
