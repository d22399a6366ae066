"""What a recomputation must reproduce or leave alone, besides the ops themselves: buffers
(batch-norm statistics and any buffer a forward updates), parameters changed in place, and
whether the region draws random numbers. Used by :mod:`autoremat.runtime.region`; the decisions
are listed in its docstring.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..capture.shared_casts import cached_autocast_devices
from .substituted import HeldState, holds_state

__all__ = ["is_recomputing", "prepare_scratch", "snapshot_buffers", "stateful_buffers", "checkpoint_kwargs",
           "restoring_contexts", "shared_casts", "BothContexts", "param_versions", "check_params", "RestoreBuffers", "SeededProbe", "UncachedAutocast"]

_BN_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_BN_STATS = frozenset({"running_mean", "running_var", "num_batches_tracked"})
# per batch-norm module: the tensors its recomputations update in place of its statistics
_SCRATCH: weakref.WeakKeyDictionary[nn.Module, dict[str, torch.Tensor]] = weakref.WeakKeyDictionary()


def _scratch(module: nn.Module, name: str, like: torch.Tensor) -> torch.Tensor:
    """The module's scratch tensor for buffer ``name``, made (a copy of ``like``) when missing or
    when ``like`` changed shape, dtype or device (``module.to()``)."""
    per = _SCRATCH.get(module)
    if per is None:
        per = _SCRATCH[module] = {}
    got = per.get(name)
    if got is None or got.shape != like.shape or got.dtype != like.dtype or got.device != like.device:
        got = per[name] = like.detach().clone()
    return got


_RECOMPUTING = threading.local()


def is_recomputing() -> bool:
    """Whether this thread is running the recomputation of an autoremat region (either region
    kind): a module hook can test it to run its side effects once per step."""
    return getattr(_RECOMPUTING, "depth", 0) > 0


def _scratch_slot(m: nn.Module, name: str) -> bool:
    """A statistic of a plain batch norm in training mode: written, never read (see RestoreBuffers)."""
    return m.training and name in _BN_STATS and type(m) in _BN_TYPES


def prepare_scratch(slots: list[tuple[nn.Module, str]]) -> None:
    """Make the scratch tensors :class:`RestoreBuffers` will use for ``slots`` now (when a plan is
    applied), not at the first replay: they are module state like the statistics they stand in
    for, and made inside the first step they were step memory the cost model does not have (the
    CPU-size ResNet-50's 24-segment plan measured 4,200 B over its prediction in its first step:
    the scratch statistics of its 19 recomputed batch norms, 4,640 B, most made before the peak;
    8 B over it from the second step on). A module moved or
    switched to training later gets its scratch at its first replay, as before."""
    for m, name in slots:
        b = m._buffers.get(name)
        if b is not None and _scratch_slot(m, name) and not (name == "num_batches_tracked" and m.momentum is not None):
            _scratch(m, name, b)


def snapshot_buffers(slots: list[tuple[nn.Module, str]]) -> list[torch.Tensor | None]:
    """A copy of each buffer of ``slots`` as it is now (``None`` for a missing one or a batch-norm
    statistic in training mode, whose value nothing reads), for the recomputation to start from."""
    out: list[torch.Tensor | None] = []
    for m, name in slots:
        b = m._buffers.get(name)
        out.append(None if b is None or _scratch_slot(m, name) else b.detach().clone())
    return out


class _Snapshot:
    """``torch.utils.checkpoint``'s forward context (``context_fn``): takes the snapshot the
    recomputation context of the same call starts from."""

    __slots__ = ("slots", "values")

    def __init__(self, slots: list[tuple[nn.Module, str]]) -> None:
        self.slots = slots
        self.values: list[torch.Tensor | None] | None = None

    def __enter__(self) -> "_Snapshot":
        self.values = snapshot_buffers(self.slots)
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class BothContexts:
    """Two context managers entered in order, exited in reverse."""

    __slots__ = ("first", "second")

    def __init__(self, first: Any, second: Any) -> None:
        self.first, self.second = first, second

    def __enter__(self) -> "BothContexts":
        self.first.__enter__()
        try:
            self.second.__enter__()
        except BaseException:
            self.first.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.second.__exit__(*exc)
        finally:
            self.first.__exit__(*exc)


class RestoreBuffers:
    """Runs the recomputation on other tensors than the buffers (batch-norm statistics), so the
    real ones stay as the forward left them.

    Each buffer is swapped for a clone while the context is open and the original tensor is
    put back on exit (the optimizer, ``state_dict`` and user references keep seeing the
    original). Switching batch norm's ``track_running_stats`` off instead would change which
    tensors its kernel saves (the recomputation would then not match the forward), and
    ``momentum=0`` still counts ``num_batches_tracked``. ``slots`` are ``(module, name)``
    pairs, looked up on entry: ``module.to()`` replaces buffer tensors.

    The statistics of a ``BatchNorm1d/2d/3d`` (exactly those types) in training mode get a
    scratch tensor kept per module instead of a fresh clone: in training mode batch norm
    normalises with the batch's statistics and only writes the running ones (its output and
    what it saves do not depend on their values), so their content does not matter, and the
    recomputation spares one clone per buffer (on the CPU-size ResNet-50, ~85 -> ~25 µs per
    recomputed region). The scratch starts as a copy, so ``num_batches_tracked`` stays a count
    (``momentum=None`` divides by it). With a momentum nothing but its own increment reads the
    count, so the replay sees ``None`` there and batch norm skips the increment (one op less per
    replayed batch norm).

    ``snapshot``: the buffers' values when the forward began (:func:`snapshot_buffers`, or the
    :class:`_Snapshot` of the same checkpoint call); the recomputation gets a copy of those
    instead of the current values. While the context is open :func:`is_recomputing` is true."""

    __slots__ = ("slots", "saved", "snapshot")

    def __init__(self, slots: list[tuple[nn.Module, str]], snapshot: Any = None) -> None:
        self.slots = slots
        self.snapshot = snapshot
        self.saved: list[tuple[dict[str, Any], str, torch.Tensor]] = []

    def __enter__(self) -> "RestoreBuffers":
        saved = []
        snap = self.snapshot.values if isinstance(self.snapshot, _Snapshot) else self.snapshot
        for i, (m, name) in enumerate(self.slots):
            table = m._buffers
            b = table.get(name)
            if b is not None:
                saved.append((table, name, b))
                if _scratch_slot(m, name):
                    # with a momentum, the count is read by nothing but its own increment
                    table[name] = (None if name == "num_batches_tracked" and m.momentum is not None
                                   else _scratch(m, name, b))
                else:
                    src = b if snap is None or snap[i] is None else snap[i]
                    table[name] = src.detach().clone()
        self.saved = saved
        _RECOMPUTING.depth = getattr(_RECOMPUTING, "depth", 0) + 1
        return self

    def __exit__(self, *exc: Any) -> None:
        _RECOMPUTING.depth -= 1
        for table, name, b in self.saved:
            table[name] = b
        self.saved = []


def stateful_buffers(modules: list[nn.Module]) -> list[tuple[nn.Module, str]]:
    """``(module, buffer name)`` of every buffer that ``modules`` (submodules included, each once)
    own, that a forward could update."""
    seen: dict[int, nn.Module] = {}
    for root in modules:
        for m in root.modules():
            if id(m) not in seen and m._buffers:
                seen[id(m)] = m
    return [(m, name) for m in seen.values() for name, b in m._buffers.items() if b is not None]


def param_versions(params: tuple[torch.Tensor, ...]) -> tuple[int, ...] | None:
    """The version counters of ``params`` now (``None`` for none), for :func:`check_params`."""
    return tuple(p._version for p in params) if params else None


def check_params(params: tuple[torch.Tensor, ...], versions: tuple[int, ...] | None) -> None:
    """Raise as autograd does for a saved tensor when a parameter changed in place since
    :func:`param_versions` took ``versions``."""
    if versions is None:
        return
    for p, v in zip(params, versions):
        if p._version != v:
            raise RuntimeError(
                f"autoremat: one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: a parameter of a recomputed region ({tuple(p.shape)} {p.dtype}) is at version "
                f"{p._version}; expected version {v} instead. Change parameters after backward (e.g. "
                "optimizer.step() after loss.backward()), as without autoremat. If the model's own forward writes "
                "it (nn.Embedding(max_norm=...)), capture the model again with this autoremat and solve: a "
                "capture keeps the node writing it from recomputation")


class _ParamCheck:
    """``torch.utils.checkpoint``'s recomputation context part checking the parameters."""

    __slots__ = ("params", "versions")

    def __init__(self, params: tuple[torch.Tensor, ...]) -> None:
        self.params = params
        self.versions = param_versions(params)

    def __enter__(self) -> "_ParamCheck":
        check_params(self.params, self.versions)
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


