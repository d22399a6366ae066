"""``autoremat.cost.batch_pricing``: pricing a state's successors at once equals one at a time.

Every transition ``L_i -> L_j`` out of a state, priced for all successors at once on bitset rows,
gives exactly what :meth:`ExactDP.move` gives one at a time (bookkeeping and
:meth:`TransitionBounds.move_bound`): time (bit for bit, integer and float node times), added kept
bytes, dangling roots after, lower bound of the need. The graphs: seeded random DAGs with views,
pass-through nodes and a non-recomputable node, module mode (one-node recomputed segments), and
GoogLeNet (197 nodes: several 64-bit words a row). A graph where a node saves a storage that is
not its own nor an ancestor's turns the batch off.
"""

from __future__ import annotations

import random

import networkx as nx
import numpy as np
import pytest
from _graphs import convolutional, random_dag_with_views, with_held_outputs

from autoremat.graph import Graph
from autoremat.solvers.kusumoto.search import Search, parse_config


def exact_dp(graph: Graph, tails: bool = False):
    dp = Search(graph, "dp-exact", parse_config({"max_lower_sets": 10**6}, "dp-exact")).dp
    dp.p.tails = tails  # (before anything is priced)
    return dp


def dangling_sets(dp, limit: int = 12) -> list[int]:
    """Dangling sets the exact model reaches: from the empty state, a few transitions deep."""
    seen, frontier = {0}, [(0, 0)]
    for _ in range(3):
        nxt = []
        for i, dang in frontier:
            for j in range(len(dp.fam)):
                if len(seen) >= limit:  # the same sets; a wide graph has thousands of moves left to try
                    return sorted(seen)
                if j != i and not dp.fam[i] & ~dp.fam[j]:
                    d2 = dp.move(i, j, dang)[2]
                    if d2 not in seen and len(seen) < limit:
                        seen.add(d2)
                        nxt.append((j, d2))
        frontier = nxt
    return sorted(seen)


def assert_batch_equals_scalar(graph: Graph, states: int | None = None, seed: int = 0,
                               successors: int | None = None, tails: bool = False) -> int:
    """Checks each successor of ``states`` sampled sets (all sets where ``None``) from each
    reached dangling set, or ``successors`` of them sampled (the batch still prices them all);
    returns the number of transitions checked."""
    dp = exact_dp(graph, tails)
    pricer = dp.pricer
    assert pricer is not None and pricer.ok
    rng = random.Random(seed)
    sets = range(len(dp.fam)) if states is None else rng.sample(range(len(dp.fam)), states)
    dangs = dangling_sets(dp)
    checked = 0
    for i in sets:
        js = [j for j in range(len(dp.fam)) if j != i and not dp.fam[i] & ~dp.fam[j]]
        if not js:
            continue
        for dang in dangs:
            dang &= dp.p.info(dp.fam[i]).alive  # a state's dangling roots are alive after its set
            dt, add, packed, low = pricer.price(i, dang, np.asarray(js))
            ks = (range(len(js)) if successors is None or successors >= len(js)
                  else rng.sample(range(len(js)), successors))
            for k in ks:
                j = js[k]
                got = (float(dt[k]), int(add[k]), int.from_bytes(packed[k].tobytes(), "little"), int(low[k]))
                assert got == dp.move(i, j, dang), (i, j, dang)
                checked += 1
    return checked


@pytest.mark.parametrize("seed", range(16))
def test_random_dags_price_as_the_scalar_code(seed):
    g = with_held_outputs(random_dag_with_views(seed, 9 + seed % 5), seed)
    assert assert_batch_equals_scalar(g) > 0


@pytest.mark.parametrize("seed", range(6))
def test_float_times_sum_left_to_right(seed):
    """Non-integer times: the batch accumulates them in the scalar loop's order."""
    g = with_held_outputs(random_dag_with_views(100 + seed, 12), seed)
    rng = random.Random(seed)
    for v in range(len(g)):
        g.nx.nodes[v]["time_s"] = rng.random() * 10 ** rng.randint(-7, 2)
    assert exact_dp(g).p.time_groups is None
    assert assert_batch_equals_scalar(g) > 0


@pytest.mark.parametrize("seed", range(6))
def test_with_replay_tails_the_times_are_the_scalar_codes(seed):
    """``GraphBits.tails`` (a recomputed segment priced up to its replay tail): the same times."""
    g = convolutional(with_held_outputs(random_dag_with_views(300 + seed, 11), seed), seed, share=0.9)
    assert assert_batch_equals_scalar(g, tails=True) > 0


@pytest.mark.parametrize("seed", range(4))
def test_module_mode_recomputes_one_node_segments_only(seed):
    g = with_held_outputs(random_dag_with_views(200 + seed, 10), seed)
    g.meta["mode"] = "module"
    assert assert_batch_equals_scalar(g) > 0


def test_googlenet_rows_span_several_words():
    import autoremat

    model, args = autoremat.zoo.build("googlenet", size="small", device="meta")
    g = autoremat.capture(model, args)
    assert len(g) > 128
    for graph in (g.with_paper_times(), g):  # 40 of each state's thousands of successors: 303,252 took 20 s
        assert assert_batch_equals_scalar(graph, states=10, successors=40) > 4_000


def test_a_node_saving_a_non_ancestor_turns_batch_pricing_off():
    """The saved-roots shortcut needs every saved storage to be the saver's own or an
    ancestor's. Captured graphs always are (autograd saves inputs and outputs; the simulator
    cannot replay anything else), but a graph that is not is priced one transition at a time
    (the searches without the pricer: ``test_golden.py``)."""
    g = random_dag_with_views(7, 10)
    late, early = next((x, u) for x in range(len(g) - 1, 0, -1) if g.node(x)["requires_grad"]
                       for u in range(x) if u not in nx.ancestors(g.nx, x)
                       and g.node(u)["alias_of"] is None and g.node(u)["alloc_bytes"])
    g.nx.nodes[late]["saves"] = tuple(g.node(late)["saves"]) + (early,)
    g.nx.nodes[late]["saved_bytes"] += g.node(early)["alloc_bytes"]
    dp = exact_dp(g)
    assert dp.pricer is None and dp.rows.ok is False
