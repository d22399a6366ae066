"""``benchmarks/paper_tables.py``: a run whose solve at the minimum times out keeps the least
budget it found (and its search time), and the markdown shows it as such."""

from __future__ import annotations

import importlib
import sys
import time
from pathlib import Path

import pytest

import autoremat

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def paper_tables(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("paper_tables", None)
    return importlib.import_module("paper_tables")


def _graph() -> autoremat.Graph:
    model, args = autoremat.zoo.build("mlp", size="small", device="meta")
    return autoremat.capture(model, args).with_paper_times()


def test_a_solve_that_times_out_keeps_the_least_budget(paper_tables, monkeypatch):
    g = _graph()
    solve = autoremat.solve
    calls = []

    def slow_second_call(graph, budget, **options):
        calls.append(budget)
        if len(calls) == 2:  # the solve at the minimum
            time.sleep(5)
        return solve(graph, budget, **options)

    monkeypatch.setattr(paper_tables.autoremat, "solve", slow_second_call)
    r = paper_tables.min_budget_run(g, "dp-approx", {"objective": "time"}, timeout=1.0)
    assert calls[0] == 0 and len(calls) == 2
    assert r["min_budget_bytes"] == autoremat.min_budget(g, "dp-approx") == calls[1]
    assert 0 <= r["search_s"] < 1.0 and r["solve_timeout_s"] > 0
    assert "timed out" in r["error"] and "plan" not in r

    row = {"net": "mlp", "nodes": len(g), "lower_sets": 10, "times": "paper", "solver": "dp-approx",
           "options": {"objective": "time"}, "vanilla_bytes": 2 * r["min_budget_bytes"], "param_bytes": 0,
           **r, "reduction": 0.5}
    md = paper_tables.to_markdown({"machine": "test", "part_a": [row]})
    line = next(x for x in md.splitlines() if x.startswith("| mlp | ") and "dp-approx (TC)" in x)
    assert "50.0%" in line and "solve timed out" in line
    assert "skipped" not in md


def test_a_search_that_times_out_is_skipped(paper_tables, monkeypatch):
    def slow(graph, budget, **options):
        time.sleep(5)

    monkeypatch.setattr(paper_tables.autoremat, "solve", slow)
    r = paper_tables.min_budget_run(_graph(), "dp-approx", {}, timeout=0.5)
    assert r["error"].startswith("skipped: timeout") and "min_budget_bytes" not in r


def test_table_cells_never_cut_a_number(paper_tables):
    msg = ("skipped: 35684 lower sets, above --exact-max-lower-sets=10000 (dp-exact's cost grows "
           "with their square)")
    assert paper_tables._brief(msg, 70) == "skipped: 35684 lower sets, above --exact-max-lower-sets=10000"
    long = "timeout after 120 s while pricing 123456789 transitions of a very large graph family"
    cut = paper_tables._brief(long, 40)
    kept = cut.removesuffix(" …")
    assert cut != kept and long.startswith(kept) and long[len(kept)] == " " and len(kept) <= 40


def test_a_rerun_replaces_only_its_solvers_on_its_nets(paper_tables):
    def row(net, solver, value, times="paper"):
        return {"net": net, "times": times, "solver": solver, "options": {}, "v": value}

    run = {"machine": "m", "settings": {}, "load_average_start": (0, 0, 0), "load_average_end": (0, 0, 0),
           "wall_s": 1.0}
    base = {**run, "part_a": [row("resnet50", "chen", 1), row("resnet50", "dp-exact", 1), row("unet", "dp-exact", 1)],
            "part_b": [{"net": "unet", "solver": "dp-exact", "options": {}, "v": 1}], "part_c": {"x": 1}}
    # one solver on one net: only that row changes; part B stays when the rerun has none
    res = {**run, "part_a": [row("unet", "dp-exact", 2)], "part_b": []}
    out = paper_tables.merge_rerun(base, res, ["unet"], ["dp-exact"], why="because")
    assert [(r["net"], r["solver"], r["v"]) for r in out["part_a"]] == [
        ("resnet50", "chen", 1), ("resnet50", "dp-exact", 1), ("unet", "dp-exact", 2)]
    assert out["part_b"][0]["v"] == 1 and out["part_c"] == {"x": 1}
    assert out["reruns"][-1]["parts"] == ["part_a"] and out["reruns"][-1]["why"] == "because"
    # every solver on a new net: its rows are added in NETS order, part B rows too
    res = {**run, "part_a": [row("googlenet_original", "chen", 3)],
           "part_b": [{"net": "googlenet_original", "solver": "chen", "options": {}, "v": 3}]}
    out = paper_tables.merge_rerun(out, res, ["googlenet_original"], [])
    assert [r["net"] for r in out["part_a"]] == ["resnet50", "resnet50", "googlenet_original", "unet"]
    assert [r["net"] for r in out["part_b"]] == ["googlenet_original", "unet"]
    md = "\n".join(paper_tables._reruns_md(out))
    assert "Part A and B rows of every solver on googlenet_original" in md
    assert "Part A rows of dp-exact on unet" in md
