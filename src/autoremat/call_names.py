"""Names of one call of a module that runs more than once per step (torch-free).

A module called ``n > 1`` times in one training step (a weight-shared layer: Hugging Face ALBERT
runs one ``AlbertLayerGroup`` for all its layers; a model looping over one block; an activation
module used twice) has one node, or one call region, per call. Each call is named
``"<path>@<k>/<n>"``: call ``k`` (from 0, in the order the step makes them) of the ``n`` calls of
module ``path``. The name is what a graph's ``scope`` entries, ``meta["call_op_start"]`` and a
plan's ``module_calls`` hold for such a call, so a plan recomputes exactly that call; the runtime
(:mod:`autoremat.runtime.per_call`) counts the module's calls in each step and checks that the
step makes ``n`` of them. A module called once keeps its plain path.
"""

from __future__ import annotations

__all__ = ["call_name", "parse_call", "plain_path", "is_per_call", "enclosing_paths"]

_SEP = "@"


def call_name(path: str, k: int, n: int) -> str:
    """The name of call ``k`` of the ``n`` calls of module ``path`` (its plain path when ``n == 1``)."""
    if n == 1:
        return path
    if not 0 <= k < n:
        raise ValueError(f"call index {k} is not one of the {n} calls of {path!r}; please report")
    return f"{path}{_SEP}{k}/{n}"


def parse_call(name: str) -> tuple[str, int | None, int | None]:
    """``(path, k, n)`` of a call name; ``(path, None, None)`` for a plain path."""
    path, sep, rest = name.rpartition(_SEP)
    if not sep:
        return name, None, None
    k, slash, n = rest.partition("/")
    if not (slash and k.isdigit() and n.isdigit() and int(k) < int(n)):
        raise ValueError(f"{name!r} is not a call name (expected '<module path>@<call>/<calls>', e.g. "
                         "'encoder.layer@2/4')")
    return path, int(k), int(n)


def plain_path(name: str) -> str:
    """The module path of a call name (a plain path as it is)."""
    return parse_call(name)[0]


def is_per_call(name: str) -> bool:
    """Whether ``name`` names one call of a module run more than once per step."""
    return parse_call(name)[1] is not None


def enclosing_paths(path: str) -> list[str]:
    """The module paths enclosing ``path`` (its proper dotted prefixes), outermost first."""
    parts = path.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]
