"""Recomputed regions: autoremat's own non-reentrant checkpoint, with little work per tensor.

A recomputed segment runs under :func:`recomputed_call` (fx plans: as a
:class:`~autoremat.runtime.checkpoint_region.CheckpointRegion`). Like non-reentrant
``torch.utils.checkpoint`` it keeps the original autograd graph and replaces every tensor the
region saves by a small handle (``saved_tensors_hooks``); the first handle unpacked in a
backward replays the region's forward, collects the tensors it saves, and stops as soon as it
has them all (early stop); each is handed out once and then dropped. Memory therefore behaves
as the simulator assumes for a checkpoint region, gradients are computed by the very same
graph (bit-for-bit equal), and second-order gradients work as with PyTorch's checkpoint. For
the regions ``apply`` builds, the replay is the region's graph without its trailing ops that
cannot save anything (:func:`~autoremat.runtime.region_graph.trim_replay`), so it returns at its last saving op instead of being
stopped by an exception, and a replay that saves more or fewer tensors than the forward is
reported.

What it leaves out is PyTorch's per-tensor bookkeeping, which is most of the overhead of
checkpointing on small ops: a ``_Holder``, a weak reference and a metadata dictionary (under
``no_grad``) for every packed tensor, weak-keyed handle dictionaries on unpack. Measured on the
CPU-size ResNet-50 under a 50 % ``dp-approx`` plan (2-core x86_64, one thread, interleaved
medians): 1.77x the unpatched step time with ``torch.utils.checkpoint``, 1.38x with this, same
peak. ``apply(model, plan, regions="torch")`` uses PyTorch's checkpoint instead.

Decisions, each tested:

* inputs are kept with their version counter (:class:`_SavedInput`), as autograd keeps a saved
  tensor: an in-place change of an input after the region ran is reported at backward instead of
  silently recomputing from the changed value (autograd's own ``_make_saved_tensor`` did this until
  it turned out to be missing from torch 2.11, which the GPU machines we benchmark on have);
* an input whose storage the plan offloads (an offloaded checkpoint) is kept on the offloader's
  host path (:meth:`~autoremat.runtime.offload.Offloader.hold_input`) and brought back for the
  replay; ``regions="torch"`` refuses such a plan at its first forward (PyTorch's checkpoint
  keeps its inputs itself);
* recomputed tensors are kept per backward call (``torch._C._current_graph_task_id``), so a
  second backward over a retained graph recomputes again, and a partial backward (e.g.
  ``torch.autograd.grad`` of an intermediate) does not hand out tensors another backward
  needs; a recomputation that saves a different number of tensors than the forward raises;
* the RNG state (CPU, and the devices of the inputs) is replayed only when the region may draw
  random numbers, and the global RNG stream is left where it was. Random ops are recognised by
  what they are, not by name: a region :func:`~autoremat.runtime.region_graph.may_draw_random` does not flag (e.g.
  ``F.scaled_dot_product_attention(..., dropout_p=0.2)``, whose name says nothing) runs its first
  forward with the RNG saved and under :class:`SeededProbe`, which sees every ATen op; it
  replays the RNG from then on exactly when an op tagged ``torch.Tag.nondeterministic_seeded``
  ran (a region rebuilt by the state guard, :mod:`autoremat.runtime.guard`, finds out again);
* autocast state (CPU and CUDA) is the forward's (entered only where the backward's differs);
  batch-norm running statistics are restored after the recomputation (:class:`RestoreBuffers`;
  a plain batch norm in training mode writes a scratch copy instead, whose values it never reads);
  every other buffer the region may touch (those of its modules, and those its ops read or update,
  e.g. a custom module's ``self.mean.copy_(...)``) is recomputed from a copy taken when the region's
  forward began (:func:`snapshot_buffers`): the replay reads what the forward read, and its writes
  go to that copy, so a buffer update in forward runs once per step;
* forward hooks and pre-hooks of modules called inside a region run again during its
  recomputation, as under ``torch.utils.checkpoint`` (whose recomputation calls the same modules);
  :func:`is_recomputing` is ``True`` while they do, so a hook with side effects can skip them;
* parameters are checked like saved tensors: a parameter of a region's modules (or read by its ops)
  changed in place between the region's forward and its recomputation raises at backward, as
  PyTorch does for a saved parameter, instead of recomputing with the new values
  (:func:`param_versions`; any parameter of the region counts, also one its ops do not save);
* a recomputation runs with the parameters and buffers the region's forward ran with, where the
  modules hold others by then (``torch.func.functional_call`` swaps its tensors in for the call
  only): :class:`~autoremat.runtime.substituted.HeldState`;
* the replay of an applied region ends at its last op that may save (:func:`~autoremat.runtime.region_graph.trim_replay`) and
  returns: no exception, and a replay that saves more tensors than the forward is reported;
* under ``torch.compile`` a region (either mode) is traced as PyTorch's checkpoint higher-order
  op (:func:`compiled_region`): the compiled backward recomputes it, with no graph break.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, get_device_states, set_device_states

from .offload import HostInput, Offloader, active_offloader
from .substituted import HeldState, holds_state
from .transforms import records
from .recompute_state import (SeededProbe, RestoreBuffers, UncachedAutocast, check_params, is_recomputing,
                              param_versions, snapshot_buffers, stateful_buffers)

__all__ = ["REGION_MODES", "compiled_region", "recomputed_call", "RecomputationMismatchError",
           "tail_mark", "is_recomputing", "snapshot_buffers"]

logger = logging.getLogger(__name__)

REGION_MODES = ("lean", "torch")
"""``apply(..., regions=)``: autoremat's :func:`recomputed_call` or ``torch.utils.checkpoint``."""


