"""Shared by the FSDP tests (issue 21) and ``tests/integrations/fsdp_script.py``: the test models
and how they are sharded, gradients gathered to full tensors, and a one-process process group.

FSDP runs with a world of one process too (``DTensor`` parameters, the units' hooks, all-gathers
and reduce-scatters over one rank, unsharded copies next to the shards): the fast tests run in
the test process with :func:`process_group`; the two-process ones spawn ``fsdp_script.py``.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["process_group", "build", "batch", "blocks", "shard", "step", "full_grads", "grads_equal"]


@contextlib.contextmanager
def process_group() -> Iterator[None]:
    """A gloo process group of this one process for the block (destroyed after it)."""
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", store=dist.FileStore(f"{d}/store", 1), rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def build(model_name: str) -> tuple[nn.Module, Callable[[Any], torch.Tensor]]:
    """``"cnn"``: the zoo's small ResNet-50 (fx level); ``"gpt2"``: transformers GPT-2 from a
    small config (module level); with the scalar to backpropagate."""
    if model_name == "cnn":
        from autoremat import zoo

        model, _ = zoo.build("resnet50", batch_size=4)
        return model, lambda out: out.float().mean()
    from autoremat.zoo import hf

    return hf.gpt2(), hf.logits_mean


def batch(model_name: str, rank: int = 0, *, small: bool = False) -> torch.Tensor:
    """A batch of 4 (``small``: 4 images of 32x32, 2 sequences of 32 tokens, for fast tests)."""
    g = torch.Generator().manual_seed(100 + rank)
    if model_name == "cnn":
        return torch.randn((4, 3, 32, 32) if small else (4, 3, 64, 64), generator=g)
    return torch.randint(0, 256, (2, 32) if small else (4, 64), generator=g)


def blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks: GPT-2's ``transformer.h``, the ResNet's bottlenecks."""
    if hasattr(model, "transformer"):
        return list(model.transformer.h)
    return [m for n, m in model.named_modules() if n.count(".") == 1 and n.startswith("layer")]


def shard(model: nn.Module, engine: str, *, per_block: bool = True) -> nn.Module:
    """FSDP2: each block a unit, then the model (root); FSDP1: blocks auto-wrapped, the model
    wrapped (returns the wrapper). ``per_block=False``: only the model, as one unit."""
    if engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for b in blocks(model) if per_block else ():
            fully_shard(b)
        fully_shard(model)
        return model
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    policy = ModuleWrapPolicy({type(blocks(model)[0])}) if per_block else None
    return FullyShardedDataParallel(model, auto_wrap_policy=policy, device_id=torch.device("cpu"))


def step(model: nn.Module, x: torch.Tensor, loss_fn: Callable[[Any], torch.Tensor]) -> None:
    """One forward and backward from no gradients, with the RNG seeded (the same dropout masks
    with and without a plan)."""
    torch.manual_seed(7)
    model.zero_grad(set_to_none=True)
    loss_fn(model(x)).backward()


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every gradient as a full tensor (a ``DTensor``'s gathered)."""
    out = {}
    for n, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad
            out[n] = g.full_tensor() if hasattr(g, "full_tensor") else g.detach().clone()
    return out


def grads_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
