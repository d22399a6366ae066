"""Seeded graph generators shared by the tests of the planning side (cost model, solvers, plans).

Every generator is deterministic in its arguments. Import it as ``from _graphs import ...``
(``tests/`` is on ``sys.path`` under pytest's default import mode).

* hand-sized shapes: :func:`diamond`, :func:`skip_connection`, :func:`module_chain` (a
  module-level chain with nothing but the structure), :func:`module_graph` (a profiled one:
  calls that keep internal activations), :func:`skip_chain` (a residual-network shape);
* random DAGs, each with the features the tests that use it need:

  - :func:`random_dag` (``seed, n``): sizes with zeros, integer times, nodes saving their
    output, an input or nothing, saved extras, workspace and shared parameters;
  - :func:`random_dag_with_views` (``seed, n``): :func:`random_dag` plus views, gradient
    pass-through nodes, a non-recomputable node and a second output;
  - :func:`random_profiled` (``rng, n``; :func:`random_profiled_graphs`: many): views, extras,
    workspace, nodes without grad, float times (the schedule and solver properties);
  - :func:`rich_dag` (``rng, n``): saved inputs of multi-input ops, views, nodes without grad
    or not recomputable (Re-forwarding's assumptions broken on purpose);
  - :func:`plain_dag` (``rng, n``) and :func:`random_chain_dag` (``rng``): graphs through
    :meth:`Graph.from_edges` (each node saves its output), with and without a chain backbone;
  - :func:`block_chain` (``rng, blocks``): repeated blocks captured op by op (scopes, call
    regions, op indices), the shape the chain-of-blocks model and the ``blocks`` solver work on;
  - :func:`with_held_outputs` (``graph, seed``): marks some nodes of any of these
    ``held_by_output`` (held by the returned object, no gradient seed) and keeps that object until
    the loss or to the end of backward (``meta["output_kept"]``, by the seed's parity), gives
    about half the outputs a gradient seed smaller than their ``out_bytes`` (``grad_seed_bytes``)
    and about half the graphs a loss tensor held to the step's end (``loss_held_bytes``), for the
    cost models' property tests;
  - :func:`random_from_edges` (``seed``): a chain with short skips, sizes and times from a few
    values; :func:`random_edges` (``n, p, rng``): an Erdős-Rényi DAG in execution order;

* op-level networks of the families the papers benchmark (:data:`FAMILIES`):
  :func:`random_network` (``family, seed, n``: residual chains with skips, U-Nets, dense blocks,
  transformer blocks, with what each op really saves) and :func:`random_networks` (many, the
  families in turn, 30-300 nodes; also ``benchmarks/milp_gaps.py``'s random DAGs).
"""

from __future__ import annotations

import random

import networkx as nx

from autoremat.graph import Graph

__all__ = ["diamond", "skip_connection", "module_chain", "module_graph", "skip_chain", "random_dag", "convolutional",
           "random_dag_with_views", "random_profiled", "random_profiled_graphs", "rich_dag", "plain_dag",
           "random_chain_dag", "random_from_edges", "with_held_outputs", "random_edges", "FAMILIES", "random_network", "random_networks",
           "block_chain"]


# ---------------------------------------------------------------------------------- hand-sized
def diamond() -> Graph:
    """0 -> 1 -> 3, 0 -> 2 -> 3."""
    return Graph.from_edges(4, [(0, 1), (0, 2), (1, 3), (2, 3)])


def skip_connection() -> Graph:
    """0 -> 1 -> 2 -> 3 and 0 -> 3 (a residual block)."""
    return Graph.from_edges(4, [(0, 1), (1, 2), (2, 3), (0, 3)])


def module_chain(n: int, recomputable: list[bool] | None = None) -> Graph:
    """A module-level chain of ``n`` calls of 10 bytes saving their output, unit times."""
    g = nx.DiGraph()
    for v in range(n):
        g.add_node(v, name=f"m{v}", module_path=f"layers.{v}", out_bytes=10, alloc_bytes=10, saves=(v,),
                   time_s=1.0, recomputable=True if recomputable is None else recomputable[v],
                   is_output=(v == n - 1))
        if v:
            g.add_edge(v - 1, v)
    return Graph(g, {"mode": "module", "loss_saves": [n - 1]})


