"""Measuring the real step peak and step time (DESIGN.md, "What memory means").

On CUDA the step peak comes from the caching allocator's statistics
(``max_memory_allocated`` after ``reset_peak_memory_stats``, minus what was allocated when the
step started). On the CPU it comes from :class:`LiveStorageCounter`, a ``TorchDispatchMode``
that adds the bytes of every new output storage and subtracts them when the storage is
finalised, so it sees forward, recomputation and backward alike.

Any ``TorchDispatchMode`` makes the autograd engine add a second gradient of a tensor out of place
where the plain engine adds it in place (:mod:`autoremat.grad_sums`). The counter undoes that one
difference: a sum the plain engine makes in place, whose input buffer is released before the next
op, counts at the level the in-place add would have had (:meth:`LiveStorageCounter.peak`;
``tests/test_measure_accumulation.py`` holds it to the CPU allocator's own record).
"""

from __future__ import annotations

import contextlib
import dataclasses

import functools
import statistics
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ._compiled import uncompiled
from ._fsdp import local_tensor
from .grad_sums import GradSums, engine_sum
from .resident import device_of

__all__ = ["LiveStorageCounter", "CollectiveCounter", "Measurement", "measure", "default_loss", "run_step",
           "gradients", "gradients_equal", "op_tensors", "deterministic_kernels", "is_profiling", "profiling_run",
           "counted_step_peak"]


class LiveStorageCounter(TorchDispatchMode):
    """Counts the bytes of live storages created while the mode is active.

    ``live`` is the current total, ``peak`` the highest since the last :meth:`reset_peak`.
    Gradient accumulation counts as the engine does it without a mode (module docstring):
    an ``aten.add`` in backward of two equal dense tensors, the first made before the current
    autograd node ran, whose inputs the engine releases at once, would have been in place.
    Storages that existed before the mode was entered are never counted; meta-device storages
    are counted unless ``count_meta`` is false (a simulated device sets it false: meta tensors
    occupy no memory). A ``DTensor`` output counts with its local shard (what this rank holds).

    ``track_resizes``: also count ``UntypedStorage.resize_`` calls made while the mode is active
    (FSDP frees and re-allocates unsharded parameters and gradients that way, outside the
    dispatcher): a resize changes the live bytes by the difference, also for a storage that
    existed before the mode was entered (freeing it makes the count go below the start).
    """

    count_meta = True

    def __init__(self, *, track_resizes: bool = False) -> None:
        super().__init__()
        self.live = 0
        self._peak = 0
        self._seen: dict[int, int] = {}
        self.made = 0
        """Storages counted so far (each once, when made)."""
        self._born: dict[int, tuple[str, int]] = {}
        """Storage key -> the autograd node that made it (storages made in backward only)."""
        self._pending: tuple[int, int, tuple[int, ...]] | None = None
        """An accumulation add not yet settled: level as if in place, level counted, input keys."""
        self.track_resizes = track_resizes
        self._resize: Any = None
        self.on_op: Callable[[Any, tuple, dict, Any], None] | None = None
        """Called as ``on_op(func, args, kwargs, out)`` after each op (capture uses it)."""
        self.sums = GradSums()
        """The engine's sums of gradients seen so far (which had a first part that was a view)."""

    @property
    def peak(self) -> int:
        """The highest live level since the last :meth:`reset_peak`."""
        self._settle()
        return self._peak

    @peak.setter
    def peak(self, value: int) -> None:
        self._pending = None
        self._peak = value

    def reset_peak(self) -> None:
        self._settle()
        self._peak = self.live

    def _settle(self) -> int | None:
        """Settle the last accumulation add: in place (its level before the sum) if the engine
        has released one of its inputs since, out of place otherwise. Returns the level."""
        if self._pending is None:
            return None
        in_place, counted, keys = self._pending
        self._pending = None
        level = in_place if any(k not in self._seen for k in keys) else counted
        self._peak = max(self._peak, level)
        return level

    def accumulation_slack(self) -> int:
        """Bytes of an unsettled accumulation's sum (0 when none): ``live`` minus them is the
        level if the add turns out to be in place."""
        return 0 if self._pending is None else self._pending[1] - self._pending[0]

    def _release(self, key: int) -> None:
        nbytes = self._seen.pop(key, 0)
        self._born.pop(key, None)
        self.sums.release(key)
        self.live -= nbytes

    def __enter__(self) -> "LiveStorageCounter":
        out = super().__enter__()
        if self.track_resizes:
            self._resize = torch.UntypedStorage.__dict__.get("resize_")
            original = torch.UntypedStorage.resize_
            counter = self

            def resize_(storage: torch.UntypedStorage, size: int) -> Any:
                key, before = storage._cdata, storage.nbytes()
                result = original(storage, size)
                counter._resized(storage, key, before)
                return result

            torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        return out

    def __exit__(self, *exc: Any) -> None:
        if self.track_resizes:
            if self._resize is None:
                del torch.UntypedStorage.resize_
            else:
                torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
        return super().__exit__(*exc)

    def _resized(self, storage: torch.UntypedStorage, key: int, before: int) -> None:
        after = storage.nbytes()
        if key not in self._seen:
            self._seen[key] = before
            weakref.finalize(storage, self._release, key)
        self._seen[key] = after
        self.live += after - before
        self._settle()
        self._peak = max(self._peak, self.live)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        self._settle()
        out = func(*args, **(kwargs or {}))
        node = None if torch.is_grad_enabled() else torch._C._current_autograd_node()
        made = None if node is None else (node.name(), node._sequence_nr())
        flat = op_tensors(out)
        inputs: set[int] | None = None
        added = 0
        for t in flat:
            if isinstance(t, torch.Tensor):
                t = local_tensor(t)
                st = t.untyped_storage()
                key = st._cdata
                if key in self._seen or (not self.count_meta and st.device.type == "meta"):
                    continue
                if inputs is None:  # views and in-place results share an input's storage
                    inputs = {local_tensor(a).untyped_storage()._cdata for a in op_tensors((args, kwargs))}
                if key in inputs:
                    continue
                nbytes = st.nbytes()
                self._seen[key] = nbytes
                self.made += 1
                if made is not None:
                    self._born[key] = made
                self.live += nbytes
                added += nbytes
                weakref.finalize(st, self._release, key)
        keys = None
        in_place = engine_sum(func, args, kwargs, made, self._seen, self._born) if added else None
        if in_place is not None:
            self.sums.note(args[0], args[1], out, in_place, added)
            if in_place:
                keys = tuple(k for k in (local_tensor(t).untyped_storage()._cdata for t in args) if k in self._seen)
        if keys:
            self._pending = (self.live - added, self.live, keys)
        elif self.live > self._peak:
            self._peak = self.live
        if self.on_op is not None:
            self.on_op(func, args, kwargs or {}, out)
        return out

