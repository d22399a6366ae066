"""Rematerialization schedules on the joint forward+backward graph (Kumar et al.'s setting).

Problem. Kumar et al. [1]_ schedule a DAG in which every node produces one tensor: a *schedule*
is a sequence of node computations, a node may be computed more than once, and each computation
needs all of its inputs in memory. The peak memory ``M(σ)`` is the largest total size of the
tensors held at any step; the length ``L(σ)`` is the total time of the computations. This module
builds that setting from a :class:`~autoremat.graph.Graph` (:class:`JointGraph`), represents a
schedule as explicit operations (:class:`Schedule`: ``compute v`` / ``free v``), checks and
measures it (:func:`simulate_schedule`), derives the tightest frees for a sequence of
computations (:func:`with_liveness_frees`, the paper's definition of ``M(σ)``), and gives the
paper's NoRemat baseline (:func:`no_remat`).

.. [1] R. Kumar, M. Purohit, Z. Svitkina, E. Vee, J. R. Wang, "Efficient Rematerialization
   for Deep Networks", NeurIPS 2019 (§2.1: computation graphs and schedules).

The joint graph (decisions). For a graph with ``n`` nodes the joint graph holds, in an order
that is topological (forward, loss, backward in reverse, final) and is exactly eager
PyTorch's order:

``fwd v`` (one per node ``v``)
    Its tensor is the storage ``v`` allocates, ``alloc_bytes`` (0 for a view or an in-place
    op, whose value lives in the storage of ``root(v)``). Inputs: ``v``'s predecessors and, for
    a predecessor that is a view, the node that owns its storage (so a view never outlives its
    storage). Time ``time_s``, workspace ``fwd_temp_bytes``.
``extra v`` (for a node that keeps ``extra_saved_bytes > 0`` for backward)
    The bytes autograd keeps for ``v`` that are no node's output (batch-norm statistics, dropout
    masks, pooling indices). The paper's nodes have one output, so this second output of
    ``v``'s forward is its own node: input ``fwd v``, size ``extra_saved_bytes``, time 0 (it
    comes with ``v``'s forward; computing it while ``fwd v`` is resident costs nothing more).
``loss``
    Inputs: what the returned object holds (:meth:`Graph.held_to_loss`) and ``meta["loss_saves"]``. Its tensor is the gradient seeds of
    the outputs (``Σ`` :meth:`Graph.grad_bytes` of outputs that require grad: ``out_bytes``, or
    the loss's smaller seed). Time 0.
``loss tensor`` (where ``meta["loss_held_bytes"] > 0``)
    The loss tensor's own storage, which the loop holds to the end of backward: input ``loss``,
    size ``loss_held_bytes``, time 0, an input of ``final``.
``bwd v`` (one per node ``v`` that requires grad)
    The backward of ``v``: inputs are the gradient of ``v``'s output, i.e. ``bwd w`` for
    every successor ``w`` that requires grad (and ``loss`` when ``v`` is an output), the
    storages ``v`` saves (``fwd root(u)`` for ``u`` in ``saves``) and ``extra v``. Its tensor
    is the gradients it produces for its inputs: ``Σ out_bytes`` (:meth:`Graph.grad_bytes`) of
    the predecessors that require grad. Time ``bwd_time_s``, workspace ``bwd_temp_bytes``.
``final``
    Size 0, time 0; inputs: every other node that nothing consumes, so every node is needed
    to compute it, as the paper assumes of its final node ``f``, and the storages the returned
    object holds where the loop keeps it to the end of backward (:meth:`Graph.held_to_end`).

Why not ``out_bytes``/``saved_bytes`` as sizes: ``out_bytes`` is nominal (a view has it but
allocates nothing), so a forward tensor's size is ``alloc_bytes``; ``out_bytes`` sizes the
gradients, which are new tensors. ``saved_bytes`` is not a tensor of its own: what ``v`` saves
is the edges from the saved storages (and ``extra v``) to ``bwd v``, so a storage that several
nodes save (a ReLU's output, kept by the ReLU and by the next convolution) is counted once
and lives until its last saver's backward, as in eager PyTorch.

Memory. At a ``compute v`` step the live bytes are the resident tensors (all inputs of ``v``
among them) plus ``v``'s tensor plus its workspace; the peak is the largest such value. This
is the paper's ``M(σ, i)`` (with workspace added) when the frees are the liveness frees.

Limitations. The joint graph is the papers' model, not the simulator's
(:mod:`autoremat.cost`): parameter gradients (a constant that every schedule keeps to the
end of the step) are left out, a gradient that an ``add`` passes through is counted as a new
tensor of its ``bwd`` node, gradient accumulation is part of the consumer's inputs, and a
recomputed backward node is treated as a pure function (as the paper's TensorFlow graphs are),
although in PyTorch it would accumulate parameter gradients again. The numbers are comparable
between schedules of this module, not with :func:`autoremat.simulate`, which judges every plan
``xla-greedy`` derives from a schedule. The one relation held by a test
(``tests/cost/test_schedule.py``): on graphs where every node saves its own output and there are
no parameters, saved extras, workspace or views, NoRemat's peak here is never below the
simulator's unoptimised peak (equal on about two graphs in three: the model can only count
gradients as more tensors).

Complexity. Building the joint graph is O(n + e); checking a schedule is O(Σ in-degrees of
its computations); :func:`with_liveness_frees` is O(same) time and O(length) space.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import networkx as nx

from ..graph import Graph

__all__ = [
    "COMPUTE",
    "FREE",
    "Op",
    "JointGraph",
    "Schedule",
    "ScheduleStats",
    "simulate_schedule",
    "with_liveness_frees",
    "no_remat",
]

COMPUTE = "compute"
FREE = "free"


class Op(NamedTuple):
    """One schedule operation: ``(COMPUTE, v)`` or ``(FREE, v)`` on a joint-graph node."""

    action: str
    node: int


@dataclass
class JointGraph:
    """The paper's computation graph for one training step (see the module docstring).

    Nodes are ``0..N-1`` in a topological order (``pred`` lists the inputs of each); ``final``
    is the paper's final node ``f``.
    """

    pred: list[list[int]]
    size_bytes: list[int]
    time_s: list[float]
    temp_bytes: list[int]
    kind: list[str]
    origin: list[int | None]
    final: int
    fwd: dict[int, int] = field(default_factory=dict)
    bwd: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.pred)
        for name in ("size_bytes", "time_s", "temp_bytes", "kind", "origin"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"JointGraph.{name} has {len(getattr(self, name))} entries, expected {n}")
        if not 0 <= self.final < n:
            raise ValueError(f"final={self.final} is not a node of a joint graph with {n} nodes")
        for v, ps in enumerate(self.pred):
            for u in ps:
                if not 0 <= u < v:
                    raise ValueError(f"joint edge {u}->{v} does not follow the topological order")
        succ: list[list[int]] = [[] for _ in range(n)]
        for v, ps in enumerate(self.pred):
            for u in ps:
                succ[u].append(v)
        self.succ = succ

    def __len__(self) -> int:
        return len(self.pred)

    def __repr__(self) -> str:
        e = sum(len(p) for p in self.pred)
        return f"JointGraph(nodes={len(self)}, edges={e}, final={self.final})"

    def name(self, v: int) -> str:
        """A readable label: ``fwd 12``, ``bwd 12``, ``extra 3``, ``loss``, ``loss tensor``, ``final``."""
        o = self.origin[v]
        return self.kind[v] if o is None else f"{self.kind[v]} {o}"

    def to_networkx(self) -> nx.DiGraph:
        """The joint graph as a :class:`networkx.DiGraph` with ``size_bytes``/``time_s``/``kind``."""
        g = nx.DiGraph()
        for v in range(len(self)):
            g.add_node(v, size_bytes=self.size_bytes[v], time_s=self.time_s[v], kind=self.kind[v],
                       origin=self.origin[v])
        g.add_edges_from((u, v) for v, ps in enumerate(self.pred) for u in ps)
        return g

    @property
    def m_max_bytes(self) -> int:
        """``M_max``: the largest tensor."""
        return max(self.size_bytes, default=0)

    @property
    def m_in_bytes(self) -> int:
        """``M_in``: the largest total input size of a node."""
        return max((sum(self.size_bytes[u] for u in ps) for ps in self.pred), default=0)

    @classmethod
    def coerce(cls, graph: "Graph | JointGraph") -> "JointGraph":
        """``graph``'s joint graph (a :class:`JointGraph` is returned as it is)."""
        if isinstance(graph, Graph):
            return cls.from_graph(graph)
        if isinstance(graph, JointGraph):
            return graph
        raise TypeError(f"graph must be an autoremat.Graph or a JointGraph, got {type(graph).__name__}")

    @classmethod
    def from_graph(cls, graph: Graph) -> "JointGraph":
        """Build the joint forward+backward graph of ``graph`` (module docstring)."""
        if not isinstance(graph, Graph):
            raise TypeError(f"graph must be an autoremat.Graph, got {type(graph).__name__}")
        b = _Builder()
        nd = [graph.node(v) for v in graph.nodes]
        req = [bool(d["requires_grad"]) for d in nd]
        fwd: dict[int, int] = {}
        extra: dict[int, int] = {}

        def storage(u: int) -> list[int]:
            """Joint nodes holding ``u``'s value: its own node and, for a view, its storage."""
            r = graph.root(u)
            return [fwd[u]] if r == u else [fwd[u], fwd[r]]

        for v in graph.nodes:
            d = nd[v]
            ins = sorted({j for u in graph.pred(v) for j in storage(u)})
            fwd[v] = b.add(ins, int(d["alloc_bytes"]), float(d["time_s"]), int(d["fwd_temp_bytes"]), "fwd", v)
            if req[v] and int(d["extra_saved_bytes"]) > 0:
                extra[v] = b.add([fwd[v]], int(d["extra_saved_bytes"]), 0.0, 0, "extra", v)
        outputs = [v for v in graph.nodes if nd[v]["is_output"]]
        held = [v for v in graph.nodes if graph.held_to_loss(v)]  # outputs and what the returned object holds
        loss_ins = sorted({j for u in held + [int(u) for u in graph.meta["loss_saves"]] for j in storage(u)})
        seed_bytes = sum(graph.grad_bytes(v) for v in outputs if req[v])  # Graph.grad_bytes
        loss = b.add(loss_ins, seed_bytes, 0.0, int(graph.meta.get("loss_bwd_temp_bytes", 0)), "loss", None)
        if graph.meta.get("loss_held_bytes", 0) > 0:  # consumed by nothing: ``final`` takes it
            b.add([loss], int(graph.meta["loss_held_bytes"]), 0.0, 0, "loss tensor", None)
        bwd: dict[int, int] = {}
        for v in reversed(graph.nodes):
            if not req[v]:
                continue
            d = nd[v]
            ins: set[int] = {bwd[w] for w in graph.succ(v) if w in bwd}
            if d["is_output"]:
                ins.add(loss)
            ins.update(fwd[graph.root(u)] for u in d["saves"])
            if v in extra:
                ins.add(extra[v])
            grads = sum(graph.grad_bytes(u) for u in graph.pred(v) if req[u])
            bwd[v] = b.add(sorted(ins), grads, float(d["bwd_time_s"]), int(d["bwd_temp_bytes"]), "bwd", v)
        consumed = {u for ps in b.pred for u in ps}
        ends = {j for u in graph.held_to_end() for j in storage(u)}  # the output object kept through backward
        final = b.add(sorted(ends | {u for u in range(len(b.pred)) if u not in consumed}), 0, 0.0, 0, "final", None)
        return cls(b.pred, b.size, b.time, b.temp, b.kind, b.origin, final, fwd, bwd)

    @classmethod
    def from_dag(cls, dag: nx.DiGraph, *, size_bytes: str = "size_bytes", time_s: str = "time_s") -> "JointGraph":
        """The paper's setting directly: a DAG on ``0..N-1`` (topological ids), one sink ``f``.

        Node attributes ``size_bytes`` (default 1) and ``time_s`` (default 1.0).
        """
        n = dag.number_of_nodes()
        if set(dag.nodes) != set(range(n)):
            raise ValueError("dag nodes must be the integers 0..N-1 in a topological order")
        sinks = [v for v in dag.nodes if dag.out_degree(v) == 0]
        if len(sinks) != 1:
            raise ValueError(f"dag must have exactly one sink (the final node), got {len(sinks)}: {sinks[:10]}")
        pred = [sorted(dag.predecessors(v)) for v in range(n)]
        size = [int(dag.nodes[v].get(size_bytes, 1)) for v in range(n)]
        time = [float(dag.nodes[v].get(time_s, 1.0)) for v in range(n)]
        return cls(pred, size, time, [0] * n, ["node"] * n, list(range(n)), sinks[0])


