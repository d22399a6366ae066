"""autoremat.cache: the plan cache's key, entries, and its tolerance of bad files."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from torch import nn

from autoremat.cache import PlanCache, code_fingerprint, plan_key


class Net(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, width), nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class Rewired(Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # the same modules, another computation
        return self.b(torch.tanh(self.a(x)))


def test_key_depends_on_model_inputs_settings_and_code() -> None:
    x = torch.randn(2, 4)
    base = plan_key(Net(), (x,), {}, {"budget": "50%"})
    assert base == plan_key(Net(), (x,), {}, {"budget": "50%"})  # other weights, same shapes: same key
    assert base != plan_key(Net(16), (x,), {}, {"budget": "50%"})  # other shapes
    assert base != plan_key(Net(), (torch.randn(3, 4),), {}, {"budget": "50%"})  # other batch
    assert base != plan_key(Net(), (x.double(),), {}, {"budget": "50%"})  # other dtype
    assert base != plan_key(Net(), (x,), {}, {"budget": "60%"})  # other settings
    assert base != plan_key(Rewired(), (x,), {}, {"budget": "50%"})  # other forward
    frozen = Net()
    frozen.a.requires_grad_(False)  # a fine-tuning stage: its step keeps less for backward
    assert base != plan_key(frozen, (x,), {}, {"budget": "50%"})
    assert code_fingerprint(Net()) != code_fingerprint(Rewired())


def test_store_and_load(tmp_path: Path) -> None:
    cache = PlanCache(tmp_path / "cache")
    assert cache.load("k1") is None
    path = cache.store("k1", {"plan": {"segments": []}, "batch_size": 4})
    assert path.exists() and path.parent == tmp_path / "cache"
    assert cache.load("k1") == {"plan": {"segments": []}, "batch_size": 4}
    assert not list((tmp_path / "cache").glob(".plan-*"))  # no temporary file left behind
    cache.forget("k1")
    assert cache.load("k1") is None


def test_bad_entries_are_ignored_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cache = PlanCache(tmp_path)
    cache.path("k").write_text("{ truncated")
    with caplog.at_level(logging.WARNING):
        assert cache.load("k") is None
    assert "unreadable plan cache entry" in caplog.text
    cache.path("k").write_text(json.dumps({"format": "autoremat.cache", "version": 1, "key": "other", "entry": {}}))
    assert cache.load("k") is None


def test_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AUTOREMAT_CACHE_DIR", raising=False)
    assert PlanCache.from_setting(None) is None
    monkeypatch.setenv("AUTOREMAT_CACHE_DIR", str(tmp_path))
    assert PlanCache.from_setting(None).directory == tmp_path  # type: ignore[union-attr]
    assert PlanCache.from_setting(str(tmp_path / "x")).directory == tmp_path / "x"  # type: ignore[union-attr]
    afile = tmp_path / "file"
    afile.write_text("")
    with pytest.raises(ValueError, match="is a file; give a directory"):
        PlanCache.from_setting(str(afile))
