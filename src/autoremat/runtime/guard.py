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
* **the generated forward** when the guard key equals the one it was built for. The key holds,
  for every module whose code the trace went through (the root and custom blocks, not the leaf
  ``nn`` layers, which the generated forward calls and which read their own state), its
  ``training`` flag, each of its plain attributes (``bool``, ``int``, ``float``, ``str``,
  ``None``), and whether it has hooks (the root's hooks run in its own ``__call__`` and do not
  count); and whether global module hooks exist;
* otherwise **re-trace** the model in its new state and, when the traced ops keep their names and
  edges (the plan still maps), build and cache a generated forward for that key; when the plan no
  longer maps, or a traced-through module has hooks (a generated forward calls no container, so
  those hooks would not fire), use the model's own forward and warn once per patch (a
  :class:`StateGuardWarning`): the model runs unpatched in that state.

Attributes held in containers (lists, dicts) and attributes of objects other than modules are not
guarded. At most :data:`MAX_VARIANTS` generated forwards are cached per patch.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.nn.modules import module as _module_mod

__all__ = ["GuardedForward", "StateGuardWarning", "MAX_VARIANTS", "op_structure"]

MAX_VARIANTS = 8
_PLAIN = (bool, int, float, str, type(None))
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")


class StateGuardWarning(UserWarning):
    """A patched model runs its own forward (unpatched) in a state its plan does not cover."""


def op_structure(gm: torch.fx.GraphModule, ops: list[torch.fx.Node]) -> list[tuple[str, tuple[str, ...]]]:
    """Names of the traced ops and of the ops each takes as input: what a plan refers to."""
    names = set(ops)
    return [(n.name, tuple(u.name for u in n.all_input_nodes if u in names)) for n in ops]


def traced_through(model: nn.Module, gm: torch.fx.GraphModule) -> list[nn.Module]:
    """The modules of ``model`` whose code the trace ran: every module that is neither a leaf
    called by the graph nor inside one."""
    leaves = [gm.get_submodule(str(n.target)) for n in gm.graph.nodes if n.op == "call_module"]
    inside = {id(m) for leaf in leaves for m in leaf.modules()}
    return [m for m in model.modules() if id(m) not in inside]


class _Key:
    """Computes the guard key of a model's current state (see the module docstring). A module's
    hook dictionaries are kept (registering a hook adds to them), so the check is a few C calls."""

    __slots__ = ("hooks", "dicts", "names")

    def __init__(self, modules: list[nn.Module], root: nn.Module) -> None:
        # the root's hooks run in its own __call__, around the patched forward
        self.hooks = [m.__dict__[h] for m in modules if m is not root for h in _HOOKS if h in m.__dict__]
        slots = [(m.__dict__, k) for m in modules for k, v in m.__dict__.items()
                 if isinstance(v, _PLAIN) and not k.startswith("__")]
        self.dicts = [d for d, _ in slots]
        self.names = [k for _, k in slots]

    def __call__(self) -> tuple[Any, ...]:
        hooked = any(self.hooks) or any(getattr(_module_mod, h) for h in _GLOBAL_HOOKS)
        return (hooked, tuple(map(dict.get, self.dicts, self.names)))


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
        self._model = model
        self._build, self._trace, self._active = build, trace, active
        self._modules = traced_through(model, gm)
        self._keyfn: _Key | None = _Key(self._modules, model)
        self._key = self._keyfn()
        self._fast: Callable[..., Any] | None = None if self._key[0] else first
        self._variants: dict[tuple[Any, ...], Callable[..., Any] | None] = {self._key: self._fast}
        self._warned = False
        if self._fast is None:
            self._warn("a module whose code the trace ran through has hooks, which the generated forward would not "
                       "call")

    def own(self, *args: Any, **kwargs: Any) -> Any:
        """The model's own (class) forward."""
        return type(self._model).forward(self._model, *args, **kwargs)

    def __getstate__(self) -> dict[str, Any]:
        # the key reads the modules' own dictionaries: made again after unpickling (torch.save)
        return {k: (None if k == "_keyfn" else v) for k, v in self.__dict__.items()}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled() or not self._model.training or not self._active():
            return self.own(*args, **kwargs)
        if self._keyfn is None:
            self._keyfn = _Key(self._modules, self._model)
        key = self._keyfn()
        if key == self._key and self._fast is not None:
            return self._fast(*args, **kwargs)
        fn = self._variants[key] if key in self._variants else self._variant(key)
        return self.own(*args, **kwargs) if fn is None else fn(*args, **kwargs)

    def _variant(self, key: tuple[Any, ...]) -> Callable[..., Any] | None:
        fn: Callable[..., Any] | None = None
        if key[0]:
            self._warn("a module whose code the trace ran through has hooks now (hooks registered after apply on the "
                       "model, a container or a custom block), which the generated forward would not call")
        else:
            fn = self._build(self._trace())
            if fn is None:
                self._warn("the model traces to other ops in its current state (Python state it branches on changed "
                           "since apply)")
        if len(self._variants) >= MAX_VARIANTS:
            self._variants.pop(next(k for k in self._variants if k != self._key))
        self._variants[key] = fn
        return fn

    def _warn(self, why: str) -> None:
        if self._warned:
            return
        self._warned = True
        warnings.warn(f"autoremat: {type(self._model).__name__} runs its own forward, without the plan, while {why}. "
                      "Remove the hooks or restore the state to get the plan back, or restore the model, capture "
                      "it in this state and solve again (said once per apply)", StateGuardWarning, stacklevel=3)
