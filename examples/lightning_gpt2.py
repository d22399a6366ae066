"""Lightning + autoremat: a Hugging Face GPT-2 from a config (random weights), module-level
capture, and the batch size raised to what fits a fixed byte budget.

    python examples/lightning_gpt2.py
"""

from __future__ import annotations

import lightning.pytorch as pl

import autoremat
from autoremat.zoo.lightning import LitGPT2


def main(max_steps: int = 5, samples: int = 128, max_batch_size: int = 64) -> autoremat.AutoRemat:
    model = LitGPT2(batch_size=4, samples=samples)
    callback = autoremat.AutoRemat(budget="12MiB", module="model", raise_batch_size=True,
                                   max_batch_size=max_batch_size)
    trainer = pl.Trainer(max_steps=max_steps, accelerator="auto", devices=1, logger=False, enable_checkpointing=False,
                         callbacks=[callback])
    trainer.fit(model)
    return callback


if __name__ == "__main__":
    main()
