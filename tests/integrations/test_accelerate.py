"""autoremat.integrations.accelerate: one call, environment variables, YAML section."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator

import autoremat
import autoremat.integrations.accelerate as ar
from autoremat.measure import gradients, gradients_equal, run_step


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("AUTOREMAT_BUDGET", "AUTOREMAT_SOLVER", "AUTOREMAT_ENABLED", "AUTOREMAT_CONFIG",
                "AUTOREMAT_PROFILE_STEPS"):
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
])
def test_bad_environment_rejected(monkeypatch: pytest.MonkeyPatch, var: str, value: str, match: str) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=match):
        ar.AutoRematConfig()


def test_byte_budget_subtracts_optimizer_state() -> None:
    model, x = _model()
    opt = torch.optim.AdamW(model.parameters())
    params = sum(p.numel() * 4 for p in model.parameters())
    from autoremat.integrations.lightning import optimizer_state_bytes

    assert optimizer_state_bytes(opt) == 2 * params  # estimated before the first step
    with pytest.raises(ValueError, match="resident"):
        ar.prepare(Accelerator(cpu=True), model, (x,), budget=params * 2, optimizer=opt)
    assert not autoremat.is_patched(model)
