"""Module-level capture for models fx cannot trace (Hugging Face transformers, say).

Nodes are calls of *node modules*: every leaf module, and every member of a container (``nn.ModuleList`` /
``nn.Sequential`` / ``nn.ModuleDict``), which are the repeated blocks a user would checkpoint (a member that is
itself a ``Sequential`` is one block; a member that is a ``ModuleList``/``ModuleDict`` is looked into); other
modules are looked into. Tensor operations that run between node modules (the glue in a parent's ``forward``:
embedding sums, views, mask arithmetic) become ``"glue"`` nodes, one per ATen op, seen by a
``TorchDispatchMode``. Edges come from storage identity: a node depends on the nodes that produced the storages
of its inputs (a call's arguments, read or not: a recomputed call holds them all).

Only module calls can be recomputed (the runtime wraps the module's ``forward``); each call of
a module called ``n > 1`` times in one step (a shared layer) is a node of its own whose ``scope``
names that call (``"<path>@<k>/<n>"``, :mod:`autoremat.call_names`), so a plan recomputes one
call and the runtime counts the calls (:mod:`autoremat.runtime.per_call`). Glue nodes are never
recomputed. With ``blocks="ops"`` the repeated blocks are captured op by op
(:mod:`autoremat.capture.blocks`): their module calls become call regions, one per call.
"""

from __future__ import annotations

import statistics
import weakref
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ._loss_reach import SeedMeter, seed_only_what_the_loss_reads
from .dead_nodes import release_points, settle_dead_nodes
from .autograd_saves import behind_copy_slices, handed, hidden_saves, saved_by
from ._recorder import NodeRecord, Recorder, classify_function, classify_module, tensors_in
from .step_timer import Timer
from ..call_names import call_name
from .blocks import BlockScopes, OpTimer, block_paths, settle_scopes, share_times
from .handed_params import call_params
from .held_outputs import OutputHold, mark_outputs
from .inplace import MutationLog, written_storages
from .kv_cache import cache_arguments
from .layer_drop import warn_skipped
from .lingering import Lingering
from .own_recompute import checkpoint_held, in_reentrant_checkpoint, refusing
from .node_modules import module_fingerprint, node_modules

__all__ = ["node_modules", "module_fingerprint", "profile_modules", "time_modules"]

