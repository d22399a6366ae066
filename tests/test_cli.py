"""The autoremat command: demo, profile, plan (JSON and PNG), errors and exit codes."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

import autoremat
from autoremat.cli import main


def test_demo_reports_equal_gradients(capsys: pytest.CaptureFixture[str]) -> None:
    """The README's ``autoremat demo`` (test_readme maps it here), two steps and one timing pair
    (the seven of the default are timed in ``test_budget_min_and_a_saved_plan_in_the_demo``)."""
    assert main(["demo", "--steps", "2", "--timing-pairs", "1"]) == 0
    out = capsys.readouterr().out
    assert "autoremat demo: resnet50" in out and "bit-for-bit equal" in out and "measured step peak" in out


def test_profile_lists_nodes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", "--model", "vgg19", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "unoptimised step peak" in out and "top 3 nodes" in out


def test_plan_writes_json_and_png(tmp_path: Path) -> None:
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    # chen: the question is the files written; auto on a measured ResNet-50 (CLI defaults) is the
    # README's `autoremat plan --model resnet50 --budget min` (test_readme)
    assert main(["plan", "--model", "resnet50", "--budget", "50%", "--solver", "chen", "--out", str(out),
                 "--plot", str(png)]) == 0
    plan = autoremat.Plan.from_json(str(out))
    assert plan.recompute_segments
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_meta_paper_size(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "resnet50", "--size", "paper", "--device", "meta", "--budget", "40%",
                 "--solver", "chen"]) == 0
    assert "predicted step peak" in capsys.readouterr().out


def test_errors_have_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "mlp", "--budget", "lots"]) == 2
    assert "not understood" in capsys.readouterr().out
    assert main(["plan", "--model", "mlp", "--budget", "1KB", "--solver", "chen", "--on-infeasible", "error"]) == 3
    out = " ".join(capsys.readouterr().out.split())
    assert "infeasible" in out and "% of the unoptimised step peak" in out and "plans reach" in out


def test_plan_on_its_defaults_plans_at_the_least_and_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    """``autoremat plan --model mlp``: 50 % is below what any plan reaches (parameter gradients
    dominate); the default plans at the least, states the range, and exits 0."""
    assert main(["plan", "--model", "mlp", "--times", "flops"]) == 0
    captured = capsys.readouterr()
    out = " ".join(captured.out.split())
    assert "reachable step peak (solver auto):" in out and "(100 %, no recomputation)" in out
    assert "note: budget 50% is below the least step peak" in out
    # progress goes to standard error, with phase names and times
    assert "autoremat: capture mlp (small, cpu): done in" in captured.err
    assert "autoremat: solve (" in captured.err


def test_budget_min_and_a_saved_plan_in_the_demo(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "plan.json"
    assert main(["plan", "--model", "resnet50", "--budget", "min", "--times", "flops", "--out", str(path)]) == 0
    plan = autoremat.Plan.from_json(str(path))
    assert plan.recompute_segments and "reachable step peak" in capsys.readouterr().out
    assert main(["demo", "--model", "resnet50", "--plan", str(path), "--steps", "1", "--times", "flops"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "saved plan: " + plan.describe() in out and "bit-for-bit equal" in out
    assert "interleaved pairs; per pair the patched step took" in out  # the timing noise, stated
    assert "median of 7 interleaved pairs" in out and "without the lowest and highest" in out  # the default 7
    demo = importlib.import_module("autoremat.demo")
    monkeypatch.setattr(demo, "capture", lambda *a, **k: pytest.fail("captured before checking"))
    assert main(["demo", "--model", "densenet121", "--plan", str(path)]) == 2  # another model: refused first
    assert "plan was made for graph" in capsys.readouterr().out
    assert main(["demo", "--plan", str(tmp_path / "missing.json")]) == 2
    assert "--plan" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "match"), [
    (["plan", "--model", "mlp", "--device", "banana"], "not a device"),
    (["plan", "--model", "mlp", "--budget", "-1GB"], "cannot be negative"),
    (["plan", "--model", "mlp", "--out", "/nonexistent-autoremat-dir/plan.json"], "does not exist; create it"),
    (["profile", "--model", "mlp", "--top", "0"], "--top 0: must be >= 1"),
])
def test_arguments_checked_before_capture(argv: list[str], match: str, capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import autoremat.cli

    monkeypatch.setattr(autoremat.cli, "capture_within", lambda *a, **k: pytest.fail("captured before checking"))
    assert main(argv) == 2
    out = capsys.readouterr().out
    assert match in out and out.count("\n") == 1 and "Traceback" not in out


def test_out_inside_a_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["plan", "--model", "mlp", "--out", str(blocker / "plan.json")]) == 2
    assert "does not exist" in capsys.readouterr().out


def test_profile_within_a_memory_limit_never_runs_the_full_step(capsys: pytest.CaptureFixture[str]) -> None:
    from autoremat.capture.scaled import resident_bytes_of
    from autoremat.cost import unoptimised_peak_bytes

    model, inputs = autoremat.zoo.build("resnet50", size="small", batch_size=8)
    g = autoremat.capture(model, inputs, repeats=1)
    fixed = g.param_grad_bytes
    resident = resident_bytes_of(model, inputs)
    limit = resident + fixed + int(0.6 * (unoptimised_peak_bytes(g) - fixed))
    assert main(["profile", "--model", "resnet50", "--batch-size", "8", "--memory-limit", str(limit)]) == 0
    assert "perf_counter, scaled" in " ".join(capsys.readouterr().out.split())  # rich wraps lines
    # no batch size can be timed within it: the full-size bytes with times from FLOPs (nothing runs)
    assert main(["profile", "--model", "resnet50", "--batch-size", "8", "--memory-limit", str(resident + 1000)]) == 0
    assert "(flops)" in " ".join(capsys.readouterr().out.split())


def test_threads_are_set_for_runs_on_the_cpu_only(capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """``--threads``: the demo runs with one intra-op thread by default and its title says so; ``0``
    keeps PyTorch's count (the default of ``profile`` and ``plan``, whose times should be the
    training's); a CPU capture takes the count asked for, a meta capture sets none; ``-1`` is refused."""
    import torch

    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    monkeypatch.setattr(torch, "get_num_threads", lambda: calls[-1] if calls else 4)
    demo = ["demo", "--model", "mlp", "--steps", "1", "--timing-pairs", "1", "--times", "flops", "--solver", "chen"]
    assert main(demo) == 0
    assert calls == [1] and "(small size, CPU, 1 thread)" in capsys.readouterr().out
    assert main([*demo, "--threads", "0"]) == 0
    assert calls == [1] and "(small size, CPU, 1 thread)" in capsys.readouterr().out  # left as it was
    assert main(["profile", "--model", "mlp", "--times", "flops"]) == 0
    assert calls == [1]
    assert main(["profile", "--model", "mlp", "--times", "flops", "--threads", "3"]) == 0
    assert calls == [1, 3]
    assert main(["plan", "--model", "mlp", "--device", "meta", "--solver", "chen", "--threads", "3"]) == 0
    assert calls == [1, 3]
    capsys.readouterr()
    assert main(["demo", "--threads", "-1"]) == 2
    assert "--threads -1: must be >= 0" in capsys.readouterr().out
