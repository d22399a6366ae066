"""In-place operations: rewritten out of place where that is exact, pinned where it is not.

A recomputed region keeps its inputs and replays its forward in backward. An in-place op breaks
that in two ways: it changes a region's kept input after the region ran (the recomputation
would start from the changed value; the runtime's version check reports it,
:class:`~autoremat.runtime.region`'s ``_SavedInput``), or it runs inside the region on one of the
region's inputs (the replay would apply it a second time). torchvision-style models write in
place everywhere (``nn.ReLU(inplace=True)``, ``out += identity``), so plans must respect it.

Two mechanisms, decided by measurement on the torchvision-style bottleneck ResNet
(``autoremat.zoo.resnet50(inplace=True)``; numbers in ``tests/capture/test_inplace.py`` and the report
of issue 26):

1. **Out of place where exact** (:func:`out_of_place`, op level). ``trace`` rewrites each
   in-place op of the traced graph whose effect nothing else can observe into its out-of-place
   form, and points the later users of the mutated value at the result. Capture and
   :func:`autoremat.apply` both trace through it, so what is measured is what runs and the
   fingerprints agree. The graph is then the one of the same network written out of place:
   every solver's least budget is that network's (no constraint is added), and the patched
   forward's peak is the out-of-place one (the unpatched model, in place, may peak a little
   lower: the overwritten tensor is freed one op earlier). The rewrite is exact when

   * the op is on a short list whose out-of-place form computes the same values and whose
     backward computes bit-for-bit the same gradients (``relu_`` / ``ReLU(inplace=True)``,
     ``hardtanh`` / ``ReLU6`` / ``leaky_relu`` with ``inplace=True``, ``add_``, ``sub_``,
     ``mul_``, ``div_``, ``sigmoid_``, ``tanh_``, ``masked_fill_``, ``operator.iadd`` and friends;
     tested against the in-place op); an ``nn`` module is rewritten only without hooks on it;
   * the mutated value is produced by an op of the graph: not a model input, parameter or
     buffer, nor (transitively) a possible view of one;
   * no possible alias of it (a view, or the result of an op not known to return a fresh tensor)
     is used after the op, and no other argument of the op is such an alias.

   Aliasing is decided statically and conservatively: an op counts as returning a fresh tensor
   only if it is on a list (convolutions, linear, norms, pools, activations, arithmetic…);
   anything else (views, ``reshape``, ``getitem``, ``Dropout``, ``Identity``, user functions)
   may alias all of its inputs. Mixed-dtype in-place arithmetic (``half_tensor.add_(float_tensor)``
   keeps ``half``, ``add`` promotes) is the one inexactness the rewrite does not see, the one
   ``torch.fx`` itself already has for ``a += b`` (which it traces as ``a + b``).

2. **Pinned where not** (:class:`MutationLog`, both capture levels). During the recorded step
   every ATen op is seen with its schema's write annotations. A node whose input storage (any
   tensor it read that it did not create) is written in place from the moment it read it until
   the end of the forward and loss, by itself or by anyone later, is made non-recomputable
   (``recomputable=False``): the solvers already respect that (segments hold only recomputable
   nodes), so no recomputed region ever keeps or replays a tensor that is written in place, and
   the simulator counts what such a node keeps like any other kept node. This covers what the
   rewrite leaves (in-place ops on views, on model inputs, ``Dropout(inplace=True)``,
   ``setitem``, ``out=``), and at module level (Hugging Face style captures, where version
   counters of the recorded step would say the same for the tensors still alive, but the log
   also sees tensors whose Python object died) e.g. a leaf ``ReLU(inplace=True)`` applied to a
   recomputable module's output. Writes by a module node to the buffers of the model (batch-norm
   statistics) are left out: the runtime restores the buffers of the modules it recomputes. A
   write to a parameter is not (``nn.Embedding(max_norm=...)`` renormalises the rows it looks up
   in place): the node is pinned, as a replay would write the parameter a second time.

   Keeping an unmutated copy of a written input instead of pinning was not built: measured on
   the zoo's in-place ResNet-50 (``size="small"`` shapes, batch 4, CPU), the rewrite leaves
   nothing to pin at op level (all 49 in-place ops run out of place; the captured graph has the
   out-of-place network's nodes, edges and bytes, and the solvers' least budgets are that
   network's except chen +2.9 % and reforward +2.0 %, on measured and on the papers' times
   alike: both follow the node order, and torchvision computes the down-sampling branch after
   the main one), and at module level only the stem's ``ReLU(inplace=True)`` is pinned,
   while the least budgets come out 3-10 % *below* the out-of-place network's (the blocks'
   in-place ReLUs really share storage). A copy would cost a whole activation per pinned node
   for a gain these graphs do not offer.
"""