def module_graph(n: int = 10, *, not_recomputable: tuple[int, ...] = (),
                 skips: tuple[tuple[int, int], ...] = ()) -> Graph:
    """A profiled module-level chain: each call keeps internal activations (``extra_saved_bytes``
    ``50 + 10 v``), times grow along it; ``skips`` adds edges, ``not_recomputable`` pins calls."""
    g = nx.DiGraph()
    for v in range(n):
        g.add_node(v, name=f"m{v}", module_path=f"layers.{v}", kind="module", out_bytes=10, alloc_bytes=10,
                   saves=(v,), extra_saved_bytes=50 + 10 * v, time_s=1.0 + v, bwd_time_s=2.0 + 2 * v,
                   is_output=v == n - 1, recomputable=v not in not_recomputable)
        if v:
            g.add_edge(v - 1, v)
    g.add_edges_from(skips)
    return Graph(g, {"mode": "module", "loss_saves": [n - 1]})


def skip_chain(n: int = 24) -> Graph:
    """A chain with a skip edge every third node (a residual-network shape), sizes 100-499
    bytes, every third node ten times slower (also ``benchmarks/solver_speed.py``'s graph)."""
    edges = [(v - 1, v) for v in range(1, n)] + [(v - 3, v) for v in range(3, n, 3)]
    return Graph.from_edges(n, edges, out_bytes=[100 + (v * 37) % 400 for v in range(n)],
                            time_s=[10.0 if v % 3 == 1 else 1.0 for v in range(n)])


# ---------------------------------------------------------------------------------- random
def random_dag(seed: int, n: int) -> Graph:
    """A small random DAG: varied sizes (zero included) and times, nodes saving their output, an
    input or nothing, some saved extras, temporaries and (shared) parameters."""
    rng = random.Random(seed)
    g = nx.DiGraph()
    for v in range(n):
        size = rng.choice([0, 1, 2, 3, 5, 8, 13])
        g.add_node(v, name=f"n{v}", out_bytes=size, alloc_bytes=size, time_s=float(rng.choice([1, 2, 5, 10])),
                   bwd_time_s=1.0, extra_saved_bytes=rng.choice([0, 0, 0, 1, 4]),
                   fwd_temp_bytes=rng.choice([0, 0, 2]), bwd_temp_bytes=rng.choice([0, 0, 3]),
                   params=tuple(rng.sample("abc", k=rng.choice([0, 0, 1]))))
    for v in range(1, n):
        for u in rng.sample(range(v), k=min(v, rng.choice([1, 1, 2, 3]))):
            g.add_edge(u, v)
    for v in range(n):
        r = rng.random()
        preds = sorted(g.predecessors(v))
        g.nodes[v]["saves"] = (v,) if r < 0.6 else ((rng.choice(preds),) if r < 0.8 and preds else ())
        g.nodes[v]["is_output"] = g.out_degree(v) == 0
    outs = [v for v in range(n) if g.out_degree(v) == 0]
    return Graph(g, {"mode": "synthetic", "loss_saves": outs[:1], "param_bytes": {"a": 4, "b": 1, "c": 2}})


