"""The examples in examples/ run on the CPU as they are."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import autoremat

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load(name: str):  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_accelerate_unet(monkeypatch: pytest.MonkeyPatch, recwarn: pytest.WarningsRecorder) -> None:
    monkeypatch.delenv("AUTOREMAT_BUDGET", raising=False)
    losses = _load("accelerate_unet").main(steps=2)
    assert len(losses) == 2
    # the example is what users copy: it must not teach a pattern PyTorch warns about
    assert not [w for w in recwarn if "to a scalar" in str(w.message)], [str(w.message) for w in recwarn]


@pytest.mark.parametrize("name", ["lightning_cnn", "lightning_gpt2"])
def test_lightning_examples(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if name == "lightning_gpt2":
        pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    small = {"max_batch_size": 8} if name == "lightning_gpt2" else {}  # fewer batch sizes to try: one above 4
    cb = _load(name).main(max_steps=2, samples=64, **small)  # reduced size: fewer steps and samples
    assert isinstance(cb, autoremat.AutoRemat) and cb.plan is not None
    assert cb.summary["measured_peak_bytes"] <= cb.step_budget_bytes
    if name == "lightning_gpt2":
        assert cb.batch_size > cb.original_batch_size
