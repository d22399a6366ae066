"""GPU-CPU offloading of activations (Beaumont, Eyraud-Dubois & Shilova, 2019): one namespace.

Pure functions on plain numbers (no torch), gathered here from where they live:
:func:`chain_from_graph` turns a profiled :class:`~autoremat.graph.Graph` into the paper's chain
and :func:`simulate_offload` / :func:`validate_schedule` replay a schedule under the paper's
assumptions (the chain cost model, :mod:`autoremat.cost.chain`, :mod:`.chain_replay
<autoremat.cost.chain_replay>`, :mod:`.chain_schedule <autoremat.cost.chain_schedule>`); the chain
solvers choose which activations to copy to host memory and when
(:mod:`autoremat.solvers.beaumont.chain_solvers`; the plan solvers ``offload-greedy``,
``offload-dp`` and ``vdnn`` are :mod:`autoremat.solvers.beaumont`). :func:`measure_bandwidth`
(:mod:`.bandwidth`, here) measures the host<->device ``B`` on a CUDA machine (torch is imported
only when it is called).
"""

from __future__ import annotations

from ..cost.chain import DEFAULT_BANDWIDTH_BYTES_PER_S, GROUPINGS, Chain, chain_from_graph, layer_cuts, split_points
from ..cost.chain_replay import simulate_offload, simulate_relaxed
from ..cost.chain_schedule import OffloadSchedule, Transfer, memory_profile, validate_schedule
from ..solvers.beaumont.chain_solvers import (
    DEFAULT_SLOTS,
    OFFLOAD_SOLVERS,
    ROUNDINGS,
    VDNN_MODES,
    lower_bound,
    offload_dp,
    offload_greedy,
    vdnn,
)
from .bandwidth import LinkBandwidth, measure_bandwidth, measure_link

__all__ = [
    "Chain", "chain_from_graph", "split_points", "layer_cuts", "GROUPINGS", "DEFAULT_BANDWIDTH_BYTES_PER_S",
    "OffloadSchedule", "Transfer", "simulate_offload", "simulate_relaxed", "validate_schedule",
    "memory_profile", "offload_greedy", "offload_dp", "vdnn", "lower_bound", "OFFLOAD_SOLVERS",
    "DEFAULT_SLOTS", "VDNN_MODES", "ROUNDINGS", "measure_bandwidth", "measure_link", "LinkBandwidth",
]
