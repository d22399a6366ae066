"""The YAML configs in configs/ run as they are through LightningCLI."""

from __future__ import annotations

from pathlib import Path

import pytest

import autoremat
from autoremat.integrations.lightning_cli import main

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("name", ["cnn.yaml", "gpt2.yaml"])
def test_config_runs(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if name == "gpt2.yaml":
        pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    small = ["--model.init_args.n_layer=2", "--model.init_args.seq=64"] if name == "gpt2.yaml" else []
    cli = main(["fit", "--config", str(CONFIGS / name), "--trainer.max_steps=2",
                "--trainer.enable_progress_bar=false", *small])
    cbs = [c for c in cli.trainer.callbacks if isinstance(c, autoremat.AutoRemat)]
    assert len(cbs) == 1
    cb = cbs[0]
    assert cb.plan is not None and cb.plan.recompute_segments
    assert cb.summary["measured_peak_bytes"] <= cb.step_budget_bytes
    assert cli.trainer.global_step == 2
    assert not (tmp_path / "config.yaml").exists() and not list(tmp_path.iterdir())  # nothing left behind