class _ModuleRecorder(Recorder):
    def __init__(self, resident: list[torch.Tensor], model: nn.Module, param_names: Mapping[int, str],
                 count_flops: bool = False, scopes: BlockScopes | None = None) -> None:
        super().__init__(resident, count_flops=count_flops, params=model.named_parameters())
        self.depth = 0
        self.glue_enabled = True
        self.last_glue: int | None = None
        self._pending_glue: list[tuple[int, int]] = []
        self.call_order: list[int] = []
        self.calls: dict[str, int] = {}
        self._stack: list[int] = []
        self.counter.on_op = self._on_op
        self._param_names = param_names
        self._glue_marks: list[tuple[int, weakref.ref]] = []
        self._op_outputs: list[tuple[int, list[weakref.ref], Any]] = []
        self._param_of = {p.untyped_storage()._cdata: param_names[id(p)] for p in model.parameters()
                          if id(p) in param_names}
        self.scopes = scopes
        if scopes is not None:
            scopes.owner = self.owner  # the storages' makers: the calls' unread arguments (BlockScopes.hold_args)
        self.call_op_start: dict[str, int] | None = None
        """Blocks captured op by op: where each call region's op sequence starts."""
        self.pinned_regions: list[str] = []
        self.reused: dict[str, int] = {}
        """Node modules and blocks called more than once in the step (recomputed per call): path -> calls."""
        self.scope_calls: dict[int, tuple[int, ...]] = {}
        """Op nodes of blocks: the index of each call of their scope among its module's calls."""
        self.cache_calls: dict[str, str] = {}
        """Calls handed a key/value cache (:mod:`autoremat.capture.kv_cache`): path -> argument."""
        self.block_of: dict[int, tuple[int, int]] = {}
        """Op nodes of blocks: node -> (block call, op index)."""
        if scopes is not None:  # a block call reads its inputs as one region (pinning)
            self.mutations = MutationLog(self._reader, self._is_module_reader)
        self.lingering = Lingering(on=scopes is not None)

    def own(self, t: torch.Tensor, v: int) -> None:
        prev = self.owner.get(t.untyped_storage()._cdata)
        super().own(t, v)
        self.lingering.owned(v, t.untyped_storage(), prev)

    def _disown(self, key: int, v: int) -> None:
        self.lingering.died(v, key)  # the storage's maker's, also where an in-place write took it over
        super()._disown(key, v)

    def _reader(self) -> int | str | None:
        pseudo = self.scopes.pseudo_id() if self.scopes is not None else None
        return self.current if pseudo is None else pseudo

    def _is_module_reader(self, v: int) -> bool:
        return v >= len(self.nodes) or bool(self.nodes[v].module_path)

    def mark_glue(self) -> None:
        """Register backward markers on the glue outputs recorded so far.

        Autograd attaches a tensor's history only after the dispatch mode returns, so a glue
        node's output is marked at the next op or module call. With its own marker, a glue
        node's backward (the cross-entropy of a loss computed in ``forward``, say) is a backward
        region of its own instead of workspace of the module whose backward ran before it.
        Reading a node's saves unpacks them (``detach`` ops): not the model's ops, not recorded."""
        enabled, self.glue_enabled = self.glue_enabled, False
        try:
            for v, refs, other in self._op_outputs:
                self._read_saves(v, refs, other)
        finally:
            self.glue_enabled = enabled
        self._op_outputs.clear()
        for v, ref in self._glue_marks:
            t = ref()
            if t is not None and t.requires_grad:
                t.register_hook(self._marker(v))
        self._glue_marks.clear()

    def _read_saves(self, v: int, refs: list[weakref.ref], other: Any) -> None:
        """What op node ``v``'s autograd node saved, read from its ``_saved_*`` fields, or, for a
        custom ``autograd.Function`` (Bloom's GELU), its ``saved_tensors`` (exact, where the order of
        pack hooks cannot tell an op's input saves from the previous op's output saves); for an
        in-place op on a view, whose node hides them, from the op (:func:`.autograd_saves.hidden_saves`:
        ``other``, what it was handed besides the view)."""
        rec = self.nodes[v]
        alive = [t for t in (r() for r in refs) if t is not None]
        if alive:  # autograd has attached the history now: whether the op's output takes part
            rec.requires_grad = any(t.requires_grad for t in alive)
        fn = next((t.grad_fn for t in alive if t.grad_fn is not None), None)
        if fn is None:
            return
        saved: list[tuple[Any, int]] = [(t.untyped_storage()._cdata, t.untyped_storage().nbytes()) for t in saved_by(fn)]
        if not rec.alloc_bytes and behind_copy_slices(fn, rec.target) and any(
                self.owner.get(t.untyped_storage()._cdata) == v for t in alive):  # (.autograd_saves)
            hidden = hidden_saves(rec.target, other, rec.out_bytes, v)
            saved += hidden
            if not hidden:  # what its backward saves is hidden: its result, high, never low
                rec.saves.add(v)
        extra: dict[int, int] = {}
        own: dict[int, int] = {}
        custom = isinstance(fn, torch.autograd.function.BackwardCFunction)
        for key, nbytes in saved:
            if key in self.resident:
                continue
            if self.owner.get(key) == v:
                own[key] = nbytes
            elif key in self.owner:
                u = self.owner[key]
                rec.saves.add(u)
                if custom and u not in rec.preds:  # a Function's input, read by its ops inside:
                    rec.preds.append(u)  # the Function reads it (and gets its gradient)
                    self.succs.setdefault(u, []).append(v)
            else:
                extra[key] = nbytes
        if own and sum(own.values()) < rec.alloc_bytes:
            # some of its outputs only (layer norm's mean and rstd, not its result): those are saved
            # bytes of its own, not the node's output, which its consumers may free (under autocast
            # they save a cast of it); kept as one output they stayed until its backward
            rec.alloc_bytes -= sum(own.values())
            extra.update(own)
        elif own:
            rec.saves.add(v)
        rec.extra_saved_bytes += sum(extra.values())

    def _pack(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        key, nbytes = st._cdata, st.nbytes()
        if self.current is None and self.glue_enabled and self.scopes is not None and self.scopes.active is not None:
            return  # an op of a block: its saves are read from its autograd node (_read_saves)
        if self.current is None and self.glue_enabled:
            # the last glue op saving its output, if it has a backward (else the next op an input: dropout's mask)
            last = self.last_glue
            if last is not None and self.owner.get(key) == last and self.nodes[last].requires_grad:
                self._packed.append((last, key, nbytes))
            else:
                self._pending_glue.append((key, nbytes))
        else:
            self._packed.append((self.current, key, nbytes))

    def pre_hook(self, path: str, mod: nn.Module) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            self.replayed[path] = self.replayed.get(path, 0) + self.in_backward  # in backward: its own recompute
            if self.depth == 0 and self.glue_enabled and (names := cache_arguments(args, kwargs)):
                self.cache_calls[path] = ", ".join(names)
            if self.depth == 0 and self.glue_enabled and self.scopes is not None and path in self.scopes.blocks:
                self.mark_glue()
                self._pending_glue.clear()  # input saves of the block's first op: read from its node
                self.scopes.enter_block(path, args, kwargs)
                self._pending_glue += checkpoint_held()  # the block's first op saves them
                self.lingering.enter_call()
                self.call_order.append(-len(self.scopes.block_calls))  # block call j: -(j + 1)
            elif self.depth == 0 and self.glue_enabled:
                self.mark_glue()
                ins = tensors_in((args, kwargs))
                preds = sorted({self.owner[t.untyped_storage()._cdata] for t in ins
                                if t.untyped_storage()._cdata in self.owner})
                params = call_params(module, args, kwargs, self._param_names)
                rec = NodeRecord(name=path, kind=classify_module(module), target=type(module).__name__,
                                 module_path=path, preds=preds, params=params)
                v = self.add_node(rec)
                self.lingering.outside_call(v)
                self.calls[path] = self.calls.get(path, 0) + 1
                self.call_order.append(v)
                self._stack.append(v)
                self.settle_saves()
                self.begin(v)
                self._packed += [(v, k, nb) for k, nb in checkpoint_held()]  # held by the model's own checkpoint
            self.depth += 1
        return hook

    def post_hook(self, path: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            self.depth -= 1
            if self.depth == 0 and self.scopes is not None and self.scopes.active == path:
                self.mark_glue()
                self.scopes.leave_block()
                self.last_glue = None
            elif self.depth == 0 and self._stack:
                v = self._stack.pop()
                self.end(v, output)
            if self.depth == 0 and in_reentrant_checkpoint():
                self._history_later(output)
        return hook

    def _history_later(self, output: Any) -> None:
        """A call inside the model's own reentrant checkpoint: its Function gives the outputs their
        history and saves its inputs once it returns, so their makers are read then (mark_glue)."""
        for t in tensors_in(output):
            v = self.owner.get(t.untyped_storage()._cdata)
            if v is not None and t.is_floating_point():
                self._op_outputs.append((v, [weakref.ref(t)], None))
                self._glue_marks.append((v, weakref.ref(t)))

    def _on_op(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        in_block = self.scopes is not None and self.scopes.active is not None
        if not self.glue_enabled or self.current is not None or self.depth > (1 if in_block else 0):
            return
        index = self.scopes.count_op(func) if in_block else None
        self.mark_glue()
        outs = tensors_in(out)
        if not outs:
            return
        ins = tensors_in((args, kwargs))
        keys = [t.untyped_storage()._cdata for t in ins]
        preds = sorted({self.owner[k] for k in keys if k in self.owner}
                       | (self.scopes.take_held() if in_block else set()))  # a call's unread arguments too
        name = str(getattr(func, "__name__", func))
        if in_block:
            scope = self.scopes.scope()
            # a parameter read through a view (``t(weight)`` feeding ``addmm``): its gradient is
            # produced by the op reading the view, so every op reading its storage lists it
            params = {self._param_of[k] for k in keys if k in self._param_of}
            rec = NodeRecord(name=f"{scope[-1]}:{name}", kind=classify_function(func.overloadpacket),
                             target=str(func), module_path=scope[-1], preds=preds, recomputable=False,
                             params=sorted(params), random=torch.Tag.nondeterministic_seeded in func.tags)
            rec.scope, rec.op_index = scope, -1 if index is None else index
            self.scope_calls[len(self.nodes)] = self.scopes.call_indices()
        else:
            rec = NodeRecord(name=f"glue:{name}", kind="glue", target=str(func), preds=preds, recomputable=False)
        v = self.add_node(rec)
        if in_block:
            self.block_of[v] = (len(self.scopes.block_calls) - 1, rec.op_index)
            self._op_outputs.append((v, [weakref.ref(t) for t in outs], handed(func, args)))  # history: after dispatch
        fresh: dict[int, int] = {}
        roots: set[int] = set()
        for t in outs:
            rec.out_bytes += t.numel() * t.element_size()
            k = t.untyped_storage()._cdata
            if k in self.owner:
                roots.add(self.owner[k])
            elif k not in self.resident and k not in fresh:
                fresh[k] = t.untyped_storage().nbytes()
                self.own(t, v)
        rec.alloc_bytes = sum(fresh.values())
        self.input_grads.note(v, ins, outs, self.owner)
        if not fresh and len(roots) == 1:
            rec.alias_of = next(iter(roots))
            self.take_over(v, outs, written_storages(func, args, kwargs))  # an in-place write
        rec.requires_grad = any(t.requires_grad for t in ins) and any(t.is_floating_point() for t in outs)
        # glue: a view or an in-place write has its owner's backward; a block's op is marked either way (a view's
        # backward passes its gradient on: grad_passthrough) and whatever its inputs (a custom autograd.Function's
        # last op, Bloom's GELU, reads tensors without history, yet its output gets the Function's: mark_glue checks)
        if (rec.requires_grad and fresh) or (in_block and any(t.is_floating_point() for t in outs)):
            first = next(t for t in outs if t.is_floating_point())
            self._glue_marks.append((v, weakref.ref(first)))
        for k, nb in self._pending_glue:
            self._packed.append((v, k, nb))
        self._pending_glue.clear()
        self.last_glue = v
        if in_block:
            self.lingering.after_op(v)
        else:
            self.lingering.outside_call(v)


def profile_modules(
    model: nn.Module,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    loss_fn: Callable[[Any], torch.Tensor],
    resident: list[torch.Tensor],
    param_names: Mapping[int, str],
    param_bytes: dict[str, int],
    *,
    repeats: int,
    warmup: int,
    device: torch.device,
    time_fn: Callable[[list[NodeRecord]], None] | None,
    count_flops: bool = False,
    blocks: str = "module",
) -> Recorder:
    """One recorded step (structure, memory) and ``warmup + repeats`` timed steps; with
    ``blocks="ops"`` the repeated blocks op by op (:mod:`autoremat.capture.blocks`)."""
    mods = node_modules(model)
    scopes = BlockScopes(model, block_paths(model, [p for p, _ in mods])) if blocks == "ops" else None
    rec = _ModuleRecorder(resident, model, param_names, count_flops=count_flops, scopes=scopes)
    rec.mutations.watch_state(model.buffers())
    handles = [] if scopes is None else scopes.register()
    try:
        for path, mod in mods:
            handles.append(mod.register_forward_pre_hook(rec.pre_hook(path, mod), with_kwargs=True))
            handles.append(mod.register_forward_hook(rec.post_hook(path)))
        with rec.recording(), refusing(model), rec.writes.watching(mods):  # the checks walk the stack
            out = model(*args, **kwargs)
            rec.lingering.close()  # what dies from here on outlived the forward
            rec.mark_glue()
            rec.glue_enabled = False
            rec.settle_saves()
            producers = mark_outputs(rec, out)
            returned = {v for v, r in enumerate(rec.nodes) if r.is_output}  # the object's own tensors (.dead_nodes)
            loss = rec.run_loss(loss_fn, out)
            seed_only_what_the_loss_reads(rec.nodes, loss, producers)
            seeds = SeedMeter(rec.nodes, loss, producers)
            hold = OutputHold(rec.owner)  # the step drops its output object here, before backward
            del out, producers
            hold.mark(rec.nodes)
            rec.run_backward(loss)
            del loss
            seeds.close()
    finally:
        for h in handles:
            h.remove()
    _name_calls(rec)
    warn_skipped(model, [p for p, _ in mods], {**rec.calls, **(scopes.calls if scopes is not None else {})})
    rec.reused = {p: n for p, n in rec.calls.items() if n > 1}  # modules run more than once: per call
    if scopes is not None:
        rec.reused.update({p: n for p, n in scopes.calls.items() if n > 1 and p in scopes.blocks})
        settle_scopes(rec, scopes)
    rec.finish(param_bytes)
    dead, ling = settle_dead_nodes(rec.nodes, rec.succs, rec.root, returned), rec.lingering
    ling.apply(rec, unreached=dead)
    rec.dead_released_after = release_points(rec.nodes, rec.succs, rec.root, dead, ling.deaths, ling.outlived, ling.ops)
    if time_fn is not None:
        time_fn(rec.nodes)
        return rec
    n, calls = len(rec.nodes), 0 if scopes is None else len(scopes.block_calls)
    order = [v if v >= 0 else n - 1 - v for v in rec.call_order]  # block call j: pseudo node n + j
    fwd, bwd, rec.time_noise = time_modules(model, order, n + calls, args, kwargs, loss_fn, repeats=repeats,
                            warmup=warmup, device=device)
    for r, f, b in zip(rec.nodes, fwd, bwd):
        r.time_s, r.bwd_time_s = f, b
    if scopes is not None:
        op_times = _time_block_ops(model, scopes.blocks, args, kwargs, loss_fn, repeats=repeats, warmup=warmup)
        for v, (f, b) in share_times(rec.block_of, op_times, fwd[n:], bwd[n:]).items():
            rec.nodes[v].time_s, rec.nodes[v].bwd_time_s = f, b
    return rec


def _name_calls(rec: _ModuleRecorder) -> None:
    """Module nodes: a call handed a key/value cache is kept; each call of a module called
    ``n > 1`` times gets the scope entry naming it (:func:`~autoremat.call_names.call_name`)."""
    seen: dict[str, int] = {}
    for v, r in enumerate(rec.nodes):
        if r.kind == "glue" or v in rec.block_of:
            continue
        k = seen[r.module_path] = seen.get(r.module_path, -1) + 1
        if r.module_path in rec.cache_calls:
            r.recomputable = False
        elif rec.calls.get(r.module_path, 0) > 1:
            r.scope = (call_name(r.module_path, k, rec.calls[r.module_path]),)


def _time_block_ops(model: nn.Module, blocks: Collection[str], args: Sequence[Any], kwargs: Mapping[str, Any],
                    loss_fn: Callable[[Any], torch.Tensor], *, repeats: int, warmup: int) -> list[dict[int, float]]:
    """Per block call, the median time of each op (by index) over ``repeats`` forwards under
    :class:`OpTimer` after ``warmup``."""
    runs: list[list[dict[int, float]]] = []
    mods = dict(model.named_modules())
    for k in range(warmup + repeats):
        scopes = BlockScopes(model, blocks)
        timer = OpTimer(scopes)
        handles = scopes.register()
        for path in blocks:
            handles.append(mods[path].register_forward_pre_hook(lambda _m, _a, p=path, s=scopes: s.enter_block(p)))
            handles.append(mods[path].register_forward_hook(lambda _m, _a, _o, s=scopes: s.leave_block()))
        try:
            with torch.random.fork_rng(devices=[]):
                with timer:
                    out = model(*args, **kwargs)
                loss_fn(out).backward()
        finally:
            for h in handles:
                h.remove()
            model.zero_grad(set_to_none=True)
        if k >= warmup:
            runs.append(timer.times)
    return [{i: statistics.median(run[c].get(i, 0.0) for run in runs) for i in runs[0][c]} for c in range(len(runs[0]))]


def time_modules(
    model: nn.Module,
    order: Sequence[int],
    n: int,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    loss_fn: Callable[[Any], torch.Tensor],
    *,
    repeats: int,
    warmup: int,
    device: torch.device,
) -> tuple[list[float], list[float], float]:
    """Median forward and backward time of the ``n`` nodes over ``repeats`` steps after ``warmup``
    and their :func:`~autoremat.capture.step_timer.timing_noise`;
    ``order`` lists the node of each top-level node-module call of a step, in call order."""
    timer = Timer(n, device)
    mods = node_modules(model)
    state = {"k": 0, "depth": 0, "stack": []}

    def tpre(module: nn.Module, a: tuple, kw: dict) -> None:
        if state["depth"] == 0:
            v = order[state["k"] % len(order)]
            state["k"] += 1
            state["stack"].append(v)
            timer.begin(v)
        state["depth"] += 1

    def tpost(module: nn.Module, a: tuple, output: Any) -> None:
        state["depth"] -= 1
        if state["depth"] == 0 and state["stack"]:
            timer.end(state["stack"].pop(), output)

    handles = []
    try:
        for _path, mod in mods:
            handles.append(mod.register_forward_pre_hook(tpre, with_kwargs=True))
            handles.append(mod.register_forward_hook(tpost))
        return timer.run_steps(model, lambda: model(*args, **kwargs), loss_fn, warmup, repeats,
                               before_step=lambda: state.update(k=0))
    finally:
        for h in handles:
            h.remove()
