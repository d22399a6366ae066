"""The :class:`~autoremat.per_rank.ShardingSpec` of a model: which graph nodes run inside which
FSDP unit, and how many bytes each unit gathers (the torch side of :mod:`autoremat.per_rank`).

Works on a model that is sharded already (its units are found, :func:`autoremat._fsdp.units_of`)
and on one that is not yet (the units it *will* have are passed, e.g. from a wrap policy:
``units={"layer1.0": model.layer1[0], ...}``), so that a plan can be solved for the per-rank
budget before ``accelerator.prepare`` or a Lightning strategy shards the model.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

from torch import nn

from .._fsdp import (canonical_modules, canonical_path, inner_module, is_fsdp1, is_sharded_tensor, local_tensor,
                     units_of, world_size)
from ..graph import Graph
from ..per_rank import ShardingSpec
from ._unit_trace import canonical_trace

__all__ = ["sharding_spec", "unit_param_bytes"]


def _padded_bytes(p: nn.Parameter, world: int) -> int:
    """Unsharded bytes FSDP gathers for ``p``: dim 0 padded to a multiple of the world size
    (FSDP2); an FSDP1 flat parameter's local shard times the world size."""
    if hasattr(p, "_fqns"):  # FSDP1 FlatParameter: padded already, held as one shard per rank
        return local_tensor(p).numel() * p.element_size() * world
    shape = tuple(p.shape)  # a DTensor's global shape
    if not shape:
        return p.element_size() * world
    rows = math.ceil(shape[0] / world) * world
    return int(rows * math.prod(shape[1:]) * p.element_size())


def unit_param_bytes(model: nn.Module, units: Mapping[str, nn.Module], world: int,
                     outer: nn.Module | None = None) -> dict[str, int]:
    """Unsharded bytes of the parameters each unit owns (not a unit's inside it); ``""``: the
    model's own (those in no unit). FSDP1 units count their flat parameter (with
    ``use_orig_params``, Lightning's default, the original parameters are 1-D views of this
    rank's shard, of another size on each rank), also the one of a wrapper outside ``model``
    in ``outer`` (Lightning's root wrapper around the LightningModule: ``""``)."""
    owner: dict[int, str] = {}
    for path in sorted(units, key=lambda p: p.count(".") if p else -1):  # outer first, inner units win
        for p in units[path].parameters():
            owner[id(p)] = path
    out: dict[str, int] = {path: 0 for path in units}
    out[""] = 0
    seen: set[int] = set()
    for path, flat in _fsdp1_flat_parameters(model, outer):
        out[path if path in out else ""] += local_tensor(flat).numel() * flat.element_size() * world
        seen.update([id(flat), *(id(p) for p in getattr(flat, "_params", None) or ())])
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        out[owner.get(id(p), "")] += _padded_bytes(p, world)
    return out


def _fsdp1_flat_parameters(model: nn.Module, outer: nn.Module | None) -> Iterator[tuple[str, nn.Parameter]]:
    """``(canonical path of the wrapper, its flat parameter)`` of every FSDP1 wrapper in
    ``model`` and in ``outer`` (``""`` for those outside ``model``)."""
    inside = {id(m): canonical_path(path) for path, m in model.named_modules()}
    wrappers = [*model.modules(), *(m for m in (outer.modules() if outer is not None else ()) if id(m) not in inside)]
    for m in wrappers:
        handle = getattr(m, "_handle", None) if is_fsdp1(m) else None
        if handle is not None and handle.flat_param is not None:
            yield inside.get(id(m), ""), handle.flat_param


def sharding_spec(model: nn.Module, graph: Graph, *, units: Mapping[str, nn.Module] | None = None,
                  world: int | None = None, root_sharded: bool = True, fsdp_version: int | None = None,
                  outer: nn.Module | None = None) -> ShardingSpec:
    """The sharding of ``model`` in ``graph``'s terms (a capture of it). ``units``: the units by
    canonical path (default: the model's FSDP units); ``world``: the world size (default: the
    default process group's); ``outer``: the module ``model`` sits in when an FSDP1 wrapper
    outside ``model`` shards its parameters (Lightning's ``FSDPStrategy``: the strategy's model)."""
    world = world_size(model) if world is None else int(world)
    outer = model if outer is None else outer
    model = inner_module(model)  # an FSDP1 root wrapper: the module it wraps
    found = units_of(model) if units is None else dict(units)
    version = fsdp_version or (1 if any(is_fsdp1(m) for m in found.values()) else 2)
    mods = canonical_modules(model)
    own = {path: mods.get(path, m) for path, m in found.items()}
    if graph.meta.get("mode") == "fx":
        node_units = _fx_node_units(model, graph, found)
    else:
        node_units = _module_node_units(graph, own)
    spans: dict[str, int] = {}
    for v, chain in enumerate(node_units):
        for u in chain:
            spans.setdefault(u, v)
    order = tuple(sorted(spans, key=lambda u: spans[u]))
    sizes = unit_param_bytes(model, found, world, outer)
    return ShardingSpec(world_size=world, units=order, unit_bytes=sizes, node_units=tuple(node_units),
                        root_sharded=root_sharded, fsdp_version=version,
                        extra={"sharded_params": any(is_sharded_tensor(p) or hasattr(p, "_fqns")
                                                     or getattr(p, "_fsdp_flattened", False)
                                                     for p in model.parameters())})


def _fx_node_units(model: nn.Module, graph: Graph, units: Mapping[str, nn.Module]) -> list[tuple[str, ...]]:
    canon = canonical_trace(model, dict(units))
    names = [graph.node(v)["name"] for v in graph.nodes]
    if [n.name for n in canon.ops] != names:
        raise ValueError("the graph was not captured from this model (its ops have other names); capture the model "
                         "and make the sharding spec from that graph")
    wanted = set(units)
    return [tuple(u for u in stack if u in wanted) for stack in canon.units]


def _module_node_units(graph: Graph, units: Mapping[str, nn.Module]) -> list[tuple[str, ...]]:
    """Module-level graphs: a node runs inside the units whose path is a prefix of its module's;
    a node holding units adds its largest one; glue runs in the units its neighbours share."""
    paths = sorted(units, key=lambda p: p.count("."))
    sizes = {u: sum(p.numel() for p in m.parameters()) for u, m in units.items()}
    out: list[tuple[str, ...] | None] = []
    for v in graph.nodes:
        path = canonical_path(graph.node(v)["module_path"] or "")
        if graph.node(v)["kind"] == "glue" or not path:
            out.append(None)
            continue
        chain = [u for u in paths if path == u or path.startswith(u + ".")]
        inner = [u for u in paths if u.startswith(path + ".")]
        if inner:
            chain.append(max(inner, key=lambda u: sizes[u]))
        out.append(tuple(chain))
    filled: list[tuple[str, ...]] = []
    for v, chain in enumerate(out):
        if chain is None:
            prev = next((c for c in reversed(out[:v]) if c is not None), ())
            nxt = next((c for c in out[v + 1:] if c is not None), ())
            chain = tuple(u for u in prev if u in nxt)
        filled.append(chain)
    return filled