def checkpoint_kwargs(stateful: list[tuple[nn.Module, str]], preserve_rng: bool = True,
                      params: tuple[torch.Tensor, ...] = (), dicts: tuple[dict[str, Any], ...] = (),
                      generators: list[tuple[torch.Generator, torch.Tensor]] | None = None) -> dict[str, Any]:
    """Keyword arguments of a non-reentrant ``torch.utils.checkpoint`` leaving the buffers
    ``stateful`` (see :func:`stateful_buffers`) alone; ``dicts``, ``generators``: see
    :func:`restoring_contexts`."""
    # a partial, not a lambda: a patched model pickles (torch.save of the module); also without
    # buffers, for is_recomputing()
    kw: dict[str, Any] = {"use_reentrant": False, "preserve_rng_state": preserve_rng,
                          "context_fn": functools.partial(restoring_contexts, stateful, params, dicts, generators)}
    return kw


class UncachedAutocast:
    """Autocast as it is, without its cache of parameter casts: a recomputed region's forward and
    replay run under it (:func:`restoring_contexts`, :mod:`.region`). Autocast keeps the first cast
    of each parameter until its region exits, so a recomputed region's casts, which the cost model
    frees with the region's other saved tensors, stayed alive through the forward (least plans of
    Hugging Face decoders under bf16 autocast measured up to 1.3x their prediction), and a replay
    inside the forward's autocast region (backward under ``autocast``) skipped the casts its
    forward dispatched, so selective checkpointing, which pairs stored outputs with ops by count,
    handed Mixtral's stored casts to other casts. Entered when the region runs, not when made."""

    def __init__(self) -> None:
        self.stack = contextlib.ExitStack()

    def __enter__(self) -> "UncachedAutocast":
        if getattr(_SHARED_CASTS, "on", False):  # one call of a shared module: see shared_casts
            return self
        for device in cached_autocast_devices():
            self.stack.enter_context(torch.autocast(device, dtype=torch.get_autocast_dtype(device), cache_enabled=False))
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stack.close()


