"""Options of the ``milp`` solver (see :mod:`autoremat.solvers._config` for the policy)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from .._config import SolverConfig

__all__ = ["MilpConfig"]


@dataclass(frozen=True)
class MilpConfig(SolverConfig):
    """Options of ``milp``."""

    solver: ClassVar[str] = "milp"
    k: int | None = field(default=None, metadata={
        "help": "most segments a plan may have (None: 12, or the most segments of a seed plan)"})
    time_limit_s: float = field(default=60.0, metadata={"help": "seconds HiGHS may search (seed solvers not counted)"})
    objective: str = field(default="time", metadata={"help": "'time' (least extra time) or 'memory' (least peak)"})
    threads: int | None = field(default=None, metadata={"help": "HiGHS threads (None: its default)"})
    seeds: bool = field(default=True, metadata={"help": "start from the other recomputation solvers' plans"})
    tails: bool = field(default=False, metadata={
        "help": "price plans as they run, recomputed segments replayed to their tails (fx graphs), not whole"})
