"""What is resident before a training step, and which device a model runs on.

One definition, used by capture (``Graph.meta["resident_bytes"]``), the integrations (the device
budget minus the resident bytes is the step-peak budget) and the benchmarks (a simulated device's
capacity minus the resident bytes is what a step may create).

**Resident bytes** are the bytes of distinct storages (a storage shared by tied weights or by
views is counted once) of the module's parameters and buffers, the step's inputs, the
optimizers' state and, depending on ``grads``, the parameter gradients:

* ``grads="none"``: not counted (capture: the graph models the gradients a step creates);
* ``grads="present"``: the gradients allocated now (a measurement, e.g. the benchmarks' device);
* ``grads="expected"``: every trainable parameter's gradient, allocated or not (Lightning's
  automatic optimisation zeroes gradients only after ``training_step``, so the previous step's
  gradients are live during the forward).

Optimizer state is created lazily at the first ``step``. ``optimizer_state="present"`` counts
what exists; ``"expected"`` counts what exists or, for an optimizer that has none yet, an
estimate from its type (:func:`optimizer_state_bytes`).

Sharded models (FSDP, issue 21): a ``DTensor`` counts with its local shard, an FSDP1 flat
parameter is one already, so a sharded model's resident bytes are this rank's. ``shard_over``
(> 1) predicts them for a model that is not sharded yet: parameter, gradient and optimizer-state
bytes divided by the world size it will be sharded over (buffers and inputs are not sharded).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from ._fsdp import local_tensor

__all__ = ["device_of", "storage_bytes", "resident_bytes", "allocated_resident_bytes", "optimizer_state_bytes"]

_LAZY_STATE_SLOTS = {"Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2, "Adadelta": 2, "Rprop": 2}
_GRADS = ("none", "present", "expected")
_STATES = ("present", "expected")


def device_of(module: nn.Module, args: Any = (), kwargs: Any = None) -> torch.device:
    """The device of ``module``'s first parameter, else of the first tensor input, else the CPU."""
    for p in module.parameters():
        return p.device
    for t in _tensors((args, kwargs or {})):
        return t.device
    return torch.device("cpu")


def storage_bytes(obj: Any) -> int:
    """Bytes of the distinct storages of the tensors in ``obj`` (nested lists, tuples, dicts)."""
    seen: dict[int, int] = {}
    for t in _tensors(obj):
        st = t.untyped_storage()
        seen[st._cdata] = st.nbytes()
    return int(sum(seen.values()))


def resident_bytes(
    module: nn.Module,
    *,
    inputs: Any = (),
    optimizers: Iterable[torch.optim.Optimizer] = (),
    grads: Literal["none", "present", "expected"] = "none",
    optimizer_state: Literal["present", "expected"] = "expected",
    shard_over: int = 1,
) -> int:
    """Bytes resident before a step of ``module`` on ``inputs`` (see the module docstring)."""
    if grads not in _GRADS:
        raise ValueError(f"grads={grads!r} must be one of {_GRADS}")
    if optimizer_state not in _STATES:
        raise ValueError(f"optimizer_state={optimizer_state!r} must be one of {_STATES}")
    if isinstance(shard_over, bool) or not isinstance(shard_over, int) or shard_over < 1:
        raise ValueError(f"shard_over={shard_over!r} must be an int >= 1 (the world size the model will be sharded over)")
    params = list(module.parameters())
    items: list[Any] = [params]
    if grads == "present":
        items.append([p.grad for p in params if p.grad is not None])
    optimizers = list(optimizers)
    items += [list(opt.state.values()) for opt in optimizers]
    sharded = storage_bytes(items)
    if grads == "expected":
        sharded += sum(local_tensor(p).numel() * p.element_size() for p in _distinct(params) if p.requires_grad)
    if optimizer_state == "expected":
        sharded += sum(optimizer_state_bytes(opt) for opt in optimizers if not _has_state(opt))
    total = storage_bytes([list(module.buffers()), inputs]) + -(-sharded // shard_over)
    return int(total)


def allocated_resident_bytes(module: nn.Module, *, device: torch.device | str, inputs: Any = (),
                             optimizers: Iterable[torch.optim.Optimizer] = ()) -> int:
    """The part of the resident bytes that exists on ``device`` now (distinct storages of the
    parameters, buffers, allocated gradients, existing optimizer state and the inputs).

    Free device memory already excludes these; what a device budget of ``"auto"`` must still keep
    room for is the rest of :func:`resident_bytes`: gradients and optimizer state that are not
    allocated yet (an optimizer's state appears at its first ``step``, while the step budget
    holds from the second step on), and inputs not yet moved to the device."""
    dev = torch.device(device)
    params = list(module.parameters())
    items = [params, [p.grad for p in params if p.grad is not None], list(module.buffers()),
             [list(opt.state.values()) for opt in optimizers], inputs]
    on_device = [t for t in _tensors(items) if _same_device(t.device, dev)]
    return storage_bytes(on_device)


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type != "cuda" or a.index is None or b.index is None:
        return True
    return a.index == b.index


def optimizer_state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of ``opt``'s state; before its first step (state is created lazily) an estimate from
    its type: Adam-family two tensors per parameter, SGD with momentum one, RMSprop one to three."""
    if _has_state(opt) or not opt.param_groups:
        return storage_bytes(list(opt.state.values()))
    total = 0
    name = type(opt).__name__
    for group in opt.param_groups:
        slots = _LAZY_STATE_SLOTS.get(name, 0)
        if name == "SGD" and group.get("momentum", 0):
            slots = 1
        if name == "RMSprop":
            slots = 1 + bool(group.get("momentum", 0)) + bool(group.get("centered", False))
        total += slots * sum(local_tensor(p).numel() * p.element_size() for p in group["params"] if p.requires_grad)
    return int(total)


def _has_state(opt: torch.optim.Optimizer) -> bool:
    return storage_bytes(list(opt.state.values())) > 0


def _distinct(params: list[nn.Parameter]) -> list[nn.Parameter]:
    seen: dict[int, nn.Parameter] = {}
    for p in params:
        seen.setdefault(id(p), p)
    return list(seen.values())


def _tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors in ``obj``; a ``DTensor`` as its local shard (what this rank holds)."""
    return [local_tensor(t) for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]
