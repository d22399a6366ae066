"""The cost model every plan is judged by: step peak, extra time and a memory timeline.

The simulator replays one training step (forward, loss, backward) of eager PyTorch on a
:class:`~autoremat.graph.Graph` under a :class:`~autoremat.plan.Plan`, tracking every storage
and who holds it:

* a node's output storage lives while a later node still has to read it in forward, while
  the backward of some node that saved it is pending, or while a checkpoint region that takes
  it as input has not finished its backward (non-reentrant checkpoint keeps its inputs);
* a node's own saved extras (batch-norm statistics, dropout masks…) live until its backward;
* inside a recomputed segment nothing is saved in forward; when backward reaches the last
  node of the segment that saved something, the segment's forward is replayed up to that
  node (PyTorch's early stop) and *new* copies of the saved tensors are held until each
  node's backward has run; where the plan records a tail for the segment
  (:mod:`autoremat.replay_tail`), the replay ends before it, holds the tail inputs until it
  ends, and what the tail's nodes save is held for their backward;
* backward runs in reverse execution order (the autograd engine's order for one graph task);
  each node allocates gradients for its inputs (none when it passes its gradient through,
  like ``add``), out-of-place accumulation when a buffer is shared, parameter gradients on
  first use (they stay until the step ends), and frees its output gradient and saved tensors
  when it is done;
* the measured transient workspace of each node (``fwd_temp_bytes``/``bwd_temp_bytes``) is
  added on top while it runs.

* offloaded storages (``plan.offload``) follow Beaumont et al.'s model: a copy to host starts
  when the storage is first saved, on a link that carries one transfer at a time; its device
  memory is released once the copy is complete and forward no longer reads it; in backward the
  copies come back in order of need, one prefetch ahead, memory reserved when a prefetch starts;
  a prefetch still running when its first user's backward starts stalls the step.

The step peak is relative to what was live when the step started (see DESIGN.md). Extra time
is the forward time of every replayed node plus offload stalls; the clock that times
transfers advances by the nodes' measured forward and backward times.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable

from .graph import Graph
from .plan import Plan, Segment, validate_plan
from .replay_tail import tails_of

__all__ = ["Simulation", "simulate", "no_recompute_plan", "unoptimised_peak_bytes",
           "DEFAULT_BANDWIDTH_BYTES_PER_S", "StorageLedger"]

DEFAULT_BANDWIDTH_BYTES_PER_S = 12e9
"""Default host<->device bandwidth for offload (pinned copies over PCIe 4 x16 reach about this);
a default, not a measurement: capture on a GPU measures it, or set it in ``graph.meta``."""


@dataclass
class Simulation:
    """What :func:`simulate` predicts for one training step."""

    peak_bytes: int
    extra_time_s: float
    fwd_time_s: float
    bwd_time_s: float
    peak_at: str
    timeline: list[tuple[str, int, int]] = field(default_factory=list)
    """``(phase, node, live_bytes)`` after each event; phase is fwd, loss, recompute or bwd."""
    offload_stall_s: float = 0.0
    """Time backward waits for prefetches (included in ``extra_time_s``)."""
    offloaded_bytes: int = 0

    @property
    def step_time_s(self) -> float:
        return self.fwd_time_s + self.bwd_time_s + self.extra_time_s


def no_recompute_plan(graph: Graph) -> Plan:
    """The plan that recomputes nothing (one plain segment)."""
    segs = [Segment(tuple(graph.nodes), recompute=False)] if len(graph) else []
    return Plan(segs, solver="none", graph_fingerprint=graph.fingerprint)


def unoptimised_peak_bytes(graph: Graph) -> int:
    """Predicted step peak with no recomputation."""
    return simulate(graph, no_recompute_plan(graph), check=False).peak_bytes


class StorageLedger:
    """Storages, their sizes and who holds them; a storage is freed when its last holder lets
    go. The bookkeeping shared by :func:`simulate` and the offload chain replay."""

    def __init__(self) -> None:
        self.size: dict[Hashable, int] = {}
        self.refs: dict[Hashable, set[Hashable]] = {}
        self.live = 0
        self._gid = 0

    def alloc(self, key: Hashable, nbytes: int) -> None:
        assert key not in self.size, f"storage {key} allocated twice, please report"
        self.size[key] = int(nbytes)
        self.refs[key] = set()
        self.live += int(nbytes)

    def free(self, key: Hashable) -> None:
        self.live -= self.size.pop(key)
        del self.refs[key]

    def addref(self, key: Hashable, holder: Hashable) -> None:
        self.refs[key].add(holder)

    def decref(self, key: Hashable, holder: Hashable) -> None:
        refs = self.refs.get(key)
        if refs is None:
            return
        refs.discard(holder)
        if not refs:
            self.free(key)

    def maybe_free(self, key: Hashable) -> None:
        if key in self.refs and not self.refs[key]:
            self.free(key)

    def new_grad(self, nbytes: int) -> Hashable:
        self._gid += 1
        key = ("g", self._gid)
        self.alloc(key, nbytes)
        return key


class _Sim(StorageLedger):
    def __init__(self, graph: Graph, record: bool) -> None:
        super().__init__()
        self.g = graph
        self.record = record
        self.peak = 0
        self.peak_at = "start"
        self.timeline: list[tuple[str, int, int]] = []
        self.grad: dict[int, Hashable] = {}
        self.pgrad: set[str] = set()

    def touch(self, extra: int, where: str) -> None:
        level = self.live + extra
        if level > self.peak:
            self.peak = level
            self.peak_at = where

    def mark(self, phase: str, v: int) -> None:
        if self.record:
            self.timeline.append((phase, v, self.live))



def _okey(g: Graph, v: int) -> Hashable:
    return ("o", g.root(v))


class _Link:
    """The host<->device link: one transfer at a time, in issue order (Beaumont et al. §3)."""

    def __init__(self, bytes_per_s: float) -> None:
        self.rate = float(bytes_per_s)
        self.free_at = 0.0

    def transfer(self, nbytes: int, not_before: float) -> tuple[float, float]:
        start = max(self.free_at, not_before)
        end = start + nbytes / self.rate
        self.free_at = end
        return start, end


def simulate(graph: Graph, plan: Plan, *, check: bool = True, record: bool = True,
             bandwidth_bytes_per_s: float | None = None) -> Simulation:
    """Predict the step peak, extra time and memory timeline of ``plan`` on ``graph``.

    ``check`` runs :func:`~autoremat.plan.validate_plan` first. ``bandwidth_bytes_per_s`` is the
    host<->device link used for ``plan.offload`` (default: ``graph.meta["bandwidth_bytes_per_s"]``,
    else :data:`DEFAULT_BANDWIDTH_BYTES_PER_S`).
    """
    if check:
        validate_plan(graph, plan)
    g = graph
    s = _Sim(g, record)
    nd = [g.node(v) for v in g.nodes]
    param_bytes: dict[str, int] = g.meta.get("param_bytes", {})
    offloaded = {g.root(v) for v in plan.offload}
    link = _Link(bandwidth_bytes_per_s or g.meta.get("bandwidth_bytes_per_s") or DEFAULT_BANDWIDTH_BYTES_PER_S)
    off = _Offload(s, g, offloaded, link)

    # ---------------------------------------------------------------- forward
    seg_inputs: list[set[int]] = []
    for si, seg in enumerate(plan.segments):
        members = set(seg.nodes)
        inputs = {u for v in seg.nodes for u in g.pred(v) if u not in members}
        seg_inputs.append(inputs)
        if seg.recompute:
            for u in inputs:
                s.addref(_okey(g, u), ("seg", si))
        for v in seg.nodes:
            d = nd[v]
            off.advance()
            if d["alias_of"] is None:
                s.alloc(("o", v), d["alloc_bytes"])
            ok = _okey(g, v)
            s.touch(d["extra_saved_bytes"] + d["fwd_temp_bytes"], f"forward of node {v} ({d['name']})")
            off.clock += d["time_s"]
            saving = not seg.recompute and d["requires_grad"]
            if saving and d["extra_saved_bytes"]:
                s.alloc(("x", v), d["extra_saved_bytes"])
            for w in g.succ(v):
                s.addref(ok, ("f", w, v))
            if d["is_output"]:
                s.addref(ok, ("out", v))
            if saving:
                for u in d["saves"]:
                    if g.root(u) in offloaded:
                        off.pack(g.root(u), v)
                    else:
                        s.addref(_okey(g, u), ("s", v))
            for u in g.pred(v):
                s.decref(_okey(g, u), ("f", v, u))
            s.maybe_free(ok)
            s.mark("fwd", v)

    # ---------------------------------------------------------------- loss
    meta = g.meta
    s.touch(meta["loss_extra_bytes"] + meta["loss_fwd_temp_bytes"], "loss forward")
    s.alloc(("x", "loss"), meta["loss_extra_bytes"])
    for u in meta["loss_saves"]:
        s.addref(_okey(g, u), ("s", "loss"))
    for v in g.nodes:
        if nd[v]["is_output"]:
            s.decref(_okey(g, v), ("out", v))
    s.mark("loss", -1)
    outputs = [v for v in g.nodes if nd[v]["is_output"] and nd[v]["requires_grad"]]
    for v in outputs:
        key = s.new_grad(nd[v]["out_bytes"])
        s.addref(key, ("gb", v))
        s.grad[v] = key
    s.touch(meta["loss_bwd_temp_bytes"], "loss backward")
    for u in meta["loss_saves"]:
        s.decref(_okey(g, u), ("s", "loss"))
    s.free(("x", "loss"))
    s.mark("loss", -1)

    # ---------------------------------------------------------------- backward
    extra_time = 0.0
    tails = tails_of(plan)
    off.start_backward()
    for si in range(len(plan.segments) - 1, -1, -1):
        seg = plan.segments[si]
        members = set(seg.nodes)
        stop = -1
        if seg.recompute:
            holders = [v for v in seg.nodes if (nd[v]["saves"] or nd[v]["extra_saved_bytes"])
                       and nd[v]["requires_grad"]]
            stop = max(holders) if holders else -1
        rroot: dict[int, Hashable] = {}
        for v in reversed(seg.nodes):
            off.advance()
            if v == stop:
                spent = _recompute(s, g, nd, seg, members, stop, rroot, tails.get(si))
                extra_time += spent
                off.clock += spent
            if not seg.recompute and nd[v]["requires_grad"]:
                for u in nd[v]["saves"]:
                    if g.root(u) in offloaded:
                        off.need(g.root(u))
            _backward_node(s, g, nd, v, recomputed=seg.recompute, rroot=rroot, param_bytes=param_bytes,
                           offloaded=offloaded)
            off.clock += nd[v]["bwd_time_s"]
        if seg.recompute:
            for u in seg_inputs[si]:
                s.decref(_okey(g, u), ("seg", si))

    fwd = float(g.total("time_s"))
    bwd = float(g.total("bwd_time_s"))
    return Simulation(peak_bytes=int(s.peak), extra_time_s=float(extra_time + off.stall_s), fwd_time_s=fwd,
                      bwd_time_s=bwd, peak_at=s.peak_at, timeline=s.timeline, offload_stall_s=off.stall_s,
                      offloaded_bytes=off.offloaded_bytes)


class _Offload:
    """Offloaded storages: copied to host after their first save (device memory released once
    the copy is complete and forward no longer needs them), prefetched back during backward in
    order of need, one ahead (memory reserved when a prefetch starts). A prefetch that is not
    complete when its first user's backward starts stalls the step."""

    def __init__(self, s: _Sim, g: Graph, targets: set[int], link: _Link) -> None:
        self.s, self.g, self.targets, self.link = s, g, targets, link
        self.clock = 0.0
        self.stall_s = 0.0
        self.offloaded_bytes = 0
        self.savers: dict[int, list[int]] = {}
        self.copied_at: dict[int, float] = {}
        self.pending: list[tuple[float, int]] = []
        self.order: list[int] = []
        self.ready_at: dict[int, float] = {}

    def pack(self, r: int, saver: int) -> None:
        self.savers.setdefault(r, []).append(saver)
        if r in self.copied_at:
            return
        nbytes = self.g.node(r)["alloc_bytes"]
        _start, end = self.link.transfer(nbytes, self.clock)
        self.copied_at[r] = end
        self.offloaded_bytes += nbytes
        self.s.addref(("o", r), ("xfer", r))
        self.pending.append((end, r))

    def advance(self) -> None:
        """Release the device copy of every offload that has completed by now."""
        keep = []
        for end, r in self.pending:
            if end <= self.clock:
                self.s.decref(("o", r), ("xfer", r))
            else:
                keep.append((end, r))
        self.pending = keep

    def start_backward(self) -> None:
        # the first needed is the one whose last saver runs latest
        self.order = sorted(self.savers, key=lambda r: -max(self.savers[r]))
        self._prefetch_next()

    def _prefetch_next(self) -> None:
        for r in self.order:
            if r not in self.ready_at:
                self._prefetch(r)
                return

    def _prefetch(self, r: int) -> None:
        nbytes = self.g.node(r)["alloc_bytes"]
        _start, end = self.link.transfer(nbytes, max(self.clock, self.copied_at[r]))
        self.ready_at[r] = end
        key = ("pf", r)
        self.s.alloc(key, nbytes)
        for w in self.savers[r]:
            self.s.addref(key, ("s", w))
        self.s.touch(0, f"prefetch of node {r}")

    def need(self, r: int) -> None:
        if r not in self.ready_at:
            self._prefetch(r)
        if self.ready_at[r] > self.clock:
            self.stall_s += self.ready_at[r] - self.clock
            self.clock = self.ready_at[r]
        if self.order and self.order[0] == r:
            self.order.pop(0)
        elif r in self.order:
            self.order.remove(r)
        self._prefetch_next()