class RecomputationMismatchError(RuntimeError):
    """The recomputation of a region saved other tensors than its forward did."""


_AUTOCAST_DEVICES = ("cpu", "cuda")


def _autocast_state() -> tuple[Any, ...]:
    """``((enabled, dtype) per device of _AUTOCAST_DEVICES, cache enabled)``; a disabled device's
    dtype is left out (it has no effect), so that equal states compare equal."""
    cpu = torch.is_autocast_enabled("cpu")
    cuda = torch.is_autocast_enabled("cuda")
    return ((cpu, torch.get_autocast_dtype("cpu") if cpu else None),
            (cuda, torch.get_autocast_dtype("cuda") if cuda else None),
            torch.is_autocast_cache_enabled())


class _SavedInput:
    """An input of a region, kept for its recomputation with the version it had then: ``unpack``
    raises, as autograd does for a saved tensor, if it was changed in place since."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.version = tensor._version

    def unpack(self) -> torch.Tensor:
        t = self.tensor
        if t._version != self.version:
            raise RuntimeError(
                f"autoremat: one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: an input of a recomputed region ({tuple(t.shape)} {t.dtype}) is at version {t._version}; "
                f"expected version {self.version} instead. The region recomputes from its inputs in backward: change "
                "a clone of the tensor instead (x = x.clone() before the in-place op), or leave this part of the "
                "model out of the plan")
        return t


class _StopRecomputation(Exception):
    """Raised by the collecting hook once the recomputation has saved all it needs."""


class _Frame:
    """One forward call of a region: its inputs and the state its recomputation replays."""

    __slots__ = ("replay", "stateful", "snapshot", "params", "versions", "args", "kwargs", "count", "by_task", "rng",
                 "autocast", "stop", "held",
                 "short", "tail", "tail_at", "sources", "whole", "offloaded")

    def __init__(self, replay: Callable[..., Any], stateful: list[tuple[nn.Module, str]], args: tuple[Any, ...],
                 kwargs: dict[str, Any], preserve_rng: bool, stop: bool | Callable[[], bool] = True,
                 short: Callable[..., Any] | None = None, params: tuple[torch.Tensor, ...] = (),
                 dicts: tuple[dict[str, Any], ...] = (),
                 generators: list[tuple[torch.Generator, torch.Tensor]] | None = None) -> None:
        self.replay = replay
        # the forward's parameters and generator states (.substituted)
        self.held = HeldState(dicts, generators) if holds_state(dicts, generators) else None
        # stop the replay by an exception once it saved all (else it ends there); a callable decides
        # at the replay (a probing forward knows only once it has run: ProbedCall)
        self.stop = stop
        # the replay without the region's tail (autoremat.replay_tail), returning the tail inputs;
        # while the tail runs in forward, ``tail`` holds those inputs and each tensor the tail saves
        # is traced to one of them (its index) or to a parameter (the tensor itself) in ``sources``;
        # a tensor traced to neither makes this forward's recomputation replay it all (``whole``)
        self.short = short
        self.tail: tuple[Any, ...] | None = None
        self.tail_at = -1
        self.sources: dict[int, Any] = {}
        self.whole = False
        self.stateful = stateful
        self.snapshot = snapshot_buffers(stateful) if stateful else None
        self.params, self.versions = params, param_versions(params)
        off = active_offloader()
        self.offloaded: list[HostInput] = []
        # one holder per input tensor: a tensor passed twice (``self_attn(x, x, x)``) is one tensor
        # again in the replay, where ``query is key`` picks nn.MultiheadAttention's path
        kept: dict[int, Any] = {}
        self.args = [self._keep(a, off, kept) for a in args]
        self.kwargs = {k: self._keep(a, off, kept) for k, a in kwargs.items()}
        self.count = 0
        self.by_task: dict[int, list[Any]] = {}
        self.autocast = _autocast_state()
        self.rng = None
        if preserve_rng:
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            self.rng = (torch.get_rng_state(), *get_device_states(*tensors))

    def _keep(self, a: Any, off: Offloader | None, kept: dict[int, Any]) -> Any:
        """How the region keeps input ``a`` for its replay: on the host path when the plan offloads
        its storage (an offloaded checkpoint, :mod:`autoremat.runtime.offload`), else as it is;
        ``kept``: the holders made so far, by tensor id (a tensor passed twice shares one)."""
        if not isinstance(a, torch.Tensor):
            return a
        got = kept.get(id(a))
        if got is not None:
            return got
        held = None if off is None else off.hold_input(a)
        if held is None:
            got = kept[id(a)] = _SavedInput(a)
            return got
        self.offloaded.append(held)
        kept[id(a)] = held
        return held

    def pack(self, x: torch.Tensor) -> tuple["_Frame", int]:
        i = self.count
        self.count = i + 1
        if self.tail is not None:
            self._trace(i, x)
        return (self, i)

    def begin_tail(self, values: tuple[Any, ...]) -> None:
        self.tail, self.tail_at = values, self.count

    def _trace(self, i: int, x: torch.Tensor) -> None:
        for j, t in enumerate(self.tail):  # type: ignore[arg-type]
            if x is t:
                self.sources[i] = j
                return
        base = x._base
        if type(x) is nn.Parameter or (base is not None and type(base) is nn.Parameter):
            self.sources[i] = x  # a parameter (or a view of one) is resident: hand out the same tensor
            return
        if not self.whole:
            self.whole = True
            region = getattr(self.short, "__self__", self.short)  # the short replay's module: once per region
            if region not in _WHOLE_LOGGED:
                _WHOLE_LOGGED.add(region)
                logger.info("autoremat: a recomputed region's tail saved a tensor that is neither one of its "
                            "inputs nor a parameter (%s %s); the region is replayed whole where this happens "
                            "(said once per region)", tuple(x.shape), x.dtype)

    def recompute(self) -> list[torch.Tensor | None]:
        if self.tail_at >= 0 and not self.whole:
            return self._recompute_short()
        stop = self.stop() if callable(self.stop) else self.stop
        return self._replayed(self.replay, self.count if stop else -1)[0]

    def _recompute_short(self) -> list[torch.Tensor | None]:
        """The replay without the tail; what the tail saved comes from its inputs (returned by
        the short replay) and from parameters."""
        got, values = self._replayed(self.short, -1, expect=self.tail_at)  # type: ignore[arg-type]
        for i in range(self.tail_at, self.count):
            src = self.sources[i]
            t = values[src] if type(src) is int else src
            got.append(t.detach() if t.requires_grad else t)
        return got

    def _replayed(self, replay: Callable[..., Any], need: int, expect: int | None = None
                  ) -> tuple[list[torch.Tensor | None], Any]:
        """Run ``replay`` on fresh inputs under the forward's RNG / autocast state, collecting
        what it saves (stopping once ``need`` are collected; -1: let it return); checks that it
        saved ``expect`` tensors (default: the forward's count)."""
        check_params(self.params, self.versions)
        got: list[torch.Tensor | None] = []
        result: Any = None

        def collect(x: torch.Tensor) -> None:
            got.append(x.detach() if x.requires_grad else x)
            if len(got) == need:
                raise _StopRecomputation

        # offloaded inputs come back in node order, the order the simulator's replay needs them in
        # (argument order may differ: DenseNet's concatenations), so the prefetch chain is the plan's
        back = {id(a): a.unpack() for a in sorted(self.offloaded, key=lambda a: a.node)}

        made: dict[int, torch.Tensor] = {}  # one fresh tensor per holder: inputs passed twice stay one

        def fresh(a: Any) -> Any:
            if type(a) is not _SavedInput and type(a) is not HostInput:
                return a
            t = made.get(id(a))
            if t is None:
                if type(a) is HostInput:
                    t = back[id(a)].detach().requires_grad_(a.requires_grad)
                else:
                    t = a.unpack()
                    t = t.detach().requires_grad_(t.requires_grad)
                made[id(a)] = t
            return t

        args = [fresh(a) for a in self.args]
        kwargs = {k: fresh(a) for k, a in self.kwargs.items()}
        with contextlib.ExitStack() as stack:
            if self.held is not None:
                stack.enter_context(self.held)
            if self.rng is not None:
                cpu_state, devices, states = self.rng
                stack.enter_context(torch.random.fork_rng(devices=devices))
                torch.set_rng_state(cpu_state)
                set_device_states(devices, states)
            now = _autocast_state()
            cache = self.autocast[-1]
            for dev, mine, theirs in zip(_AUTOCAST_DEVICES, self.autocast, now):  # the forward's state where it differs
                if (mine != theirs or (mine[0] and cache != now[-1])) and (dev == "cpu" or torch.cuda.is_available()):
                    stack.enter_context(torch.autocast(dev, enabled=mine[0], dtype=mine[1], cache_enabled=cache))
            stack.enter_context(UncachedAutocast())
            stack.enter_context(torch.enable_grad())
            stack.enter_context(RestoreBuffers(self.stateful, self.snapshot))
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(collect, _identity))
            try:
                result = replay(*args, **kwargs)
            except _StopRecomputation:
                pass
        want = self.count if expect is None else expect
        if len(got) != want:
            raise RecomputationMismatchError(
                f"autoremat: recomputing a region saved {len(got)} tensors where its forward saved {want}: the "
                "region does not run the same operations twice (data-dependent control flow, or state changed "
                "between forward and backward); apply the plan with regions='torch' for PyTorch's checks, or "
                "leave this part out of the plan")
        return got, result  # type: ignore[return-value]


