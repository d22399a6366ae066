"""``autoremat.solvers.evaluation``: the yardsticks are importable from one place and none is registered."""

from __future__ import annotations

from autoremat import SOLVERS
from autoremat.solvers import evaluation
from autoremat.solvers.evaluation import bruteforce, twremat


def test_exports_and_not_registered():
    assert evaluation.solve_bruteforce is bruteforce.solve_bruteforce
    assert evaluation.lower_set_chains is bruteforce.lower_set_chains
    assert evaluation.twremat_schedule is twremat.twremat_schedule
    assert not {"bruteforce", "twremat", "brute-force"} & set(SOLVERS)
