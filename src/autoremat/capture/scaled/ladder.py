"""Real captures at batch sizes that fit: which sizes, out-of-memory safe, and the scaled graph
made from them."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch import nn

from ...graph import Graph
from .batch import cut_bytes_per_row, cut_rows, input_bytes
from .fit import check_same, fit, fixed_grad_bytes, same_graph, scale_to, with_times, with_workspace
from .limits import CaptureDoesNotFitError, free_cache, is_oom

__all__ = ["largest_fitting", "ladder"]

logger = logging.getLogger(__name__)


def largest_fitting(predict: Callable[[int], float], batch: int, limit: int) -> int:
    """The largest size below ``batch`` whose predicted unoptimised peak is within ``limit``."""
    lo, hi = 1, batch - 1
    if predict(lo) > limit:
        raise CaptureDoesNotFitError(1, limit, batch)
    while lo < hi:  # predict grows with the size
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if predict(mid) <= limit else (lo, mid - 1)
    return lo


def _timed_copy(model: nn.Module, gm: torch.fx.GraphModule | None, args: tuple, kwargs: dict, opts: dict,
                base: Graph) -> Graph:
    """``base`` with the node times of real steps on ``args`` (no recording step: bytes are base's;
    ``opts["warmup"]`` and ``opts["repeats"]`` steps)."""
    from ...measure import default_loss
    from ...resident import device_of
    from ..preserved import preserved_state
    from ..fx import time_fx
    from ..module import time_modules

    device = device_of(model, args, kwargs)
    loss = opts["loss_fn"] or default_loss
    timing = dict(repeats=opts["repeats"], warmup=opts["warmup"], device=device)
    with preserved_state(model, [device]):
        if gm is not None:
            fwd, bwd, noise = time_fx(gm, args, kwargs, loss, **timing)
        else:
            order = [v for v in base.nodes if base.node(v)["kind"] != "glue"]
            fwd, bwd, noise = time_modules(model, order, len(base), args, kwargs, loss, **timing)
    g = base.copy()
    for v, f, b in zip(g.nodes, fwd, bwd):
        g.node(v)["time_s"], g.node(v)["bwd_time_s"] = float(f), float(b)
    g.meta["time_source"] = "cuda-events" if device.type == "cuda" else "perf_counter"
    g.meta["time_noise"] = round(float(noise), 6)
    return g


class _Trial:
    """Real captures at cut batches, out-of-memory safe; ``smallest`` is the smallest size tried.
    With ``base`` (bytes known) they are timing steps only, on ``gm`` at fx level."""

    def __init__(self, model: nn.Module, args: tuple, kwargs: dict, opts: dict, batch: int, batch_dim: int,
                 limit: int, base: Graph | None, gm: torch.fx.GraphModule | None) -> None:
        self.model, self.args, self.kwargs, self.opts, self.base = model, args, kwargs, opts, base
        self.batch, self.batch_dim, self.limit = batch, batch_dim, limit
        self.smallest = batch
        self.per_row = cut_bytes_per_row(args, kwargs, batch, batch_dim)  # the cut batch's copy, beside the step
        self.gm = gm  # the one trace (capture_within's) for the meta capture, every run and the replay
        # blocks captured op by op: per-op times come from a recorded step (a timing step times the
        # node modules only), which also shows whether the meta graph is the real one
        self.recorded = base is None or base.ops_blocks
        if base is not None and base.meta["mode"] == "fx":
            from ..fx import fx_fingerprint

            assert gm is not None and fx_fingerprint(gm) == base.fingerprint, \
                "the traced graph changed, please report"

    def run(self, size: int) -> Graph | None:
        """A capture at ``size`` rows, or ``None`` when it ran out of memory (state restored)."""
        from .. import _capture

        self.smallest = min(self.smallest, size)
        small: Any = None
        try:
            small = cut_rows(self.args, self.kwargs, self.batch, size, self.batch_dim)
            if not self.recorded:
                # no warm-up step: the median of three or more repeats leaves out the first step's
                # one-off costs (kernel set-up for new shapes)
                opts = {**self.opts, "warmup": 0} if self.opts["repeats"] >= 3 else self.opts
                g = _timed_copy(self.model, self.gm, *small, opts, self.base)
                return g
            return _capture(self.model, *small, **self.opts, traced=self.gm)
        except ValueError as err:
            if size != 1 or "more than 1 value per channel" not in str(err):
                raise
            # batch-norm's training statistics need two rows: one row is no size to profile at
            logger.info("autoremat: the model does not train on a batch of 1 (%s)", err)
        except (RuntimeError, torch.OutOfMemoryError) as err:
            if not is_oom(err) and size != self.batch:
                raise RuntimeError(
                    f"profiling at batch size {size} (of {self.batch}; the step does not fit the budget, so autoremat "
                    f"times it at smaller batches cut along dimension {self.batch_dim} of the example inputs) failed: "
                    f"{err}. If loss_fn reads a tensor of the full batch it closes over (a target: "
                    "lambda out: F.mse_loss(out.sample, noise)), it cannot run there: slice it to the output's rows "
                    "(noise[: out.sample.shape[0]]), or give a budget the whole step fits") from err
            if not is_oom(err):
                raise
            logger.info("autoremat: profiling at batch size %d ran out of memory; trying smaller", size)
        del small
        free_cache()
        return None

    def down(self, size: int) -> dict[int, Graph]:
        """``size`` and ``size // 2``, halving past any size that runs out of memory."""
        got: dict[int, Graph] = {}
        while len(got) < 2 and size >= 1:
            g = self.run(size)
            if g is not None:
                got[size] = g
            elif not got and size == 1:
                raise CaptureDoesNotFitError(1, self.limit, self.batch)
            elif got:
                break
            size //= 2
        return got

    def up(self, size: int) -> dict[int, Graph]:
        """From ``size`` (halved on out of memory), doubling while the peak fitted through the real
        captures so far predicts the next size fits, up to ``batch // 2``; the whole batch alone
        where it is predicted to need at most half the limit."""
        got: dict[int, Graph] = {}
        while True:
            g = self.run(size)
            if g is None:
                if got:
                    return got
                if size == 1:
                    raise CaptureDoesNotFitError(1, self.limit, self.batch)
                size //= 2
                continue
            got[size] = g
            if self._need(got, self.batch) <= self.limit / 2:  # ample room: the whole batch
                whole = self.run(self.batch)
                if whole is not None:
                    return {self.batch: whole}
            nxt = size * 2
            if nxt > self.batch // 2 or self._need(got, nxt) > self.limit:
                return got
            size = nxt

    def _need(self, got: dict[int, Graph], size: int) -> float:
        """The unoptimised peak at ``size`` (:meth:`_guess`) and the cut batch's copy beside it."""
        return self._guess(got, size) + self.per_row * size

    @staticmethod
    def _guess(got: dict[int, Graph], size: int) -> float:
        """Unoptimised peak at ``size``: linear through the two largest captures; from one, the
        gradients stay and the rest is proportional."""
        from ...cost import unoptimised_peak_bytes

        sizes = sorted(got)[-2:]
        peaks = [unoptimised_peak_bytes(got[s]) for s in sizes]
        if len(sizes) == 1:
            fixed = fixed_grad_bytes(got[sizes[0]])
            return fixed + max(0, peaks[0] - fixed) * size / sizes[0]
        return fit(peaks[0], peaks[-1], sizes[0], sizes[-1], size)


