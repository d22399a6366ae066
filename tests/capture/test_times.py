"""``times="flops"`` (autoremat.capture): deterministic node times from FLOPs and bytes moved,
for reproducible planning (CI); ``AUTOREMAT_TIMES`` sets the default."""

from __future__ import annotations

import importlib

import pytest

import autoremat

capture_pkg = importlib.import_module("autoremat.capture")  # autoremat.capture is the function
fx = importlib.import_module("autoremat.capture.fx")
scaled = importlib.import_module("autoremat.capture.scaled")


def _times(g: autoremat.Graph) -> list[tuple[float, float]]:
    return [(g.node(v)["time_s"], g.node(v)["bwd_time_s"]) for v in g.nodes]


def test_flop_times_are_deterministic_and_run_no_timing_step(monkeypatch: pytest.MonkeyPatch) -> None:
    model, inputs = autoremat.zoo.build("resnet50", size="small", batch_size=2)
    monkeypatch.setattr(fx, "time_fx", lambda *a, **k: pytest.fail("timed a step"))
    a = autoremat.capture(model, inputs, times="flops")
    b = autoremat.capture(model, inputs, times="flops")
    assert a.meta["time_source"] == b.meta["time_source"] == "flops"
    assert _times(a) == _times(b) and all(t > 0 for t, _ in _times(a))
    assert a.to_dict() == b.to_dict()  # the same graph, so the same plan (auto's own determinism: milp/test_chain.py)


def test_environment_variable_sets_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    model, inputs = autoremat.zoo.build("mlp", size="small")
    monkeypatch.setenv("AUTOREMAT_TIMES", "flops")
    assert autoremat.capture(model, inputs).meta["time_source"] == "flops"
    assert autoremat.capture(model, inputs, times="measured").meta["time_source"] == "perf_counter"
    monkeypatch.setenv("AUTOREMAT_TIMES", "fast")
    with pytest.raises(ValueError, match="AUTOREMAT_TIMES='fast' is not a time source"):
        autoremat.capture(model, inputs)
    with pytest.raises(ValueError, match="times='exact' is not a time source"):
        autoremat.capture(model, inputs, times="exact")


def test_capture_within_with_flop_times_runs_no_real_step(monkeypatch: pytest.MonkeyPatch) -> None:
    model, inputs = autoremat.zoo.build("resnet50", size="small", batch_size=4)
    plain = autoremat.capture(model, inputs, times="flops")
    monkeypatch.setattr(scaled, "ladder", lambda *a, **k: pytest.fail("ran a real step"))  # the timed captures
    monkeypatch.setattr(capture_pkg, "capture", lambda *a, **k: pytest.fail("ran a real step"))
    g = autoremat.capture_within(model, inputs, limit_bytes=1000, times="flops")  # far below the step
    assert g.fingerprint == plain.fingerprint and _times(g) == _times(plain)
    assert g.meta["device"] == "cpu" and g.meta["inputs"][0]["device"] == "cpu"
    plan = autoremat.solve(g, "60%", solver="chen")  # the signature is the graph's, whichever solver
    assert plan.inputs and plan.recompute_segments
    autoremat.check_inputs(plan, inputs)  # the real batch matches the plan


def test_timing_noise_is_the_share_of_the_medians_above_the_fastest_repeat() -> None:
    from autoremat.capture import timing_noise

    assert timing_noise([]) == 0.0 and timing_noise([[], []]) == 0.0
    assert timing_noise([[2.0]]) == 0.0  # one repeat: no information
    assert timing_noise([[1.0, 1.0, 1.0], [3.0, 3.0, 3.0]]) == 0.0
    assert timing_noise([[1.0, 2.0, 3.0]]) == pytest.approx(0.5)  # median 2, fastest 1
    assert timing_noise([[1.0, 2.0, 3.0], [4.0, 4.0, 4.0]]) == pytest.approx(1.0 / 6.0)
    assert 0.0 <= timing_noise([[1e-6, 1.0, 2.0]]) < 1.0


def test_measured_captures_record_their_timing_noise() -> None:
    model, inputs = autoremat.zoo.build("mlp", size="small")
    for mode in ("fx", "module"):
        g = autoremat.capture(model, inputs, mode=mode)
        assert 0.0 <= g.meta["time_noise"] < 1.0, mode
        assert autoremat.Graph.from_json(g.to_json()).meta["time_noise"] == g.meta["time_noise"]
    one = autoremat.capture(model, inputs, repeats=1)
    assert one.meta["time_noise"] == 0.0
    assert "time_noise" not in autoremat.capture(model, inputs, times="flops").meta
