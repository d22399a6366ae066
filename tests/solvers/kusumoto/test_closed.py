"""``autoremat.solvers.kusumoto.closed``: dp-approx's searches on the closed-form model.

Against brute force over the family's chains in the closed-form model: the feasibility table
finds a sequence exactly when one fits, the time-centric search (dense and sparse) the least
recomputation time, the memory-centric table the most; and numpy's floor division, which buckets
the dense search's times, equals Python's.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from _graphs import random_dag, random_dag_with_views
from _plans import family_chains

from autoremat.solvers.kusumoto import closed
from autoremat.solvers.kusumoto.closed import ClosedDP, cell_front
from autoremat.solvers.kusumoto.search import Search, parse_config


def table(dp: ClosedDP) -> list[tuple[int, float]]:
    return [dp.model_peak(seq) for seq in family_chains(dp.fam)]


@pytest.mark.parametrize("seed", range(20))
def test_searches_equal_brute_force_in_the_model(seed, monkeypatch):
    maker = random_dag_with_views if seed % 2 else random_dag
    g = maker(800 + seed, 4 + seed % 6)
    dp = Search(g, "dp-approx", parse_config(None, "dp-approx")).dp
    assert isinstance(dp, ClosedDP)
    rows = table(dp)
    least = min(p for p, _ in rows)
    for budget in sorted({least - 1, least, (least + dp.vanilla_need()) // 2, dp.vanilla_need()}):
        fits = [t for p, t in rows if p <= budget]
        feasible = dp.run(budget, "feasible")
        assert (feasible is not None) == bool(fits)
        if not fits:
            assert dp.run(budget, "time") is None and dp.run(budget, "memory") is None
            continue
        assert dp.model_peak(feasible[0])[0] <= budget
        seq, t = dp.run(budget, "time")
        assert dp.model_peak(seq)[0] <= budget and t == pytest.approx(min(fits))
        seq, t = dp.run(budget, "memory")
        assert dp.model_peak(seq)[0] <= budget and t == pytest.approx(max(fits))
        monkeypatch.setattr(closed, "DENSE_CELLS", 1)  # the sparse buckets answer the same
        assert dp.run(budget, "time")[1] == pytest.approx(min(fits))
        monkeypatch.undo()


def test_cell_front_keeps_the_non_dominated_entries():
    entries = {5: (10, 5.0, None), 4: (12, 4.0, None), 3: (8, 3.0, None), 1: (9, 1.0, None), 0: (2, 0.0, None)}
    assert cell_front(entries) == [(5, 10, 5.0), (3, 8, 3.0), (0, 2, 0.0)]


def test_numpy_floor_division_matches_python():
    """The dense time search buckets ``t`` with numpy's ``//``; it must equal Python's."""
    rng = random.Random(3)
    ts = [rng.random() * 10 ** rng.randint(-6, 3) for _ in range(2000)] + [0.0, 1.0, 3.0, 1e-300]
    for q in (1.0, 0.1, 2.353357e-05, 7.0, 1 / 3):
        got = (np.array(ts) // q).astype(np.int64).tolist()
        assert got == [int(t // q) for t in ts]
