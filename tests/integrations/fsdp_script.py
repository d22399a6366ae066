"""Run by test_fsdp.py and benchmarks/fsdp.py: two CPU processes (gloo) shard a model with FSDP2
(``fully_shard``: each block a unit, the model the root) or FSDP1 (``FullyShardedDataParallel``,
blocks auto-wrapped), with and without an autoremat plan, and compare.

Usage: ``fsdp_script.py ENGINE MODEL ORDERS BUDGET [TIMING_STEPS]`` (ENGINE ``fsdp2``/``fsdp1``,
MODEL ``cnn`` (zoo ResNet-50, small, fx level) / ``gpt2`` (transformers, small config, module
level), optionally ``+SOLVER`` (default ``dp-approx`` on one node per block; ``gpt2+blocks``: the
``blocks`` solver on the default capture, layers op by op), ORDERS a comma list of
``shard-first``/``apply-first``). Rank zero captures the unsharded model and solves; the plan goes
to both ranks. Per order and rank it records, in
``$AUTOREMAT_TEST_OUT/rank<N>.json``: gradients ``torch.equal`` to the same sharding without the
plan, the collectives of a step (both), the measured per-rank step peak (live storage counter,
resizes and ``DTensor`` local shards counted) and the per-rank prediction, ``restore`` under
sharding, and a checkpoint (full state dict) saved from the patched model and resumed into a
fresh patched one. With TIMING_STEPS, also the per-rank peak and collectives of the sharded model
with PyTorch's own per-block checkpointing, and interleaved per-rank step times of: the unsharded
model with and without the plan, the sharded model with and without it, and with PyTorch's
checkpointing.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import autoremat
from autoremat.graph import Graph
from autoremat.measure import CollectiveCounter, LiveStorageCounter
from autoremat.per_rank import per_rank_graph
from autoremat.plan import Plan
from autoremat.runtime.sharded_memory import sharding_spec
from autoremat.runtime.sharding import sharded_plan_of
from autoremat.cost import no_recompute_plan

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared FSDP helpers
from _fsdp import batch, blocks, build, full_grads, grads_equal, shard, step  # noqa: E402


def measured(model: torch.nn.Module, x: torch.Tensor, loss_fn: Any) -> tuple[int, dict[str, int], dict[str, int]]:
    step(model, x, loss_fn)  # warm: FSDP's lazy init, the plan's first-forward probes
    model.zero_grad(set_to_none=True)
    counter, comm = LiveStorageCounter(track_resizes=True), CollectiveCounter()
    torch.manual_seed(7)
    with comm, counter:
        loss_fn(model(x)).backward()
    return counter.peak, comm.counts, comm.bytes


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def load(model: torch.nn.Module, sd: dict[str, torch.Tensor]) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, sd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=False))


def order_case(engine: str, model_name: str, order: str, plan: Plan, graph: Graph, x: torch.Tensor) -> dict[str, Any]:
    loss_fn = build(model_name)[1]
    ref = shard(build(model_name)[0], engine)
    ref_peak, ref_comm, ref_bytes = measured(ref, x, loss_fn)
    step(ref, x, loss_fn)
    want = full_grads(ref)
    model = build(model_name)[0]
    if order == "apply-first":
        autoremat.apply(model, plan)
        model = shard(model, engine)
    else:
        model = shard(model, engine)
        autoremat.apply(model, plan)
    peak, comm, nbytes = measured(model, x, loss_fn)
    step(model, x, loss_fn)
    got = full_grads(model)
    equal = grads_equal(want, got)
    cut = sharded_plan_of(model) or plan
    spec = sharding_spec(model, graph)
    predicted = autoremat.simulate(per_rank_graph(graph, spec, cut), cut, check=False).peak_bytes
    predicted_ref = autoremat.simulate(per_rank_graph(graph, spec), no_recompute_plan(graph)).peak_bytes
    # checkpoint: the patched model's state dict is the unpatched one's; resumed into a fresh patched model
    sd_model, sd_ref = state(model), state(ref)
    keys_equal = list(sd_model) == list(sd_ref)
    values_equal = all(torch.equal(sd_model[k], sd_ref[k]) for k in sd_ref)
    resumed = build(model_name)[0]
    resumed = shard(resumed, engine)
    autoremat.apply(resumed, plan)
    load(resumed, {k: v.clone() for k, v in sd_model.items()})
    step(resumed, x, loss_fn)
    step(ref, x, loss_fn)
    want2, got2 = full_grads(ref), full_grads(resumed)
    resumed_equal = grads_equal(want2, got2)
    # restore under sharding: no patch left anywhere, the model's own forward
    autoremat.restore(model)
    leftovers = [n for n, m in model.named_modules() if "forward" in m.__dict__]
    step(model, x, loss_fn)
    restored_equal = all(torch.equal(a, b) for a, b in zip(full_grads(model).values(), want2.values()))
    return {"grads_equal": equal, "peak_bytes": peak, "predicted_bytes": predicted, "ref_peak_bytes": ref_peak,
            "ref_predicted_bytes": predicted_ref, "comm": comm, "ref_comm": ref_comm, "comm_bytes": nbytes,
            "ref_comm_bytes": ref_bytes, "cuts": cut.options.get("sharded_cuts", 0),
            "recomputed": len(plan.recompute_segments), "recomputed_after_cut": len(cut.recompute_segments),
            "state_keys_equal": keys_equal, "state_values_equal": values_equal, "resumed_equal": resumed_equal,
            "restored": not autoremat.is_patched(model) and not leftovers, "restored_equal": restored_equal,
            "units": len(spec.units)}


def with_fsdp_checkpointing(engine: str, model_name: str) -> torch.nn.Module:
    """The model sharded with PyTorch's own per-block activation checkpointing: FSDP2 as
    torchtitan does it (``checkpoint_wrapper`` on each block, then ``fully_shard``), FSDP1 with
    ``apply_activation_checkpointing`` after wrapping."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (apply_activation_checkpointing,
                                                                             checkpoint_wrapper)

    model = build(model_name)[0]
    kind = type(blocks(model)[0])
    if engine == "fsdp2":
        for name, m in list(model.named_modules()):
            if isinstance(m, kind):
                parent, _, attr = name.rpartition(".")
                setattr(model.get_submodule(parent), attr, checkpoint_wrapper(m))
        return shard(model, engine)
    model = shard(model, engine)
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper, check_fn=lambda m: isinstance(m, kind))
    return model


