"""Run by test_fsdp_lightning.py: a 2-process fit (gloo, CPU) under ModelParallelStrategy (FSDP2,
sharded in configure_model) or FSDPStrategy (FSDP1 wrappers), with or without AutoRemat.

Usage: fsdp_lightning_script.py STRATEGY MODEL[+SOLVER] USE_AUTOREMAT [RESUME_FROM]; writes, per rank,
``$AUTOREMAT_TEST_OUT/rank<N>.pt``: the losses, the full state dict at the end, the plan and the
state_dict keys of the module. FSDPStrategy passes ``device_id=None`` on a CPU, which FSDP1
refuses; :class:`CPUFSDPStrategy` passes the CPU device (what it does on a GPU with the GPU's).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

import autoremat
from autoremat.zoo.lightning import LitClassifier, LitGPT2


class CPUFSDPStrategy(FSDPStrategy):
    """FSDPStrategy on a CPU: FSDP1 wrapped with ``device_id`` the CPU."""

    def _setup_model(self, model):  # type: ignore[no-untyped-def]
        from torch.distributed.fsdp import FullyShardedDataParallel

        if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
            return model
        return FullyShardedDataParallel(module=model, device_id=torch.device("cpu"), **self.kwargs)


def blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    if hasattr(model, "transformer"):
        return list(model.transformer.h)
    return [m for n, m in model.named_modules() if n.count(".") == 1 and n.startswith("layer")]


class Sharded:
    """configure_model for ModelParallelStrategy: each block a unit, the model the root unit."""

    def configure_model(self) -> None:  # type: ignore[misc]
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if isinstance(self.model, FSDPModule) or self.device_mesh is None:  # FSDPStrategy wraps by itself
            return
        mesh = self.device_mesh["data_parallel"]
        for b in blocks(self.model):
            fully_shard(b, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


class CNN(Sharded, LitClassifier):
    pass


class GPT(Sharded, LitGPT2):
    def __init__(self) -> None:
        super().__init__(samples=16)
        self.step_losses: list[float] = []
        for m in self.model.modules():  # the callback's profiling must not change the dropout stream
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        loss = super().training_step(batch, batch_idx)
        if torch.is_grad_enabled():
            self.step_losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        # with state: Lightning 2.6's ModelParallelStrategy cannot resume an empty optimizer state
        # (IndexError in _rekey_optimizer_state_if_needed), with or without AutoRemat
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def main() -> None:
    strategy_name, use = sys.argv[1], sys.argv[3] == "1"
    model_name, _, solver = sys.argv[2].partition("+")  # gpt2+blocks: the blocks solver, layers op by op
    resume = sys.argv[4] if len(sys.argv) > 4 else None
    out = Path(os.environ["AUTOREMAT_TEST_OUT"])
    torch.manual_seed(0)
    module = CNN(batch_size=4, samples=16) if model_name == "cnn" else GPT()
    if strategy_name == "fsdp2":
        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, save_distributed_checkpoint=False)
    else:
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        strategy = CPUFSDPStrategy(auto_wrap_policy=ModuleWrapPolicy({type(blocks(module.model)[0])}),
                                   state_dict_type="full")
    callbacks: list[pl.Callback] = []
    if use:
        callbacks.append(autoremat.AutoRemat(budget="50%", module="model", solver=solver or "dp-approx",
                                             verbose=False))
    trainer = pl.Trainer(max_steps=4 if resume else 2, accelerator="cpu", devices=2, strategy=strategy, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=callbacks, default_root_dir=str(out))
    trainer.fit(module, ckpt_path=resume)
    if resume is None and strategy_name == "fsdp2":  # FSDP1's full state dict offloads to the CPU: crashes on one
        trainer.save_checkpoint(str(out / f"{'ar' if use else 'plain'}.ckpt"))
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(trainer.strategy.model, options=StateDictOptions(full_state_dict=True))
    cb = callbacks[0] if callbacks else None
    torch.save({"losses": module.step_losses, "state": {k: v.detach().clone() for k, v in full.items()},
                "plan": None if cb is None or cb.plan is None else cb.plan.to_dict(),
                "summary": None if cb is None else cb.summary,
                "patched_during_fit": bool(cb is not None and cb.plan is not None)},
               out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