def with_held_outputs(g: Graph, seed: int, share: float = 0.25, kept: str | None = None) -> Graph:
    """``g`` with about ``share`` of its non-output nodes marked ``held_by_output`` (the returned
    object holds them, as a key/value cache does), in place; drawn from a generator of their own
    (``seed``), so ``g``'s other draws are unchanged. The ops of repeated blocks (``op_index >= 0``)
    are marked by op index, alike in every block. ``meta["output_kept"]`` is ``kept``; by default
    ``"step"`` (the object kept to the end of backward) for odd seeds, ``"loss"`` for even ones.
    About half the outputs get ``grad_seed_bytes`` 0 or 1 (the loss's seed, an expanded scalar), and
    about half the graphs a loss tensor held to the step's end (``loss_held_bytes``: 4 bytes, a scalar,
    or an output's size, ``mse_loss``'s mean on the CPU)."""
    g.meta["output_kept"] = kept or ("step" if seed % 2 else "loss")
    rng = random.Random(f"held:{seed}:{len(g)}")
    by_index: dict[int, bool] = {}
    for v in g.nodes:
        d = g.node(v)
        pick = rng.random() < share
        if d["op_index"] >= 0:
            pick = by_index.setdefault(d["op_index"], pick)
        d["held_by_output"] = pick and not d["is_output"]
    seeds = random.Random(f"seed:{seed}:{len(g)}")  # a generator of its own: the draws above stay
    for v in g.nodes:  # about half the outputs get a seed below out_bytes (out.sum()'s expanded scalar)
        if g.node(v)["is_output"] and seeds.random() < 0.5:
            g.node(v)["grad_seed_bytes"] = seeds.choice([0, 1])
    outs = [g.node(v)["out_bytes"] for v in g.nodes if g.node(v)["is_output"]]
    g.meta["loss_held_bytes"] = random.Random(f"loss:{seed}:{len(g)}").choice([0, 0, 4, max(outs, default=0)])
    return g


def random_dag_with_views(seed: int, n: int) -> Graph:
    """:func:`random_dag` plus views (output in an input's storage, no allocation) and gradient
    pass-through nodes (adds and views; about half the adds with two inputs or more give one input a
    new gradient, ``grad_new``: autocast's cast to its dtype), a non-recomputable node and a second output."""
    rng = random.Random(seed)
    casts = random.Random(f"cast:{seed}:{n}")  # a generator of its own: the draws below stay
    g = random_dag(seed, n).nx
    for v in range(1, n):
        preds = sorted(g.predecessors(v))
        r = rng.random()
        if r < 0.25 and preds:  # a view of its first input
            base = preds[0]
            g.nodes[v].update(alias_of=base, alloc_bytes=0, out_bytes=g.nodes[base]["out_bytes"],
                              grad_passthrough=True, saves=())
        elif r < 0.35:  # an add-like node
            g.nodes[v].update(grad_passthrough=True, saves=())
            only = [u for u in preds if g.out_degree(u) == 1]  # its only reader: what capture marks
            if len(preds) > 1 and only and casts.random() < 0.5:
                g.nodes[v]["grad_new"] = (casts.choice(only),)
    if n > 3:
        g.nodes[rng.randrange(n)]["recomputable"] = False
    for v in range(n):
        d = g.nodes[v]
        d["saved_bytes"] = sum(g.nodes[u]["alloc_bytes"] if g.nodes[u]["alias_of"] is None else 0
                               for u in d["saves"]) + d["extra_saved_bytes"]
    outs = [v for v in range(n) if g.out_degree(v) == 0]
    return Graph(g, {"mode": "synthetic", "loss_saves": outs[:1], "param_bytes": {"a": 4, "b": 1, "c": 2}})


def convolutional(g: Graph, seed: int, share: float = 0.6) -> Graph:
    """``g``, in place, as an fx capture whose replays may have tails (:mod:`autoremat.replay_tail`):
    ``meta["mode"]`` ``"fx"``, and about ``share`` of the nodes that save one input (and not their
    output) of kind ``"conv"``, the others ``"add"`` (a drawn generator of their own)."""
    rng = random.Random(f"conv:{seed}:{len(g)}")
    g.meta["mode"] = "fx"
    for v in g.nodes:
        d = g.node(v)
        saves = tuple(d["saves"])
        conv = len(saves) == 1 and saves[0] != v and saves[0] in g.pred(v) and rng.random() < share
        d["kind"] = "conv" if conv else "add"
    return g


