"""Capture: turn a model and an example batch into a profiled :class:`~autoremat.graph.Graph`.

``mode="fx"`` traces with ``torch.fx`` (op level); ``mode="module"`` records submodule calls
(see :mod:`autoremat.capture.module`); ``mode="auto"`` tries fx and falls back to module level,
logging why. The model is left exactly as it was, whether capture succeeds or raises: RNG
state, buffers (batch-norm running statistics, counters a traced forward bumps, a ``grad_fn`` a
traced in-place update attaches), ``.grad`` (set to ``None`` while profiling, so nothing is
accumulated into it), ``requires_grad`` and ``training`` flags and the modules' own attributes are restored
(:func:`~autoremat.capture.preserved.preserved_state`). The graph's meta records the shapes and
dtypes of parameters and buffers (``tensors``) and of the example batch (``inputs``), see
:mod:`autoremat.capture.signature`.

Times (``times=``, default ``"measured"``, or the ``AUTOREMAT_TIMES`` environment variable):
``"measured"``: CUDA events on a GPU, ``perf_counter`` on the CPU (median of ``repeats`` steps
after ``warmup``; ``graph.meta["time_noise"]`` records how much of the medians is interference,
:func:`timing_noise`); ``"flops"``: deterministic, from ``torch.utils.flop_counter`` FLOPs and bytes
moved (see :func:`estimate_time`; no timing steps run), so that two captures give the same
graph and the same plan, e.g. for planning in CI. On the meta device nothing is allocated or run
for real and times are always FLOP-based. The backward time of a FLOP-timed node is taken as
twice its forward time.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import networkx as nx
import torch
from torch import nn

from .._compiled import uncompiled
from ..graph import Graph
from ..measure import default_loss, profiling_run
from ..resident import device_of, resident_bytes
from ._recorder import NodeRecord, Recorder, tensors_in
from .step_timer import paused_gc, timing_noise
from .shared_casts import autocast_caches
from .layer_drop import every_layer
from .preserved import preserved_state
from ..errors import ModelRecomputesError
from ._code_reads import traced_through
from .._module_hooks import global_hooks, has_hooks
from .fx import fx_fingerprint, profile_fx, records_from_fx, trace
from .blocks import BLOCK_MODES
from .meta_cache import MetaOpCache
from .module import module_fingerprint, profile_modules
from .kept_said import say_kept
from .param_writes import written_first
from .signature import input_signature, resized_signature, tensor_signature
from .sparse_grads import SparseGrads
from .scaled import CaptureDoesNotFitError, capture_within

__all__ = ["capture", "capture_within", "CaptureDoesNotFitError", "CAPTURE_MODES", "TIMES", "resolve_times",
           "timing_noise",
           "estimate_time", "DEFAULT_FLOPS_PER_S", "DEFAULT_BYTES_PER_S"]

logger = logging.getLogger(__name__)

CAPTURE_MODES = ("auto", "fx", "module")
TIMES = ("measured", "flops")
"""Where node times come from: timing steps, or FLOPs and bytes moved (deterministic)."""


def resolve_times(times: str | None) -> str:
    """``times``, or ``AUTOREMAT_TIMES`` when it is ``None``, or ``"measured"``; checked."""
    import os

    source = "times"
    if times is None:
        times, source = os.environ.get("AUTOREMAT_TIMES", "measured"), "AUTOREMAT_TIMES"
    if not isinstance(times, str) or times.strip().lower() not in TIMES:
        raise ValueError(f"{source}={times!r} is not a time source; expected 'measured' (timing steps) or 'flops' "
                         "(deterministic, from FLOPs and bytes moved)")
    return times.strip().lower()
DEFAULT_FLOPS_PER_S = 100e12
"""Sustained FLOP rate assumed for meta-device times (an H100-class GPU at bf16, derated)."""
DEFAULT_BYTES_PER_S = 2e12
"""Memory bandwidth assumed for meta-device times of memory-bound ops."""


def estimate_time(flops: float, bytes_moved: float) -> float:
    """Roofline time of one op: the larger of compute time and memory time."""
    return max(flops / DEFAULT_FLOPS_PER_S, bytes_moved / DEFAULT_BYTES_PER_S)


def _validate(model: Any, args: Any, kwargs: Any, mode: str, loss_fn: Any) -> tuple[tuple, dict]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if mode not in CAPTURE_MODES:
        raise ValueError(f"mode={mode!r} is not a capture mode; expected one of {CAPTURE_MODES}")
    if isinstance(args, torch.Tensor):
        args = (args,)
    if isinstance(args, Mapping) and not kwargs:  # a Hugging Face batch (BatchEncoding, a dict)
        raise TypeError(f"args must be a tuple of positional inputs (e.g. (x,)), got {type(args).__name__}, a mapping: "
                        "for a model called as model(**batch), pass capture(model, (), batch)")
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple of positional inputs (e.g. (x,)), got {type(args).__name__}")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, Mapping):
        raise TypeError(f"kwargs must be a dict of keyword inputs, got {type(kwargs).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable (outputs -> scalar tensor), got {type(loss_fn).__name__}")
    if not tensors_in((tuple(args), dict(kwargs))):
        raise TypeError("args/kwargs hold no tensor: pass an example batch, e.g. capture(model, (x,))")
    checkpointing = next((n for n, m in model.named_modules() if getattr(m, "gradient_checkpointing", False) is True
                          and hasattr(m, "_gradient_checkpointing_func")), None)
    if checkpointing is not None:
        raise ModelRecomputesError(
            f"{type(model).__name__} has Hugging Face gradient checkpointing enabled ({checkpointing or 'the model'}): "
            "autoremat chooses what to recompute itself, and a capture of a step that already recomputes cannot be "
            "planned. Call model.gradient_checkpointing_disable() before profiling (AutoRemat's plan replaces it)")
    lazy = [n for n, t in (*model.named_parameters(), *model.named_buffers())
            if isinstance(t, nn.parameter.UninitializedTensorMixin)]
    if lazy:
        raise ValueError(
            f"{type(model).__name__} has {len(lazy)} uninitialized lazy parameters or buffers ({', '.join(lazy[:3])}"
            f"{', ...' if len(lazy) > 3 else ''}): their shapes, so the step's memory, are unknown until the first "
            "forward. Run the model once on a batch (model(batch)) before capturing it, as PyTorch asks before "
            "creating an optimizer")
    return tuple(args), dict(kwargs)


@profiling_run
def capture(
    model: nn.Module,
    args: Sequence[Any] | torch.Tensor,
    kwargs: Mapping[str, Any] | None = None,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    mode: str = "auto",
    repeats: int = 3,
    warmup: int = 1,
    times: str | None = None,
    blocks: str = "auto",
) -> Graph:
    """Profile one training step of ``model`` on the example batch and return its graph.

    ``times``: ``"measured"`` or ``"flops"`` (module docstring; ``None``: ``AUTOREMAT_TIMES``,
    else measured). ``loss_fn`` maps the model's output to the scalar to backpropagate; the default
    (:func:`autoremat.measure.default_loss`) is the output's own ``loss`` where it carries one (a
    ``transformers`` model given ``labels``), else the sum of the means of every floating-point output.
    ``blocks`` (module level): ``"module"`` makes each repeated block one node, ``"ops"``
    captures the blocks op by op so that plans can recompute parts of a layer and keep op
    outputs inside it (:mod:`autoremat.capture.blocks`); ``"auto"`` (the default) is ``"ops"``.
    For a step that may not fit the device, see :func:`autoremat.capture.scaled.capture_within`.
    On a CUDA device the host<->device link is measured too (once per process), for offload
    plans: ``graph.meta["bandwidth_bytes_per_s"]`` (:func:`autoremat.offload.bandwidth.record_link`).
    """
    from ..offload.bandwidth import record_link

    return record_link(_capture(model, args, kwargs, loss_fn=loss_fn, mode=mode, repeats=repeats, warmup=warmup,
                                times=times, blocks=blocks))


def _capture(
    model: nn.Module,
    args: Sequence[Any] | torch.Tensor,
    kwargs: Mapping[str, Any] | None,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None,
    mode: str,
    repeats: int,
    warmup: int,
    flop_times: bool = True,
    times: str | None = None,
    blocks: str = "auto",
    traced: Any = None,
    watch: Any = None,
    shadows: Any = None,
) -> Graph:
    """:func:`capture`; ``flop_times=False``: no FLOPs counted on meta (times 0, the caller's);
    ``traced``: ``model`` already traced (:func:`_traced_or_none`); ``watch``: sees each node of an
    fx capture's recorded step (:data:`.fx.Watch`); ``shadows``: a meta capture's
    :class:`~.shadow_values.ShadowValues`, entered below the recorder, above the meta-op cache."""
    model = uncompiled(model)  # a torch.compile wrapper: the module it holds (see autoremat._compiled)
    args, kwargs = _validate(model, args, kwargs, mode, loss_fn)
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats}, {warmup}")
    if blocks not in BLOCK_MODES:
        raise ValueError(f"blocks={blocks!r} is not accepted; expected one of {BLOCK_MODES} ('ops': repeated "
                         "blocks captured op by op at module level)")
    blocks = "ops" if blocks == "auto" else blocks
    loss = loss_fn or default_loss
    device = device_of(model, args, kwargs)
    is_meta = device.type == "meta"
    param_names: dict[int, str] = {}
    param_bytes: dict[str, int] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            param_names[id(p)] = name
            param_bytes[name] = p.numel() * p.element_size()
    resident = [p for p in model.parameters()] + [b for b in model.buffers()]
    resident += tensors_in((args, kwargs))
    input_bytes = sum(t.untyped_storage().nbytes() for t in tensors_in((args, kwargs)))
    count_flops = (is_meta and flop_times) or (not is_meta and resolve_times(times) == "flops")
    time_fn = _flop_times(model, args, kwargs) if count_flops else _zero_times if is_meta else None

    # on meta: repeated ops answered from a cache of output metadata (meta_cache; same graph); the cyclic
    # collector paused (a fifth of a 64-layer GPT-2's meta capture; on a real device it frees memory)
    with paused_gc() if is_meta else contextlib.nullcontext(), \
            MetaOpCache() if is_meta else contextlib.nullcontext() as cache, \
            shadows if shadows is not None else contextlib.nullcontext(), SparseGrads(model, param_bytes) as sparse:
        rec, gm, fingerprint, tensors, cmode = _trace_and_profile(
            model, args, kwargs, mode, blocks, loss, resident, param_names, param_bytes, device,
            dict(repeats=repeats, warmup=warmup, time_fn=time_fn, count_flops=count_flops), traced, watch)
    if cache is not None:
        logger.debug("autoremat: meta capture: %d ops answered from the cache (%d by layout rules), %d run",
                     cache.hits, cache.rules.used, cache.misses)
    time_source = ("flops" if count_flops else "none" if is_meta
                   else "cuda-events" if device.type == "cuda" else "perf_counter")
    meta = {
        "mode": cmode,
        "fingerprint": fingerprint,
        "tensors": tensors,
        "inputs": input_signature(args, kwargs),
        "model": type(model).__name__,
        "device": str(device),
        "time_source": time_source,
        "param_bytes": param_bytes,
        "sparse_grad_params": sparse.names,  # autoremat.capture.sparse_grads
        "resident_bytes": resident_bytes(model, inputs=(args, kwargs)),
        "input_bytes": int(input_bytes),
        "loss_saves": sorted(rec.loss_saves),
        **{key: int(getattr(rec, key)) for key in ("loss_extra_bytes", "loss_fwd_temp_bytes", "loss_bwd_temp_bytes",
                                                    "loss_held_bytes")},
        # issue 26 (autoremat.capture.inplace): in-place ops run out of place; nodes pinned by one
        "out_of_place": list(gm.meta.get("autoremat_out_of_place", ())) if gm is not None else [],
        **_kept_calls(rec),
    }
    return _to_graph(rec, {**meta, **_recorded_meta(rec)})


def _recorded_meta(rec: Any) -> dict[str, Any]:
    """The graph facts only some captures record."""
    meta: dict[str, Any] = {}
    if getattr(rec, "dead_released_after", None):  # autoremat.capture.dead_nodes.release_points
        meta["dead_released_after"] = sorted([v, at] for v, at in rec.dead_released_after.items())
    if rec.time_noise is not None:  # measured times: how much of them is interference (solvers.stable)
        meta["time_noise"] = round(float(rec.time_noise), 6)
    if getattr(rec, "call_op_start", None) is not None:  # blocks captured op by op
        meta.update(blocks="ops", call_op_start=dict(rec.call_op_start), pinned_regions=list(rec.pinned_regions))
    return meta


def _empty_cast_cache() -> None:
    """Under autocast every capture profiles a step's first forward, with autocast's cast cache
    empty: a cache warmed by an earlier capture in the same autocast region (the sizes of a scaled
    capture, a warm-up) would leave the parameter casts out of this step's graph (a module-level
    GPT-2 under bf16: 340 nodes against 372 cold). Clearing drops copies only (values unchanged)."""
    if autocast_caches():
        torch.clear_autocast_cache()


def _kept_calls(rec: Recorder) -> dict[str, dict[str, Any]]:
    """What capture keeps from recomputation, and why, for the graph's meta: nodes whose input is
    written in place (:mod:`.inplace`), calls handed a key/value cache (:mod:`.kv_cache`, said once
    here), nodes sharing an autocast cast (:mod:`.shared_casts`), calls changing a container in place
    (:mod:`.container_writes`) and modules run more than once in the step."""
    calls = dict(getattr(rec, "cache_calls", {}))
    if calls:
        say_kept("autoremat: %d module call(s) write a key/value cache (%s: %s) and are kept, not recomputed (a "
                 "replay would write the cache twice); pass use_cache=False to the model, as "
                 "gradient_checkpointing_enable() does, if the training step does not use the returned cache",
                 len(calls), *next(iter(calls.items())))
    replayed = {path: n for path, n in rec.replayed.items() if n}
    if replayed:
        logger.warning("autoremat: the model recomputes %d module call(s) itself during backward (%s, a "
                       "torch.utils.checkpoint in its forward): the captured step counts that recomputation and a "
                       "plan cannot split what the model's own checkpoint holds; remove the checkpoint calls to let "
                       "autoremat choose (its plan replaces them)", sum(replayed.values()), next(iter(replayed)))
    return {"pinned_by_mutation": dict(rec.pinned), "pinned_by_cache": calls, "pinned_by_shared_cast": rec.cast_pins,
            "pinned_by_container_write": {**rec.write_pins, **rec.pinned_regions_by_write},
            "pinned_by_host_rng": {**rec.rng_pins, **rec.pinned_regions_by_rng},
            "reused_modules": dict(getattr(rec, "reused", {})), "recomputed_by_model": replayed}


def _trace_and_profile(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], mode: str, blocks: str,
                       loss: Callable[[Any], torch.Tensor], resident: list[torch.Tensor],
                       param_names: dict[int, str], param_bytes: dict[str, int], device: torch.device,
                       profile: dict[str, Any], traced: Any = None,
                       watch: Any = None) -> tuple[Recorder, Any, str, Any, str]:
    """Trace ``model`` with fx (``mode`` "auto"/"fx"; "auto" falls back to module level with an
    info line; ``traced``: the trace made already) and profile the step: ``(recorder,
    GraphModule or None, fingerprint, tensor signature, capture mode)``. ``profile``: the keyword
    arguments of the profiler."""
    gm = traced
    _empty_cast_cache()
    # tracing runs the Python of forward on real attributes (a counter ``self.n += 1`` moves): it
    # is inside the preserved state too, so a failed capture leaves the model as it was
    with preserved_state(model, [device]):
        if gm is None and mode in ("auto", "fx"):
            gm = _traced_in_state(model, mode)
        if gm is not None:
            before = tensor_signature(gm)
            rec = profile_fx(gm, records_from_fx(gm, param_names), args, kwargs, loss, resident, param_bytes,
                             device=device, watch=watch, **profile)
            sig = resized_signature(before, tensor_signature(gm))  # buffers the forward resizes (signature)
            return rec, gm, fx_fingerprint(gm, tensors=sig), sig, "fx"
        before = tensor_signature(model)
        with every_layer(model):  # LayerDrop: the step in which every layer runs (.layer_drop)
            _first_call(model, args, kwargs, device)
            rec = profile_modules(model, args, kwargs, loss, resident, param_names, param_bytes, device=device,
                                  blocks=blocks, **profile)
        sig = resized_signature(before, tensor_signature(model))
        return rec, None, module_fingerprint(model, blocks, tensors=sig), sig, "module"


def _first_call(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], device: torch.device) -> None:
    """One forward without gradients before a module-level capture records its step, its effects on
    the model undone (:func:`preserved_state`): what a model does on its first call only is then not
    recorded as what every call does. Measured: the Hugging Face BEiT builds its relative position
    index in an ``lru_cache``'d method on the first call; recorded in the first layer's op sequence,
    a selective plan for that layer failed at its first step (the layer no longer ran those ops)."""
    if device.type == "meta":  # a meta capture follows real ones (which warmed the caches) and replays their
        return                 # data-dependent values in order (.shadow_values): a forward more would shift them
    with preserved_state(model, [device]), torch.no_grad(), \
            written_first([*model.parameters(), *tensors_in((args, kwargs))]):
        model(*args, **kwargs)
    _empty_cast_cache()


def _traced_in_state(model: nn.Module, mode: str) -> Any:
    """``trace(model)``, or ``None`` (logged) where fx cannot trace it, or where a module the
    trace runs through has hooks (:func:`_hooked_through`), and ``mode`` is "auto"."""
    try:
        gm = trace(model)
        hooked = _hooked_through(model, gm)
        if hooked:
            raise ValueError(f"hooks on {hooked}, a module whose code the trace runs through: the fx-level "
                             "forward calls only the trace's leaves, so it would not run them and the patched "
                             "model would run without the plan")
        packed = _layers_in_a_leaf(gm)
        if packed and mode == "auto":
            logger.info("torch.fx calls %s as one leaf; capturing at module level so that plans can recompute "
                        "its layers one by one", packed)
            return None
        if packed:
            logger.warning("torch.fx calls %s as one leaf: plans can recompute all of it or none; "
                           "mode='module' (or 'auto') captures its layers one by one", packed)
        return gm
    except Exception as exc:  # fx raises many types (TraceError, TypeError, NotImplementedError…)
        if mode == "fx":
            raise ValueError(f"torch.fx cannot trace {type(model).__name__}: {exc}. "
                             "Use mode='module' to capture at module level.") from exc
        logger.info("torch.fx cannot trace %s (%s: %s); capturing at module level",
                    type(model).__name__, type(exc).__name__, str(exc).splitlines()[0][:200])
        return None


def _layers_in_a_leaf(gm: Any) -> str | None:
    """The first fx leaf (its path and class, quoted) that holds a list of layers with parameters
    (``nn.TransformerEncoder``, ``nn.TransformerDecoder``, ``nn.Transformer``: torch.nn modules,
    which fx does not trace into, and whose code fx could not trace), else ``None``."""
    for n in gm.graph.nodes:
        if n.op != "call_module":
            continue
        leaf = gm.get_submodule(str(n.target))
        for m in leaf.modules():
            if isinstance(m, nn.ModuleList) and sum(any(True for _ in c.parameters()) for c in m) >= 2:
                return f"{n.target!r} ({type(leaf).__name__}, {len(m)} layers)"
    return None


def _hooked_through(model: nn.Module, gm: Any) -> str | None:
    """The first module (its path, quoted) other than ``model`` whose code ``gm`` runs through
    and that has module hooks, or "global module hooks" where any is registered; else ``None``.
    Those are the hooks the fx-level forward's guard (:mod:`autoremat.runtime.guard`) finds and
    falls back to the model's own forward for; leaves run their hooks in their ``__call__``."""
    if global_hooks():
        return "global module hooks (torch.nn.modules.module.register_module_*_hook)"
    through = {id(m) for m in traced_through(model, gm)}
    for path, m in model.named_modules():
        if m is not model and id(m) in through and has_hooks(m):
            return f"module {path!r}"
    return None


