"""Module calls handed a key/value cache (``use_cache=True``, the default of most causal-LM configs)
are kept, never recomputed: a replay would write the cache twice (issue 29's contract: the patched
model behaves as the user's, or refuses and says why)."""

from __future__ import annotations

import importlib
import logging

import pytest
import torch

import autoremat
from autoremat.capture.kv_cache import CacheWriteError, cache_arguments, is_kv_cache
from autoremat.measure import gradients, gradients_equal, run_step

transformers = pytest.importorskip("transformers")
from autoremat.zoo import hf  # noqa: E402  (needs transformers)


def test_recognises_a_transformers_cache_and_nothing_else() -> None:
    cache = transformers.DynamicCache()
    assert is_kv_cache(cache) and not is_kv_cache(None) and not is_kv_cache(torch.zeros(1))

    class Cache:  # a user class of that name is not a transformers cache
        pass

    assert not is_kv_cache(Cache())
    assert cache_arguments((torch.zeros(1), cache), {"past_key_values": None}) == ["args[1]"]
    assert cache_arguments((), {"layer_past": cache, "x": 1}) == ["layer_past"]
    assert cache_arguments(((cache, None),), {"d": {"k": cache}}) == ["args[0]", "d"]
    assert cache_arguments((), {"past_key_values": None, "use_cache": True}) == []


def _llama() -> tuple[torch.nn.Module, tuple, dict]:
    ex = hf.example("llama")
    return ex.model, ex.args, {"use_cache": True}


def _step(model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[dict, int]:
    torch.manual_seed(3)
    out = model(*args, **kwargs)
    hf.logits_mean(out).backward()
    grads = gradients(model)
    model.zero_grad(set_to_none=True)
    return grads, out.past_key_values.get_seq_length()


def test_cache_writing_calls_are_kept_and_training_is_exact(caplog: pytest.LogCaptureFixture,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.import_module("autoremat.capture.kept_said"), "_SAID", set())  # said once per process
    model, args, kwargs = _llama()
    reference, length = _step(model, args, kwargs)
    assert length == args[0].shape[1]
    with caplog.at_level(logging.WARNING, logger="autoremat"):
        graph = autoremat.capture(model, args, kwargs, loss_fn=hf.logits_mean, repeats=1, warmup=0)
    layers = [f"model.layers.{i}" for i in range(model.config.num_hidden_layers)]
    pinned = graph.meta["pinned_by_cache"]
    assert set(layers) <= set(pinned) and pinned["model.layers.0"] == "past_key_values"
    assert "model.layers.0.self_attn" in pinned  # the attention inside is handed the cache too
    assert any("write a key/value cache" in r.getMessage() and "use_cache=False" in r.getMessage()
               for r in caplog.records)
    regions = graph.call_regions()
    assert not set(pinned) & set(regions), "a call handed the cache is a region a plan may recompute"
    with pytest.raises(autoremat.InfeasibleBudgetError, match=r"write a key/value cache.*use_cache=False"):
        autoremat.solve(graph, "10%")
    plan = autoremat.solve(graph, "min")
    assert plan.recompute_segments, "the calls without the cache (MLPs, norms) are still recomputed"
    autoremat.apply(model, plan)
    try:
        grads, length = _step(model, args, kwargs)
    finally:
        autoremat.restore(model)
    assert gradients_equal(reference, grads)
    assert length == args[0].shape[1], "the cache holds the step's keys once"


def test_a_plan_recomputing_a_cache_writer_refuses_at_its_first_forward() -> None:
    model, args, kwargs = _llama()
    graph = autoremat.capture(model, args, {"use_cache": False}, loss_fn=hf.logits_mean, repeats=1, warmup=0)
    assert graph.meta["pinned_by_cache"] == {}
    # chen's least plan recomputes the layers whole (auto's, ~6 s, recomputes them with ops kept:
    # a SelectiveCall, the same ProbedCall.__call__ that refuses)
    plan = autoremat.solve(graph, "min", solver="chen")
    assert {path for path, _ in plan.module_calls.values()} >= {"model.layers.0", "model.layers.1"}
    autoremat.apply(model, plan)
    try:
        run_step(model, args, {"use_cache": False}, hf.logits_mean)  # as planned: fine
        with pytest.raises(CacheWriteError, match=r"model\.layers\.\d.*use_cache=False"):
            run_step(model, args, kwargs, hf.logits_mean)
    finally:
        autoremat.restore(model)


def test_the_cache_line_is_said_once_per_process(caplog: pytest.LogCaptureFixture,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The integrations capture twice (the real step and a meta one): the line came twice."""
    monkeypatch.setattr(importlib.import_module("autoremat.capture.kept_said"), "_SAID", set())
    model, args, kwargs = _llama()
    with caplog.at_level(logging.WARNING, logger="autoremat"):
        for _ in range(2):
            autoremat.capture(model, args, kwargs, loss_fn=hf.logits_mean, repeats=1, warmup=0)
    assert sum("write a key/value cache" in r.getMessage() for r in caplog.records) == 1