def _replayed(trial: _Trial, out: Graph, s_lo: int, s_hi: int, workspace: dict[int, tuple[int, int]],
              signatures: dict[str, Any]) -> dict[int, tuple[float, float]]:
    """Full-batch times of the nodes :mod:`.replay` times alone (fx captures, two sizes); their
    workspace on CUDA into ``workspace``. ``signatures``: their full-size arguments from the meta
    capture (else extrapolated from a forward at ``s_hi``)."""
    from ...resident import device_of
    from .replay import replay_times

    if s_lo == s_hi or out.meta["mode"] != "fx" or trial.gm is None:
        return {}
    at_hi = None if signatures else cut_rows(trial.args, trial.kwargs, trial.batch, s_hi, trial.batch_dim)
    at_lo = cut_rows(trial.args, trial.kwargs, trial.batch, s_lo, trial.batch_dim)
    device = device_of(trial.model, trial.args, trial.kwargs)
    repeats = trial.opts["repeats"]
    # no warm-up call where the median of three or more leaves out a first call's set-up (new shapes)
    warmup = 0 if repeats >= 3 else trial.opts["warmup"]
    return replay_times(trial.gm, trial.model, out, at_hi, at_lo, (s_hi, s_lo, trial.batch),
                        limit_bytes=trial.limit, repeats=repeats, warmup=warmup,
                        device=device, workspace=workspace, full_signatures=signatures or None)