from __future__ import annotations

import logging
import operator
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from ..measure import op_tensors

__all__ = ["out_of_place", "mutated_input", "write_order", "MutationLog", "written_storages"]

logger = logging.getLogger(__name__)

_OPS = ("call_module", "call_function", "call_method")

# --------------------------------------------------------------------------- static analysis
_IOPS_EXACT: dict[Any, Any] = {operator.iadd: operator.add, operator.isub: operator.sub,
                               operator.imul: operator.mul, operator.itruediv: operator.truediv}
_IOPS_OTHER = frozenset({operator.ifloordiv, operator.imod, operator.ipow, operator.iand, operator.ior,
                         operator.ixor, operator.ilshift, operator.irshift, operator.imatmul, operator.setitem})
_METHODS_EXACT = frozenset({"add_", "sub_", "mul_", "div_", "relu_", "sigmoid_", "tanh_", "masked_fill_"})
_NOT_DATA_WRITES = frozenset({"requires_grad_", "share_memory_", "retain_grad"})
_FUNCTIONS_EXACT: dict[Any, Any] = {torch.relu_: torch.relu, F.relu_: F.relu, torch.sigmoid_: torch.sigmoid,
                                    torch.tanh_: torch.tanh}
# functions taking ``inplace``: the position of that argument
_INPLACE_ARG: dict[Any, int] = {F.relu: 1, F.relu6: 1, F.hardtanh: 3, F.leaky_relu: 2, F.elu: 2, F.selu: 1,
                                F.celu: 2, F.threshold: 3, F.dropout: 3, F.dropout1d: 3, F.dropout2d: 3,
                                F.dropout3d: 3, F.alpha_dropout: 3, F.feature_alpha_dropout: 3, F.rrelu: 4,
                                F.silu: 1, F.mish: 1, F.hardswish: 1, F.hardsigmoid: 1}
_INPLACE_EXACT = frozenset({F.relu, F.relu6, F.hardtanh, F.leaky_relu})

_FRESH_MODULES: tuple[type, ...] = (
    nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d, nn.Linear,
    _BatchNorm, nn.LayerNorm, nn.GroupNorm, nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d,
    nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.Embedding,
    nn.Upsample, nn.Softmax, nn.LogSoftmax, nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid,
    nn.LeakyReLU, nn.ELU, nn.Hardswish, nn.Hardsigmoid, nn.Hardtanh, nn.Mish, nn.LocalResponseNorm)
_FRESH_FUNCTIONS = frozenset({
    operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.matmul, operator.neg,
    operator.pow, operator.mod, torch.add, torch.sub, torch.mul, torch.div, torch.matmul, torch.mm, torch.bmm,
    torch.cat, torch.stack, torch.relu, torch.sigmoid, torch.tanh, torch.exp, torch.softmax, torch.log_softmax,
    torch.sum, torch.mean, torch.conv1d, torch.conv2d, torch.conv3d, F.relu, F.relu6, F.hardtanh, F.leaky_relu,
    F.gelu, F.silu, F.elu, F.conv1d, F.conv2d, F.conv3d, F.linear, F.layer_norm, F.batch_norm, F.group_norm,
    F.softmax, F.log_softmax, F.max_pool2d, F.avg_pool2d, F.adaptive_avg_pool2d, F.interpolate, F.embedding,
    F.scaled_dot_product_attention})
