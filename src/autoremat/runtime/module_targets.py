"""Module-level plans: the module call each recomputed segment runs as, and the ops it keeps."""

from __future__ import annotations

from torch import nn

from .._fsdp import canonical_path
from ..call_names import parse_call
from ..errors import PlanMismatchError
from ..plan import Plan

__all__ = ["module_targets"]


def module_targets(model: nn.Module, plan: Plan, names: list[str],
                    sharded: bool = False) -> list[tuple[str, nn.Module, dict[int, str]]]:
    """The module call each recomputed segment runs as (``plan.module_calls``, else its one
    node's module; one call of a module run more than once per step is ``"<path>@<k>/<n>"``,
    :mod:`autoremat.call_names`) and the ops it keeps (index in the call's op sequence -> op name); a sharded
    model's modules by their names before sharding."""
    mods = {canonical_path(n) if sharded else n: m for n, m in model.named_modules()}
    out: list[tuple[str, nn.Module, dict[int, str]]] = []
    seen: set[str] = set()
    for i, seg in enumerate(plan.segments):
        if not seg.recompute:
            continue
        call = plan.module_calls.get(i)
        if call is None and (len(seg.nodes) != 1 or seg.keep):
            raise PlanMismatchError(f"segment {i} recomputes {len(seg.nodes)} nodes (keeping {len(seg.keep)}) but the "
                                    "plan names no module call for it (module_calls); solve the graph again")
        name = names[seg.nodes[0]] if call is None else call[0]
        path, k, _n = parse_call(name)
        if path not in mods or path == "":
            raise PlanMismatchError(f"plan recomputes module {path!r}, which {type(model).__name__} does not have")
        if name in seen or path in seen or (k is None and any(parse_call(s)[0] == path for s in seen)):
            raise PlanMismatchError(
                f"plan recomputes module {path!r} in two segments (or all its calls and one); a module run more "
                "than once per step is recomputed call by call, each call named '<path>@<k>/<n>' in the plan's "
                "module_calls (autoremat.plan.module_calls_of(graph, plan) fills them for a hand-made plan)")
        seen.add(name)
        out.append((name, mods[path], {} if call is None else dict(call[1])))
    return out
