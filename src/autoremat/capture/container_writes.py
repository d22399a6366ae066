"""Lists, dicts and sets a forward changes in place (``self.features.append(h)``, ``self.stats["n"] += 1``).

Such a change is a side effect outside the tensor ops, which neither a traced graph nor a
recomputation can keep exact:

* an fx trace runs the Python once, so the generated forward never made the change again
  (measured, CPU: a model appending to ``self.log`` in forward kept an empty list through three
  patched steps, where the user's model had three entries): :func:`semantic_trace
  <autoremat.capture._tracing.semantic_trace>` refuses such a forward (``mode="auto"`` then captures
  at module level, which runs the model's own code);
* a recomputed module call runs its forward again in backward, so the change happened twice per
  step: module-level capture watches each node module's call (:class:`ContainerWrites`) and keeps
  the calls that change a container of their modules from recomputation
  (``graph.meta["pinned_by_container_write"]``: call -> attribute, and the call regions of blocks
  captured op by op in ``meta["pinned_regions"]``), with a log line. The same watch keeps the calls
  that draw from Python's or numpy's generator (``meta["pinned_by_host_rng"]``, :mod:`.host_rng`).

What is compared: every public (not ``_``-prefixed) list, dict and set attribute of the modules,
and the lists, dicts and sets they hold (two levels), by the identity of their items (a dict's keys
by equality). Reassigned attributes are :mod:`autoremat.runtime.substituted`'s (a recomputation runs
with the forward's); containers held elsewhere (globals, closures) are not seen."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

from torch import nn

from .host_rng import draws, host_states
from .kept_said import say_kept

__all__ = ["contents", "put_back", "held_containers", "changed_containers", "ContainerWrites"]

_KINDS = (list, dict, set)


def contents(v: Any, depth: int) -> Any:
    """A copy of container ``v``'s items (and of its containers', ``depth`` levels), or ``None``."""
    if depth <= 0 or not isinstance(v, _KINDS):
        return None
    items = list(v.items()) if isinstance(v, dict) else list(v)
    inner = [(x, contents(x, depth - 1)) for x in (v.values() if isinstance(v, dict) else v)]
    return items, inner


def put_back(v: Any, held: Any) -> None:
    """Give container ``v`` the items :func:`contents` took (and its containers theirs)."""
    if held is None:
        return
    items, inner = held
    if isinstance(v, list):
        v[:] = items
    else:  # a dict (from its item pairs) or a set
        v.clear()
        v.update(items)
    for x, c in inner:
        put_back(x, c)


def _same(v: Any, held: Any) -> bool:
    if held is None:
        return True
    items, inner = held
    now = list(v.items()) if isinstance(v, dict) else list(v)
    if len(now) != len(items):
        return False
    if isinstance(v, dict):
        if any(k1 != k2 or x is not y for (k1, x), (k2, y) in zip(now, items)):
            return False
    elif isinstance(v, set):
        if set(map(id, now)) != set(map(id, items)):
            return False
    elif any(x is not y for x, y in zip(now, items)):
        return False
    return all(_same(x, c) for x, c in inner)


def held_containers(modules: Iterable[tuple[str, nn.Module]]) -> list[tuple[str, Any, Any]]:
    """``(label, container, contents)`` of the public container attributes of ``modules``
    (``(path, module)`` pairs), two levels deep."""
    return [(f"{type(m).__name__}.{k}" + (f" ({path})" if path else ""), v, contents(v, 2))
            for path, m in modules for k, v in vars(m).items() if not k.startswith("_") and isinstance(v, _KINDS)]


def changed_containers(held: list[tuple[str, Any, Any]]) -> list[str]:
    """The labels of the containers of :func:`held_containers` whose contents differ now."""
    return [label for label, v, c in held if not _same(v, c)]


class ContainerWrites:
    """Which node module calls of a recorded step change a container of their modules in place:
    ``changed``, path -> the first such attribute (module docstring)."""

    def __init__(self) -> None:
        self.changed: dict[str, str] = {}
        self.drew: dict[str, str] = {}  # calls drawing from Python's or numpy's generator (.host_rng)
        self._open: dict[int, tuple[list[tuple[str, Any, Any]], dict[str, Any]]] = {}

    @contextlib.contextmanager
    def watching(self, mods: Iterable[tuple[str, nn.Module]]) -> Iterator[None]:
        """Watch the calls of ``mods`` (``(path, module)``, the node modules) while the block runs."""
        handles = []
        for path, mod in mods:
            handles.append(mod.register_forward_pre_hook(self._pre))
            handles.append(mod.register_forward_hook(self._post(path)))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _pre(self, module: nn.Module, args: Any) -> None:
        if id(module) not in self._open:  # the outermost call
            self._open[id(module)] = held_containers(module.named_modules()), host_states()

    def _post(self, path: str) -> Any:
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            held, rng = self._open.pop(id(module), (None, None))
            changed = changed_containers(held) if held else []
            if changed:
                self.changed.setdefault(path, changed[0])
            moved = draws(rng) if rng is not None else []
            if moved:
                self.drew.setdefault(path, moved[0])
        return hook

    def said(self, kept: dict[str, str], drew: dict[str, str]) -> None:
        """Log once which calls are kept (``kept``: call or region -> attribute; ``drew``: -> generator)."""
        for pins, what in ((kept, "change a list, dict or set attribute in place in forward (%s: %s): recomputed, "
                                  "they would change it again"),
                           (drew, "draw from Python's or numpy's random generator in forward (%s: %s): recomputed, "
                                  "they would draw again (draw from torch's generator to let them be recomputed)")):
            if pins:
                say_kept("autoremat: %d module call(s) " + what + "; they are kept (autoremat.capture.container_writes)",
                         len(pins), *next(iter(pins.items())))
