"""The chain model of Beaumont et al.'s offloading paper, and how a :class:`Graph` becomes one.

Paper: .. [1] O. Beaumont, L. Eyraud-Dubois, A. Shilova, "Optimal GPU-CPU Offloading Strategies
   for Deep Neural Network Training", hal-02316266, 2019 (§3.1 model, §6.1 virtual layers).

The model (§3.1, paper notation). A training step is a chain of ``L+1`` forward operations
``F_0..F_L`` and backward operations ``B_L..B_0``. ``F_i`` reads the activation ``x_i`` and
produces ``x_{i+1}``; ``B_i`` reads ``x_i``, ``x_{i+1}`` and ``y_{i+1}`` and produces ``y_i``;
``x_{i+1}`` and ``y_{i+1}`` are freed when ``B_i`` ends. So ``x_j`` lives from the start of
``F_{j-1}`` to the end of ``B_{j-1}`` (``x_0`` for the whole step). The memory an operation needs,
counting data on both devices (what it would use on the GPU with nothing offloaded), is::

    m_F[i] = ex_F[i] + sum(|x_j| for j <= i+1)
    m_B[i] = ex_B[i] + |y_i| + |y_{i+1}| + sum(|x_j| for j <= i+1)
    M_peak = max(max m_F, max m_B)

The activations ``x_0..x_L`` may be offloaded (``x_{L+1}`` is read by ``B_L`` right after
``F_L`` produces it). Transfers take ``|x| / B`` seconds at bandwidth ``B`` (bytes/s); the
paper writes the transfer time of ``x`` as ``B|x|`` with ``B`` an inverse bandwidth.

From a graph (§6.1: "grouping each non-linear part of the graph in a virtual layer").
:func:`chain_from_graph` cuts the execution order into virtual layers ``G_0..G_{K-1}`` (chain
operation ``k`` = layer ``G_k``, ``L = K - 1``) so that the chain's dependencies hold: every
storage that autograd *keeps* for backward is read in forward and saved only by its own layer
and the next one (a model output counts as read by the last layer, which holds the loss).
``grouping="fine"`` starts from one layer per node; ``grouping="split-points"`` from the cuts
after nodes ``v`` whose prefix ``{0..v}`` has every outgoing edge starting at ``v`` (the single
tensor boundaries). Cuts are then removed wherever the rule fails (e.g. a ResNet block whose
input is saved by its first convolution and read again by its ``add`` becomes one layer; a
view read two layers later merges them). ``"fine"`` may leave storages that nobody saves
crossing layers in forward (DenseNet's feature maps, read by every later concatenation of the
block): they are never offloaded and count in ``ex^F`` of every layer they cross. For each
operation ``i``:

``fwd_time_s[i]`` (``u_F``), ``bwd_time_s[i]`` (``u_B``)
    Sums of the nodes' ``time_s`` and ``bwd_time_s``.
``x_bytes[i+1]`` (``|x_{i+1}|``)
    The bytes kept for backward that ``G_i`` creates: the storages created in ``G_i`` that
    some node (or the loss) saves, de-duplicated, plus the ``extra_saved_bytes`` of ``G_i``'s
    nodes (plus the loss's extra bytes for the last layer); not those the returned object holds
    to the end of backward (:meth:`Graph.held_to_end`: offloading them frees nothing), which
    count in the extras and ``y`` as the other live bytes do. This is the unit that is offloaded
    whole. ``x_bytes[0] = 0``: the model's inputs are resident before the step. In the chain
    all of ``x_{i+1}`` is needed by ``B_{i+1}`` and ``B_i``; in the graph ``B_{i+1}`` may need only
    part of it, so prefetch deadlines are conservative.
``y_bytes[i]`` (``|y_i|``)
    What backward carries from ``B_i`` to ``B_{i-1}`` besides activations and parameter
    gradients: in the replay below, the live bytes once ``B_i`` is over, minus the kept bytes
    of ``x_0..x_i`` and the parameter gradients allocated so far (clamped at 0): the gradients
    of ``G_i``'s inputs. ``y_{L+1} = 0``: the loss is folded into the last layer (its forward
    into ``F_L``, its backward into ``B_L``).
``fwd_extra_bytes[i]`` (``ex^F_i``), ``bwd_extra_bytes[i]`` (``ex^B_i``)
    From the simulator's levels of the step with nothing recomputed
    (:func:`autoremat.cost.step_levels`): the highest live level at any
    node of ``G_i`` in forward (resp. backward), *including* each node's transient
    ``fwd_temp_bytes`` / ``bwd_temp_bytes``, the layer's non-kept tensors and gradients and,
    in backward, the parameter gradients allocated so far (autograd keeps them to the end of
    the step), minus the chain's terms (``sum(x_j, j <= i+1)``, plus ``y_i + y_{i+1}`` in
    backward), clamped at 0. So ``m_F[i]`` / ``m_B[i]`` are the replayed peak of the layer
    (unless the clamp acted, when they are above it). Between two backward operations the
    chain counts ``y`` but not the parameter gradients; that is safe: the next operation counts
    them, and memory only grows until it starts.

Preserved exactly: ``sum(fwd_time_s) == graph.total("time_s")``,
``sum(bwd_time_s) == graph.total("bwd_time_s")``, ``sum(x_bytes)`` == the bytes autograd keeps
for backward (de-duplicated saved storages, saved extras, the loss's extra bytes), and
``M_peak`` == the simulated no-recomputation step peak whenever no clamp acts at the peak
(``>=`` always; equal on the zoo networks, see the tests).

Memory values are relative to what is live when the step starts (the step peak of
DESIGN.md), like every budget in autoremat.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..graph import Graph
from .simulator import DEFAULT_BANDWIDTH_BYTES_PER_S, step_levels

__all__ = ["Chain", "chain_from_graph", "split_points", "layer_cuts", "GROUPINGS", "DEFAULT_BANDWIDTH_BYTES_PER_S"]


@dataclass(frozen=True)
class Chain:
    """A chain in the paper's notation (see the module docstring).

    Operations are indexed ``0..L`` (``n_ops = L + 1``), activations ``0..L+1``.
    """

    fwd_time_s: tuple[float, ...]
    """``u_F[i]``: forward time of operation ``i``."""
    bwd_time_s: tuple[float, ...]
    """``u_B[i]``: backward time of operation ``i``."""
    x_bytes: tuple[int, ...]
    """``|x_j|`` for ``j = 0..L+1``: ``x_j`` is the input of ``F_j`` (``x_{L+1}`` is never offloaded)."""
    y_bytes: tuple[int, ...]
    """``|y_j|`` for ``j = 0..L+1``: what ``B_j`` hands to ``B_{j-1}``."""
    fwd_extra_bytes: tuple[int, ...]
    """``ex^F_i``: memory ``F_i`` needs on top of the activations."""
    bwd_extra_bytes: tuple[int, ...]
    """``ex^B_i``: memory ``B_i`` needs on top of the activations and ``y_i``, ``y_{i+1}``."""
    bandwidth_bytes_per_s: float = DEFAULT_BANDWIDTH_BYTES_PER_S
    """``B``: host<->device bytes per second, one transfer at a time."""
    layer_nodes: tuple[tuple[int, int], ...] = ()
    """For a chain made from a graph: ``(first, last)`` node of each virtual layer."""
    layer_names: tuple[str, ...] = ()
    """For a chain made from a graph: a readable name of each virtual layer."""
    meta: dict[str, Any] = field(default_factory=dict, compare=False)
    """Provenance (graph fingerprint, model, time source)."""

    def __post_init__(self) -> None:
        n = len(self.fwd_time_s)
        conv = {
            "fwd_time_s": (tuple(float(t) for t in self.fwd_time_s), n),
            "bwd_time_s": (tuple(float(t) for t in self.bwd_time_s), n),
            "x_bytes": (tuple(int(b) for b in self.x_bytes), n + 1),
            "y_bytes": (tuple(int(b) for b in self.y_bytes), n + 1),
            "fwd_extra_bytes": (tuple(int(b) for b in self.fwd_extra_bytes), n),
            "bwd_extra_bytes": (tuple(int(b) for b in self.bwd_extra_bytes), n),
        }
        if n == 0:
            raise ValueError("a chain needs at least one operation (fwd_time_s is empty)")
        for name, (values, length) in conv.items():
            if len(values) != length:
                raise ValueError(f"{name} has {len(values)} entries; a chain of {n} operations needs {length}")
            bad = [v for v in values if v < 0 or v != v]
            if bad:
                raise ValueError(f"{name} must be >= 0, got {bad[0]!r}")
            object.__setattr__(self, name, values)
        b = float(self.bandwidth_bytes_per_s)
        if not b > 0 or b == float("inf"):
            raise ValueError(f"bandwidth_bytes_per_s={self.bandwidth_bytes_per_s!r} must be a positive finite number")
        object.__setattr__(self, "bandwidth_bytes_per_s", b)
        if self.layer_nodes and len(self.layer_nodes) != n:
            raise ValueError(f"layer_nodes has {len(self.layer_nodes)} entries for {n} operations")

    # ------------------------------------------------------------------ sizes
    @property
    def n_ops(self) -> int:
        """``L + 1``."""
        return len(self.fwd_time_s)

    @property
    def L(self) -> int:  # noqa: N802 - the paper's name
        return len(self.fwd_time_s) - 1

    @property
    def offloadable(self) -> tuple[int, ...]:
        """Activations that may be offloaded: ``x_0..x_L`` of non-zero size."""
        return tuple(j for j in range(self.n_ops) if self.x_bytes[j] > 0)

    @property
    def compute_time_s(self) -> float:
        """``sum(u_F + u_B)``: the makespan without offloading."""
        return float(sum(self.fwd_time_s) + sum(self.bwd_time_s))

    @property
    def fwd_memory_bytes(self) -> tuple[int, ...]:
        """``m_F[i]`` (both devices)."""
        out, acc = [], self.x_bytes[0]
        for i in range(self.n_ops):
            acc += self.x_bytes[i + 1]
            out.append(acc + self.fwd_extra_bytes[i])
        return tuple(out)

    @property
    def bwd_memory_bytes(self) -> tuple[int, ...]:
        """``m_B[i]`` (both devices)."""
        out, acc = [], self.x_bytes[0]
        for i in range(self.n_ops):
            acc += self.x_bytes[i + 1]
            out.append(acc + self.bwd_extra_bytes[i] + self.y_bytes[i] + self.y_bytes[i + 1])
        return tuple(out)

    @property
    def peak_bytes(self) -> int:
        """``M_peak``: the memory the step needs with nothing offloaded."""
        return max(max(self.fwd_memory_bytes), max(self.bwd_memory_bytes))

    @property
    def min_memory_bytes(self) -> int:
        """The least memory limit under which some schedule exists (offload everything).

        ``F_i`` needs ``x_i`` (its input, on the GPU until ``F_i`` ends) and ``x_{i+1}``;
        ``B_i`` needs ``x_i``, ``x_{i+1}``, ``y_i``, ``y_{i+1}``: everything older can be on the host.
        """
        mf, mb = self.fwd_memory_bytes, self.bwd_memory_bytes
        best, below = 0, 0
        for i in range(self.n_ops):
            best = max(best, mf[i] - below, mb[i] - below)
            below += self.x_bytes[i]
        return int(best)

    def to_dict(self) -> dict[str, Any]:
        return {
            "fwd_time_s": list(self.fwd_time_s), "bwd_time_s": list(self.bwd_time_s),
            "x_bytes": list(self.x_bytes), "y_bytes": list(self.y_bytes),
            "fwd_extra_bytes": list(self.fwd_extra_bytes), "bwd_extra_bytes": list(self.bwd_extra_bytes),
            "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
            "layer_nodes": [list(p) for p in self.layer_nodes], "layer_names": list(self.layer_names),
            "meta": dict(self.meta),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Chain":
        return cls(
            fwd_time_s=tuple(data["fwd_time_s"]), bwd_time_s=tuple(data["bwd_time_s"]),
            x_bytes=tuple(data["x_bytes"]), y_bytes=tuple(data["y_bytes"]),
            fwd_extra_bytes=tuple(data["fwd_extra_bytes"]), bwd_extra_bytes=tuple(data["bwd_extra_bytes"]),
            bandwidth_bytes_per_s=float(data["bandwidth_bytes_per_s"]),
            layer_nodes=tuple(tuple(p) for p in data.get("layer_nodes", ())),
            layer_names=tuple(data.get("layer_names", ())), meta=dict(data.get("meta", {})),
        )

    def with_bandwidth(self, bandwidth_bytes_per_s: float) -> "Chain":
        """A copy with another ``B``."""
        d = self.to_dict()
        d["bandwidth_bytes_per_s"] = bandwidth_bytes_per_s
        return Chain.from_dict(d)

    def with_time_scale(self, factor: float) -> "Chain":
        """A copy with every forward and backward time multiplied by ``factor`` (> 0)."""
        if not factor > 0:
            raise ValueError(f"factor={factor!r} must be > 0")
        d = self.to_dict()
        d["fwd_time_s"] = [t * factor for t in self.fwd_time_s]
        d["bwd_time_s"] = [t * factor for t in self.bwd_time_s]
        d["meta"] = {**d["meta"], "time_scale": factor * float(self.meta.get("time_scale", 1.0))}
        return Chain.from_dict(d)


# ---------------------------------------------------------------------- graph -> chain
def split_points(graph: Graph) -> list[int]:
    """Nodes ``v`` after which every edge leaving ``{0..v}`` starts at ``v``.

    A model output, a node the returned object holds (:meth:`Graph.held_to_loss`) or a node the
    loss saves counts as an edge to the loss, so no cut falls after a node whose value still waits
    for the loss. The last node is always included.
    """
    sink = {v for v in graph.nodes if graph.held_to_loss(v)} | {int(u) for u in graph.meta.get("loss_saves", [])}
    out = graph.prefix_cuts(sink)
    if len(graph) and (not out or out[-1] != len(graph) - 1):
        out.append(len(graph) - 1)
    return out


def _layers_from_cuts(n: int, cuts: Sequence[int]) -> list[int]:
    layer_of = [0] * n
    k, start = 0, 0
    for c in cuts:
        for v in range(start, c + 1):
            layer_of[v] = k
        k, start = k + 1, c + 1
    return layer_of


GROUPINGS = ("fine", "split-points")


def _kept_roots(graph: Graph) -> set[int]:
    """Storages (by root node) that autograd keeps for backward: saved by a node or the loss."""
    kept: set[int] = set()
    for v in graph.nodes:
        if graph.node(v)["requires_grad"]:
            kept.update(graph.root(u) for u in graph.node(v)["saves"])
    kept.update(graph.root(int(u)) for u in graph.meta.get("loss_saves", []))
    return kept


def layer_cuts(graph: Graph, grouping: str = "fine") -> list[int]:
    """The last node of each virtual layer (see :func:`chain_from_graph`)."""
    if grouping not in GROUPINGS:
        raise ValueError(f"grouping={grouping!r}; expected one of {GROUPINGS}")
    n = len(graph)
    kept = _kept_roots(graph)
    if grouping == "split-points":
        cuts = split_points(graph)
    else:
        cuts = list(range(n))
    users: dict[int, set[int]] = {}  # storage root -> nodes that read it in forward or save it
    for v in graph.nodes:
        d = graph.node(v)
        r = graph.root(v)
        held = graph.held_to_loss(v)
        if grouping == "split-points" or r in kept or held:
            for w in graph.succ(v):
                users.setdefault(r, set()).add(w)
        if d["requires_grad"]:
            for u in d["saves"]:
                users.setdefault(graph.root(u), set()).add(v)
        if held:
            users.setdefault(r, set()).add(n - 1)
    for u in graph.meta.get("loss_saves", []):
        users.setdefault(graph.root(int(u)), set()).add(n - 1)
    while True:
        layer_of = _layers_from_cuts(n, cuts)
        merge: tuple[int, int] | None = None
        for r, us in users.items():
            c = layer_of[r]
            hi = max(layer_of[w] for w in us)
            if hi > c + 1:
                merge = (c + 1, hi)
                break
        if merge is None:
            return cuts
        lo, hi = merge
        # cuts[k] ends layer k: drop the cuts ending layers lo..hi-1 so that lo..hi become one
        cuts = [c for k, c in enumerate(cuts) if not lo <= k < hi]


def chain_from_graph(
    graph: Graph,
    *,
    bandwidth_bytes_per_s: float = DEFAULT_BANDWIDTH_BYTES_PER_S,
    grouping: str = "fine",
) -> Chain:
    """The paper's chain for ``graph`` (see the module docstring for every quantity).

    ``bandwidth_bytes_per_s`` is ``B``; the default is :data:`DEFAULT_BANDWIDTH_BYTES_PER_S`.
    ``grouping`` picks the virtual layers: ``"fine"`` (default) or ``"split-points"``.
    """
    if not isinstance(graph, Graph):
        raise TypeError(f"graph must be an autoremat.graph.Graph, got {type(graph).__name__}")
    n = len(graph)
    if n == 0:
        raise ValueError("graph has no nodes: there is no chain to offload")
    cuts = layer_cuts(graph, grouping)
    layer_of = _layers_from_cuts(n, cuts)
    k_layers = len(cuts)
    starts = [0] + [c + 1 for c in cuts[:-1]]
    nd = [graph.node(v) for v in graph.nodes]

    # activations: kept storages and extras, by creating layer
    bundle = [0] * k_layers
    ends = graph.held_roots(to_end=True)  # the output object holds them on the device to the end
    for r in _kept_roots(graph) - ends:
        bundle[layer_of[r]] += int(nd[r]["alloc_bytes"])
    for v in graph.nodes:
        if nd[v]["requires_grad"]:
            bundle[layer_of[v]] += int(nd[v]["extra_saved_bytes"])
    bundle[-1] += int(graph.meta.get("loss_extra_bytes", 0))
    x = [0] + bundle
    prefix = [sum(x[: j + 1]) for j in range(k_layers + 1)]  # prefix[j] = sum(|x_i|, i <= j)

    # y and the extras from the replayed live levels
    lv = step_levels(graph)
    y = [0] * (k_layers + 1)
    for k in range(k_layers):
        a = starts[k]  # live once B_k (G_k's first node) is over, parameter gradients aside
        y[k] = max(0, lv.bwd_after[a] - lv.pgrad_after[a] - prefix[k])
    ex_f, ex_b = [], []
    for k in range(k_layers):
        nodes = range(starts[k], cuts[k] + 1)
        f = [lv.fwd_touch[v] for v in nodes if lv.fwd_touch[v] is not None]
        b_ = [lv.bwd_touch[v] for v in nodes if lv.bwd_touch[v] is not None]
        if k == k_layers - 1:
            f.append(lv.loss_fwd_touch)
            b_.append(lv.loss_bwd_touch)
        ex_f.append(max(0, max(f, default=0) - prefix[k + 1]))
        ex_b.append(max(0, max(b_, default=0) - prefix[k + 1] - y[k] - y[k + 1]))

    u_f = [float(sum(nd[v]["time_s"] for v in range(starts[k], cuts[k] + 1))) for k in range(k_layers)]
    u_b = [float(sum(nd[v]["bwd_time_s"] for v in range(starts[k], cuts[k] + 1))) for k in range(k_layers)]
    names = []
    for k in range(k_layers):
        a, z = starts[k], cuts[k]
        names.append(nd[a]["name"] if a == z else f"{nd[a]['name']}..{nd[z]['name']}")
    return Chain(
        fwd_time_s=tuple(u_f), bwd_time_s=tuple(u_b), x_bytes=tuple(x), y_bytes=tuple(y),
        fwd_extra_bytes=tuple(ex_f), bwd_extra_bytes=tuple(ex_b),
        bandwidth_bytes_per_s=bandwidth_bytes_per_s,
        layer_nodes=tuple((starts[k], cuts[k]) for k in range(k_layers)), layer_names=tuple(names),
        meta={"graph_fingerprint": graph.fingerprint, "model": graph.meta.get("model"),
              "time_source": graph.meta.get("time_source"), "replayed_peak_bytes": lv.peak,
              "graph_nodes": n, "grouping": grouping},
    )