def _identity(x: Any) -> Any:
    return x


def _unpack(handle: tuple[_Frame, int]) -> torch.Tensor:
    frame, i = handle
    task = torch._C._current_graph_task_id()
    if task == -1:  # unpacked outside a backward (e.g. grad_fn._saved_self): a fresh replay each time
        t = frame.recompute()[i]
        assert t is not None
        return t
    entry = frame.by_task.get(task)
    if entry is None:
        entry = frame.by_task[task] = [frame.recompute(), frame.count]
    tensors = entry[0]
    t = tensors[i]
    if t is None:
        raise RuntimeError("autoremat: a recomputed tensor was unpacked twice in one backward; please report "
                           "(regions='torch' avoids autoremat's own recomputation)")
    tensors[i] = None
    entry[1] -= 1
    if entry[1] == 0:
        del frame.by_task[task]
    return t


def compiled_region(fn: Callable[..., Any], preserve_rng: bool, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
    """A recomputed region while ``torch.compile`` traces it: PyTorch's non-reentrant checkpoint,
    which Dynamo turns into its checkpoint higher-order op, so that AOTAutograd's partitioner
    recomputes the region in the compiled backward. Both runtimes (saved-tensor hooks, the
    batch-norm and RNG guards) are eager code that Dynamo cannot trace; a compiled graph updates
    buffers once (functionalised) and its partitioner handles random ops itself."""
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=preserve_rng, **kwargs)


