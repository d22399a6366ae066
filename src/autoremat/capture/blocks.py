"""Repeated blocks captured op by op at module level (issue 24: choices inside the layer).

A module-level capture makes each repeated block (a member of an ``nn.ModuleList`` /
``nn.Sequential``: a transformer layer) one node, so the least plan it can express is per-layer
checkpointing. With ``blocks="ops"`` the blocks are captured op by op instead: every ATen op
the block's call dispatches becomes a node (recorded like the glue between modules: storages,
views, what autograd saves, backward workspace), with

* ``scope``: the module calls it runs inside, from the block down (``model.layers.3``,
  ``model.layers.3.mlp``, ``model.layers.3.mlp.down_proj``); every such call is a *call region*
  (:meth:`autoremat.graph.Graph.call_regions`) that a plan may recompute as one checkpoint
  region: the whole block, or a sub-module of it (a layer split into several regions);
* ``op_index``: the op's position in the block call's op sequence as selective checkpointing
  counts it (``torch.utils.checkpoint.SAC_IGNORED_OPS`` left out); ``meta["call_op_start"]``
  says where each call region's own sequence starts, so a plan can name kept ops by their
  index in the region it wraps (:mod:`autoremat.runtime.selective`).

Op nodes are not recomputable on their own (``recomputable=False``: solvers that recompute
single module-level nodes leave them alone); their call regions are, unless an input of the
block was written in place after the block read it (``meta["pinned_regions"]``: that call only).

Times: the op sequence is timed once under a dispatch mode (``perf_counter`` around each op);
each block call's forward time, measured with the model's own module hooks like any node, is
shared among its ops in proportion, and its backward time the same way.

Decision (option a of the issue, by measurement): ``torch.export`` gives an op graph of Hugging
Face models too, but its gradients differ from eager on Llama (see
:mod:`autoremat.runtime.selective`); recording the eager ops keeps the model's own code running.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import SAC_IGNORED_OPS

from ..call_names import call_name, plain_path
from .aliases import aliased
from ._recorder import tensors_in
from .kv_cache import cache_arguments

__all__ = ["BLOCK_MODES", "BlockScopes", "block_paths", "OpTimer", "settle_scopes", "share_times"]

BLOCK_MODES = ("auto", "module", "ops")
"""``capture(..., blocks=)``: repeated blocks as one node each, or op by op (``"auto"``: op by op)."""

_PSEUDO = 1 << 40
"""Ids of block calls in the mutation log (above any node id)."""


def block_paths(model: nn.Module, node_paths: Sequence[str],
                modules: Mapping[str, nn.Module] | None = None) -> list[str]:
    """The node modules of ``node_paths`` that are repeated blocks: members of a container
    (``ModuleList``, ``Sequential``, ``ModuleDict``) that have submodules. ``modules``: the
    model's modules by path to look in instead of its own (a sharded model's canonical ones)."""
    mods = dict(model.named_modules()) if modules is None else dict(modules)
    containers = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
    out = []
    for path in node_paths:
        parent = path.rpartition(".")[0]
        if parent in mods and isinstance(mods[parent], containers) and next(mods[path].children(), None) is not None:
            out.append(path)
    return out


class BlockScopes:
    """The module-call stack, op counter and call starts while a block is recorded op by op."""

    def __init__(self, model: nn.Module, blocks: Collection[str]) -> None:
        self.blocks = set(blocks)
        self.active: str | None = None
        self.stack: list[str] = []
        self.stack_calls: list[int] = []
        """The index of each call of :attr:`stack` among the calls of its module in the step."""
        self.count = 0
        self.calls: dict[str, int] = {}
        self.start: dict[tuple[str, int], int] = {}
        """(path, call index) -> where that call's op sequence starts in its block call's."""
        self.block_calls: list[str] = []
        """The blocks in call order (one entry per call)."""
        self.cache_calls: dict[str, str] = {}
        """Calls inside the blocks handed a key/value cache (:mod:`autoremat.capture.kv_cache`)."""
        self.owner: Mapping[int, int] = {}
        """Storage -> the node that made it (the recorder's), for :meth:`hold_args`."""
        self.held: dict[int, set[int]] = {}
        """Per depth of :attr:`stack`: the nodes whose outputs that call takes as arguments without gradients and
        no op of its own has listed yet (:meth:`hold_args`)."""
        self._inner: list[tuple[str, nn.Module]] = []
        mods = dict(model.named_modules())
        several = aliased(model)  # one object at several paths: no scope of its own (capture.aliases)
        for path in blocks:
            for name, sub in mods[path].named_modules():
                if name and id(sub) not in several:
                    self._inner.append((f"{path}.{name}", sub))

    def pseudo_id(self) -> int | None:
        """An id for the block call now running (the mutation log's reader), else ``None``."""
        return None if self.active is None else _PSEUDO + len(self.block_calls) - 1

    def hold_args(self, args: tuple, kwargs: dict | None) -> None:
        """Note the nodes that made the tensors the call just entered takes without gradients: a recomputed call
        region (``torch.utils.checkpoint``) holds every argument until its backward, read or not
        (``nn.Transformer``'s decoder layers take ``tgt_mask`` and, told ``tgt_is_causal``, never read it), so the
        call's first op of its own (not one inside a call it makes: that call's region does not hold them) lists
        them as inputs (:meth:`take_held`); a call with no op of its own lists none. Arguments with gradients are
        left out: an edge from them would be a gradient the op never gives."""
        held = self.held.setdefault(len(self.stack), set())
        for t in tensors_in((args, kwargs or {})):
            if t.layout is torch.strided and not t.requires_grad and (k := t.untyped_storage()._cdata) in self.owner:
                held.add(self.owner[k])

    def take_held(self) -> set[int]:
        """The nodes :meth:`hold_args` noted for the innermost call now running (its op being recorded takes them)."""
        return self.held.pop(len(self.stack), set())

    def enter_block(self, path: str, args: tuple = (), kwargs: dict | None = None) -> None:
        self.active = path
        self.stack = [path]
        self.held.clear()
        self.hold_args(args, kwargs)
        self.count = 0
        self.calls[path] = self.calls.get(path, 0) + 1
        self.stack_calls = [self.calls[path] - 1]
        self.start[(path, self.calls[path] - 1)] = 0
        self.block_calls.append(path)

    def leave_block(self) -> None:
        self.active = None
        self.held.clear()
        self.stack = []
        self.stack_calls = []

    def count_op(self, func: Any) -> int | None:
        """The op's index in the block call's sequence (``None`` for ops selective checkpointing
        ignores)."""
        if func in SAC_IGNORED_OPS:
            return None
        i = self.count
        self.count += 1
        return i

    def register(self) -> list[Any]:
        """Hooks on every module inside the blocks that keep the call stack; returns the handles."""
        handles = []
        for path, mod in self._inner:
            handles.append(mod.register_forward_pre_hook(self._pre(path), with_kwargs=True))
            handles.append(mod.register_forward_hook(self._post(path)))
        return handles

    def _pre(self, path: str) -> Callable[..., None]:
        def hook(_m: nn.Module, args: tuple, kwargs: dict) -> None:
            if self.active is not None:
                if names := cache_arguments(args, kwargs):
                    self.cache_calls[path] = ", ".join(names)
                self.stack.append(path)
                self.hold_args(args, kwargs)
                self.calls[path] = self.calls.get(path, 0) + 1
                self.stack_calls.append(self.calls[path] - 1)
                self.start[(path, self.calls[path] - 1)] = self.count
        return hook

    def _post(self, path: str) -> Callable[..., None]:
        def hook(_m: nn.Module, _a: tuple, _o: Any) -> None:
            if self.active is not None and self.stack and self.stack[-1] == path:
                self.held.pop(len(self.stack), None)  # no op of its own took them
                self.stack.pop()
                self.stack_calls.pop()
        return hook

    def scope(self) -> tuple[str, ...]:
        """The current call stack (plain paths; :meth:`call_indices` says which call of each)."""
        return tuple(self.stack)

    def call_indices(self) -> tuple[int, ...]:
        """The index of each call of :meth:`scope` among its module's calls so far in the step."""
        return tuple(self.stack_calls)

    def named(self, scope: tuple[str, ...], calls: tuple[int, ...]) -> tuple[str, ...]:
        """Scope entries named per call once the step is over (:func:`~autoremat.call_names.call_name`)."""
        return tuple(call_name(p, k, self.calls[p]) for p, k in zip(scope, calls))

    def call_starts(self) -> dict[str, int]:
        """Call name -> where its op sequence starts (``meta["call_op_start"]``)."""
        return {call_name(p, k, self.calls[p]): i for (p, k), i in self.start.items()}


class OpTimer(TorchDispatchMode):
    """Times every op dispatched inside the blocks (``perf_counter``), per block call in order."""

    def __init__(self, scopes: BlockScopes) -> None:
        super().__init__()
        self.scopes = scopes
        self.times: list[dict[int, float]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if self.scopes.active is None or func in SAC_IGNORED_OPS:
            return func(*args, **(kwargs or {}))
        if len(self.times) < len(self.scopes.block_calls):
            self.times.append({})
        i = self.scopes.count_op(func)
        t0 = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.times[-1][i] = time.perf_counter() - t0  # type: ignore[index]
        return out


def share_times(block_of: Mapping[int, tuple[int, int]], op_times: Sequence[Mapping[int, float]],
                call_fwd: Sequence[float], call_bwd: Sequence[float]) -> dict[int, tuple[float, float]]:
    """Forward and backward time per op node: each block call's measured times shared among its
    op nodes in proportion to their op times. ``block_of``: node -> (block call, op index)."""
    totals: dict[int, float] = {}
    for v, (call, i) in block_of.items():
        totals[call] = totals.get(call, 0.0) + op_times[call].get(i, 0.0)
    out: dict[int, tuple[float, float]] = {}
    counts: dict[int, int] = {}
    for _v, (call, _i) in block_of.items():
        counts[call] = counts.get(call, 0) + 1
    for v, (call, i) in block_of.items():
        total = totals[call]
        share = op_times[call].get(i, 0.0) / total if total > 0 else 1.0 / counts[call]
        out[v] = (call_fwd[call] * share, call_bwd[call] * share)
    return out


def settle_scopes(rec: Any, scopes: BlockScopes) -> None:
    """Once the step is over, name the op nodes' scope entries per call (``rec.scope_calls``);
    record where each call's op sequence starts (``rec.call_op_start``) and which call regions
    are pinned (``rec.pinned_regions``: an input written in place after the block read it, a
    key/value cache handed to the call, or an autocast parameter cast read twice: :mod:`.shared_casts`).
    ``rec``: the module capture's recorder."""
    pinned_calls = {v - _PSEUDO for v in rec.mutations.pinned() if v >= len(rec.nodes)}
    pinned: set[str] = set()
    for v, (call, _i) in rec.block_of.items():
        r = rec.nodes[v]
        r.scope = scopes.named(r.scope, rec.scope_calls[v])
        if call in pinned_calls:
            pinned.update(r.scope)
    rec.call_op_start = scopes.call_starts()
    rec.cache_calls.update(scopes.cache_calls)
    cached = {name for name in rec.call_op_start if plain_path(name) in rec.cache_calls}
    casts = rec.casts.settle(rec.nodes).regions  # autocast: .shared_casts
    rec.pinned_regions_by_write = {name: rec.writes.changed[plain_path(name)] for name in rec.call_op_start
                                   if plain_path(name) in rec.writes.changed}  # .container_writes
    rec.pinned_regions_by_rng = {name: rec.writes.drew[plain_path(name)] for name in rec.call_op_start
                                 if plain_path(name) in rec.writes.drew}  # .host_rng
    rec.pinned_regions = sorted(pinned | cached | set(casts) | set(rec.pinned_regions_by_write)
                                | set(rec.pinned_regions_by_rng))
