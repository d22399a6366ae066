"""Op-level capture through ``torch.fx``: one graph node per ``call_module`` /
``call_function`` / ``call_method`` node of the traced module (standard ``nn`` layers are
leaves). Placeholders, ``get_attr`` and the output node are not graph nodes: inputs and
parameters are resident for the whole step.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
import torch.fx

from ._loss_reach import SeedMeter, seed_only_what_the_loss_reads
from ._recorder import NodeRecord, Recorder, classify_function, classify_module, tensors_in
from .step_timer import Timer
from .signature import tensor_lines
from ._tracing import SemanticTracer, semantic_trace
from .held_outputs import OutputHold
from .inplace import out_of_place, write_order
from .param_writes import written_first

__all__ = ["trace", "fx_ops", "fx_fingerprint", "records_from_fx", "profile_fx", "time_fx", "Watch"]

_OPS = ("call_module", "call_function", "call_method")


def trace(model: torch.nn.Module, tracer: SemanticTracer | None = None) -> torch.fx.GraphModule:
    """``torch.fx.symbolic_trace`` with buffers proxied, user hooks silenced and no-grad blocks
    refused (:mod:`autoremat.capture._tracing`), and in-place ops run out of place where that is
    exact (:mod:`autoremat.capture.inplace`); raises whatever fx raises when the model is not
    traceable. ``tracer``: see :func:`~autoremat.capture._tracing.semantic_trace`."""
    gm = semantic_trace(model, tracer)
    out_of_place(gm)
    return gm


def fx_ops(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op in _OPS]


def _kind(gm: torch.fx.GraphModule, n: torch.fx.Node) -> str:
    if n.op == "call_module":
        return classify_module(gm.get_submodule(str(n.target)))
    return classify_function(n.target)


def _target_name(n: torch.fx.Node) -> str:
    t = n.target
    return t if isinstance(t, str) else getattr(t, "__name__", str(t))


def fx_fingerprint(gm: torch.fx.GraphModule, tensors: Mapping[str, str] | None = None) -> str:
    """Hash of a traced module's structure and of its parameters' and buffers' shapes and dtypes
    (:mod:`autoremat.capture.signature`); equals ``Graph.fingerprint`` of its capture.
    ``tensors``: the tensor signature to hash instead of ``gm``'s own (a sharded model's
    parameters as they were before sharding, :mod:`autoremat.runtime.sharding`)."""
    ops = fx_ops(gm)
    ids = {n: i for i, n in enumerate(ops)}
    h = hashlib.sha256()
    h.update(b"fx")
    edges: list[tuple[int, int]] = []
    for i, n in enumerate(ops):
        mod = str(n.target) if n.op == "call_module" else ""
        h.update(f"{i}:{n.name}:{_kind(gm, n)}:{mod};".encode())
        for u in n.all_input_nodes:
            if u in ids:
                edges.append((ids[u], i))
    for u, v in sorted(set(edges)):
        h.update(f"{u}>{v};".encode())
    for line in tensor_lines(gm) if tensors is None else (f"{k}={v};" for k, v in tensors.items()):
        h.update(line.encode())
    return h.hexdigest()[:16]


def records_from_fx(gm: torch.fx.GraphModule, param_names: Mapping[int, str]) -> list[NodeRecord]:
    """Structure of the graph: names, kinds, edges, parameters, outputs."""
    ops = fx_ops(gm)
    ids = {n: i for i, n in enumerate(ops)}
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    outputs = {ids[u] for u in _output_nodes(out_node) if u in ids}
    order = write_order(gm)  # in-place ops left in place: their readers before and after them keep their order
    recs: list[NodeRecord] = []
    for i, n in enumerate(ops):
        params: list[str] = []
        if n.op == "call_module":
            for p in gm.get_submodule(str(n.target)).parameters():
                if id(p) in param_names:
                    params.append(param_names[id(p)])
        for u in n.all_input_nodes:
            if u.op == "get_attr":
                obj = _get_attr(gm, str(u.target))
                if isinstance(obj, torch.nn.Parameter) and id(obj) in param_names:
                    params.append(param_names[id(obj)])
        preds = sorted({ids[u] for u in (*n.all_input_nodes, *order.get(n, ())) if u in ids})
        recs.append(NodeRecord(
            name=n.name, kind=_kind(gm, n), target=_target_name(n),
            module_path=str(n.target) if n.op == "call_module" else "",
            preds=preds, params=sorted(set(params)), is_output=i in outputs, scope=_scope(n),
        ))
    return recs


def _scope(n: torch.fx.Node) -> tuple[str, ...]:
    """The module calls the traced node ran inside, outermost first (``nn_module_stack``, which
    ``torch.fx`` records while tracing; a leaf module's own call included)."""
    stack = n.meta.get("nn_module_stack") or {}
    paths = [v[0] if isinstance(v, tuple) else str(v) for v in stack.values()]
    return tuple(p for p in paths if p)


def _output_nodes(out_node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes whose values the model returns. A dataclass built in ``forward``
    (``return Out(logits, aux)``) is a ``call_function`` node of the class: its fields, not
    the instance, are the outputs that live until the loss."""
    found: list[torch.fx.Node] = []
    todo = list(out_node.all_input_nodes)
    while todo:
        u = todo.pop()
        if u.op == "call_function" and isinstance(u.target, type) and dataclasses.is_dataclass(u.target):
            todo.extend(u.all_input_nodes)
        elif u not in found:
            found.append(u)
    return found


def _get_attr(gm: torch.nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


Watch = Callable[[torch.fx.Interpreter, torch.fx.Node], None]
"""Called before each op node of the recorded step runs (its arguments are in the interpreter's ``env``)."""


class _Interp(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule, probe: Recorder | Timer, watch: Watch | None = None,
                 outputs: Collection[int] = ()) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.probe = probe
        self.watch = watch
        self.ids = {n: i for i, n in enumerate(fx_ops(gm))}
        self.outputs = outputs
        # autograd node of each output tensor -> the output nodes that made it (for the loss's reach)
        self.producers: dict[Any, set[int]] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        """``Interpreter.run_node`` with only the op's own call inside the probe's window.

        The interpreter's work per node (argument lookup, submodule fetch, node context) is
        not part of the model's forward: inside the window it added ~10-20 µs to every node on
        the CPU, which made cheap ops (activations, adds) look up to twice as dear as they are
        and the whole forward ~1.3-2x slower than the model runs it."""
        v = self.ids.get(n)
        if v is None:
            return super().run_node(n)
        if self.watch is not None:
            self.watch(self, n)
        with self._set_current_node(n):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            if n.op == "call_module":
                fn = self.fetch_attr(str(n.target))
            elif n.op == "call_method":
                obj, *rest = args
                fn, args = getattr(obj, str(n.target)), tuple(rest)
            else:
                fn = n.target
            self.probe.begin(v)
            out = fn(*args, **kwargs)
            self.probe.end(v, out)
            if (grads := getattr(self.probe, "input_grads", None)) is not None:  # the recorder (not the timer)
                grads.note(v, tensors_in((args, kwargs)), tensors_in(out), self.probe.owner)
        if v in self.outputs:
            for t in tensors_in(out):
                if t.grad_fn is not None:
                    self.producers.setdefault(t.grad_fn, set()).add(v)
        return out


def profile_fx(
    gm: torch.fx.GraphModule,
    recs: list[NodeRecord],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    loss_fn: Callable[[Any], torch.Tensor],
    resident: list[torch.Tensor],
    param_bytes: dict[str, int],
    *,
    repeats: int,
    warmup: int,
    device: torch.device,
    time_fn: Callable[[list[NodeRecord]], None] | None,
    count_flops: bool = False,
    watch: Watch | None = None,
) -> Recorder:
    """One recorded step (memory; ``watch`` sees its nodes) and ``warmup + repeats`` timed steps."""
    rec = Recorder(resident, count_flops=count_flops, params=gm.named_parameters())
    rec.mutations.watch_state(gm.buffers())
    for r in recs:
        rec.add_node(r)
    interp = _Interp(gm, rec, watch, outputs={v for v, r in enumerate(recs) if r.is_output})
    with rec.recording():
        with written_first([*gm.parameters(), *tensors_in((args, kwargs))]):  # the first run: copies (.param_writes)
            out = _run_kwargs(interp, gm, args, kwargs)
        interp.env.clear()  # the interpreter's env holds the returned value: only ``out`` may
        loss = rec.run_loss(loss_fn, out)
        seed_only_what_the_loss_reads(recs, loss, interp.producers)
        seeds = SeedMeter(recs, loss, interp.producers)
        interp.producers.clear()
        hold = OutputHold(rec.owner)  # the step drops the returned object here, before backward
        del out
        hold.mark(rec.nodes)
        rec.run_backward(loss)
        del loss
        seeds.close()
    rec.finish(param_bytes)
    if time_fn is not None:
        time_fn(recs)
        return rec
    fwd, bwd, rec.time_noise = time_fx(gm, args, kwargs, loss_fn, repeats=repeats, warmup=warmup, device=device)
    for r, f, b in zip(recs, fwd, bwd):
        r.time_s, r.bwd_time_s = f, b
    return rec


def time_fx(
    gm: torch.fx.GraphModule,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    loss_fn: Callable[[Any], torch.Tensor],
    *,
    repeats: int,
    warmup: int,
    device: torch.device,
) -> tuple[list[float], list[float], float]:
    """Median forward and backward time of every node over ``repeats`` steps after ``warmup``, and
    the :func:`~autoremat.capture.step_timer.timing_noise` of those steps."""
    n = len(fx_ops(gm))
    timer = Timer(n, device)
    tinterp = _Interp(gm, timer)
    return timer.run_steps(gm, lambda: _run_kwargs(tinterp, gm, args, kwargs), loss_fn, warmup, repeats)


def _run_kwargs(interp: torch.fx.Interpreter, gm: torch.fx.GraphModule, args: Sequence[Any],
                kwargs: Mapping[str, Any]) -> Any:
    """Bind positional and keyword inputs to the placeholders, as ``gm.forward`` would."""
    if not kwargs:
        return interp.run(*args)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    bound: list[Any] = list(args)
    for ph in placeholders[len(args):]:
        name = str(ph.target).lstrip("*")
        if name in kwargs:
            bound.append(kwargs[name])
        elif ph.args:
            bound.append(ph.args[0])
        else:
            raise TypeError(f"missing input {name!r} for the traced model")
    return interp.run(*bound)
