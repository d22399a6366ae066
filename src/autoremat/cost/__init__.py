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
:mod:`.unreached`           the simulator's rules for what nodes no gradient reaches hold
:mod:`.grad_handoff`        the simulator's rules for the gradients a node's backward hands its
                            inputs, and a reader-less view's backward workspace
:mod:`.replay_frames`       the simulator's rule for what a module-level replay's frames hold
:mod:`.bitsets`             a graph as bitsets (per-set boundary, liveness): no rule of its own
:mod:`.segment_replay`      dp-exact's model: the simulator's events on one segment; equal to
                            ``simulate`` on plain DAGs, within 10 % with views / pass-through
                            nodes (``tests/cost/test_segment_replay.py``)
:mod:`.closed_form`         dp-approx's model (Kusumoto eq. (2) on saved bytes): peak within
                            ``UNDER_BOUND``..``OVER_BOUND`` of the simulated one, equal extra time
:mod:`.backward_floor`      lower bounds of a transition's need: never above the replay's
:mod:`.batch_pricing`       many transitions priced at once: equal to the one-at-a-time replay
:mod:`.chain`               Beaumont et al.'s chain (§3.1, §6.1 virtual layers): its peak with
                            nothing recomputed equals the simulated one
:mod:`.chain_schedule`      offload schedules on a chain: types, memory, checks
:mod:`.chain_replay`        the paper's no-wait replays (integral and relaxed) of a schedule
:mod:`.schedule`            Kumar et al.'s joint-graph schedules: its no-recomputation peak is
                            never below the simulator's (on graphs without parameters, extras,
                            workspace or views)
==========================  ==================================================================

``autoremat.cost`` imports only the simulator; the specialised models load with the solvers
that use them.
"""

from __future__ import annotations

from .simulator import (DEFAULT_BANDWIDTH_BYTES_PER_S, Simulation, StepLevels, no_recompute_plan, simulate,
                        step_levels, unoptimised_peak_bytes)

__all__ = ["simulate", "Simulation", "no_recompute_plan", "unoptimised_peak_bytes", "DEFAULT_BANDWIDTH_BYTES_PER_S",
           "StepLevels", "step_levels"]
