"""The Hugging Face zoo end to end: capture at module level, plan at three budgets, apply;
gradients bit-for-bit those of the unpatched model (dropout on in BERT and T5), measured step
peak within 10 % of the prediction (CPU storage counter)."""

from __future__ import annotations

import pytest

import autoremat

pytest.importorskip("transformers")
from _hf_exact import trains_exactly  # noqa: E402
from autoremat.zoo import hf  # noqa: E402  (needs transformers)

FAST = ["bert", "llama", "t5", "vit", "resnet"]
SLOW = ["gpt2", "wav2vec2"]


def _end_to_end(name: str) -> None:
    ex = hf.example(name)
    graph = trains_exactly(name, ex.model, ex.args, ex.kwargs, ex.loss_fn, fractions=(0.8, 0.5))
    assert graph.meta["mode"] == "module"


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