class CollectiveCounter(TorchDispatchMode):
    """Counts the collectives (``c10d`` ops: FSDP's all-gathers and reduce-scatters, DDP's
    all-reduces) run while the mode is active: ``counts[op name]`` and ``bytes[op name]`` (the
    bytes of the op's tensor arguments, the output buffer included)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}
        self.bytes: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        name = str(func)
        if name.startswith("c10d."):
            short = name.removeprefix("c10d.").split(".")[0].strip("_")
            self.counts[short] = self.counts.get(short, 0) + 1
            flat = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            self.bytes[short] = self.bytes.get(short, 0) + sum(t.numel() * t.element_size() for t in flat)
        return func(*args, **(kwargs or {}))


def default_loss(output: Any) -> torch.Tensor:
    """The default scalar to backpropagate: ``output``'s own loss where it carries one (a
    ``loss`` key or attribute holding a one-element floating-point tensor that requires grad: a
    Hugging Face model given ``labels``, whose users backpropagate ``outputs.loss``); else the
    sum of the means of every floating-point tensor in ``output`` (tuples, lists, dicts and
    dataclass-like objects are walked), in float32."""
    own = _own_loss(output)
    if own is not None:
        return own
    tensors = [t for t in _flatten(output) if isinstance(t, torch.Tensor) and t.is_floating_point()
               and t.requires_grad]
    if not tensors:
        raise ValueError("the model output holds no floating-point tensor that requires grad; "
                         "pass loss_fn= to say what to backpropagate")
    total = tensors[0].float().mean()
    for t in tensors[1:]:
        total = total + t.float().mean()
    return total


def _own_loss(output: Any) -> torch.Tensor | None:
    """``output["loss"]`` or ``output.loss`` where it is a one-element floating-point tensor that
    requires grad, else ``None``."""
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.is_floating_point() and loss.requires_grad and loss.numel() == 1:
        return loss
    return None


def _sparse_parts(t: torch.Tensor) -> list[torch.Tensor]:
    """The dense tensors a sparse one keeps its data in (COO: indices, values; compressed: the index
    arrays and values)."""
    if t.layout is torch.sparse_coo:
        return [t._indices(), t._values()]
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return [t.crow_indices(), t.col_indices(), t.values()]
    if t.layout in (torch.sparse_csc, torch.sparse_bsc):
        return [t.ccol_indices(), t.row_indices(), t.values()]
    return [t]


def op_tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors in an ATen op's arguments or result, in order: what ``tree_flatten`` finds there
    (tensors, lists and tuples of them, and scalars, which are left out; ``(args, kwargs)``'s
    dict), without its per-leaf work (a dispatch mode calls this for every op of a capture). A sparse
    tensor (``nn.Embedding(sparse=True)``'s gradient) has no storage of its own: its index and value
    tensors stand for it."""
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.layout is torch.strided else _sparse_parts(obj)
    out: list[torch.Tensor] = []
    for x in (obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()):
        if isinstance(x, torch.Tensor):
            out.extend((x,) if x.layout is torch.strided else _sparse_parts(x))
        elif isinstance(x, (list, tuple, dict)):
            out.extend(op_tensors(x))
    return out


