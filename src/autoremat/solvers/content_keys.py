"""Keys of a graph's content for the solvers' caches, which must notice an edited graph.

:func:`signature` hashes every node attribute, edge and meta entry (the lazily added fingerprint
aside); :func:`memory_signature` leaves out the times, for what depends on bytes and structure only
(the exact model's feasibility, :meth:`autoremat.solvers.kusumoto.search.Search._exact_least`).
"""

from __future__ import annotations

from ..graph import Graph

__all__ = ["signature", "memory_signature"]

_TIMES = frozenset({"time_s", "bwd_time_s", "time_noise", "time_source", "fingerprint"})


def signature(graph: Graph) -> int:
    """A hash of the graph's nodes, edges and meta (not the lazily added fingerprint)."""
    meta = sorted((k, v) for k, v in graph.meta.items() if k != "fingerprint")
    text = repr([tuple(d.items()) for _, d in graph.nx.nodes(data=True)]) + repr(list(graph.nx.edges)) + repr(meta)
    return hash(text)


def memory_signature(graph: Graph) -> int:
    """:func:`signature` without the times (a hash of what memory depends on)."""
    meta = sorted((k, v) for k, v in graph.meta.items() if k not in _TIMES)
    nodes = [sorted((k, v) for k, v in d.items() if k not in _TIMES) for _, d in graph.nx.nodes(data=True)]
    return hash(repr(nodes) + repr(list(graph.nx.edges)) + repr(meta))
