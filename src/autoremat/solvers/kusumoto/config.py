"""Options of the Kusumoto DP solvers ``dp-exact`` and ``dp-approx`` (see :mod:`autoremat.solvers.kusumoto`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from .._config import SolverConfig

__all__ = ["DPConfig", "DPExactConfig", "DPApproxConfig", "OBJECTIVES"]

OBJECTIVES = ("time", "memory")


@dataclass(frozen=True)
class DPConfig(SolverConfig):
    """Options shared by ``dp-exact`` and ``dp-approx``."""

    solver: ClassVar[str] = "dp-exact / dp-approx"
    objective: str = field(default="time", metadata={
        "help": f"one of {OBJECTIVES}: least recomputation time (time-centric), or least peak (memory-centric)"})
    time_slots: int = field(default=500, metadata={"help": "time quantisation of the DP's cost axis"})
    max_lower_sets: int = field(default=500, metadata={
        "help": "dp-exact: beyond this many lower sets, fall back to dp-approx (or raise, fallback=False)"})
    fallback: bool = field(default=True, metadata={"help": "dp-exact: fall back to dp-approx on large graphs"})
    max_tightenings: int = field(default=24, metadata={
        "help": "re-solves at a tighter budget when a DP plan fails the simulator check"})

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective={self.objective!r} is not supported; expected one of {OBJECTIVES}")
        for key, least in (("time_slots", 1), ("max_lower_sets", 1), ("max_tightenings", 0)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{key}={value!r} must be an int >= {least}")


@dataclass(frozen=True)
class DPExactConfig(DPConfig):
    """Options of ``dp-exact``."""

    solver: ClassVar[str] = "dp-exact"


@dataclass(frozen=True)
class DPApproxConfig(DPConfig):
    """Options of ``dp-approx``."""

    solver: ClassVar[str] = "dp-approx"
