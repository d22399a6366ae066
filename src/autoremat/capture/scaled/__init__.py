"""Capture a training step that does not fit: bytes at full size without allocation, times
from real runs at batch sizes that fit, scaled to the full batch.

:func:`capture_within` is :func:`~autoremat.capture.capture` for a step whose unpatched peak may
exceed what the device holds. It never runs the unpatched step at a size predicted above
``limit_bytes`` (a step-peak limit: bytes above what is resident when the step starts).

How it works (decisions, tested in ``tests/capture/scaled/test_scaled.py``; one module per concern):

1. **Bytes at full size on the meta device** (:mod:`.meta`). The model's parameters and buffers
   are swapped in place for meta tensors of the same shape and dtype (tied parameters stay tied;
   gradients are set aside), the inputs are replaced by meta tensors, and the ordinary capture
   runs on that: it records outputs, saved tensors, views, workspace and parameter gradients
   exactly as a real capture would, and allocates nothing. Everything is put back in a
   ``finally`` block. Ops seen before with the same input metadata are answered from a cache.
   The meta device was chosen over ``FakeTensorMode`` because capture already supports it
   (``autoremat profile --device meta``) and the recorder's storage bookkeeping works on it.
   Composite functions that choose their ops by device run as on the real device
   (:mod:`autoremat.capture.device_parity`: attention's fused backend, convolution layouts, lifted
   constants), so the meta graph is the real capture's node for node (tested on 17 Hugging Face
   architectures). Batch norm and pointwise ops of shapes not seen before are answered by layout rules verified
   against their (Python) meta kernels (:mod:`autoremat.capture.meta_rules`). Under autocast (CPU or
   CUDA: ``bf16-mixed``, ``16-mixed``, ``torch.autocast``) the meta tensors see the device's autocast,
   emulated with the device's own policy and cast cache (:mod:`autoremat.capture.autocast_meta`;
   autocast never fires on meta tensors by itself), so the meta graph is still the real one (CPU
   bf16: 13 of 13 zoo models and 19 of the 20 ``hf_breadth`` architectures node for node,
   Mixtral falling back as without autocast). The model is traced by fx once,
   with its tensors on meta (:func:`.meta.traced_on_meta`), and that trace serves the meta
   capture, every real run and the replay.
2. **Times from real runs at sizes that fit** (:mod:`.ladder`). The batch (dimension
   ``batch_dim`` of every input tensor whose size there equals the batch, :mod:`.batch`) is cut
   to ``s`` rows. The predicted unoptimised peak at ``s`` is linear in the batch:
   ``P(s) = G + (P(B) - G) * s / B`` with ``G`` the parameter-gradient bytes (which do not
   scale) and ``P(B)`` the meta capture's peak. The largest ``s < B`` predicted to fit and half
   of it run for real, timing steps only (``repeats`` each, with no warm-up step where
   ``repeats >= 3``: their median leaves out a first step's set-up; the bytes being the meta
   capture's), largest first, halving past a size that runs out of memory. The largest size is
   taken, not a fixed fraction of ``B``: the fit below extrapolates less (from 4 and 8 to 16, the
   noise of the two measurements is multiplied by 3.6; from 4 and 9, by 2.8).
3. **Scaling** (:mod:`.fit`). Per node and per direction, ``t(B) = a + b * B`` through the two
   measured sizes, clamped where noise makes the slope or the intercept negative.
4. **Kernels chosen per shape** (:mod:`.replay`). Convolutions and matrix multiplies are timed
   alone at the full batch (fx captures), their arguments tiled from the small run to the
   full-size shapes the meta capture recorded: a backend may pick another kernel at the full
   batch than at the sizes measured, which no fit sees.
5. **Same graph.** The result is the meta capture at full size, with its nodes, edges and
   fingerprint, carrying the scaled times; a small capture whose node names differ from the
   meta capture is an error that says so (it would mean the graph depends on the batch size).
6. **Fallback.** Python that reads values of tensors made from the inputs, buffers and constants
   (transformers' mask code: position ids, padding checks) runs on meta with those values beside
   the meta tensors (:mod:`autoremat.capture.shadow_values`; tried only after a first meta
   capture without them raised). Where the model still cannot run on meta tensors (data-dependent
   Python on activations such as ``if x.sum() > 0``, Mixtral's expert routing; a tensor attribute
   that is not a buffer) or autocast is active on a device whose autocast is not emulated (not
   CPU or CUDA; the log names the reason), the ladder is walked with real (recorded) captures
   from ``max(1, B // 8)`` upwards, doubling while the peak predicted from the captures so far
   fits, and bytes are fitted per node with the same ``a + b * B`` rule (clamped at zero). The
   log says so (``INFO``), and ``graph.meta["scaled"]["bytes_from"]`` is ``"linear fit"``
   instead of ``"meta"``. This path starts at 2 rows where the batch allows (models such as
   transformers' take other paths at batch 1, so the graph would differ). The whole batch is
   captured instead (a plain capture) only where the small captures predict it needs at most
   half the limit: that prediction misses workspace a small size hides (below), and the factor
   two keeps it from running an unpatched step above the limit. The fit is approximate where a
   small size hides a workspace (the recorder clamps a negative workspace at zero): a GPT-2
   measured -0.3 % (when it took this path), a toy MLP dominated by gradients and workspace -8.6 %. ``FakeTensorMode``
   was tried for transformers (it counts as tracing there): bytes matched, but transformers then
   takes another mask path whose glue ops differ, so the graph would not be the full-size
   capture's; the values beside meta tensors keep transformers on its eager path.
7. **Out of memory** (:mod:`.limits`). A ``torch.OutOfMemoryError`` (or the CPU allocator's)
   during any real capture is caught; capture has already restored RNG, buffers and gradients
   (parameters and optimizer state are never written by profiling; profiling steps start from no
   gradients and never accumulate into the user's), the CUDA cache is emptied, and the size is
   halved. When even one row does not fit (a batch of 1 whose unpatched step does not fit: the
   case planning is for), the graph is the full-size meta capture with node times from FLOPs and
   bytes moved (``times="flops"``), logged as a warning (``graph.meta["scaled"]["times_from"]``);
   only where there is no meta capture either, :class:`CaptureDoesNotFitError` names the smallest
   size tried and what to change.

When the whole step is predicted to fit, :func:`capture_within` is a plain capture (falling back
to the scaled path if it runs out of memory anyway). ``graph.meta["scaled"]`` records the batch,
the sizes run, where the bytes came from and which nodes were timed at the full batch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..._compiled import uncompiled
from ...graph import Graph
from ...measure import profiling_run
from .batch import batch_size_of
from .fit import fixed_grad_bytes, linear_peak, scale_to
from .ladder import ladder
from .limits import CaptureDoesNotFitError, free_cache, is_oom, profile_limit_bytes, resident_bytes_of
from .meta import meta_capture, on_meta, traced_on_meta

__all__ = ["capture_within", "CaptureDoesNotFitError", "profile_limit_bytes", "resident_bytes_of", "on_meta",
           "batch_size_of", "is_oom", "scale_to"]

logger = logging.getLogger(__name__)


@profiling_run
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
    blocks: str = "auto",
) -> Graph:
    """Profile one training step of ``model`` without running an unpatched step predicted to
    need more than ``limit_bytes`` (step peak: bytes above what is resident at step start).

    ``blocks``: as :func:`~autoremat.capture.capture`. ``limit_bytes=None`` is a plain
    :func:`~autoremat.capture.capture`. Otherwise the graph's
    bytes come from a meta-device capture at the full batch and its times from real captures at
    batch sizes that fit, scaled (module docstring). ``graph.meta["scaled"]`` records the sizes
    and sources; it is absent when the full step ran. On a CUDA device the host<->device link is
    measured too (once per process), for offload plans (:func:`autoremat.offload.bandwidth.record_link`).

    Raises:
        CaptureDoesNotFitError: even the smallest batch size tried ran out of memory, and the model
            cannot run on meta tensors (with a meta capture, its times come from FLOPs instead).
        ValueError: ``limit_bytes`` is negative, or the graph depends on the batch size.
    """
    from .. import _capture, capture, resolve_times
    from ...offload.bandwidth import record_link
    from ...resident import device_of

    times = resolve_times(times)
    model = uncompiled(model)
    if isinstance(args, torch.Tensor):
        args = (args,)
    args, kwargs = tuple(args), dict(kwargs or {})
    opts: dict[str, Any] = dict(loss_fn=loss_fn, mode=mode, repeats=repeats, warmup=warmup, times=times,
                                blocks=blocks)
    if limit_bytes is None or device_of(model, args, kwargs).type == "meta":
        return capture(model, args, kwargs, **opts)
    if isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int) or limit_bytes < 0:
        raise ValueError(f"limit_bytes={limit_bytes!r} must be an int >= 0 (bytes a profiling step may use "
                         "above what is resident), or None for a plain capture")
    batch = batch_size_of(args, kwargs, batch_dim)
    gm = traced_on_meta(model, mode)  # one trace for every step below
    if gm is None and mode == "auto":  # fx cannot trace it (logged): module level, without trying again
        opts["mode"] = "module"
    meta = meta_capture(model, args, kwargs, opts, gm)
    base, signatures = meta if meta is not None else (None, {})
    if base is not None and times == "flops":  # bytes exact at full size, times from FLOPs: no real step
        return record_link(base)
    predict = None
    if base is not None:
        from ...cost import unoptimised_peak_bytes

        full = unoptimised_peak_bytes(base)
        if full <= limit_bytes:
            try:
                return record_link(_capture(model, args, kwargs, **opts, traced=gm))
            except (RuntimeError, torch.OutOfMemoryError) as err:
                if not is_oom(err):
                    raise
                logger.info("autoremat: the full step (predicted %d bytes) ran out of memory; profiling at "
                            "smaller batch sizes", full)
            free_cache()
        predict = linear_peak(full, fixed_grad_bytes(base), batch)
    try:
        out = ladder(model, args, kwargs, opts, base, batch, batch_dim, limit_bytes, predict, gm, signatures)
    except CaptureDoesNotFitError as err:
        return record_link(_on_flop_times(model, args, kwargs, opts, base, gm, batch, limit_bytes, err))
    if out is None:  # one row fits, and takes another path than the full batch (ladder._to_scale, warned)
        return record_link(_on_flop_times(model, args, kwargs, opts, base, gm, batch, limit_bytes, None))
    return record_link(out)


def _on_flop_times(model: nn.Module, args: tuple, kwargs: dict, opts: dict, base: Graph | None,
                   gm: torch.fx.GraphModule | None, batch: int, limit_bytes: int,
                   err: CaptureDoesNotFitError | None) -> Graph:
    """No batch size runs within the limit (``err``), or only one row, whose graph is not the full
    batch's (``None``): the full-size meta capture with node times from FLOPs (module docstring, 7),
    or ``err`` where the model has no meta capture."""
    flops = meta_capture(model, args, kwargs, {**opts, "times": "flops"}, gm) if base is not None else None
    if flops is None and err is not None:
        raise err
    assert flops is not None, "please report"  # without err, ladder had the meta capture
    if err is not None:
        logger.warning("autoremat: no batch size runs within the %d-byte step limit for timing (a batch of %d of %d "
                       "does not fit); node times from FLOPs and bytes moved instead (times='flops'), bytes from the "
                       "full-size meta capture", limit_bytes, err.smallest_size, err.batch_size)
    flops[0].meta["scaled"] = {"batch_size": batch, "sizes": [] if err is not None else [1],
                               "smallest_tried": err.smallest_size if err is not None else 1,
                               "bytes_from": "meta", "limit_bytes": limit_bytes, "times_from": "flops"}
    return flops[0]
