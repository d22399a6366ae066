"""Tests for autoremat.plan: validate_plan, JSON round trip, segments_from_lower_sets."""

from __future__ import annotations

import json
import random

import pytest
from _graphs import block_chain, diamond, module_chain

from autoremat.errors import PlanFormatError, PlanMismatchError
from autoremat.graph import Graph
from autoremat.plan import (PLAN_FORMAT_VERSION, Plan, Segment, check_segments, module_calls_of, segments_from_lower_sets,
                            validate_plan)


class TestSegment:
    def test_nodes_sorted_and_int(self):
        s = Segment((3, 1, 2))
        assert s.nodes == (1, 2, 3) and s.recompute is True
        assert Segment([2.0, 0]).nodes == (0, 2)


class TestValidatePlan:
    def test_accepts_good_plans(self):
        g = Graph.chain([1] * 6)
        validate_plan(g, Plan([Segment(range(6), recompute=False)]))
        validate_plan(g, Plan([Segment((0, 1)), Segment((2, 3)), Segment((4, 5), recompute=False)],
                              graph_fingerprint=g.fingerprint))
        d = diamond()
        # {0,2} then {1,3}: each prefix union is a lower set
        validate_plan(d, Plan([Segment((0, 2)), Segment((1, 3), recompute=False)]))
        validate_plan(d, Plan([Segment((0,)), Segment((1,)), Segment((2,)), Segment((3,))]))
        validate_plan(Graph(), Plan([]))

    def test_overlapping_segments(self):
        g = Graph.chain([1] * 4)
        with pytest.raises(ValueError, match="more than one segment"):
            validate_plan(g, Plan([Segment((0, 1)), Segment((1, 2, 3))]))

    def test_node_repeated_inside_a_segment(self):
        g = Graph.chain([1] * 2)
        with pytest.raises(ValueError, match="more than once"):
            validate_plan(g, Plan([Segment((0, 0, 1), recompute=False)]))

    def test_missing_nodes(self):
        g = Graph.chain([1] * 5)
        with pytest.raises(ValueError, match=r"missing nodes \[3, 4\]"):
            validate_plan(g, Plan([Segment((0, 1, 2))]))
        with pytest.raises(ValueError, match="missing"):
            validate_plan(g, Plan([]))

    def test_empty_segment(self):
        g = Graph.chain([1] * 2)
        with pytest.raises(ValueError, match="empty"):
            validate_plan(g, Plan([Segment(()), Segment((0, 1))]))

    def test_not_a_lower_set_order(self):
        g = Graph.chain([1] * 4)
        with pytest.raises(ValueError, match="lower set"):
            validate_plan(g, Plan([Segment((2, 3)), Segment((0, 1))]))
        d = diamond()
        with pytest.raises(ValueError, match="lower set"):
            validate_plan(d, Plan([Segment((0, 3)), Segment((1, 2))]))

    def test_out_of_range_node(self):
        g = Graph.chain([1] * 3)
        with pytest.raises(PlanMismatchError, match="node 3"):
            validate_plan(g, Plan([Segment((0, 1, 2, 3))]))
        with pytest.raises(PlanMismatchError, match="node -1"):
            validate_plan(g, Plan([Segment((-1, 0, 1, 2))]))

    def test_fingerprint_mismatch(self):
        g = Graph.chain([1] * 3)
        other = Graph.chain([1] * 4)
        plan = Plan([Segment((0, 1, 2), recompute=False)], graph_fingerprint=other.fingerprint)
        with pytest.raises(PlanMismatchError, match="capture the model again"):
            validate_plan(g, plan)
        assert issubclass(PlanMismatchError, ValueError)

    def test_module_mode_multi_node_recompute_segment(self):
        g = module_chain(4)
        with pytest.raises(ValueError, match="one module call per segment"):
            validate_plan(g, Plan([Segment((0, 1)), Segment((2, 3), recompute=False)]))
        # single-node recompute segments and plain multi-node segments are fine
        validate_plan(g, Plan([Segment((0,)), Segment((1,)), Segment((2, 3), recompute=False)]))

    def test_recompute_of_non_recomputable_node(self):
        g = module_chain(3, recomputable=[True, False, True])
        with pytest.raises(ValueError, match=r"cannot wrap: \[1\]"):
            validate_plan(g, Plan([Segment((0,)), Segment((1,)), Segment((2,), recompute=False)]))
        validate_plan(g, Plan([Segment((0,)), Segment((1,), recompute=False), Segment((2,), recompute=False)]))


