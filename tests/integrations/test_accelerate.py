"""autoremat.integrations.accelerate: one call, environment variables, YAML section."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate import Accelerator

import autoremat
import autoremat.integrations.accelerate as ar
from autoremat.measure import gradients, gradients_equal, run_step


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("AUTOREMAT_BUDGET", "AUTOREMAT_SOLVER", "AUTOREMAT_ENABLED", "AUTOREMAT_CONFIG",
                "AUTOREMAT_PROFILE_STEPS", "AUTOREMAT_ON_INFEASIBLE", "AUTOREMAT_PLAN", "AUTOREMAT_CACHE_DIR",
                "AUTOREMAT_TIMES", "AUTOREMAT_VERBOSE", "AUTOREMAT_PROGRESS", "AUTOREMAT_OUTPUT_KEPT",
                "AUTOREMAT_CALLS_PER_STEP"):
        monkeypatch.delenv(key, raising=False)


def _model():  # type: ignore[no-untyped-def]
    model, (x,) = autoremat.zoo.build("resnet50", size="small")
    return model, x


def test_prepare_patches_with_equal_gradients() -> None:
    model, x = _model()
    reference = copy.deepcopy(model)
    accelerator = Accelerator(cpu=True)
    out = ar.prepare(accelerator, model, (x,), budget="50%")
    assert out is model and autoremat.is_patched(model)
    torch.manual_seed(0)
    run_step(reference, (x,))
    torch.manual_seed(0)
    run_step(model, (x,))
    assert gradients_equal(gradients(reference), gradients(model))
    autoremat.restore(model)


def test_environment_overrides_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AUTOREMAT_SOLVER", "none")
    monkeypatch.setenv("AUTOREMAT_BUDGET", "100%")
    model, x = _model()
    ar.prepare(Accelerator(cpu=True), model, (x,), budget="50%", solver="chen")
    state = model.__dict__["_autoremat_patch"]
    assert state.plan.solver == "none" and not state.plan.recompute_segments
    autoremat.restore(model)


def test_disabled_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AUTOREMAT_ENABLED", "0")
    model, x = _model()
    ar.prepare(Accelerator(cpu=True), model, (x,), budget="50%")
    assert not autoremat.is_patched(model)


def test_yaml_section(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "autoremat.yaml"
    cfg.write_text("autoremat:\n  budget: '60%'\n  solver: chen\n")
    monkeypatch.setenv("AUTOREMAT_CONFIG", str(cfg))
    model, x = _model()
    ar.prepare(Accelerator(cpu=True), model, (x,))
    plan = model.__dict__["_autoremat_patch"].plan
    assert plan.solver == "chen" and plan.recompute_segments
    autoremat.restore(model)
    bad = tmp_path / "bad.yaml"
    bad.write_text("autoremat:\n  budgett: '60%'\n")
    with pytest.raises(ValueError, match="unknown autoremat keys"):
        ar.AutoRematConfig.from_yaml(str(bad))


@pytest.mark.parametrize(("var", "value", "match"), [
    ("AUTOREMAT_BUDGET", "lots", "accepted|expected"),
    ("AUTOREMAT_SOLVER", "magic", "not registered"),
    ("AUTOREMAT_ENABLED", "maybe", "AUTOREMAT_ENABLED"),
    ("AUTOREMAT_PROFILE_STEPS", "x", "AUTOREMAT_PROFILE_STEPS"),
    ("AUTOREMAT_CALLS_PER_STEP", "0", "calls_per_step=0 must be an integer >= 1"),
])
def test_bad_environment_rejected(monkeypatch: pytest.MonkeyPatch, var: str, value: str, match: str) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=match):
        ar.AutoRematConfig()


def test_byte_budget_subtracts_optimizer_state() -> None:
    model, x = _model()
    opt = torch.optim.AdamW(model.parameters())
    params = sum(p.numel() * 4 for p in model.parameters())
    from autoremat.resident import optimizer_state_bytes

    assert optimizer_state_bytes(opt) == 2 * params  # estimated before the first step
    with pytest.raises(ValueError, match="resident"):
        ar.prepare(Accelerator(cpu=True), model, (x,), budget=params * 2, optimizer=opt)
    assert not autoremat.is_patched(model)


@pytest.fixture
def fresh_accelerator_state() -> Any:
    """Accelerate keeps one process-wide state; a mixed-precision Accelerator needs a fresh one."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def test_prepare_profiles_and_recomputes_under_bf16_autocast(monkeypatch: pytest.MonkeyPatch,
                                                             fresh_accelerator_state: Any) -> None:
    """``Accelerator(mixed_precision="bf16")``: capture runs under its autocast (bf16 activations in
    the graph), and a patched step under ``accelerator.autocast()`` has the unpatched gradients.
    (Accelerate runs ``"fp16"`` on the CPU without autocast, so bf16 is the CPU case.)"""
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    seen: dict[str, Any] = {}
    real_capture = ar.capture_within

    def spy(*args: Any, **kwargs: Any) -> autoremat.Graph:
        seen["autocast"] = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
        seen["graph"] = real_capture(*args, **kwargs)
        return seen["graph"]

    monkeypatch.setattr(ar, "capture_within", spy)
    model, x = _model()
    reference = copy.deepcopy(model)
    fp32 = autoremat.capture(model, (x,), repeats=1)
    ar.prepare(accelerator, model, (x,), budget="50%")
    assert seen["autocast"] == (True, torch.bfloat16)
    g = seen["graph"]
    conv = next(v for v in g.nodes if g.node(v)["kind"] == "conv")
    assert 2 * g.node(conv)["out_bytes"] == fp32.node(conv)["out_bytes"]
    plan = model.__dict__["_autoremat_patch"].plan
    assert plan.recompute_segments
    with accelerator.autocast():
        torch.manual_seed(0)
        run_step(reference, (x,))
        torch.manual_seed(0)
        run_step(model, (x,))
    assert gradients_equal(gradients(reference), gradients(model))
    autoremat.restore(model)


