"""What autoremat needs to know about a model sharded by FSDP, in one place.

A *unit* is a submodule whose ``__call__`` owns the parameters inside it: FSDP2's
``fully_shard`` makes a module an instance of :class:`torch.distributed.fsdp.FSDPModule` (its
class is swapped for a subclass, hooks registered on it all-gather the parameters before its
forward and reduce-scatter the gradients after its backward); FSDP1's
:class:`~torch.distributed.fsdp.FullyShardedDataParallel` wraps a module (its ``forward``
unshards a flat parameter and calls the wrapped module, found under ``_fsdp_wrapped_module``).
The *canonical path* of a module is its path with the FSDP1 wrapper components left out: the
path it had before wrapping, which plans and graphs name.

Nothing here imports ``torch.distributed`` unless it is available, and nothing starts a
collective except :func:`full_parameters` (which every rank must enter).
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["FSDP1_WRAPPED", "is_fsdp1", "is_fsdp2", "is_unit", "has_units", "has_sharded_params", "original_class", "inner_module",
           "canonical_path", "canonical_modules", "units_of", "is_sharded_tensor", "local_tensor", "world_size",
           "logical_signature", "UNKNOWN", "full_parameters", "fsdp_state_count"]

FSDP1_WRAPPED = "_fsdp_wrapped_module"
_WRAPPER_PARTS = (FSDP1_WRAPPED, "_checkpoint_wrapped_module")


def _fsdp_classes() -> tuple[type | None, type | None]:
    if not torch.distributed.is_available():
        return None, None
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    return FullyShardedDataParallel, FSDPModule


def is_fsdp1(module: nn.Module) -> bool:
    """Whether ``module`` is an FSDP1 ``FullyShardedDataParallel`` wrapper."""
    fsdp1, _ = _fsdp_classes()
    return fsdp1 is not None and isinstance(module, fsdp1)


def is_fsdp2(module: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``module`` (FSDP2)."""
    _, fsdp2 = _fsdp_classes()
    return fsdp2 is not None and isinstance(module, fsdp2)


def is_unit(module: nn.Module) -> bool:
    """Whether ``module`` is an FSDP unit (FSDP2 ``fully_shard`` or an FSDP1 wrapper)."""
    return is_fsdp1(module) or is_fsdp2(module)


def has_units(model: nn.Module) -> bool:
    """Whether ``model`` or any submodule is an FSDP unit."""
    if not torch.distributed.is_available():
        return False
    return any(is_unit(m) for m in model.modules())


