"""The profiled computation graph every solver works on.

A :class:`Graph` is a DAG of *tensor-producing nodes* (one fx op, or one submodule call in
module-level capture) held in a :class:`networkx.DiGraph`. Node ids are the integers ``0..n-1``
in execution order, which is a topological order. Inputs of the model, parameters and buffers
are not nodes: they are resident before the step starts (see DESIGN.md, "step peak").

Node attributes (all plain numbers and strings, so solvers never need torch):

``name``, ``kind``, ``target``, ``module_path``
    What the node is: fx node name (or module path), a coarse op kind (``"conv"``,
    ``"linear"``, ``"add"``, ``"module"``, ``"glue"``…), the op or module class, and the
    path of the owning submodule.
``time_s``, ``bwd_time_s``: forward and backward time of the node.
``out_bytes``: nominal bytes of the node's tensor outputs (the size of its output gradient).
``alloc_bytes``: bytes of *new* storage its outputs occupy (0 for views and in-place ops).
``alias_of``: for a view / in-place output, the node whose storage it lives in (else ``None``).
``saves``
    Nodes whose output storage autograd keeps for this node's backward (may include itself).
``unreached_saves``
    Of a node no gradient reaches (``requires_grad`` false, :mod:`autoremat.capture.dead_nodes`): the nodes whose
    storage its autograd node holds until freed (capture's lingering bytes), unless recomputed with them.
``extra_saved_bytes``
    Bytes of storages this node's backward keeps that are no node's output (batch-norm
    statistics, dropout masks, pooling indices…).
``saved_bytes``
    What autograd really keeps for this node, storage de-duplicated: the storages of
    ``saves`` plus ``extra_saved_bytes``.
``fwd_temp_bytes``, ``bwd_temp_bytes``
    Transient workspace above the modelled allocations during the node's forward / backward.
``lingering``
    Of ``fwd_temp_bytes``, ``(maker, bytes)``: earlier outputs Python keeps alive past their last
    reader while the node runs (:mod:`autoremat.capture.lingering`; the simulator's rule for them).
``params``, ``param_grad_bytes``
    Names of the trainable parameters the node uses and the bytes of their gradients.
``requires_grad``: whether the node's output takes part in backward.
``grad_passthrough``, ``grad_new``, ``grad_part``, ``first_grad_view``
    Whether the node's backward hands its output gradient to its inputs without a new
    allocation (``add``, views); the inputs it gives a new one even so (a cast to their dtype);
    ``(input, bytes)``: inputs it read through one of the views a split made (``chunk``), whose
    gradient is that view's size until the split's backward joins them (:class:`~autoremat.cost.ledger.StepState`);
    whether the first gradient the node's output gets is a view (a reader's transpose) or not dense,
    so the engine sums the second out of place, into a third buffer (:mod:`autoremat.cost.grad_handoff`).
``is_output``
    Whether the node's value is an output of the model whose gradient the loss seeds (module capture:
    one the loss reads; :mod:`autoremat.capture._loss_reach`): held as long as the returned object.
``grad_seed_bytes``
    For an ``is_output`` node: the storage bytes of the gradients the loss hands it, where smaller
    than ``out_bytes`` (``out.sum()``'s expanded scalar; ``None``: ``out_bytes``); used by
    :meth:`Graph.grad_bytes`; :meth:`Graph.scaled` scales it as ``out_bytes`` (high for a scalar).
``held_by_output``
    Whether the node's output storage is held by the object the model returned (a key/value
    cache, hidden states, attentions, logits beside a loss computed in ``forward``) though the
    loss seeds no gradient into it: held as long as that object
    (:mod:`autoremat.capture.held_outputs`). :meth:`Graph.held_to_loss` is either;
    :meth:`Graph.held_until` says until when.
``recomputable``
    Whether the runtime can run this node inside a checkpoint region on its own (module-level
    capture: module calls are, glue ops are not).
``random``: an op that draws from the RNG (dropout's mask, drop path's ``rand``): never kept by a plan.
``scope``
    The paths of the module calls the node runs inside, outermost first (the model left out; a
    call of a module run ``n > 1`` times per step is ``"<path>@<k>/<n>"``, :mod:`.call_names`,
    and a module node of one names its own call). At module level, the ops of a repeated block
    captured op by op form one *call region* per path: :meth:`Graph.call_regions`, what a
    module-level plan can recompute as one region. At fx level they name the blocks a chain
    solver groups.

Graph-level attributes live in :attr:`Graph.meta`: ``mode`` (``"fx"``, ``"module"`` or
``"synthetic"``), ``blocks`` (module level: ``"ops"`` where the repeated blocks were captured op by op,
:attr:`Graph.ops_blocks`), ``fingerprint``, ``model``, ``device``, ``time_source``, ``param_bytes``
(name -> bytes of its gradient; ``sparse_grad_params``: the names whose gradient is sparse), ``resident_bytes``, the loss node (``loss_saves``, ``loss_extra_bytes``,
``loss_fwd_temp_bytes``, ``loss_bwd_temp_bytes``, and ``loss_held_bytes``: the loss tensor's own
storage, held from the loss to the step's end), ``dead_released_after`` (:mod:`autoremat.capture.dead_nodes`),
when measured, ``measured_peak_bytes``, and ``output_kept``: how long the step keeps the object the model returned, so the storages it holds
(``is_output`` and ``held_by_output`` nodes; :mod:`autoremat.capture.held_outputs`): ``"loss"``
(the default: dropped once the loss is computed, ``loss = model(**batch).loss``, Lightning's
``training_step``) or ``"step"`` (to the end of backward, ``outputs = model(**batch);
accelerator.backward(outputs.loss)``, the usual Accelerate loop); :data:`OUTPUT_KEPT`,
:meth:`Graph.held_until`; no part of the fingerprint (the same model, stepped by another loop).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import networkx as nx

from ._graph_rules import (OUTPUT_KEPT, byte_pairs, check_output_kept, grad_bytes_of, input_nodes, scale_sparse_grads,
                           scaled_pairs)
from ._jsonio import dump_json, load_json
from .call_names import enclosing_paths, plain_path

_BATCH_BYTES = ("out_bytes", "alloc_bytes", "extra_saved_bytes", "fwd_temp_bytes", "bwd_temp_bytes")
_BATCH_META_BYTES = ("loss_extra_bytes", "loss_fwd_temp_bytes", "loss_bwd_temp_bytes", "loss_held_bytes")

__all__ = ["Graph", "NODE_DEFAULTS", "GRAPH_FORMAT_VERSION", "OUTPUT_KEPT", "check_output_kept"]

GRAPH_FORMAT_VERSION = 1

NODE_DEFAULTS: dict[str, Any] = {
    "name": "", "kind": "op", "target": "", "module_path": "",
    "time_s": 0.0, "bwd_time_s": 0.0,
    "out_bytes": 0, "alloc_bytes": 0, "alias_of": None,
    "saves": (), "unreached_saves": (), "extra_saved_bytes": 0,
    "fwd_temp_bytes": 0, "bwd_temp_bytes": 0, "lingering": (),
    "params": (), "param_grad_bytes": 0, "requires_grad": True,
    "grad_passthrough": False, "grad_new": (), "grad_part": (), "first_grad_view": False,
    "is_output": False, "grad_seed_bytes": None, "held_by_output": False,
    "recomputable": True, "scope": (), "op_index": -1, "random": False,
}

class Graph:
    """A profiled computation graph (see the module docstring for its attributes)."""

    def __init__(self, nx_graph: nx.DiGraph | None = None, meta: Mapping[str, Any] | None = None) -> None:
        g = nx.DiGraph() if nx_graph is None else nx_graph
        n = g.number_of_nodes()
        if set(g.nodes) != set(range(n)):
            raise ValueError("Graph nodes must be the integers 0..n-1 in execution order")
        for u, v in g.edges:
            if u >= v:
                raise ValueError(f"edge {u}->{v} goes backwards: node ids must be a topological order")
        for v in g.nodes:
            data = g.nodes[v]
            for key, default in NODE_DEFAULTS.items():
                data.setdefault(key, default)
            data["saves"] = tuple(sorted(set(int(u) for u in data["saves"])))
            data["unreached_saves"] = tuple(sorted(set(int(u) for u in data["unreached_saves"])))
            data["params"] = tuple(data["params"])
            data["scope"] = tuple(str(p) for p in data["scope"])
            data["lingering"] = byte_pairs(data["lingering"], v, "lingering")
            data["grad_new"] = input_nodes(data["grad_new"], v, g.predecessors(v), "grad_new")
            data["grad_part"] = byte_pairs(data["grad_part"], v, "grad_part", g.predecessors(v))
            for u in (*data["saves"], *data["unreached_saves"]):
                if u > v:
                    raise ValueError(f"node {v} saves node {u}, which runs after it")
        self.nx = g
        self.meta: dict[str, Any] = dict(meta or {})
        self.meta.setdefault("mode", "synthetic")
        self.meta.setdefault("param_bytes", {})
        self.meta.setdefault("loss_saves", [])
        for key in (*_BATCH_META_BYTES, "resident_bytes"):
            self.meta.setdefault(key, 0)
        self._refresh()

    # ------------------------------------------------------------------ construction helpers
    @classmethod
    def chain(cls, out_bytes: Iterable[int], time_s: Iterable[float] | None = None, *,
              saves_own_output: bool = True) -> "Graph":
        """A linear chain ``0 -> 1 -> ... -> n-1`` (tests, examples); each node saves its own
        output when ``saves_own_output`` (the papers' model)."""
        sizes = [int(b) for b in out_bytes]
        times = [1.0] * len(sizes) if time_s is None else [float(t) for t in time_s]
        if len(times) != len(sizes):
            raise ValueError("out_bytes and time_s must have the same length")
        g = nx.DiGraph()
        for i, (b, t) in enumerate(zip(sizes, times)):
            g.add_node(i, name=f"n{i}", out_bytes=b, alloc_bytes=b, time_s=t, bwd_time_s=2 * t,
                       saves=(i,) if saves_own_output else (), is_output=(i == len(sizes) - 1))
            if i:
                g.add_edge(i - 1, i)
        return cls(g, {"mode": "synthetic", "loss_saves": [len(sizes) - 1] if sizes else []})

    @classmethod
    def from_edges(cls, n: int, edges: Iterable[tuple[int, int]], *, out_bytes: Iterable[int] | None = None,
                   time_s: Iterable[float] | None = None, saves_own_output: bool = True) -> "Graph":
        """A synthetic DAG on ``n`` nodes; the sinks are the model outputs."""
        sizes = [1] * n if out_bytes is None else [int(b) for b in out_bytes]
        times = [1.0] * n if time_s is None else [float(t) for t in time_s]
        g = nx.DiGraph()
        for i in range(n):
            g.add_node(i, name=f"n{i}", out_bytes=sizes[i], alloc_bytes=sizes[i], time_s=times[i],
                       bwd_time_s=2 * times[i], saves=(i,) if saves_own_output else ())
        g.add_edges_from(edges)
        outs = [i for i in range(n) if g.out_degree(i) == 0]
        for i in range(n):
            g.nodes[i]["is_output"] = i in outs
        return cls(g, {"mode": "synthetic", "loss_saves": outs})

    # ------------------------------------------------------------------ basic access
    def __len__(self) -> int:
        return self.nx.number_of_nodes()

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self)))

    def __repr__(self) -> str:
        return (f"Graph(mode={self.meta.get('mode')!r}, nodes={len(self)}, "
                f"edges={self.nx.number_of_edges()}, model={self.meta.get('model', '?')!r})")

    def node(self, v: int) -> dict[str, Any]:
        """The attribute dict of node ``v``."""
        return self.nx.nodes[v]

    @property
    def nodes(self) -> range:
        return range(len(self))

    def succ(self, v: int) -> list[int]:
        return self._succ[v]

    def pred(self, v: int) -> list[int]:
        return self._pred[v]

    def root(self, v: int) -> int:
        """The node whose storage ``v``'s output lives in (itself unless it is a view)."""
        return self._root[v]

    def held_to_loss(self, v: int) -> bool:
        """Whether node ``v``'s output storage is held at least until the loss: a model output
        (``is_output``, whose gradient the loss seeds) or held by the returned object (``held_by_output``)."""
        return bool(self.nx.nodes[v]["is_output"] or self.nx.nodes[v]["held_by_output"])

    def grad_bytes(self, v: int) -> int:
        """Bytes of node ``v``'s output gradient: ``out_bytes``, or the loss's seed
        ``grad_seed_bytes`` for an output that keeps it to its backward (:mod:`._graph_rules`)."""
        d = self.nx.nodes[v]
        return grad_bytes_of(d["out_bytes"], d["grad_seed_bytes"], is_output=d["is_output"],
                             passthrough=d["grad_passthrough"],
                             read_with_grad=any(self.nx.nodes[w]["requires_grad"] for w in self._succ[v]))

    @property
    def output_kept(self) -> str:
        """``meta["output_kept"]`` (default ``"loss"``), checked (the module docstring)."""
        return check_output_kept(self.meta.get("output_kept", "loss"), 'graph.meta["output_kept"]')

    def held_until(self, v: int) -> str | None:
        """Until when the returned object holds node ``v``'s output storage, whatever else reads it:
        :attr:`output_kept` for :meth:`held_to_loss` nodes, else ``None`` (every cost model's rule)."""
        return self.output_kept if self.held_to_loss(v) else None

    def held_to_end(self) -> list[int]:
        """The nodes whose output storage the returned object holds to the end of backward
        (:meth:`held_until` ``"step"``), in order; none unless :attr:`output_kept` is ``"step"``."""
        return [v for v in self.nodes if self.held_to_loss(v)] if self.output_kept == "step" else []

    def held_roots(self, *, to_end: bool = False) -> set[int]:
        """The storages (:meth:`root`) of the :meth:`held_to_loss` nodes (``to_end``: :meth:`held_to_end`'s)."""
        return {self._root[v] for v in (self.held_to_end() if to_end else self.nodes) if to_end or self.held_to_loss(v)}

    def _refresh(self) -> None:
        n = len(self)
        self._succ = [sorted(self.nx.successors(v)) for v in range(n)]
        self._pred = [sorted(self.nx.predecessors(v)) for v in range(n)]
        root = list(range(n))
        for v in range(n):
            a = self.nx.nodes[v]["alias_of"]
            if a is not None:
                if not 0 <= a < v:
                    raise ValueError(f"node {v} is a view of node {a}, which does not run before it")
                root[v] = root[a]
        self._root = root
        self._regions: dict[str, tuple[int, ...]] | None = None
        for v in range(n):
            d = self.nx.nodes[v]
            d["saved_bytes"] = self._saved_bytes_of(v)

    def _saved_bytes_of(self, v: int) -> int:
        d = self.nx.nodes[v]
        roots = {self._root[u] for u in d["saves"]}
        return int(sum(self.nx.nodes[r]["alloc_bytes"] for r in roots) + d["extra_saved_bytes"])

    def call_regions(self) -> dict[str, tuple[int, ...]]:
        """Module path -> the nodes that run inside that call (``scope``), in execution order:
        at module level, the node sets a recomputed segment may be besides a single module call.
        Calls named in ``meta["pinned_regions"]`` (an input written in place) are left out."""
        if self._regions is None:
            pinned = set(self.meta.get("pinned_regions", ()))
            regions: dict[str, list[int]] = {}
            for v in self.nodes:
                for path in self.nx.nodes[v]["scope"]:
                    regions.setdefault(path, []).append(v)
            self._regions = {p: tuple(vs) for p, vs in regions.items() if p not in pinned}
        return self._regions

    def recompute_units(self) -> list[tuple[int, ...]]:
        """At module level, the node sets a recomputed segment can be, in execution order: each
        recomputable module call outside the blocks captured op by op, and each such block call as its
        outermost call region: what a solver planning one module call at a time chooses among."""
        if self.meta.get("mode") != "module":
            return []
        starts = self.meta.get("call_op_start", {})
        regions = self.call_regions()
        paths = {plain_path(p) for p in starts}  # inside another region (any call of it): no unit
        outer = [p for p in starts if p in regions and not any(q in paths for q in enclosing_paths(plain_path(p)))]
        first = {regions[p][0]: regions[p] for p in outer}
        inside = {v for p in outer for v in regions[p]}
        units: list[tuple[int, ...]] = []
        for v in self.nodes:
            if v in first:
                units.append(first[v])
            elif v not in inside and self.nx.nodes[v]["recomputable"]:
                units.append((v,))
        return units

    def region_of(self, nodes: Iterable[int]) -> str | None:
        """The path of the innermost call region whose nodes are exactly ``nodes`` (else ``None``)."""
        vs = tuple(sorted(set(nodes)))
        if not vs:
            return None
        regions = self.call_regions()
        for path in reversed(self.nx.nodes[vs[0]]["scope"]):
            if regions.get(path) == vs:
                return path
        return None

    # ------------------------------------------------------------------ totals
    def total(self, attr: str, nodes: Iterable[int] | None = None) -> float:
        """Sum of a numeric node attribute over ``nodes`` (default: all)."""
        return sum(self.nx.nodes[v][attr] for v in (self.nodes if nodes is None else nodes))

    param_grad_bytes = property(lambda self: int(sum(self.meta["param_bytes"].values())))

    # ------------------------------------------------------------------ order theory (Kusumoto §2)
    def delta_plus(self, nodes: Iterable[int]) -> set[int]:
        """``δ+(S)``: nodes with an edge from some node of ``S``."""
        return {w for s in nodes for w in self._succ[s]}

    def delta_minus(self, nodes: Iterable[int]) -> set[int]:
        """``δ−(S)``: nodes with an edge into some node of ``S``."""
        return {u for s in nodes for u in self._pred[s]}

    def is_lower_set(self, nodes: Iterable[int]) -> bool:
        """``L`` is a lower set iff no edge enters it from outside (``δ−(L) ⊆ L``) (:attr:`in_program_order`)."""
        s = set(nodes)
        if self.in_program_order:
            return not s or (min(s) == 0 and max(s) == len(s) - 1)
        return all(u in s for v in s for u in self._pred[v])

    ops_blocks = property(lambda self: self.meta.get("blocks") == "ops",
                          doc='Whether the repeated blocks were captured op by op (``meta["blocks"] == "ops"``).')

    @property
    def in_program_order(self) -> bool:
        """A module-level graph's forward runs in id order whatever the plan: its lower sets are the id prefixes."""
        return self.meta.get("mode") == "module"

    def boundary(self, lower: Iterable[int]) -> set[int]:
        """``∂(L) = δ−(V \\ L) ∩ L``: nodes of ``L`` with an edge leaving ``L``."""
        s = set(lower)
        return {v for v in s if any(w not in s for w in self._succ[v])}

    def prefix_cuts(self, sinks: Iterable[int] = ()) -> list[int]:
        """Nodes ``v`` after which every edge leaving the prefix ``{0..v}`` starts at ``v`` (a node
        of ``sinks`` counts one more edge, to the end of the step): where the prefix hands the rest
        one tensor (Chen's split candidates, the offload chain's split points)."""
        sink = set(sinks)
        out: list[int] = []
        open_edges = 0  # edges from the prefix to the rest
        pending: dict[int, int] = {}
        for v in self.nodes:
            open_edges -= pending.pop(v, 0)
            succ = self._succ[v]
            for w in succ:
                pending[w] = pending.get(w, 0) + 1
            own = len(succ) + (1 if v in sink else 0)
            open_edges += own
            if open_edges == own:
                out.append(v)
        return out

    def ancestor_closure(self, v: int) -> frozenset[int]:
        """``L^v``: ``v`` and every node from which ``v`` is reachable."""
        return frozenset(nx.ancestors(self.nx, v) | {v})

    def lower_sets(self, limit: int | None = None) -> Iterator[frozenset[int]]:
        """Enumerate every lower set (including ∅ and V) in order of size. The family can be
        exponential: ``limit`` stops with ``ValueError`` once more than ``limit`` sets were produced."""
        n, ordered = len(self), self.in_program_order  # the program's order: one more edge into each node
        pred_mask = [sum(1 << u for u in self._pred[v]) | (ordered and v and 1 << v - 1) for v in range(n)]
        seen = {0}
        frontier = [0]
        count = 0
        while frontier:
            nxt: list[int] = []
            for mask in frontier:
                count += 1
                if limit is not None and count > limit:
                    raise ValueError(f"more than {limit} lower sets; use a pruned family instead")
                yield frozenset(i for i in range(n) if mask >> i & 1)
                for m2 in (mask | 1 << v for v in range(n) if not mask >> v & 1 and pred_mask[v] & ~mask == 0):
                    if m2 not in seen:
                        seen.add(m2)
                        nxt.append(m2)
            frontier = nxt

    # ------------------------------------------------------------------ transforms
    def with_paper_times(self) -> "Graph":
        """A copy with the papers' time convention: 10 per convolution, 1 otherwise."""
        g = self.copy()
        for v in g.nodes:
            d = g.node(v)
            d["time_s"] = 10.0 if d["kind"] == "conv" else 1.0
            d["bwd_time_s"] = 2 * d["time_s"]
        g.meta["time_source"] = "paper (10 per convolution, 1 otherwise)"
        return g

    def copy(self) -> "Graph":
        return Graph.from_dict(self.to_dict())

    def scaled(self, factor: float) -> "Graph":
        """A copy with every batch-proportional quantity (outputs, saved tensors, workspace and lingering bytes,
        sparse gradients, times) multiplied by ``factor`` (bytes rounded up); dense parameter gradients and the
        structure do not change. Used to predict a step at another batch size."""
        if not factor > 0:
            raise ValueError(f"factor={factor!r} must be > 0")
        g = self.copy()
        for v in g.nodes:
            d = g.nx.nodes[v]
            for key in _BATCH_BYTES + (("grad_seed_bytes",) if d["grad_seed_bytes"] is not None else ()):
                d[key] = int(math.ceil(d[key] * factor))
            for key in ("lingering", "grad_part"):
                d[key] = scaled_pairs(d[key], lambda b: b * factor)
            d["time_s"] *= factor
            d["bwd_time_s"] *= factor
        for key in _BATCH_META_BYTES:
            g.meta[key] = int(math.ceil(g.meta[key] * factor))
        scale_sparse_grads(g.meta, (g.nx.nodes[v] for v in g.nodes), lambda _, b: b * factor)
        g._refresh()
        return g

    # ------------------------------------------------------------------ identity and JSON
    def compute_fingerprint(self) -> str:
        """A hash of the graph's structure (node names, kinds, edges)."""
        h = hashlib.sha256()
        h.update(str(self.meta.get("mode")).encode())
        for v in self.nodes:
            d = self.nx.nodes[v]
            h.update(f"{v}:{d['name']}:{d['kind']}:{d['module_path']};".encode())
        for u, v in sorted(self.nx.edges):
            h.update(f"{u}>{v};".encode())
        return h.hexdigest()[:16]

    @property
    def fingerprint(self) -> str:
        fp = self.meta.get("fingerprint")
        if not fp:
            fp = self.meta["fingerprint"] = self.compute_fingerprint()
        return fp

    def to_dict(self) -> dict[str, Any]:
        nodes = []
        for v in self.nodes:
            d = {k: self.nx.nodes[v][k] for k in NODE_DEFAULTS}
            d["saves"], d["unreached_saves"] = list(d["saves"]), list(d["unreached_saves"])
            d["params"] = list(d["params"])
            d["scope"] = list(d["scope"])
            d["lingering"], d["grad_part"] = [list(p) for p in d["lingering"]], [list(p) for p in d["grad_part"]]
            d["grad_new"] = list(d["grad_new"])
            nodes.append(d)
        return {
            "format": "autoremat.graph",
            "version": GRAPH_FORMAT_VERSION,
            "meta": self.meta,
            "nodes": nodes,
            "edges": sorted([list(e) for e in self.nx.edges]),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Graph":
        if data.get("format") != "autoremat.graph":
            raise ValueError("not an autoremat graph (missing format='autoremat.graph')")
        if data.get("version") != GRAPH_FORMAT_VERSION:
            raise ValueError(f"graph format version {data.get('version')!r} is not supported "
                             f"(this autoremat reads version {GRAPH_FORMAT_VERSION})")
        g = nx.DiGraph()
        for i, d in enumerate(data["nodes"]):
            g.add_node(i, **{k: d.get(k, NODE_DEFAULTS[k]) for k in NODE_DEFAULTS})
        g.add_edges_from(tuple(e) for e in data["edges"])
        return cls(g, json.loads(json.dumps(data["meta"])))

    def to_json(self, path: str | None = None) -> str:
        return dump_json(self.to_dict(), path)

    @classmethod
    def from_json(cls, text_or_path: str) -> "Graph":
        """From JSON text, or from the file at ``text_or_path``."""
        return cls.from_dict(load_json(text_or_path))