_SHARED_CASTS = threading.local()


@contextlib.contextmanager
def shared_casts() -> Any:
    """The forward of one call of a module run more than once per step (:mod:`.per_call`) keeps
    autocast's cache of parameter casts: every call of the unpatched step uses the one cast the
    first call made, whose bf16 gradients autograd sums before casting them once; a call with a
    cast of its own sums its gradient in fp32 instead (ALBERT under bf16 autocast: gradients not
    bit-equal). Its replay, in backward, makes fresh casts (the same values)."""
    prev = getattr(_SHARED_CASTS, "on", False)
    _SHARED_CASTS.on = True
    try:
        yield
    finally:
        _SHARED_CASTS.on = prev


def restoring_contexts(stateful: list[tuple[nn.Module, str]], params: tuple[torch.Tensor, ...] = (),
                       dicts: tuple[dict[str, Any], ...] = (),
                       generators: list[tuple[torch.Generator, torch.Tensor]] | None = None) -> tuple[Any, Any]:
    """``context_fn`` of ``torch.utils.checkpoint``: a forward taking a snapshot of the buffers
    (and the parameters' versions: called at the forward), a recomputation checking the versions,
    starting from the snapshot and leaving the real buffers alone, with the entries the region's
    modules' instance, parameter and buffer ``dicts`` held at the forward and the ``generators`` in
    the states the forward found them in (:mod:`.substituted`)."""
    snap = _Snapshot(stateful) if stateful else None
    restore = BothContexts(RestoreBuffers(stateful, snap), UncachedAutocast())
    if holds_state(dicts, generators):
        restore = BothContexts(HeldState(dicts, generators), restore)
    forward = BothContexts(snap or contextlib.nullcontext(), UncachedAutocast())
    if not params:
        return forward, restore
    return forward, BothContexts(_ParamCheck(params), restore)


_FILLS_SAVED = frozenset({"rrelu_with_noise", "rrelu_with_noise_"})
"""ATen ops that save for backward a tensor they fill themselves (RReLU's noise): a replay stopped
at its last saved tensor stops before the op fills it (PyTorch's own early-stopping checkpoint
then gives wrong gradients), so a region running one replays to its end."""


class SeededProbe(TorchDispatchMode):
    """Notes whether an ATen op tagged ``nondeterministic_seeded`` (one that draws from the RNG:
    dropout's ``bernoulli_``, ``rrelu_with_noise``, ``randn``…) runs while it is active
    (``seen``), and whether one of :data:`_FILLS_SAVED` does (``fills_saved``); ``generators``: each
    ``torch.Generator`` such an op was handed (``generator=``: a module's own generator) with its
    state before that op, its first use (:mod:`.substituted` replays it)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = False
        self.fills_saved = False
        self.generators: list[tuple[torch.Generator, torch.Tensor]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.seen = True
            self.fills_saved = self.fills_saved or func.overloadpacket.__name__ in _FILLS_SAVED
            gen = (kwargs or {}).get("generator")
            if isinstance(gen, torch.Generator) and not any(g is gen for g, _ in self.generators):
                self.generators.append((gen, gen.get_state()))
        return func(*args, **(kwargs or {}))
