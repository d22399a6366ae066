"""Smoke tests of the comparison benchmark: ``benchmarks/compare --quick`` in process (one tiny
model, one round) and ``benchmarks/compare_gpu.py --dry-run`` (which needs no GPU)."""

from __future__ import annotations

import functools
import importlib
import json
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

import autoremat

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCH))  # compare_gpu imports compare from its own folder
    for mod in [m for m in sys.modules if m.split(".")[0] in ("compare", "compare_gpu", "merge_runs")]:
        sys.modules.pop(mod, None)
    return importlib.import_module(name)


def test_compare_smoke_runs_every_stage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison's path end to end in its fast form (PyTorch's eager options and one solver on
    the zoo mlp, the largest-batch section, the report, partial results and merging); every
    configuration family: ``test_compare_quick_writes_every_row_and_field`` (slow)."""
    pytest.importorskip("matplotlib")
    compare = _load("compare", monkeypatch)
    # the largest-batch section raised up to the 64 samples (7 predicted sizes, each solved with its
    # reference costs): capped at 8, each method still raises from 4 (and bisects where 8 fails)
    monkeypatch.setattr(compare.driver, "run_batch_task", functools.partial(compare.driver.run_batch_task, max_batch=8))
    compare.main(["--quick", "--configs", "pytorch,autoremat", "--solvers", "dp-approx", "--compiled-plans", "none",
                  "--torch-regions", "none", "--solver-timeout", "5", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "compare.json").read_text())
    rows = {r["config"]: r for r in data["rows"]}
    assert set(rows) == {"none", "block-ac", "block-sac", "ckpt-seq", "save-on-cpu", "autoremat:dp-approx@0.5",
                         "autoremat:dp-approx@match"}
    for r in data["rows"]:
        assert set(compare.ROW_FIELDS) <= set(r), r["config"]
        assert r["status"] == "ok", (r["config"], r["error"])
        assert r["gradients_equal"] is True and r["measured_peak_bytes"] > 0 and r["step_time_s"] > 0
    assert rows["autoremat:dp-approx@0.5"]["predicted_peak_bytes"] > 0
    assert [r["method"] for r in data["largest_batch"]] == list(compare.BATCH_METHODS)
    assert all(set(compare.BATCH_FIELDS) <= set(r) and r["status"] == "ok" for r in data["largest_batch"])
    assert all(4 < r["batch_size"] <= 8 for r in data["largest_batch"]), data["largest_batch"]
    assert "## mlp" in (tmp_path / "RESULTS.md").read_text() and (tmp_path / "compare_mlp.png").is_file()
    _check_partial_and_merge(compare, data, tmp_path, monkeypatch)


@pytest.mark.slow
def test_compare_quick_writes_every_row_and_field(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib")
    compare = _load("compare", monkeypatch)
    compare.main(["--quick", "--solver-timeout", "5", "--out", str(tmp_path)])  # milp does not finish on the mlp
    data = json.loads((tmp_path / "compare.json").read_text())

    assert list(data["models"]) == ["mlp"]
    assert data["settings"]["rounds"] == 1 and data["settings"]["quick"] is True
    machine = data["machine"]
    assert machine["platform_machine"] and machine["cpu_count"] >= 1 and machine["torch"]

    rows = {r["config"]: r for r in data["rows"]}
    solvers = [s for s in sorted(autoremat.SOLVERS) if s != "none"]
    expected = {"none", "block-ac", "block-sac", "ckpt-seq", "save-on-cpu", "compile@0.5"}
    expected |= {f"autoremat:{s}@0.5" for s in solvers}
    assert expected <= set(rows)
    for r in data["rows"]:
        assert set(compare.ROW_FIELDS) <= set(r), r["config"]
        assert r["status"] in {"ok", "failed", "infeasible", "not_applicable", "timeout", "skipped"}

    none = rows["none"]
    assert none["status"] == "ok" and none["peak_ratio"] == 1.0 and none["time_ratio"] == 1.0
    assert none["measured_peak_bytes"] > 0 and len(none["step_times_s"]) == 1

    for key in ("block-ac", "block-sac", "ckpt-seq", "save-on-cpu"):  # eager PyTorch options: exact gradients
        r = rows[key]
        assert r["status"] == "ok", r["error"]
        assert r["gradients_equal"] is True and r["measured_peak_bytes"] > 0 and r["step_time_s"] > 0
    assert rows["ckpt-seq"]["peak_ratio"] < 1.0  # the mlp is a sequence: checkpointing it saves memory

    comp = rows["compile@0.5"]
    assert comp["compile_budget"] == 0.5 and comp["compile_backend"]
    assert comp["status"] in {"ok", "failed", "timeout"}
    if comp["status"] == "ok":
        assert comp["compile_s"] > 0 and comp["grad_max_abs_diff"] is not None and comp["time_ratio"] > 0
    else:
        assert comp["error"]

    auto = [rows[f"autoremat:{s}@0.5"] for s in solvers]
    assert any(r["status"] == "ok" for r in auto)
    for r in auto:
        assert r["family"] == "autoremat" and r["budget_fraction"] == 0.5
        assert r["budget_bytes"] == int(0.5 * none["measured_peak_bytes"])
        if r["status"] == "ok":
            assert r["gradients_equal"] is True
            assert r["predicted_peak_bytes"] > 0 and math.isfinite(r["prediction_error"])
            assert r["solver_time_s"] >= 0 and r["step_time_s"] > 0 and r["meets_budget"] is not None
        elif r["status"] == "infeasible":
            assert r["min_budget_bytes"] is None or r["min_budget_bytes"] > r["budget_bytes"]

    compiled = rows["autoremat:dp-approx@0.5+compile"]  # the plan under torch.compile
    assert compiled["status"] == "ok", compiled["error"]
    assert compiled["compile_s"] > 0 and compiled["step_time_s"] > 0 and compiled["grad_max_abs_diff"] < 1e-4
    assert compiled["prediction_error"] is None and "compiled" in compiled["note"]
    assert compiled["measured_peak_bytes"] < none["measured_peak_bytes"]  # its regions are recomputed
    assert any(c["config"] == compiled["config"] for c in data["headline"]["compiled_plans"])

    eager = [r for r in data["rows"] if r["family"] == "pytorch" and r["status"] == "ok"
             and r["measured_peak_bytes"] < none["measured_peak_bytes"]]
    lowest = min(r["measured_peak_bytes"] for r in eager)
    for s in solvers:  # every solver also at the lowest eager PyTorch peak
        m = rows[f"autoremat:{s}@match"]
        assert m["budget_bytes"] == lowest and "measured peak" in m["note"]
        if m["status"] == "ok":
            assert m["measured_peak_bytes"] <= lowest or m["meets_budget"] is False

    batch = data["largest_batch"]
    assert [r["method"] for r in batch] == list(compare.BATCH_METHODS)
    for r in batch:
        assert set(compare.BATCH_FIELDS) <= set(r)
        assert r["budget_bytes"] > 0 and r["initial_batch_size"] == 4 and r["batch_size"] >= 1
    bsf = batch[-1]
    assert bsf["method"] == "batchsizefinder" and bsf["status"] == "ok" and bsf["confirmed"] is True
    assert bsf["largest_trained_batch"] >= bsf["batch_size"]

    head = data["headline"]
    assert set(head) >= {"per_model", "resnet50_50pct", "largest_batch", "worst_prediction_error"}
    assert "mlp" in head["per_model"]

    md = (tmp_path / "RESULTS.md").read_text()
    assert "noisy" in md and machine["platform_machine"] in md and "## mlp" in md
    assert "## Largest batch under a fixed budget" in md and "under `torch.compile`" in md
    assert (tmp_path / "compare_mlp.png").stat().st_size > 1000

    # --batch-only re-measures the largest-batch section alone and keeps the step-time rows
    compare.main(["--quick", "--batch-only", "--solver-timeout", "5", "--out", str(tmp_path)])
    again = json.loads((tmp_path / "compare.json").read_text())
    assert again["rows"] == data["rows"]
    assert [r["method"] for r in again["largest_batch"]] == list(compare.BATCH_METHODS)
    assert all(r["budget_bytes"] > 0 for r in again["largest_batch"])
    assert "## Largest batch under a fixed budget" in (tmp_path / "RESULTS.md").read_text()
    _check_partial_and_merge(compare, again, tmp_path, monkeypatch)


def _check_partial_and_merge(compare: ModuleType, data: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run stopped after its first model leaves that model on disk; ``merge_runs.py`` joins it
    with another run's models (a measured run's model info, replayed without measuring)."""
    info = data["models"]["mlp"]

    def canned(name: str, opts: object, log: object) -> dict:
        rows = [{**r, "model": name} for r in info["rows"]]
        return {**info, "rows": rows}

    def killed(*args: object, **kwargs: object) -> list:
        raise KeyboardInterrupt  # e.g. the device's time limit, after the models were measured

    monkeypatch.setattr(compare.driver, "run_model", canned)  # the names the driver calls
    monkeypatch.setattr(compare.driver, "run_batch_section", killed)
    stopped = tmp_path / "stopped"
    with pytest.raises(KeyboardInterrupt):
        compare.main(["--quick", "--models", "mlp,other", "--out", str(stopped)])
    part = json.loads((stopped / "compare.json").read_text())
    assert part["partial"] is True and list(part["models"]) == ["mlp", "other"] and part["largest_batch"] == []
    assert {r["model"] for r in part["rows"]} == {"mlp", "other"}
    assert part["failures"] == compare.row_failures(part["rows"])  # each row that did not run, as at the end
    assert "Partial results" in (stopped / "RESULTS.md").read_text()
    assert data["partial"] is False

    merge_runs = _load("merge_runs", monkeypatch)
    out = tmp_path / "merged"
    merged = merge_runs.main([str(tmp_path / "compare.json"), str(stopped / "compare.json"), "--out", str(out)])
    assert list(merged["models"]) == ["mlp", "other"]  # every mlp row from the later run, which also has it
    assert [{k: v for k, v in r.items() if k != "run"} for r in merged["models"]["mlp"]["rows"]] == \
        part["models"]["mlp"]["rows"]
    assert {r["run"] for r in merged["rows"]} == {1} and merged["models"]["mlp"]["runs"] == [0, 1]
    assert [r["model"] for r in merged["rows"]] == [r["model"] for r in part["rows"]]
    assert merged["largest_batch"] == data["largest_batch"]  # only the first run has the batch section
    assert merged["partial"] is False and [r["partial"] for r in merged["runs"]] == [False, True]
    assert set(merged["headline"]["per_model"]) == {"mlp", "other"}
    assert json.loads((out / "compare.json").read_text())["runs"][1]["models"] == ["mlp", "other"]
    md = (out / "RESULTS.md").read_text()
    assert "Merged from 2 runs" in md and "stopped before it finished" in md and "## other" in md
    assert (out / "compare_other.png").is_file()

    gpu = importlib.import_module("compare_gpu")  # offload.json beside each run (compare_gpu.py) is joined too
    link = {"bytes_per_s": 1e9, "measured": False, "host_to_device_bytes_per_s": 1e9, "device_to_host_bytes_per_s": 1e9}
    gpu.write_offload(gpu.offload_summary(data, link), tmp_path)
    gpu.write_offload(gpu.offload_summary({**part, "models": {"other": part["models"]["other"]}}, link), stopped)
    merge_runs.main([str(tmp_path / "compare.json"), str(stopped / "compare.json"), "--out", str(out)])
    offload = json.loads((out / "offload.json").read_text())
    assert list(offload["models"]) == ["mlp", "other"] and "## other" in (out / "OFFLOAD.md").read_text()

    # one model's configuration families measured in two runs (e.g. compile rows in a job of their own):
    # joined row by row, each row's ratio to its own run's none kept, its time put on the table's scale
    slow = {r["config"]: {**r, "step_time_s": 2 * r["step_time_s"]} for r in info["rows"] if r["status"] == "ok"}
    second = {**data, "models": {"mlp": {**info, "rows": [slow["none"], slow["block-ac"]]}},
              "rows": [slow["none"], slow["block-ac"]], "largest_batch": [], "command": "second run"}
    joined = merge_runs.merge([data, second])["models"]["mlp"]
    by = {r["config"]: r for r in joined["rows"]}
    assert [r["config"] for r in joined["rows"]] == [r["config"] for r in info["rows"]] and joined["runs"] == [0, 1]
    assert by["none"]["run"] == by["block-ac"]["run"] == 1 and by["none"]["step_time_s"] == slow["none"]["step_time_s"]
    first = {r["config"]: r for r in info["rows"]}
    for key, r in by.items():
        if r["run"] == 0 and first[key]["time_ratio"] is not None:
            assert r["measured_step_time_s"] == first[key]["step_time_s"] and r["time_ratio"] == first[key]["time_ratio"]
            assert r["step_time_s"] == pytest.approx(first[key]["time_ratio"] * slow["none"]["step_time_s"])
    assert "Measured in 2 runs (run 1:" in compare.to_markdown({**merge_runs.merge([data, second]), "out": str(out)})
    no_base = {**second, "models": {"mlp": {**info, "rows": [slow["block-ac"]]}}}
    with pytest.raises(SystemExit, match="no measured `none`"):
        merge_runs.merge([{**data, "models": {"mlp": {**info, "rows": [first["block-ac"]]}}}, no_base])

    elsewhere = {**part, "machine": {**part["machine"], "cpu_count": part["machine"]["cpu_count"] + 1}}
    with pytest.raises(SystemExit, match="different machines"):
        merge_runs.merge([data, elsewhere])
    with pytest.raises(SystemExit, match="does not exist"):
        merge_runs.main([str(tmp_path / "nowhere.json"), "--out", str(out)])


