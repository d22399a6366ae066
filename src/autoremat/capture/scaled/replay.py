"""Times of the nodes whose kernel the backend picks per shape, measured at the full batch.

Why. ``a + b * batch`` fitted from two small sizes cannot see a kernel change between the sizes
measured and the full batch, and convolution and matrix-multiply backends choose kernels per
shape (cuDNN / cuBLAS heuristics on a GPU, oneDNN or PyTorch's own kernels on a CPU). Measured
on the CPU zoo (``benchmarks/scaled_capture.py``): single-threaded PyTorch runs a 1x1, stride-1
convolution with its native kernel below batch 16 and with oneDNN from 16 on, 5-10x slower at
these channel counts (~12 us at batch 8-15, ~110 us at 16 for 4 channels at 16x16), so ResNet-50
fitted from batches 4 and 8 to 16 had its 1x1 convolutions (43 % of the step) 61 % off, median.
Other ops (elementwise, normalisation, pooling, views) are linear in the batch and stay fitted:
timed alone, cheap ops lose what they cost inside the step (fresh allocations, dispatch), and
their in-step times at two sizes fit well.

How (fx captures only; module-level nodes are whole blocks and stay fitted):

1. The full-size shapes of every replayed node's (kinds :data:`REPLAYED_KINDS`) tensor
   arguments and its integer arguments: read exactly while the meta capture's recorded step runs
   at the full batch (:class:`ArgumentSignatures`; this costs nothing extra, where a forward of
   its own cost about as much as a real one), or, where there is no meta capture (the fallback),
   recorded by a forward at ``s_a`` rows (each output detached: nothing is kept for a backward)
   and extrapolated linearly with step 2's sizes.
2. A forward at ``s_b`` rows stops at each replayed node: each argument is tiled to its
   full-size shape (its values repeated, its stride order kept), and the node
   runs alone at full size, ``warmup + repeats`` times: forward, then backward
   (``torch.autograd.grad`` of its outputs with respect to the arguments that require grad in the
   step and its parameters, nothing accumulated), timed from the moment its output's gradient
   arrives, as the step's timer does. Medians are kept. Nodes that run the same op (module type,
   configuration and parameter shapes, or function) on arguments of the same full-size shapes,
   dtypes and layouts run the same kernels: they are timed once (ResNet-152: 156 convolution and
   linear nodes, 24 distinct; DenseNet-121: 121, 67 distinct).
3. Workspace (CUDA): the caching allocator's peak while the node runs alone, above its outputs
   (forward) or the gradients it returns (backward), is the node's workspace at the full batch
   (cuDNN and cuBLAS pick their workspace per shape; the meta capture sees none, and a small run
   a fraction of it). The largest over the repeats raises the graph's ``fwd_temp_bytes`` /
   ``bwd_temp_bytes`` where it is larger (found on an H200: ResNet-50 at batch 1024 profiled at
   smaller sizes, a plan's measured step ran ~10 % above its prediction and out of memory).
4. Memory: a node is replayed only when its full-size arguments, outputs, gradients, saved
   tensors and workspace (bytes from the full-size graph) plus the live values of the
   forward at ``s_b`` stay under the limit; an out-of-memory error or any other
   error skips the node (its fitted time stays), and the summary is logged.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx
from torch.utils._pytree import tree_flatten, tree_unflatten

from ...graph import Graph
from .._recorder import tensors_in
from ..step_timer import Clock, paused_gc
from ..preserved import preserved_state
from ..allocator_meter import AllocatorMeter
from ..fx import _run_kwargs, fx_ops
from .limits import free_cache, is_oom

__all__ = ["REPLAYED_KINDS", "replay_times", "ArgumentSignatures", "forward_live_bytes"]

logger = logging.getLogger(__name__)

REPLAYED_KINDS = frozenset({"conv", "linear", "matmul"})
"""Node kinds timed at the full batch: those whose kernels backends choose per shape."""



class _TooLarge(Exception):
    """A node's full-size replay is predicted above the room the limit leaves."""