def with_reader_less_views(g: Graph, seed: int, share: float = 0.3) -> Graph:
    """A new graph: ``g`` with about ``share`` of its non-output nodes that have an input turned into views
    as module-level capture records them: in their first input's root storage (their only input now, no
    allocation), saving nothing, no readers of their own (their readers read and save the root: the edges
    move there) and, for most, backward workspace (an overlapping ``as_strided``'s slow backward,
    :mod:`autoremat.cost.grad_handoff`). Drawn from a generator of its own (``seed``)."""
    rng = random.Random(f"views:{seed}:{len(g)}")
    nxg = g.nx
    for v in list(nxg.nodes):
        preds = sorted(nxg.predecessors(v))
        d = nxg.nodes[v]
        if not preds or d.get("is_output") or rng.random() >= share:
            continue
        root = preds[0]
        while nxg.nodes[root].get("alias_of") is not None:
            root = nxg.nodes[root]["alias_of"]
        for w in list(nxg.successors(v)):
            nxg.remove_edge(v, w)
            nxg.add_edge(root, w)
            nxg.nodes[w]["saves"] = tuple(sorted({root if u == v else u for u in nxg.nodes[w]["saves"]}))
        for u in preds:
            nxg.remove_edge(u, v)
        nxg.add_edge(root, v)
        d.update(alias_of=root, alloc_bytes=0, out_bytes=nxg.nodes[root]["out_bytes"], saves=(), extra_saved_bytes=0,
                 grad_passthrough=False, bwd_temp_bytes=rng.choice([0, 3, 7, 7]), params=())
    return Graph(nxg, g.meta)


def with_view_first_grads(g: Graph, seed: int, share: float = 0.5) -> Graph:
    """A new graph: ``g`` with about ``share`` of its nodes read by two or more nodes marked as getting
    their first gradient as a view (``first_grad_view``: summed with the next out of place). Drawn from a
    generator of its own (``seed``)."""
    rng = random.Random(f"first views:{seed}:{len(g)}")
    nxg = g.nx.copy()
    for v in nxg.nodes:
        if nxg.out_degree(v) > 1 and rng.random() < share:
            nxg.nodes[v]["first_grad_view"] = True
    return Graph(nxg, g.meta)


def random_profiled(rng: random.Random, n: int) -> Graph:
    """A random profiled DAG: random sizes, saves, extras, views, a few nodes without grad."""
    g = nx.DiGraph()
    for v in range(n):
        preds = [u for u in range(v) if rng.random() < min(0.5, 2.5 / max(1, v))]
        if v and not preds:
            preds = [rng.randrange(v)]
        view = bool(preds) and rng.random() < 0.15
        size = rng.choice([0, 10, 50, 100, 400])
        saves = {u for u in preds if rng.random() < 0.5} | ({v} if rng.random() < 0.5 else set())
        g.add_node(v, name=f"n{v}", out_bytes=size, alloc_bytes=0 if view else size,
                   alias_of=preds[0] if view else None, saves=tuple(saves),
                   extra_saved_bytes=rng.choice([0, 0, 0, 20]), time_s=rng.uniform(0.5, 2.0),
                   bwd_time_s=rng.uniform(1.0, 4.0), requires_grad=v > 0 or rng.random() < 0.7,
                   fwd_temp_bytes=rng.choice([0, 0, 30]), bwd_temp_bytes=rng.choice([0, 0, 30]))
        g.add_edges_from((u, v) for u in preds)
    for v in range(n):
        g.nodes[v]["is_output"] = g.out_degree(v) == 0
    outs = [v for v in range(n) if g.out_degree(v) == 0]
    return Graph(g, {"mode": "synthetic", "loss_saves": outs[:1]})


def random_profiled_graphs(count: int = 25, seed: int = 0) -> list[Graph]:
    """``count`` graphs of :func:`random_profiled` with 1-30 nodes, from one seeded generator."""
    rng = random.Random(seed)
    return [random_profiled(rng, rng.randint(1, 30)) for _ in range(count)]