def test_measured_step_under_bf16_is_the_prepared_models(monkeypatch: pytest.MonkeyPatch,
                                                         fresh_accelerator_state: Any) -> None:
    """The summary's measured step peak is the step of the loop: ``accelerator.prepare`` runs the
    forward under autocast and the backward outside it. Measured with autocast around the whole
    step, autocast's cast cache held the bf16 weight copies of every recomputed layer to the end of
    backward (ConvNeXt at its least plan: 1.48 MiB reported, 1.20 MiB in the loop, 1.17 predicted)."""
    from autoremat.measure import LiveStorageCounter

    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    seen: dict[str, Any] = {}
    monkeypatch.setattr(ar, "print_summary", lambda summary, **_: seen.update(summary))
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.ConvNextForImageClassification(transformers.ConvNextConfig(
        hidden_sizes=[16, 32, 64, 64], depths=[1, 1, 2, 1], num_labels=10))
    x = torch.randn(4, 3, 64, 64)
    ar.prepare(accelerator, model, (x,), budget="min", solver="chen")
    assert model.__dict__["_autoremat_patch"].plan.recompute_segments
    prepared = accelerator.prepare(model)
    counter = LiveStorageCounter()
    with counter:
        out = prepared(x)
        out.logits.float().mean().backward()
    assert seen["measured_peak_bytes"] == counter.peak, (seen["measured_peak_bytes"], counter.peak)
    autoremat.restore(model)


def test_a_batch_of_one_whose_step_does_not_fit_is_planned(monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """A batch of 1 (an LLM fine-tune) whose unpatched step is above the budget: no batch size can
    be timed, so times come from FLOPs (logged) and the plan fits; it raised CaptureDoesNotFitError."""
    import logging

    seen: dict[str, Any] = {}
    monkeypatch.setattr(ar, "print_summary", lambda summary, **_: seen.update(summary))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(),
                                                      torch.nn.Linear(256, 32)) for _ in range(8)))
    x = torch.randn(1, 512, 32)
    full = autoremat.capture(model, (x,), times="flops")
    resident = sum(p.numel() * 4 for p in model.parameters()) + x.numel() * 4
    budget = resident + autoremat.cost.unoptimised_peak_bytes(full) * 6 // 10
    with caplog.at_level(logging.WARNING, logger="autoremat.capture.scaled"):
        ar.prepare(Accelerator(cpu=True), model, (x,), budget=budget, solver="chen")
    assert "node times from FLOPs" in caplog.text
    assert model.__dict__["_autoremat_patch"].plan.recompute_segments
    assert seen["time_source"] == "flops" and seen["measured_peak_bytes"] <= seen["step_budget_bytes"]
    autoremat.restore(model)