def _to_scale(base: Graph | None, got: dict[int, Graph]) -> tuple[dict[int, Graph], str]:
    """The captures to scale from and where the bytes come from. With a meta capture: the sizes
    whose recorded graph is the meta graph (transformers takes other paths at one row: that size
    is left out, logged); where none is, the meta capture is not the graph the model runs
    (warned) and the bytes come from a linear fit of the real captures, unless the only size that
    fits is one row: none then (warned; the caller times the meta capture by FLOPs). A timing
    step's copy of ``base`` is always the same graph."""
    if base is None:
        return got, "linear fit"
    same = {s: g for s, g in got.items() if same_graph(base, g)}
    if not same and max(got) == 1:  # one row takes its own path (a reshape that is a view only there: Encodec)
        logger.warning("autoremat: the graph at batch size 1 (%d nodes) is not the full-size graph (%d nodes, meta "
                       "capture) and no larger size fits the limit: bytes from the meta capture, node times from "
                       "FLOPs", len(got[1]), len(base))
        return {}, "meta"
    if same:
        if len(same) < len(got):
            logger.info("autoremat: the graph at batch size %s is not the full-size graph (the model takes "
                        "another path there); times from batch size %s", sorted(set(got) - set(same)), sorted(same))
        return same, "meta"
    logger.warning("autoremat: the meta capture's graph (%d nodes) is not the one the model runs at batch sizes %s "
                   "(%s nodes); bytes come from a linear fit of the real captures", len(base), sorted(got),
                   [len(got[s]) for s in sorted(got)])
    hi = max(got)
    return {s: g for s, g in got.items() if same_graph(got[hi], g)}, "linear fit"


def ladder(model: nn.Module, args: tuple, kwargs: dict, opts: dict, base: Graph | None, batch: int,
           batch_dim: int, limit: int, predict: Callable[[int], float] | None,
           gm: torch.fx.GraphModule | None = None, signatures: dict[str, Any] | None = None) -> Graph | None:
    """Capture the two sizes that fit (:func:`autoremat.capture.scaled.capture_within`), scale.
    ``gm``: the model's one trace (``None`` at module level); ``signatures``: the replayed nodes'
    full-size arguments from the meta capture. ``None``: only one row fits and its graph is not the
    meta capture's (:func:`_to_scale`)."""
    trial = _Trial(model, args, kwargs, opts, batch, batch_dim, limit, base, gm)
    if predict is not None:  # the largest size predicted to fit, and half of it
        got = trial.down(largest_fitting(lambda s: predict(s) + trial.per_row * s, batch, limit))
    else:
        got = trial.up(max(max(1, batch // 8), min(2, batch // 2)))  # batch 1 often takes other paths
        if batch in got:
            return got[batch]
    got, bytes_from = _to_scale(base, got)
    if not got:
        return None
    sizes = sorted(got)
    s_hi = sizes[-1]
    s_lo = sizes[-2] if len(sizes) > 1 else s_hi
    lo, hi = got[s_lo], got[s_hi]
    if bytes_from == "meta":
        out = scale_to(base, lo, hi, s_lo, s_hi, batch, bytes_too=False)
    else:
        check_same(hi, lo, s_lo)
        out = scale_to(hi, lo, hi, s_lo, s_hi, batch, bytes_too=True)
    workspace: dict[int, tuple[int, int]] = {}
    replayed = _replayed(trial, out, s_lo, s_hi, workspace, signatures or {})
    first = min((v for v in out.nodes if out.node(v)["requires_grad"]), default=None)
    if first in replayed:  # the step's timer ends this node's backward when backward returns: it also
        # holds the end of the backward pass (freeing the graph), which no node alone shows
        replayed[first] = (replayed[first][0], out.node(first)["bwd_time_s"])
    out = with_workspace(with_times(out, replayed), workspace)
    out.meta["time_source"] = f"{hi.meta['time_source']}, scaled"
    noises = [c.meta["time_noise"] for c in (lo, hi) if c.meta.get("time_noise") is not None]
    if noises:  # the noisier of the two timed sizes (solvers.stable)
        out.meta["time_noise"] = max(noises)
    out.meta["input_bytes"] = input_bytes(args, kwargs)
    out.meta["resident_bytes"] = int(sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
                                     + out.meta["input_bytes"]
                                     + sum(b.numel() * b.element_size() for b in model.buffers()))
    out.meta["scaled"] = {"batch_size": batch, "sizes": [s_lo, s_hi] if s_lo != s_hi else [s_hi],
                          "smallest_tried": trial.smallest, "bytes_from": bytes_from, "limit_bytes": limit,
                          "timed_at_full_batch": sorted(replayed),
                          "workspace_at_full_batch": sorted(workspace)}
    logger.info("autoremat: profiled at batch sizes %s of %d (limit %d bytes); bytes from %s, times scaled "
                "(%d nodes timed alone at the full batch)", sorted({s_lo, s_hi}), batch, limit, bytes_from,
                len(replayed))
    return out
