"""``autoremat.plan_offload``: what a plan may offload — node outputs and nodes' own saved tensors
(``Plan.offload_saved``, one unit each): unit ids, candidates, validation with clear errors, the
plan file."""

from __future__ import annotations

import pytest
from _graphs import module_graph, random_dag

from autoremat.cost import no_recompute_plan
from autoremat.errors import PlanFormatError, PlanMismatchError
from autoremat.plan import Plan, Segment, validate_plan
from autoremat.plan_offload import offload_units, saved_unit, saved_unit_nodes, unit_bytes, unit_node


def test_unit_ids():
    assert saved_unit(0) == -1 and saved_unit(7) == -8 and unit_node(-8) == 7 and unit_node(3) == 3
    g = module_graph(4)
    assert unit_bytes(g, saved_unit(2)) == 70 and unit_bytes(g, 2) == 10
    assert offload_units(Plan([], offload=(1,), offload_saved=(2, 0))) == (1, -1, -3)


def test_candidates_are_module_calls_that_save_something_and_are_not_recomputed():
    g = module_graph(5)
    base = no_recompute_plan(g)
    assert saved_unit_nodes(g, base) == set(range(5))
    plan = Plan([Segment((0, 1), False), Segment((2,), True), Segment((3, 4), False)])
    assert saved_unit_nodes(g, plan) == {0, 1, 3, 4}
    g.nx.nodes[3]["kind"] = "glue"
    assert 3 not in saved_unit_nodes(g, base)
    g.meta["mode"] = "fx"
    assert saved_unit_nodes(g, base) == set()


def _plan(g, saved, segments=None, **kw) -> Plan:
    return Plan(segments or list(no_recompute_plan(g).segments), offload_saved=tuple(saved), **kw)


def test_validate_plan_refuses_bad_offload_saved_with_clear_errors():
    g = module_graph(5)
    validate_plan(g, _plan(g, (0, 4)))
    with pytest.raises(PlanFormatError, match="recomputed segment.*nothing to offload|recomputed segment"):
        validate_plan(g, _plan(g, (2,), [Segment((0, 1), False), Segment((2,), True), Segment((3, 4), False)]))
    g.nx.nodes[1]["extra_saved_bytes"] = 0
    with pytest.raises(PlanFormatError, match="saves no tensors of its own"):
        validate_plan(g, _plan(g, (1,)))
    with pytest.raises(PlanMismatchError, match="offload_saved names node 9"):
        validate_plan(g, _plan(g, (9,)))
    g.nx.nodes[3]["kind"] = "glue"
    with pytest.raises(PlanFormatError, match="not a module call"):
        validate_plan(g, _plan(g, (3,)))
    fx = random_dag(1, 8)
    fx.meta["mode"] = "fx"
    with pytest.raises(PlanFormatError, match="op-level"):
        validate_plan(fx, _plan(fx, (0,)))


def test_order_and_waits_name_units_of_both_kinds():
    g = module_graph(5)
    validate_plan(g, _plan(g, (2,), offload=(1,), offload_order=(-3, 1), offload_waits={3: -3}))
    with pytest.raises(PlanFormatError, match="offload_order"):
        validate_plan(g, _plan(g, (2,), offload=(1,), offload_order=(1,)))
    with pytest.raises(PlanFormatError, match="offload_waits.3"):
        validate_plan(g, _plan(g, (2,), offload_waits={3: -2}))


def test_the_plan_file_keeps_offload_saved_and_checks_it():
    g = module_graph(5)
    plan = _plan(g, (0, 3), offload=(1,), offload_order=(-4, 1, -1), offload_waits={2: -1})
    back = Plan.from_json(plan.to_json())
    assert (back.offload_saved, back.offload_order, back.offload_waits) == ((0, 3), (-4, 1, -1), {2: -1})
    assert "2 nodes' saved tensors offloaded" in plan.describe()
    d = plan.to_dict()
    for bad, field in [({"offload_saved": [-1]}, "offload_saved"), ({"offload_order": [1, -1]}, "offload_order"),
                       ({"offload_order": [1, -4, "x"]}, "offload_order"), ({"offload_waits": {"2": -9}}, "offload_waits")]:
        with pytest.raises(PlanFormatError, match=field):
            Plan.from_dict({**d, **bad})
