"""``autoremat.solvers.blocks.options``: store first, whole / split / keep options as valid
local plans (recomputed segments are call regions, kept nodes inside them), no keep options
at op level, and the parts of a block."""

from __future__ import annotations

import random

from _graphs import block_chain
from autoremat.solvers.blocks.detect import find_blocks
from autoremat.solvers.blocks.options import block_options, block_parts


def _block(mode: str = "module"):
    g = block_chain(random.Random(1), 3, width=8, mode=mode, shared_saved=True)
    b = find_blocks(g)
    nodes = b.nodes[1]
    return g, b.paths[1], nodes, {v: float(g.node(v)["time_s"]) for v in nodes}


def test_options_of_a_module_level_block():
    g, path, nodes, times = _block()
    options = block_options(g, path, nodes, times, keep_fractions=(0.2, 0.5), max_parts=5)
    names = [name for name, _ in options]
    assert names[0] == "store" and "whole" in names and "split01" in names
    assert any(n.startswith("whole+keep") for n in names)
    assert len({segs for _, segs in options}) == len(options)  # no repeats
    for _name, segs in options:
        covered = sorted(v + nodes[0] for s in segs for v in s.nodes)
        assert covered == list(nodes)
        for s in segs:
            if s.recompute:
                absolute = tuple(v + nodes[0] for v in s.nodes)
                assert g.region_of(absolute) is not None
                assert set(s.keep) <= set(s.nodes)


def test_parts_and_op_level_options():
    g, path, nodes, times = _block("fx")
    parts = block_parts(g, path, nodes)
    assert [len(p) for p in parts] == [4, 3]  # parts a and b; the residual add between them
    options = block_options(g, path, nodes, times, keep_fractions=(0.2,), max_parts=5)
    assert all(not s.keep for _n, segs in options for s in segs)  # selective saves: module level only
    few = block_options(g, path, nodes, times, keep_fractions=(), max_parts=1)
    assert len(few) <= len(options)


def test_keep_options_never_keep_a_random_op():
    """The runtime replays a random op even where a plan keeps it (the RNG must advance as in the
    forward: ``autoremat.runtime.selective``), so a plan keeping one would count bytes it never
    holds (Swin's drop path: predicted 2.49 MiB, measured 2.48)."""
    g, path, nodes, times = _block()
    chosen = block_options(g, path, nodes, times, keep_fractions=(1.0,), max_parts=5)
    kept = {v + nodes[0] for _n, segs in chosen for s in segs for v in s.keep}
    assert kept
    for v in kept:
        g.node(v)["random"] = True
    again = block_options(g, path, nodes, times, keep_fractions=(1.0,), max_parts=5)
    assert not {v + nodes[0] for _n, segs in again for s in segs for v in s.keep} & kept
