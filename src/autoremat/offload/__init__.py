"""GPU-CPU offloading of activations (Beaumont, Eyraud-Dubois & Shilova, 2019).

Pure functions on plain numbers (no torch): :func:`chain_from_graph` turns a profiled
:class:`~autoremat.graph.Graph` into the paper's chain, the solvers choose which activations
to copy to host memory and when, and :func:`simulate_offload` / :func:`validate_schedule`
replay a schedule under the paper's assumptions. :func:`measure_bandwidth` measures the
host<->device ``B`` on a CUDA machine (torch is imported only when it is called).
"""

from __future__ import annotations

from .bandwidth import LinkBandwidth, measure_bandwidth, measure_link
from .chain import DEFAULT_BANDWIDTH_BYTES_PER_S, GROUPINGS, Chain, chain_from_graph, layer_cuts, split_points
from .chain_sim import (
    OffloadSchedule,
    Transfer,
    memory_profile,
    simulate_offload,
    simulate_relaxed,
    validate_schedule,
)
from .solvers import (
    DEFAULT_SLOTS,
    OFFLOAD_SOLVERS,
    ROUNDINGS,
    VDNN_MODES,
    lower_bound,
    offload_dp,
    offload_greedy,
    vdnn,
)

__all__ = [
    "Chain", "chain_from_graph", "split_points", "layer_cuts", "GROUPINGS", "DEFAULT_BANDWIDTH_BYTES_PER_S",
    "OffloadSchedule", "Transfer", "simulate_offload", "simulate_relaxed", "validate_schedule",
    "memory_profile", "offload_greedy", "offload_dp", "vdnn", "lower_bound", "OFFLOAD_SOLVERS",
    "DEFAULT_SLOTS", "VDNN_MODES", "ROUNDINGS", "measure_bandwidth", "measure_link", "LinkBandwidth",
]