def has_sharded_params(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is sharded: a ``DTensor`` (FSDP2) or an FSDP1 flat
    parameter or a view into one (a model wrapped by FSDP1 as a whole has no unit inside it,
    but its parameters are not the ones it was captured with)."""
    return any(is_sharded_tensor(p) or hasattr(p, "_fqns") or getattr(p, "_fsdp_flattened", False)
               for p in model.parameters())


def fsdp_state_count() -> int:
    """How many modules FSDP2 manages in this process (O(1); changes when ``fully_shard`` runs)."""
    if not torch.distributed.is_available():
        return 0
    from torch.distributed import _composable_state

    return len(getattr(_composable_state, "_module_state_mapping", ()))


def original_class(module: nn.Module) -> type:
    """The class ``module`` had before ``fully_shard`` swapped it (its own class otherwise)."""
    cls = type(module)
    if is_fsdp2(module):
        return cls.__mro__[getattr(cls, "_orig_cls_mro_index", 2)]
    return cls


def inner_module(module: nn.Module) -> nn.Module:
    """The module an FSDP1 wrapper wraps (``module`` itself otherwise): the one whose
    ``forward`` holds the model's code."""
    while is_fsdp1(module):
        module = module._fsdp_wrapped_module
    return module


def canonical_path(path: str) -> str:
    """``path`` without FSDP1 (and checkpoint-wrapper) components."""
    return ".".join(p for p in path.split(".") if p and p not in _WRAPPER_PARTS)


def canonical_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Every module of ``model`` by canonical path; an FSDP1 wrapper and the module it wraps
    share a path, the wrapped module wins (it is the one whose code runs)."""
    out: dict[str, nn.Module] = {}
    for path, m in model.named_modules():
        out[canonical_path(path)] = inner_module(m)
    return out


def units_of(model: nn.Module) -> dict[str, nn.Module]:
    """The FSDP units inside ``model`` (not ``model`` itself, nor a wrapper of it), by
    canonical path, outermost first: the modules whose ``__call__`` a patched forward must go
    through (the FSDP1 wrapper, for FSDP1)."""
    root = inner_module(model)
    found: dict[str, nn.Module] = {}
    for path, m in model.named_modules():
        if not is_unit(m) or inner_module(m) is root:
            continue
        key = canonical_path(path)
        found.setdefault(key, m)  # a wrapper before the module it wraps
    return found


def is_sharded_tensor(t: Any) -> bool:
    """Whether ``t`` is a ``DTensor`` (an FSDP2 parameter, gradient or optimizer state). Cheap:
    no ``DTensor`` exists before ``torch.distributed.tensor`` is imported, so it is not imported here."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a ``DTensor``'s local shard, any other tensor itself."""
    return t._local_tensor if is_sharded_tensor(t) else t  # type: ignore[attr-defined]


def world_size(model: nn.Module | None = None) -> int:
    """Over how many ranks ``model``'s parameters are sharded: the mesh of its FSDP2
    parameters, the process group of its FSDP1 wrappers; else (or without ``model``) the
    processes in the default group (1 without ``torch.distributed``)."""
    for m in () if model is None else model.modules():
        if is_fsdp1(m):
            return int(m.world_size)
        for p in m.parameters(recurse=False):
            if is_sharded_tensor(p):
                return int(math.prod(p.device_mesh.size(i) for i, pl in enumerate(p.placements) if pl.is_shard()))
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return int(torch.distributed.get_world_size())
    return 1


UNKNOWN = "?"
"""The shape :func:`logical_signature` gives a parameter it cannot see unsharded."""


def logical_signature(model: nn.Module) -> dict[str, str]:
    """``{"param:<canonical name>": "float32[shape]"}`` of the parameters as they were before
    sharding: a ``DTensor``'s global shape, an FSDP1 flat parameter's original shapes
    (:data:`UNKNOWN` for an FSDP1 ``use_orig_params`` shard view whose wrapper is outside
    ``model``: the root wrapper of the model itself, say)."""
    def sig(dtype: torch.dtype, shape: Any) -> str:
        return f"{str(dtype).removeprefix('torch.')}{list(shape)}"

    out: dict[str, str] = {}
    modules = list(model.named_modules())
    for path, m in modules:  # FSDP1 flat parameters first: with use_orig_params the originals are shard views
        flat = getattr(getattr(m, "_handle", None), "flat_param", None) if is_fsdp1(m) else None
        if flat is not None:
            prefix = canonical_path(path)
            for fqn, shape in zip(flat._fqns, flat._shapes):
                out[f"param:{canonical_path(f'{prefix}.{fqn}' if prefix else fqn)}"] = sig(flat.dtype, shape)
    for path, m in modules:
        for name, p in m.named_parameters(recurse=False):
            if hasattr(p, "_fqns"):  # a FlatParameter the wrapped module holds (use_orig_params=False)
                prefix = canonical_path(path)
                for fqn, shape in zip(p._fqns, p._shapes):
                    out.setdefault(f"param:{canonical_path(f'{prefix}.{fqn}' if prefix else fqn)}", sig(p.dtype, shape))
            else:  # a shard view whose flat parameter a wrapper outside ``model`` holds: shape unknown here
                shown = UNKNOWN if getattr(p, "_fsdp_flattened", False) else sig(p.dtype, p.shape)
                out.setdefault(f"param:{canonical_path(f'{path}.{name}' if path else name)}", shown)
    return out


@contextlib.contextmanager
def full_parameters(model: nn.Module) -> Iterator[None]:
    """Every FSDP2 unit of ``model`` unsharded in place for the block and resharded after it
    (a collective: every rank must enter). Inside, the modules hold their full parameters, so a
    forward that bypasses the units' hooks (a capture on one rank) runs without collectives.
    FSDP1 models are not supported here (their flat parameters hide the original ones): capture
    them before wrapping."""
    units = [m for m in model.modules() if is_fsdp2(m)]
    if any(is_fsdp1(m) for m in model.modules()):
        raise ValueError("full_parameters: FSDP1 (FullyShardedDataParallel) models cannot be unsharded in place for "
                         "capture; capture and apply the plan before wrapping the model (see autoremat.runtime.sharding)")
    for m in units:
        m.unshard()
    try:
        yield
    finally:
        for m in units:
            m.reshard()