class TestPlanJson:
    def _plan(self) -> Plan:
        return Plan([Segment((0, 1)), Segment((2,), recompute=False)], solver="chen",
                    options={"threshold_bytes": 12.5}, node_names=("a", "b", "c"), budget_bytes=1234,
                    graph_fingerprint="abcdef0123456789", predicted_peak_bytes=1000,
                    predicted_extra_time_s=0.25)

    def test_round_trip(self, tmp_path):
        p = self._plan()
        text = p.to_json()
        data = json.loads(text)
        assert data["format"] == "autoremat.plan" and data["version"] == PLAN_FORMAT_VERSION
        assert data["segments"] == [{"nodes": [0, 1], "recompute": True}, {"nodes": [2], "recompute": False}]
        assert Plan.from_json(text) == p
        assert Plan.from_dict(p.to_dict()) == p
        path = tmp_path / "plan.json"
        p.to_json(str(path))
        assert Plan.from_json(str(path)) == p

    def test_bad_format_and_version(self):
        d = self._plan().to_dict()
        with pytest.raises(ValueError, match="not an autoremat plan"):
            Plan.from_dict({**d, "format": "autoremat.graph"})
        with pytest.raises(ValueError, match="version"):
            Plan.from_dict({**d, "version": 999})

    def test_properties(self):
        p = Plan([Segment((0, 1)), Segment((2, 3), recompute=False), Segment((4,))])
        assert p.recompute_segments == [Segment((0, 1)), Segment((4,))]
        assert p.recomputed_nodes == {0, 1, 4}
        assert p.describe() == "none: 3 segments, 2 recomputed"
        p.replay_tails = {2: (4, ())}
        assert p.describe() == "none: 3 segments, 2 recomputed (1 with a shortened replay)"


class TestGraphFields:
    """What ``apply`` reads is typed fields of the plan (format 2); format 1 kept it in ``options``."""

    def _doc(self, version: int = 1, **options) -> dict:
        return {"format": "autoremat.plan", "version": version, "solver": "chen",
                "segments": [{"nodes": [0, 1], "recompute": True}, {"nodes": [2], "recompute": False}],
                "options": {"threshold_bytes": 12.5, **options}}

    def test_a_format_1_file_loads_with_its_fields_moved(self, tmp_path):
        legacy = self._doc(graph_mode="fx", node_names=["a", "b", "c"], replay_tails={"0": [1, [0]]},
                           tensors={"w": "float32[3]"}, inputs=[{"path": "args[0]", "shape": [2], "dtype": "float32",
                                                                 "device": "cpu"}])
        path = tmp_path / "old.json"
        path.write_text(json.dumps(legacy))
        p = Plan.from_json(str(path))
        assert (p.graph_mode, p.node_names, p.replay_tails) == ("fx", ("a", "b", "c"), {0: (1, (0,))})
        assert p.tensors == {"w": "float32[3]"} and p.inputs[0]["shape"] == [2]
        assert p.options == {"threshold_bytes": 12.5} and p.version == PLAN_FORMAT_VERSION == 2
        again = json.loads(p.to_json())
        assert again["version"] == 2 and again["node_names"] == ["a", "b", "c"]
        assert again["replay_tails"] == {"0": [1, [0]]} and "node_names" not in again["options"]
        assert Plan.from_json(p.to_json()) == p

    def test_fields_are_checked_in_either_place(self):
        with pytest.raises(PlanFormatError, match="'options.node_names'"):
            Plan.from_dict(self._doc(node_names="abc"))
        bad = {**self._doc(version=2), "node_names": "abc"}
        with pytest.raises(PlanFormatError, match="'node_names'"):
            Plan.from_dict(bad)
        with pytest.raises(PlanFormatError, match="'replay_tails.x'"):
            Plan.from_dict({**self._doc(version=2), "replay_tails": {"x": [1, []]}})
        with pytest.raises(PlanFormatError, match="'bandwidth_bytes_per_s'"):
            Plan.from_dict({**self._doc(version=2), "bandwidth_bytes_per_s": -1})
        with pytest.raises(PlanFormatError, match="out of range.*node_names"):
            Plan.from_dict({**self._doc(version=2), "node_names": ["a", "b"]})

    def test_both_places_or_a_new_key_in_an_old_file_are_refused(self):
        with pytest.raises(PlanFormatError, match="'options.graph_mode'.*both"):
            Plan.from_dict({**self._doc(version=2, graph_mode="fx"), "graph_mode": "fx"})
        with pytest.raises(PlanFormatError, match="'graph_mode'.*version 1"):
            Plan.from_dict({**self._doc(version=1), "graph_mode": "fx"})
        with pytest.raises(PlanFormatError, match="'version'.*reads versions 1, 2"):
            Plan.from_dict(self._doc(version=3))

    def test_constructing_with_the_old_options_moves_them(self):
        p = Plan([Segment((0, 1, 2), recompute=False)], options={"graph_mode": "module", "node_names": ["x"] * 3,
                                                                  "replay_tails": [], "k": 1})
        assert p.graph_mode == "module" and p.node_names == ("x", "x", "x") and p.replay_tails == {}
        assert p.options == {"k": 1}
        typed = Plan([Segment((0,))], graph_mode="fx", options={"graph_mode": "module"})
        assert typed.graph_mode == "fx"  # the field wins over the old place


