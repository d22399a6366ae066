"""peft LoRA adapters on small transformers configs (built in place, nothing downloaded), as a new user
trains them: ``get_peft_model`` on a Llama and a GPT-2 with dropout on (LoRA dropout too), frozen
base weights; capture + solve + apply trains the adapters bit for bit at the predicted peak."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import autoremat
from autoremat.measure import gradients, gradients_equal, measure


def _lora(arch: str, batch: int = 4, seq: int = 32) -> tuple[nn.Module, dict, Any]:
    pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    import transformers

    torch.manual_seed(0)
    if arch == "llama":
        base = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.1, use_cache=False))
        targets, fan_in_fan_out = ["q_proj", "v_proj"], False
    else:
        base = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=64, use_cache=False))  # dropouts 0.1
        targets, fan_in_fan_out = ["c_attn"], True
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=targets,
                                                      fan_in_fan_out=fan_in_fan_out)).train()
    ids = torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}, lambda out: out.loss


def _grads(model: nn.Module, kwargs: dict, loss_fn: Any) -> dict:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(5)  # dropout masks
    loss_fn(model(**kwargs)).backward()
    return gradients(model)


@pytest.mark.parametrize("arch,amp", [("llama", False), ("gpt2", False), ("llama", True), ("gpt2", True)])
def test_lora_least_plan_trains_the_adapters_bit_for_bit(arch: str, amp: bool) -> None:
    """Under bf16 autocast the replays of the least plan held 8.8 % (GPT-2) and 3.8 % (Llama) less
    than predicted: lingering bytes a caller's frame held in forward (the embeddings, a block's input
    that the replayed attention keeps as its region input anyway) were counted in the replays too."""
    model, kwargs, loss_fn = _lora(arch)
    assert sum(p.requires_grad for p in model.parameters()) < len(list(model.parameters()))  # base frozen
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        g = autoremat.capture(model, (), kwargs, loss_fn=loss_fn, times="flops")
        unpatched = measure(model, (), kwargs, loss_fn=loss_fn, steps=1, warmup=1).peak_bytes
        assert abs(autoremat.simulate(g, autoremat.solve(g, "100%")).peak_bytes - unpatched) <= 0.002 * unpatched
        reference = _grads(model, kwargs, loss_fn)
        plan = autoremat.solve(g, "min")
        autoremat.apply(model, plan)
        try:
            assert gradients_equal(reference, _grads(model, kwargs, loss_fn))
            peak = measure(model, (), kwargs, loss_fn=loss_fn, steps=1, warmup=1).peak_bytes
        finally:
            autoremat.restore(model)
    assert peak <= 0.55 * unpatched, (peak, unpatched)
    assert abs(plan.predicted_peak_bytes - peak) <= 0.01 * peak, (plan.predicted_peak_bytes, peak)
