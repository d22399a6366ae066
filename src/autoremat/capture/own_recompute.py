"""Models that recompute by themselves: fx must not trace through their checkpoints, and modules
run inside a custom ``autograd.Function`` are refused.

A ``forward`` can already recompute in backward, by code of its own:

* **hand-placed checkpoints**: ``torch.utils.checkpoint.checkpoint`` (and what calls it:
  ``checkpoint_sequential``, timm's ``set_grad_checkpointing()``, ``checkpoint_wrapper``,
  selective checkpointing). A module-level capture runs the model's own code, sees the
  checkpointed calls run again in backward (``meta["recomputed_by_model"]``) and says so. But fx
  traces *through* a non-reentrant checkpoint, so the traced graph, and the patched model that
  runs it, silently dropped the user's recomputation: measured on a 4-block MLP with a checkpoint
  around each block (CPU storage counter), the unpatched prediction was 2.8x the step's peak and
  the "50 %" plan's step measured 1.33x the user's own step. Decision: the fx trace refuses a node
  traced inside a checkpoint (:class:`SelfCheckpointTraceError`), so ``mode="auto"`` captures such
  a model at module level, which keeps the model's checkpoints (a reentrant checkpoint already
  went there: it runs without gradients, which fx refuses). There, a node module called inside
  a non-reentrant checkpoint saves the checkpoint's arguments (:func:`checkpoint_held`): the
  checkpoint holds them to its backward, and its own saved-tensor hooks hide every save inside.
* **modules run inside a custom** ``torch.autograd.Function``: its ``forward`` runs them without
  gradients and its ``backward`` runs them again itself (reversible layers: the Hugging Face
  Reformer's). Captured at module level, the layers' ops were recorded as nodes without
  gradients and the Function's saves pointed at outputs the graph had freed: the simulator failed
  on the unpatched plan (``KeyError``). Its backward is code autoremat neither sees nor could
  plan. Decision: the module-level capture refuses such a model with
  :class:`~autoremat.errors.ModelRecomputesError`, naming the module, the Function and where the
  model applies it. The reentrant checkpoint (``CheckpointFunction``, which saves only its inputs)
  is the exception, handled as the checkpoints above; a Function that runs no module (Bloom's
  GELU) is an op like any other.

Both checks walk up the Python stack (at each traced fx node; at each module call of the
recorded step): the frames of ``checkpoint`` and of ``Function.apply`` (whose ``forward`` runs
inside it) mark the calls; calls made by autoremat's own code are told apart by their caller's file.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
from collections.abc import Iterator
from types import FrameType
from typing import Any

import torch
import torch.utils.checkpoint as _ckpt
from torch import nn

from ..errors import ModelRecomputesError
from ._recorder import tensors_in

__all__ = ["SelfCheckpointTraceError", "checkpoint_call", "checkpoint_held", "function_call", "in_reentrant_checkpoint", "refusing"]

_CHECKPOINT_FN = inspect.unwrap(_ckpt.checkpoint).__code__
_REENTRANT = _ckpt.CheckpointFunction.forward.__code__
_CHECKPOINT = {_CHECKPOINT_FN, _REENTRANT}
_APPLY = torch.autograd.Function.apply.__func__.__code__  # type: ignore[attr-defined]
_OURS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


class SelfCheckpointTraceError(TypeError):
    """fx would trace through the model's own ``torch.utils.checkpoint`` call and drop it."""


def _user_caller(frame: FrameType) -> FrameType | None:
    """The first frame above ``frame`` outside torch's own code (its wrappers: dynamo's
    ``_disable_dynamo``, ``checkpoint`` calling ``CheckpointFunction.apply``)."""
    caller = frame.f_back
    while caller is not None and os.path.abspath(caller.f_code.co_filename).startswith(_TORCH):
        caller = caller.f_back
    return caller


def _where(frame: FrameType | None) -> str:
    if frame is None:
        return "an unknown caller"
    return f"{frame.f_code.co_name} ({frame.f_code.co_filename}:{frame.f_lineno})"


def _enclosing(match: Any) -> Iterator[tuple[FrameType, FrameType | None]]:
    """The frames of the running code that ``match`` accepts and whose caller is not autoremat's,
    innermost first, each with that caller."""
    frame: FrameType | None = sys._getframe()
    while frame is not None:
        if match(frame):
            caller = _user_caller(frame)
            if caller is None or not os.path.abspath(caller.f_code.co_filename).startswith(_OURS):
                yield frame, caller
        frame = frame.f_back


def checkpoint_call() -> str | None:
    """The model's own ``torch.utils.checkpoint`` call the running code is inside, as a phrase
    (``"torch.utils.checkpoint.checkpoint, called in forward (net.py:12)"``), else ``None``."""
    found = next(_enclosing(lambda f: f.f_code in _CHECKPOINT), None)
    return None if found is None else f"torch.utils.checkpoint.checkpoint, called in {_where(found[1])}"


def checkpoint_held() -> list[tuple[int, int]]:
    """The storages (key, bytes) the model's own non-reentrant checkpoints around the running code
    hold until their backward: their ``args`` and ``kwargs`` (a reentrant one saves them itself,
    through the saved-tensor hooks the capture sees). Their pack hooks hide the saves inside from
    the capture, and nothing else says the inputs stay: without them a model ending in
    checkpointed blocks was predicted 0.71x its step."""
    held: dict[int, int] = {}
    for frame, _caller in _enclosing(lambda f: f.f_code is _CHECKPOINT_FN and f.f_locals.get("use_reentrant") is False):
        for t in tensors_in((frame.f_locals.get("args"), frame.f_locals.get("kwargs"))):
            held[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
    return list(held.items())


def in_reentrant_checkpoint() -> bool:
    """Whether the running code is inside the model's own reentrant checkpoint (its Function's
    ``forward``: the outputs get their history, and the inputs are saved, once it returns)."""
    return next(_enclosing(lambda f: f.f_code is _REENTRANT), None) is not None


def function_call() -> str | None:
    """The custom ``autograd.Function`` (other than the reentrant checkpoint's) whose ``forward``
    the running code is inside, as a phrase, else ``None``."""
    found = next(_enclosing(lambda f: f.f_code is _APPLY and f.f_locals.get("cls") is not _ckpt.CheckpointFunction),
                 None)
    if found is None:
        return None
    name = getattr(found[0].f_locals.get("cls"), "__qualname__", "?")
    return f"the forward of the custom torch.autograd.Function {name}, applied in {_where(found[1])}"


@contextlib.contextmanager
def refusing(model: nn.Module) -> Iterator[None]:
    """Within: a call of a module of ``model`` inside a custom ``autograd.Function``'s forward
    (:func:`function_call`) raises :class:`~autoremat.errors.ModelRecomputesError` (forward
    pre-hooks, taken off on exit)."""
    def hook(path: str) -> Any:
        def check(module: nn.Module, _args: tuple) -> None:
            call = function_call()
            if call is not None:
                raise ModelRecomputesError(
                    f"{path or 'the model'} ({type(module).__name__}) runs inside {call}: its backward runs the "
                    "module's code again by itself (reversible layers), which autoremat neither sees nor can plan. "
                    "autoremat cannot plan this model; train it without autoremat, or call the layers outside "
                    "the Function (plain calls, or torch.utils.checkpoint, which autoremat understands)")
        return check
    handles = [m.register_forward_pre_hook(hook(p)) for p, m in model.named_modules()
               if not isinstance(m, torch.jit.ScriptModule)]  # (no hooks; nor does it run Python Functions)
    try:
        yield
    finally:
        for h in handles:
            h.remove()
