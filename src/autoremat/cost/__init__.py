"""The cost model: what one training step of a plan costs in memory and time.

:func:`simulate` (:mod:`.simulator`) is *the* cost model every plan is judged by: it replays one
step of eager PyTorch (forward, loss, backward, recomputation, offload transfers) storage by
storage. Solvers that price many candidate plans use faster specialised models; each lives in
this package beside the simulator and is held to it by a property test on seeded random graphs
(``tests/cost/``): equal where it claims to be equal, within a documented bound otherwise.

==========================  ==================================================================
module                      what it models, and how it relates to :func:`simulate`
==========================  ==================================================================
:mod:`.simulator`           the step (peak, extra time, timeline); :func:`step_levels`: the
                            level at every node's forward and backward, nothing recomputed
:mod:`.ledger`              storages and their holders (the simulator's bookkeeping)
:mod:`.offload_link`        Beaumont et al.'s host link inside the simulator
==========================  ==================================================================

``autoremat.cost`` imports only the simulator; the specialised models load with the solvers
that use them.
"""

from __future__ import annotations

from .simulator import (DEFAULT_BANDWIDTH_BYTES_PER_S, Simulation, StepLevels, no_recompute_plan, simulate,
                        step_levels, unoptimised_peak_bytes)

__all__ = ["simulate", "Simulation", "no_recompute_plan", "unoptimised_peak_bytes", "DEFAULT_BANDWIDTH_BYTES_PER_S",
           "StepLevels", "step_levels"]