class _Builder:
    def __init__(self) -> None:
        self.pred: list[list[int]] = []
        self.size: list[int] = []
        self.time: list[float] = []
        self.temp: list[int] = []
        self.kind: list[str] = []
        self.origin: list[int | None] = []

    def add(self, ins: Iterable[int], size: int, time: float, temp: int, kind: str, origin: int | None) -> int:
        self.pred.append(list(ins))
        self.size.append(size)
        self.time.append(time)
        self.temp.append(temp)
        self.kind.append(kind)
        self.origin.append(origin)
        return len(self.pred) - 1


@dataclass
class Schedule:
    """A sequence of ``compute``/``free`` operations on a :class:`JointGraph`."""

    ops: list[Op]
    algorithm: str = ""
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def computes(self) -> list[int]:
        """The computed nodes, in order (the paper's ``σ``)."""
        return [op.node for op in self.ops if op.action == COMPUTE]

    def __len__(self) -> int:
        return len(self.ops)


@dataclass(frozen=True)
class ScheduleStats:
    """What :func:`simulate_schedule` measures."""

    peak_bytes: int
    """Largest live bytes at a compute step (resident + the new tensor + its workspace)."""
    n_computes: int
    """Number of computations (the paper's length with unit costs)."""
    time_s: float
    """Total time of the computations (the paper's ``L(σ)``)."""
    peak_step: int
    """Index into ``ops`` of the compute step where the peak occurs (-1 if none)."""
    max_recomputations: int
    """Largest number of times one node is computed."""
    recomputed_nodes: int
    """Nodes computed more than once."""


