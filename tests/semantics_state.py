"""Model kinds whose forward reads Python state outside its own modules' attributes (issue 29):
attributes of other objects (a plain config object, an object shared by several blocks), module
globals (a flag, a value read in a helper function, an attribute of a module object), closure
cells, class-level defaults overridden on the instance, and a branch on ``is_fx_tracing()``.

Module-level state (globals, closure cells) is shared by the reference and the patched model:
:func:`reset` puts it back before each run (``Case.reset``)."""

from __future__ import annotations

import types

import torch
from torch import nn

W = 16

SCALE = 2.0
GATE = True
FLAGS = types.ModuleType("semantics_flags")  # e.g. ``from project import config``; ``config.MULT``
FLAGS.MULT = 1.5


class PlainConfig:
    """A plain object (neither a dataclass nor a namespace) holding the model's options."""

    def __init__(self) -> None:
        self.scale = 2.0
        self.gate = True


class OtherObject(nn.Module):
    """Reads ``self.cfg.scale`` and branches on ``self.cfg.gate``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(W, W), nn.Linear(W, W), nn.Linear(W, W)
        self.cfg = PlainConfig()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x)) * self.cfg.scale
        if self.cfg.gate:
            h = h + torch.tanh(self.c(h))
        return self.b(h)


def change_config_value(m: nn.Module) -> None:
    m.cfg.scale = 0.5


def change_config_branch(m: nn.Module) -> None:
    m.cfg.gate = False


class SharedState:
    def __init__(self) -> None:
        self.gain = 1.0


class SharedBlock(nn.Module):
    def __init__(self, state: SharedState) -> None:
        super().__init__()
        self.l = nn.Linear(W, W)
        self.state = state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.l(x)) * self.state.gain + x


class Shared(nn.Module):
    """Three custom blocks reading one object they share."""

    def __init__(self) -> None:
        super().__init__()
        state = SharedState()
        self.blocks = nn.ModuleList(SharedBlock(state) for _ in range(3))
        self.head = nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)


def change_shared(m: nn.Module) -> None:
    m.blocks[0].state.gain = 0.25


def _scaled(h: torch.Tensor) -> torch.Tensor:
    return h * SCALE * FLAGS.MULT


class GlobalFlags(nn.Module):
    """Branches on a module-level flag; a helper function reads a global value and an attribute
    of a module object."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(W, W), nn.Linear(W, W), nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _scaled(torch.relu(self.a(x)))
        if GATE:
            h = h + torch.tanh(self.c(h))
        return self.b(h)


def change_global_values(m: nn.Module) -> None:
    global SCALE
    SCALE = 0.5
    FLAGS.MULT = 3.0


def change_global_branch(m: nn.Module) -> None:
    global GATE
    GATE = False


def _closure_kind() -> tuple[type[nn.Module], types.FunctionType]:
    scale, gate = 2.0, True

    class ClosureFlags(nn.Module):
        """Reads two cells of the function that defined it."""

        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = nn.Linear(W, W), nn.Linear(W, W), nn.Linear(W, W)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.a(x)) * scale
            if gate:
                h = h + torch.tanh(self.c(h))
            return self.b(h)

    def set_cells(new_scale: float, new_gate: bool) -> None:
        nonlocal scale, gate
        scale, gate = new_scale, new_gate

    return ClosureFlags, set_cells  # type: ignore[return-value]


ClosureFlags, set_cells = _closure_kind()


def change_cell_value(m: nn.Module) -> None:
    set_cells(0.5, True)


def change_cell_branch(m: nn.Module) -> None:
    set_cells(2.0, False)


class ClassDefaults(nn.Module):
    """Options as class attributes, overridden on the instance later (``model.gain = ...``)."""

    gain = 2.0
    gate = True

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(W, W), nn.Linear(W, W), nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x)) * self.gain
        if self.gate:
            h = h + torch.tanh(self.c(h))
        return self.b(h)


def override_default_value(m: nn.Module) -> None:
    m.gain = 0.5


def override_default_branch(m: nn.Module) -> None:
    m.gate = False


class FxTracingBranch(nn.Module):
    """Runs other ops while fx traces it than when it runs (``is_fx_tracing()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(W, W), nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        if not torch.fx._symbolic_trace.is_fx_tracing():
            h = h * 2.0
        return self.b(h)


def reset() -> None:
    """Module-level state back to its initial values."""
    global SCALE, GATE
    SCALE, GATE = 2.0, True
    FLAGS.MULT = 1.5
    set_cells(2.0, True)
