"""The models the comparison runs: a zoo model or a transformers GPT-2, its batch, its loss, its blocks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import autoremat

from .settings import GPT2_PAPER, GPT2_SMALL


@dataclass
class Workload:
    """One model, its batch and its loss, plus what the PyTorch options need to know about it."""

    name: str
    model: nn.Module
    args: tuple
    loss_fn: Callable[[Any], torch.Tensor]
    block_types: tuple[type, ...]
    block_note: str
    sequential: Callable[[nn.Module], list[nn.Module]] | None
    not_sequential: str | None
    description: str
    batch: int
    copy_list_args: bool = False
    """DenseNet: a dense layer takes its block's growing feature list (see runner_block_ac)."""

    @property
    def has_dropout(self) -> bool:
        if any(isinstance(m, nn.Dropout) and m.p > 0 for m in self.model.modules()):
            return True
        cfg = getattr(self.model, "config", None)  # transformers: attention dropout inside SDPA
        return bool(cfg is not None and getattr(cfg, "attn_pdrop", 0))


def _output_mean(out: torch.Tensor) -> torch.Tensor:
    return out.float().mean()


def _logits_mean(out: Any) -> torch.Tensor:
    return out.logits.float().mean()


def _resnet_seq(m: nn.Module) -> list[nn.Module]:
    return [m.stem, *m.layer1, *m.layer2, *m.layer3, *m.layer4, m.head]


def _densenet_seq(m: nn.Module) -> list[nn.Module]:
    return [*m.features, m.avgpool, nn.Flatten(1), m.classifier]


def _mlp_seq(m: nn.Module) -> list[nn.Module]:
    return list(m.layers)


def _zoo_traits(name: str) -> tuple[tuple[type, ...], str, Callable | None, str | None]:
    import importlib

    # importlib: the zoo package re-exports builder functions named like some of its modules
    resnet, densenet, transformer, unet = (importlib.import_module(f"autoremat.zoo.{m}")
                                           for m in ("resnet", "densenet", "transformer", "unet"))

    if name.startswith("resnet"):
        return ((resnet.Bottleneck,), "Bottleneck", _resnet_seq,
                None)
    if name.startswith("densenet"):
        return ((densenet.DenseLayer,), "DenseLayer", _densenet_seq, None)
    if name == "unet":
        return ((unet._DoubleConv,), "_DoubleConv (two 3x3 conv + ReLU)", None,
                "U-Net's skip connections (each contracting level feeds the expanding path) make it a DAG, "
                "not a sequence")
    if name == "mlp":
        return ((nn.Linear,), "Linear", _mlp_seq, None)
    if name == "transformer":
        return ((transformer.Block,), "Block", None, "token + position embeddings are added before the blocks")
    return ((), "", None, f"no sequential form of {name} is defined here")


def build_workload(name: str, *, size: str = "small", batch: int | None = None,
                   device: str | torch.device = "cpu") -> Workload:
    """The model ``name`` (a zoo name or ``"gpt2"``) with its batch, at ``size``."""
    device = torch.device(device)
    if name == "gpt2":
        import transformers
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        shape = GPT2_SMALL if size == "small" else GPT2_PAPER
        cfg = transformers.GPT2Config(**shape, use_cache=False, bos_token_id=0, eos_token_id=0)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = transformers.GPT2LMHeadModel(cfg)
        model = model.to(device).train()
        b = batch or (4 if size == "small" else 8)
        ids = torch.randint(0, cfg.vocab_size, (b, cfg.n_positions), generator=torch.Generator().manual_seed(1))
        desc = (f"transformers GPT2LMHeadModel (n_layer={cfg.n_layer}, n_embd={cfg.n_embd}, n_head={cfg.n_head}, "
                f"vocab={cfg.vocab_size}), random weights, {b}x{cfg.n_positions} random tokens, "
                "loss = logits.float().mean()")
        return Workload("gpt2", model, (ids.to(device),), _logits_mean, (GPT2Block,), "GPT2Block", None,
                        "GPT2Model is not a sequence of modules (embeddings, position ids and the attention mask are "
                        "computed between them)", desc, b)
    model, args = autoremat.zoo.build(name, size=size, batch_size=batch, device=device)
    blocks, note, seq, why = _zoo_traits(name)
    x = args[0]
    desc = f"zoo {name} ({size} size), batch {tuple(x.shape)}, loss = output.float().mean()"
    return Workload(name, model, tuple(args), _output_mean, blocks, note, seq, why, desc, int(x.shape[0]),
                    copy_list_args=name.startswith("densenet"))
