"""The forward ``apply`` installs on an fx-patched model: the generated forward while the Python
state it was traced in holds, the model's own forward otherwise (issue 29).

A ``torch.fx`` trace runs the model's Python once and keeps only the tensor ops: every
``if self.training``, ``F.dropout(x, p, self.training)`` or branch on a plain attribute of a
module whose code was traced through is frozen at its trace-time value. Like ``torch.compile``,
the patched forward therefore checks *guards* before each call and decides:

* **the model's own forward** (``type(model).forward``) when nothing would be recomputed:
  gradients disabled (``torch.no_grad()``, ``torch.inference_mode()``) or the model in eval mode
  (``model.training`` false; evaluation does not backpropagate through recomputed regions). This
  is equivalent by construction: it is the user's code;
* **the generated forward** when its guard holds. A guard (:class:`_Key`) is made from the
  trace it belongs to: for every module whose code that trace went through (the root and custom
  blocks, not the leaf ``nn`` layers, which the generated forward calls and which read their own
  state), its ``training`` flag and the instance attributes the trace *read* (recorded while
  tracing, :func:`~autoremat.capture._tracing.recorded_reads`; a list the training loop appends
  to but forward never reads is not guarded):

  - plain values (``bool``, ``int``, ``float``, ``str``, ``None``) by value, and an attribute
    forward looked up but that did not exist then (``getattr(self, "x", None)``) as ``None``;
  - containers (``list``, ``tuple``, ``dict``, ``set`` and their subclasses, nested) and plain
    objects (dataclass instances, namespaces, and any other object with a ``__dict__`` that is
    not a module, tensor, class or function, nor of a class of torch, the standard library or a
    training framework: a config object, an object several blocks share)
    by their contents: plain leaves by value, anything else (a tensor in a list, a function)
    by identity. One with more than :data:`MAX_LEAVES` leaves is guarded by identity and length
    only (checking every value on every call would cost more than many forwards): ``apply``
    says so once, naming it (:class:`UnguardedStateWarning`);
  - tensor attributes (not buffers) by kind only (a tensor, or what replaced it): the generated
    forward reads them at run time (:mod:`autoremat.runtime.buffers`), like buffers;
  - any other object (a function, a module held outside ``_modules``, a device) by identity;
  - a plain class-level default (``gain = 2.0`` in the class body) by its value, and by whether
    the instance has set its own since;

  the identity of its submodules and parameters (the generated forward holds them: one
  assigned anew, ``model.head = nn.Linear(...)``, re-traces); whether such a module has hooks
  (the root's hooks run in its own ``__call__`` and do not count); whether global module
  hooks exist; the autocast state where forward asked for it (``torch.is_autocast_enabled()``);
  and the module globals, attributes of module objects (``config.FLAG``) and closure cells the
  forward code reads (:mod:`autoremat.capture._code_reads`), valued as attributes are;
* **the model's own forward** too, with one warning, when forward asked during the trace whether
  it runs under ``torch.compile`` or ``torch.jit.trace`` (``torch.compiler.is_compiling()``,
  ``torch.jit.is_tracing()``, false while fx traced) and now it does (a forward that asks
  ``is_fx_tracing()`` is refused at capture);
* otherwise a generated forward cached for an earlier state whose guard holds, or **re-trace**
  the model in its new state and, when the traced ops keep their names and edges (the plan still
  maps), build and cache a generated forward with the new trace's guard; when the plan no longer
  maps, the model cannot be traced in the new state (a ``no_grad`` block now runs, a branch
  assigns state), or a traced-through module has hooks (a generated forward calls no container,
  so those hooks would not fire), use the model's own forward and warn once per patch (a
  :class:`StateGuardWarning`): the model runs unpatched in that state.

At most :data:`MAX_VARIANTS` generated forwards are cached per patch. State that changes on
most calls (a counter forward reads) would re-trace every step: after :data:`MAX_REBUILDS`
re-traces a new state runs the model's own forward, with the warning naming the attribute that
keeps changing. Not guarded: globals read by functions forward reaches other than through a
global, a closure cell or a method name (see :mod:`autoremat.capture._code_reads`), values inside
objects or containers over :data:`MAX_LEAVES` leaves (said), and objects without a ``__dict__``
(``__slots__`` classes, C types) other than by identity.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import functools
import operator
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch import nn

from .._module_hooks import HOOK_DICTS, global_hooks
from ..capture._code_reads import _foreign, code_reads, traced_through
from ..capture._tracing import autocast_state
from .transforms import records

__all__ = ["GuardedForward", "StateGuardWarning", "UnguardedStateWarning", "MAX_VARIANTS", "MAX_REBUILDS", "MAX_LEAVES", "op_structure"]

MAX_VARIANTS = 8
MAX_REBUILDS = 32
MAX_LEAVES = 512
_PLAIN = (bool, int, float, str, type(None))
_VALUE_LEAVES = _PLAIN + (bytes, complex, torch.dtype, torch.device, enum.Enum)
_CONTAINERS = (list, tuple, dict, set, frozenset)
_NAMESPACES = (types.SimpleNamespace, argparse.Namespace)
# nn.Module's own bookkeeping (hook dicts, _parameters, ...): not state a forward reads as values;
# autoremat's patch attributes (the installed forward, the patch state) are the guard's own
_INTERNAL = frozenset(nn.Module().__dict__) - {"training"} | {"forward", "_autoremat_patch"}


class StateGuardWarning(UserWarning):
    """A patched model runs its own forward (unpatched) in a state its plan does not cover."""


class UnguardedStateWarning(UserWarning):
    """Python state a patched forward reads is guarded by identity and length only (a container
    or object of more than :data:`MAX_LEAVES` values)."""


_QUERY_CALLS: dict[str, Callable[[], bool]] = {"compiling": torch.compiler.is_compiling,
                                                "jit_tracing": torch.jit.is_tracing}


def op_structure(gm: torch.fx.GraphModule, ops: list[torch.fx.Node]) -> list[tuple[str, tuple[str, ...]]]:
    """Names of the traced ops and of the ops each takes as input: what a plan refers to."""
    names = set(ops)
    return [(n.name, tuple(u.name for u in n.all_input_nodes if u in names)) for n in ops]


class _Ident:
    """An object compared by identity in a guard key (holding it: its id is not reused)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return type(other) is _Ident and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


