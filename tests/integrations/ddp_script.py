"""Run by test_lightning.py: a 2-process DDP fit (gloo, CPU) with AutoRemat; each rank writes
the plan it runs to ``$AUTOREMAT_TEST_OUT/rank<N>.json``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import lightning.pytorch as pl
import torch

import autoremat
from autoremat.zoo.lightning import LitClassifier


class Record(pl.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
        if batch_idx == 0:
            cb = next(c for c in trainer.callbacks if isinstance(c, autoremat.AutoRemat))
            out = Path(os.environ["AUTOREMAT_TEST_OUT"]) / f"rank{trainer.global_rank}.json"
            out.write_text(json.dumps({"plan": cb.plan.to_dict(), "batch_size": cb.batch_size,
                                       "patched": autoremat.is_patched(pl_module.model), "module": cb.module}))


def main() -> None:
    torch.manual_seed(0)
    # no module=: rank zero chooses `model` (training_step calls it, not forward) and tells the others
    cb = autoremat.AutoRemat(budget="50%", raise_batch_size=False, verbose=False)
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", devices=2, strategy="ddp", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[cb, Record()])
    trainer.fit(LitClassifier())


if __name__ == "__main__":
    main()
