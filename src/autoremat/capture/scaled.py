"""Capture a training step that does not fit: bytes at full size without allocation, times
from real runs at batch sizes that fit, scaled to the full batch.

:func:`capture_within` is :func:`~autoremat.capture.capture` for a step whose unpatched peak may
exceed what the device holds. It never runs the unpatched step at a size predicted above
``limit_bytes`` (a step-peak limit: bytes above what is resident when the step starts).

How it works (decisions, tested in ``tests/test_capture_scaled.py``):

1. **Bytes at full size on the meta device.** The model's parameters and buffers are swapped in
   place for meta tensors of the same shape and dtype (tied parameters stay tied; gradients are
   set aside), the inputs are replaced by meta tensors, and the ordinary capture runs on that:
   it records outputs, saved tensors, views, workspace and parameter gradients exactly as a
   real capture would, and allocates nothing. Everything is put back in a ``finally`` block.
   The meta device was chosen over ``FakeTensorMode`` because capture already supports it
   (``autoremat profile --device meta``) and the recorder's storage bookkeeping works on it.
2. **Times from real runs at sizes that fit.** The batch (dimension ``batch_dim`` of every input
   tensor whose size there equals the batch) is cut to ``s`` rows. The ladder starts at
   ``max(1, B // 8)``, halves while the predicted unpatched peak at ``s`` is above the limit and
   doubles while the next size (at most ``B // 2``) is predicted to fit; the two largest sizes
   of the ladder run for real, timing steps only (``warmup + repeats`` each, the bytes being the
   meta capture's), largest first, halving past a size that runs out of memory. The predicted peak at ``s`` is linear in the batch:
   ``P(s) = G + (P(B) - G) * s / B`` with ``G`` the parameter-gradient bytes (which do not
   scale) and ``P(B)`` the meta capture's unoptimised step peak.
3. **Scaling.** Per node and per direction (forward, backward), ``t(B) = a + b * B`` through the
   two measured sizes. A negative slope (noise on a node whose time does not grow with the
   batch) gives the mean of the two times; a negative intercept gives ``t(s_hi) * B / s_hi``
   (proportional). With a single size (``B == 2``, or only one row fits) times are proportional.
4. **Same graph.** The result is the meta capture at full size, with its nodes, edges and
   fingerprint, carrying the fitted times; a small capture whose node names differ from the
   meta capture is an error that says so (it would mean the graph depends on the batch size).
5. **Fallback.** Where the model cannot run on meta tensors (data-dependent Python such as
   ``if x.sum() > 0``, or transformers' mask code, which calls ``.item()``; a tensor attribute
   that is not a buffer) or autocast is active (autocast does not apply to meta tensors, so
   bytes would be those of full precision), the ladder is walked with real (recorded) captures
   from ``max(1, B // 8)`` upwards, doubling while the peak predicted from the captures so far
   fits, and bytes are fitted per node with the same ``a + b * B`` rule (clamped at zero). The
   log says so (``INFO``), and ``graph.meta["scaled"]["bytes_from"]`` is ``"linear fit"``
   instead of ``"meta"``. This path starts at 2 rows where the batch allows (models such as
   transformers' take other paths at batch 1, so the graph would differ). The whole batch is
   captured instead (a plain capture) only where the small captures predict it needs at most
   half the limit: that prediction misses workspace a small size hides (below), and the factor
   two keeps it from running an unpatched step above the limit. The fit is approximate where a small size hides a workspace (the
   recorder clamps a negative workspace at zero): a GPT-2 measured -0.3 %, a toy MLP dominated
   by gradients and workspace -8.6 %. ``FakeTensorMode`` was tried for transformers (it counts
   as tracing there): bytes matched, but transformers then takes another mask path whose glue
   ops differ, so the graph would not be the full-size capture's.
6. **Out of memory.** A ``torch.OutOfMemoryError`` (or the CPU allocator's) during any real
   capture is caught; capture has already restored RNG, buffers and gradients (parameters and
   optimizer state are never written by profiling; profiling steps start from no gradients and
   never accumulate into the user's), the CUDA cache is emptied, and the size is halved. When even one row does not fit, :class:`CaptureDoesNotFitError` names the smallest
   size tried and what to change.

When the whole step is predicted to fit, :func:`capture_within` is a plain capture (falling back
to the scaled path if it runs out of memory anyway).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .._compiled import uncompiled
from ..graph import Graph

__all__ = ["capture_within", "CaptureDoesNotFitError", "profile_limit_bytes", "resident_bytes_of", "on_meta",
           "batch_size_of", "is_oom", "scale_to"]

logger = logging.getLogger(__name__)

_OOM_MARKERS = ("out of memory", "can't allocate memory", "cannot allocate memory")
_BYTE_KEYS = ("out_bytes", "alloc_bytes", "extra_saved_bytes", "fwd_temp_bytes", "bwd_temp_bytes")
_META_BYTE_KEYS = ("loss_extra_bytes", "loss_fwd_temp_bytes", "loss_bwd_temp_bytes")


class CaptureDoesNotFitError(RuntimeError):
    """Profiling ran out of memory (or was predicted to) even at the smallest batch size tried."""

    def __init__(self, smallest_size: int, limit_bytes: int, batch_size: int) -> None:
        self.smallest_size = int(smallest_size)
        self.limit_bytes = int(limit_bytes)
        self.batch_size = int(batch_size)
        super().__init__(
            f"profiling does not fit: even a batch of {smallest_size} (of {batch_size}) needs more than the "
            f"{limit_bytes}-byte step limit. Free device memory or give a larger budget, make one sample "
            "smaller (sequence length, image size), or plan from a meta-device capture "
            "(autoremat profile --device meta)."
        )


def is_oom(err: BaseException) -> bool:
    """Whether ``err`` is an out-of-memory error (CUDA, or the CPU allocator's)."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    return isinstance(err, RuntimeError) and any(m in str(err).lower() for m in _OOM_MARKERS)


# ---------------------------------------------------------------------- batches
def batch_size_of(args: Sequence[Any], kwargs: Mapping[str, Any], batch_dim: int = 0) -> int:
    """The batch size: dimension ``batch_dim`` of the first input tensor that has it."""
    from ._recorder import tensors_in

    for t in tensors_in((tuple(args), dict(kwargs))):
        if t.dim() > batch_dim:
            return int(t.shape[batch_dim])
    raise ValueError(f"no input tensor has a batch dimension {batch_dim}; pass batch_dim= the dimension "
                     "that holds the batch")


def _map_batch(obj: Any, batch: int, batch_dim: int, fn: Callable[[torch.Tensor, bool], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj, obj.dim() > batch_dim and obj.shape[batch_dim] == batch)
    if isinstance(obj, Mapping):
        return {k: _map_batch(v, batch, batch_dim, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_batch(v, batch, batch_dim, fn) for v in obj)
    return obj


def _rows(args: tuple, kwargs: dict, batch: int, size: int, batch_dim: int) -> tuple[tuple, dict]:
    def cut(t: torch.Tensor, batched: bool) -> torch.Tensor:
        if not batched:
            return t
        # a copy, not a view: the recorder counts the storages of its inputs as resident
        return t.narrow(batch_dim, 0, size).clone().requires_grad_(t.requires_grad)
    return _map_batch(args, batch, batch_dim, cut), _map_batch(kwargs, batch, batch_dim, cut)


def _meta_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    def meta(t: torch.Tensor, _batched: bool) -> torch.Tensor:
        return torch.empty_like(t, device="meta").requires_grad_(t.requires_grad)
    return _map_batch(args, -1, 0, meta), _map_batch(kwargs, -1, 0, meta)


# ---------------------------------------------------------------------- the meta swap
@contextlib.contextmanager
def on_meta(model: nn.Module) -> Iterator[nn.Module]:
    """Swap ``model``'s parameters and buffers for meta tensors in place, and put them back.

    Tied parameters stay tied (one meta tensor per original); ``.grad`` is set aside while
    swapped. The objects the optimizer holds are untouched: the modules point at new meta
    tensors for the duration and at the originals again afterwards, even on an exception.
    """
    memo: dict[int, torch.Tensor] = {}
    swapped: list[tuple[dict, str, Any]] = []
    grads = {id(p): p.grad for p in model.parameters()}
    try:
        for mod in model.modules():
            for store in (mod._parameters, mod._buffers):
                for name, t in list(store.items()):
                    if t is None or t.device.type == "meta":
                        continue
                    if id(t) not in memo:
                        m = torch.empty_like(t, device="meta")
                        memo[id(t)] = nn.Parameter(m, t.requires_grad) if isinstance(t, nn.Parameter) else m
                    swapped.append((store, name, t))
                    store[name] = memo[id(t)]
        yield model
    finally:
        for store, name, t in reversed(swapped):
            store[name] = t
        for p in model.parameters():
            p.grad = grads.get(id(p), p.grad)


def _autocast_on(device: torch.device) -> bool:
    try:
        return bool(torch.is_autocast_enabled(device.type))
    except (TypeError, RuntimeError):
        return False


# ---------------------------------------------------------------------- fitting
def _fit(y_lo: float, y_hi: float, s_lo: int, s_hi: int, batch: int) -> float:
    """``a + b * batch`` through ``(s_lo, y_lo)`` and ``(s_hi, y_hi)``, clamped as documented."""
    if s_hi == s_lo:
        return y_hi * batch / s_hi
    b = (y_hi - y_lo) / (s_hi - s_lo)
    if b < 0:
        return (y_lo + y_hi) / 2
    a = y_lo - b * s_lo
    if a < 0:
        return y_hi * batch / s_hi
    return a + b * batch


def _check_same(base: Graph, small: Graph, size: int) -> None:
    names = [base.node(v)["name"] for v in base.nodes]
    other = [small.node(v)["name"] for v in small.nodes]
    if names != other or base.fingerprint != small.fingerprint:
        raise ValueError(f"the graph captured at batch size {size} differs from the full-size graph "
                         f"({len(other)} vs {len(names)} nodes): the model's structure depends on the batch "
                         "size, so it cannot be profiled at a smaller batch; give a budget that fits the "
                         "whole step or make the structure independent of the batch size")


def scale_to(base: Graph, lo: Graph, hi: Graph, s_lo: int, s_hi: int, batch: int, *, bytes_too: bool) -> Graph:
    """``base`` (same nodes as ``lo`` and ``hi``) with times, and with ``bytes_too`` bytes, fitted
    per node from the captures at ``s_lo`` and ``s_hi`` rows and evaluated at ``batch``."""
    g = base.copy()
    for v in g.nodes:
        d, a, b = g.node(v), lo.node(v), hi.node(v)
        for key in ("time_s", "bwd_time_s"):
            d[key] = max(0.0, _fit(a[key], b[key], s_lo, s_hi, batch))
        if bytes_too:
            for key in _BYTE_KEYS:
                d[key] = max(0, int(math.ceil(_fit(a[key], b[key], s_lo, s_hi, batch))))
    if bytes_too:
        for key in _META_BYTE_KEYS:
            g.meta[key] = max(0, int(math.ceil(_fit(lo.meta[key], hi.meta[key], s_lo, s_hi, batch))))
    g._refresh()
    return g


# ---------------------------------------------------------------------- budgets
def resident_bytes_of(model: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None) -> int:
    """What a capture counts as resident before a step (``graph.meta["resident_bytes"]``, see
    :mod:`autoremat.resident`), known before capturing."""
    from ..resident import resident_bytes  # the one definition of resident bytes

    return resident_bytes(model, inputs=(tuple(args), dict(kwargs or {})))


def profile_limit_bytes(budget: Any, *, device: Any, resident_bytes: int) -> int:
    """The step limit profiling may use under a *device* budget, known before any capture.

    ``"auto"`` and budgets relative to the unoptimised step peak (``"50%"``, ``0.5``; that peak
    is what profiling is to find out) take the device's capacity: free memory from NVML /
    ``torch.cuda.mem_get_info`` on a GPU, available host memory on a CPU, minus the ``"auto"``
    margin (free memory already excludes what is resident). A byte count or size string is the
    device's capacity: ``resident_bytes`` are subtracted.
    """
    from ..budget import parse_budget

    if isinstance(budget, float) or (isinstance(budget, str) and budget.strip().lower() == "auto") \
            or (isinstance(budget, str) and budget.strip().endswith("%")):
        return parse_budget("auto", device=device, resident_bytes=0)
    step = parse_budget(budget) - int(resident_bytes)
    if step <= 0:
        raise ValueError(f"budget={budget!r} is below the {resident_bytes} bytes resident before a step "
                         "(parameters, buffers, optimizer state, the batch); raise it")
    return step


# ---------------------------------------------------------------------- the public entry point
def capture_within(
    model: nn.Module,
    args: Sequence[Any] | torch.Tensor,
    kwargs: Mapping[str, Any] | None = None,
    *,
    limit_bytes: int | None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    mode: str = "auto",
    repeats: int = 3,
    warmup: int = 1,
    batch_dim: int = 0,
    times: str | None = None,
) -> Graph:
    """Profile one training step of ``model`` without running an unpatched step predicted to
    need more than ``limit_bytes`` (step peak: bytes above what is resident at step start).

    ``limit_bytes=None`` is a plain :func:`~autoremat.capture.capture`. Otherwise the graph's
    bytes come from a meta-device capture at the full batch and its times from real captures at
    batch sizes that fit, scaled (module docstring). ``graph.meta["scaled"]`` records the sizes
    and sources; it is absent when the full step ran.

    Raises:
        CaptureDoesNotFitError: even the smallest batch size tried ran out of memory.
        ValueError: ``limit_bytes`` is negative, or the graph depends on the batch size.
    """
    from . import capture, resolve_times
    from ..resident import device_of as _device

    times = resolve_times(times)
    model = uncompiled(model)
    if isinstance(args, torch.Tensor):
        args = (args,)
    args, kwargs = tuple(args), dict(kwargs or {})
    opts: dict[str, Any] = dict(loss_fn=loss_fn, mode=mode, repeats=repeats, warmup=warmup, times=times)
    if limit_bytes is None or _device(model, args, kwargs).type == "meta":
        return capture(model, args, kwargs, **opts)
    if isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int) or limit_bytes < 0:
        raise ValueError(f"limit_bytes={limit_bytes!r} must be an int >= 0 (bytes a profiling step may use "
                         "above what is resident), or None for a plain capture")
    batch = batch_size_of(args, kwargs, batch_dim)
    base = _meta_capture(model, args, kwargs, opts)
    if base is not None and times == "flops":  # bytes exact at full size, times from FLOPs: no real step
        return base
    if base is not None:
        from ..simulate import unoptimised_peak_bytes

        full = unoptimised_peak_bytes(base)
        if full <= limit_bytes:
            try:
                return capture(model, args, kwargs, **opts)
            except (RuntimeError, torch.OutOfMemoryError) as err:
                if not is_oom(err):
                    raise
                logger.info("autoremat: the full step (predicted %d bytes) ran out of memory; profiling at "
                            "smaller batch sizes", full)
            _free()
        predict = _linear_peak(full, base.param_grad_bytes, batch)
    else:
        predict = None
    return _ladder(model, args, kwargs, opts, base, batch, batch_dim, limit_bytes, predict)


def _meta_capture(model: nn.Module, args: tuple, kwargs: dict, opts: dict) -> Graph | None:
    """The full-size capture on the meta device, or ``None`` (logged) where it cannot run."""
    from . import _capture
    from ..resident import device_of as _device

    device = _device(model, args, kwargs)
    if _autocast_on(device):
        logger.info("autoremat: autocast is on and does not apply to meta tensors; bytes come from a linear "
                    "fit of real captures at batch sizes that fit")
        return None
    margs, mkwargs = _meta_inputs(args, kwargs)
    try:
        with on_meta(model):
            g = _capture(model, margs, mkwargs, **{**opts, "repeats": 1, "warmup": 0},
                         flop_times=opts.get("times") == "flops")
    except Exception as exc:  # data-dependent Python on meta raises many types; fall back and say so
        logger.info("autoremat: %s cannot run on meta tensors (%s: %s); bytes come from a linear fit of real "
                    "captures at batch sizes that fit", type(model).__name__, type(exc).__name__,
                    str(exc).splitlines()[0][:200] if str(exc) else "")
        return None
    g.meta["device"] = str(device)
    from .signature import input_signature

    g.meta["inputs"] = input_signature(args, kwargs)  # the real batch's devices, not "meta"
    return g


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    from ._recorder import tensors_in
    return tensors_in((args, kwargs))


def _linear_peak(full: int, fixed: int, batch: int) -> Callable[[int], float]:
    def predict(size: int) -> float:
        return fixed + max(0, full - fixed) * size / batch
    return predict


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _timed_copy(model: nn.Module, args: tuple, kwargs: dict, opts: dict, base: Graph) -> Graph:
    """``base`` with the node times of real steps on ``args`` (no recording step: bytes are base's)."""
    from ..measure import default_loss
    from ..resident import device_of as _device
    from ._recorder import preserved_state
    from .fx import fx_fingerprint, time_fx, trace
    from .module import time_modules

    device = _device(model, args, kwargs)
    loss = opts["loss_fn"] or default_loss
    timing = dict(repeats=opts["repeats"], warmup=opts["warmup"], device=device)
    with preserved_state(model, [device]):
        if base.meta["mode"] == "fx":
            gm = trace(model)
            assert fx_fingerprint(gm) == base.fingerprint, "the traced graph changed between captures, please report"
            fwd, bwd = time_fx(gm, args, kwargs, loss, **timing)
        else:
            order = [v for v in base.nodes if base.node(v)["kind"] != "glue"]
            fwd, bwd = time_modules(model, order, len(base), args, kwargs, loss, **timing)
    g = base.copy()
    for v, f, b in zip(g.nodes, fwd, bwd):
        g.node(v)["time_s"], g.node(v)["bwd_time_s"] = float(f), float(b)
    g.meta["time_source"] = "cuda-events" if device.type == "cuda" else "perf_counter"
    return g


def _try_capture(model: nn.Module, args: tuple, kwargs: dict, opts: dict, batch: int, size: int,
                 batch_dim: int, base: Graph | None) -> Graph | None:
    """A real capture at ``size`` rows (times only when ``base`` gives the bytes), or ``None`` when
    it ran out of memory (state restored)."""
    from . import capture

    small_args: Any = (None, None)
    try:
        small_args = _rows(args, kwargs, batch, size, batch_dim)
        if base is not None:
            return _timed_copy(model, *small_args, opts, base)
        return capture(model, *small_args, **opts)
    except (RuntimeError, torch.OutOfMemoryError) as err:
        if not is_oom(err):
            raise
        logger.info("autoremat: profiling at batch size %d ran out of memory; trying smaller", size)
    del small_args
    _free()
    return None


class _Trial:
    """Real captures at cut batches, out-of-memory safe; ``smallest`` is the smallest size tried."""

    def __init__(self, model: nn.Module, args: tuple, kwargs: dict, opts: dict, batch: int, batch_dim: int,
                 limit: int, base: Graph | None) -> None:
        self.model, self.args, self.kwargs, self.opts, self.base = model, args, kwargs, opts, base
        self.batch, self.batch_dim, self.limit = batch, batch_dim, limit
        self.smallest = batch

    def run(self, size: int) -> Graph | None:
        self.smallest = min(self.smallest, size)
        return _try_capture(self.model, self.args, self.kwargs, self.opts, self.batch, size, self.batch_dim,
                            self.base)

    def down(self, size: int) -> dict[int, Graph]:
        """``size`` and ``size // 2``, halving past any size that runs out of memory."""
        got: dict[int, Graph] = {}
        while len(got) < 2 and size >= 1:
            g = self.run(size)
            if g is not None:
                got[size] = g
            elif not got and size == 1:
                raise CaptureDoesNotFitError(1, self.limit, self.batch)
            elif got:
                break
            size //= 2
        return got

    def up(self, size: int) -> dict[int, Graph]:
        """From ``size`` (halved on out of memory), doubling while the peak fitted through the real
        captures so far predicts the next size fits, up to ``batch // 2``; the whole batch alone
        where it is predicted to need at most half the limit."""
        got: dict[int, Graph] = {}
        while True:
            g = self.run(size)
            if g is None:
                if got:
                    return got
                if size == 1:
                    raise CaptureDoesNotFitError(1, self.limit, self.batch)
                size //= 2
                continue
            got[size] = g
            if self._guess(got, self.batch) <= self.limit / 2:  # ample room: the whole batch
                whole = self.run(self.batch)
                if whole is not None:
                    return {self.batch: whole}
            nxt = size * 2
            if nxt > self.batch // 2 or self._guess(got, nxt) > self.limit:
                return got
            size = nxt

    @staticmethod
    def _guess(got: dict[int, Graph], size: int) -> float:
        """Unoptimised peak at ``size``: linear through the two largest captures; from one, the
        gradients stay and the rest is proportional."""
        from ..simulate import unoptimised_peak_bytes

        sizes = sorted(got)[-2:]
        peaks = [unoptimised_peak_bytes(got[s]) for s in sizes]
        if len(sizes) == 1:
            fixed = got[sizes[0]].param_grad_bytes
            return fixed + max(0, peaks[0] - fixed) * size / sizes[0]
        return _fit(peaks[0], peaks[-1], sizes[0], sizes[-1], size)


def _ladder(model: nn.Module, args: tuple, kwargs: dict, opts: dict, base: Graph | None, batch: int,
            batch_dim: int, limit: int, predict: Callable[[int], float] | None) -> Graph:
    """Walk the batch-size ladder (module docstring), capture the two largest sizes that fit, scale."""
    trial = _Trial(model, args, kwargs, opts, batch, batch_dim, limit, base)
    top = max(1, batch // 8)
    if predict is not None:  # the two largest ladder sizes predicted to fit, largest first
        while top > 1 and predict(top) > limit:
            top //= 2
        if predict(top) > limit:
            raise CaptureDoesNotFitError(top, limit, batch)
        while top * 2 <= batch // 2 and predict(top * 2) <= limit:
            top *= 2
        got = trial.down(top)
    else:
        got = trial.up(max(top, min(2, batch // 2)))  # batch 1 often takes other paths (squeezes)
        if batch in got:
            return got[batch]
    sizes = sorted(got)
    s_hi = sizes[-1]
    s_lo = sizes[-2] if len(sizes) > 1 else s_hi
    lo, hi = got[s_lo], got[s_hi]
    if base is not None:
        _check_same(base, hi, s_hi)
        _check_same(base, lo, s_lo)
        out = scale_to(base, lo, hi, s_lo, s_hi, batch, bytes_too=False)
        bytes_from = "meta"
    else:
        _check_same(hi, lo, s_lo)
        out = scale_to(hi, lo, hi, s_lo, s_hi, batch, bytes_too=True)
        bytes_from = "linear fit"
    out.meta["time_source"] = f"{hi.meta['time_source']}, scaled"
    out.meta["input_bytes"] = int(sum(t.untyped_storage().nbytes() for t in _tensors(args, kwargs)))
    out.meta["resident_bytes"] = int(sum(out.meta["param_bytes"].values()) + out.meta["input_bytes"]
                                     + sum(b.numel() * b.element_size() for b in model.buffers()))
    out.meta["scaled"] = {"batch_size": batch, "sizes": [s_lo, s_hi] if s_lo != s_hi else [s_hi],
                          "smallest_tried": trial.smallest, "bytes_from": bytes_from, "limit_bytes": limit}
    logger.info("autoremat: profiled at batch sizes %s of %d (limit %d bytes); bytes from %s, times scaled",
                sorted({s_lo, s_hi}), batch, limit, bytes_from)
    return out