def rich_dag(rng: random.Random, n: int, *, p_skip: float = 0.25) -> Graph:
    """A random profiled DAG: varied sizes and times, saved inputs (multi-input ops that
    break Re-forwarding's assumption), extras, views, nodes without grad or not recomputable."""
    g = nx.DiGraph()
    for v in range(n):
        preds = [v - 1] if v and rng.random() < 0.85 else []
        preds += [u for u in range(v - 1) if rng.random() < p_skip]
        if v and not preds:
            preds = [rng.randrange(v)]
        view = bool(preds) and rng.random() < 0.1
        size = rng.choice([0, 10, 50, 100, 400])
        saves = {u for u in preds if rng.random() < 0.4} | ({v} if rng.random() < 0.6 else set())
        g.add_node(v, name=f"n{v}", out_bytes=size, alloc_bytes=0 if view else size,
                   alias_of=preds[0] if view else None, saves=tuple(saves),
                   extra_saved_bytes=rng.choice([0, 0, 0, 20]), time_s=rng.choice([0.5, 1.0, 2.0, 10.0]),
                   bwd_time_s=2.0, requires_grad=v > 0 or rng.random() < 0.8,
                   recomputable=rng.random() < 0.95)
        g.add_edges_from((u, v) for u in preds)
    for v in range(n):
        g.nodes[v]["is_output"] = g.out_degree(v) == 0
    outs = [v for v in range(n) if g.out_degree(v) == 0]
    return Graph(g, {"mode": "synthetic", "loss_saves": outs[:1]})


def plain_dag(rng: random.Random, n: int) -> Graph:
    """A random DAG through ``Graph.from_edges`` with varied sizes and times."""
    edges = set()
    for v in range(1, n):
        if rng.random() < 0.8:
            edges.add((v - 1, v))
        for u in range(v - 1):
            if rng.random() < 0.3:
                edges.add((u, v))
        if not any(e[1] == v for e in edges):
            edges.add((rng.randrange(v), v))
    sizes = [rng.choice([0, 10, 40, 100, 250]) for _ in range(n)]
    times = [rng.choice([0.5, 1.0, 3.0, 10.0]) for _ in range(n)]
    return Graph.from_edges(n, sorted(edges), out_bytes=sizes, time_s=times)


def random_chain_dag(rng: random.Random) -> Graph:
    """2-12 nodes connected along the execution order, plus random forward edges."""
    n = rng.randint(2, 12)
    edges = {(v - 1, v) for v in range(1, n)}
    edges |= {(u, v) for u in range(n) for v in range(u + 2, n) if rng.random() < 0.2}
    sizes = [rng.choice([0, 1, 8, 64, 100, 1000]) for _ in range(n)]
    times = [rng.choice([0.5, 1.0, 3.0]) for _ in range(n)]
    return Graph.from_edges(n, sorted(edges), out_bytes=sizes, time_s=times)


def random_from_edges(seed: int) -> Graph:
    """6-30 nodes: a chain with skips of 2 and 3, sizes 10/100/1000, times 1 or 10."""
    rng = random.Random(seed)
    n = rng.randint(6, 30)
    edges = {(v - 1, v) for v in range(1, n)}
    edges |= {(u, v) for u in range(n) for v in range(u + 2, min(n, u + 4)) if rng.random() < 0.3}
    return Graph.from_edges(n, sorted(edges), out_bytes=[rng.choice([10, 100, 1000]) for _ in range(n)],
                            time_s=[rng.choice([1.0, 10.0]) for _ in range(n)])


def random_edges(n: int, p: float, rng: random.Random) -> Graph:
    """Each forward edge ``u -> v`` (``u < v``) with probability ``p``."""
    edges = [(u, v) for u in range(n) for v in range(u + 1, n) if rng.random() < p]
    return Graph.from_edges(n, edges)


# ---------------------------------------------------------------------------------- network families
FAMILIES = ("chain_skips", "unet", "dense", "transformer")
"""The families of :func:`random_network`: residual chains with skips, U-Nets, dense blocks and
transformer blocks (what Kusumoto et al. and Rockmate benchmark), at op level."""


