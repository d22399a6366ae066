"""Module-level offload hooks, and which call of a module they act in.

At module level a plan's offloads run as hooks on the node's module (a module call), or on the
block whose call runs the op (a block captured op by op): a forward pre-hook opens the node's window
(:meth:`~autoremat.runtime.offload.Offloader.begin_node`), a forward hook marks its output
(:meth:`~autoremat.runtime.offload.Offloader.mark`), and a pre-hook waits for a copy to host before
it (``Plan.offload_waits``). A node's own saved tensors are a :class:`~autoremat.runtime.
offload_saved.SavedCall` (``Plan.offload_saved``).

A module run ``n`` times per step (a weight-shared layer, issue 24) has a node per call, and a plan
offloads, saves or waits in some of them: ``Plan.offload_calls`` names the call of each such node
(``"<path>@<k>/<n>"``, :func:`autoremat.plan_offload.offload_calls_of`). A :class:`CallTally`
counts the module's calls in the offloader's step, and each hook acts in its call only. Counted,
as :mod:`autoremat.runtime.per_call` counts: the calls inside the patched training forward with
gradients on; not counted: calls while a region is recomputed (a replay in backward), with
gradients off, or outside the patched forward.

Decision: a module whose hooks act in every call (no entry in ``offload_calls``: the plan made
for a module run once) that runs a second time in one step raises
:class:`~autoremat.errors.CallCountError`, as does a per-call module running more than ``n``
times: the hooks would otherwise mark another call's output as the node's, and the transfers
would not be the ones the plan predicted (before this check, every call of a shared module was
offloaded under the one node's name, silently).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..call_names import parse_call
from ..errors import CallCountError, PlanMismatchError
from ..plan import Plan
from .offload import Offloader, active_offloader
from .recompute_state import is_recomputing
from .transforms import records

__all__ = ["CallTally", "install_offload_hooks", "call_of"]


class CallTally:
    """How many times module ``path`` has run in the offloader's current step; ``current``: the
    index of the call running now (``None`` outside a counted call). ``n``: the calls a step runs
    (``None``: a module the plan expects to run once, whose second call is refused)."""

    def __init__(self, offloader: Offloader, path: str, n: int | None) -> None:
        self.offloader, self.path, self.n = offloader, path, n
        self.step = -1
        self.count = 0
        self.current: int | None = None

    def next_call(self) -> int | None:
        """Count a call starting now; its index, or ``None`` where calls are not counted."""
        off = self.offloader
        if active_offloader() is not off or not records() or is_recomputing():
            self.current = None
            return None
        if self.step != off.steps:
            self.step, self.count = off.steps, 0
        k = self.count
        self.count += 1
        if k >= (self.n or 1):
            raise CallCountError(
                f"autoremat: module {self.path!r} ran {k + 1} times in this step, but the plan offloads in "
                + (f"its calls one by one and was made for a step that runs it {self.n} times" if self.n else
                   "it as a module that runs once per step (its offload_calls name no call of it)")
                + "; the plan cannot tell which call is which. Keep the number of calls fixed, or capture and "
                "solve again on a step like this one; autoremat.restore(model) runs the model unpatched")
        self.current = k
        return k

    def pre_hook(self, _module: nn.Module, _args: Any) -> None:
        self.next_call()


def call_of(plan: Plan, v: int) -> tuple[int | None, int | None]:
    """``(k, n)`` of the call node ``v`` is in (``Plan.offload_calls``), ``(None, None)`` if none."""
    name = plan.offload_calls.get(v)
    return (None, None) if name is None else parse_call(name)[1:]


def _gated(tally: CallTally, k: int | None, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run only in call ``k`` of the tallied module (every counted call where ``k`` is None)."""
    def hook(*args: Any) -> Any:
        if tally.current is not None and (k is None or tally.current == k):
            return fn(*args)
        return None
    return hook


def install_offload_hooks(plan: Plan, names: Sequence[str], paths: Mapping[int, str], mods: Mapping[str, nn.Module],
                          offloader: Offloader, hooks: list[Any]) -> None:
    """The hooks of ``plan.offload`` (``paths``: node -> module path the hooks go on) and of
    ``plan.offload_waits`` (module calls, or blocks captured op by op, before their first op);
    ``hooks`` records the handles for :func:`autoremat.restore`."""
    from .offload_saved import hooked_path

    waits = {}
    for v in plan.offload_waits:
        path = hooked_path(names, v, mods)
        if path is None:
            raise PlanMismatchError(f"plan waits before {names[v]!r}, which is not a module call of this model")
        waits[v] = path
    tallies: dict[str, CallTally] = {}
    for v, path in (*paths.items(), *waits.items()):
        n = call_of(plan, v)[1]
        tally = tallies.get(path)
        if tally is None:
            tally = tallies[path] = CallTally(offloader, path, n)
            hooks.append(mods[path].register_forward_pre_hook(tally.pre_hook))  # first: counts the call
        elif tally.n != n:
            raise PlanMismatchError(f"plan offloads in module {path!r} both per call and as one call "
                                    "(offload_calls); solve the graph again")
    for v, path in paths.items():
        k, tally = call_of(plan, v)[0], tallies[path]
        hooks.append(mods[path].register_forward_pre_hook(_gated(tally, k, lambda _m, _a, v=v: offloader.begin_node(v))))
        hooks.append(mods[path].register_forward_hook(_gated(tally, k, lambda _m, _a, out, v=v: offloader.mark(out, v))))
    for v, path in waits.items():
        k, tally = call_of(plan, v)[0], tallies[path]
        hooks.append(mods[path].register_forward_pre_hook(_gated(tally, k, lambda _m, _a, v=v: offloader.wait(v))))
