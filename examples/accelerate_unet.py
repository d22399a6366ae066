"""Accelerate + autoremat: a zoo U-Net (CPU size) on synthetic data, patched by one call.

    python examples/accelerate_unet.py
    AUTOREMAT_BUDGET=50% AUTOREMAT_SOLVER=chen accelerate launch examples/accelerate_unet.py
    AUTOREMAT_CONFIG=configs/autoremat.yaml accelerate launch examples/accelerate_unet.py
    AUTOREMAT_ENABLED=0 accelerate launch examples/accelerate_unet.py

``on_infeasible="min"`` makes any budget work: one the solver cannot reach (chen's least on this
U-Net is about 86 % of its step peak) is replaced by the least it reaches, with a warning line.
Leave it out to get an error that states the reachable range instead.
"""

from __future__ import annotations

import argparse

import torch
from accelerate import Accelerator

import autoremat
import autoremat.integrations.accelerate as ar


def main(steps: int = 3) -> list[float]:
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    model, (x,) = autoremat.zoo.build("unet", size="small")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # AUTOREMAT_BUDGET / AUTOREMAT_SOLVER / AUTOREMAT_CONFIG override these arguments
    model = ar.prepare(accelerator, model, (x,), budget="90%", optimizer=optimizer, on_infeasible="min")
    model, optimizer = accelerator.prepare(model, optimizer)
    losses = []
    for step in range(steps):
        batch = torch.randn_like(x).to(accelerator.device)
        loss = model(batch).float().pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        accelerator.print(f"step {step}: loss {losses[-1]:.4f}")
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    main(parser.parse_args().steps)