def simulate_schedule(joint: JointGraph, schedule: Schedule | Sequence[Op], *,
                      require_all: bool = True) -> ScheduleStats:
    """Check ``schedule`` on ``joint`` and measure its peak memory and length.

    Raises ``ValueError`` if a node is computed while one of its inputs is not resident or
    while it is itself resident, if a free names a node that is not resident, if the final
    node is not resident at the end, or (``require_all``) if some node is never computed.
    """
    ops = schedule.ops if isinstance(schedule, Schedule) else list(schedule)
    n = len(joint)
    resident = [False] * n
    count = [0] * n
    size = joint.size_bytes
    live = 0
    peak = 0
    peak_step = -1
    total_time = 0.0
    computes = 0
    for i, (action, v) in enumerate(ops):
        if not 0 <= v < n:
            raise ValueError(f"op {i} ({action} {v}) names a node outside 0..{n - 1}")
        if action == COMPUTE:
            missing = [u for u in joint.pred[v] if not resident[u]]
            if missing:
                raise ValueError(f"op {i} computes {joint.name(v)} but its inputs "
                                 f"{[joint.name(u) for u in missing[:5]]} are not resident")
            if resident[v]:
                raise ValueError(f"op {i} computes {joint.name(v)}, which is already resident")
            level = live + size[v] + joint.temp_bytes[v]
            if level > peak or peak_step < 0:
                peak, peak_step = max(peak, level), i
            resident[v] = True
            live += size[v]
            count[v] += 1
            computes += 1
            total_time += joint.time_s[v]
        elif action == FREE:
            if not resident[v]:
                raise ValueError(f"op {i} frees {joint.name(v)}, which is not resident")
            resident[v] = False
            live -= size[v]
        else:
            raise ValueError(f"op {i} has action {action!r}; expected {COMPUTE!r} or {FREE!r}")
    if n and not resident[joint.final]:
        raise ValueError(f"the final node ({joint.name(joint.final)}) is not resident at the end")
    if require_all:
        never = [v for v in range(n) if count[v] == 0]
        if never:
            raise ValueError(f"nodes never computed: {[joint.name(v) for v in never[:5]]}")
    return ScheduleStats(peak_bytes=int(peak), n_computes=computes, time_s=float(total_time),
                         peak_step=peak_step, max_recomputations=max(count, default=0),
                         recomputed_nodes=sum(c > 1 for c in count))