_FRESH_METHODS = frozenset({"add", "sub", "mul", "div", "matmul", "relu", "sigmoid", "tanh", "exp", "softmax",
                            "log_softmax", "sum", "mean", "pow", "neg", "clone", "masked_fill", "size", "dim",
                            "numel", "__add__", "__mul__", "__sub__", "__truediv__"})


def _module(gm: torch.fx.GraphModule, n: torch.fx.Node) -> nn.Module:
    return gm.get_submodule(str(n.target))


def _inplace_flag(n: torch.fx.Node) -> bool:
    pos = _INPLACE_ARG.get(n.target)
    if pos is None:
        return n.kwargs.get("inplace") is True
    if len(n.args) > pos:
        return n.args[pos] is True
    return n.kwargs.get("inplace") is True


def mutated_input(gm: torch.fx.GraphModule, n: torch.fx.Node) -> torch.fx.Node | None:
    """The graph node whose value ``n`` writes in place, if ``n`` is an in-place op on one."""
    target: Any = None
    if n.op == "call_method":
        name = str(n.target)
        if name.endswith("_") and not name.startswith("_") and name not in _NOT_DATA_WRITES:
            target = n.args[0]
    elif n.op == "call_function":
        name = getattr(n.target, "__name__", "")
        if n.target in _IOPS_EXACT or n.target in _IOPS_OTHER or _inplace_flag(n) or (
                name.endswith("_") and not name.startswith("_") and name not in _NOT_DATA_WRITES):
            target = n.args[0] if n.args else None
        elif isinstance(n.kwargs.get("out"), torch.fx.Node):
            target = n.kwargs["out"]
    elif n.op == "call_module" and getattr(_module(gm, n), "inplace", False) is True:
        target = n.args[0] if n.args else None
    return target if isinstance(target, torch.fx.Node) else None


def _fresh(gm: torch.fx.GraphModule, n: torch.fx.Node) -> bool:
    """Whether ``n`` certainly returns new storage (never a view or its input itself)."""
    if n.op == "call_module":
        mod = _module(gm, n)
        return isinstance(mod, _FRESH_MODULES) and getattr(mod, "inplace", False) is not True
    if n.op == "call_function":
        return n.target in _FRESH_FUNCTIONS and not _inplace_flag(n)
    if n.op == "call_method":
        return str(n.target) in _FRESH_METHODS
    return False


def _alias_classes(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, torch.fx.Node]:
    """Union-find over possible aliasing: a node that may not return fresh storage joins the
    class of every node it takes (placeholders and ``get_attr`` included); an in-place op joins
    the class of the node it writes."""
    parent: dict[torch.fx.Node, torch.fx.Node] = {}

    def find(x: torch.fx.Node) -> torch.fx.Node:
        root = x
        while parent.get(root, root) is not root:
            root = parent[root]
        while x is not root:
            parent[x], x = root, parent.get(x, x)
        return root

    for n in gm.graph.nodes:
        if n.op in _OPS and not _fresh(gm, n):
            written = mutated_input(gm, n)  # an in-place op returns the tensor it writes, nothing else
            for u in ([written] if written is not None else n.all_input_nodes):
                parent[find(n)] = find(u)
    return {n: find(n) for n in gm.graph.nodes}


def _exact(k: torch.fx.Node, m: torch.fx.Node, cls: list[torch.fx.Node], pos: dict[torch.fx.Node, int]) -> bool:
    """Whether writing ``m`` in place at ``k`` is unobservable except through ``m``'s later users;
    ``cls``: the nodes that may alias ``m``."""
    if m.op not in _OPS:
        return False
    if any(a.op in ("placeholder", "get_attr") for a in cls):
        return False
    members = set(cls)
    if any(u is not m and u in members for u in k.all_input_nodes):
        return False
    for a in cls:
        if a is m or a is k or pos[a] > pos[k]:
            continue
        if any(pos[u] > pos[k] for u in a.users):
            return False
    return True