class _Ops:
    """Op-level nodes as an fx capture records them: what each op saves for backward (a
    convolution or linear its input, batch/layer norm its input plus statistics, ReLU its
    output, GELU its input, matmul both inputs, softmax its output, max-pool its input plus
    indices, add/cat/upsample nothing; add and views pass their gradient through), bytes of
    activations, times from a per-family cost per byte."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.g = nx.DiGraph()
        self.params: dict[str, int] = {}

    def __len__(self) -> int:
        return self.g.number_of_nodes()

    def op(self, kind: str, preds: list[int], out: int, *, saves: str = "none", extra: int = 0,
           heavy: bool = False, param: int = 0, passthrough: bool = False, view: bool = False) -> int:
        v = len(self)
        own = {"out": (v,), "in": tuple(preds[:1]), "ins": tuple(preds), "none": ()}[saves]
        cost = (8e-12 if heavy else 1e-12) * out * self.rng.uniform(0.5, 1.5)
        params: tuple[str, ...] = ()
        if param:
            params = (f"p{v}",)
            self.params[f"p{v}"] = param
        self.g.add_node(v, name=f"{kind}{v}", kind=kind, out_bytes=out, alloc_bytes=0 if view else out,
                        alias_of=preds[0] if view else None, saves=own, extra_saved_bytes=extra,
                        time_s=cost, bwd_time_s=2 * cost, params=params, grad_passthrough=passthrough or view)
        self.g.add_edges_from((u, v) for u in preds)
        return v

    def conv_bn_relu(self, x: int, out: int, relu: bool = True) -> int:
        c = self.op("conv", [x], out, saves="in", heavy=True, param=out // 64 + 64)
        b = self.op("bn", [c], out, saves="in", extra=max(8, out // 256), param=64)
        return self.op("relu", [b], out, saves="out") if relu else b

    def graph(self, family: str) -> Graph:
        for v in self.g.nodes:
            self.g.nodes[v]["is_output"] = self.g.out_degree(v) == 0
        outs = [v for v in self.g.nodes if self.g.out_degree(v) == 0]
        return Graph(self.g, {"mode": "synthetic", "loss_saves": outs[:1], "param_bytes": dict(self.params),
                              "model": family})


def _chain_skips(o: _Ops, n: int) -> None:
    size = o.rng.choice([2, 4, 8]) * 4096
    x = o.conv_bn_relu(o.op("conv", [], size, heavy=True), size)
    while len(o) < n - 8:
        y = o.conv_bn_relu(x, size)
        y = o.conv_bn_relu(y, size, relu=False)
        skip = x
        if o.rng.random() < 0.25:  # a downsampling block: the skip gets its own convolution
            size = max(1024, size // 2)
            skip = o.conv_bn_relu(x, size, relu=False)
            y = o.conv_bn_relu(y, size, relu=False)
        x = o.op("relu", [o.op("add", [y, skip], size, passthrough=True)], size, saves="out")
    o.op("linear", [x], 1024, saves="in", heavy=True, param=4096)


def _unet(o: _Ops, n: int) -> None:
    depth = max(1, min(5, (n - 6) // 12))
    size = o.rng.choice([4, 8]) * 8192
    x = o.op("conv", [], size, heavy=True)
    skips = []
    for _ in range(depth):
        x = o.op("relu", [o.op("conv", [x], size, saves="in", heavy=True, param=256)], size, saves="out")
        x = o.op("relu", [o.op("conv", [x], size, saves="in", heavy=True, param=256)], size, saves="out")
        skips.append((x, size))
        size = max(1024, size // 2)
        x = o.op("maxpool", [x], size, saves="in", extra=size // 2)
    while len(o) < n - 6 * depth - 2:  # the bottom: as many blocks as the node count asks
        x = o.op("relu", [o.op("conv", [x], size, saves="in", heavy=True, param=512)], size, saves="out")
    for skip, s in reversed(skips):
        up = o.op("upsample", [x], s)
        x = o.op("cat", [up, skip], 2 * s)
        x = o.op("relu", [o.op("conv", [x], s, saves="in", heavy=True, param=256)], s, saves="out")
        x = o.op("relu", [o.op("conv", [x], s, saves="in", heavy=True, param=256)], s, saves="out")
        size = s
    o.op("conv", [x], size // 4, saves="in", heavy=True, param=64)


def _dense(o: _Ops, n: int) -> None:
    growth = o.rng.choice([1, 2]) * 2048
    x = o.conv_bn_relu(o.op("conv", [], 4 * growth, heavy=True), 4 * growth)
    width = 4 * growth
    while len(o) < n - 5:
        feats = [x]
        for _ in range(o.rng.randint(3, 8)):
            if len(o) >= n - 9:
                break
            cat = o.op("cat", list(feats), width) if len(feats) > 1 else feats[0]
            b = o.op("bn", [cat], width, saves="in", extra=64, param=64)
            r = o.op("relu", [b], width, saves="out")
            feats.append(o.op("conv", [r], growth, saves="in", heavy=True, param=2048))
            width += growth
        x = o.op("cat", feats, width)
        width = max(2 * growth, width // 2)  # a transition: bn, relu, conv, pool
        x = o.op("avgpool", [o.conv_bn_relu(x, 2 * width)], width)
    o.op("linear", [x], 512, saves="in", heavy=True, param=4096)


def _transformer(o: _Ops, n: int) -> None:
    tok = o.rng.choice([2, 4]) * 4096
    attn = tok * o.rng.choice([1, 2, 4])
    x = o.op("embed", [], tok, param=8192)
    while len(o) < n - 18:
        ln = o.op("layernorm", [x], tok, saves="in", extra=64, param=64)
        q, k, v = (o.op("linear", [ln], tok, saves="in", heavy=True, param=4096) for _ in range(3))
        qh, kh, vh = (o.op("view", [t], tok, view=True) for t in (q, k, v))
        s = o.op("matmul", [qh, kh], attn, saves="ins", heavy=True)
        p = o.op("softmax", [s], attn, saves="out")
        a = o.op("matmul", [p, vh], tok, saves="ins", heavy=True)
        a = o.op("linear", [o.op("view", [a], tok, view=True)], tok, saves="in", heavy=True, param=4096)
        x = o.op("add", [x, a], tok, passthrough=True)
        ln = o.op("layernorm", [x], tok, saves="in", extra=64, param=64)
        h = o.op("gelu", [o.op("linear", [ln], 4 * tok, saves="in", heavy=True, param=16384)], 4 * tok, saves="in")
        x = o.op("add", [x, o.op("linear", [h], tok, saves="in", heavy=True, param=16384)], tok, passthrough=True)
    o.op("linear", [o.op("layernorm", [x], tok, saves="in", extra=64, param=64)], tok, saves="in", heavy=True,
         param=8192)


def random_network(family: str, seed: int, n: int) -> Graph:
    """A seeded op-level network of about ``n`` nodes (at least ~20) of ``family`` (one of
    :data:`FAMILIES`): residual chains with skips (some downsampling), U-Nets (long skips to
    concatenations), DenseNet dense blocks (concatenations of every earlier layer) and
    transformer blocks (attention with views, MLP with GELU); sizes and times vary with the seed."""
    builders = {"chain_skips": _chain_skips, "unet": _unet, "dense": _dense, "transformer": _transformer}
    if family not in builders:
        raise ValueError(f"family={family!r}; expected one of {FAMILIES}")
    o = _Ops(random.Random(f"{family}:{seed}"))
    builders[family](o, n)
    return o.graph(f"{family}-{seed}")


def random_networks(count: int, *, seed: int = 0, lo: int = 30, hi: int = 300) -> list[Graph]:
    """``count`` graphs of :func:`random_network`, the families in turn, ``lo``-``hi`` nodes."""
    rng = random.Random(seed)
    return [random_network(FAMILIES[i % len(FAMILIES)], seed * 10_000 + i, rng.randint(lo, hi))
            for i in range(count)]
# ---------------------------------------------------------------------------------- block chains
def block_chain(rng: random.Random, blocks: int, *, width: int = 6, mode: str = "module", classes: int = 1,
                shared_saved: bool = False) -> Graph:
    """A chain of ``blocks`` repeated blocks as a capture with ``blocks="ops"`` records it: a
    prefix node (an embedding, read by every block like a position table), then blocks
    ``layers.0..`` of ``width`` op nodes each (a random template per class, blocks cycling
    through ``classes``), then a head that is the output. Inside a block: two parts
    ``layers.j.a`` / ``layers.j.b`` (sub-module calls), a residual add between them that belongs
    to the block only, views, ops saving their input, their output, both or nothing, saved
    extras, workspace, a parameter per part. Node scopes and op indices are set as capture sets
    them (``meta["call_op_start"]``), so every block and part is a call region. With
    ``shared_saved`` every op reading the prefix saves it (as RoPE's multiplications save the
    position table), so no block's plan changes how long the prefix lives."""
    templates = [_block_template(random.Random(rng.random()), width, shared_saved) for _ in range(classes)]
    g = nx.DiGraph()
    g.add_node(0, name="embed", kind="embedding", module_path="embed", out_bytes=64, alloc_bytes=64,
               time_s=1.0, bwd_time_s=1.0, scope=("embed",), params=("embed.weight",), param_grad_bytes=32)
    prev, starts = 0, {}
    for j in range(blocks):
        prev = _add_block(g, templates[j % classes], j, prev, starts, mode)
    head = len(g)
    g.add_node(head, name="head", kind="linear", module_path="head", out_bytes=48, alloc_bytes=48, saves=(prev,),
               time_s=2.0, bwd_time_s=4.0, scope=("head",), params=("head.weight",), param_grad_bytes=40,
               is_output=True)
    g.add_edge(prev, head)
    params = {"embed.weight": 32, "head.weight": 40}
    for v in g.nodes:
        for p in g.nodes[v].get("params", ()):
            params.setdefault(p, g.nodes[v]["param_grad_bytes"])
    return Graph(g, {"mode": mode, "loss_saves": [head], "param_bytes": params, "call_op_start": starts})


