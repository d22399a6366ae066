"""``autoremat.solvers.kusumoto.config``: the DP solvers' options, checked at the boundary."""

from __future__ import annotations

import pytest

from autoremat.solvers.kusumoto import DPApproxConfig, DPConfig, DPExactConfig


def test_defaults_and_names():
    cfg = DPExactConfig()
    assert (cfg.objective, cfg.time_slots, cfg.max_lower_sets, cfg.fallback, cfg.max_tightenings) == (
        "time", 500, 500, True, 24)
    assert DPExactConfig.solver == "dp-exact" and DPApproxConfig.solver == "dp-approx"
    assert issubclass(DPApproxConfig, DPConfig)
    assert set(DPApproxConfig.options_help()) == {"objective", "time_slots", "max_lower_sets", "fallback",
                                                  "max_tightenings"}


@pytest.mark.parametrize("bad,match", [({"objective": "fast"}, "objective='fast'"), ({"time_slots": 0}, "time_slots"),
                                       ({"max_tightenings": -1}, "max_tightenings"),
                                       ({"max_lower_sets": 1.5}, "max_lower_sets"), ({"time_slots": True}, "time_slots")])
def test_bad_values_name_the_option(bad, match):
    with pytest.raises(ValueError, match=match):
        DPApproxConfig.parse(bad)


def test_unknown_option_names_the_accepted_ones():
    with pytest.raises(ValueError, match=r"dp-exact: unknown option\(s\) \['slots'\]; it accepts: objective"):
        DPExactConfig.parse({"slots": 3})
