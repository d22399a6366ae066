"""``autoremat.cost.ledger``: storages freed with their last holder; the step's peak and places."""

from __future__ import annotations

import pytest

from autoremat.cost.ledger import PEAK_PLACES, StepState, StorageLedger
from autoremat.graph import Graph


def test_a_storage_lives_while_someone_holds_it():
    s = StorageLedger()
    s.alloc("a", 10)
    s.addref("a", "x")
    s.addref("a", "y")
    s.decref("a", "x")
    assert s.live == 10
    s.decref("a", "y")
    assert s.live == 0 and "a" not in s.size
    s.decref("a", "y")  # a storage already freed: nothing happens
    s.alloc("b", 5)
    s.maybe_free("b")  # held by no one: freed
    assert s.live == 0
    with pytest.raises(AssertionError, match="allocated twice"):
        s.alloc("c", 1) or s.alloc("c", 1)


def test_gradient_buffers_get_fresh_keys():
    s = StorageLedger()
    a, b = s.new_grad(3), s.new_grad(4)
    assert a != b and s.live == 7


def test_peak_place_levels_and_timeline():
    g = Graph.chain([4, 4])
    levels = {phase: {} for phase in (*PEAK_PLACES, "after bwd", "pgrad after bwd")}
    s = StepState(g, record=True, levels=levels)
    assert s.peak_at == "start"
    s.alloc("o", 8)
    s.touch(2, "fwd", 1)
    assert (s.peak, s.peak_at) == (10, "forward of node 1 (n1)")
    s.touch(1, "bwd", 0)
    assert s.peak == 10 and levels["bwd"][0] == 9
    s.touch(5, "loss fwd")
    assert s.peak_at == "loss forward" and levels["loss fwd"][-1] == 13
    s.mark("bwd", 0)
    assert s.timeline == [("bwd", 0, 8)] and levels["after bwd"][0] == 8
