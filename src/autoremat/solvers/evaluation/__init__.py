"""Evaluation-only planners: yardsticks for the registered solvers, never registered themselves.

* :mod:`.bruteforce`: every canonical strategy of a small graph, each judged by
  :func:`autoremat.cost.simulate` (the optimum the exact solvers are tested against).
* :mod:`.offload_bruteforce`: every offload set on a small graph's plan (with and without
  derived forward waits), judged by the simulator (the optimum ``offload-dag`` is tested against).
* :mod:`.offload_bound`: a lower bound on the step time of any offload plan at a budget
  (Beaumont et al.'s fractional relaxation on the graph), to tell an unreachable target from a
  solver that misses it.
* :mod:`.twremat`: Kumar et al.'s TWRemat, whose schedules recompute forward *and* backward
  nodes in an order flat checkpoint regions cannot run; they are measured with the schedule
  model (:mod:`autoremat.cost.schedule`) only.

The registered solvers are in :data:`autoremat.solvers.SOLVERS` (``xla-greedy``, from the same
paper's evaluation, is one of them).
"""

from __future__ import annotations

from .bruteforce import lower_set_chains, solve_bruteforce
from .offload_bound import OffloadBound, offload_time_lower_bound
from .offload_bruteforce import solve_offload_bruteforce
from .twremat import twremat_schedule

__all__ = ["lower_set_chains", "solve_bruteforce", "solve_offload_bruteforce", "twremat_schedule", "OffloadBound",
           "offload_time_lower_bound"]
