"""Run by test_fsdp.py and benchmarks/fsdp.py: two CPU processes (gloo) shard a model with FSDP2
(``fully_shard``: each block a unit, the model the root) or FSDP1 (``FullyShardedDataParallel``,
blocks auto-wrapped), with and without an autoremat plan, and compare.

Usage: ``fsdp_script.py ENGINE MODEL ORDERS BUDGET [TIMING_STEPS]`` (ENGINE ``fsdp2``/``fsdp1``,
MODEL ``cnn`` (zoo ResNet-50, small, fx level) / ``gpt2`` (transformers, small config, module
level), ORDERS a comma list of ``shard-first``/``apply-first``). Rank zero captures the unsharded
model and solves; the plan goes to both ranks. Per order and rank it records, in
``$AUTOREMAT_TEST_OUT/rank<N>.json``: gradients ``torch.equal`` to the same sharding without the
plan, the collectives of a step (both), the measured per-rank step peak (live storage counter,
resizes and ``DTensor`` local shards counted) and the per-rank prediction, ``restore`` under
sharding, and a checkpoint (full state dict) saved from the patched model and resumed into a
fresh patched one. With TIMING_STEPS, also interleaved per-rank step times of: the unsharded model
with and without the plan, and the sharded model with and without it.
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
from autoremat.simulate import no_recompute_plan


def build(model_name: str) -> tuple[torch.nn.Module, Any]:
    if model_name == "cnn":
        from autoremat import zoo

        model, _ = zoo.build("resnet50", batch_size=4)
        return model, lambda out: out.float().mean()
    from autoremat.zoo import hf

    return hf.gpt2(), hf.logits_mean


def batch(model_name: str, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    if model_name == "cnn":
        return torch.randn((4, 3, 64, 64), generator=g)
    return torch.randint(0, 256, (4, 64), generator=g)


def blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    if hasattr(model, "transformer"):
        return list(model.transformer.h)
    return [m for n, m in model.named_modules() if n.count(".") == 1 and n.startswith("layer")]


def shard(model: torch.nn.Module, engine: str) -> torch.nn.Module:
    if engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for b in blocks(model):
            fully_shard(b)
        fully_shard(model)
        return model
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({type(blocks(model)[0])}),
                                    device_id=torch.device("cpu"))


def step(model: torch.nn.Module, x: torch.Tensor, loss_fn: Any) -> None:
    torch.manual_seed(7)  # dropout: the same masks with and without the plan
    model.zero_grad(set_to_none=True)
    loss_fn(model(x)).backward()


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad
            out[n] = g.full_tensor() if hasattr(g, "full_tensor") else g.detach().clone()
    return out


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
    equal = want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
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
    resumed_equal = want2.keys() == got2.keys() and all(torch.equal(want2[k], got2[k]) for k in want2)
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


def timing(engine: str, model_name: str, plan: Plan, x: torch.Tensor, steps: int) -> dict[str, Any]:
    """Interleaved per-rank step times: unsharded / sharded, each without and with the plan."""
    loss_fn = build(model_name)[1]
    models = {"local": build(model_name)[0], "local+plan": build(model_name)[0],
              "sharded": shard(build(model_name)[0], engine), "sharded+plan": build(model_name)[0]}
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


def run(rank: int, port: int, engine: str, model_name: str, orders: list[str], budget: str, steps: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    x = batch(model_name, rank)
    box: list[Any] = [None]
    if rank == 0:
        model, loss_fn = build(model_name)
        graph = autoremat.capture(model, (x,), loss_fn=loss_fn, mode="fx" if model_name == "cnn" else "module")
        box = [(graph.to_dict(), autoremat.solve(graph, budget, solver="dp-approx").to_dict())]
    dist.broadcast_object_list(box, 0)
    graph, plan = Graph.from_dict(box[0][0]), Plan.from_dict(box[0][1])
    out: dict[str, Any] = {"orders": {o: order_case(engine, model_name, o, plan, graph, x) for o in orders}}
    if steps:
        out["timing"] = timing(engine, model_name, plan, x, steps)
    Path(os.environ["AUTOREMAT_TEST_OUT"], f"rank{rank}.json").write_text(json.dumps(out, indent=1))
    dist.destroy_process_group()


def main() -> None:
    engine, model_name, orders, budget = sys.argv[1], sys.argv[2], sys.argv[3].split(","), sys.argv[4]
    steps = int(sys.argv[5]) if len(sys.argv) > 5 else 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run, args=(port, engine, model_name, orders, budget, steps), nprocs=2)


if __name__ == "__main__":
    main()