def _flatten(obj: Any) -> list[Any]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, Mapping):
        return [x for v in obj.values() for x in _flatten(v)]
    if isinstance(obj, (list, tuple)):
        return [x for v in obj for x in _flatten(v)]
    if hasattr(obj, "to_tuple"):  # transformers ModelOutput
        return _flatten(obj.to_tuple())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [x for f in dataclasses.fields(obj) for x in _flatten(getattr(obj, f.name))]
    return []


_PROFILING = [0]  # process-wide, not per thread: on a GPU, backward hooks run in autograd's device threads


def is_profiling() -> bool:
    """Whether autoremat is running the model itself: a capture (:func:`autoremat.capture`,
    :func:`autoremat.capture_within`: profiling, timing and meta runs, at the user's batch size
    and at smaller ones), a measured step (:func:`measure`, the integrations' step that confirms a
    plan, the batch-size trial steps) or the Lightning callback's recording of ``training_step``.
    Module hooks run in these as in any forward and backward (a hook may change what the model
    computes, so the capture keeps them); a hook with side effects (counting calls, logging
    activations or gradients) can test it to run them only in the user's own steps, as
    :func:`autoremat.runtime.is_recomputing` does for recomputation. Process-wide (backward hooks
    on a GPU run in autograd's own threads)."""
    return _PROFILING[0] > 0


def profiling_run(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with :func:`is_profiling` true while it runs (nested calls allowed)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _PROFILING[0] += 1
        try:
            return fn(*args, **kwargs)
        finally:
            _PROFILING[0] -= 1

    return wrapper


def counted_step_peak(model: torch.nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any] | None,
                      loss_fn: Callable[[Any], torch.Tensor] | None, *, keep_output: bool = False,
                      context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext) -> int:
    """The peak of one :func:`run_step` (``context()`` around its forward and loss), counted by a
    :class:`LiveStorageCounter` (the CPU's step peak). The module runs inside a ``torch.compile`` wrapper: Dynamo called under
    the counter's dispatch mode runs eagerly anyway, and marks the code it meets to run eagerly
    from then on (the user's compiled model would stop compiling); the peak counted is the eager
    step's, the one a capture predicts."""
    counter = LiveStorageCounter()
    with counter:
        run_step(uncompiled(model), args, kwargs, loss_fn, keep_output=keep_output, forward_context=context)
    return int(counter.peak)


