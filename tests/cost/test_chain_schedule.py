"""``autoremat.cost.chain_schedule``: the checker of an offload schedule, and its memory profile."""

from __future__ import annotations

import random

import pytest
from _chains import all_schedules, feasible, limits, rand_chain, subsets

from autoremat.cost.chain_schedule import validate_schedule
from autoremat.solvers.beaumont.chain_solvers import offload_greedy


# ---------------------------------------------------------------------- validator
def test_validator_catches_violations():
    rng = random.Random(10)
    c = None
    while c is None or not c.offloadable or c.min_memory_bytes >= c.peak_bytes:
        c = rand_chain(rng, 4)
    limit = c.min_memory_bytes
    s = offload_greedy(c, limit)
    validate_schedule(c, s)
    import dataclasses

    def broken(**kw):
        return dataclasses.replace(s, **kw)

    with pytest.raises(ValueError, match="above the limit"):
        validate_schedule(c, broken(memory_limit_bytes=limit - 1))
    t0 = s.transfers[0]
    moved = dataclasses.replace(t0, start_s=t0.start_s - 1e3, end_s=t0.end_s - 1e3)
    with pytest.raises(ValueError, match="produces it|busy"):
        validate_schedule(c, broken(transfers=(moved,) + s.transfers[1:]))
    last = s.transfers[-1]
    late = dataclasses.replace(last, start_s=last.start_s + 1e3, end_s=last.end_s + 1e3)
    with pytest.raises(ValueError, match="is back at"):
        validate_schedule(c, broken(transfers=s.transfers[:-1] + (late,)))
    with pytest.raises(ValueError, match="lasts"):
        validate_schedule(c, broken(fwd_end_s=(s.fwd_end_s[0] + 1,) + s.fwd_end_s[1:]))
    with pytest.raises(ValueError, match="makespan"):
        validate_schedule(c, broken(makespan_s=s.makespan_s + 1))
