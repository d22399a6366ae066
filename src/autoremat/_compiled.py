"""Modules wrapped by ``torch.compile``: autoremat captures and patches the module inside.

``torch.compile(model)`` returns an ``OptimizedModule`` that holds ``model`` as ``_orig_mod``
(same parameters and buffers) and runs it through Dynamo. Capturing the wrapper would profile
Dynamo compiling autoremat's own hooks, and patching it would not reach the code Dynamo traces;
so :func:`autoremat.capture`, :func:`autoremat.apply`, :func:`autoremat.restore` and
:func:`autoremat.is_patched` work on ``_orig_mod``. A patched module compiles with its regions as
checkpoint operators (:func:`autoremat.runtime.region.compiled_region`); Dynamo recompiles when
``apply`` or ``restore`` changes the module's ``forward`` after a compiled step.
"""

from __future__ import annotations

import sys

from torch import nn

__all__ = ["uncompiled"]


def uncompiled(model: nn.Module) -> nn.Module:
    """The module a ``torch.compile`` wrapper holds (``_orig_mod``), else ``model`` itself."""
    if "torch._dynamo" not in sys.modules:  # nothing was compiled: importing Dynamo would cost ~1 s
        return model
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:  # pragma: no cover - torch without Dynamo
        return model
    while isinstance(model, OptimizedModule):
        model = model._orig_mod
    return model