def run_step(model: torch.nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None,
             loss_fn: Callable[[Any], torch.Tensor] | None = None, *, keep_output: bool = False,
             forward_context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
             ) -> torch.Tensor:
    """One forward + backward; returns the detached loss. Gradients are set to ``None`` first.
    The model's returned object is dropped once the loss is computed, or, with ``keep_output``,
    kept to the end of backward as the usual Accelerate loop does (``Graph.meta["output_kept"]``).
    ``forward_context()`` is around the forward and the loss, not the backward, as Lightning's
    precision plugin wraps ``training_step`` (under autocast its cast cache, the low-precision
    weight copies, is dropped before backward)."""
    model.zero_grad(set_to_none=True)
    with forward_context():
        out = model(*args, **(kwargs or {}))
        loss = (loss_fn or default_loss)(out)
    if not keep_output:
        del out
    loss.backward()
    return loss.detach()


@dataclass
class Measurement:
    """A measured training step."""

    peak_bytes: int
    step_time_s: float
    step_times_s: list[float] = field(default_factory=list)
    device: str = "cpu"


@profiling_run
def measure(
    model: torch.nn.Module,
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None = None,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    steps: int = 3,
    warmup: int = 1,
    keep_output: bool = False,
) -> Measurement:
    """Measure the step peak (bytes above what was live at step start) and median step time.
    ``keep_output``: keep the model's returned object to the end of backward (:func:`run_step`).

    ``steps`` steps are timed after ``warmup``. On CUDA the peak is the largest of the timed
    steps; on the CPU it comes from one more step run under :class:`LiveStorageCounter`
    (which is not timed, since a Python dispatch mode slows every op). Called inside one
    ``torch.autocast`` region, every step after the first reuses autocast's cached casts of the
    parameters, which a training loop entering autocast per step makes again each step (ResNet-50
    under CPU bf16, small size: its step peak measured about 0.85x the per-step one): measure one
    step per region to compare with a plan's prediction.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if steps < 1 or warmup < 0:
        raise ValueError(f"steps must be >= 1 and warmup >= 0, got steps={steps}, warmup={warmup}")
    device = device_of(model, args)
    for _ in range(warmup):
        run_step(model, args, kwargs, loss_fn, keep_output=keep_output)
    times: list[float] = []
    peak = 0
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            t0 = time.perf_counter()
            run_step(model, args, kwargs, loss_fn, keep_output=keep_output)
            torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
            peak = max(peak, torch.cuda.max_memory_allocated(device) - base)
        else:
            t0 = time.perf_counter()
            run_step(model, args, kwargs, loss_fn, keep_output=keep_output)
            times.append(time.perf_counter() - t0)
    if device.type != "cuda":
        # The counter is a Python dispatch mode: it slows every op, so the peak is taken from a
        # separate step and the times above are free of it.
        model.zero_grad(set_to_none=True)
        peak = counted_step_peak(model, args, kwargs, loss_fn, keep_output=keep_output)
    model.zero_grad(set_to_none=True)
    return Measurement(peak_bytes=int(peak), step_time_s=statistics.median(times), step_times_s=times,
                       device=str(device))


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """A copy of every parameter's gradient, by name."""
    return {n: (None if p.grad is None else p.grad.detach().clone()) for n, p in model.named_parameters()}


def gradients_equal(a: Mapping[str, torch.Tensor | None], b: Mapping[str, torch.Tensor | None]) -> bool:
    """Whether two gradient dicts are bit-for-bit equal (``torch.equal`` on every entry)."""
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if (x is None) != (y is None):
            return False
        # torch.equal compares values after type promotion: a dtype change is not bit-for-bit
        if x is not None and (x.dtype != y.dtype or not torch.equal(x, y)):
            return False
    return True


@contextlib.contextmanager
def deterministic_kernels() -> Iterator[None]:
    """Deterministic kernels inside the block (``torch.use_deterministic_algorithms(True,
    warn_only=True)``, cuDNN deterministic without benchmarking), restored after it: on a GPU, two
    runs of one step then give bit-for-bit equal gradients (:func:`gradients_equal`) whatever the
    plan, where cuDNN's and atomics' reduction orders would otherwise differ. An op without a
    deterministic kernel warns (PyTorch's message) instead of failing."""
    was, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True):
            yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn)