def with_liveness_frees(joint: JointGraph, computes: Iterable[int], *, algorithm: str = "",
                        options: dict[str, Any] | None = None) -> Schedule:
    """The schedule that computes ``computes`` in order and frees each tensor after its last use.

    A computed copy is used by the later computations up to the next computation of the same
    node; it is freed right after its last use (right after it is computed if it has none),
    except the final node's last copy, which stays. This is the memory the paper assigns to a
    sequence of computations (``M(σ)`` in §2.1). Raises ``ValueError`` if a node is computed
    before one of its inputs has ever been computed.
    """
    seq = list(computes)
    n = len(joint)
    latest = [-1] * n  # position of the most recent copy of each node
    last_use: dict[int, int] = {}  # position of a copy -> position of its last use
    for j, v in enumerate(seq):
        if not 0 <= v < n:
            raise ValueError(f"computation {j} names node {v}, outside 0..{n - 1}")
        for u in joint.pred[v]:
            i = latest[u]
            if i < 0:
                raise ValueError(f"computation {j} ({joint.name(v)}) needs {joint.name(u)}, "
                                 "which was never computed before it")
            last_use[i] = j
        latest[v] = j
    keep = latest[joint.final] if n else -1
    frees_at: dict[int, list[int]] = {}
    for i, v in enumerate(seq):
        if i == keep:
            continue
        frees_at.setdefault(last_use.get(i, i), []).append(v)
    ops: list[Op] = []
    for j, v in enumerate(seq):
        ops.append(Op(COMPUTE, v))
        for u in frees_at.get(j, ()):
            ops.append(Op(FREE, u))
    return Schedule(ops, algorithm=algorithm, options=dict(options or {}))


def no_remat(joint: JointGraph) -> Schedule:
    """The paper's NoRemat: every node once, in topological order, freed when dead."""
    if not isinstance(joint, JointGraph):
        raise TypeError(f"joint must be a JointGraph (JointGraph.from_graph(graph)), got {type(joint).__name__}")
    return with_liveness_frees(joint, range(len(joint)), algorithm="noremat")