def _traced_or_none(model: nn.Module, mode: str, device: torch.device) -> Any:
    """The fx trace a capture with ``mode`` would profile (``None`` at module level: ``mode``
    "module", or "auto" where fx cannot trace, logged), made with the model's state preserved;
    pass it to several captures of the same model (:mod:`autoremat.capture.scaled`) to trace once."""
    if mode not in ("auto", "fx"):
        return None
    with preserved_state(model, [device]):
        return _traced_in_state(model, mode)


def _to_graph(rec: Recorder, meta: dict[str, Any]) -> Graph:
    g = nx.DiGraph()
    for v, r in enumerate(rec.nodes):
        g.add_node(v, name=r.name, kind=r.kind, target=r.target, module_path=r.module_path,
                   time_s=float(r.time_s), bwd_time_s=float(r.bwd_time_s), out_bytes=int(r.out_bytes),
                   alloc_bytes=int(r.alloc_bytes), alias_of=r.alias_of, saves=tuple(sorted(r.saves)),
                   unreached_saves=tuple(sorted(r.unreached_saves)),
                   extra_saved_bytes=int(r.extra_saved_bytes), fwd_temp_bytes=int(r.fwd_temp_bytes),
                   lingering=tuple(r.lingering), grad_new=tuple(r.grad_new), grad_part=tuple(r.grad_part),
                   bwd_temp_bytes=int(r.bwd_temp_bytes), params=tuple(r.params),
                   param_grad_bytes=int(sum(meta["param_bytes"].get(p, 0) for p in r.params)),
                   requires_grad=bool(r.requires_grad), grad_passthrough=bool(r.grad_passthrough),
                   first_grad_view=bool(r.first_grad_view), is_output=bool(r.is_output), grad_seed_bytes=r.grad_seed_bytes,
                   held_by_output=bool(r.held_by_output),
                   recomputable=bool(r.recomputable), scope=tuple(r.scope), op_index=int(r.op_index),
                   random=bool(r.random))
        for u in r.preds:
            g.add_edge(u, v)
    return Graph(g, meta)


def _zero_times(recs: list[NodeRecord]) -> None:
    """Meta-device capture without FLOP counting: times stay 0 (the caller supplies them)."""


def _flop_times(model: nn.Module, args: tuple, kwargs: dict) -> Callable[[list[NodeRecord]], None]:
    """Meta-device times from the FLOPs the recorder counted per node, plus bytes moved."""

    def apply(recs: list[NodeRecord]) -> None:
        for r in recs:
            moved = r.out_bytes + sum(recs[u].out_bytes for u in r.preds)
            r.time_s = estimate_time(r.flops, moved)
            r.bwd_time_s = 2.0 * r.time_s

    return apply
