"""What a recomputed region's fx nodes are, read from the graph before anything runs: whether they
may draw random numbers (:func:`may_draw_random`, conservative: any module outside a list of
deterministic ``torch.nn`` layers, and any function whose name looks random, counts; what the
names miss, :class:`~autoremat.runtime.recompute_state.SeededProbe` finds when the region first
runs) and where a replay can stop (:func:`trim_replay`: its trailing ops that cannot save a tensor
for backward are dropped)."""

from __future__ import annotations

import operator
import re

import torch
import torch.fx
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["may_draw_random", "trim_replay"]

_RANDOM_NAME = re.compile(r"dropout|rand|bernoulli|normal|multinomial|rrelu|poisson|exponential|uniform|"
                          r"geometric|cauchy|random|shuffle", re.IGNORECASE)
_DETERMINISTIC_LEAVES = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
                         nn.ConvTranspose3d, nn.Linear, _BatchNorm, nn.LayerNorm, nn.GroupNorm, nn.ReLU,
                         nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Identity, nn.MaxPool1d, nn.MaxPool2d,
                         nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, nn.AdaptiveAvgPool1d,
                         nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool2d, nn.Embedding,
                         nn.Flatten, nn.Upsample, nn.Softmax, nn.LogSoftmax, nn.LeakyReLU, nn.ELU, nn.Hardswish,
                         nn.Hardsigmoid, nn.Mish, nn.ReLU6, nn.LocalResponseNorm)


def may_draw_random(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node]) -> bool:
    """Whether running ``nodes`` may consume random numbers (then recomputation replays the RNG).

    Conservative: a leaf module counts as deterministic only if it is one of the listed
    ``torch.nn`` layers; a function or method only if its name does not look random."""
    for n in nodes:
        if n.op == "call_module":
            if not isinstance(gm.get_submodule(str(n.target)), _DETERMINISTIC_LEAVES):
                return True
        elif n.op in ("call_function", "call_method"):
            name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", repr(n.target))
            if _RANDOM_NAME.search(str(name)):
                return True
    return False


# ops that never save a tensor for backward (their backward needs sizes, scalars or nothing)
_NO_SAVE_FUNCTIONS = frozenset({operator.add, operator.sub, operator.neg, torch.add, torch.sub, torch.cat,
                                torch.flatten, torch.reshape})
_NO_SAVE_METHODS = frozenset({"view", "view_as", "reshape", "flatten", "permute", "transpose", "contiguous",
                              "unsqueeze", "squeeze", "expand", "expand_as", "size", "dim", "add", "sub", "neg"})
_NO_SAVE_MODULES = (nn.Flatten, nn.Identity)


def trim_replay(gm: torch.fx.GraphModule, graph: torch.fx.Graph) -> bool:
    """Erase, from the end of a replay ``graph`` (output ``()``), the ops that cannot save a tensor
    for backward (adds, concatenations, views; a short list, anything else may save). Returns
    whether the graph then ends with an op that may save, i.e. whether a replay of it can be
    let to return (see :class:`CheckpointRegion`); ``False`` when it has no op left."""
    ops = [n for n in graph.nodes if n.op in ("call_module", "call_function", "call_method")]
    for n in reversed(ops):
        if n.op == "call_function":
            never = n.target in _NO_SAVE_FUNCTIONS
        elif n.op == "call_method":
            never = str(n.target) in _NO_SAVE_METHODS
        else:
            never = isinstance(gm.get_submodule(str(n.target)), _NO_SAVE_MODULES)
        if not never or n.users:
            return not never
        graph.erase_node(n)
    return False
