"""LightningModules over zoo models and a transformers GPT-2, on synthetic data.

Used by the examples, the YAML configs in ``configs/`` (LightningCLI) and the tests.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from . import build

__all__ = ["LitClassifier", "LitGPT2"]


class LitClassifier(pl.LightningModule):
    """A zoo CNN trained on random images; ``batch_size`` drives the dataloader."""

    def __init__(self, name: str = "resnet50", batch_size: int = 4, samples: int = 64, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model, (x,) = build(name, size="small", batch_size=1)
        self.batch_size = batch_size
        g = torch.Generator().manual_seed(0)
        self.images = torch.randn((samples, *x.shape[1:]), generator=g)
        self.labels = torch.randint(0, 10, (samples,), generator=g)
        self.step_losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        loss = nn.functional.cross_entropy(self.model(x), y)
        self.log("train_loss", loss)
        if torch.is_grad_enabled():  # AutoRemat's recording call runs under no_grad
            self.step_losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.images, self.labels), batch_size=self.batch_size, shuffle=False)


class LitGPT2(pl.LightningModule):
    """A transformers GPT-2 from a small config (random weights) on random tokens."""

    def __init__(self, batch_size: int = 4, samples: int = 32, seq: int = 64, n_layer: int = 4,
                 n_embd: int = 64, n_head: int = 4, vocab_size: int = 256) -> None:
        super().__init__()
        from .hf import gpt2

        self.save_hyperparameters()
        self.model = gpt2(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab_size, seq=seq)
        self.batch_size = batch_size
        self.tokens = torch.randint(0, vocab_size, (samples, seq), generator=torch.Generator().manual_seed(0))

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        (ids,) = batch
        out = self.model(input_ids=ids, labels=ids)
        self.log("train_loss", out.loss)
        return out.loss

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.tokens), batch_size=self.batch_size)
