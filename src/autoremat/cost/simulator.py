"""The cost model every plan is judged by: step peak, extra time and a memory timeline.

The simulator replays one training step (forward, loss, backward) of eager PyTorch on a
:class:`~autoremat.graph.Graph` under a :class:`~autoremat.plan.Plan`, tracking every storage
and who holds it:

* a node's output storage lives while a later node still has to read it in forward, as long as the
  returned object holds it (:meth:`Graph.held_until`: outputs, a KV cache; the loss or the step's end), while a node
  that saved it awaits its backward, or while a checkpoint region taking it as input does (it keeps its inputs);
* a node's own saved extras (batch-norm statistics, dropout masks…) live until its backward;
* inside a recomputed segment nothing is saved in forward; when backward reaches the last
  node of the segment that saved something, the segment's forward is replayed up to that
  node (PyTorch's early stop) and *new* copies of the saved tensors are held until each
  node's backward has run; where the plan records a tail for the segment
  (:mod:`autoremat.replay_tail`), the replay ends before it, holds the tail inputs until it
  ends, and what the tail's nodes save is held for their backward;
* a recomputed segment's kept nodes (``Segment.keep``: selective saves, PyTorch's
  ``create_selective_checkpoint_contexts``) hold their output storage and saved extras (the op's
  other outputs) from forward until the replay reaches them; the replay hands the stored output
  on instead of running the node (no time, no new storage, no workspace), and what the node
  saves is held as for any replayed node; a kept node the replay never reaches (after its early
  stop) is held until the segment's backward is over, and so is a kept node at the early stop
  that saves only its inputs (:func:`stops_before_running`: the replay stops when it packs them,
  before the node runs and takes its stored output);
* a replay at module level runs the user's code: what a replayed call computes for later nodes (read
  after the segment, or held by the returned object) stays in its frames until the replay ends
  (:mod:`.replay_frames`), not only until its last reader inside the segment;
* backward runs in reverse execution order (the autograd engine's order for one graph task);
  each node allocates gradients for its inputs (none when it passes its gradient through,
  like ``add``), out-of-place accumulation when a buffer is shared, parameter gradients on
  first use (they stay until the step ends), and frees its output gradient and saved tensors
  when it is done (:mod:`.grad_handoff`; also a view's backward workspace where its readers read its root);
* the loss tensor's own storage (``loss_held_bytes``: the loop holds ``loss`` through ``backward()``) is
  live from the loss's forward to the step's end;
* the measured transient workspace of each node (``fwd_temp_bytes``/``bwd_temp_bytes``) is
  added on top while it runs, less its ``lingering`` bytes (:mod:`autoremat.capture.lingering`)
  of makers whose storage is held otherwise, in a replay not made again, or that nodes no gradient
  reaches hold in a recomputed segment with them in forward (:mod:`.unreached`);
* offloaded units follow Beaumont et al.'s model on the DAG (:mod:`.offload_link`): a storage the
  plan keeps for backward (``plan.offload``: saved by a node outside a recomputed segment, or the
  input of a recomputed segment, an offloaded checkpoint) or a node's own saved tensors
  (``plan.offload_saved``) is copied to host when its first holder takes it, one transfer at a
  time per direction; its device memory is released once the copy is complete and forward no
  longer reads it; forward waits where ``plan.offload_waits`` says; backward brings the units back
  in order of first use, ``plan.offload_prefetch_depth`` ahead, memory reserved when a prefetch
  starts; a prefetch still running at its first use (a saver's backward, a replay) stalls the step.

The step peak is relative to what was live when the step started (see DESIGN.md). Extra time
is the forward time of every replayed node plus offload stalls (forward waits included); the
clock that times transfers advances by the nodes' measured forward and backward times.
Every specialised model a solver uses for speed lives beside this one in :mod:`autoremat.cost`
and is held to it by a property test on seeded random graphs (see the package docstring).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from itertools import chain, count

from ..graph import Graph
from ..plan import Plan, Segment, region_stop, validate_plan, wait_points
from ..replay_tail import tails_of
from .grad_handoff import input_grads, reader_less_view_runs, view_backward_bytes
from .ledger import PEAK_PLACES, StepState
from .replay_frames import returned_by_replay
from .offload_link import Offload
from .unreached import freed_by_recomputation, held_inputs, lingering_key, released_after, unheld

__all__ = ["Simulation", "simulate", "no_recompute_plan", "unoptimised_peak_bytes",
           "DEFAULT_BANDWIDTH_BYTES_PER_S", "StepLevels", "step_levels", "stops_before_running"]

SegmentHook = Callable[[str, int, StepState], None]  # called at segment boundaries (see ``_run``)
DEFAULT_BANDWIDTH_BYTES_PER_S = 12e9
"""Default host<->device bandwidth for offload (pinned PCIe 4 x16 copies reach about this; not a measurement)."""


@dataclass
class Simulation:
    """What :func:`simulate` predicts for one training step."""
    peak_bytes: int
    extra_time_s: float
    fwd_time_s: float
    bwd_time_s: float
    peak_at: str
    timeline: list[tuple[str, int, int]] = field(default_factory=list)  # (fwd|loss|recompute|bwd, node, live) per event
    offload_stall_s: float = 0.0  # waits for transfers (forward: copies out; backward: prefetches), in extra_time_s
    offloaded_bytes: int = 0
    offload_wait_s: float = 0.0  # the forward's part of ``offload_stall_s``
    offload_waits: dict[int, int] = field(default_factory=dict)  # from ``offload_wait_limit_bytes``: node -> unit
    offload_order: list[int] = field(default_factory=list)  # the units (autoremat.plan_offload) in order of first need
    offload_releases: dict[int, int] = field(default_factory=dict)  # forward node -> the last unit released before it

    @property
    def step_time_s(self) -> float:
        return self.fwd_time_s + self.bwd_time_s + self.extra_time_s


def no_recompute_plan(graph: Graph) -> Plan:
    """The plan that recomputes nothing (one plain segment)."""
    return Plan([Segment(tuple(graph.nodes), recompute=False)] if len(graph) else [], solver="none",
                graph_fingerprint=graph.fingerprint)


def unoptimised_peak_bytes(graph: Graph) -> int:
    """Predicted step peak with no recomputation."""
    return simulate(graph, no_recompute_plan(graph), check=False).peak_bytes


def stops_before_running(graph: Graph, v: int) -> bool:
    """Whether a replay whose early stop is node ``v`` stops before ``v`` runs: autograd packs an op's saved
    inputs before the op runs and its saved outputs after, and the replay stops at the last pack, so a node
    that saves none of its own outputs never runs (a GELU that saves its input). Selective checkpointing then
    never hands on ``v``'s stored output: it stays cached until the segment's backward is over."""
    d = graph.node(v)
    return v not in d["saves"] and not d["extra_saved_bytes"]


def _okey(g: Graph, v: int) -> Hashable:
    return ("o", g.root(v))


def simulate(graph: Graph, plan: Plan, *, check: bool = True, record: bool = True,
             bandwidth_bytes_per_s: float | None = None, offload_wait_limit_bytes: int | None = None) -> Simulation:
    """Predict the step peak, extra time and memory timeline of ``plan`` on ``graph``.

    ``check`` runs :func:`~autoremat.plan.validate_plan` first. ``bandwidth_bytes_per_s`` is the
    host<->device link used for ``plan.offload`` (default: ``graph.meta["bandwidth_bytes_per_s"]``,
    else :data:`DEFAULT_BANDWIDTH_BYTES_PER_S`). ``offload_wait_limit_bytes``: instead of the
    plan's ``offload_waits``, derive the forward's waits for copies from this memory limit
    (:mod:`.offload_link`); :attr:`Simulation.offload_waits` holds them, and the plan given them
    simulates the same.
    """
    if check:
        validate_plan(graph, plan)
    return _run(graph, plan, StepState(graph, record), bandwidth_bytes_per_s, offload_wait_limit_bytes)


@dataclass
class _Step:
    """What every phase of one simulated step reads: the graph, the plan, the offloads."""

    g: Graph
    nd: list[dict]
    plan: Plan
    off: Offload
    offloaded: set[int]
    pos: dict[int, int]  # node -> its index in the forward's execution order (segment by segment)
    stops: list[int]  # per segment: the node whose backward starts its replay (-1: none, or not recomputed)
    ok: list[tuple[str, int]]  # node -> the key of the storage its output lives in (``_okey``)
    lkey: Callable[[int], Hashable | None]  # where a lingering maker's output lives in forward (.unreached)
    unheld: frozenset[int]  # held_by_output nodes the plan frees before the object is dropped (.unreached)
    units: frozenset[int] = frozenset()  # nodes whose own saved tensors are offloaded (``plan.offload_saved``)
    dead: dict[int, list[int]] = field(default_factory=dict)  # node -> the dead recomputed segments freed after it


def _run(g: Graph, plan: Plan, s: StepState, bandwidth_bytes_per_s: float | None,
         wait_limit: int | None = None, at: SegmentHook | None = None, pre: dict | None = None) -> Simulation:
    """The step: forward of every segment, the loss, backward of every segment in reverse.
    ``at`` is called before each segment's forward (``"fwd"``), after it (``"fwd end"``) and before its backward
    (``"bwd"``) with the segment's index and the state (:mod:`.block_window`); ``pre``: :func:`_step_of`'s keywords."""
    st = _step_of(g, plan, s, bandwidth_bytes_per_s, wait_limit, **(pre or {}))
    off, seg_inputs = st.off, []
    for si, seg in enumerate(plan.segments):
        if at is not None:
            at("fwd", si, s)
        seg_inputs.append(_forward(s, st, si, seg))
        if at is not None:
            at("fwd end", si, s)
    _loss(s, st)
    extra_time = _backward(s, st, seg_inputs, at)
    for v in (w for w in g.held_to_end() if w not in st.unheld):  # the loop drops the output object after backward
        s.decref(_okey(g, v), ("out", v))
    fwd = float(sum(d["time_s"] for d in st.nd))  # Graph.total's sum, in node order, without networkx
    bwd = float(sum(d["bwd_time_s"] for d in st.nd))
    return Simulation(peak_bytes=int(s.peak), extra_time_s=float(extra_time + off.stall_s), fwd_time_s=fwd,
                      bwd_time_s=bwd, peak_at=s.peak_at, timeline=s.timeline, offload_stall_s=off.stall_s,
                      offloaded_bytes=off.offloaded_bytes, offload_wait_s=off.wait_s, offload_waits=dict(off.waits),
                      offload_order=list(off.needed), offload_releases=dict(off.releases))


def _step_of(g: Graph, plan: Plan, s: StepState, bandwidth_bytes_per_s: float | None,
             wait_limit: int | None = None, nd: list[dict] | None = None, ok: list | None = None,
             pos: dict[int, int] | None = None, points: set[int] | None = None) -> _Step:
    """What every phase of one simulated step of ``plan`` reads (``nd``, ``ok``, ``pos``, ``points``: the nodes'
    attributes and output keys, ``plan``'s execution positions and :func:`wait_points`, where the caller has them)."""
    nd = [g.node(v) for v in g.nodes] if nd is None else nd
    offloaded = {g.root(v) for v in plan.offload}
    units = frozenset(plan.offload_saved)
    rate = bandwidth_bytes_per_s or g.meta.get("bandwidth_bytes_per_s") or DEFAULT_BANDWIDTH_BYTES_PER_S
    off = Offload(s, offloaded, rate, waits=None if wait_limit is not None else plan.offload_waits,
                  wait_limit=wait_limit, wait_points=None if wait_limit is None else points or wait_points(g, plan),
                  order=plan.offload_order, depth=plan.offload_prefetch_depth, units=units)
    pos = dict(zip(chain.from_iterable(seg.nodes for seg in plan.segments), count())) if pos is None else pos
    stops = [region_stop(g, seg) for seg in plan.segments]
    ok = [_okey(g, v) for v in g.nodes] if ok is None else ok
    freed = freed_by_recomputation(g, plan, nd)  # what nodes no gradient reach hold, freed by the plan (.unreached)
    dead: dict[int, list[int]] = {}
    for si, at in released_after(g, plan, nd).items():
        dead.setdefault(at, []).append(si)
    return _Step(g, nd, plan, off, offloaded, pos, stops, ok, lingering_key(g, freed, ok), unheld(g, nd, freed), units,
                 dead)


def _forward(s: StepState, st: _Step, si: int, seg: Segment) -> set[int]:
    """The forward of segment ``si``; returns its inputs (a recomputed segment holds them until its backward
    is over, in host memory if offloaded; none in a region no gradient reaches, whose graph holds them until
    capture saw it freed where it recorded that: .unreached)."""
    g, nd, off, offloaded, units = st.g, st.nd, st.off, st.offloaded, st.units
    inputs = _inputs(g, seg) if held_inputs(seg, nd) else set()
    if any(si in sis for sis in st.dead.values()):  # its graph holds its inputs until freed (.unreached.released_after)
        for u in _inputs(g, seg):
            s.addref(st.ok[u], ("dead", si))
    if seg.recompute:
        for u in inputs:
            if g.root(u) in offloaded and st.stops[si] >= 0:
                off.pack(g.root(u), ("seg", si), st.pos[st.stops[si]])
            else:
                s.addref(_okey(g, u), ("seg", si))
    kept, okey_of = set(seg.keep), st.lkey  # okey_of: where a lingering maker's output lives
    okeys, root, succ, pred, alloc, addref, decref = st.ok, g.root, g.succ, g.pred, s.alloc, s.addref, s.decref
    for v in seg.nodes:
        d = nd[v]
        if off.pending and off.pending[0][0] <= off.clock:  # else advance releases nothing
            off.advance(at=v)
        if offloaded or units:
            off.before_node(v, d["alloc_bytes"] * (d["alias_of"] is None) + d["extra_saved_bytes"] + d["fwd_temp_bytes"])
        if d["alias_of"] is None:
            alloc(("o", v), d["alloc_bytes"])
        ok = okeys[v]
        s.touch(d["extra_saved_bytes"] + s.workspace(d, okey_of), "fwd", v)
        off.clock += d["time_s"]
        saving = not seg.recompute and d["requires_grad"]
        if saving and d["extra_saved_bytes"]:
            alloc(("x", v), d["extra_saved_bytes"])
        for w in succ(v):
            addref(ok, ("f", w, v))
        if v in kept:
            s.keep(ok, v, d["extra_saved_bytes"])
        if d["is_output"] or d["held_by_output"] and v not in st.unheld:  # Graph.held_to_loss, without the call
            addref(ok, ("out", v))
        if saving:
            for u in d["saves"]:
                if offloaded and root(u) in offloaded:
                    off.pack(root(u), ("s", v), st.pos[v])
                else:
                    addref(okeys[u], ("s", v))
        for u in pred(v):
            decref(okeys[u], ("f", v, u))
        if v in off.pack_at:  # own saved tensors (Plan.offload_saved): a node's, or its block's at the block's end
            off.pack_saved(v, st.pos)
        s.maybe_free(ok)
        for di in st.dead.get(v, ()):
            _release_dead(s, st, di)
        s.mark("fwd", v)
    return inputs


def _inputs(g: Graph, seg: Segment) -> set[int]:
    members = set(seg.nodes)
    return {u for v in seg.nodes for u in g.pred(v) if u not in members}


def _release_dead(s: StepState, st: _Step, si: int) -> None:
    """The graph of dead recomputed segment ``si`` is freed: its inputs go (a no-op when already gone)."""
    for u in _inputs(st.g, st.plan.segments[si]):
        s.decref(st.ok[u], ("dead", si))


def _loss(s: StepState, st: _Step) -> None:
    """The loss: its forward and backward, the gradients of the outputs allocated; its own storage stays."""
    g, nd, unheld, meta = st.g, st.nd, st.unheld, st.g.meta
    s.touch(meta["loss_extra_bytes"] + meta["loss_held_bytes"] + meta["loss_fwd_temp_bytes"], "loss fwd")
    for di in chain.from_iterable(st.dead.values()):  # those freed after the forward (the others: a no-op)
        _release_dead(s, st, di)
    s.alloc(("x", "loss"), meta["loss_extra_bytes"])
    s.alloc(("l", "loss"), meta["loss_held_bytes"])  # never freed: held to the step's end
    for u in meta["loss_saves"]:
        s.addref(_okey(g, u), ("s", "loss"))
    for v in (g.nodes if g.output_kept == "loss" else ()):  # Graph.held_until: the object is dropped
        if nd[v]["is_output"] or nd[v]["held_by_output"] and v not in unheld:
            s.decref(_okey(g, v), ("out", v))
    s.mark("loss", -1)
    outputs = [v for v in g.nodes if nd[v]["is_output"] and nd[v]["requires_grad"]]
    for v in outputs:
        key = s.new_grad(g.grad_bytes(v))  # the loss's seed (Graph.grad_bytes)
        s.addref(key, ("gb", v))
        s.grad[v] = key
    s.touch(meta["loss_bwd_temp_bytes"], "loss bwd")
    for u in meta["loss_saves"]:
        s.decref(_okey(g, u), ("s", "loss"))
    s.free(("x", "loss"))
    s.mark("loss", -1)


def _backward(s: StepState, st: _Step, seg_inputs: list[set[int]], at: SegmentHook | None = None) -> float:
    """Backward of every segment in reverse order, replaying the recomputed ones; returns the replayed forward time."""
    extra_time = 0.0
    tails = tails_of(st.plan)
    param_bytes: dict[str, int] = st.g.meta.get("param_bytes", {})
    st.off.start_backward()
    for si in range(len(st.plan.segments) - 1, -1, -1):
        if at is not None:
            at("bwd", si, s)
        extra_time += _backward_segment(s, st, si, seg_inputs[si], tails.get(si), param_bytes)
    return extra_time


def _backward_segment(s: StepState, st: _Step, si: int, inputs: set[int], tail: tuple[int, list[int]] | None,
                      param_bytes: dict[str, int]) -> float:
    """Backward of segment ``si`` (``inputs``: its forward's), replaying it when recomputed; the replayed time."""
    g, nd, off, offloaded = st.g, st.nd, st.off, st.offloaded
    seg = st.plan.segments[si]
    stop = st.stops[si]
    extra_time = 0.0
    held = {u: g.root(u) for u in sorted(inputs, key=g.root) if g.root(u) in offloaded} if stop >= 0 else {}
    rroot: dict[int, Hashable] = {}
    for v in reversed(seg.nodes):
        if off.pending and off.pending[0][0] <= off.clock:  # else advance releases nothing
            off.advance()
        if v == stop:
            for u, r in held.items():  # the replay reads the region's offloaded inputs (and views of them)
                off.need(r)
                rroot[u] = rroot[r] = off.key(r)
            spent = _recompute(s, g, nd, seg, stop, rroot, tail)
            extra_time += spent
            off.clock += spent
        if not seg.recompute and nd[v]["requires_grad"]:
            for r in off.need_at.get(v, ()):
                off.need(r)  # first among what v's backward reads (offload_link's order)
            for u in nd[v]["saves"]:
                if g.root(u) in offloaded:
                    off.need(g.root(u))
        _backward_node(s, g, nd, v, recomputed=seg.recompute, rroot=rroot, param_bytes=param_bytes, off=off,
                       okeys=st.ok)
        off.clock += nd[v]["bwd_time_s"]
    if seg.recompute:
        for u in inputs:
            s.decref(off.key(held[u]) if u in held else _okey(g, u), ("seg", si))
        for v in seg.keep:  # kept outputs the replay did not reach (after its early stop)
            s.let_go(_okey(g, v), v)
    return extra_time


def _rkey(g: Graph, rroot: dict[int, Hashable], v: int) -> Hashable:
    """Storage key of ``v``'s value during the recomputation of a segment."""
    if v in rroot:
        return rroot[v]
    r = g.root(v)
    return rroot[r] if r in rroot else ("o", r)  # an offloaded input's storage is its prefetched copy


def _recompute(s: StepState, g: Graph, nd: list[dict], seg: Segment, stop: int,
               rroot: dict[int, Hashable], tail: tuple[int, list[int]] | None = None) -> float:
    """Replay ``seg``'s forward up to ``stop``; keep new copies of what it saves. With a ``tail``
    (:mod:`autoremat.replay_tail`: its first node and its inputs) the replay ends before the
    tail, holds the tail inputs until it ends, and what the tail's nodes save is held for them."""
    spent = 0.0
    kept = set(seg.keep)
    tail_savers: dict[int, list[int]] = {}
    held: set[int] = set()
    todo = [v for v in seg.nodes if (v <= stop if tail is None else v < tail[0])]
    replay = set(todo)
    frame = returned_by_replay(g, nd, seg, todo)  # held by the replayed calls' frames to the replay's end
    again = lambda u: _rkey(g, rroot, u) if u in replay else None  # noqa: E731 (lingering makers: StepState.workspace)
    if tail is not None:
        for w in seg.nodes:
            if w >= tail[0] and nd[w]["requires_grad"]:
                for u in nd[w]["saves"]:
                    tail_savers.setdefault(u, []).append(w)
        held = {u for u in tail[1] if u in replay}
        for u, savers in tail_savers.items():
            if u not in replay:  # an input of the segment: the forward's storage
                for w in savers:
                    s.addref(_rkey(g, rroot, u), ("rs", w))
    for v in todo:
        d = nd[v]
        a = d["alias_of"]
        if v in kept:  # the stored output is handed on: nothing runs
            rroot[v] = _okey(g, v)
        else:
            spent += d["time_s"]
            if a is None:
                rroot[v] = ("r", v)
                s.alloc(("r", v), d["alloc_bytes"])
            elif a in rroot:
                rroot[v] = rroot[a]
        key = _rkey(g, rroot, v)
        if v not in kept:  # lingering bytes: only of makers the replay makes again
            s.touch(d["extra_saved_bytes"] + s.workspace(d, again), "recompute", v)
        if d["requires_grad"]:
            s.replay_extras(v, d["extra_saved_bytes"])
            for u in d["saves"]:
                s.addref(_rkey(g, rroot, u), ("rs", v))
        for w in tail_savers.get(v, ()):
            s.addref(key, ("rs", w))
        if v in held:
            s.addref(key, ("tail", v))
        if v in frame:
            s.addref(key, ("frame", v))
        for w in g.succ(v):
            if w in replay:
                s.addref(key, ("rf", w, v))
        for u in g.pred(v):
            if u in replay:  # also views of the segment's inputs (original storage)
                s.decref(_rkey(g, rroot, u), ("rf", v, u))
        if v in kept:
            if v != stop or not stops_before_running(g, v):  # else held to the segment's end
                s.let_go(key, v)
        elif v in rroot:
            s.maybe_free(key)
        s.mark("recompute", v)
    for u in held:  # the replay has returned its tail inputs
        s.decref(_rkey(g, rroot, u), ("tail", u))
    for u in frame:  # the replayed calls have returned (or stopped early)
        s.decref(_rkey(g, rroot, u), ("frame", u))
    return spent


def _backward_node(s: StepState, g: Graph, nd: list[dict], v: int, *, recomputed: bool,
                   rroot: dict[int, Hashable], param_bytes: dict[str, int], off: Offload,
                   okeys: list[tuple[str, int]]) -> None:
    """Node ``v``'s backward: its inputs' gradients (new, shared by a pass-through, accumulated, or parts
    of a split's views), its parameters' gradients on first use, its workspace; then its saves go."""
    d = nd[v]
    s.join_parts(v, d["out_bytes"])  # gradients of parts a split made of v's output (grad_part)
    gv = s.grad.pop(v, None)
    if gv is not None:
        transient, first = input_grads(s, g, nd, v, gv)
        for p in d["params"]:
            if p not in param_bytes:
                continue
            if p in s.pgrad:
                transient += param_bytes[p]
            else:
                s.pgrad.add(p)
                s.pgrad_bytes += int(param_bytes[p])
                s.alloc(("p", p), param_bytes[p])
        # the workspace, or (once it is gone) first gradients that are views alive through their sums
        s.touch(transient + max(d["bwd_temp_bytes"], first), "bwd", v)  # (.grad_handoff)
        s.decref(gv, ("gb", v))
    elif reader_less_view_runs(s, g, nd, v):  # its readers handed their gradients to its root (.grad_handoff)
        s.touch(view_backward_bytes(g, nd, v), "bwd", v)
    if d["requires_grad"]:
        holder = ("rs" if recomputed else "s", v)
        targets = off.targets
        for u in d["saves"]:
            if recomputed:
                key = _rkey(g, rroot, u)
            elif targets and g.root(u) in targets:
                key = off.key(g.root(u))
            else:  # (a part of a block's unit: where its prefetch put it, offload_link)
                key = off.cur.get(okeys[u], okeys[u]) if off.cur else okeys[u]
            s.decref(key, holder)
        xkey = ("rx", v) if recomputed else ("x", v)
        if not recomputed and v in off.units:  # the prefetched unit, or the device copy still there
            s.decref(off.key(-1 - v), holder)
        elif xkey in off.cur:
            s.decref(off.cur[xkey], holder)
        elif xkey in s.size:
            s.free(xkey)
    s.mark("bwd", v)


# ------------------------------------------------------------------------ per-node levels
@dataclass
class StepLevels:
    """The live level at each event of one step (:func:`step_levels`; nothing recomputed unless a plan is given)."""

    fwd_touch: list[int | None]
    """Per node: live bytes plus its saved extras and workspace during its forward."""
    bwd_touch: list[int | None]
    """Per node: live bytes plus its transients and workspace during its backward (``None``: no gradient reaches it)."""
    bwd_after: list[int]
    """Per node: live bytes once its backward is over."""
    pgrad_after: list[int]
    """Per node: bytes of the parameter gradients allocated once its backward is over."""
    loss_fwd_touch: int
    loss_bwd_touch: int
    peak: int
    recompute_touch: list[int | None] = field(default_factory=list)
    """Per node: live bytes plus its saved extras and workspace during its replay (``None``: not replayed)."""
    extra_time_s: float = 0.0


def step_levels(graph: Graph, plan: Plan | None = None, *, at: SegmentHook | None = None) -> StepLevels:
    """The levels :func:`simulate` sees at each node's forward, replay and backward under ``plan`` (default: nothing
    recomputed; what :func:`autoremat.cost.chain.chain_from_graph` turns into the chain's terms, and
    :mod:`autoremat.cost.block_chain` into its blocks'); ``at``: see ``_run``)."""
    levels: dict[str, dict[int, int]] = {phase: {} for phase in (*PEAK_PLACES, "after bwd", "pgrad after bwd")}
    plan = no_recompute_plan(graph) if plan is None else plan
    sim = _run(graph, plan, StepState(graph, record=False, levels=levels), None, at=at)
    n = len(graph)
    return StepLevels(fwd_touch=[levels["fwd"].get(v) for v in range(n)],
                      bwd_touch=[levels["bwd"].get(v) for v in range(n)], bwd_after=[levels["after bwd"][v] for v in range(n)],
                      pgrad_after=[levels["pgrad after bwd"][v] for v in range(n)],
                      loss_fwd_touch=levels["loss fwd"][-1], loss_bwd_touch=levels["loss bwd"][-1],
                      peak=sim.peak_bytes, recompute_touch=[levels["recompute"].get(v) for v in range(n)],
                      extra_time_s=sim.extra_time_s)
