"""``autoremat.plan_schema``: the strict schema of a plan document, both formats.

The cases with their messages, through ``Plan.from_dict`` / ``from_json``, are ``test_plan.py``'s
and ``test_bad_inputs.py``'s; here the schema functions themselves.
"""

from __future__ import annotations

import json

import pytest

from autoremat.errors import PlanFormatError
from autoremat.plan import PLAN_FORMAT_VERSION, Plan, Segment
from autoremat.plan_schema import GRAPH_KEYS, PLAN_KEYS, READ_VERSIONS, check_plan_dict, load_plan_json


def doc(**extra) -> dict:
    return {"format": "autoremat.plan", "version": PLAN_FORMAT_VERSION,
            "segments": [{"nodes": [0, 1], "recompute": True}, {"nodes": [2], "recompute": False}], **extra}


def test_what_a_plan_writes_is_what_the_schema_reads():
    plan = Plan([Segment((0, 1)), Segment((2,), recompute=False)], graph_mode="fx", node_names=("a", "b", "c"),
                replay_tails={0: (1, (0,))}, bandwidth_bytes_per_s=1e9)
    data = plan.to_dict()
    assert set(data) == PLAN_KEYS and set(GRAPH_KEYS) <= PLAN_KEYS
    check_plan_dict(data)
    check_plan_dict(json.loads(json.dumps(data)))
    assert READ_VERSIONS == (1, 2) and PLAN_FORMAT_VERSION == 2


def test_graph_fields_are_checked_at_the_top_level_and_in_format_1_options():
    check_plan_dict(doc(graph_mode="fx", node_names=["a", "b", "c"]))
    check_plan_dict({**doc(), "version": 1, "options": {"graph_mode": "fx", "node_names": ["a", "b", "c"]}})
    with pytest.raises(PlanFormatError, match="'tensors'"):
        check_plan_dict(doc(tensors={"w": 3}))
    with pytest.raises(PlanFormatError, match="'options.inputs\\[0\\]'"):
        check_plan_dict({**doc(), "options": {"inputs": [{"path": "x"}]}})
    with pytest.raises(PlanFormatError, match="'node_names'.*version 1"):
        check_plan_dict({**doc(node_names=["a", "b", "c"]), "version": 1})
    with pytest.raises(PlanFormatError, match="both"):
        check_plan_dict({**doc(graph_mode="fx"), "options": {"graph_mode": "fx"}})


def test_text_or_file(tmp_path):
    text = json.dumps(doc())
    assert load_plan_json(text) == (json.loads(text), None)
    path = tmp_path / "p.json"
    path.write_text(text)
    assert load_plan_json(str(path)) == (json.loads(text), str(path))
    with pytest.raises(PlanFormatError, match="neither JSON text"):
        load_plan_json(str(tmp_path / "missing.json"))
