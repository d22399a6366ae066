"""The patched model's forward when its plan offloads: one offloader step per training forward,
backward started when an output's gradient arrives."""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from ..plan import Plan
from .offload import Offloader
from .transforms import records

__all__ = ["offloading_forward", "new_offloader"]

logger = logging.getLogger("autoremat.runtime")


def offloading_forward(forward: Any, offloader: Offloader) -> Any:
    # the offloader (streams, pinned buffers, per-step state) is eager code: under torch.compile
    # the whole patched forward runs eagerly instead of being traced into wrong graphs
    @torch.compiler.disable
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not records():  # also under torch.func transforms (.transforms)
            return forward(*args, **kwargs)
        offloader.begin_step()
        with offloader.active():
            out = forward(*args, **kwargs)
        for t in _output_tensors(out):  # backward starts when an output's gradient arrives
            if t.requires_grad:
                t.register_hook(functools.partial(_start_backward, offloader))
        return out

    return run


def _start_backward(offloader: Offloader, grad: torch.Tensor) -> None:
    offloader.start_backward()


def _output_tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _output_tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _output_tensors(v)]
    if hasattr(value, "__dataclass_fields__") or hasattr(value, "to_tuple"):  # HF ModelOutput, dataclasses
        return [t for v in vars(value).values() for t in _output_tensors(v)]
    return []


def new_offloader(plan: Plan) -> Offloader | None:
    if not plan.offloads:
        return None
    if plan.offload_saved and plan.graph_mode != "module":
        from ..errors import PlanMismatchError

        raise PlanMismatchError(f"offload_saved names nodes {list(plan.offload_saved)[:5]} of a {plan.graph_mode!r} "
                                "capture: a node's own saved tensors are offloaded around module calls; capture with "
                                "mode='module', or offload the nodes' outputs instead (offload)")
    if not plan.offload_order:
        logger.info("the plan offloads %d units but has no offload_order (it was not finalised by "
                    "autoremat.solve); prefetching the storage whose holder was registered last first",
                    len(plan.offload) + len(plan.offload_saved))
    return Offloader(plan.offload_order, plan.offload_waits, depth=plan.offload_prefetch_depth)