def _rkey(g: Graph, nd: list[dict], members: set[int], rroot: dict[int, Hashable], v: int) -> Hashable:
    """Storage key of ``v``'s value during the recomputation of a segment."""
    if v in rroot:
        return rroot[v]
    return _okey(g, v)


def _recompute(s: _Sim, g: Graph, nd: list[dict], seg: Segment, members: set[int], stop: int,
               rroot: dict[int, Hashable], tail: tuple[int, list[int]] | None = None) -> float:
    """Replay ``seg``'s forward up to ``stop``; keep new copies of what it saves. With a ``tail``
    (:mod:`autoremat.replay_tail`: its first node and its inputs) the replay ends before the
    tail, holds the tail inputs until it ends, and what the tail's nodes save is held for them."""
    spent = 0.0
    tail_savers: dict[int, list[int]] = {}
    held: set[int] = set()
    todo = [v for v in seg.nodes if (v <= stop if tail is None else v < tail[0])]
    replay = set(todo)
    if tail is not None:
        for w in seg.nodes:
            if w >= tail[0] and nd[w]["requires_grad"]:
                for u in nd[w]["saves"]:
                    tail_savers.setdefault(u, []).append(w)
        held = {u for u in tail[1] if u in replay}
        for u, savers in tail_savers.items():
            if u not in replay:  # an input of the segment: the forward's storage
                for w in savers:
                    s.addref(_rkey(g, nd, members, rroot, u), ("rs", w))
    for v in todo:
        d = nd[v]
        spent += d["time_s"]
        a = d["alias_of"]
        if a is None:
            rroot[v] = ("r", v)
            s.alloc(("r", v), d["alloc_bytes"])
        elif a in rroot:
            rroot[v] = rroot[a]
        key = _rkey(g, nd, members, rroot, v)
        s.touch(d["extra_saved_bytes"] + d["fwd_temp_bytes"], f"recompute of node {v} ({d['name']})")
        if d["requires_grad"]:
            if d["extra_saved_bytes"]:
                s.alloc(("rx", v), d["extra_saved_bytes"])
            for u in d["saves"]:
                s.addref(_rkey(g, nd, members, rroot, u), ("rs", v))
        for w in tail_savers.get(v, ()):
            s.addref(key, ("rs", w))
        if v in held:
            s.addref(key, ("tail", v))
        for w in g.succ(v):
            if w in replay:
                s.addref(key, ("rf", w, v))
        for u in g.pred(v):
            if u in replay:  # also views of the segment's inputs (original storage)
                s.decref(_rkey(g, nd, members, rroot, u), ("rf", v, u))
        if v in rroot:
            s.maybe_free(key)
        s.mark("recompute", v)
    for u in held:  # the replay has returned its tail inputs
        s.decref(_rkey(g, nd, members, rroot, u), ("tail", u))
    return spent