def recomputed_call(fn: Callable[..., Any], stateful: list[tuple[nn.Module, str]], preserve_rng: bool, /,
                    *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` with every tensor it saves for backward recomputed in backward.

    ``stateful``: the buffers (:func:`stateful_buffers`) the recomputation must leave as they are;
    ``preserve_rng``: replay the RNG state (needed when ``fn`` may draw random numbers)."""
    return _run(fn, fn, stateful, preserve_rng, args, kwargs)


_WHOLE_LOGGED: "weakref.WeakSet[Any]" = weakref.WeakSet()
"""Short replays whose region has logged that a forward's tail could not be traced."""

_ACTIVE = threading.local()
"""``frame``: the :class:`_Frame` of the region whose forward is running in this thread, while
it has a shortened replay (else unset or ``None``)."""


def tail_mark(*values: Any) -> None:
    """Called by a region's forward right before its tail (:mod:`autoremat.replay_tail`) with the
    tail inputs: what the tail saves from here on is traced to them. A no-op outside autoremat's
    own regions (``regions="torch"``, no-grad forwards) and while ``torch.compile`` traces."""
    if torch.compiler.is_compiling():
        return
    frame = getattr(_ACTIVE, "frame", None)
    if frame is not None:
        frame.begin_tail(values)


def _run(fn: Callable[..., Any], replay: Callable[..., Any], stateful: list[tuple[nn.Module, str]],
         preserve_rng: bool, args: tuple[Any, ...], kwargs: dict[str, Any], stop: bool | Callable[[], bool] = True,
         short: Callable[..., Any] | None = None, params: tuple[torch.Tensor, ...] = (),
         dicts: tuple[dict[str, Any], ...] = (),
         generators: list[tuple[torch.Generator, torch.Tensor]] | None = None) -> Any:
    """:func:`recomputed_call`, with ``replay`` (same ops as ``fn``) run for recomputation; ``stop``:
    stop the replay by an exception once it saved what the forward saved (``False``: the replay
    ends at its last saving op, see :class:`CheckpointRegion`); ``short``: the replay without the
    region's tail (``fn`` calls :func:`tail_mark` before it); ``params``: the parameters checked
    for in-place changes before recomputation (:func:`check_params`); ``dicts``: the instance,
    parameter and buffer dicts whose forward-time entries the recomputation runs with, ``generators`` the
    generators it replays from their forward-time states (:mod:`.substituted`)."""
    if not records():  # also under torch.func transforms (.transforms)
        return fn(*args, **kwargs)
    if torch.compiler.is_compiling():
        return compiled_region(fn, preserve_rng, args, kwargs)
    frame = _Frame(replay, stateful, args, kwargs, preserve_rng, stop, short, params, dicts, generators)
    if short is None:
        with torch.autograd.graph.saved_tensors_hooks(frame.pack, _unpack), UncachedAutocast():
            out = fn(*args, **kwargs)
    else:
        outer = getattr(_ACTIVE, "frame", None)
        _ACTIVE.frame = frame
        try:
            with torch.autograd.graph.saved_tensors_hooks(frame.pack, _unpack), UncachedAutocast():
                out = fn(*args, **kwargs)
        finally:
            _ACTIVE.frame = outer
            frame.tail = None  # the tail inputs are the region's to free, not the frame's to keep
    if frame.offloaded:
        frame.offloaded[0].offloader.end_region(frame.offloaded)
    return out
