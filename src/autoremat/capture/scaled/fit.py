"""From captures at small batch sizes to the full batch: per node ``a + b * batch``.

``t(B) = a + b * B`` through the two measured sizes, per node and per direction (forward,
backward). A negative slope (noise on a node whose time does not grow with the batch) gives the
mean of the two times; a negative intercept gives ``t(s_hi) * B / s_hi`` (proportional). With a
single size (``B == 2``, or only one row fits) times are proportional. The fallback path fits
bytes the same way (clamped at zero).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from ..._graph_rules import scale_sparse_grads
from ...graph import Graph

__all__ = ["fit", "scale_to", "check_same", "linear_peak", "fixed_grad_bytes", "with_times", "with_workspace"]

_BYTE_KEYS = ("out_bytes", "alloc_bytes", "extra_saved_bytes", "fwd_temp_bytes", "bwd_temp_bytes")
_META_BYTE_KEYS = ("loss_extra_bytes", "loss_fwd_temp_bytes", "loss_bwd_temp_bytes", "loss_held_bytes")


def fit(y_lo: float, y_hi: float, s_lo: int, s_hi: int, batch: int) -> float:
    """``a + b * batch`` through ``(s_lo, y_lo)`` and ``(s_hi, y_hi)``, clamped as documented."""
    if s_hi == s_lo:
        return y_hi * batch / s_hi
    b = (y_hi - y_lo) / (s_hi - s_lo)
    if b < 0:
        return (y_lo + y_hi) / 2
    a = y_lo - b * s_lo
    if a < 0:
        return y_hi * batch / s_hi
    return a + b * batch


def same_graph(base: Graph, small: Graph) -> bool:
    """Whether ``small`` has ``base``'s nodes (names, in order) and fingerprint."""
    return base.fingerprint == small.fingerprint and \
        [base.node(v)["name"] for v in base.nodes] == [small.node(v)["name"] for v in small.nodes]


def check_same(base: Graph, small: Graph, size: int) -> None:
    """Raise when ``small`` (captured at ``size`` rows) is not ``base``'s graph."""
    if not same_graph(base, small):
        raise ValueError(f"the graph captured at batch size {size} differs from the full-size graph "
                         f"({len(small)} vs {len(base)} nodes): the model's structure depends on the batch "
                         "size, so it cannot be profiled at a smaller batch; give a budget that fits the "
                         "whole step or make the structure independent of the batch size")


def scale_to(base: Graph, lo: Graph, hi: Graph, s_lo: int, s_hi: int, batch: int, *, bytes_too: bool) -> Graph:
    """``base`` (same nodes as ``lo`` and ``hi``) with times, and with ``bytes_too`` bytes (and lingering ones), fitted
    per node from the captures at ``s_lo`` and ``s_hi`` rows and evaluated at ``batch``; an
    output's ``grad_seed_bytes`` too where both have one (an expanded scalar's stays put, a dense
    part grows), else ``None``."""
    g = base.copy()
    for v in g.nodes:
        d, a, b = g.node(v), lo.node(v), hi.node(v)
        for key in ("time_s", "bwd_time_s"):
            d[key] = max(0.0, fit(a[key], b[key], s_lo, s_hi, batch))
        if bytes_too:
            for key in _BYTE_KEYS:
                d[key] = max(0, int(math.ceil(fit(a[key], b[key], s_lo, s_hi, batch))))
            for key in ("lingering", "grad_part"):  # the same nodes at both sizes (the same graph), else 0 there
                small = dict(a[key])
                d[key] = tuple((u, max(0, int(math.ceil(fit(small.get(u, 0), nbytes, s_lo, s_hi, batch)))))
                               for u, nbytes in b[key])
            seeds = (a["grad_seed_bytes"], b["grad_seed_bytes"])
            d["grad_seed_bytes"] = None if None in seeds else max(0, int(math.ceil(fit(*seeds, s_lo, s_hi, batch))))
    if bytes_too:
        for key in _META_BYTE_KEYS:
            g.meta[key] = max(0, int(math.ceil(fit(lo.meta[key], hi.meta[key], s_lo, s_hi, batch))))
        lo_pb, hi_pb = lo.meta["param_bytes"], hi.meta["param_bytes"]
        scale_sparse_grads(g.meta, (g.nx.nodes[v] for v in g.nodes),
                           lambda name, _: fit(lo_pb[name], hi_pb[name], s_lo, s_hi, batch))
    return g.copy() if bytes_too else g  # a copy derives saved bytes from the edited bytes again


def with_times(g: Graph, times: Mapping[int, tuple[float, float]]) -> Graph:
    """``g`` with the forward and backward times of the nodes in ``times`` replaced."""
    out = g.copy()
    for v, (fwd, bwd) in times.items():
        out.node(v)["time_s"], out.node(v)["bwd_time_s"] = float(fwd), float(bwd)
    return out


def with_workspace(g: Graph, workspace: Mapping[int, tuple[int, int]]) -> Graph:
    """``g`` with each node's forward and backward workspace raised to the bytes in ``workspace``
    where they are larger (measured at the full batch on CUDA, :mod:`.replay`)."""
    out = g.copy()
    for v, (fwd, bwd) in workspace.items():
        d = out.node(v)
        d["fwd_temp_bytes"] = max(int(d["fwd_temp_bytes"]), int(fwd))
        d["bwd_temp_bytes"] = max(int(d["bwd_temp_bytes"]), int(bwd))
    return out


def fixed_grad_bytes(g: Graph) -> int:
    """The parameter gradients that do not grow with the batch: all but the sparse ones
    (:mod:`autoremat.capture.sparse_grads`: one row per lookup)."""
    sparse = set(g.meta.get("sparse_grad_params", ()))
    return int(sum(b for name, b in g.meta["param_bytes"].items() if name not in sparse))


def linear_peak(full: int, fixed: int, batch: int) -> Callable[[int], float]:
    """The unoptimised step peak at ``size`` rows: ``fixed`` bytes (parameter gradients) plus the
    rest of the full-batch peak ``full`` in proportion."""
    def predict(size: int) -> float:
        return fixed + max(0, full - fixed) * size / batch
    return predict
