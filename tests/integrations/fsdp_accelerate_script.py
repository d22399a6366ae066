"""Run by test_fsdp_lightning.py: Accelerate's FSDP plugin (``fsdp_version`` 1 or 2) over two CPU
processes (gloo), with and without ``autoremat.integrations.accelerate.prepare`` (called before
``accelerator.prepare``, the documented order).

Usage: ``fsdp_accelerate_script.py VERSION MODEL[+SOLVER] USE_AUTOREMAT``; writes, per rank,
``$AUTOREMAT_TEST_OUT/rank<N>.pt``: the gradients of two steps (full tensors) and whether the plan
runs on the FSDP units. Accelerate sets its FSDP distributed type only for accelerator devices;
on a CPU it runs ``MULTI_CPU`` (DDP), so the script sets the FSDP state by hand after
``Accelerator(cpu=True)`` (the state ``accelerator.prepare`` reads), as a GPU launch would.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared FSDP helpers
from _fsdp import batch, blocks, build, full_grads, step  # noqa: E402


def run(rank: int, port: int, version: int, model_name: str, use: bool, solver: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    torch.set_num_threads(1)
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    import autoremat.integrations.accelerate as ar
    from autoremat.runtime.sharding import sharded_plan_of

    model, loss_fn = build(model_name)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=version, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=[type(blocks(model)[0]).__name__])
    accelerator = Accelerator(cpu=True)
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # what a GPU launch would set
    PartialState._shared_state["device"] = torch.device("cpu")
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    accelerator.state.device = torch.device("cpu")
    x = batch(model_name, rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    if use:
        model = ar.prepare(accelerator, model, (x,), budget="50%", solver=solver, optimizer=optimizer,
                           loss_fn=loss_fn)
    model, optimizer = accelerator.prepare(model, optimizer)
    grads = []
    for _ in range(2):
        step(model, x, loss_fn)
        grads.append(full_grads(model))
        optimizer.step()
    mapped = sharded_plan_of(model) is not None if model_name == "cnn" else None
    refused = None
    if use and rank == 0:
        try:  # the wrong order: a model sharded already is refused with the order to use
            ar.prepare(accelerator, model, (x,), budget="50%")
        except ValueError as err:
            refused = str(err)
    torch.save({"grads": grads, "mapped": mapped, "refused": refused}, Path(os.environ["AUTOREMAT_TEST_OUT"],
                                                                            f"rank{rank}.pt"))


def main() -> None:
    version, use = int(sys.argv[1]), sys.argv[3] == "1"
    model_name, _, solver = sys.argv[2].partition("+")  # gpt2+blocks: the blocks solver, layers op by op
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run, args=(port, version, model_name, use, solver or "dp-approx"), nprocs=2)


if __name__ == "__main__":
    main()
