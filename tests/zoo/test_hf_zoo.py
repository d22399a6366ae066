"""The Hugging Face zoo end to end: capture at module level, plan at three budgets, apply;
gradients bit-for-bit those of the unpatched model (dropout on in BERT and T5), measured step
peak within 10 % of the prediction (CPU storage counter)."""

from __future__ import annotations

import pytest
import torch

import autoremat
from autoremat.measure import gradients, gradients_equal, measure, run_step
from autoremat.cost import no_recompute_plan, simulate

pytest.importorskip("transformers")
from autoremat.zoo import hf  # noqa: E402  (needs transformers)

TOLERANCE = 0.10
FAST = ["bert", "llama", "t5", "vit", "resnet"]
SLOW = ["gpt2", "wav2vec2"]


def _grads(ex: hf.HFExample) -> dict:
    torch.manual_seed(11)  # same dropout masks in every run
    run_step(ex.model, ex.args, ex.kwargs, ex.loss_fn)
    return gradients(ex.model)


def _plans(graph: autoremat.Graph) -> list[autoremat.Plan]:
    """Plans at 80 % and 50 % of the predicted peak and at the least feasible budget
    (a budget below the least one gives the least plan instead), without repeats."""
    plans: list[autoremat.Plan] = []
    vanilla = simulate(graph, no_recompute_plan(graph)).peak_bytes
    for budget in (int(0.8 * vanilla), int(0.5 * vanilla), 1):
        try:
            plan = autoremat.solve(graph, budget)
        except autoremat.InfeasibleBudgetError as err:
            assert err.min_budget_bytes is not None and err.min_budget_bytes > budget
            plan = autoremat.solve(graph, err.min_budget_bytes)
        if all(p.segments != plan.segments for p in plans):
            plans.append(plan)
    return plans


def _end_to_end(name: str) -> None:
    ex = hf.example(name)
    graph = autoremat.capture(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, repeats=1, warmup=0)
    assert graph.meta["mode"] == "module"
    vanilla = measure(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, steps=1, warmup=0).peak_bytes
    predicted = simulate(graph, no_recompute_plan(graph)).peak_bytes
    assert abs(predicted - vanilla) <= TOLERANCE * vanilla, (name, predicted, vanilla)
    reference = _grads(ex)
    plans = _plans(graph)
    assert any(p.recompute_segments for p in plans), f"{name}: no plan recomputes anything"
    for plan in plans:
        autoremat.apply(ex.model, plan)
        try:
            peak = measure(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, steps=1, warmup=0).peak_bytes
            grads = _grads(ex)
        finally:
            autoremat.restore(ex.model)
        assert gradients_equal(reference, grads), f"{name}: gradients changed under {plan.segments}"
        assert abs(plan.predicted_peak_bytes - peak) <= TOLERANCE * peak, (name, plan.predicted_peak_bytes, peak)
        assert peak <= vanilla


@pytest.mark.parametrize("name", FAST)
def test_zoo_end_to_end(name: str) -> None:
    _end_to_end(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW)
def test_zoo_end_to_end_slow(name: str) -> None:
    _end_to_end(name)


def test_examples_cover_the_families() -> None:
    assert set(hf.EXAMPLES) == set(FAST + SLOW)
    llama = hf.example("llama").model.config
    assert llama.num_key_value_heads < llama.num_attention_heads
    assert hf.example("bert").model.config.hidden_dropout_prob > 0
    assert hf.example("t5").model.config.is_encoder_decoder


def test_example_rejects_unknown_names_and_batches() -> None:
    with pytest.raises(ValueError, match="expected one of"):
        hf.example("gpt5")
    with pytest.raises(ValueError, match="batch must be"):
        hf.example("bert", batch=0)
    with pytest.raises(ValueError, match="kv_heads"):
        hf.llama(heads=4, kv_heads=3)


def test_a_model_with_hf_gradient_checkpointing_enabled_is_refused_with_the_fix() -> None:
    """Its captured step would already recompute (and a capture of DistilBERT's crashed on backward
    ops it could not place): refused up front, naming gradient_checkpointing_disable()."""
    ex = hf.example("bert")
    ex.model.gradient_checkpointing_enable()
    with pytest.raises(ValueError, match=r"gradient checkpointing enabled .*gradient_checkpointing_disable\(\)"):
        autoremat.capture(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, repeats=1, warmup=0)
    ex.model.gradient_checkpointing_disable()
    graph = autoremat.capture(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, repeats=1, warmup=0)
    assert len(graph) > 0
