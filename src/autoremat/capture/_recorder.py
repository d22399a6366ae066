"""Shared profiling machinery of fx and module-level capture.

A :class:`Recorder` runs once around a forward + loss + backward of the real model and
records, per node: the storages its outputs occupy (views detected by storage identity), what
autograd saved while it ran (``saved_tensors_hooks``, de-duplicated by storage, parameters and
inputs excluded), transient workspace (from :class:`~autoremat.measure.LiveStorageCounter`), and its
backward region (a tensor hook on its output marks where its backward starts); times come from
:class:`~autoremat.capture.step_timer.Timer`.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .._fsdp import original_class
from ..measure import LiveStorageCounter, _flatten
from .allocator_meter import AllocatorMeter
from ._loss_reach import seed_bytes
from .input_grads import InputGrads
from .inplace import MutationLog
from .meta_targets import loss_on
from .shared_casts import CastReads
from .container_writes import ContainerWrites
from .unread_saves import settle_unread_saves

__all__ = ["NodeRecord", "Recorder", "classify_module", "classify_function"]


@dataclass
class NodeRecord:
    """What capture learned about one node before it becomes a :class:`Graph` node."""

    name: str
    kind: str
    target: str
    module_path: str = ""
    preds: list[int] = field(default_factory=list)
    params: list[str] = field(default_factory=list)
    recomputable: bool = True
    is_output: bool = False
    grad_seed_bytes: int | None = None
    held_by_output: bool = False
    out_bytes: int = 0
    alloc_bytes: int = 0
    alias_of: int | None = None
    saves: set[int] = field(default_factory=set)
    unreached_saves: set[int] = field(default_factory=set)
    extra_saved_bytes: int = 0
    fwd_temp_bytes: int = 0
    lingering: list[tuple[int, int]] = field(default_factory=list)
    grad_new: list[int] = field(default_factory=list)
    grad_part: list[tuple[int, int]] = field(default_factory=list)
    bwd_temp_bytes: int = 0
    requires_grad: bool = False
    grad_passthrough: bool = False
    first_grad_view: bool = False
    time_s: float = 0.0
    bwd_time_s: float = 0.0
    flops: float = 0.0
    scope: tuple[str, ...] = ()
    op_index: int = -1
    random: bool = False


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def tensors_in(obj: Any) -> list[torch.Tensor]:
    return [t for t in _flatten(obj) if isinstance(t, torch.Tensor)]


class Recorder:
    """Attributes storages, saved tensors, workspace and backward regions to nodes."""

    def __init__(self, resident: Iterable[torch.Tensor], *, count_flops: bool = False,
                 params: Iterable[tuple[str, torch.Tensor]] = ()) -> None:
        self.count_flops = count_flops
        self.casts = CastReads(params)  # autocast casts read more than once: kept (.shared_casts)
        self.cast_pins: dict[str, str] = {}
        self.writes = ContainerWrites()  # node calls changing containers in place: kept (.container_writes)
        self.write_pins: dict[str, str] = {}
        self.pinned_regions_by_write: dict[str, str] = {}  # the block call regions among them (.blocks)
        self.rng_pins: dict[str, str] = {}  # node calls drawing from Python's or numpy's generator (.host_rng)
        self.pinned_regions_by_rng: dict[str, str] = {}
        self._flop_mode: Any = None
        self.in_backward, self.replayed = False, dict[str, int]()  # calls in backward: the model's own recompute
        self.nodes: list[NodeRecord] = []
        self.owner: dict[int, int] = {}
        resident = list(resident)
        self.resident: set[int] = {_storage_key(t) for t in resident}
        self.counter = LiveStorageCounter()
        self.workspace = AllocatorMeter(next((t.device for t in resident if t.device.type == "cuda"), None),
                                        live=lambda: self.counter.live, made=lambda: self.counter.made)
        self.current: int | str | None = None
        self._level0 = 0
        self._packed: list[tuple[int | str | None, int, int]] = []
        # a weak reference to each saved tensor's storage while recording, by key: its address (the key of
        # its entry in _packed, settled later) is not handed to another storage meanwhile, and settle_saves
        # sees whether it died first (an Encodec quantizer op's saved cast: freed before it was settled, and
        # counted as the op's 4,096 saved bytes in most captures, as nothing where a later node's storage had
        # taken its address)
        self._save_refs: dict[int, StorageWeakRef] = {}
        self.loss_saves: set[int] = set()
        self.loss_extra_bytes = self.loss_fwd_temp_bytes = self.loss_bwd_temp_bytes = self.loss_held_bytes = 0
        self.loss_seed_bytes = self._loss_made = 0  # the gradient backward() seeds the loss with; its storage's bytes
        self._loss_extras: dict[int, int] = {}  # storage -> bytes of the loss's extra saved tensors
        self._regions: list[tuple[int | str, int, range]] = []
        """(node or "loss", peak bytes above its start, the sums made there out of place because the
        first gradient was a view: indices in ``counter.sums.view_sums``)."""
        self._view_sum_of: dict[int, int] = {}
        """Index in ``counter.sums.view_sums`` -> the node whose gradient that sum made (its marker)."""
        self._open: tuple[int | str, int, int] | None = None  # (node or "loss", live, sums so far)
        self._grad_ref: dict[int, tuple[int, weakref.ref]] = {}
        self._grad_of: dict[int, int] = {}  # storage key of a node's gradient (at its marker) -> the node
        self._passed: dict[int, set[int]] = {}
        """Storage key of a sum of gradients -> the nodes whose own gradient storage was one of its parts."""
        self.input_grads = InputGrads()  # casts and split parts each op read (grad_new, grad_part)
        self.on_pack: Callable[[int | str | None, int, int], None] | None = None
        self.succs: dict[int, list[int]] = {}
        self.pinned: dict[str, str] = {}
        self.time_noise: float | None = None  # timing_noise of the timed steps (None: not timed)
        """Nodes made non-recomputable because an input was written in place: name -> writer."""
        self.mutations = MutationLog(lambda: self.current, lambda v: bool(self.nodes[v].module_path))

    def own(self, t: torch.Tensor, v: int) -> None:
        """Record ``v`` as the producer of ``t``'s storage until the storage dies."""
        st = t.untyped_storage()
        key = st._cdata
        self.owner[key] = v
        weakref.finalize(st, self._disown, key, v)

    def take_over(self, v: int, outs: list[torch.Tensor], written: set[int]) -> None:
        """Node ``v`` wrote the storages ``written`` of its outputs ``outs`` in place: later readers
        read them from ``v`` (whose backward hands the write's gradient on: Falcon's ``mlp_output +=
        attention_output``), while each storage stays its maker's (``alias_of``)."""
        for t in outs:
            st = t.untyped_storage()
            if st._cdata in written and st._cdata in self.owner:
                self.owner[st._cdata] = v
                weakref.finalize(st, self._disown, st._cdata, v)

    def _disown(self, key: int, v: int) -> None:
        if self.owner.get(key) == v:
            del self.owner[key]

    # ------------------------------------------------------------------ hooks
    def _pack(self, t: torch.Tensor) -> None:
        """Note what autograd saves while the current node runs."""
        st = t.untyped_storage()
        entry = (self.current, st._cdata, st.nbytes())
        if self.on_pack is not None:
            self.on_pack(*entry)
        else:
            self._packed.append(entry)

    def _pack_hook(self, t: torch.Tensor) -> torch.Tensor:
        """Note ``t``; hand autograd a history-free alias: ``t``, saved by its own op (ELU), holds that op's node,
        a cycle only backward breaks (a graph no gradient reaches leaked). This ``detach`` is no model op."""
        self._pack(t)
        st = t.untyped_storage()
        if st._cdata not in self._save_refs:
            self._save_refs[st._cdata] = StorageWeakRef(st)
        on_op, self.counter.on_op = self.counter.on_op, None
        try:
            return t.detach()
        finally:
            self.counter.on_op = on_op

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        self._watch_mutations()
        try:
            with self.counter, torch.autograd.graph.saved_tensors_hooks(self._pack_hook, lambda t: t):
                yield
        finally:
            self._save_refs.clear()

    def _watch_mutations(self) -> None:
        """Feed every op of the forward and loss to :attr:`mutations` (until :meth:`run_backward`)."""
        log, then = self.mutations, self.counter.on_op

        def on_op(func: Any, args: tuple, kwargs: dict, out: Any) -> None:
            log.on_op(func, args, kwargs, out)
            n = len(self.nodes)
            if then is not None:
                then(func, args, kwargs, out)
            if self.casts.on and log.active:  # forward and loss: in the current node, or the one node it added
                who = self.current if isinstance(self.current, int) else n if len(self.nodes) == n + 1 else None
                self.casts.note(func, tensors_in((args, kwargs)), tensors_in(out), who)

        self.counter.on_op = on_op
        log.active = True

    # ------------------------------------------------------------------ forward
    def begin(self, v: int) -> None:
        self.current = v
        self.counter.reset_peak()
        self._level0 = self.counter.live
        self.workspace.start()
        if self.count_flops:
            from torch.utils.flop_counter import FlopCounterMode

            self._flop_mode = FlopCounterMode(display=False)
            self._flop_mode.__enter__()

    def end(self, v: int, out: Any) -> None:
        rec = self.nodes[v]
        if self._flop_mode is not None:
            self._flop_mode.__exit__(None, None, None)
            rec.flops = float(self._flop_mode.get_total_flops())
            self._flop_mode = None
        peak_delta = self.counter.peak - self._level0
        outs = tensors_in(out)
        new_bytes = 0
        roots: set[int] = set()
        fresh: set[int] = set()
        nominal = 0
        for t in outs:
            nominal += t.numel() * t.element_size()
            key = _storage_key(t)
            if key in self.owner:
                roots.add(self.owner[key])
            elif key in self.resident:
                continue
            elif key not in fresh:
                fresh.add(key)
                new_bytes += t.untyped_storage().nbytes()
        for t in outs:
            key = _storage_key(t)
            if key in fresh and key not in self.owner:
                self.own(t, v)
        rec.out_bytes = nominal
        rec.alloc_bytes = new_bytes
        if not fresh and len(roots) == 1:
            rec.alias_of = next(iter(roots))
        rec.requires_grad = any(t.requires_grad for t in outs)
        self.settle_saves()
        rec.fwd_temp_bytes = max(0, self.workspace.over(peak_delta) - rec.alloc_bytes - rec.extra_saved_bytes)
        for t in outs:
            if t.requires_grad:
                t.register_hook(self._marker(v))
                break
        self.current = None

    def settle_saves(self) -> None:
        """Attribute the tensors packed so far to the nodes that were running."""
        extras: dict[int | str, dict[int, int]] = {}
        for who, key, nbytes in self._packed:
            if who is None or key in self.resident:
                continue
            ref = self._save_refs.get(key)
            if ref is not None and ref.expired():
                continue  # the storage died before now: its saver was freed, nothing of it is held
            if key in self.owner and isinstance(who, int) and self.owner[key] > who:
                continue  # the storage died before now, its address reused by a later node's: its saver was freed
            if key in self.owner:
                target = self.loss_saves if who == "loss" else self.nodes[who].saves
                target.add(self.owner[key])
            else:
                extras.setdefault(who, {})[key] = nbytes
        self._packed.clear()
        for who, d in extras.items():
            if who == "loss":
                self.loss_extra_bytes += sum(d.values())
                self._loss_extras.update(d)
            else:
                self.nodes[who].extra_saved_bytes += sum(d.values())

    # ------------------------------------------------------------------ loss and backward
    def run_loss(self, loss_fn: Callable[[Any], torch.Tensor], output: Any) -> torch.Tensor:
        self.current = "loss"
        self.counter.reset_peak()
        level0 = self.counter.live
        loss = loss_on(loss_fn, output, self.resident)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("loss_fn must return a scalar tensor")
        if not loss.requires_grad:
            raise ValueError("the loss does not require grad: no parameter or input takes part in it")
        self.settle_saves()
        self._hold_loss(loss)
        self.loss_fwd_temp_bytes = max(0, self.counter.peak - level0 - self.loss_extra_bytes - self._loss_made)
        self.current = None
        return loss

    def _hold_loss(self, loss: torch.Tensor) -> None:
        """``loss_held_bytes``: what stays for the loss to the step's end. The loss tensor's own storage,
        which the loop holds (``loss = ...; loss.backward()``): 4 bytes for a float32 scalar, but on the
        CPU ``mse_loss`` returns its mean in a storage the size of its input; also where a node's output
        is that storage (a loss the model returns: the step drops the returned object at the loss, the
        loop's ``loss`` keeps it; kept to the end too, ``output_kept="step"``, it is counted twice).
        And the gradient ``backward()`` seeds it with (``ones_like(loss)``, which its frame holds until
        it returns; :meth:`finish` takes it out of the loss's backward workspace), from the loss on."""
        st, key = loss.untyped_storage(), loss.untyped_storage()._cdata
        self.loss_seed_bytes = loss.numel() * loss.element_size()
        self.loss_extra_bytes -= self._loss_extras.pop(key, 0)  # saved by the loss: held longer
        self.loss_held_bytes = (0 if key in self.resident else st.nbytes()) + self.loss_seed_bytes
        self._loss_made = st.nbytes() if key not in self.owner and key not in self.resident else 0  # by the loss

    def _marker(self, v: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            self._close_region()
            self._open = (v, self.counter.live, len(self.counter.sums.view_sums))
            self.counter.reset_peak()
            self.workspace.start()
            origin = self.counter.sums.origin(grad)
            if origin is not None:
                self.nodes[v].first_grad_view = True
                self._view_sum_of[origin] = v
            st = grad.untyped_storage()
            self._grad_ref[v] = (st._cdata, weakref.ref(st))
            self._grad_of[st._cdata] = v
            # A consumer whose gradient storage is still alive and is now ours passed it through; so
            # did one whose storage was a part of the sum that is ours (a view of it: a transpose).
            passed = self._passed.pop(st._cdata, set())
            for w in self.succs.get(v, ()):
                theirs = self._grad_ref.get(w)
                if w in passed or theirs is not None and theirs[0] == st._cdata and theirs[1]() is st:
                    self.nodes[w].grad_passthrough = True
        return hook

    def _summed(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
        """The engine summed gradients ``a`` and ``b`` into ``out``: note the nodes whose own gradient
        storage (alive: the key is theirs) was a part, directly or through an earlier sum."""
        passed = self._passed.pop(a.untyped_storage()._cdata, set())
        for t in (a, b):
            st = t.untyped_storage()
            w = self._grad_of.get(st._cdata)
            if w is not None and self._grad_ref[w][1]() is st:
                passed.add(w)
        if passed:
            self._passed[out.untyped_storage()._cdata] = passed

    def _close_region(self) -> None:
        if self._open is not None:
            who, start, sums = self._open
            self._regions.append((who, self.workspace.over(self.counter.peak - start),
                                  range(sums, len(self.counter.sums.view_sums))))

    def run_backward(self, loss: torch.Tensor) -> None:
        self.mutations.active = False
        self._open = ("loss", self.counter.live, len(self.counter.sums.view_sums))
        self.counter.reset_peak()
        self.workspace.start()
        self.in_backward = True  # a failed backward fails the capture: no need to reset it then
        self.counter.sums.on_sum = self._summed
        loss.backward()
        self.counter.sums.on_sum = None
        self.in_backward = False
        self._close_region()
        self._open = None

    def add_node(self, rec: NodeRecord) -> int:
        v = len(self.nodes)
        self.nodes.append(rec)
        for u in rec.preds:
            self.succs.setdefault(u, []).append(v)
        return v

    def root(self, u: int) -> int:
        """The node whose storage node ``u``'s output lives in (itself unless a view or in-place write)."""
        while self.nodes[u].alias_of is not None:
            u = self.nodes[u].alias_of
        return u

    def finish(self, param_bytes: dict[str, int]) -> None:
        """Derive backward workspace from the recorded regions; pin the nodes whose inputs were
        written in place (:mod:`autoremat.capture.inplace`), those sharing an autocast cast
        (:mod:`autoremat.capture.shared_casts`) and the calls changing a container in place
        (:mod:`autoremat.capture.container_writes`)."""
        settle_unread_saves(self.nodes, self.succs, self.root, self.input_grads.held)
        for v, writer in self.mutations.pinned().items():
            if not 0 <= v < len(self.nodes):  # a block call read it (autoremat.capture.blocks)
                continue
            if isinstance(writer, int) and not 0 <= writer < len(self.nodes):
                writer = "a block captured op by op"
            self.nodes[v].recomputable = False
            self.pinned[self.nodes[v].name] = (self.nodes[writer].name if isinstance(writer, int)
                                                 else writer or "code between nodes")
        shared = self.casts.settle(self.nodes).nodes
        for v in shared:
            self.nodes[v].recomputable = False
        self.cast_pins = {self.nodes[v].name: param for v, param in shared.items()}
        block_ops = getattr(self, "block_of", {})
        for v, r in enumerate(self.nodes):
            for found, pins in ((self.writes.changed, self.write_pins), (self.writes.drew, self.rng_pins)):
                if r.module_path in found and v not in block_ops and r.kind != "glue":
                    r.recomputable = False
                    pins[r.name] = found[r.module_path]
        self.writes.said({**self.write_pins, **self.pinned_regions_by_write},
                         {**self.rng_pins, **self.pinned_regions_by_rng})
        self.input_grads.apply(self.nodes)
        for r in self.nodes:  # an output's first gradient is the loss's seed, priced as the sum (Graph.grad_bytes)
            r.first_grad_view = r.first_grad_view and not r.is_output
        for who, delta, sums in self._regions:
            # a sum after a first gradient that was a view: the cost model's, where the second arrives
            delta -= sum(self.counter.sums.view_sums[i] for i in sums
                         if (v := self._view_sum_of.get(i)) is not None and self.nodes[v].first_grad_view)
            if who == "loss":
                modelled = sum(seed_bytes(self.nodes, self.succs, v) for v, r in enumerate(self.nodes)
                               if r.is_output and r.requires_grad)
                self.loss_bwd_temp_bytes = max(0, delta - modelled - self.loss_seed_bytes)  # held: loss_held_bytes
                continue
            rec = self.nodes[who]
            modelled = 0
            parts = dict(rec.grad_part)  # the gradients the cost model gives the inputs
            if not rec.grad_passthrough:
                modelled += sum(parts.get(u, self.nodes[u].out_bytes) for u in rec.preds if self.nodes[u].requires_grad)
            modelled += sum(self.nodes[u].out_bytes for u in rec.grad_new)
            for p in rec.params:  # the first use in backward allocates p's gradient; a later use's
                if p in param_bytes:  # contribution is the transient the cost model charges beside it
                    modelled += param_bytes[p]
            rec.bwd_temp_bytes = max(0, delta - modelled)


_MODULE_KINDS = {
    "conv": "conv", "linear": "linear", "batchnorm": "bn", "layernorm": "norm", "groupnorm": "norm",
    "relu": "act", "gelu": "act", "silu": "act", "sigmoid": "act", "tanh": "act", "softmax": "act",
    "pool": "pool", "dropout": "dropout", "embedding": "embedding", "upsample": "resize",
}


def classify_module(mod: torch.nn.Module) -> str:
    name = original_class(mod).__name__.lower()  # an FSDP2 unit's class is a generated subclass
    for key, kind in _MODULE_KINDS.items():
        if key in name:
            return kind
    return name


_FUNC_KINDS = {
    "add": "add", "iadd": "add", "sub": "add", "mul": "mul", "truediv": "mul", "div": "mul",
    "cat": "cat", "stack": "cat", "matmul": "matmul", "bmm": "matmul", "mm": "matmul",
    "conv": "conv", "linear": "linear", "relu": "act", "gelu": "act", "softmax": "act",
    "view": "view", "reshape": "view", "flatten": "view", "transpose": "view", "permute": "view",
    "getitem": "view", "contiguous": "copy", "interpolate": "resize", "pool": "pool",
    "dropout": "dropout", "mean": "reduce", "sum": "reduce", "size": "meta",
}


def classify_function(target: Any) -> str:
    name = getattr(target, "__name__", str(target)).lower().strip("_")
    for key, kind in _FUNC_KINDS.items():
        if key in name:
            return kind
    return name
