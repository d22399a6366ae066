"""Exceptions raised by autoremat."""

from __future__ import annotations

__all__ = ["InfeasibleBudgetError", "PlanMismatchError", "PlanFormatError", "CallCountError", "ModelRecomputesError"]


def _fmt_bytes(n: int) -> str:
    """Human-readable binary size, e.g. ``'1.50 MiB'``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable, please report")


class InfeasibleBudgetError(ValueError):
    """No plan of the requested solver fits the budget.

    ``min_budget_bytes`` is the smallest step-peak budget the solver can meet on this graph
    (``None`` only when the solver could not determine it); ``unoptimised_peak_bytes``, where
    known, is the step peak without recomputation, so that the message states the reachable
    range in bytes and in percent.
    """

    def __init__(self, budget_bytes: int, min_budget_bytes: int | None, *, solver: str,
                 unoptimised_peak_bytes: int | None = None, reason: str | None = None) -> None:
        self.budget_bytes = int(budget_bytes)
        self.reason = reason
        """Why the solver can reach no lower (a solver's own explanation), appended to the message."""
        self.min_budget_bytes = None if min_budget_bytes is None else int(min_budget_bytes)
        self.solver = solver
        self.unoptimised_peak_bytes = None if unoptimised_peak_bytes is None else int(unoptimised_peak_bytes)
        need = "unknown" if min_budget_bytes is None else _fmt_bytes(min_budget_bytes)
        peak = self.unoptimised_peak_bytes
        if min_budget_bytes is None:
            detail = ""
        elif peak:
            detail = (f" ({min_budget_bytes} bytes, {100.0 * min_budget_bytes / peak:.0f} % of the unoptimised "
                      f"step peak {_fmt_bytes(peak)}); plans reach {need} to {_fmt_bytes(peak)}")
        else:
            detail = f" ({min_budget_bytes} bytes)"
        asked = f"{_fmt_bytes(budget_bytes)} ({budget_bytes} bytes" + (
            f", {100.0 * budget_bytes / peak:.0f} %)" if peak else ")")
        super().__init__(
            f"solver {solver!r} found no plan within a step-peak budget of {asked}; the smallest budget it "
            f"can meet is {need}{detail}. Raise the budget, pass budget='min' (the least reachable; AutoRemat "
            "and prepare also take on_infeasible='min' to plan there when the budget is out of reach), "
            "lower the batch size, or try another solver (autoremat.SOLVERS)."
            + (f" {reason}" if reason else "")
        )

    def with_peak(self, unoptimised_peak_bytes: int) -> "InfeasibleBudgetError":
        """The same error, its message stating the reachable range in percent too."""
        if self.unoptimised_peak_bytes is not None:
            return self
        return InfeasibleBudgetError(self.budget_bytes, self.min_budget_bytes, solver=self.solver,
                                     unoptimised_peak_bytes=unoptimised_peak_bytes, reason=self.reason)


class PlanMismatchError(ValueError):
    """A plan was applied to a model (or simulated on a graph) it was not made for."""


class ModelRecomputesError(ValueError):
    """The model recomputes by itself (Hugging Face ``gradient_checkpointing``, hand-placed
    ``torch.utils.checkpoint`` calls, modules run inside a custom ``autograd.Function`` whose
    backward runs them again): the capture refuses it (:mod:`autoremat.capture.own_recompute`)."""


class CallCountError(RuntimeError):
    """A training step ran a module a number of times other than the step the plan was made for,
    and the plan recomputes calls of that module one by one (:mod:`autoremat.runtime.per_call`)."""


class PlanFormatError(ValueError):
    """A plan (a dict, JSON text or a plan file) is malformed: a field is missing, has the wrong
    type or is out of range, or the segments contradict each other.

    ``field`` is the dotted path of the offending field (``"segments[2].recompute"``; ``""``
    for the document as a whole). The message names the field, what was found and what is
    expected.
    """

    def __init__(self, field: str, problem: str, *, source: str | None = None) -> None:
        self.field = field
        self.problem = problem
        self.source = source
        where = f"{source}: " if source else ""
        what = f"plan field {field!r}: " if field else "plan: "
        super().__init__(f"{where}{what}{problem}")
