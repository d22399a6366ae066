"""Small GPT-style decoder-only transformer language model in plain torch.

Architecture: A. Radford, J. Wu, R. Child, D. Luan, D. Amodei, I. Sutskever,
"Language Models are Unsupervised Multitask Learners" (GPT-2), 2019, which
builds on A. Vaswani et al., "Attention Is All You Need", NeurIPS 2017
(arXiv:1706.03762): learned token and position embeddings, embedding dropout,
``n_layer`` pre-LayerNorm blocks (causal multi-head self-attention and a
4x GELU MLP, each with a residual connection and dropout 0.1), a final
LayerNorm and a language-model head tied to the token embedding.

Attention is written out as ``softmax(mask(Q K^T / sqrt(d))) V`` with plain
matmuls; the causal mask is a registered (non-persistent) boolean buffer, so
the model traces with ``torch.fx`` and every dropout (embedding, attention
probabilities, residual branches) appears as an ``nn.Dropout`` node.

The network is built for a fixed sequence length ``block_size`` (the mask
and position buffers have exactly that length), so no shape arithmetic is
needed in the forward; inputs are ``(N, block_size)`` token ids. Width
scaling changes the per-head dimension (64 at ``width=1.0``); the number of
heads and layers stay fixed. Paper size is GPT-2 small: 12 layers, 12 heads,
d_model 768, vocabulary 50257, context 1024 (124M parameters with the tied
head).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ._common import check_width, scaled

__all__ = ["Block", "CausalSelfAttention", "GPT", "transformer"]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with explicit matmul + softmax."""

    def __init__(self, d_model: int, n_head: int, block_size: int, dropout: float) -> None:
        super().__init__()
        if d_model % n_head != 0:
            raise ValueError(f"d_model {d_model} is not divisible by n_head {n_head}")
        self.n_head = n_head
        self.head_dim = d_model // n_head
        self.d_model = d_model
        self.block_size = block_size
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)
        # True above the diagonal: positions a query must not attend to.
        mask = torch.ones(block_size, block_size, dtype=torch.bool).triu(1)
        self.register_buffer("mask", mask.view(1, 1, block_size, block_size), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, h, d = self.block_size, self.n_head, self.head_dim
        qkv = self.qkv(x)
        q, k, v = qkv.split(self.d_model, dim=2)
        q = q.reshape(-1, t, h, d).transpose(1, 2)
        k = k.reshape(-1, t, h, d).transpose(1, 2)
        v = v.reshape(-1, t, h, d).transpose(1, 2)
        att = torch.matmul(q, k.transpose(-2, -1)) * self.scale
        att = att.masked_fill(self.mask, float("-inf"))
        att = torch.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        y = torch.matmul(att, v)
        y = y.transpose(1, 2).reshape(-1, t, self.d_model)
        return self.resid_dropout(self.proj(y))


class MLPBlock(nn.Module):
    """Position-wise feed-forward network: Linear(4d) - GELU - Linear(d) - Dropout."""

    def __init__(self, d_model: int, dropout: float) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * d_model, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(self.act(self.fc(x))))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, d_model: int, n_head: int, block_size: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, block_size, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLPBlock(d_model, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """GPT-2-style language model returning logits of shape ``(N, block_size, vocab_size)``.

    Args:
        vocab_size: number of token ids.
        block_size: sequence length the model is built for.
        n_layer: number of transformer blocks.
        n_head: attention heads per block.
        head_dim: per-head dimension before ``width`` scaling (d_model = n_head * head_dim).
        width: multiplier for ``head_dim``.
        dropout: dropout probability of every dropout layer.
        tie_weights: share the LM head weight with the token embedding (as GPT-2).
    """

    def __init__(
        self,
        vocab_size: int = 50257,
        block_size: int = 1024,
        n_layer: int = 12,
        n_head: int = 12,
        head_dim: int = 64,
        *,
        width: float = 1.0,
        dropout: float = 0.1,
        tie_weights: bool = True,
    ) -> None:
        super().__init__()
        width = check_width(width)
        d_model = n_head * scaled(head_dim, width)
        self.d_model = d_model
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(block_size, d_model)
        self.register_buffer("positions", torch.arange(block_size).view(1, block_size), persistent=False)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*(Block(d_model, n_head, block_size, dropout) for _ in range(n_layer)))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))
        if tie_weights:
            self.lm_head.weight = self.tok_emb.weight

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx) + self.pos_emb(self.positions)
        x = self.drop(x)
        x = self.blocks(x)
        return self.lm_head(self.ln_f(x))


def transformer(*, width: float = 1.0, input_shape: tuple[int, ...] = (1024,), num_classes: int = 50257) -> GPT:
    """GPT-2-small-shaped model (12 layers, 12 heads) for ``(N, T)`` token inputs; ``num_classes`` is the vocabulary."""
    if len(input_shape) != 1 or int(input_shape[0]) <= 0:
        raise ValueError(f"transformer expects an input shape (sequence_length,), got {input_shape!r}")
    return GPT(num_classes, int(input_shape[0]), 12, 12, 64, width=width)