class TestSegmentsFromLowerSets:
    def test_chain(self):
        g = Graph.chain([1] * 4)
        segs = segments_from_lower_sets(g, [{0, 1}, {0, 1, 2, 3}])
        assert segs == [Segment((0, 1), True), Segment((2, 3), False)]
        segs = segments_from_lower_sets(g, [{0, 1}, {0, 1, 2, 3}], recompute_last=True)
        assert segs == [Segment((0, 1), True), Segment((2, 3), True)]

    def test_repeated_lower_set_skipped(self):
        g = Graph.chain([1] * 3)
        segs = segments_from_lower_sets(g, [{0}, {0}, {0, 1}, {0, 1, 2}])
        assert segs == [Segment((0,), True), Segment((1,), True), Segment((2,), False)]

    def test_segment_that_saves_nothing_is_not_recomputed(self):
        g = Graph.chain([1] * 4, saves_own_output=False)
        segs = segments_from_lower_sets(g, [{0, 1}, {0, 1, 2, 3}])
        assert [s.recompute for s in segs] == [False, False]

    def test_diamond(self):
        d = diamond()
        segs = segments_from_lower_sets(d, [d.ancestor_closure(2), d.ancestor_closure(3)])
        assert segs == [Segment((0, 2), True), Segment((1, 3), False)]
        validate_plan(d, Plan(segs))

    def test_module_mode(self):
        g = module_chain(4, recomputable=[True, True, False, True])
        segs = segments_from_lower_sets(g, [{0, 1}, {0, 1, 2}, {0, 1, 2, 3}], recompute_last=True)
        # multi-node segment: not recomputed; non-recomputable node: not recomputed
        assert segs == [Segment((0, 1), False), Segment((2,), False), Segment((3,), True)]
        validate_plan(g, Plan(segs))


class TestPlanSchema:
    """The strict schema of plan documents (autoremat.plan_schema): one error class naming the field."""

    def _doc(self) -> dict:
        return TestPlanJson()._plan().to_dict()

    def test_recompute_must_be_a_json_boolean(self):
        d = self._doc()
        d["segments"][1]["recompute"] = "false"
        with pytest.raises(PlanFormatError, match=r"segments\[1\]\.recompute.*got 'false'") as info:
            Plan.from_dict(d)
        assert info.value.field == "segments[1].recompute"
        assert issubclass(PlanFormatError, ValueError)

    def test_missing_key_names_the_field(self):
        d = self._doc()
        del d["segments"][0]["nodes"]
        with pytest.raises(PlanFormatError, match=r"'segments\[0\]\.nodes': required key is missing"):
            Plan.from_dict(d)

    def test_node_ids_are_checked_against_the_plans_node_names(self):
        d = self._doc()  # three node names
        d["segments"][1]["nodes"] = [2, 3]
        with pytest.raises(PlanFormatError, match=r"node 3 is out of range.*3 nodes"):
            Plan.from_dict(d)
        d["segments"][1]["nodes"] = [1]
        with pytest.raises(PlanFormatError, match=r"node 1 is also in segments\[0\]"):
            Plan.from_dict(d)

    def test_json_list_and_text_that_is_not_a_path(self, tmp_path):
        with pytest.raises(PlanFormatError, match="expected a JSON object"):
            Plan.from_json("[1, 2, 3]")
        with pytest.raises(PlanFormatError, match="neither JSON text"):
            Plan.from_json("plan please")
        with pytest.raises(PlanFormatError, match="neither JSON text"):
            Plan.from_json(str(tmp_path))  # a directory

    def test_truncated_file_names_the_file(self, tmp_path):
        path = tmp_path / "plan.json"
        path.write_text(self._plan_text()[:50])
        with pytest.raises(PlanFormatError, match=r"plan\.json: plan: not valid JSON .*line") as info:
            Plan.from_json(path)  # a PathLike is a path
        assert info.value.source == str(path)

    def test_error_in_a_file_names_file_and_field(self, tmp_path):
        d = self._doc()
        d["budget_bytes"] = "lots"
        path = tmp_path / "plan.json"
        path.write_text(json.dumps(d))
        with pytest.raises(PlanFormatError, match=r"plan\.json: plan field 'budget_bytes'"):
            Plan.from_json(str(path))

    def test_optional_keys_default(self):
        d = {"format": "autoremat.plan", "version": PLAN_FORMAT_VERSION,
             "segments": [{"nodes": [0, 1], "recompute": False}]}
        assert Plan.from_dict(d) == Plan([Segment((0, 1), recompute=False)])

    def _plan_text(self) -> str:
        return TestPlanJson()._plan().to_json()


