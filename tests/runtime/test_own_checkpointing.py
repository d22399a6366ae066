"""``autoremat.runtime.own_checkpointing``: Hugging Face gradient checkpointing turned on after ``apply``
is said once (the step stays exact); nothing is said without it, outside training, or after ``restore``."""

from __future__ import annotations

import warnings

import pytest
import torch

import autoremat
from autoremat.measure import gradients, gradients_equal
from autoremat.runtime.own_checkpointing import OwnCheckpointingWarning

transformers = pytest.importorskip("transformers")


def _gpt2() -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, use_cache=False)
    model = transformers.GPT2LMHeadModel(cfg).train()
    ids = torch.randint(0, 64, (2, 16))
    return model, {"input_ids": ids, "labels": ids}


def _step(model: torch.nn.Module, kw: dict) -> dict:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)  # its dropout draws the same masks in every step
    model(**kw).loss.backward()
    return gradients(model)


def _said(fn) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        fn()
    return [w for w in got if issubclass(w.category, OwnCheckpointingWarning)]


def test_checkpointing_turned_on_after_apply_is_said_once_and_the_step_stays_exact() -> None:
    model, kw = _gpt2()
    reference = _step(model, kw)
    graph = autoremat.capture(model, (), kw, loss_fn=lambda o: o.loss)
    autoremat.apply(model, autoremat.solve(graph, "min"))
    assert _said(lambda: _step(model, kw)) == []  # patched, no checkpointing of its own
    model.gradient_checkpointing_enable()
    with torch.no_grad():
        assert _said(lambda: model(**kw)) == []  # no training step: nothing recomputes
    said = _said(lambda: gradients_equal(reference, _step(model, kw)) or pytest.fail("gradients differ"))
    assert len(said) == 1 and "gradient_checkpointing_disable()" in str(said[0].message)
    assert _said(lambda: _step(model, kw)) == []  # once per patch
    autoremat.restore(model)
    assert _said(lambda: _step(model, kw)) == []  # unpatched: the user's own choice
    assert not model._forward_pre_hooks


def test_a_model_without_such_flags_gets_no_hook() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    x = torch.randn(4, 8)
    before = dict(model._forward_pre_hooks)
    autoremat.apply(model, autoremat.solve(autoremat.capture(model, (x,)), "min"))
    assert dict(model._forward_pre_hooks) == before
    autoremat.restore(model)
