"""The README works as written: its Python blocks run, every command line in its ``bash`` blocks
is run here (at reduced size: fewer steps or timing pairs, a short time limit) or by the named
test that runs it, and its YAML fragment is what ``configs/cnn.yaml`` holds.

A command added to the README without a runner here fails :func:`test_every_readme_command_is_run`."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import autoremat

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def _commands() -> list[str]:
    """Every command line of the README's bash blocks (comments stripped)."""
    lines = [line.split("  #")[0].strip() for block in _blocks("bash") for line in block.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def _cli(argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from autoremat.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(argv) == 0, argv


def _reduced(line: str, extra: list[str]) -> Callable[[Path, pytest.MonkeyPatch], None]:
    """The ``autoremat`` command ``line`` with ``extra`` arguments that make it smaller."""
    argv = line.split()[1:] + extra
    return lambda tmp, mp: _cli(argv, tmp, mp)


def _plan_then_demo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _cli(["plan", "--model", "resnet50", "--budget", "min", "--out", "plan.json"], tmp_path, monkeypatch)
    _cli(["demo", "--plan", "plan.json", "--steps", "1", "--timing-pairs", "1"], tmp_path, monkeypatch)


def _launch(env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``accelerate launch examples/accelerate_unet.py`` as a user runs it (one training step)."""
    accelerate = Path(sys.executable).with_name("accelerate")
    full = {**os.environ, **env, "PYTHONPATH": str(ROOT / "src")}
    for key in ("AUTOREMAT_CACHE_DIR", "AUTOREMAT_TIMES", "AUTOREMAT_PLAN"):
        full.pop(key, None)
    done = subprocess.run([str(accelerate), "launch", "--num_processes", "1", "--cpu",
                           "examples/accelerate_unet.py", "--steps", "1"], cwd=ROOT, env=full,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step 0: loss" in done.stdout
    if env.get("AUTOREMAT_ENABLED") == "0":
        assert "disabled (AUTOREMAT_ENABLED=0)" in done.stderr and "autoremat (Accelerate)" not in done.stdout
    else:
        assert "autoremat (Accelerate)" in done.stdout and "reachable step peak" in done.stdout
    if env.get("AUTOREMAT_BUDGET") == "50%":  # below chen's least: planned at the least, and said so
        assert "planned at the least (on_infeasible='min')" in " ".join(done.stderr.split())


def _example(env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same example in this process (Accelerate's launcher is tested once, above)."""
    import importlib.util

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(ROOT)
    spec = importlib.util.spec_from_file_location("accelerate_unet", ROOT / "examples" / "accelerate_unet.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    assert len(module.main(steps=1)) == 1


def _covered(test_id: str) -> Callable[[Path, pytest.MonkeyPatch], None]:
    """A command another test runs; the test must exist (so the mapping cannot go stale)."""
    path, _, name = test_id.partition("::")
    assert f"def {name.split('[')[0]}(" in (ROOT / path).read_text(), test_id
    return lambda tmp, mp: None


def _ci_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The test command is what ``.ci/run`` runs on a fresh clone (this suite)."""
    assert "pytest -q -n 2" in (ROOT / ".ci" / "run").read_text()


INSTALL = 'python3 -m venv .venv && .venv/bin/pip install -q -c constraints.txt -e ".[dev]" && '
RUNNERS: dict[str, Callable[[Path, pytest.MonkeyPatch], None]] = {
    INSTALL + ".venv/bin/autoremat demo": _covered(  # the same command with two steps, its output checked
        "tests/test_cli.py::test_demo_reports_equal_gradients"),
    INSTALL + ".venv/bin/python -m pytest -q -n 2": _ci_runs,  # this suite
    "autoremat demo --model densenet121 --budget 40%": _reduced(
        "autoremat demo --model densenet121 --budget 40%", ["--steps", "1", "--timing-pairs", "1"]),
    "autoremat profile --model unet": _reduced("autoremat profile --model unet", []),
    "autoremat plan --model pspnet --budget 2MiB --out plan.json": _reduced(
        "autoremat plan --model pspnet --budget 2MiB --out plan.json", []),
    "autoremat plan --model resnet50 --budget min --out plan.json && autoremat demo --plan plan.json": _plan_then_demo,
    "autoremat plan --model resnet50 --budget 50% --out plan.json --plot plan.png": _covered(
        "tests/test_cli.py::test_plan_writes_json_and_png"),  # the same argv, and its files checked
    "autoremat plan --model unet --gap": _reduced("autoremat plan --model unet --gap", ["--gap-time-limit", "2"]),
    "python -m autoremat.integrations.lightning_cli fit --config configs/cnn.yaml": _covered(
        "tests/integrations/test_lightning_cli.py::test_config_runs[cnn.yaml]"),
    "AUTOREMAT_BUDGET=50% AUTOREMAT_SOLVER=chen accelerate launch examples/accelerate_unet.py": functools.partial(
        _launch, {"AUTOREMAT_BUDGET": "50%", "AUTOREMAT_SOLVER": "chen"}),
    "AUTOREMAT_CONFIG=configs/autoremat.yaml accelerate launch examples/accelerate_unet.py": functools.partial(
        _example, {"AUTOREMAT_CONFIG": "configs/autoremat.yaml"}),
    "AUTOREMAT_ENABLED=0 accelerate launch examples/accelerate_unet.py": functools.partial(
        _example, {"AUTOREMAT_ENABLED": "0"}),
}


def test_every_readme_command_is_run() -> None:
    assert set(_commands()) == set(RUNNERS), set(_commands()) ^ set(RUNNERS)


SLOW = {"autoremat demo --model densenet121 --budget 40%"}
"""Commands run only with ``-m slow``: another zoo model through the same demo path."""


@pytest.mark.parametrize("command", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c
                                     for c in sorted(RUNNERS)])
def test_readme_command(command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("AUTOREMAT_CACHE_DIR", "AUTOREMAT_BUDGET", "AUTOREMAT_SOLVER", "AUTOREMAT_CONFIG",
                "AUTOREMAT_ENABLED", "AUTOREMAT_PLAN", "AUTOREMAT_TIMES"):
        monkeypatch.delenv(key, raising=False)
    RUNNERS[command](tmp_path, monkeypatch)


def test_first_python_block_runs(capsys: pytest.CaptureFixture[str]) -> None:
    code = _blocks("python")[0]
    assert "autoremat.capture" in code and "autoremat.apply" in code
    exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
    out = capsys.readouterr().out.split("\n")
    assert "recomputed" in out[0]  # plan.describe()
    assert int(out[1]) > 0  # min_budget in bytes


def test_lightning_block_runs_on_an_ordinary_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's Lightning lines on a LightningModule without a ``batch_size`` attribute
    (the Trainer limited to one step, without logs and checkpoints in the working directory)."""
    import lightning.pytorch as pl
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1),
                                       nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            x, y = batch
            return nn.functional.cross_entropy(self.model(x), y)

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(TensorDataset(torch.randn(16, 3, 8, 8), torch.randint(0, 10, (16,))), batch_size=4)

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(pl, "Trainer", functools.partial(
        pl.Trainer, max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False))
    namespace = {"model": Module()}
    exec(compile(_blocks("python")[1], "README.md", "exec"), namespace)
    trainer = namespace["trainer"]
    assert trainer.global_step == 1
    cb = next(c for c in trainer.callbacks if isinstance(c, autoremat.AutoRemat))
    assert cb.plan is not None and cb.summary["batch_size_not_raised"].startswith("no `batch_size`")


def test_accelerate_block_runs() -> None:
    from torch.utils.data import DataLoader, TensorDataset

    model, (x,) = autoremat.zoo.build("mlp", size="small")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    namespace = {"model": model, "example_x": x, "optimizer": optimizer,
                 "loader": DataLoader(TensorDataset(torch.randn(8, *x.shape[1:])), batch_size=4)}
    exec(compile(_blocks("python")[2], "README.md", "exec"), namespace)
    assert autoremat.is_patched(namespace["model"])
    autoremat.restore(namespace["model"])


def test_yaml_fragment_is_what_the_config_holds() -> None:
    import yaml

    fragment = yaml.safe_load(_blocks("yaml")[0])["trainer"]["callbacks"][0]
    config = yaml.safe_load((ROOT / "configs" / "cnn.yaml").read_text())["trainer"]["callbacks"][0]
    assert fragment["class_path"] == config["class_path"]
    assert fragment["init_args"].items() <= config["init_args"].items()


def test_cli_commands_in_the_readme_exist() -> None:
    from autoremat.cli import _parser

    parser = _parser()
    subcommands = set(parser._subparsers._group_actions[0].choices)  # type: ignore[union-attr]
    shown = set(re.findall(r"`autoremat (\w+)", README)) | set(re.findall(r"\.venv/bin/autoremat (\w+)", README))
    assert shown and shown <= subcommands, shown - subcommands


def _output_blocks() -> list[list[str]]:
    """The non-empty lines of each fenced block without a language (pasted program output)."""
    blocks: list[list[str]] = []
    lang = None
    for line in README.splitlines():
        if line.startswith("```"):
            if lang is None:
                lang = line[3:].strip()
                blocks.append([])
            else:
                if lang:
                    blocks.pop()
                lang = None
        elif lang is not None and line.strip():
            blocks[-1].append(line.strip())
    return blocks


def test_output_blocks_hold_real_output() -> None:
    """Every block of pasted output holds output, not a placeholder line such as ``GPT2_SAMPLE``
    left for a run nobody pasted."""
    blocks = _output_blocks()
    assert blocks
    for lines in blocks:
        assert len(lines) > 1, lines
        assert not any(re.fullmatch(r"[A-Z][A-Z0-9_]{3,}", line) for line in lines), lines
