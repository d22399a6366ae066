"""The module globals and closure cells the code of a traced forward reads (issue 29): what
:mod:`autoremat.runtime.guard` checks besides the modules' own attributes.

A ``torch.fx`` trace runs forward's Python once: ``if USE_GATE:`` on a module-level flag,
``h * SCALE`` in a helper function, ``config.MULT`` on an imported module object or a variable of
the function that defined the model class (a closure cell) are frozen at their trace-time values
like module attributes are. The bytecode of each traced-through module's ``forward`` (and of the
methods it names and the Python functions it reaches through globals or cells, nested code
objects included) is read once per trace, statically:

* ``LOAD_GLOBAL name`` -> the entry ``name`` of the function's globals (a name that is only a
  builtin is skipped); where the global is a module object outside torch and the next
  instruction reads an attribute (``config.MULT``), that attribute of the module instead;
* ``LOAD_DEREF`` of a free variable -> the cell in the function's ``__closure__``.

Module objects and classes are not guarded (a rebinding of ``torch`` or of a class is not state
a forward branches on); functions by identity, everything else as :func:`~autoremat.runtime.guard.freeze`
does. Reading is static and so an over-approximation (a global in a branch not taken is guarded
too, at the cost of a dictionary lookup per call). Code of torch, autoremat and the standard
library is not read: state that only they read is theirs. Not seen: globals of functions reached
some other way than by a global, a cell or a method name (a function stored in a container, or
called through another object's attribute): their *identity* is guarded where forward read them
as an attribute, not the globals they read.
"""

from __future__ import annotations

import dis
import functools
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["CodeReads", "code_reads", "traced_through", "QUERIES", "query_kind"]

QUERIES: tuple[tuple[str, str, str], ...] = (
    ("torch.fx._symbolic_trace", "is_fx_tracing", "fx"),
    ("torch.fx._symbolic_trace", "is_fx_symbolic_tracing", "fx"),
    ("torch.compiler", "is_compiling", "compiling"),
    ("torch.compiler", "is_dynamo_compiling", "compiling"),
    ("torch._dynamo", "is_compiling", "compiling"),
    ("torch._utils", "is_compiling", "compiling"),
    ("torch.jit", "is_tracing", "jit_tracing"),
    ("torch.jit._trace", "is_tracing", "jit_tracing"),
)
"""``(module, function, kind)``: the functions that tell code whether fx traces it (``fx``: true
while tracing, false when the traced graph runs), whether Dynamo compiles it (``compiling``) or
``torch.jit.trace`` records it (``jit_tracing``): both false while fx traces, true when the patched
model runs under them. ``torch.jit.is_scripting()`` is not among them: ``torch.jit.script`` of a
patched model compiles the class's own ``forward`` (the patch is an instance attribute), which
takes its scripting branch as the unpatched model does."""


def query_kind(fn: Any) -> str | None:
    """The kind (:data:`QUERIES`) of ``fn`` when it is one of those functions (as loaded now)."""
    for mod, name, kind in QUERIES:
        m = sys.modules.get(mod)
        if m is not None and getattr(m, name, None) is fn:
            return kind
    return None

_SKIP_PREFIXES = ("torch", "autoremat", "functorch", "typing", "builtins")
_MAX_FUNCTIONS = 256


class CodeReads:
    """``entries``: ``(dictionary, name, label)`` of globals (or module-object attributes);
    ``cells``: ``(cell, label)``."""

    __slots__ = ("entries", "cells", "queries")

    def __init__(self) -> None:
        self.entries: list[tuple[dict[str, Any], str, str]] = []
        self.cells: list[tuple[types.CellType, str]] = []
        self.queries: dict[str, str] = {}  # kind -> the function that reads it


def traced_through(model: nn.Module, gm: Any) -> list[nn.Module]:
    """The modules of ``model`` whose code the trace ``gm`` ran: every module that is neither a
    leaf called by the graph nor inside one."""
    leaves = [gm.get_submodule(str(n.target)) for n in gm.graph.nodes if n.op == "call_module"]
    inside = {id(m) for leaf in leaves for m in leaf.modules()}
    return [m for m in model.modules() if id(m) not in inside]


def _foreign(module_name: str | None) -> bool:
    """Whether code of that module is not the user's (torch, autoremat, the standard library)."""
    if not module_name:
        return False
    root = module_name.split(".")[0]
    return root.startswith(_SKIP_PREFIXES) or root in sys.stdlib_module_names


