"""Content keys of graphs for the solvers' caches (autoremat.solvers.content_keys)."""

from __future__ import annotations

from _graphs import skip_chain

from autoremat.solvers.content_keys import memory_signature, signature
from autoremat.solvers.stable import reference_graph


def test_times_change_the_signature_and_not_the_memory_signature() -> None:
    g = skip_chain()
    ref = reference_graph(g)  # the same bytes and structure, other times (and its node dicts in another order)
    assert signature(ref) != signature(g)
    assert memory_signature(ref) == memory_signature(g)
    before = (signature(g), memory_signature(g))
    g.nx.nodes[2]["out_bytes"] += 4  # an edit of bytes changes both
    assert signature(g) != before[0] and memory_signature(g) != before[1]