def _rewrite(gm: torch.fx.GraphModule, k: torch.fx.Node) -> bool:
    """Turn ``k`` into its out-of-place form in place (same node, same name); ``False`` when it
    has none on the exact list."""
    if k.op == "call_method":
        if str(k.target) not in _METHODS_EXACT:
            return False
        k.target = str(k.target)[:-1]
        return True
    if k.op == "call_function":
        if k.target in _IOPS_EXACT:
            k.target = _IOPS_EXACT[k.target]
            return True
        if k.target in _FUNCTIONS_EXACT:
            k.target = _FUNCTIONS_EXACT[k.target]
            return True
        if k.target in _INPLACE_EXACT and not k.kwargs.get("out"):
            pos = _INPLACE_ARG[k.target]
            if len(k.args) > pos:
                k.args = (*k.args[:pos], False, *k.args[pos + 1:])
            else:
                k.kwargs = {**k.kwargs, "inplace": False}
            return True
        return False
    return _rewrite_module(gm, k)


def _rewrite_module(gm: torch.fx.GraphModule, k: torch.fx.Node) -> bool:
    mod = _module(gm, k)
    if mod._forward_hooks or mod._forward_pre_hooks or len(k.args) != 1 or k.kwargs:
        return False
    kind = type(mod)
    if kind is nn.ReLU:
        fn, extra = F.relu, ()
    elif kind in (nn.ReLU6, nn.Hardtanh):  # ReLU6 is a Hardtanh(0, 6)
        fn, extra = F.hardtanh, (float(mod.min_val), float(mod.max_val))
    elif kind is nn.LeakyReLU and mod.negative_slope >= 0:
        fn, extra = F.leaky_relu, (float(mod.negative_slope),)
    else:
        return False
    k.op, k.target, k.args = "call_function", fn, (k.args[0], *extra)
    return True


def out_of_place(gm: torch.fx.GraphModule) -> list[str]:
    """Rewrite, in ``gm``'s graph, the in-place ops whose out-of-place form is exact (see the
    module docstring); returns the names of the rewritten nodes (also in
    ``gm.meta["autoremat_out_of_place"]``) and recompiles ``gm`` if any.

    One pass in graph order. The alias classes are computed once, before any rewrite: a rewrite
    only removes aliasing (the rewritten op returns fresh storage), so the classes stay a
    coarser, conservative partition for the later checks."""
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    root = _alias_classes(gm)
    classes: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for n in nodes:
        classes.setdefault(root[n], []).append(n)
    done: list[str] = []
    for k in nodes:
        m = mutated_input(gm, k) if k.op in _OPS else None
        if m is None or not _exact(k, m, classes[root[m]], pos) or not _rewrite(gm, k):
            continue
        for u in list(m.users):
            if u is not k and pos[u] > pos[k]:
                u.replace_input_with(m, k)
        done.append(k.name)
    if done:
        gm.recompile()
        logger.debug("autoremat: ran %d in-place ops out of place: %s", len(done), ", ".join(done))
    gm.meta["autoremat_out_of_place"] = done
    return done

def write_order(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, set[torch.fx.Node]]:
    """Order edges for the in-place ops left in place (after :func:`out_of_place`): each reads
    after every earlier node reading a possible alias of the tensor it writes, and every later
    such node reads after it; ``{node: nodes it must follow}``. Without them a plan could run a
    reader of a model input before the forward normalised it in place (``x.sub_(mean)``, then
    ``self.a(x)``: ``a`` takes the placeholder, not the in-place op's result): measured, a plan
    recomputing ``a`` ran it first. The readers before a write are pinned already
    (:class:`MutationLog`), so an edge never makes a recomputed region take another input. Per alias
    class the writes are chained in program order and each reader is tied to the writes on either side
    of it only (the rest follows): edges linear in the class's readers and writes."""
    ops = [n for n in gm.graph.nodes if n.op in _OPS]
    written = {k: m for k in ops for m in [mutated_input(gm, k)] if m is not None}
    if not written:
        return {}
    root = _alias_classes(gm)
    events: dict[torch.fx.Node, list[tuple[torch.fx.Node, bool]]] = {}  # class -> (node, writes it) in order
    for n in ops:
        classes = {root[a] for a in n.all_input_nodes}
        if n in written:
            classes.discard(root[written[n]])
            events.setdefault(root[written[n]], []).append((n, True))
        for c in classes:
            events.setdefault(c, []).append((n, False))
    out: dict[torch.fx.Node, set[torch.fx.Node]] = {}
    for seq in events.values():
        if not any(w for _, w in seq):
            continue
        last_write, pending = None, []  # readers since the last write: they precede the next one
        for n, writes in seq:
            if writes:
                out.setdefault(n, set()).update(pending)
                if last_write is not None:
                    out[n].add(last_write)
                last_write, pending = n, []
            else:
                if last_write is not None:
                    out.setdefault(n, set()).add(last_write)
                pending.append(n)
    return out


