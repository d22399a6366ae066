"""What a plan was made for, beyond the graph's structure: the shapes and dtypes of the model's
parameters and buffers, and the shapes, dtypes and devices of the example inputs.

A plan's memory predictions hold only for the tensor sizes it was captured with: a plan made
for an MLP of width 128 must not run silently on width 256, nor a plan made at batch 8 on
batch 64. So:

* the graph fingerprint (:func:`~autoremat.capture.fx.fx_fingerprint`,
  :func:`~autoremat.capture.module.module_fingerprint`) hashes the shape and dtype of every
  parameter and buffer, and :func:`autoremat.apply` refuses a plan whose fingerprint differs,
  naming the first differing node or tensor (:func:`first_difference`); the plan carries the
  tensor signature (``Plan.tensors``) so that the message can say what changed;
* the example inputs' signature (``Plan.inputs``) is recorded by
  :func:`autoremat.solve` from the graph. ``apply`` sees only the model, not a batch, so the
  input check (:func:`check_inputs`) runs where a batch is known: ``apply(model, plan,
  inputs=...)`` and the integrations that reuse a plan. Device *type* is compared (``cuda:0``
  and ``cuda:1`` are the same kind of memory), dtypes and every dimension but the batch's
  exactly. A *smaller* batch passes (every tensor that had the batch's rows in its first
  dimension has the same fewer rows): the plan is exact at any batch size and only its memory
  changes, and activations shrink with the batch, so the plan's budget still holds. A larger
  batch is refused, not re-scaled: solve again (capture is the only source of the byte counts
  the plan relies on).

A buffer the model's forward resizes (a quantization-aware-training observer's ``min_val`` and
fake-quantizer's ``scale`` start as ``[0]`` / ``[1]`` and take their per-channel shapes in the first
forward, ``resize_``) has one shape before the first step and another after: a capture that sees a
buffer's shape change records it as ``float32[*]`` (:func:`resized_signature`), the fingerprint hashes
that, and ``apply`` compares such a buffer's dtype only (:func:`as_recorded`), so the plan applies to
the model before and after its first step.

A patched model itself checks no shapes when it runs: the last, smaller batch of an epoch, an
evaluation at another batch size or a larger batch run exactly as the unpatched model does
(at a larger batch its step peak grows past the plan's prediction).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..errors import PlanMismatchError

__all__ = ["tensor_signature", "resized_signature", "as_recorded", "input_signature", "tensor_lines",
           "first_difference", "check_inputs"]

RESIZED = "[*]"
"""The shape a signature records for a buffer the forward resizes."""


def _sig(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


def tensor_signature(module: nn.Module) -> dict[str, str]:
    """``{name: "float32[128, 64]"}`` for every parameter and buffer, in registration order."""
    out = {f"param:{n}": _sig(p) for n, p in module.named_parameters()}
    out.update({f"buffer:{n}": _sig(b) for n, b in module.named_buffers()})
    return out


def resized_signature(before: Mapping[str, str], after: Mapping[str, str]) -> dict[str, str]:
    """``after`` with every buffer whose shape differs from ``before`` recorded as resized (``dtype[*]``)."""
    return {k: (v.partition("[")[0] + RESIZED if k.startswith("buffer:") and before.get(k, v) != v else v)
            for k, v in after.items()}


def as_recorded(own: Mapping[str, str], recorded: Mapping[str, str] | None) -> dict[str, str]:
    """``own`` (a model's :func:`tensor_signature`) with the shapes of the buffers ``recorded`` (a
    plan's) has as resized left out, where the dtype agrees."""
    def one(k: str, v: str) -> str:
        r = (recorded or {}).get(k, "")
        return r if r.endswith(RESIZED) and v.partition("[")[0] == r.partition("[")[0] else v

    return {k: one(k, v) for k, v in own.items()}


def tensor_lines(module: nn.Module) -> Iterable[str]:
    """The lines a fingerprint hashes for the module's tensors."""
    return (f"{k}={v};" for k, v in tensor_signature(module).items())


def input_signature(args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Shape, dtype and device of every tensor in the example batch, with its place in it."""
    out: list[dict[str, Any]] = []

    def walk(path: str, obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            out.append({"path": path, "shape": list(obj.shape), "dtype": str(obj.dtype).removeprefix("torch."),
                        "device": obj.device.type})
        elif isinstance(obj, Mapping):
            for k, v in obj.items():
                walk(f"{path}[{k!r}]", v)
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(f"{path}[{i}]", v)

    walk("args", tuple(args))
    walk("kwargs", dict(kwargs))
    return out


def first_difference(plan_items: Mapping[str, str] | Sequence[str], model_items: Mapping[str, str] | Sequence[str],
                     what: str) -> str | None:
    """A sentence naming the first entry where the plan and the model differ, or ``None``."""
    if isinstance(plan_items, Mapping) and isinstance(model_items, Mapping):
        for key in list(plan_items) + [k for k in model_items if k not in plan_items]:
            a, b = plan_items.get(key), model_items.get(key)
            if a != b:
                kind, _, name = key.partition(":")
                return (f"{kind} {name!r}: the plan was made for {a or 'no such tensor'}, the model has "
                        f"{b or 'no such tensor'}")
        return None
    plan_list, model_list = list(plan_items), list(model_items)
    for i, (a, b) in enumerate(zip(plan_list, model_list)):
        if a != b:
            return f"{what} {i}: the plan has {a!r}, the model has {b!r}"
    if len(plan_list) != len(model_list):
        return f"the plan has {len(plan_list)} {what}s, the model {len(model_list)}"
    return None


def _batch_rows(recorded: Sequence[Mapping[str, Any]], given: Sequence[Mapping[str, Any]]) -> tuple[int, int] | None:
    """``(plan's rows, batch's rows)`` when ``given`` differs from ``recorded`` only in the rows
    of the tensors that had the plan's batch rows in their first dimension, else ``None``."""
    if not recorded or not recorded[0]["shape"] or len(recorded) != len(given):
        return None
    rows = recorded[0]["shape"][0]
    new_rows = given[0]["shape"][0] if given[0]["shape"] else None
    for old, new in zip(recorded, given):
        batched = bool(old["shape"]) and old["shape"][0] == rows
        want = dict(old, shape=[new_rows, *old["shape"][1:]]) if batched else old
        if new != want:
            return None
    return rows, int(new_rows)


def check_inputs(plan: Any, args: Sequence[Any] | torch.Tensor, kwargs: Mapping[str, Any] | None = None) -> None:
    """Raise :class:`PlanMismatchError` unless the batch ``args`` / ``kwargs`` has the shapes,
    dtypes and device types the plan was captured with, or is the same batch with fewer rows
    (see the module docstring). A plan without a recorded input signature (written by an older
    autoremat) passes."""
    recorded = getattr(plan, "inputs", None)
    if recorded is None:
        return
    if isinstance(args, torch.Tensor):
        args = (args,)
    given = input_signature(tuple(args), dict(kwargs or {}))
    rows = _batch_rows(recorded, given)
    if rows is not None:
        if rows[1] <= rows[0]:
            return
        raise PlanMismatchError(
            f"the batch has {rows[1]} rows, the plan was made for {rows[0]}: its memory predictions do not hold for a "
            "larger batch (a smaller one runs within them): capture and solve again with this batch (autoremat does "
            "not re-scale plans)")
    for old, new in zip(recorded, given):
        if old != new:
            raise PlanMismatchError(
                f"input {new['path']} is {new['dtype']}{new['shape']} on {new['device']}, but the plan was made "
                f"for {old['path']} = {old['dtype']}{old['shape']} on {old['device']}; its memory predictions do "
                "not hold for this batch: capture and solve again with this batch (autoremat does not re-scale plans)")
    if len(recorded) != len(given):
        raise PlanMismatchError(f"the batch holds {len(given)} tensors, the plan was made for {len(recorded)} "
                                f"({[r['path'] for r in recorded]}); capture and solve again with this batch")
