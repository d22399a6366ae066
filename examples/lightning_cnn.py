"""Lightning + autoremat: a zoo ResNet-50 (CPU size) under a 50% budget, at its own batch size.

    python examples/lightning_cnn.py
"""

from __future__ import annotations

import lightning.pytorch as pl

import autoremat
from autoremat.zoo.lightning import LitClassifier


def main(max_steps: int = 5, samples: int = 256) -> autoremat.AutoRemat:
    model = LitClassifier(name="resnet50", batch_size=8, samples=samples)
    callback = autoremat.AutoRemat(budget="50%", module="model", raise_batch_size=False)
    trainer = pl.Trainer(max_steps=max_steps, accelerator="auto", devices=1, logger=False, enable_checkpointing=False,
                         callbacks=[callback])
    trainer.fit(model)
    return callback


if __name__ == "__main__":
    main()
