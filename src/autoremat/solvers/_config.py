"""Typed solver options: one dataclass per solver, one policy for what it does not know.

Every registered solver reads its options through its config class (``ChenConfig``,
``DPConfig``, …, listed by name in :data:`autoremat.solvers.CONFIGS`). The policy, the same for
every solver: an option the solver does not accept is a ``ValueError`` that names the accepted
ones; a missing option takes the field's default; a value out of range is a ``ValueError`` from
the solver naming the option. ``solve(graph, budget, solver="auto", **options)`` hands each solver
it tries only the options its class accepts, and rejects an option that none of them accepts.

A solver receives ``config`` as ``None``, a mapping, or an instance of its class.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any, ClassVar, TypeVar

__all__ = ["SolverConfig", "option_names", "check_budget"]

C = TypeVar("C", bound="SolverConfig")


@dataclass(frozen=True)
class SolverConfig:
    """Base of the per-solver option classes (a solver without options uses it as is)."""

    solver: ClassVar[str] = "this solver"
    renamed: ClassVar[dict[str, str]] = {}
    """Options this solver had under another name: old name -> new name (refused with the new one)."""

    @classmethod
    def parse(cls: type[C], config: "Mapping[str, Any] | SolverConfig | None") -> C:
        """An instance from ``config``; an unknown option is a ``ValueError`` naming the accepted."""
        if isinstance(config, cls):
            return config
        if isinstance(config, SolverConfig):
            raise ValueError(f"{cls.solver}: config is a {type(config).__name__}, expected a {cls.__name__} "
                             "or a mapping of its options")
        given = dict(config or {})
        accepted = option_names(cls)
        for old in sorted(set(given) & set(cls.renamed)):
            raise ValueError(f"{cls.solver}: option {old!r} is now called {cls.renamed[old]!r} (two solvers used "
                             f"{old!r} for different things); pass {cls.renamed[old]}={given[old]!r}")
        unknown = sorted(set(given) - set(accepted))
        if unknown:
            listed = ", ".join(accepted) if accepted else "none"
            raise ValueError(f"{cls.solver}: unknown option(s) {unknown}; it accepts: {listed}")
        return cls(**given)

    def as_dict(self) -> dict[str, Any]:
        """Every option, defaults included (for solvers that keep a dict internally)."""
        return asdict(self)

    @classmethod
    def options_help(cls) -> dict[str, str]:
        """Option name -> help text (with its default)."""
        out = {}
        for f in fields(cls):
            default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
            out[f.name] = f"{f.metadata.get('help', '')} (default {default!r})"
        return out


def option_names(cls: type[SolverConfig]) -> list[str]:
    """The options ``cls`` accepts, in declaration order."""
    return [f.name for f in fields(cls)]


def check_budget(budget_bytes: Any) -> int:
    """A solver's ``budget_bytes`` argument, checked: an int of step-peak bytes, at least 0."""
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
        raise ValueError(f"budget_bytes={budget_bytes!r} must be an int >= 0 (bytes of step peak)")
    return int(budget_bytes)
