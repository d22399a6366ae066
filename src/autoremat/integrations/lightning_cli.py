"""``python -m autoremat.integrations.lightning_cli fit --config configs/cnn.yaml``.

A plain ``LightningCLI`` over any LightningModule (``model.class_path``), so YAML configs can add
``autoremat.AutoRemat`` to ``trainer.callbacks`` with ``class_path`` / ``init_args``.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.cli import LightningCLI

__all__ = ["main"]


def main(args: list[str] | None = None) -> LightningCLI:
    return LightningCLI(pl.LightningModule, subclass_mode_model=True, args=args, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
