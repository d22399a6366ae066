"""The model as it was before autoremat ran it for its own purposes (a capture's profiling and
timing runs, a measured step, the Lightning callback's runs of ``training_step``), whether the
block succeeds or raises.

:func:`preserved_state`: RNG (torch's, Python's and numpy's: :mod:`.host_rng`), parameters (the
same objects, ``requires_grad``, ``.grad``, and the values of those a forward writes in place,
copied on their first write: :mod:`.param_writes`; the example batch likewise), buffers (the same
objects, their values, their shapes where the forward resized them), every module's ``training``
flag, and, by default, :func:`kept_attributes`.

:func:`kept_attributes`: every module's public attributes as they were (added ones removed,
rebound ones rebound; the root's private ones too with ``private_root``), the contents of the
lists, dicts and sets they hold (two levels: a dict of lists), and the values of the tensors
they hold, which a forward or a step may update in place. The last is what a ``torchmetrics``
metric's state is (``self.tp += ...`` in its ``update``): without it a training accuracy
accumulated in ``training_step`` counted the Lightning callback's rows in its epoch value (66 of
64 samples, measured), and a module counting its calls (``self.calls += 1``) counted a
capture's 9 runs. A tensor is copied beforehand only where a submodule holds it and up to
:data:`KEEP_BYTES` (metric states, counters), not the root's own (a LightningModule often holds
its dataset in a tensor attribute: a copy would take memory the user's budget did not give, and
on the simulated device of the tests a step that fitted ran out of memory); one changed in place
without a copy is left changed, with a warning naming it (its version counter tells). Private
attributes (``_``-prefixed: hooks, the state PyTorch, FSDP and compiled modules keep) of
submodules are left alone.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .container_writes import contents, put_back
from .host_rng import host_rng_kept
from .param_writes import held_copies

__all__ = ["preserved_state", "kept_attributes", "KEEP_BYTES"]

logger = logging.getLogger("autoremat")

KEEP_BYTES = 256 * 1024
"""The largest tensor attribute :func:`kept_attributes` copies to restore (a 100-class confusion
matrix of int64 is 80 KB)."""

_OWN = ("_parameters", "_buffers", "_modules")  # preserved_state's


@contextlib.contextmanager
def preserved_state(model: torch.nn.Module, devices: list[torch.device], attributes: bool = True,
                    private_root: bool = False) -> Iterator[None]:
    """Leave the model exactly as it was, whether the block succeeds or raises: RNG, buffers
    (the same objects, their values, ``requires_grad`` and no ``grad_fn``: a traced in-place
    buffer update can attach one), parameters (the same objects, ``requires_grad``, ``.grad``),
    every module's ``training`` flag and (``attributes``) :func:`kept_attributes` (with
    ``private_root``): off where the block patches the model itself."""
    modules = list(model.modules())
    held = [(m, dict(m._buffers), dict(m._parameters), m.training) for m in modules]
    buffers = {id(b): (b, b.detach().clone(), b.requires_grad) for _m, bufs, _p, _t in held
               for b in bufs.values() if b is not None}
    params = {id(p): (p, p.grad, p.requires_grad) for _m, _b, ps, _t in held for p in ps.values() if p is not None}
    versions = {k: p._version for k, (p, _g, _r) in params.items()}
    for p, _grad, _rg in params.values():
        p.grad = None  # backward would accumulate into the user's .grad tensors in place
    cuda_devices = [d for d in devices if d.type == "cuda"]
    with torch.random.fork_rng(devices=cuda_devices), host_rng_kept(), held_copies() as copies, \
            kept_attributes(model, private_root=private_root) if attributes else contextlib.nullcontext():
        try:
            yield
        finally:
            _put_back_written(params, versions, copies)
            for m, bufs, ps, training in held:
                if isinstance(m._buffers, dict):  # (a TorchScript module's are fixed views of its C++ module)
                    m._buffers.clear()
                    m._buffers.update(bufs)
                    m._parameters.clear()
                    m._parameters.update(ps)
                m.training = training
            for b, value, requires_grad in buffers.values():
                if b.grad_fn is not None or b.requires_grad != requires_grad:
                    b.detach_()
                    b.requires_grad_(requires_grad)
                _put_values(b, value)
            for p, grad, requires_grad in params.values():
                p.requires_grad_(requires_grad)
                p.grad = grad


@contextlib.contextmanager
def kept_attributes(obj: nn.Module, depth: int = 2, private_root: bool = False) -> Iterator[None]:
    """``obj``'s and its submodules' attributes as they were before the block (module docstring)."""
    def kept(m: nn.Module, k: str) -> bool:
        return k not in _OWN and (not k.startswith("_") or (private_root and m is obj))

    before = {m: {k: v for k, v in vars(m).items() if kept(m, k)} for m in obj.modules()}
    held = [(v, contents(v, depth)) for attrs in before.values() for k, v in attrs.items() if not k.startswith("_")]
    values = [(f"{type(m).__name__}.{k}", v, v._version, v.detach().clone() if m is not obj and _small(v) else None)
              for m, attrs in before.items() for k, v in attrs.items()
              if not k.startswith("_") and isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter)
              and not v.is_inference()]  # (no version counter; nor can it change outside inference mode)
    try:
        yield
    finally:
        for m, attrs in before.items():
            now = vars(m)
            for k in [k for k in now if k not in attrs and kept(m, k)]:
                del now[k]
            now.update(attrs)
        for v, held_items in held:
            put_back(v, held_items)
        _restore(values)


def _put_back_written(params: dict[int, tuple[nn.Parameter, Any, bool]], versions: dict[int, int],
                      copies: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """The values of the tensors (parameters, the batch) written in place in the block, from their
    copies (:mod:`.param_writes`); a warning for parameters written with no copy."""
    for t, copy in copies.values():
        _put_values(t, copy)
    for k, (p, _g, _r) in params.items():
        if p._version != versions[k] and k not in copies and p.device.type != "meta":  # (a meta one holds no values)
            logger.warning("autoremat ran the model for its own purposes (a capture, a measured step, the Lightning "
                           "callback's run of training_step) and its forward changed a parameter (%s, %s) in place "
                           "in a run after the first: that change stays", tuple(p.shape), p.dtype)


def _put_values(t: torch.Tensor, old: torch.Tensor) -> None:
    """``old``'s values into ``t`` in place, resized back first where the block resized it
    (``resize_``: a quantization observer's ``min_val`` starts empty and takes its shape in the
    first forward)."""
    with torch.no_grad():
        if t.shape != old.shape:
            t.resize_(old.shape)
        t.copy_(old)


def _small(v: torch.Tensor) -> bool:
    return v.numel() * v.element_size() <= KEEP_BYTES


def _restore(values: list[tuple[str, torch.Tensor, int, torch.Tensor | None]]) -> None:
    """Copy the old values back into the tensors the block changed in place (their version moved)."""
    with torch.no_grad():
        for name, v, version, old in values:
            if v._version == version:
                continue
            if old is not None and v.dtype == old.dtype and v.device == old.device:
                _put_values(v, old)
            else:
                logger.warning("autoremat ran the model for its own purposes (a capture, a measured step, the Lightning "
                               "callback's run of training_step) and it changed tensor attribute %s (%s, %s) in "
                               "place, which was not copied beforehand (over %d bytes, or the module's own): it keeps "
                               "that change; register it as a buffer to have it restored", name, tuple(v.shape),
                               v.dtype, KEEP_BYTES)
