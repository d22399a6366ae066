"""``AUTOREMAT_TEST_TIME_JITTER`` (tests/conftest.py): the tests' captures with measured node times
scaled per node, as another machine's timings would be (a test that held only for this machine's
times failed on CI's)."""

from __future__ import annotations

import math
from types import SimpleNamespace

from conftest import jitter_times


def _rec(n: int = 200) -> SimpleNamespace:
    return SimpleNamespace(nodes=[SimpleNamespace(time_s=1.0, bwd_time_s=2.0) for _ in range(n)])


def test_measured_times_are_scaled_by_seeded_factors_within_a_quarter_and_four() -> None:
    meta = {"time_source": "perf_counter", "fingerprint": "abc"}
    a, b, c = _rec(), _rec(), _rec()
    jitter_times(a, meta, "4")
    jitter_times(b, meta, "4")
    jitter_times(c, meta, "5")
    ratios = [r.time_s for r in a.nodes] + [r.bwd_time_s / 2.0 for r in a.nodes]
    assert all(0.25 <= x <= 4.0 for x in ratios)
    assert min(ratios) < 0.5 and max(ratios) > 2.0  # the whole range is used
    assert abs(sum(math.log(x) for x in ratios) / len(ratios)) < 0.2  # no bias either way
    assert [r.time_s for r in a.nodes] == [r.time_s for r in b.nodes] != [r.time_s for r in c.nodes]


def test_flop_counts_and_meta_captures_are_left_alone() -> None:
    for source in ("flops", "none"):
        rec = _rec(3)
        jitter_times(rec, {"time_source": source, "fingerprint": "abc"}, "4")
        assert [(r.time_s, r.bwd_time_s) for r in rec.nodes] == [(1.0, 2.0)] * 3
