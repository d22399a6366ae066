"""Run by test_dist_trial.py: a user's first distributed fit of a Hugging Face model nobody wrote
for us, two CPU processes (gloo), with or without autoremat, under Lightning (``ddp``,
``FSDPStrategy``, ``ModelParallelStrategy``) or Accelerate (DDP, FSDP plugin 1 and 2), gradients
accumulated over two batches.

Usage: ``dist_trial_script.py ENGINE MODEL PRECISION BUDGET USE``: ENGINE ``l-ddp``, ``l-fsdp1``,
``l-fsdp2``, ``a-ddp``, ``a-fsdp1`` or ``a-fsdp2``; MODEL ``mistral`` (causal LM, loss from
``labels``) or ``distilbert`` (sequence classification, dropout 0.1); PRECISION ``32`` or ``bf16``;
BUDGET e.g. ``50%`` or ``min``; USE ``0`` or ``1``. Writes, per rank, ``$AUTOREMAT_TEST_OUT/rank<N>.pt``:
the losses, the full state dict at the end, the plan, the summary and the step peak measured on
this rank (the first batch, :class:`~autoremat.measure.LiveStorageCounter`).
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the FSDP1-on-a-CPU strategy beside it
V, SEQ, BATCH, SAMPLES = 128, 32, 4, 32


def make(name: str) -> nn.Module:
    import transformers as T

    torch.manual_seed(0)
    if name == "mistral":
        cfg = T.MistralConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                              num_attention_heads=4, num_key_value_heads=2, sliding_window=16, use_cache=False)
        return T.MistralForCausalLM(cfg)
    cfg = T.DistilBertConfig(vocab_size=V, dim=64, hidden_dim=128, n_layers=3, n_heads=4, num_labels=3)
    return T.DistilBertForSequenceClassification(cfg)


def data(name: str) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, V, (SAMPLES, SEQ), generator=g)
    labels = ids.clone() if name == "mistral" else torch.randint(0, 3, (SAMPLES,), generator=g)
    return torch.utils.data.TensorDataset(ids, labels)


def layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks (the FSDP units)."""
    return list(model.model.layers) if hasattr(model, "model") else list(model.distilbert.transformer.layer)


def loss_of(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=labels).loss


class PeakRecorder:
    """The step peak of the first batch on this rank (forward and backward)."""

    def __init__(self) -> None:
        self.counter: Any = None
        self.peak: int | None = None

    def start(self) -> None:
        from autoremat.measure import LiveStorageCounter

        self.counter = LiveStorageCounter(track_resizes=True)
        self.counter.__enter__()

    def stop(self) -> None:
        if self.counter is not None:
            self.counter.__exit__(None, None, None)
            self.peak, self.counter = self.counter.peak, None


def lightning_main(engine: str, name: str, precision: str, budget: str, use: bool, out: Path) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy

    import autoremat
    from fsdp_lightning_script import CPUFSDPStrategy

    recorder = PeakRecorder()

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = make(name)
            self.losses: list[float] = []

        def configure_model(self) -> None:
            from torch.distributed.fsdp import FSDPModule, fully_shard

            if engine != "l-fsdp2" or isinstance(self.model, FSDPModule):
                return
            mesh = self.device_mesh["data_parallel"]
            for b in layers(self.model):
                fully_shard(b, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            loss = loss_of(self.model, *batch)
            if torch.is_grad_enabled():
                self.losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

        def train_dataloader(self):  # type: ignore[no-untyped-def]
            return torch.utils.data.DataLoader(data(name), batch_size=BATCH, shuffle=False)

    class Measure(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
            if batch_idx == 0:
                pl_module.model.zero_grad(set_to_none=True)
                recorder.start()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
            recorder.stop()

    if engine == "l-fsdp2":
        strategy: Any = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1,
                                              save_distributed_checkpoint=False)
    elif engine == "l-fsdp1":
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        strategy = CPUFSDPStrategy(auto_wrap_policy=ModuleWrapPolicy({type(layers(make(name))[0])}),
                                   state_dict_type="full")
    else:
        strategy = "ddp"
    cb = autoremat.AutoRemat(budget=budget, module="model", raise_batch_size=False, verbose=False)
    module = Lit()
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", devices=2, strategy=strategy, logger=False,
                         precision="bf16-mixed" if precision == "bf16" else "32-true", accumulate_grad_batches=int(os.environ.get("TRIAL_ACCUM", "2")),
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[cb, Measure()] if use else [Measure()], default_root_dir=str(out))
    trainer.fit(module)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(trainer.strategy.model, options=StateDictOptions(full_state_dict=True))
    torch.save({"losses": module.losses, "state": {k: v.detach().clone() for k, v in full.items()},
                "plan": cb.plan.to_dict() if use and cb.plan is not None else None,
                "summary": cb.summary if use else None, "peak": recorder.peak},
               out / f"rank{trainer.global_rank}.pt")


