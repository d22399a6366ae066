"""Hugging Face models for tests, examples and benchmarks, built from a config (random
weights, nothing downloaded). ``transformers`` is an optional dependency (the ``dev`` extra).

Every builder returns the model in train mode with the global RNG left as it was; :func:`example`
returns a model with an example batch and the scalar to backpropagate, for each architecture
family a user is likely to train: an encoder (BERT), a decoder with rotary embeddings and
grouped-query attention (Llama), an encoder-decoder (T5), a vision transformer (ViT), a
convolutional net (ResNet) and a speech model (Wav2Vec2). Dropout is on (p=0.1) in BERT and T5
and at each config's default elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["gpt2", "bert", "llama", "t5", "vit", "resnet", "wav2vec2", "logits_mean", "last_hidden_mean",
           "HFExample", "EXAMPLES", "example"]


def _build(cls_name: str, cfg: Any, seed: int) -> nn.Module:
    import transformers

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return getattr(transformers, cls_name)(cfg).train()


def gpt2(*, n_layer: int = 4, n_embd: int = 64, n_head: int = 4, vocab_size: int = 256, seq: int = 64,
         seed: int = 0) -> nn.Module:
    """A ``GPT2LMHeadModel`` (``use_cache=False``) in train mode; the global RNG is left as it was."""
    import transformers

    cfg = transformers.GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab_size,
                                  n_positions=seq, use_cache=False, bos_token_id=0, eos_token_id=0)
    return _build("GPT2LMHeadModel", cfg, seed)


def bert(*, layers: int = 4, hidden: int = 64, heads: int = 4, vocab_size: int = 256, seq: int = 64,
         dropout: float = 0.1, seed: int = 0) -> nn.Module:
    """A ``BertForMaskedLM`` encoder with dropout ``dropout`` (hidden and attention)."""
    import transformers

    cfg = transformers.BertConfig(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                                  num_attention_heads=heads, intermediate_size=4 * hidden,
                                  max_position_embeddings=seq, hidden_dropout_prob=dropout,
                                  attention_probs_dropout_prob=dropout)
    return _build("BertForMaskedLM", cfg, seed)


def llama(*, layers: int = 4, hidden: int = 64, heads: int = 4, kv_heads: int = 2, vocab_size: int = 256,
          seq: int = 64, seed: int = 0) -> nn.Module:
    """A ``LlamaForCausalLM`` with rotary embeddings and grouped-query attention (``kv_heads`` < ``heads``)."""
    import transformers

    if kv_heads >= heads or heads % kv_heads:
        raise ValueError(f"kv_heads must divide heads and be fewer, got kv_heads={kv_heads}, heads={heads}")
    cfg = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=heads,
                                   num_key_value_heads=kv_heads, max_position_embeddings=seq, use_cache=False,
                                   attn_implementation="sdpa")
    return _build("LlamaForCausalLM", cfg, seed)


def t5(*, layers: int = 2, d_model: int = 64, heads: int = 4, vocab_size: int = 256, dropout: float = 0.1,
       seed: int = 0) -> nn.Module:
    """A ``T5ForConditionalGeneration`` encoder-decoder (``layers`` blocks each side)."""
    import transformers

    cfg = transformers.T5Config(vocab_size=vocab_size, d_model=d_model, d_kv=d_model // heads, d_ff=2 * d_model,
                                num_layers=layers, num_decoder_layers=layers, num_heads=heads,
                                dropout_rate=dropout, use_cache=False, decoder_start_token_id=0, pad_token_id=0)
    return _build("T5ForConditionalGeneration", cfg, seed)


def vit(*, layers: int = 4, hidden: int = 64, heads: int = 4, image: int = 32, patch: int = 4,
        seed: int = 0) -> nn.Module:
    """A ``ViTForImageClassification`` (10 classes) on ``image`` px RGB inputs."""
    import transformers

    cfg = transformers.ViTConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                                 intermediate_size=4 * hidden, image_size=image, patch_size=patch, num_labels=10)
    return _build("ViTForImageClassification", cfg, seed)


def resnet(*, widths: tuple[int, ...] = (16, 32, 64), depths: tuple[int, ...] = (1, 1, 1),
           seed: int = 0) -> nn.Module:
    """A ``ResNetForImageClassification`` (basic blocks, 10 classes)."""
    import transformers

    cfg = transformers.ResNetConfig(embedding_size=16, hidden_sizes=list(widths), depths=list(depths),
                                    layer_type="basic", num_labels=10)
    return _build("ResNetForImageClassification", cfg, seed)


def wav2vec2(*, layers: int = 2, hidden: int = 64, heads: int = 4, seed: int = 0) -> nn.Module:
    """A ``Wav2Vec2Model`` (two small conv feature layers, ``layers`` transformer layers) on raw audio.

    LayerDrop is off: with it on, each training step skips a random subset of layers, so the
    step a capture records is one draw of several different graphs (a plan made for one draw
    mis-predicts the others; the zoo keeps steps deterministic)."""
    import transformers

    cfg = transformers.Wav2Vec2Config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                                      intermediate_size=2 * hidden, conv_dim=(32, 32), conv_stride=(5, 2),
                                      conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                                      num_conv_pos_embedding_groups=4, mask_time_prob=0.0,
                                      do_stable_layer_norm=True, feat_extract_norm="layer", layerdrop=0.0)
    return _build("Wav2Vec2Model", cfg, seed)


def logits_mean(out: Any) -> torch.Tensor:
    """The scalar the tests and benchmarks backpropagate through a model with ``logits``: their mean."""
    return out.logits.float().mean()


def last_hidden_mean(out: Any) -> torch.Tensor:
    """The scalar for a base model without a head: the mean of ``last_hidden_state``."""
    return out.last_hidden_state.float().mean()


@dataclass(frozen=True)
class HFExample:
    """One zoo entry: a model, its example batch (positional and keyword) and its scalar."""

    name: str
    model: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    loss_fn: Callable[[Any], torch.Tensor]


def _ids(batch: int, seq: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _gpt2_ex(batch: int) -> HFExample:
    return HFExample("gpt2", gpt2(), (_ids(batch, 64, 256, 1),), {}, logits_mean)


def _bert_ex(batch: int) -> HFExample:
    ids = _ids(batch, 64, 256, 2)
    return HFExample("bert", bert(), (ids,), {"attention_mask": torch.ones_like(ids)}, logits_mean)


def _llama_ex(batch: int) -> HFExample:
    return HFExample("llama", llama(), (_ids(batch, 64, 256, 3),), {}, logits_mean)


def _t5_ex(batch: int) -> HFExample:
    ids = _ids(batch, 48, 256, 4)
    labels = _ids(batch, 16, 256, 5)
    return HFExample("t5", t5(), (ids,), {"decoder_input_ids": labels}, logits_mean)


def _vit_ex(batch: int) -> HFExample:
    x = torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(6))
    return HFExample("vit", vit(), (x,), {}, logits_mean)


def _resnet_ex(batch: int) -> HFExample:
    x = torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(7))
    # two blocks per stage: with one, the step peak is the stem's backward, which no plan lowers
    return HFExample("resnet", resnet(depths=(2, 2, 2)), (x,), {}, logits_mean)


def _wav2vec2_ex(batch: int) -> HFExample:
    x = torch.randn(batch, 1600, generator=torch.Generator().manual_seed(8))
    return HFExample("wav2vec2", wav2vec2(), (x,), {}, last_hidden_mean)


EXAMPLES: dict[str, Callable[[int], HFExample]] = {
    "gpt2": _gpt2_ex, "bert": _bert_ex, "llama": _llama_ex, "t5": _t5_ex, "vit": _vit_ex,
    "resnet": _resnet_ex, "wav2vec2": _wav2vec2_ex,
}
"""Builders of the zoo's examples by name (each takes the batch size)."""


def example(name: str, *, batch: int = 4) -> HFExample:
    """The zoo example ``name`` (one of :data:`EXAMPLES`) at batch size ``batch``."""
    if name not in EXAMPLES:
        raise ValueError(f"unknown Hugging Face example {name!r}; expected one of {sorted(EXAMPLES)}")
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    return EXAMPLES[name](batch)