def _block_template(rng: random.Random, width: int, shared_saved: bool) -> list[dict]:
    """Op records of one block, offsets relative to the block's first node; ``-1`` is the
    block's input, ``-2`` the prefix."""
    half = width // 2
    ops: list[dict] = []
    for i in range(width):
        part = "a" if i < half else "b"
        preds = [i - 1] if i else [-1]
        if i == half:
            preds = [-1, i - 1]  # the residual add of the block
        elif i and rng.random() < 0.3:
            preds.append(-2)
        view = i not in (0, half) and rng.random() < 0.2
        save = rng.choice(["in", "out", "both", "none"]) if i != half else "none"
        if shared_saved and -2 in preds:
            save = "shared" if save in ("none", "out") else "both+shared"
        ops.append({"part": None if i == half else part, "preds": preds, "view": view, "save": save,
                    "bytes": rng.choice([16, 32, 64, 96]), "extra": rng.choice([0, 0, 8]),
                    "fwd_temp": rng.choice([0, 0, 16]), "bwd_temp": rng.choice([0, 8]),
                    "time": float(rng.randint(1, 5)), "passthrough": i == half})
    return ops


def _add_block(g: nx.DiGraph, ops: list[dict], j: int, prev: int, starts: dict[str, int], mode: str) -> int:
    first = len(g)
    path = f"layers.{j}"
    starts[path] = 0
    for i, op in enumerate(ops):
        v = first + i
        ref = {-1: prev, -2: 0}
        preds = [ref.get(u, first + u) for u in op["preds"]]
        saves = {"in": preds[:1], "out": [v], "both": preds[:1] + [v], "none": [], "shared": [0],
                 "both+shared": preds[:1] + [v, 0]}[op["save"]]
        view = op["view"] and g.nodes[preds[0]].get("alias_of") is None and preds[0] >= first
        part = None if op["part"] is None else f"{path}.{op['part']}"
        if part is not None and part not in starts:
            starts[part] = i
        g.add_node(v, name=f"{path}:op{i}", kind="op", target=f"aten.op{i}", module_path=part or path,
                   out_bytes=op["bytes"], alloc_bytes=0 if view else op["bytes"], alias_of=preds[0] if view else None,
                   saves=tuple(u for u in saves if u != v or not view), extra_saved_bytes=op["extra"],
                   fwd_temp_bytes=op["fwd_temp"], bwd_temp_bytes=op["bwd_temp"], time_s=op["time"],
                   bwd_time_s=2 * op["time"], grad_passthrough=op["passthrough"], recomputable=mode != "module",
                   op_index=i if mode == "module" else -1,
                   scope=(path,) if part is None else (path, part),
                   params=() if i not in (0, len(ops) // 2 + 1) else (f"{part}.weight",),
                   param_grad_bytes=0 if i not in (0, len(ops) // 2 + 1) else 24)
        for u in preds:
            g.add_edge(u, v)
    return first + len(ops) - 1