def accelerate_run(rank: int, port: int, engine: str, name: str, precision: str, budget: str, use: bool,
                   out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    torch.set_num_threads(1)
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    import autoremat.integrations.accelerate as ar

    model = make(name)
    accelerator = Accelerator(cpu=True, mixed_precision="bf16" if precision == "bf16" else "no",
                              gradient_accumulation_steps=int(os.environ.get("TRIAL_ACCUM", "2")))
    if engine != "a-ddp":  # what a GPU launch would set (fsdp_accelerate_script.py)
        plugin = FullyShardedDataParallelPlugin(fsdp_version=int(engine[-1]), auto_wrap_policy="transformer_based_wrap",
                                                transformer_cls_names_to_wrap=[type(layers(model)[0]).__name__])
        if precision == "bf16" and os.environ.get("TRIAL_MP_POLICY") == "1":  # as Accelerator(mixed_precision=) does
            plugin.set_mixed_precision("bf16")
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        PartialState._shared_state["device"] = torch.device("cpu")
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin
        accelerator.state.device = torch.device("cpu")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = torch.utils.data.DataLoader(data(name), batch_size=BATCH, shuffle=False)
    summary = None
    if use:
        ids, labels = data(name)[:BATCH]  # not next(iter(loader)): a loader's iterator draws from the RNG
        model = ar.prepare(accelerator, model, (), {"input_ids": ids, "labels": labels}, budget=budget,
                           optimizer=optimizer, loss_fn=lambda o: o.loss)
        summary = getattr(model, "_autoremat_patch", None)
    plan = _plan_of(model) if use else None
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    recorder, losses = PeakRecorder(), []
    for i, (ids, labels) in enumerate(loader):
        with accelerator.accumulate(model):
            if i == 0:
                optimizer.zero_grad(set_to_none=True)
                recorder.start()
            loss = loss_of(model, ids, labels)
            accelerator.backward(loss)
            recorder.stop()
            losses.append(float(loss.detach()))
            optimizer.step()
            optimizer.zero_grad()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    torch.save({"losses": losses, "state": {k: v.detach().clone() for k, v in full.items()}, "plan": plan,
                "summary": None if summary is None else "patched", "peak": recorder.peak},
               Path(out, f"rank{rank}.pt"))


def _plan_of(model: nn.Module) -> dict | None:
    state = model.__dict__.get("_autoremat_patch")
    plan = getattr(state, "plan", None)
    return None if plan is None else plan.to_dict()


def main() -> None:
    engine, name, precision, budget, use = sys.argv[1:6]
    out = Path(os.environ["AUTOREMAT_TEST_OUT"])
    torch.set_num_threads(1)
    if engine.startswith("l-"):
        lightning_main(engine, name, precision, budget, use == "1", out)
        return
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(accelerate_run, args=(port, engine, name, precision, budget, use == "1", str(out)), nprocs=2)


if __name__ == "__main__":
    main()