def forward_live_bytes(g: Graph) -> int:
    """Peak bytes of a forward without gradients: each output lives until its last consumer ran
    (outputs of the model until the end), plus the running node's workspace."""
    last = {v: max(g.succ(v), default=len(g) if g.node(v)["is_output"] else v) for v in g.nodes}
    dies: dict[int, list[int]] = {}
    for v, w in last.items():
        dies.setdefault(w, []).append(v)
    live = peak = 0
    for v in g.nodes:
        d = g.node(v)
        own = d["alloc_bytes"] if d["alias_of"] is None else 0
        live += own
        peak = max(peak, live + d["fwd_temp_bytes"])
        for u in dies.get(v, ()):
            if g.node(u)["alias_of"] is None:
                live -= g.node(u)["alloc_bytes"]
    return int(peak)


def _extrapolate(d_a: int, d_b: int, s_a: int, s_b: int, batch: int) -> int | None:
    if d_a == d_b:
        return d_b
    num = (d_b - d_a) * (batch - s_b)
    if num % (s_b - s_a):
        return None
    d = d_b + num // (s_b - s_a)
    return d if d > 0 else None


def _tile(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``t``'s values repeated to ``shape``, in a dense tensor with ``t``'s order of strides."""
    if tuple(t.shape) == shape:
        return t
    reps = [math.ceil(f / d) for f, d in zip(shape, t.shape)]
    big = t.detach().repeat(reps)
    for dim, f in enumerate(shape):
        if big.shape[dim] != f:
            big = big.narrow(dim, 0, f)
    order = sorted(range(t.dim()), key=lambda i: -t.stride(i))
    out = torch.empty_permuted(shape, order, dtype=t.dtype, device=t.device)
    out.copy_(big)
    return out


def _signature(value: Any) -> list[Any]:
    return [tuple(x.shape) if isinstance(x, torch.Tensor)
            else x if isinstance(x, int) and not isinstance(x, bool) else None
            for x in tree_flatten(value)[0]]


def _map(fn: Callable[[Any], Any], tree: Any) -> Any:
    flat, spec = tree_flatten(tree)
    return tree_unflatten([fn(x) for x in flat], spec)


def _detached_run(interp: torch.fx.Interpreter, n: torch.fx.Node) -> Any:
    """``n`` run with gradients on, as in the step (backends keep other kernels for inference:
    oneDNN built new primitives for every convolution of a no-grad forward, ~1 ms each), its
    outputs detached at once so that nothing is saved for a backward."""
    out = torch.fx.Interpreter.run_node(interp, n)
    if n.op not in ("call_module", "call_function", "call_method"):
        return out
    return _map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out)


class _Shapes(torch.fx.Interpreter):
    """Step 1: the argument signatures of the replayed nodes (at ``s_a`` rows, or on the meta
    device at the full batch)."""

    def __init__(self, gm: torch.fx.GraphModule, replayed: set[str]) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.replayed = replayed
        self.signatures: dict[str, dict[str, list[Any]]] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        if n.name in self.replayed:
            self.signatures[n.name] = {u.name: _signature(self.env[u]) for u in n.all_input_nodes}
        return _detached_run(self, n)


def _storage_total(tensors: Sequence[Any]) -> int:
    seen = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors if isinstance(t, torch.Tensor)}
    return int(sum(seen.values()))


def _time_node(fn: Callable[..., Any], args: tuple, kwargs: dict, grad_ids: set[int], params: list[torch.Tensor],
               clock: Clock, repeats: int, warmup: int,
               meter: AllocatorMeter | None = None) -> tuple[float, float, int, int]:
    """Median forward and backward seconds of ``fn`` alone (module docstring, step 2), and the
    largest forward and backward workspace ``meter`` saw (step 3; 0 without a meter)."""
    fwd: list[float] = []
    bwd: list[float] = []
    ws_f = ws_b = 0
    grads: list[torch.Tensor] | None = None
    for i in range(warmup + repeats):
        wrt: list[torch.Tensor] = []

        def leaf(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and id(x) in grad_ids:
                x = x.detach().requires_grad_()
                wrt.append(x)
            return x

        a, k = _map(leaf, (args, kwargs))
        if meter is not None:
            meter.start()
        t0 = clock.now()
        out = fn(*a, **k)
        t1 = clock.now()
        if meter is not None:
            kept = _storage_total(tensors_in(out))
            ws_f = max(ws_f, meter.peak_delta(kept) - kept)
        outs = [t for t in tensors_in(out) if t.requires_grad]
        took = 0.0
        if outs and (wrt or params):
            if grads is None:
                grads = [torch.ones_like(t) for t in outs]
            mark: list[Any] = []
            outs[0].register_hook(lambda _g: mark.append(clock.now()))
            if meter is not None:
                meter.start()
            got = torch.autograd.grad(outs, [*wrt, *params], grads, allow_unused=True)
            t3 = clock.now()
            took = clock.seconds(mark[0] if mark else t1, t3)
            if meter is not None:
                kept = _storage_total(got)
                ws_b = max(ws_b, meter.peak_delta(kept) - kept)
            del got
        del out, outs, a, k, wrt
        if i >= warmup:
            fwd.append(clock.seconds(t0, t1))
            bwd.append(took)
    return statistics.median(fwd), statistics.median(bwd), max(0, ws_f), max(0, ws_b)


def _meter(device: torch.device) -> AllocatorMeter | None:
    """The allocator meter for step 3 (CUDA only: other devices' workspace is a storage the
    meta capture already counts)."""
    return AllocatorMeter(device) if device.type == "cuda" else None


class _Replay(torch.fx.Interpreter):
    """Step 2: the forward at ``s_b`` rows, each replayed node also run alone at full size."""

    def __init__(self, gm: torch.fx.GraphModule, base: Graph, signatures: Mapping[str, Mapping[str, list[Any]]],
                 sizes: tuple[int, int, int], room_bytes: int, repeats: int, warmup: int,
                 device: torch.device, exact: bool = False) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.exact = exact
        """Whether ``signatures`` are the full batch's (else at ``sizes[0]``, extrapolated)."""
        self.ids = {n: i for i, n in enumerate(fx_ops(gm))}
        self.base, self.signatures, self.sizes, self.room = base, signatures, sizes, room_bytes
        self.repeats, self.warmup, self.clock = repeats, warmup, Clock(device)
        self.meter = _meter(device)
        self.times: dict[int, tuple[float, float]] = {}
        self.workspace: dict[int, tuple[int, int]] = {}
        self.skipped: dict[str, str] = {}
        self.measured: dict[tuple, tuple[float, float, int, int]] = {}
        """Times by op and full-size arguments: identical layers (a ResNet stage's blocks) are timed once."""

    def run_node(self, n: torch.fx.Node) -> Any:
        if n.name in self.signatures:
            try:
                fwd, bwd, ws_f, ws_b = self._replay(n)
                self.times[self.ids[n]] = (fwd, bwd)
                if self.meter is not None:
                    self.workspace[self.ids[n]] = (ws_f, ws_b)
            except Exception as exc:  # any failure leaves the node's fitted time; reported below
                self.skipped[n.name] = "out of memory" if is_oom(exc) else f"{type(exc).__name__}: {exc}"[:160]
                if is_oom(exc):
                    free_cache()
        return _detached_run(self, n)

    def _planned(self, n: torch.fx.Node) -> tuple[Any, tuple]:
        """The node's arguments with every tensor a :class:`_Pending` (its value at ``s_b``, its
        full-size shape, whether the step takes its gradient), and a key of the op and its
        full-size arguments."""
        s_a, s_b, batch = self.sizes

        def full_value(u: torch.fx.Node) -> Any:
            flat, spec = tree_flatten(self.env[u])
            before = self.signatures[n.name][u.name]
            if len(before) != len(flat):
                raise ValueError(f"{u.name} changed structure between batch sizes")
            v = self.ids.get(u)
            out: list[Any] = []
            for x, x_a in zip(flat, before):
                if isinstance(x, torch.Tensor):
                    shape = tuple(x_a) if self.exact else \
                        tuple(_extrapolate(a, b, s_a, s_b, batch) for a, b in zip(x_a, x.shape))
                    if len(shape) != x.dim() or None in shape:
                        raise ValueError(f"no full-size shape for {u.name}: {tuple(x_a)} at {s_a}, "
                                         f"{tuple(x.shape)} at {s_b}")
                    wants = self.base.node(v)["requires_grad"] if v is not None else x.requires_grad
                    out.append(_Pending(x, shape, bool(wants) and x.is_floating_point()))  # type: ignore[arg-type]
                elif isinstance(x, int) and not isinstance(x, bool) and x_a is not None:
                    full = x_a if self.exact else _extrapolate(x_a, x, s_a, s_b, batch)
                    if full is None:
                        raise ValueError(f"no full-size value for {u.name}")
                    out.append(full)
                else:
                    out.append(x)
            return tree_unflatten(out, spec)

        planned = torch.fx.node.map_arg((n.args, n.kwargs), full_value)
        if n.op == "call_module":
            mod = self.fetch_attr(str(n.target))
            op: Any = (type(mod), mod.extra_repr(), mod.training,
                       tuple((tuple(p.shape), p.dtype, p.requires_grad) for p in mod.parameters()))
        else:
            op = (n.op, n.target)
        leaves = tuple(x.key() if isinstance(x, _Pending) else (type(x).__name__, repr(x))
                       for x in tree_flatten(planned)[0])
        return planned, (op, tree_flatten(planned)[1], leaves)

    def _replay(self, n: torch.fx.Node) -> tuple[float, float, int, int]:
        d = self.base.node(self.ids[n])
        own = 2 * d["out_bytes"] + d["extra_saved_bytes"] + d["fwd_temp_bytes"] + d["bwd_temp_bytes"] \
            + d["param_grad_bytes"]
        if own > self.room:  # known before tiling anything
            raise _TooLarge(f"{own} bytes of its own, {self.room} bytes of room")
        planned, key = self._planned(n)
        if key in self.measured:  # the same op on the same shapes was timed already: the same kernels
            return self.measured[key]
        flat, spec = tree_flatten(planned)
        nbytes = sum(x.nbytes() for x in flat if isinstance(x, _Pending))
        if own + 2 * nbytes > self.room:
            raise _TooLarge(f"{own + 2 * nbytes} bytes with its arguments, {self.room} bytes of room")
        values = [_tile(x.value, x.shape) if isinstance(x, _Pending) else x for x in flat]
        grad_ids = {id(t) for t, x in zip(values, flat) if isinstance(x, _Pending) and x.wants_grad}
        args, kwargs = tree_unflatten(values, spec)
        params: list[torch.Tensor] = []
        if n.op == "call_module":
            fn: Callable[..., Any] = self.fetch_attr(str(n.target))
            params = [p for p in fn.parameters() if p.requires_grad]  # type: ignore[union-attr]
        elif n.op == "call_method":
            obj, *rest = args
            fn, args = getattr(obj, str(n.target)), tuple(rest)
        else:
            fn = n.target  # type: ignore[assignment]
        self.measured[key] = _time_node(fn, tuple(args), dict(kwargs), grad_ids, params, self.clock, self.repeats,
                                        self.warmup, self.meter)
        return self.measured[key]


class _Pending:
    """A replayed node's tensor argument: its value at ``s_b`` rows and its full-size shape."""

    def __init__(self, value: torch.Tensor, shape: tuple[int, ...], wants_grad: bool) -> None:
        self.value, self.shape, self.wants_grad = value, shape, wants_grad

    def nbytes(self) -> int:
        return math.prod(self.shape) * self.value.element_size()

    def key(self) -> tuple:
        order = tuple(sorted(range(self.value.dim()), key=lambda i: -self.value.stride(i)))
        return ("tensor", self.shape, self.value.dtype, order, self.wants_grad)


def _replayed_names(base: Graph) -> set[str]:
    return {base.node(v)["name"] for v in base.nodes if base.node(v)["kind"] in REPLAYED_KINDS}


class ArgumentSignatures:
    """Step 1 while a capture of ``gm`` at the full batch runs (its ``watch``, on the meta device:
    :func:`~autoremat.capture.scaled.meta.meta_capture`): ``signatures`` are the exact full-size
    argument signatures of the nodes of the replayed kinds, for :func:`replay_times`."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        from ..fx import _kind

        self.replayed = {n for n in fx_ops(gm) if _kind(gm, n) in REPLAYED_KINDS}
        self.signatures: dict[str, dict[str, list[Any]]] = {}

    def __call__(self, interp: torch.fx.Interpreter, n: torch.fx.Node) -> None:
        if n in self.replayed:
            self.signatures[n.name] = {u.name: _signature(interp.env[u]) for u in n.all_input_nodes}


def replay_times(gm: torch.fx.GraphModule, model: torch.nn.Module, base: Graph, at_a: tuple[tuple, dict] | None,
                 at_b: tuple[tuple, dict], sizes: tuple[int, int, int], *, limit_bytes: int, repeats: int,
                 warmup: int, device: torch.device, workspace: dict[int, tuple[int, int]] | None = None,
                 full_signatures: Mapping[str, Mapping[str, list[Any]]] | None = None,
                 ) -> dict[int, tuple[float, float]]:
    """Full-batch ``(forward, backward)`` seconds of the replayed nodes of ``base`` (module
    docstring). ``at_a`` and ``at_b`` are the inputs cut to ``sizes[0]`` and ``sizes[1]`` rows,
    ``sizes[2]`` the full batch; ``gm`` is ``model`` traced (``base``'s fingerprint). With
    ``full_signatures`` (:class:`ArgumentSignatures`) the full-size shapes are those, exact, and
    no forward at ``sizes[0]`` runs (``at_a`` may be ``None``). On CUDA, ``workspace`` (when
    given) receives each replayed node's ``(forward, backward)`` workspace bytes at the full
    batch (step 3)."""
    replayed = _replayed_names(base)
    if not replayed:
        return {}
    s_a, s_b, batch = sizes
    room = limit_bytes - int(math.ceil(forward_live_bytes(base) * s_b / batch))
    with preserved_state(model, [device]), paused_gc(), torch.enable_grad():
        if full_signatures is None:
            if at_a is None:
                raise ValueError("replay_times needs the inputs at sizes[0] rows (at_a) or full_signatures")
            shapes = _Shapes(gm, replayed)
            _run_kwargs(shapes, gm, *at_a)
            signatures: Mapping[str, Mapping[str, list[Any]]] = shapes.signatures
        else:
            signatures = {k: v for k, v in full_signatures.items() if k in replayed}
        replay = _Replay(gm, base, signatures, sizes, room, repeats, warmup, device,
                         exact=full_signatures is not None)
        _run_kwargs(replay, gm, *at_b)
    if workspace is not None:
        workspace.update(replay.workspace)
    if replay.skipped:
        first = next(iter(replay.skipped.items()))
        logger.info("autoremat: %d of %d conv/linear/matmul nodes timed alone at batch %d; %d keep fitted "
                    "times (%s: %s%s)", len(replay.times), len(replayed), batch, len(replay.skipped), *first,
                    ", ..." if len(replay.skipped) > 1 else "")
    else:
        logger.info("autoremat: %d conv/linear/matmul nodes timed alone at batch %d", len(replay.times), batch)
    return replay.times