def test_yaml_and_numeric_budgets_are_read_as_budgets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 29 item 12: ``budget: 0.5`` in YAML raised "'float' object has no attribute 'strip'"."""
    np = pytest.importorskip("numpy")
    cfg = tmp_path / "autoremat.yaml"
    cfg.write_text("autoremat:\n  budget: 0.5\n")
    assert ar.AutoRematConfig.from_yaml(str(cfg)).budget == "50.0%"
    assert ar.AutoRematConfig(budget=np.float64(0.25)).budget == "25.00%"
    assert ar.AutoRematConfig(budget=6_000_000_000).budget == "6000000000"
    monkeypatch.setenv("AUTOREMAT_BUDGET", "6GB")  # an environment string overrides a numeric value
    assert ar.AutoRematConfig(budget=0.5).budget == "6GB"
    monkeypatch.delenv("AUTOREMAT_BUDGET")
    with pytest.raises(ValueError, match=r"fraction in \(0, 1\]"):
        ar.AutoRematConfig(budget=1.5)


def _small(width: int = 32, batch: int = 8):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Conv2d(3, width, 3, padding=1), torch.nn.ReLU()]
    for _ in range(6):
        layers += [torch.nn.Conv2d(width, width, 3, padding=1), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(width, 10))
    return model, torch.randn(batch, 3, 16, 16)


def test_prints_the_summary_table_and_progress(capsys: pytest.CaptureFixture[str]) -> None:
    model, x = _small()
    ar.prepare(Accelerator(cpu=True), model, (x,), budget="70%")
    out = capsys.readouterr()
    for row in ("autoremat (Accelerate)", "plan from", "reachable step peak", "measured step peak",
                "not raised: the Accelerate path keeps it"):
        assert row in " ".join(out.out.split()), row
    assert "autoremat: capture Sequential: done in" in out.err
    autoremat.restore(model)


def test_disabled_says_so(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("AUTOREMAT_ENABLED", "0")
    model, x = _small()
    ar.prepare(Accelerator(cpu=True), model, (x,), budget="70%")
    assert "disabled (AUTOREMAT_ENABLED=0): the model is left as it is" in capsys.readouterr().err
    assert not autoremat.is_patched(model)


def test_infeasible_budget_states_the_range_or_plans_at_the_least(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AUTOREMAT_BUDGET", "1%")
    model, x = _small()
    with pytest.raises(autoremat.InfeasibleBudgetError, match=r"bytes, 1 %\).*plans reach"):
        ar.prepare(Accelerator(cpu=True), model, (x,), budget="70%")
    assert not autoremat.is_patched(model)
    monkeypatch.setenv("AUTOREMAT_ON_INFEASIBLE", "min")
    ar.prepare(Accelerator(cpu=True), model, (x,))
    plan = model.__dict__["_autoremat_patch"].plan
    # measured times, as prepare captures: on FLOP times auto's lattice search (small graphs,
    # deterministic times only: autoremat.solvers.milp.exact.auto_least_peak) reaches lower
    graph = autoremat.capture(model, (x,))
    graph.meta["output_kept"] = "step"  # prepare's default: the loop keeps the output through backward
    least = autoremat.solve(graph, "min").budget_bytes
    assert plan.budget_bytes == least
    autoremat.restore(model)
    monkeypatch.delenv("AUTOREMAT_ON_INFEASIBLE")
    monkeypatch.setenv("AUTOREMAT_BUDGET", "min")
    ar.prepare(Accelerator(cpu=True), model, (x,))
    assert model.__dict__["_autoremat_patch"].plan.budget_bytes == least
    autoremat.restore(model)


def test_a_byte_budget_below_the_resident_bytes_plans_at_the_least_under_on_infeasible_min(
        capsys: pytest.CaptureFixture[str]) -> None:
    """``on_infeasible="min"`` plans at the least for every budget no plan meets, also one below
    the parameters, optimizer state and batch (it raised "raise it", as under ``"error"``)."""
    model, x = _small()
    with pytest.raises(ValueError, match=r"below .*resident before a step \(.*iB"):
        ar.prepare(Accelerator(cpu=True), model, (x,), budget="1KiB")
    assert not autoremat.is_patched(model)
    ar.prepare(Accelerator(cpu=True), model, (x,), budget="1KiB", on_infeasible="min")
    plan = model.__dict__["_autoremat_patch"].plan
    assert plan.recompute_segments
    err = " ".join(capsys.readouterr().err.split())
    assert "budget='1KiB' (below" in err and "planned at the least (on_infeasible='min')" in err
    autoremat.restore(model)


def test_saved_plan_and_cache_skip_profiling(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, x = _small()
    monkeypatch.setenv("AUTOREMAT_CACHE_DIR", str(tmp_path / "cache"))
    ar.prepare(Accelerator(cpu=True), model, (x,), budget="70%")
    plan = model.__dict__["_autoremat_patch"].plan
    autoremat.restore(model)
    plan.to_json(str(tmp_path / "plan.json"))
    monkeypatch.setattr(ar, "capture_within", lambda *a, **k: pytest.fail("profiled again"))
    for kwargs in ({"budget": "70%"}, {"plan": str(tmp_path / "plan.json")}, {"plan": plan}):
        again, _ = _small()
        ar.prepare(Accelerator(cpu=True), again, (x,), **kwargs)
        assert again.__dict__["_autoremat_patch"].plan.to_dict() == plan.to_dict(), kwargs
        autoremat.restore(again)
    monkeypatch.setenv("AUTOREMAT_PLAN", str(tmp_path / "plan.json"))
    other, y = _small(batch=16)  # a larger batch: the plan's predictions do not hold (a smaller one runs)
    with pytest.raises(autoremat.PlanMismatchError, match=r"the batch has 16 rows, the plan was made for 8"):
        ar.prepare(Accelerator(cpu=True), other, (y,))
    wider, _ = _small(width=16)
    with pytest.raises(autoremat.PlanMismatchError):
        ar.prepare(Accelerator(cpu=True), wider, (x,))
    assert not autoremat.is_patched(other) and not autoremat.is_patched(wider)
    monkeypatch.setenv("AUTOREMAT_PLAN", str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="no such plan file"):
        ar.AutoRematConfig()


def test_a_failure_on_the_main_process_reaches_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    """The other processes wait for the main process's plan in a broadcast: its failure is
    broadcast before it is raised, so they stop with it instead of hanging."""
    sent: list[Any] = []

    def broadcast(accelerator: Any, obj: Any) -> Any:
        sent.append(obj)
        return obj if accelerator.is_main_process else {"error": "ValueError: boom"}

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("boom")

    monkeypatch.setattr(ar, "_broadcast", broadcast)
    monkeypatch.setattr(ar, "_plan_on_main", failing)
    model = torch.nn.Linear(4, 2)
    x = torch.randn(3, 4)
    acc = Accelerator(cpu=True)
    with pytest.raises(ValueError, match="boom"):
        ar.prepare(acc, model, (x,), budget="50%")
    assert sent == [{"error": "ValueError: boom"}]
    monkeypatch.setattr(type(acc), "is_main_process", property(lambda self: False))
    with pytest.raises(RuntimeError, match="the main process failed while planning, so every process stops"):
        ar.prepare(acc, model, (x,), budget="50%")
    assert not autoremat.is_patched(model)


@pytest.mark.slow  # ~50-85 s here: prepare profiles GPT-2 at module level
@pytest.mark.parametrize("solver", ["dp-approx", "blocks"])
def test_module_level_capture_suits_the_solver(solver: str) -> None:
    """A transformers model (module level): ``dp-approx`` recomputes single nodes, so ``prepare``
    captures one node per layer for it (on the default op-by-op capture it reaches nothing below
    100 % and ``prepare`` stopped at planning); ``blocks`` gets the layers op by op."""
    from autoremat.zoo import hf

    model, x = hf.gpt2(), torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    reference = copy.deepcopy(model)
    ar.prepare(Accelerator(cpu=True), model, (x,), budget="60%", solver=solver)
    plan = model.__dict__["_autoremat_patch"].plan
    assert plan.recompute_segments and plan.graph_mode == "module" and plan.solver == solver
    assert (len(plan.node_names) > 100) == (solver == "blocks")  # op by op, or one node per layer
    torch.manual_seed(0)
    run_step(reference, (x,), loss_fn=hf.logits_mean)
    torch.manual_seed(0)
    run_step(model, (x,), loss_fn=hf.logits_mean)
    assert gradients_equal(gradients(reference), gradients(model))


def test_calls_per_step_shares_a_byte_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """A loop calling the model twice before one backward (two views) holds both calls'
    activations: ``calls_per_step=2`` plans each call at half the step budget."""
    model, x = _small()
    graph = autoremat.capture(model, (x,), times="flops")
    resident = sum(p.numel() * 4 for p in model.parameters()) + x.numel() * 4
    budget = resident + int(1.35 * autoremat.cost.unoptimised_peak_bytes(graph))  # one call fits unpatched
    monkeypatch.setenv("AUTOREMAT_TIMES", "flops")
    seen: list[tuple[int, str | None]] = []
    real = ar.plan_within

    def spy(*args: Any, **kwargs: Any) -> Any:
        plan, step, note = real(*args, **kwargs)
        seen.append((step, note))
        return plan, step, note

    monkeypatch.setattr(ar, "plan_within", spy)
    ar.prepare(Accelerator(cpu=True), model, (x,), budget=budget)
    autoremat.restore(model)
    monkeypatch.setenv("AUTOREMAT_CALLS_PER_STEP", "2")
    ar.prepare(Accelerator(cpu=True), model, (x,), budget=budget)
    plan_steps = [step for step, _ in seen]
    assert plan_steps[1] == plan_steps[0] // 2 and "2 calls per step" in str(seen[1][1])
    autoremat.restore(model)


def test_a_plan_whose_measured_step_runs_out_of_memory_is_solved_again_lower(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The measured step runs before training, inside prepare: where it runs out of memory (the
    allocator's fragmentation, a workspace the profile missed) the plan is solved at 85 % of the
    step budget; where every try does, prepare raises a clear error and leaves the model as it was.
    Before, the measured step ran after planning, outside the rollback, for the summary only: its
    raw out-of-memory error left the model patched."""
    import logging

    real = ar.measured_step_peak
    tries: list[int] = []

    def failing_first(*args: Any, **kwargs: Any) -> int:
        tries.append(1)
        if len(tries) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (simulated)")
        return real(*args, **kwargs)

    model, x = _small()
    monkeypatch.setenv("AUTOREMAT_TIMES", "flops")
    monkeypatch.setattr(ar, "measured_step_peak", failing_first)
    with caplog.at_level(logging.WARNING, logger="autoremat"):
        ar.prepare(Accelerator(cpu=True), model, (x,), budget="80%")
    assert len(tries) == 2 and "planning again at" in caplog.text
    plan = model.__dict__["_autoremat_patch"].plan
    assert plan.budget_bytes is not None and autoremat.is_patched(model)
    autoremat.restore(model)

    def always(*args: Any, **kwargs: Any) -> int:
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(ar, "measured_step_peak", always)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(torch.OutOfMemoryError, match="ran out of memory with every plan tried"):
        ar.prepare(Accelerator(cpu=True), model, (x,), budget="80%")
    assert not autoremat.is_patched(model)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_a_batch_mapping_as_the_example_args_says_how_to_pass_it() -> None:
    """``prepare(accelerator, model, batch)`` with a Hugging Face batch (a dict): before, "no input tensor has
    a batch dimension 0"; now it says to pass it as the keyword batch."""
    model = torch.nn.Linear(4, 4)
    with pytest.raises(TypeError, match=r"a mapping \(dict\): .*prepare\(accelerator, model, \(\), batch\)"):
        ar.prepare(Accelerator(cpu=True), model, {"input": torch.randn(2, 4)})
