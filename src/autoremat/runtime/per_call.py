"""Plans that recompute some calls of a module run more than once per step, and keep the others.

A weight-shared layer (Hugging Face ALBERT runs one ``AlbertLayerGroup`` for every layer; a model
looping over one block) is one module whose ``forward`` runs ``n`` times in a step. Capture makes
each call a node or call region of its own, named ``"<path>@<k>/<n>"``
(:mod:`autoremat.call_names`), and a plan recomputes the calls it names. ``apply`` installs a
:class:`PerCallForward` as that module's ``forward``: it counts the module's calls in the step
and runs call ``k`` as the plan's region for it (a
:class:`~autoremat.runtime.probed_call.ProbedCall` or a
:class:`~autoremat.runtime.selective.SelectiveCall`, each with its own RNG replay and buffer
snapshot, so dropout masks and batch-norm statistics are exactly those of the unpatched step),
every other call as the module's own ``forward``. Under autocast a recomputed call's forward
keeps autocast's cast cache (:func:`~autoremat.runtime.recompute_state.shared_casts`), so its
parameters' gradients are summed as in the unpatched step (bit for bit); a call keeping some ops
(selective saves) is refused there.

When a step starts: a forward pre-hook on the model ``apply`` patched (the model the plan was
captured on; the step's root call) resets the counts; they count only in training mode with
gradients on, the step capture recorded (``eval()``, ``no_grad`` and ``inference_mode``
forwards run the module's own ``forward`` every call, as does a call outside the model's
forward, e.g. from a loss function). Calls made while a region is recomputed (a replay running
the module again in backward, :func:`~autoremat.runtime.recompute_state.is_recomputing`) are not
counted. A step that runs the module more often than the plan's ``n`` raises
:class:`~autoremat.errors.CallCountError` at the call past ``n``, one that runs it less often at
the end of the model's forward: a data-dependent loop, or a model called more than once per
step, would otherwise recompute other calls than the plan chose (never silently).

Under ``torch.compile`` the counting is traced with the model's forward (Dynamo follows the
counters as Python state), so the compiled step runs the plan's calls as checkpoint operators
(:func:`~autoremat.runtime.region.compiled_region`) and the others plain. Measured (CPU,
``aot_eager``, the tests' looped block with dropout): the compiled patched step's gradients equal
the compiled unpatched step's, at 0.44x its peak (inductor: equal too). As for every region, the
debugging backend ``"eager"`` does not replay a recomputed call's dropout masks (PyTorch's own
``torch.utils.checkpoint`` neither: Dynamo's checkpoint operator relies on AOTAutograd,
pytorch/pytorch#160773), see :mod:`autoremat.runtime`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from ..call_names import parse_call
from ..errors import CallCountError, PlanMismatchError
from .probed_call import ProbedCall
from ..capture.shared_casts import cached_autocast_devices
from .recompute_state import is_recomputing, shared_casts, stateful_buffers
from .selective import SelectiveCall
from .substituted import state_dicts

__all__ = ["PerCallForward", "StepCalls", "install_calls"]


class StepCalls:
    """The per-step call counts of a patched model's :class:`PerCallForward` s: its
    :meth:`begin` and :meth:`end` are forward pre- and post-hooks of the model."""

    def __init__(self, model: nn.Module) -> None:
        self.model_name = type(model).__name__
        self.forwards: list[PerCallForward] = []
        self.on = False

    def begin(self, module: nn.Module, _args: Any) -> None:
        self.on = torch.is_grad_enabled() and module.training
        for f in self.forwards:
            f.count = 0

    def end(self, _module: nn.Module, _args: Any, _out: Any) -> None:
        if not self.on:
            return
        self.on = False
        short = [f for f in self.forwards if f.count != f.n]
        if short:
            f = short[0]
            raise CallCountError(_message(f.path, f.count, f.n, self.model_name))


def _message(path: str, count: int | str, n: int, model: str) -> str:
    return (f"autoremat: this forward of {model} ran module {path!r} {count} times, but the plan recomputes its "
            f"calls one by one and was made for a step that runs it {n} times (a loop whose length depends on the "
            "data, or a model called more than once per step?); the plan cannot tell which call is which. Keep "
            "the number of calls fixed (pad the inputs to one shape), or capture and solve again on a step like "
            "this one; autoremat.restore(model) runs the model unpatched")


class PerCallForward:
    """Installed as the ``forward`` of a module run ``n`` times per step: call ``k`` runs
    ``calls[k]`` (a recomputed region) where the plan names it, else ``fn`` (the module's own
    ``forward``). ``active`` is cleared by :func:`autoremat.restore`."""

    def __init__(self, fn: Callable[..., Any], path: str, n: int, calls: dict[int, Callable[..., Any]],
                 step: StepCalls) -> None:
        bad = sorted(k for k in calls if not 0 <= k < n)
        if bad:
            raise PlanMismatchError(f"plan recomputes call {bad[0]} of module {path!r}, which it says runs {n} times "
                                    "per step; please report")
        self.fn, self.path, self.n, self.calls, self.step = fn, path, n, dict(calls), step
        self.count = 0
        self.active = True
        step.forwards.append(self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.active or not self.step.on or is_recomputing():
            return self.fn(*args, **kwargs)
        k = self.count
        self.count = k + 1
        if k >= self.n:
            self.step.on = False  # the step is refused: its end checks nothing more
            raise CallCountError(_message(self.path, f"more than {self.n}", self.n, self.step.model_name))
        call = self.calls.get(k)
        if call is None:
            return self.fn(*args, **kwargs)
        if isinstance(call, SelectiveCall) and cached_autocast_devices():
            raise RuntimeError(
                f"autoremat: the plan keeps some ops of call {k} of module {self.path!r} (selective saves), which "
                "cannot run exactly under autocast with its cast cache on (the other calls use the first call's "
                "parameter casts, the replay makes its own, and selective checkpointing pairs them by count); "
                "solve with a solver that recomputes whole calls (e.g. solver='chen'), or run autocast with "
                "cache_enabled=False")
        with shared_casts():
            return call(*args, **kwargs)


def _region(fn: Callable[..., Any], mod: nn.Module, keep: dict[int, str], regions: str, path: str) -> ProbedCall:
    """The recomputed region one call of ``mod`` runs as (module level: arbitrary user code; its
    first forward finds out what it draws, see :class:`ProbedCall`)."""
    if keep:
        return SelectiveCall(fn, stateful_buffers([mod]), tuple(mod.parameters()), keep, path, state_dicts([mod]))
    return ProbedCall(fn, stateful_buffers([mod]), regions, tuple(mod.parameters()), path, state_dicts([mod]))


def install_calls(model: nn.Module, targets: list[tuple[str, nn.Module, dict[int, str]]], regions: str,
                  wrapped: list[tuple[nn.Module, bool, Any, Any]], hooks: list[Any]) -> None:
    """Wrap the ``forward`` of each target of :func:`~autoremat.runtime.module_targets.module_targets`:
    a module called once with its region, a module some of whose calls the plan names with a
    :class:`PerCallForward` (and ``model`` with the :class:`StepCalls` hooks). ``wrapped`` and
    ``hooks`` record what :func:`autoremat.restore` undoes."""
    shared: dict[int, tuple[nn.Module, str, int, dict[int, dict[int, str]]]] = {}
    for name, mod, keep in targets:
        path, k, n = parse_call(name)
        if k is None:
            _install(mod, _region(mod.forward, mod, keep, regions, path), wrapped)
            continue
        entry = shared.setdefault(id(mod), (mod, path, int(n), {}))  # type: ignore[arg-type]
        if entry[2] != n:
            raise PlanMismatchError(f"plan names calls of module {path!r} of steps running it {entry[2]} and {n} "
                                    "times; solve the graph again")
        entry[3][k] = keep
    if not shared:
        return
    step = StepCalls(model)
    for mod, path, n, calls in shared.values():
        fn = mod.forward
        _install(mod, PerCallForward(fn, path, n, {k: _region(fn, mod, keep, regions, f"{path} (call {k} of {n})")
                                                   for k, keep in calls.items()}, step), wrapped)
    hooks.append(model.register_forward_pre_hook(step.begin))
    hooks.append(model.register_forward_hook(step.end))


def _install(mod: nn.Module, call: Any, wrapped: list[tuple[nn.Module, bool, Any, Any]]) -> None:
    wrapped.append((mod, "forward" in mod.__dict__, mod.__dict__.get("forward"), call))
    mod.__dict__["forward"] = call