# --------------------------------------------------------------------------- recorded writes
_WRITES: dict[Any, tuple[tuple[int, str], ...]] = {}


def _written_args(func: Any) -> tuple[tuple[int, str], ...]:
    """``(position, name)`` of the arguments an ATen op's schema marks as written (``Tensor(a!)``)."""
    got = _WRITES.get(func)
    if got is None:
        schema = getattr(func, "_schema", None)
        got = tuple((i, a.name) for i, a in enumerate(schema.arguments if schema is not None else ())
                    if a.alias_info is not None and a.alias_info.is_write)
        _WRITES[func] = got
    return got


def _written_tensors(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an ATen op writes in place (its schema's ``Tensor(a!)`` arguments)."""
    return [x for i, name in _written_args(func) for x in op_tensors(args[i] if i < len(args) else kwargs.get(name))]


def written_storages(func: Any, args: tuple, kwargs: dict) -> set[int]:
    """Keys of the storages an ATen op writes in place."""
    return {x.untyped_storage()._cdata for x in _written_tensors(func, args, kwargs)}


class MutationLog:
    """What each node read and what was written in place, op by op, during a recorded forward.

    ``who()`` names the node running an op (its id, ``"loss"``, or ``None`` between nodes);
    ``is_module(v)`` says whether node ``v`` is a module call (its writes to ``state``, the
    model's parameters and buffers, are the runtime's business). Storages are told apart by
    their Python object (a dead storage's key may be reused), so a write to a storage born after
    a node read another one at the same address does not count."""

    def __init__(self, who: Callable[[], int | str | None], is_module: Callable[[int], bool]) -> None:
        self.who = who
        self.is_module = is_module
        self.state: set[int] = set()
        self.active = False
        self._t = 0
        self._reads: dict[int, dict[weakref.ref, int]] = {}
        self._created: dict[int, set[weakref.ref]] = {}
        self._writes: dict[weakref.ref, list[tuple[int, int | str | None]]] = {}

    def watch_state(self, tensors: Iterable[torch.Tensor]) -> None:
        self.state = {t.untyped_storage()._cdata for t in tensors}

    def on_op(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """Called after every ATen op while the log is active (see ``LiveStorageCounter.on_op``)."""
        if not self.active:
            return
        t, self._t = self._t, self._t + 1
        v = self.who()
        ins = op_tensors((args, kwargs))
        if isinstance(v, int):
            created = self._created.setdefault(v, set())
            reads = self._reads.setdefault(v, {})
            in_refs = set()
            for x in ins:
                ref = weakref.ref(x.untyped_storage())
                in_refs.add(ref)
                if ref not in created and ref not in reads:
                    reads[ref] = t
            for x in op_tensors(out):
                ref = weakref.ref(x.untyped_storage())
                if ref not in in_refs:
                    created.add(ref)
        for x in _written_tensors(func, args, kwargs):
            st = x.untyped_storage()
            if isinstance(v, int) and st._cdata in self.state and self.is_module(v):
                continue
            self._writes.setdefault(weakref.ref(st), []).append((t, v))

    def pinned(self) -> dict[int, int | str | None]:
        """Nodes whose input storage was written in place after they read it: node -> writer."""
        out: dict[int, int | str | None] = {}
        for v, reads in self._reads.items():
            for ref, t in reads.items():
                for tw, writer in self._writes.get(ref, ()):
                    if tw >= t:
                        out[v] = writer
                        break
                if v in out:
                    break
        return out