def _function(obj: Any) -> types.FunctionType | None:
    """The plain Python function behind ``obj`` (a method, a static/class method, a decorated or
    ``functools.partial`` function), or ``None``."""
    for _ in range(8):
        if isinstance(obj, (staticmethod, classmethod, types.MethodType)):
            obj = obj.__func__
        elif isinstance(obj, functools.partial):
            obj = obj.func
        elif isinstance(obj, types.FunctionType):
            wrapped = getattr(obj, "__wrapped__", None)
            if wrapped is None:
                return obj
            obj = wrapped
        else:
            return None
    return None


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            yield from _codes(c)


def _class_function(cls: type, name: str) -> types.FunctionType | None:
    for k in cls.__mro__:
        if name in k.__dict__:
            return _function(k.__dict__[name])
    return None


def code_reads(modules: list[nn.Module]) -> CodeReads:
    """The globals and cells read by the ``forward`` code of ``modules`` (see the module docstring)."""
    out = CodeReads()
    seen_fn: set[int] = set()
    seen_entry: set[tuple[int, str]] = set()
    seen_cell: set[int] = set()
    todo: list[tuple[types.FunctionType, type | None]] = []
    for m in modules:
        fn = _class_function(type(m), "forward")
        if fn is not None:
            todo.append((fn, type(m)))
    while todo and len(seen_fn) < _MAX_FUNCTIONS:
        fn, cls = todo.pop()
        if id(fn) in seen_fn or _foreign(fn.__module__):
            continue
        seen_fn.add(id(fn))
        for found in _read_function(fn, cls, out, seen_entry, seen_cell):
            todo.append((found, cls))
    return out


def _read_function(fn: types.FunctionType, cls: type | None, out: CodeReads, seen_entry: set[tuple[int, str]],
                   seen_cell: set[int]) -> Iterator[types.FunctionType]:
    """Adds ``fn``'s globals and cells to ``out``; yields the functions it reaches."""
    glob = fn.__globals__
    cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or ()))
    where = f"{fn.__module__}.{fn.__qualname__}"
    for code in _codes(fn.__code__):
        ins = list(dis.get_instructions(code))
        for i, op in enumerate(ins):
            name = op.argval
            if op.opname == "LOAD_GLOBAL" and isinstance(name, str) and name in glob:
                value = glob[name]
                nxt = ins[i + 1] if i + 1 < len(ins) else None
                if isinstance(value, types.ModuleType):
                    if (nxt is not None and nxt.opname in ("LOAD_ATTR", "LOAD_METHOD") and not _foreign(value.__name__)
                            and isinstance(nxt.argval, str)):
                        _add_entry(out, seen_entry, value.__dict__, nxt.argval, f"{value.__name__}.{nxt.argval}")
                        reached = _function(value.__dict__.get(nxt.argval))
                        if reached is not None:
                            yield reached
                    continue
                if isinstance(value, type):
                    continue
                _add_entry(out, seen_entry, glob, name, f"global {glob.get('__name__', '?')}.{name}")
                reached = _function(value)
                if reached is not None:
                    yield reached
            elif op.opname == "LOAD_DEREF" and code is fn.__code__ and name in cells:
                cell = cells[name]
                kind = query_kind(getattr(cell, "cell_contents", None))
                if kind is not None:
                    out.queries.setdefault(kind, f"closure variable {name} of {where}")
                elif id(cell) not in seen_cell:
                    seen_cell.add(id(cell))
                    out.cells.append((cell, f"closure variable {name} of {where}"))
                try:
                    reached = _function(cell.cell_contents)
                except ValueError:  # an empty cell
                    reached = None
                if reached is not None:
                    yield reached
            elif op.opname in ("LOAD_ATTR", "LOAD_METHOD", "LOAD_SUPER_ATTR") and cls is not None \
                    and isinstance(name, str):
                # self.helper(...) or super().forward(...): that name's methods along the class's MRO
                for k in cls.__mro__:
                    reached = _function(k.__dict__.get(name))
                    if reached is not None:
                        yield reached


def _add_entry(out: CodeReads, seen: set[tuple[int, str]], table: dict[str, Any], name: str, label: str) -> None:
    kind = query_kind(table.get(name))
    if kind is not None:
        out.queries.setdefault(kind, label)
        return
    if (id(table), name) not in seen:
        seen.add((id(table), name))
        out.entries.append((table, name, label))