def fsdp_checkpointing(engine: str, model_name: str, x: torch.Tensor) -> dict[str, Any]:
    """Per-rank peak and collectives of the sharded model with PyTorch's per-block checkpointing."""
    loss_fn = build(model_name)[1]
    peak, comm, nbytes = measured(with_fsdp_checkpointing(engine, model_name), x, loss_fn)
    return {"peak_bytes": peak, "comm": comm, "comm_bytes": nbytes}


def timing(engine: str, model_name: str, plan: Plan, x: torch.Tensor, steps: int) -> dict[str, Any]:
    """Interleaved per-rank step times: unsharded / sharded, each without and with the plan, and
    sharded with PyTorch's per-block checkpointing."""
    loss_fn = build(model_name)[1]
    models = {"local": build(model_name)[0], "local+plan": build(model_name)[0],
              "sharded": shard(build(model_name)[0], engine), "sharded+plan": build(model_name)[0],
              "sharded+fsdp-ac": with_fsdp_checkpointing(engine, model_name)}
    autoremat.apply(models["local+plan"], plan)
    models["sharded+plan"] = shard(models["sharded+plan"], engine)
    autoremat.apply(models["sharded+plan"], plan)
    times: dict[str, list[float]] = {k: [] for k in models}
    for _ in range(2):
        for m in models.values():
            step(m, x, loss_fn)
    for _ in range(steps):
        for name, m in models.items():
            dist.barrier()
            t0 = time.perf_counter()
            step(m, x, loss_fn)
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"median_s": med, "times_s": times,
            "ratio_local": med["local+plan"] / med["local"], "ratio_sharded": med["sharded+plan"] / med["sharded"]}


def run(rank: int, port: int, engine: str, model_name: str, orders: list[str], budget: str, steps: int,
        solver: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    x = batch(model_name, rank)
    box: list[Any] = [None]
    if rank == 0:
        model, loss_fn = build(model_name)
        # node-by-node solvers recompute whole layers (one node each); "blocks" inside them (the default capture)
        graph = autoremat.capture(model, (x,), loss_fn=loss_fn, mode="fx" if model_name == "cnn" else "module",
                                  blocks="auto" if solver == "blocks" else "module")
        box = [(graph.to_dict(), autoremat.solve(graph, budget, solver=solver).to_dict())]
    dist.broadcast_object_list(box, 0)
    graph, plan = Graph.from_dict(box[0][0]), Plan.from_dict(box[0][1])
    out: dict[str, Any] = {"orders": {o: order_case(engine, model_name, o, plan, graph, x) for o in orders}}
    if steps:
        out["fsdp_checkpointing"] = fsdp_checkpointing(engine, model_name, x)
        out["timing"] = timing(engine, model_name, plan, x, steps)
    Path(os.environ["AUTOREMAT_TEST_OUT"], f"rank{rank}.json").write_text(json.dumps(out, indent=1))
    dist.destroy_process_group()


def main() -> None:
    engine, orders, budget = sys.argv[1], sys.argv[3].split(","), sys.argv[4]
    model_name, _, solver = sys.argv[2].partition("+")
    steps = int(sys.argv[5]) if len(sys.argv) > 5 else 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run, args=(port, engine, model_name, orders, budget, steps, solver or "dp-approx"), nprocs=2)


if __name__ == "__main__":
    main()