class TestCheckSegments:
    def test_errors_say_what_is_wrong(self):
        plan = Plan([Segment((0, 1)), Segment((1, 2), recompute=False)])
        with pytest.raises(PlanFormatError, match="more than one segment"):
            check_segments(plan, 3)
        with pytest.raises(PlanMismatchError, match="graph has 2 nodes"):
            check_segments(Plan([Segment((0, 1, 2))]), 2)
        with pytest.raises(PlanMismatchError, match="lower set"):
            check_segments(Plan([Segment((1,)), Segment((0,))]), 2, is_lower_set=lambda s: s != {1})
        with pytest.raises(PlanMismatchError, match="offload names node 5"):
            check_segments(Plan([Segment((0, 1))], offload=(5,)), 2)
        check_segments(Plan([Segment((0,)), Segment((1,))]), 2, is_lower_set=lambda s: s != {1})


class TestKeepAndModuleCalls:
    """Selective saves (``Segment.keep``) and module calls (``Plan.module_calls``)."""

    def _graph(self):
        return block_chain(random.Random(0), 2, width=6)

    def test_call_regions_validate_and_round_trip(self, tmp_path):
        g = self._graph()
        block = g.call_regions()["layers.1"]
        keep = block[:2]
        segs = [Segment(tuple(range(block[0])), False), Segment(block, True, keep),
                Segment(tuple(range(block[-1] + 1, len(g))), False)]
        plan = Plan(segs, graph_fingerprint=g.fingerprint)
        validate_plan(g, plan)
        calls = module_calls_of(g, plan)
        assert calls == {1: ("layers.1", tuple((g.node(v)["op_index"], g.node(v)["target"]) for v in keep))}
        plan.module_calls = calls
        back = Plan.from_json(plan.to_json())
        assert back.segments == plan.segments and back.module_calls == calls
        assert "2 op outputs kept" in plan.describe()

    def test_keep_and_regions_are_checked(self):
        g = self._graph()
        block = g.call_regions()["layers.1"]
        rest = tuple(range(block[-1] + 1, len(g)))
        with pytest.raises(PlanFormatError, match="not recomputed"):
            validate_plan(g, Plan([Segment(tuple(range(block[0])), False), Segment(block, False, block[:1]),
                                   Segment(rest, False)]))
        with pytest.raises(ValueError, match="runtime cannot wrap"):  # ops of a block, not one call
            validate_plan(g, Plan([Segment(tuple(range(block[0] + 1)), True), Segment(block[1:], False),
                                   Segment(rest, False)]))
        plan = Plan([Segment(tuple(range(block[0])), False), Segment(block, True), Segment(rest, False)],
                    module_calls={1: ("layers.0", ())})
        with pytest.raises(PlanMismatchError, match="names 'layers.0'"):
            validate_plan(g, plan)
        with pytest.raises(PlanFormatError, match="module_calls"):
            Plan.from_dict({**plan.to_dict(), "module_calls": {"7": {"path": "x", "keep_ops": [], "keep_names": []}}})
        with pytest.raises(PlanFormatError, match="keep_names"):
            Plan.from_dict({**plan.to_dict(), "module_calls": {"1": {"path": "x", "keep_ops": [1], "keep_names": []}}})
        with pytest.raises(PlanFormatError, match="keep"):
            doc = plan.to_dict()
            doc["segments"][1]["keep"] = [999]
            Plan.from_dict(doc)

    def test_segments_from_lower_sets_recompute_call_regions(self):
        g = self._graph()
        block = g.call_regions()["layers.1"]
        segs = segments_from_lower_sets(g, [range(block[0]), range(block[-1] + 1), range(len(g))])
        assert segs[1].nodes == block and segs[1].recompute
