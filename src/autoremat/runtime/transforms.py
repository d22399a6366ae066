"""Whether the runtime acts on a forward: PyTorch's autograd records it and takes saved-tensor hooks.

``torch.func``'s transforms (``grad``, ``vjp``, ``jacrev``, ``hessian``, and ``vmap`` of them:
per-sample gradients, model ensembles) compute gradients at their own autograd levels, which refuse
saved-tensor hooks ("torch.func.{grad, vjp, jacrev, hessian} don't yet support saved tensor
hooks"). Recomputed regions and offloading are both built on those hooks, so a patched model raised
there where the user's model runs (measured, CPU: ``vmap(grad(...))`` of ``functional_call`` on a
patched MLP, fx and module-level plans, recomputing or offloading).

Decided: under any ``torch.func`` transform the patched model runs as the user's model (no
recomputation, no offloading: the memory of the unpatched model), said once per process with a
warning; outside one it runs the plan as before. Every runtime entry that would push hooks asks
:func:`records` instead of ``torch.is_grad_enabled()``."""

from __future__ import annotations

import logging

import torch

__all__ = ["records"]

logger = logging.getLogger("autoremat.runtime")

_SAID: list[bool] = []


def records() -> bool:
    """Gradients enabled and no ``torch.func`` transform running (module docstring)."""
    if not torch.is_grad_enabled():
        return False
    if torch.compiler.is_compiling() or torch._C._functorch.peek_interpreter_stack() is None:
        # under torch.compile the callers trace their regions as checkpoint operators (the
        # interpreter stack there is the compiler's, not a user's transform)
        return True
    if not _SAID:
        _SAID.append(True)
        logger.warning("autoremat: the patched model runs under a torch.func transform (grad, vjp, jacrev, vmap), "
                       "whose autograd takes no saved-tensor hooks: it runs as your model there, without "
                       "recomputation or offloading (its memory is the unpatched model's; said once)")
    return False
