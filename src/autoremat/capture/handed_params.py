"""The parameters a module call uses: its own, and those it is handed.

A module-level node's parameters were its module's (``module.parameters()``). A call can use
parameters that belong to another module, handed to it as an argument: the Hugging Face Perceiver's
``PerceiverEmbeddingDecoder`` is called with the input embedding layer and multiplies by its weight
(tied input and output embeddings), and a functional decoder called with ``embed.weight`` does the
same. Its backward makes that weight's gradient, the first use in backward, which the cost model
put at the embedding's own backward, at the end of the step: the gradient was missing for the whole
backward (32 KB on a small Perceiver; the least plan predicted 0.925x its measured peak). Decision:
a call's parameters are its module's, the parameters of the modules among its arguments (top level,
in lists, tuples and dicts) and the parameter tensors among its arguments, or whose views are (the
Perceiver's decoder queries: its trainable position embeddings expanded over the batch, read by a
layer norm; their gradient was never allocated, since the module returning the view has no
successor in the graph).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["call_params"]


def _handed(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    if isinstance(obj, nn.Module):
        yield from obj.parameters()
    elif isinstance(obj, nn.Parameter):
        yield obj
    elif isinstance(obj, torch.Tensor) and isinstance(obj._base, nn.Parameter):  # a view of one (expanded)
        yield obj._base
    elif depth < 2 and isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _handed(x, depth + 1)
    elif depth < 2 and isinstance(obj, Mapping):
        for x in obj.values():
            yield from _handed(x, depth + 1)


def call_params(module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any],
                names: Mapping[int, str]) -> list[str]:
    """The sorted names (``names``: ``id`` -> name, the parameters that require grad) of the
    parameters a call of ``module`` with ``args`` and ``kwargs`` uses (module docstring)."""
    found = {names[id(p)] for p in module.parameters() if id(p) in names}
    found |= {names[id(p)] for p in _handed((args, kwargs)) if id(p) in names}
    return sorted(found)
