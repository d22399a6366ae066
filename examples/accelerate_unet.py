"""Accelerate + autoremat: a zoo U-Net (CPU size) on synthetic data, patched by one call.

    python examples/accelerate_unet.py
    AUTOREMAT_BUDGET=60% AUTOREMAT_SOLVER=chen accelerate launch examples/accelerate_unet.py
"""

from __future__ import annotations

import torch
from accelerate import Accelerator

import autoremat
import autoremat.integrations.accelerate as ar


def main(steps: int = 3) -> list[float]:
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    model, (x,) = autoremat.zoo.build("unet", size="small")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model = ar.prepare(accelerator, model, (x,), budget="90%", optimizer=optimizer)  # env vars / AUTOREMAT_CONFIG override
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
    main()