class _TooLarge(Exception):
    pass


def _freeze(value: Any, budget: list[int]) -> Any:
    """A hashable picture of ``value``'s contents (see the module docstring); ``budget``: leaves left."""
    budget[0] -= 1
    if budget[0] < 0:
        raise _TooLarge
    if isinstance(value, _VALUE_LEAVES):
        return (type(value), value)
    if isinstance(value, dict):
        return (type(value), tuple((_freeze(k, budget), _freeze(v, budget)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_freeze(v, budget) for v in value))
    if isinstance(value, (set, frozenset)):
        return (type(value), frozenset(_freeze(v, budget) for v in value))
    if _by_contents(value):
        return (type(value), _freeze(vars(value), budget))
    return _Ident(value)


_LIBRARIES = frozenset({"lightning", "pytorch_lightning", "lightning_fabric", "accelerate", "logging", "numpy"})
_OPAQUE = (nn.Module, torch.Tensor, type, types.ModuleType, types.FunctionType, types.MethodType,
           types.BuiltinFunctionType, functools.partial)


def _by_contents(value: Any) -> bool:
    """Whether ``value`` is an object guarded by its attributes: a namespace, a dataclass instance
    or any other plain object with a ``__dict__`` (a config object, an object blocks share), not a
    module, tensor, class, function or module object (by identity)."""
    if isinstance(value, _NAMESPACES) or (dataclasses.is_dataclass(value) and not isinstance(value, type)):
        return True
    return (isinstance(getattr(value, "__dict__", None), dict) and not isinstance(value, _OPAQUE)
            and not _library_class(type(value)))


@functools.lru_cache(maxsize=1024)
def _library_class(cls: type) -> bool:
    """A class of torch, the standard library or a training framework (a logger, a lock, a
    trainer): its objects are guarded by identity, not by their attributes."""
    root = (cls.__module__ or "").split(".")[0]
    return root in _LIBRARIES or _foreign(root)


def freeze(value: Any) -> Any:
    """:func:`_freeze` with :data:`MAX_LEAVES`; a larger container: identity and length."""
    if isinstance(value, torch.Tensor):
        return type(value)  # read at run time by the generated forward: only its kind matters
    if not isinstance(value, _CONTAINERS) and not _by_contents(value):
        return _Ident(value)
    try:
        return _freeze(value, [MAX_LEAVES])
    except _TooLarge:
        return (_Ident(value), len(value) if isinstance(value, _CONTAINERS) else None)


def too_large(value: Any) -> bool:
    """Whether :func:`freeze` guards ``value`` by identity and length only (over :data:`MAX_LEAVES`)."""
    if isinstance(value, torch.Tensor) or not (isinstance(value, _CONTAINERS) or _by_contents(value)):
        return False
    try:
        _freeze(value, [MAX_LEAVES])
    except _TooLarge:
        return True
    return False


class _Key:
    """Computes the guard key of a model's current state for one trace (see the module
    docstring). A module's hook dictionaries are kept (registering a hook adds to them), so the
    check of plain values and hooks is a few C calls; other attributes are frozen
    (:func:`freeze`) on each call. ``reads``: module path -> attribute names the trace read
    (``None`` or a missing path: every attribute of that module counts as read)."""

    __slots__ = ("modules", "root", "reads", "hooks", "dicts", "names", "deep_dicts", "deep_names", "param_dicts",
                 "param_names", "children", "snapshots", "labels", "paths", "autocast", "classes", "cells", "large")

    def __init__(self, modules: list[nn.Module], root: nn.Module, reads: dict[str, frozenset[str]] | None,
                 autocast: bool = False, lazy: bool = False) -> None:
        self.modules, self.root, self.reads, self.autocast = modules, root, reads, autocast
        self.dicts: list[dict[str, Any]] | None = None
        if not lazy:
            self._setup()

    def _setup(self) -> None:
        modules, root = self.modules, self.root
        # the root's hooks run in its own __call__, around the patched forward
        self.hooks = [m.__dict__[h] for m in modules if m is not root for h in HOOK_DICTS if h in m.__dict__]
        paths = {id(m): p for p, m in root.named_modules()}
        plain, deep, classes = self._attributes(paths)
        code = code_reads(modules)  # globals and closure cells forward's code reads
        for table, k, label in code.entries:
            (plain if isinstance(table.get(k), _PLAIN) else deep).append((table, k, label))
        self.cells = [cell for cell, _ in code.cells]
        self.dicts = [t for t, _, _ in plain]
        self.names = [k for _, k, _ in plain]
        self.deep_dicts = [t for t, _, _ in deep]
        self.deep_names = [k for _, k, _ in deep]
        self.classes = [(c, k) for c, k, _ in classes]
        # the submodules and parameters the generated forward holds: one assigned anew is re-traced
        params = [(m, k) for m in modules for k in m._parameters]
        self.param_dicts = [m._parameters for m, _ in params]
        self.param_names = [k for _, k in params]
        self.children = [m._modules for m in modules]
        self.snapshots = [dict(t) for t in self.children]  # modules compare by identity
        self.paths = [paths.get(id(m), type(m).__name__) for m in modules]
        self.labels = [label for _, _, label in plain + deep] + [
            f"{paths[id(m)]}.{k}" if paths.get(id(m)) else k for m, k in params] + [
            label for _, _, label in classes] + [label for _, label in code.cells]
        self.large = [label for t, k, label in deep if too_large(t.get(k))]

    def _attributes(self, paths: dict[int, str]) -> tuple[list[Any], list[Any], list[Any]]:
        """``(plain, deep, classes)`` entries of the modules' attributes the trace read:
        ``(table, name, label)`` compared by value, frozen, or ``(class, name, label)``: a plain
        class-level default (``gain = 2.0`` in the class body) compared by value."""
        plain: list[tuple[dict[str, Any], str, str]] = []
        deep: list[tuple[dict[str, Any], str, str]] = []
        classes: list[tuple[type, str, str]] = []
        for m in self.modules:
            read = None if self.reads is None or id(m) not in paths else self.reads.get(paths[id(m)])
            path = paths.get(id(m))
            for k in (m.__dict__ if read is None else sorted(read | {"training"})):
                if k.startswith("__"):
                    continue
                label = f"{path}.{k}" if path else k
                if k not in m.__dict__:
                    if not _resolvable(m, k):  # looked up but absent (getattr(self, "x", None)): set or registered later
                        plain += [(table, k, label) for table in (m.__dict__, m._parameters, m._buffers, m._modules)]
                    elif _class_default(m, k):  # set on the instance later, it shadows the class's value
                        plain.append((m.__dict__, k, label))
                        classes.append((type(m), k, f"{type(m).__name__}.{k}"))
                elif isinstance(m.__dict__[k], _PLAIN):
                    plain.append((m.__dict__, k, label))
                elif k not in _INTERNAL:
                    deep.append((m.__dict__, k, label))
        return plain, deep, classes

    def __reduce__(self) -> tuple[Any, ...]:
        # the key reads the modules' own dictionaries: made again after unpickling (torch.save),
        # on first use (while unpickling, the modules are not filled in yet)
        return (_Key, (self.modules, self.root, self.reads, self.autocast, True))

    def __call__(self) -> tuple[Any, ...]:
        if self.dicts is None:
            self._setup()
        hooked = any(self.hooks) or global_hooks()
        values = tuple(map(dict.get, self.dicts, self.names))
        deep = tuple(freeze(d.get(k)) for d, k in zip(self.deep_dicts, self.deep_names)) if self.deep_dicts else ()
        extra = tuple(freeze(getattr(c, k, None)) for c, k in self.classes) + tuple(map(_cell, self.cells))
        # by id: the generated forward a key belongs to holds these objects, so no id is reused
        return (hooked, values, deep, tuple(map(id, map(dict.get, self.param_dicts, self.param_names))),
                autocast_state() if self.autocast else None, extra)

    def holds(self, key: tuple[Any, ...]) -> bool:
        """Whether the model's state now is the one ``key`` was taken in, and the submodules are
        the objects they were when this guard was made (one C-level dict comparison per module)."""
        return same(self(), key) and all(map(operator.eq, self.children, self.snapshots))

    def changed(self, old: tuple[Any, ...]) -> str:
        """The attributes whose values differ between ``old`` and now (for a message)."""
        new = self()
        a, b = [*old[1], *old[2], *old[3], *old[5]], [*new[1], *new[2], *new[3], *new[5]]
        names = [label for label, x, y in zip(self.labels, a, b) if not same(x, y)]
        names += [f"{p}.{k}" if p else k for p, t, snap in zip(self.paths, self.children, self.snapshots)
                  for k in set(t) | set(snap) if t.get(k) is not snap.get(k)]
        if old[4] != new[4]:
            names.append("the autocast state")
        return ", ".join(names[:3]) + (" ..." if len(names) > 3 else "") if names else "hooks"


_EMPTY = object()


def _cell(cell: types.CellType) -> Any:
    try:
        return freeze(cell.cell_contents)
    except ValueError:  # an empty cell (a variable not assigned yet)
        return _Ident(_EMPTY)


def _class_default(m: nn.Module, name: str) -> bool:
    """Whether ``m.name`` is a data attribute of ``m``'s class (not a method, property or other
    descriptor, nor ``nn.Module``'s own bookkeeping), found neither in the instance nor as a
    parameter, buffer or submodule."""
    if name in _INTERNAL or hasattr(nn.Module, name) or name in m._parameters or name in m._buffers \
            or name in m._modules:
        return False
    for k in type(m).__mro__:
        if name in k.__dict__:
            return not hasattr(type(k.__dict__[name]), "__get__")
    return False


def _resolvable(m: nn.Module, name: str) -> bool:
    """Whether ``m.name`` is found without the instance dictionary (class attribute, parameter,
    buffer, submodule)."""
    return hasattr(type(m), name) or name in m._parameters or name in m._buffers or name in m._modules


def same(a: Any, b: Any) -> bool:
    """``a == b`` for key parts that may hold values whose ``==`` is not a bool (a tensor put in
    place of a plain attribute): those count as different."""
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - any __eq__/__bool__ failure means "not the same state"
        return False


class GuardedForward:
    """The patched ``forward`` of an fx-patched model (see the module docstring).

    ``build(gm)``: the generated forward for a fresh trace ``gm`` of the model, or ``None`` when
    the plan does not map onto it; ``trace()``: a fresh trace; ``active()``: whether the patch is
    still in place (a user wrapper kept around after ``restore`` then runs the model's own code)."""

    def __init__(self, model: nn.Module, gm: torch.fx.GraphModule, first: Callable[..., Any],
                 build: Callable[[torch.fx.GraphModule], Callable[..., Any] | None],
                 trace: Callable[[], torch.fx.GraphModule], active: Callable[[], bool]) -> None:
        # like a bound method's: the generated forward module (code that inspects the regions)
        self.__self__ = getattr(first, "__self__", None)
        _eager_lookup()
        self._model = model
        self._build, self._trace, self._active = build, trace, active
        guard = self._guard(gm)
        key = guard()
        self._base: tuple[_Key, tuple[Any, ...], Callable[..., Any] | None] = (guard, key, None if key[0] else first)
        self._variants: list[tuple[_Key, tuple[Any, ...], Callable[..., Any] | None, Any]] = []
        self._rebuilds = 0
        self._warned = False
        self._large_warned = False
        self._warn_large(guard)
        # how the code runs (torch.compile, torch.jit.trace): false while fx traced it
        self._queries = tuple(_QUERY_CALLS[k] for k in gm.meta.get("autoremat_queries", ()) if k in _QUERY_CALLS)
        if key[0]:
            self._warn("a module whose code the trace ran through has hooks, which the generated forward would not "
                       "call")

    def __setstate__(self, state: dict[str, Any]) -> None:  # unpickled in a fresh process: see _eager_lookup
        _eager_lookup()
        self.__dict__.update(state)

    def _guard(self, gm: torch.fx.GraphModule) -> _Key:
        return _Key(traced_through(self._model, gm), self._model, gm.meta.get("autoremat_reads"),
                    gm.meta.get("autoremat_reads_autocast", False))

    def _warn_large(self, guard: _Key) -> None:
        if guard.large and not self._large_warned:
            self._large_warned = True
            warnings.warn(
                f"autoremat: {type(self._model).__name__}'s forward reads {', '.join(guard.large[:3])}, holding more "
                f"than {MAX_LEAVES} values: checking all of them on every call would cost more than the forward, so "
                "the patched model sees only a new object or a new length there, not a value changed in place. "
                "After changing a value inside it, assign it anew (model.x = dict(model.x)), or pass it as an input "
                "(said once per apply)", UnguardedStateWarning, stacklevel=4)

    def _warn_query(self) -> None:  # eager (see _eager_lookup): under torch.compile a graph break, once
        self._warn("it runs under torch.compile or torch.jit.trace and its forward asks whether it does "
                   "(torch.compiler.is_compiling(), torch.jit.is_tracing()), which the trace answered False")

    def own(self, *args: Any, **kwargs: Any) -> Any:
        """The model's own (class) forward."""
        return type(self._model).forward(self._model, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not records() or not self._model.training or not self._active():  # records: .transforms
            return self.own(*args, **kwargs)
        if self._queries and any(q() for q in self._queries):
            if not self._warned:
                self._warn_query()
            return self.own(*args, **kwargs)
        guard, key, fast = self._base
        if fast is not None and guard.holds(key):
            return fast(*args, **kwargs)
        fn = self._lookup()
        return self.own(*args, **kwargs) if fn is None else fn(*args, **kwargs)

    def _lookup(self) -> Callable[..., Any] | None:
        for guard, key, fn, *_ in (self._base, *reversed(self._variants)):
            if guard.holds(key):
                return fn
        last_guard, last_key, *_ = self._variants[-1] if self._variants else self._base
        if self._rebuilds >= MAX_REBUILDS:
            self._warn(f"its Python state keeps changing ({last_guard.changed(last_key)} changed again after "
                       f"{MAX_REBUILDS} re-traces): keep that state out of forward's modules (e.g. pass it as an "
                       "input), or capture with mode='module'")
            return None
        self._rebuilds += 1
        try:
            gm = self._trace()
        except Exception as exc:  # noqa: BLE001 - fx raises many types; the user's own forward runs instead
            self._warn(f"the model cannot be traced in its current state ({type(exc).__name__}: "
                       f"{str(exc).splitlines()[0][:200]})")
            base_guard = self._base[0]
            self._variants.append((base_guard, base_guard(), None, None))  # this state: its own forward
            del self._variants[:-(MAX_VARIANTS - 1)]
            return None
        guard = self._guard(gm)
        key = guard()
        self._warn_large(guard)
        fn: Callable[..., Any] | None = None
        if key[0]:
            self._warn("a module whose code the trace ran through has hooks now (hooks registered after apply on the "
                       "model, a container or a custom block), which the generated forward would not call")
        else:
            fn = self._build(gm)
            if fn is None:
                self._warn("the model traces to other ops in its current state (Python state it branches on changed "
                           f"since apply: {self._base[0].changed(self._base[1])})")
        self._variants.append((guard, key, fn, gm))  # gm holds what the key has ids of
        del self._variants[:-(MAX_VARIANTS - 1)]
        return fn

    def _warn(self, why: str) -> None:
        if self._warned:
            return
        self._warned = True
        warnings.warn(f"autoremat: {type(self._model).__name__} runs its own forward, without the plan, while {why}. "
                      "Remove the hooks or restore the state to get the plan back, or restore the model, capture "
                      "it in this state and solve again (said once per apply)", StateGuardWarning, stacklevel=4)


def _eager_lookup() -> None:
    """Make :meth:`GuardedForward._lookup` (re-tracing is eager Python: under ``torch.compile`` a
    graph break, not a wrong trace) and :meth:`GuardedForward._warn_query` (a warning)
    ``torch.compiler.disable``-d, once, when the first guarded forward is made: as decorators they
    imported ``torch._dynamo`` (about a second) with ``import autoremat``."""
    for name in ("_lookup", "_warn_query"):
        method = getattr(GuardedForward, name)
        if not getattr(method, "_autoremat_eager", False):
            method = torch.compiler.disable(method)
            method._autoremat_eager = True
            setattr(GuardedForward, name, method)