def _backward_node(s: _Sim, g: Graph, nd: list[dict], v: int, *, recomputed: bool,
                   rroot: dict[int, Hashable], param_bytes: dict[str, int], offloaded: set[int] = frozenset()) -> None:
    d = nd[v]
    gv = s.grad.pop(v, None)
    tag = "rs" if recomputed else "s"
    if gv is not None:
        transient = 0
        for u in g.pred(v):
            du = nd[u]
            if not du["requires_grad"]:
                continue
            old = s.grad.get(u)
            if d["grad_passthrough"]:
                if old is None:
                    s.addref(gv, ("gb", u))
                    s.grad[u] = gv
                else:
                    new = s.new_grad(du["out_bytes"])
                    s.addref(new, ("gb", u))
                    s.grad[u] = new
                    s.decref(old, ("gb", u))
            elif old is None:
                new = s.new_grad(du["out_bytes"])
                s.addref(new, ("gb", u))
                s.grad[u] = new
            elif len(s.refs[old]) == 1:
                transient += du["out_bytes"]  # new gradient, added in place, freed
            else:
                transient += du["out_bytes"]
                new = s.new_grad(du["out_bytes"])
                s.addref(new, ("gb", u))
                s.grad[u] = new
                s.decref(old, ("gb", u))
        for p in d["params"]:
            if p not in param_bytes:
                continue
            if p in s.pgrad:
                transient += param_bytes[p]
            else:
                s.pgrad.add(p)
                s.alloc(("p", p), param_bytes[p])
        s.touch(transient + d["bwd_temp_bytes"], f"backward of node {v} ({d['name']})")
        s.decref(gv, ("gb", v))
    if d["requires_grad"]:
        for u in d["saves"]:
            if recomputed:
                key = _rkey(g, nd, set(), rroot, u)
            elif g.root(u) in offloaded:
                key = ("pf", g.root(u))
            else:
                key = _okey(g, u)
            s.decref(key, (tag, v))
        xkey = ("rx", v) if recomputed else ("x", v)
        if xkey in s.size:
            s.free(xkey)
    s.mark("bwd", v)
