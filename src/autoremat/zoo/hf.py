"""Hugging Face models for tests, examples and benchmarks, built from a config (random
weights, nothing downloaded). ``transformers`` is an optional dependency (the ``dev`` extra)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["gpt2", "logits_mean"]


def gpt2(*, n_layer: int = 4, n_embd: int = 64, n_head: int = 4, vocab_size: int = 256, seq: int = 64,
         seed: int = 0) -> nn.Module:
    """A ``GPT2LMHeadModel`` (``use_cache=False``) in train mode; the global RNG is left as it was."""
    import transformers

    cfg = transformers.GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab_size,
                                  n_positions=seq, use_cache=False, bos_token_id=0, eos_token_id=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return transformers.GPT2LMHeadModel(cfg).train()


def logits_mean(out: Any) -> torch.Tensor:
    """The scalar the tests and benchmarks backpropagate through a causal LM: mean of the logits."""
    return out.logits.float().mean()