def test_compare_batch_sizes_override_the_models_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    compare = _load("compare", monkeypatch)
    _, opts = compare.options_from(compare.parser().parse_args(["--batch-sizes", "resnet50=16, gpt2=2"]))
    assert opts.batch == {"resnet50": 16, "gpt2": 2}
    _, quick = compare.options_from(compare.parser().parse_args(["--quick", "--batch-sizes", "mlp=64"]))
    assert quick.batch == {"mlp": 64}  # the override wins over the quick mode's own batch
    assert opts.compiled_plans == (("dp-approx", 0.5), ("dp-approx", 0.3))
    _, none = compare.options_from(compare.parser().parse_args(["--compiled-plans", "none"]))
    assert none.compiled_plans == ()
    with pytest.raises(SystemExit, match="--compiled-plans"):
        compare.options_from(compare.parser().parse_args(["--compiled-plans", "dp-approx"]))
    for bad in ("resnet50", "resnet50=0", "resnet50=x"):
        with pytest.raises(SystemExit, match="MODEL=N"):
            compare.options_from(compare.parser().parse_args(["--batch-sizes", bad]))
    w = compare.build_workload("mlp", size="small", batch=3, device="cpu")
    assert w.batch == 3 and w.args[0].shape[0] == 3


def test_compare_gpu_dry_run_lists_configurations(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    gpu = _load("compare_gpu", monkeypatch)
    out = gpu.main(["--dry-run"])
    plan = out["configurations"]
    assert {c["model"] for c in plan} == {"resnet50", "densenet121", "unet", "gpt2"}
    for model in ("resnet50", "gpt2"):
        keys = {c["config"] for c in plan if c["model"] == model}
        assert {"none", "block-ac", "block-sac", "ckpt-seq", "save-on-cpu"} <= keys
        assert {f"compile@{b:g}" for b in (1.0, 0.75, 0.5, 0.25)} <= keys
        assert {f"autoremat:{s}@{f:g}" for s in sorted(autoremat.SOLVERS) if s != "none"
                for f in (0.75, 0.5, 0.3)} <= keys
    assert out["options"].device == "cuda" and out["options"].size == "paper"
    assert out["options"].batch["resnet50"] == gpu.GPU_BATCH["resnet50"]
    assert len(out["batch_tasks"]) == 2
    assert "largest batch" in capsys.readouterr().out
    assert gpu.device_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    quick = gpu.main(["--quick", "--size", "small", "--dry-run"])  # lists what --quick would run
    assert {c["model"] for c in quick["configurations"]} == {"mlp"} and len(quick["batch_tasks"]) == 1
    with pytest.raises(SystemExit, match="--batch-only excludes"):
        gpu.main(["--batch-only", "--no-batch"])


def test_recompute_cost_splits_the_patched_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from autoremat.runtime import checkpoint_region, region

    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("recompute_cost", None)
    bench = importlib.import_module("recompute_cost")
    fwd, rec = checkpoint_region.CheckpointRegion.forward, region._Frame.recompute
    bench.main(["--model", "unet", "--solver", "dp-approx", "--budget", "0.7", "--rounds", "1", "--batch", "2",
                "--out", str(tmp_path)])
    assert checkpoint_region.CheckpointRegion.forward is fwd and region._Frame.recompute is rec  # probes removed
    data = json.loads((tmp_path / "recompute_cost.json").read_text())
    res = data["result"]
    assert data["machine"]["torch_threads"] == 1 and res["recomputed_segments"] >= 1
    assert res["batch"][0] == 2
    assert res["predicted_peak_fraction"] <= 0.7
    assert 0 < res["median_replay_s"] <= res["median_recompute_s"]  # the set-up wraps the replay
    assert res["median_region_forward_s"] > 0 and res["predicted_extra_s"] > 0
    assert res["measured_ratio"] > 0 and res["ratio_if_replay_only"] > 1
    assert all(len(v) == 1 for v in res["steps"].values())
    assert "measured ratio" in (tmp_path / "recompute_cost.md").read_text()
    with pytest.raises(SystemExit, match="pass --budget"):
        bench.main(["--model", "unet", "--budget", "0.05", "--rounds", "1", "--out", str(tmp_path)])


@pytest.mark.gpu
def test_compare_gpu_quick_runs_on_cuda(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU script end to end in its smoke mode (the zoo mlp, one round; ~1 min): what a GPU
    session runs first, before spending its limited time on the full comparison."""
    gpu = _load("compare_gpu", monkeypatch)
    # the small mlp at 65536 rows: 16 MiB activations, parameters of a few KiB. At its own batch (32; the
    # GPU script's --batch replaces --quick's 512) the step peak was allocator rounding and an H200 found
    # every budget infeasible; at paper size (1024 features) parameter gradients are the peak (388 MiB,
    # block checkpointing measured the same) and 50 % is out of any recomputation's reach.
    gpu.main(["--quick", "--size", "small", "--batch", "mlp=65536", "--batch-budgets", "resnet50=256MiB",
              "--out", str(tmp_path)])
    data = json.loads((tmp_path / "compare.json").read_text())
    assert data["partial"] is False and data["machine"]["device_name"] and data["machine"]["cuda_available"]
    rows = {r["config"]: r for r in data["rows"]}
    for key in ("none", "block-ac", "save-on-cpu"):
        assert rows[key]["status"] == "ok", rows[key]["error"]
        assert rows[key]["measured_peak_bytes"] > 0 and rows[key]["step_time_s"] > 0
    eager = [r for r in data["rows"] if r["family"] == "autoremat" and r["status"] == "ok"
             and not r["config"].endswith("+compile")]
    assert eager, [(r["config"], r["status"], r["error"]) for r in data["rows"] if r["family"] == "autoremat"]
    for r in eager:  # deterministic kernels: recomputation reproduces the gradients exactly
        assert r["gradients_equal"] is True, r["config"]
        assert r["predicted_peak_bytes"] > 0 and r["meets_budget"] is not None
    offload = json.loads((tmp_path / "offload.json").read_text())
    assert offload["bandwidth"]["measured"] is True and offload["bandwidth"]["bytes_per_s"] > 0
    assert {r["method"] for r in data["largest_batch"]} == set(gpu.compare.BATCH_METHODS)
    assert all(r["status"] == "ok" and r["batch_size"] >= 1 for r in data["largest_batch"]), data["largest_batch"]
    assert "device_name" in data["machine"] and data["machine"]["device_name"] in (tmp_path / "RESULTS.md").read_text()


def test_solver_speed_reports_every_solver(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The speed benchmark runs and reports (the target itself is the benchmark's, not a test's)."""
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("solver_speed", None)
    speed = importlib.import_module("solver_speed")
    assert speed.main(["--nodes", "60", "--solvers", "dp-approx,chen", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "| dp-approx |" in out and "| chen |" in out and "60 nodes" in out
    with pytest.raises(SystemExit):
        speed.main(["--solvers", "magic"])


def test_hf_inside_layer_runs_every_configuration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``benchmarks/hf_inside_layer.py`` on a tiny GPT-2 (one round): every configuration
    measured with the unpatched gradients, HF checkpointing's simulated peak beside its measured
    one, the target verdict and the report written."""
    pytest.importorskip("transformers")
    from autoremat.zoo import hf

    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("hf_inside_layer", None)
    bench = importlib.import_module("hf_inside_layer")

    def tiny() -> tuple:
        ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0))
        return hf.gpt2(n_layer=3), (ids,), {"labels": ids}, lambda o: o.loss

    monkeypatch.setattr(bench, "models", lambda: {"gpt2": tiny})
    monkeypatch.setattr(bench, "plot", lambda result, path: path.write_text("plot"))
    bench.main(["--models", "gpt2", "--rounds", "1", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "hf_inside_layer.json").read_text())["results"][0]
    rows = res["rows"]
    assert {"none", "hf-ckpt", "block-sac"} <= set(rows) and any(k.startswith("autoremat@") for k in rows)
    assert all(r["grads_equal"] for r in rows.values())
    hf_row = rows["hf-ckpt"]
    assert abs(hf_row["predicted_peak_bytes"] - hf_row["peak_bytes"]) <= 0.1 * hf_row["peak_bytes"]
    assert res["anatomy"]["layers"] == 3 and isinstance(res["targets"]["met"], bool)
    assert "Where HF checkpointing's peak sits" in (tmp_path / "hf_inside_layer.md").read_text()


def test_hf_inside_layer_targets_pick_the_best_plan_of_each_form(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("hf_inside_layer", None)
    bench = importlib.import_module("hf_inside_layer")
    rows = {"hf-ckpt": {"peak_bytes": 100, "step_time_s": 1.0},
            "autoremat@a": {"peak_bytes": 100, "step_time_s": 0.9},
            "autoremat@b": {"peak_bytes": 79, "step_time_s": 1.0},
            "autoremat@c": {"peak_bytes": 101, "step_time_s": 0.5}}
    t = bench.targets(rows)
    assert t["time_at_hf_peak"] == (0.9, "autoremat@a") and t["peak_at_hf_time"] == (0.79, "autoremat@b")
    assert t["met"]
    rows.pop("autoremat@b")
    assert not bench.targets(rows)["met"]


def test_offload_dag_benchmark_small(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``benchmarks/offload_dag.py`` on one small net: every solver has a row, ratios are sane."""
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("offload_dag", None)
    bench = importlib.import_module("offload_dag")
    bench.main(["--size", "small", "--nets", "unet", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "offload_dag_unet.json").read_text())
    assert data["machine"] and [r["solver"] for r in data["offload_alone"]] == bench.OFFLOAD_SOLVERS
    dag = data["offload_alone"][-1]
    assert "error" not in dag and dag["peak_ratio"] <= dag["fraction"] and dag["time_ratio"] >= 1.0
    assert "| unet |" in (tmp_path / "offload_dag.md").read_text()


def test_milp_gaps_quick_reports_the_target_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``benchmarks/milp_gaps.py --quick`` (one 12-node DAG): milp's least budget is a row with
    milp's own plan and bound, and the 1 %-target table says whether the gap is proven there."""
    pytest.importorskip("highspy")
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("milp_gaps", None)
    bench = importlib.import_module("milp_gaps")
    data = bench.main(["--quick", "--time-limit", "5", "--out", str(tmp_path)])
    (graph,) = data["graphs"]
    least = graph["budgets"]["least"]
    assert least["budget_bytes"] == graph["least"]["milp"]["bytes"]
    assert least["milp"]["bound_s"] <= least["milp"]["extra_time_s"] + 1e-12
    text = (tmp_path / "RESULTS.md").read_text()
    assert "| chain-skips-12-seed0 | 0.00 % (proven optimal) | 0.00 % (proven optimal) | yes |" in text
    run = least["milp"]["predicted_extra_time_s"]  # the optimum's plan finalised, beside auto's
    assert run is not None and run <= least["milp"]["extra_time_s"] + 1e-12
    assert f"least: {least['auto']['predicted_extra_time_s'] * 1e3:.4g} ms against {run * 1e3:.4g} ms" in text
    assert "Extra time is as the plans run" not in text
    priced = bench.main(["--quick", "--tails", "--time-limit", "5", "--out", str(tmp_path / "as_run")])
    assert priced["tails"] and "Extra time is as the plans run" in (tmp_path / "as_run" / "RESULTS.md").read_text()
    bench.TAILS = False


def test_combined_speed_times_one_case_and_compares_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    """``benchmarks/combined_speed.py``: one case in process (the H200 GPT-2 graph at dp-approx's
    least budget: a plan within it, simulations counted) and the before/after verdicts."""
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("combined_speed", None)
    speed = importlib.import_module("combined_speed")
    row = speed.one("gpt2", "least")
    assert row["peak_bytes"] <= row["budget_bytes"] and row["simulations"] > 0 and row["nodes"] == 36
    slower = {**row, "extra_time_s": row["extra_time_s"] * 2}
    assert speed._verdict(row, dict(row)) == "same plan"
    assert speed._verdict(slower, row) == "faster" and speed._verdict(row, slower) == "SLOWER"
    assert "x, +" in speed._plan_text(row)


def test_block_internals_estimate_moves_each_blocks_saved_tensors_into_a_unit(monkeypatch: pytest.MonkeyPatch) -> None:
    """``benchmarks/block_internals_estimate.py`` on the H200 GPT-2 graph: the rewrite keeps the
    unpatched peak and step, gives each block one unit node, and offload-dag offloads units."""
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("block_internals_estimate", None)
    est = importlib.import_module("block_internals_estimate")
    g = autoremat.Graph.from_json(str(est.GRAPHS / "graph_gpt2.json"))
    split = est.split_internals(g)
    units = [v for v in split.nodes if split.node(v)["kind"] == "internals"]
    assert len(units) == 12 and len(split) == len(g) + 12
    assert sum(split.node(v)["alloc_bytes"] for v in units) == sum(
        g.node(v)["extra_saved_bytes"] for v in g.nodes if g.node(v)["kind"] == "gpt2block")
    plain = autoremat.cost.no_recompute_plan
    assert autoremat.simulate(split, plain(split)).peak_bytes == autoremat.simulate(g, plain(g)).peak_bytes
    (row,) = est.main(["--fractions", "0.8"])
    assert row["peak_ratio"] <= 0.8 and row["units"] >= 1


def test_auto_gaps_compares_auto_with_stored_bounds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``benchmarks/auto_gaps.py`` on the zoo U-Net against a stored bound: auto's extra time over
    the bound and over the best plan found, and a graph that is not the stored one is skipped."""
    from autoremat import zoo
    from autoremat.cost import unoptimised_peak_bytes

    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("auto_gaps", None)
    bench = importlib.import_module("auto_gaps")
    g = autoremat.capture(*zoo.build("unet", size="small", device="meta"))
    peak = unoptimised_peak_bytes(g)
    budget = int(0.75 * peak)
    mine = bench._auto(g, budget)
    extra, ran = mine["extra_time_s"], mine["as_run_s"]
    row = {"budget_bytes": budget, "optimum": {"bound_s": extra / 2, "proven_optimal": False},
           "milp": {"extra_time_s": extra, "predicted_extra_time_s": 4 * ran}, "auto": {"extra_time_s": 2 * extra}}
    assert extra > 0
    stored = {"graphs": [{"graph": "unet (CPU size)", "nodes": len(g), "unoptimised_peak_bytes": peak,
                          "budgets": {"75%": row}},
                         {"graph": "vgg19 (CPU size)", "nodes": 1, "unoptimised_peak_bytes": 1, "budgets": {}}]}
    (tmp_path / "bounds.json").write_text(json.dumps(stored))
    data = bench.main(["--bounds", str(tmp_path / "bounds.json"), "--models", "unet,vgg19", "--out", str(tmp_path)])
    unet, vgg = data["graphs"]
    got = unet["budgets"]["75%"]
    assert got["over_bound"] == pytest.approx(2.0) and got["over_best"] == pytest.approx(1.0)
    assert got["as_run_over_best"] == pytest.approx(0.25)  # as the plans run, beside milp's (stored)
    assert "graph differs" in vgg["skipped"]
    text = (tmp_path / "RESULTS.md").read_text()
    assert "| unet (CPU size) | 75% (" in text and "2.000x | 1.000x | no |" in text
    assert "| unet (CPU size) | 75% | - | " in text and "| 0.250x |" in text
    assert bench.stored_model("resnet50 (paper size)") == ("resnet50", "paper") and bench.stored_model("g7") is None
    row["budget_bytes"] = int(0.7 * peak)  # where auto's plan runs faster than replayed whole
    stored["tails"] = True  # bounds proven as the plans run: auto priced the same way
    (tmp_path / "bounds.json").write_text(json.dumps(stored))
    got = bench.main(["--bounds", str(tmp_path / "bounds.json"), "--models", "unet", "--out", str(tmp_path)])
    row = got["graphs"][0]["budgets"]["75%"]
    assert got["tails"] and row["extra_time_s"] == pytest.approx(row["as_run_s"], rel=1e-5)
    assert row["extra_time_s"] < 0.9 * bench._auto(g, int(0.7 * peak))["extra_time_s"]
    assert "time: as the plans run" in (tmp_path / "RESULTS.md").read_text()


def test_optimum_gaps_reports_auto_per_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """``benchmarks/optimum_gaps.py``'s distribution of auto against the bound and the best plan found."""
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.syspath_prepend(str(BENCH.parent / "tests"))
    sys.modules.pop("optimum_gaps", None)
    bench = importlib.import_module("optimum_gaps")

    def row(ob: float, bb: float, gap: float) -> dict:
        return {"auto": {"extra_time_s": 1.0, "over_bound": ob, "over_best": bb, "seconds": 0.1, "chosen": "milp"},
                "milp": {"gap": gap}}

    data = {"graphs": [{"graph": f"g{i}", "part": "random", "budgets": {"50%": row(1 + i / 50, 1.0, i / 50)}}
                       for i in range(5)]}
    data["graphs"][0]["budgets"]["least"] = {"auto": {"infeasible": True, "seconds": 0.2}, "milp": {}}
    dist = bench.auto_distribution(data, "random")
    half = dist["50%"]
    assert half["graphs"] == 5 and half["auto_within_5pct_of_bound"] == 3 and half["auto_within_5pct_of_best_found"] == 5
    assert half["over_bound"]["worst"] == pytest.approx(1.08) and half["over_bound"]["median"] == pytest.approx(1.04)
    assert half["milp_gap_over_5pct"] == ["g3", "g4"] and half["auto_chose_milp"] == 5
    assert dist["least"]["auto_no_plan"] == 1 and dist["least"]["milp_no_answer"] == ["g0"]


def test_polish_gain_compares_auto_with_the_stored_best_plans(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``benchmarks/polish_gain.py`` on the first stored random network (its budgets): auto now against the
    stored best plans, never worse than the stored auto row, and a report written."""
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("polish_gain", None)
    bench = importlib.import_module("polish_gain")
    gaps = BENCH / "results" / "cpu" / "optimum_gaps" / "random" / "gaps.json"
    assert bench.main(["--gaps", str(gaps), "--count", "1", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "polish_gain.json").read_text())["rows"]
    assert rows and all(r["now"] <= r["before"] * (1 + 1e-7) for rs in rows.values() for r in rs)
    assert "| 50% |" in (tmp_path / "polish_gain.md").read_text()


def test_offload_saved_benchmark_compares_with_and_without_units(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``benchmarks/offload_saved.py`` on the H200 GPT-2 graph at one budget and link: offload-dag
    with the blocks' own saved tensors fits 0.6x where it cannot without them; the op-level U-Net
    has no candidates; the markdown has a row per solver."""
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("offload_saved", None)
    bench = importlib.import_module("offload_saved")
    result = bench.main(["--graphs", "gpt2,unet", "--fractions", "0.6", "--bandwidths", "53.99e9",
                         "--out", str(tmp_path)])
    assert result["graphs"]["unet"]["candidates"] == 0 and not result["graphs"]["unet"]["rows"]
    on, off = result["graphs"]["gpt2"]["rows"][:2]
    assert on["saved_units"] and on["peak_ratio"] <= 0.6 and on["units"] > 0 and off["least_ratio"] > 0.95
    text = (tmp_path / "offload_saved.md").read_text()
    assert "| 53.99 | offload-dag | 0.6 |" in text and "| 53.99 | combined | 0.6 |" in text


def test_hf_breadth_runs_and_reports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    hb = _load("hf_breadth", monkeypatch)
    assert hb.main(["--names", "bloom", "--precision", "bf16", "--out", str(tmp_path)]) == 0
    row = json.loads((tmp_path / "hf_breadth.json").read_text())["rows"][0]
    assert "error" not in row and row["gradients_equal"] and 0.9 <= row["least_pred_over_meas"] <= 1.1, row
    text = (tmp_path / "hf_breadth.md").read_text()
    assert "| bloom | bf16 |" in text and "gradients equal: 1 of 1" in text
    broken = hb.report([{"name": "x", "precision": "fp32", "error": "ValueError: no"}], "m")
    assert "error: ValueError: no" in broken and "errors: 1" in broken


def test_capture_determinism_compares_captures_but_their_times(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cd = _load("capture_determinism", monkeypatch)
    assert cd.main(["--names", "zoo:mlp", "--captures", "2", "--precision", "fp32", "--out", str(tmp_path)]) == 0
    row = json.loads((tmp_path / "capture_determinism.json").read_text())["rows"][0]
    assert row["same"] and row["differences"] == [] and row["nodes"] > 0, row
    assert "The same in 1 of 1 cases." in (tmp_path / "capture_determinism.md").read_text()
    g = autoremat.capture(*autoremat.zoo.build("mlp", size="small"), repeats=1, warmup=0)
    a, b = cd._doc(g), cd._doc(g)
    b[0][1]["out_bytes"] += 4
    assert cd.differences(a, a) == [] and len(cd.differences(a, b)) == 1 and "[out_bytes]" in cd.differences(a, b)[0]


def test_albert_shared_runs_and_reports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-call plans on ALBERT beside a hand-written per-layer checkpoint: every variant trains
    bit for bit and autoremat's least plan reaches at most the checkpoint's peak."""
    pytest.importorskip("transformers")
    bench = _load("albert_shared", monkeypatch)
    assert bench.main(["--size", "small", "--rounds", "1", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "albert_shared_small.json").read_text())["rows"]
    assert all(r["gradients_equal"] for r in rows.values()), rows
    assert rows["autoremat least"]["peak_bytes"] <= rows["per-layer checkpoint"]["peak_bytes"]
    assert 0.9 <= rows["autoremat least"]["predicted_peak_bytes"] / rows["autoremat least"]["peak_bytes"] <= 1.1
    assert "| per-layer checkpoint |" in (tmp_path / "albert_shared_small.md").read_text()


def test_meta_autocast_compares_the_meta_capture_with_the_real_one(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    ma = _load("meta_autocast", monkeypatch)
    assert ma.main(["--models", "mlp", "--rounds", "1", "--out", str(tmp_path)]) == 0
    row = json.loads((tmp_path / "meta_autocast.json").read_text())["rows"][0]
    assert row["on_meta"] and row["node_for_node"] and row["peak_ratio"] == 1.0, row
    assert "1 of 1 node for node" in (tmp_path / "meta_autocast.md").read_text()


def test_reference_speed_checks_kept_plans_against_cold_ones(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``benchmarks/reference_speed.py`` end to end on two small measured graphs (not zoo captures:
    seconds each): every row timed, the kept plans compared with the cold ones, the report written."""
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("reference_speed", None)
    bench = importlib.import_module("reference_speed")

    def pair(model: str) -> tuple[autoremat.Graph, autoremat.Graph]:
        edges = [(0, 1), (1, 2), (2, 3), (3, 7), (0, 4), (4, 5), (5, 6), (6, 7)]
        a = autoremat.Graph.from_edges(8, edges, out_bytes=[1000] * 8, time_s=[1e-4 * (1 + v % 3) for v in range(8)])
        a.meta["time_source"] = "perf_counter"
        b = a.copy()
        b.node(2)["time_s"] *= 1.1  # another capture: other times, the same reference costs
        return a, b

    monkeypatch.setattr(bench, "capture_pair", pair)
    assert bench.main(["--models", "tiny", "--budgets", "80%,90%", "--rounds", "1", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "reference_speed.json").read_text())
    assert [(r["model"], r["budget"]) for r in data["rows"]] == [("tiny", "80%"), ("tiny", "90%")]
    assert data["mismatches"] == [] and all(r["same reference costs"] for r in data["rows"])
    assert "| tiny | 8 | 80% |" in (tmp_path / "reference_speed.md").read_text()


def test_hf_inside_layer_gpu_size_is_gpt2_smalls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--size gpu`` (for a GPU run, where arithmetic sets the step time): the language models at
    GPT-2 small's width and depth on 8 x 1024 tokens, the size recorded in the results."""
    pytest.importorskip("transformers")
    from autoremat.zoo import hf

    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("hf_inside_layer", None)
    bench = importlib.import_module("hf_inside_layer")
    seen = []

    def tiny() -> tuple:
        seen.append(bench.lm_config("gpt2"))
        ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
        return hf.gpt2(n_layer=2), (ids,), {"labels": ids}, lambda o: o.loss

    monkeypatch.setattr(bench, "models", lambda: {"gpt2": tiny})
    monkeypatch.setattr(bench, "plot", lambda result, path: path.write_text("plot"))
    bench.main(["--models", "gpt2", "--rounds", "1", "--out", str(tmp_path), "--size", "gpu"])
    cfg = seen[0]
    assert (cfg.n_embd, cfg.n_layer, cfg.n_head, cfg.n_positions) == (768, 12, 12, 1024)
    assert bench.lm_config("llama").num_hidden_layers == 12 and bench.LM_SIZES["gpu"]["batch"] == 8
    assert json.loads((tmp_path / "hf_inside_layer.json").read_text())["size"] == "gpu"


def test_mode_free_peaks_measures_without_a_dispatch_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``benchmarks/mode_free_peaks.py`` on the U-Net's unpatched step and least plan: the peaks per
    memory format, the profiler's the same in both formats (no dispatch mode: the gradient sums run
    in place), and so is the counter's: it adds a second gradient in place into a channels_last
    first one, as the engine does (it counted the least plan at 5,605,888 B channels_last against
    4,479,488 B contiguous before, predicted 4,516,352 B)."""
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("mode_free_peaks", None)
    bench = importlib.import_module("mode_free_peaks")
    threads = torch.get_num_threads()
    try:
        result = bench.main(["--models", "unet", "--budgets", "none,min", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    rows = result["rows"]
    assert [(r["format"], r["budget"]) for r in rows] == [("contiguous", "none"), ("contiguous", "min"),
                                                           ("channels_last", "none"), ("channels_last", "min")]
    assert all(r["profiler"] > 0 and r["allocator"] > 0 for r in rows)
    assert rows[0]["counter"] == rows[0]["predicted"] and rows[2]["counter"] == rows[2]["predicted"]
    assert rows[0]["profiler"] == rows[2]["profiler"] and rows[1]["counter"] == rows[3]["counter"]
    assert abs(rows[3]["counter"] / rows[3]["predicted"] - 1) < 0.02
    assert (tmp_path / "mode_free_peaks.md").read_text().count("| unet |") == 4


def test_every_benchmark_script_is_in_the_index():
    """``benchmarks/README.md`` is where the next engineer looks: every script has its row."""
    index = (BENCH / "README.md").read_text()
    missing = [p.name for p in sorted(BENCH.glob("*.py")) if f"| `{p.name}` |" not in index]
    assert not missing, f"add a row to benchmarks/README.md for {missing}"


def test_milp_gaps_builds_the_zoo_at_the_papers_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """``benchmarks/milp_gaps.py --size paper``: the zoo's graphs at the papers' size (the same nodes,
    larger bytes), labelled so; an unknown size is refused."""
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("milp_gaps", None)
    bench = importlib.import_module("milp_gaps")
    ((small_label, small),) = bench.zoo_graphs(["vgg19"], "small")
    ((paper_label, paper),) = bench.zoo_graphs(["vgg19"], "paper")
    assert (small_label, paper_label) == ("vgg19 (CPU size)", "vgg19 (paper size)")
    g, h = small(), paper()
    assert len(g) == len(h) and h.total("out_bytes") > 100 * g.total("out_bytes")
    with pytest.raises(ValueError, match="size='huge'"):
        bench.zoo_graphs(["vgg19"], "huge")
