"""Modules registered under more than one path: one object, several names.

Diffusers' ``get_activation`` hands every ResNet block, the time embedding and the output the same
``nn.SiLU()``; T5 and BART register their embedding as ``shared`` and as each stack's
``embed_tokens``. ``model.named_modules()`` names such a module once (its first path), and the
runtime patches the object, so whatever it does to the module happens at every path.

Decision (module-level capture):

* A module whose paths are all node paths (T5's embedding: ``shared``, ``encoder.embed_tokens``,
  ``decoder.embed_tokens`` are each a node module at top level) is one module run ``n`` times per
  step, named by its first path, as a weight-shared layer is (:mod:`autoremat.runtime.per_call`).
* A module with a path inside another node module (the diffusers activation, also called inside
  every ResNet block) is not a node: a plan naming one of its calls would be counted by the runtime
  at every path, where capture counted the top-level calls only. Its top-level calls run as glue
  (never recomputed); inside a block captured op by op its ops belong to the calling module's scope.

Before this (diffusers' ``UNet2DConditionModel``; a plain-torch copy of its pattern in
``tests/capture/test_aliased_modules.py``): the block scopes registered one hook per path on the
one object, the stack kept stale entries, the ops after an activation were named as its own
(``mid_block.resnets.0.nonlinearity:add.Tensor``), and ``apply`` refused the plan
(``PlanMismatchError``: the model "does not have" that path) or the prediction missed by 8 %.
"""

from __future__ import annotations

from torch import nn

__all__ = ["aliased"]


def aliased(model: nn.Module) -> dict[int, tuple[str, ...]]:
    """``id(module) -> its paths`` for every submodule of ``model`` registered under more than one path."""
    paths: dict[int, list[str]] = {}
    for path, mod in model.named_modules(remove_duplicate=False):
        paths.setdefault(id(mod), []).append(path)
    return {k: tuple(v) for k, v in paths.items() if len(v) > 1}
