"""``python -m autoremat.integrations.lightning_cli fit --config configs/cnn.yaml``.

A plain ``LightningCLI`` over any LightningModule (``model.class_path``), so YAML configs can add
``autoremat.AutoRemat`` to ``trainer.callbacks`` with ``class_path`` / ``init_args``.

Decision: the resolved configuration is not written to ``config.yaml``. LightningCLI writes it
into the trainer's log directory, which without a logger (as in ``configs/``) is the working
directory: every run left an untracked ``config.yaml`` in the user's checkout. A run that wants
it passes ``--print_config`` (to standard output) or uses its own ``LightningCLI`` with a logger.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.cli import LightningCLI

__all__ = ["main"]


def main(args: list[str] | None = None) -> LightningCLI:
    return LightningCLI(pl.LightningModule, subclass_mode_model=True, args=args, save_config_callback=None)


if __name__ == "__main__":
    main()
