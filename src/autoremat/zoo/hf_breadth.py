"""More Hugging Face architectures, as a user would train them, beside :mod:`autoremat.zoo.hf`'s
six families: default configs (the causal LMs keep ``use_cache=True``), small sizes, nothing
downloaded. Each entry of :data:`CASES` builds ``(model, args, kwargs, loss_fn)``; the tests
(``tests/zoo/test_hf_breadth.py``) and ``benchmarks/hf_breadth.py`` share them. ``transformers``
is imported when an entry is built.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["CASES", "build"]

Case = tuple[torch.nn.Module, tuple[Any, ...], dict[str, Any], Callable[[Any], torch.Tensor]]


class _Lazy:
    """``transformers`` attribute access at build time (it is an optional dependency)."""

    def __getattr__(self, name: str) -> Any:
        import transformers

        return getattr(transformers, name)


T = _Lazy()
V = 256
def _ids(batch: int, seq: int, seed: int, low: int = 0) -> torch.Tensor:
    return torch.randint(low, V, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _lm(out: Any) -> torch.Tensor:
    return out.logits.float().mean()


def _loss(out: Any) -> torch.Tensor:
    return out.loss


def _audio(out: Any) -> torch.Tensor:
    return out.audio_values.square().mean()


def _decoder(cls: str, cfg: str, **kw: Any) -> Callable[[], Case]:
    def make() -> Case:
        config = getattr(T, cfg)(vocab_size=V, **kw)
        return getattr(T, cls)(config), (_ids(4, 64, 1),), {}, _lm
    return make


def _series(batch: int = 2, past: int = 19, future: int = 8) -> dict[str, torch.Tensor]:
    """A time-series batch (the transformers forecasting models): past values with their lags,
    time features and observed mask, and the future to predict."""
    gen = torch.Generator().manual_seed(7)
    return {"past_values": torch.randn(batch, past, generator=gen),
            "past_time_features": torch.randn(batch, past, 1, generator=gen), "past_observed_mask": torch.ones(batch, past), "future_values": torch.randn(batch, future, generator=gen),
            "future_time_features": torch.randn(batch, future, 1, generator=gen)}


def _image(batch: int, size: int) -> torch.Tensor:
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(6))


LLAMA_LIKE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2)
CASES: dict[str, Callable[[], Case]] = {
    "qwen2": _decoder("Qwen2ForCausalLM", "Qwen2Config", **LLAMA_LIKE),
    "mixtral": _decoder("MixtralForCausalLM", "MixtralConfig", **LLAMA_LIKE, num_local_experts=4,
                        num_experts_per_tok=2),
    "bloom": _decoder("BloomForCausalLM", "BloomConfig", hidden_size=64, n_layer=3, n_head=4),
    "mistral": _decoder("MistralForCausalLM", "MistralConfig", **LLAMA_LIKE, sliding_window=16),
    "gemma": _decoder("GemmaForCausalLM", "GemmaConfig", **{**LLAMA_LIKE, "num_key_value_heads": 1}, head_dim=16),
    "phi3": _decoder("Phi3ForCausalLM", "Phi3Config", **LLAMA_LIKE, pad_token_id=0),
    "gpt_neox": _decoder("GPTNeoXForCausalLM", "GPTNeoXConfig", hidden_size=64, intermediate_size=128,
                         num_hidden_layers=3, num_attention_heads=4),
    "falcon": _decoder("FalconForCausalLM", "FalconConfig", hidden_size=64, num_hidden_layers=3,
                       num_attention_heads=4),
    "gptj": _decoder("GPTJForCausalLM", "GPTJConfig", n_embd=64, n_layer=3, n_head=4, rotary_dim=8, n_positions=128,
                     bos_token_id=0, eos_token_id=0),
    "gpt2_labels": lambda: (T.GPT2LMHeadModel(T.GPT2Config(vocab_size=V, n_embd=64, n_layer=3, n_head=4,
                                                           n_positions=128, bos_token_id=0, eos_token_id=0)),
                            (_ids(4, 64, 1),), {"labels": _ids(4, 64, 1)}, _loss),
    "distilbert": lambda: (T.DistilBertForMaskedLM(T.DistilBertConfig(vocab_size=V, dim=64, hidden_dim=128,
                                                                      n_layers=3, n_heads=4)),
                           (_ids(4, 64, 2),), {}, _lm),
    "albert": lambda: (T.AlbertForMaskedLM(T.AlbertConfig(vocab_size=V, embedding_size=32, hidden_size=64,
                                                          intermediate_size=128, num_hidden_layers=4,
                                                          num_attention_heads=4)), (_ids(4, 64, 2),), {}, _lm),
    "roberta": lambda: (T.RobertaForMaskedLM(T.RobertaConfig(vocab_size=V, hidden_size=64, intermediate_size=128,
                                                             num_hidden_layers=3, num_attention_heads=4)),
                        (_ids(4, 64, 2, low=3),), {}, _lm),
    "deberta_v2": lambda: (T.DebertaV2ForMaskedLM(T.DebertaV2Config(
        vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        relative_attention=True, position_buckets=16, pos_att_type=["p2c", "c2p"])), (_ids(4, 64, 2),), {}, _lm),
    "bart": lambda: (T.BartForConditionalGeneration(T.BartConfig(
        vocab_size=V, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=128)),
        (_ids(4, 48, 4),), {"decoder_input_ids": _ids(4, 16, 5)}, _lm),
    "whisper": lambda: (T.WhisperForConditionalGeneration(T.WhisperConfig(
        vocab_size=V, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=16,
        max_source_positions=32, max_target_positions=32, pad_token_id=0, bos_token_id=0, eos_token_id=0,
        decoder_start_token_id=0)),
        (torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(3)),), {"decoder_input_ids": _ids(2, 16, 5)},
        _lm),
    "swin": lambda: (T.SwinForImageClassification(T.SwinConfig(image_size=32, patch_size=2, embed_dim=16,
                                                               depths=[2, 2], num_heads=[2, 4], window_size=4)),
                     (_image(4, 32),), {}, _lm),
    "convnext": lambda: (T.ConvNextForImageClassification(T.ConvNextConfig(hidden_sizes=[16, 32, 64, 64],
                                                                           depths=[1, 1, 2, 1])),
                         (_image(4, 64),), {}, _lm),
    "clip": lambda: (T.CLIPModel(T.CLIPConfig(
        text_config=dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, bos_token_id=0, eos_token_id=2, pad_token_id=1),
        vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           image_size=32, patch_size=8), projection_dim=32)),
        (), {"input_ids": _ids(4, 16, 1), "pixel_values": _image(4, 32), "return_loss": True}, _loss),
    "segformer": lambda: (T.SegformerForSemanticSegmentation(T.SegformerConfig(
        num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32], num_attention_heads=[1, 2],
        decoder_hidden_size=32, num_labels=4, patch_sizes=[7, 3], strides=[4, 2])), (_image(2, 64),), {}, _lm),
    "beit": lambda: (T.BeitForImageClassification(T.BeitConfig(
        image_size=32, patch_size=4, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        use_relative_position_bias=True, use_mean_pooling=True, drop_path_rate=0.1)), (_image(2, 32),), {}, _lm),
    "swinv2": lambda: (T.Swinv2ForImageClassification(T.Swinv2Config(
        image_size=32, patch_size=2, embed_dim=16, depths=[1, 1], num_heads=[2, 4], window_size=4, drop_path_rate=0.1)),
        (_image(2, 32),), {}, _lm),
    "perceiver": lambda: (T.PerceiverForMaskedLM(T.PerceiverConfig(
        num_latents=16, d_latents=64, d_model=64, num_blocks=1, num_self_attends_per_block=2,
        num_self_attention_heads=4, num_cross_attention_heads=4, vocab_size=V, max_position_embeddings=32, qk_channels=64, v_channels=64)),
        (), {"inputs": _ids(2, 32, 1), "labels": _ids(2, 32, 2)}, _loss),
    "t5": lambda: (T.T5ForConditionalGeneration(T.T5Config(
        vocab_size=V, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
        decoder_start_token_id=0, pad_token_id=0)), (), {"input_ids": _ids(2, 32, 1), "labels": _ids(2, 16, 2)}, _loss),
    "autoformer": lambda: (T.AutoformerForPrediction(T.AutoformerConfig(
        prediction_length=8, context_length=16, lags_sequence=[1, 2, 3], num_time_features=1, d_model=32,
        encoder_layers=2, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
        decoder_ffn_dim=32, encoder_layerdrop=0.0, decoder_layerdrop=0.0)), (), _series(), _loss),  # as HuBERT's
    "hubert": lambda: (T.HubertForCTC(T.HubertConfig(
        vocab_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        conv_dim=(32, 32, 32), conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4, mask_time_prob=0.0, ctc_loss_reduction="mean", pad_token_id=0,
        layerdrop=0.0)),  # with LayerDrop a measured step may skip layers: tests/capture/test_layer_drop.py
        (), {"input_values": torch.randn(2, 4000, generator=torch.Generator().manual_seed(6)),
             "labels": torch.randint(1, 32, (2, 20), generator=torch.Generator().manual_seed(3))}, _loss),
    "encodec": lambda: (T.EncodecModel(T.EncodecConfig(
        num_filters=8, hidden_size=32, upsampling_ratios=[4, 2], codebook_size=64, num_lstm_layers=1,
        target_bandwidths=[12.0], sampling_rate=8000, audio_channels=1, codebook_dim=32)),
        (), {"input_values": torch.randn(2, 1, 800, generator=torch.Generator().manual_seed(5))},
        _audio),
    "longformer": lambda: (T.LongformerForMaskedLM(T.LongformerConfig(
        vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        attention_window=8, max_position_embeddings=80)), (), {"input_ids": _ids(2, 32, 1), "labels": _ids(2, 32, 1)},
        _loss),
    "led": lambda: (T.LEDForConditionalGeneration(T.LEDConfig(
        vocab_size=V, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, attention_window=8,
        max_encoder_position_embeddings=64, max_decoder_position_embeddings=64)), (),
        {"input_ids": _ids(2, 32, 1), "labels": _ids(2, 16, 2)}, _loss),
    "longt5": lambda: (T.LongT5ForConditionalGeneration(T.LongT5Config(
        vocab_size=V, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
        local_radius=4, global_block_size=4, encoder_attention_type="transient-global", decoder_start_token_id=0,
        pad_token_id=0)), (), {"input_ids": _ids(2, 32, 1), "labels": _ids(2, 16, 2)}, _loss),
    "mamba": lambda: (T.MambaForCausalLM(T.MambaConfig(vocab_size=V, hidden_size=64, num_hidden_layers=3, state_size=8,
                                                       use_cache=False)), (_ids(2, 32, 1),), {}, _lm),
    "qwen2_moe": _decoder("Qwen2MoeForCausalLM", "Qwen2MoeConfig", **LLAMA_LIKE, num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=32, shared_expert_intermediate_size=64),
    "modernbert": lambda: (T.ModernBertForMaskedLM(T.ModernBertConfig(
        vocab_size=V, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=128, pad_token_id=0,
        local_attention=16)), (_ids(2, 32, 1, low=1),), {}, _lm),
    "funnel": lambda: (T.FunnelForMaskedLM(T.FunnelConfig(vocab_size=V, d_model=64, n_head=4, d_head=16, d_inner=128,
                                                           block_sizes=[1, 1, 1])), (_ids(2, 32, 1),), {}, _lm),
    "granite": _decoder("GraniteForCausalLM", "GraniteConfig", **LLAMA_LIKE),
    "olmoe": _decoder("OlmoeForCausalLM", "OlmoeConfig", **LLAMA_LIKE, num_experts=4, num_experts_per_tok=2),
    "jamba": lambda: (T.JambaForCausalLM(T.JambaConfig(
        vocab_size=V, **LLAMA_LIKE, num_experts=2, num_experts_per_tok=1, attn_layer_period=2, attn_layer_offset=1,
        expert_layer_period=2, expert_layer_offset=1, mamba_d_state=8, mamba_dt_rank=8, mamba_expand=2,
        use_mamba_kernels=False)), (_ids(2, 32, 1),), {}, _lm),
    "rwkv": lambda: (T.RwkvForCausalLM(T.RwkvConfig(vocab_size=V, hidden_size=64, num_hidden_layers=3,
                                                     attention_hidden_size=64, intermediate_size=128, context_length=64,
                                                     use_cache=False)), (_ids(2, 32, 1),), {}, _lm),
    "electra": lambda: (T.ElectraForMaskedLM(T.ElectraConfig(
        vocab_size=V, embedding_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4)), (_ids(4, 64, 2),), {}, _lm),
    "mpnet": lambda: (T.MPNetForMaskedLM(T.MPNetConfig(vocab_size=V, hidden_size=64, intermediate_size=128,
                                                       num_hidden_layers=3, num_attention_heads=4)),
                      (_ids(4, 64, 2, low=3),), {}, _lm),
    "videomae": lambda: (T.VideoMAEForVideoClassification(T.VideoMAEConfig(
        image_size=32, patch_size=8, num_frames=4, tubelet_size=2, hidden_size=64, intermediate_size=128,
        num_hidden_layers=3, num_attention_heads=4, num_labels=5)),
        (torch.randn(2, 4, 3, 32, 32, generator=torch.Generator().manual_seed(1)),), {}, _lm),
    "patchtst": lambda: (T.PatchTSTForPrediction(T.PatchTSTConfig(
        num_input_channels=3, context_length=64, patch_length=8, patch_stride=8, prediction_length=8, d_model=32,
        num_attention_heads=4, num_hidden_layers=2, ffn_dim=64)),
        (torch.randn(4, 64, 3, generator=torch.Generator().manual_seed(2)),), {},
        lambda out: out.prediction_outputs.float().square().mean()),
    "convnextv2": lambda: (T.ConvNextV2ForImageClassification(T.ConvNextV2Config(
        num_stages=2, hidden_sizes=[16, 32], depths=[1, 2], num_labels=10, drop_path_rate=0.1)), (_image(4, 64),), {},
        _lm),
    "dinov2": lambda: (T.Dinov2ForImageClassification(T.Dinov2Config(
        image_size=32, patch_size=4, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, mlp_ratio=2,
        num_labels=10, drop_path_rate=0.1)), (_image(4, 32),), {}, _lm),
    "levit": lambda: (T.LevitForImageClassification(T.LevitConfig(
        image_size=64, hidden_sizes=[32, 48, 64], num_attention_heads=[1, 2, 2], depths=[1, 1, 1], key_dim=[8, 8, 8],
        num_labels=10)), (_image(4, 64),), {}, _lm),
    "speecht5": lambda: (T.SpeechT5ForSpeechToText(T.SpeechT5Config(
        vocab_size=V, hidden_size=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, conv_dim=(32, 32), conv_stride=(5, 2),
        conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, mask_time_prob=0.0,
        encoder_layerdrop=0.0, decoder_layerdrop=0.0)),
        (torch.randn(2, 4000, generator=torch.Generator().manual_seed(3)),), {"decoder_input_ids": _ids(2, 12, 5)},
        _lm),
}
"""Builders by name: decoders with rotary embeddings, grouped-query attention, sliding windows,
ALiBi (Bloom), mixture of experts (Mixtral), parallel residuals (GPT-NeoX, GPT-J, Falcon); a GPT-2
whose loss is computed inside ``forward`` (``labels``); encoders (DistilBERT, ALBERT with one
layer shared by all, RoBERTa, DeBERTa-v2 with relative attention); encoder-decoders (BART, Whisper, T5 with
relative position buckets); vision (Swin, ConvNeXt, SegFormer, BEiT with an ``lru_cache``'d position index,
Swin v2 with an in-place ReLU in its position-bias MLP); a two-tower model (CLIP); Perceiver (a decoder
tied to the input embedding, expanded latent and query parameters); Autoformer (FFT auto-correlation,
``x * conj(y)``); HuBERT (convolutional feature encoder, weight-normed positional convolution); Encodec
(an encoder no gradient reaches: its output only picks integer codes, which the decoder decodes); Longformer
and LED (sliding-window attention: overlapping ``as_strided`` chunks, whose backward has workspace); LongT5
(transient-global attention; its first layer returns the position bias to the next, as T5's does); Funnel
(pooling between blocks; its relative-position attention scales a slice of an einsum's output in place by
a mask, whose saves autograd hides); Mamba (a selective state-space scan, its slow path in plain ops);
Qwen2-MoE (routed experts beside a gated shared expert); ModernBERT (alternating local and global
attention); Granite, OLMoE (routed experts), Jamba (Mamba and attention layers, experts every other
layer), RWKV (a time-mixing recurrence in plain ops: ~3,000 nodes), ELECTRA, MPNet (relative
position bias), VideoMAE (tubelet patches), PatchTST (time-series patches), ConvNeXt V2 (global
response norm, stochastic depth), DINOv2 (layer scale, stochastic depth), LeViT (attention biases
indexed by position), SpeechT5 (speech encoder-decoder; its relative position embedding, one tensor
every encoder layer reads, gets a gradient from each: see ``tests/zoo/test_hf_breadth.py``)."""


def build(name: str, *, seed: int = 0) -> Case:
    """The model (train mode, seeded), example batch and loss function of :data:`CASES` ``name``."""
    if name not in CASES:
        raise ValueError(f"unknown architecture {name!r}; expected one of {sorted(CASES)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model, args, kwargs, loss = CASES[name]()
    return model.train(), args, kwargs, loss
