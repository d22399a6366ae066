"""Budget parsing: the one place that turns what a user writes into a step-peak budget in bytes.

Accepted forms (anything else is a ``ValueError`` naming the value and these forms):

* an ``int`` number of bytes (``>= 0``; numpy integers too);
* a size string: ``"6GB"``, ``"6 GB"``, ``"512MiB"``, ``"1.5GiB"``, ``"800kB"``, ``"1000B"``
  (``kB/MB/GB/TB`` are powers of 1000, ``KiB/MiB/GiB/TiB`` powers of 1024);
* a fraction of the graph's unoptimised step peak: ``"40%"`` or a float in ``(0, 1]``;
* ``"auto"``: the device's free memory (NVML, else ``torch.cuda.mem_get_info``; on a CPU-only
  machine the host's available memory), minus what is already resident, minus a safety margin;
* ``"min"``: the least step peak a solver reaches on the graph (``autoremat.solve`` and the
  integrations resolve it with :func:`autoremat.solvers.least.least_budget`; it needs a graph,
  so :func:`parse_budget` itself refuses it).

What happens when a budget is below what any plan reaches is the caller's choice
(``on_infeasible``, see :data:`ON_INFEASIBLE`): ``"error"`` raises
:class:`~autoremat.errors.InfeasibleBudgetError`, whose message states the reachable range in
bytes and in percent of the unoptimised step peak (:func:`reachable_range_text`); ``"min"``
plans at the least reachable budget instead and says so.
"""

from __future__ import annotations

import logging
import numbers
import os
import re
from decimal import Decimal
from typing import Any

__all__ = ["parse_budget", "check_budget", "is_min", "is_auto", "device_free_bytes", "reachable_range_text",
           "check_on_infeasible", "ACCEPTED_FORMS", "DEFAULT_MARGIN", "ON_INFEASIBLE"]

logger = logging.getLogger(__name__)

ACCEPTED_FORMS = ('an int number of bytes, a size string such as "6GB" or "512MiB", a fraction of '
                  'the unoptimised step peak such as "40%" or 0.4, "auto" (free device memory) or "min" '
                  '(the least step peak a solver reaches)')
ON_INFEASIBLE = ("error", "min")
"""What to do when no plan meets the budget: raise (with the reachable range), or plan at the least."""
DEFAULT_MARGIN = 0.10
"""Fraction of the free device memory kept back by ``"auto"`` (allocator fragmentation, CUDA
context, workspace the profile did not see). Override with ``AUTOREMAT_MARGIN``."""

_UNITS = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def _bad(value: Any, why: str = "") -> ValueError:
    extra = f" ({why})" if why else ""
    return ValueError(f"budget={value!r} is not understood{extra}; expected {ACCEPTED_FORMS}")


def _word(budget: Any) -> str | None:
    return budget.strip().lower() if isinstance(budget, str) else None


def is_min(budget: Any) -> bool:
    """Whether ``budget`` is ``"min"`` (the least step peak a solver reaches)."""
    return _word(budget) == "min"


def is_auto(budget: Any) -> bool:
    """Whether ``budget`` is ``"auto"`` (free device memory minus a margin)."""
    return _word(budget) == "auto"


def check_budget(budget: Any) -> None:
    """Syntax and range check of a budget before anything is captured: every form
    :func:`parse_budget` accepts, plus ``"auto"`` and ``"min"``; a ``ValueError`` otherwise."""
    if is_min(budget) or is_auto(budget):
        return
    parse_budget(budget, unoptimised_peak_bytes=1)


def check_on_infeasible(value: Any, name: str = "on_infeasible") -> str:
    """``value`` if it is one of :data:`ON_INFEASIBLE`, else a ``ValueError`` naming them."""
    if not isinstance(value, str) or value.strip().lower() not in ON_INFEASIBLE:
        raise ValueError(f"{name}={value!r} must be 'error' (raise, stating the reachable range) or 'min' "
                         "(plan at the least reachable budget instead, and say so)")
    return value.strip().lower()


def reachable_range_text(least_bytes: int, unoptimised_peak_bytes: int, *, short: bool = False) -> str:
    """``"5.52 MiB (64 %) to 8.60 MiB (100 %, no recomputation)"``: the step peaks plans reach
    (``short``: without ``", no recomputation"``)."""
    from .errors import _fmt_bytes

    pct = 100.0 * least_bytes / unoptimised_peak_bytes if unoptimised_peak_bytes else 100.0
    return (f"{_fmt_bytes(least_bytes)} ({pct:.0f} %) to {_fmt_bytes(unoptimised_peak_bytes)} "
            f"(100 %{'' if short else ', no recomputation'})")


def device_free_bytes(device: Any = None) -> int:
    """Free memory on ``device``: NVML or ``torch.cuda`` on a GPU (no more than this process's
    ``torch.cuda.set_per_process_memory_fraction`` leaves), available host memory otherwise."""
    dev = str(device) if device is not None else "cpu"
    if dev.startswith("cuda"):
        import torch

        index = torch.device(dev).index
        index = torch.cuda.current_device() if index is None else index
        return min(_gpu_free_bytes(index), _fraction_free_bytes(index))
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def _gpu_free_bytes(index: int) -> int:
    import torch

    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            return int(pynvml.nvmlDeviceGetMemoryInfo(handle).free)
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # NVML is optional on some drivers: fall back, and say so
        logger.info("NVML unavailable (%s); using torch.cuda.mem_get_info", exc)
        free, _total = torch.cuda.mem_get_info(index)
        return int(free)


def _fraction_free_bytes(index: int) -> int:
    """What the caching allocator still gives this process under its memory fraction (the device's
    free memory does not see the cap: a step planned to it would run out of memory)."""
    import torch

    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    cap = fraction(index) if fraction is not None else 1.0
    if cap >= 1.0:
        return 2**63 - 1
    total = torch.cuda.get_device_properties(index).total_memory
    return max(0, int(cap * total) - int(torch.cuda.memory_allocated(index)))


def parse_budget(
    budget: Any,
    *,
    unoptimised_peak_bytes: int | None = None,
    device: Any = None,
    resident_bytes: int = 0,
    margin: float | None = None,
) -> int:
    """Turn ``budget`` into a step-peak budget in bytes.

    ``unoptimised_peak_bytes`` is needed for fractions; ``device``, ``resident_bytes`` and
    ``margin`` for ``"auto"``.
    """
    if isinstance(budget, bool) or type(budget).__name__ in ("bool", "bool_"):
        raise _bad(budget, "a bool is not a budget")
    if isinstance(budget, numbers.Integral):  # numpy integers too
        budget = int(budget)
    elif isinstance(budget, numbers.Real):  # numpy floating scalars (np.float64 subclasses float)
        budget = float(budget)
    if isinstance(budget, int):
        if budget < 0:
            raise _bad(budget, "bytes must be >= 0")
        return budget
    if isinstance(budget, float):
        if not 0.0 < budget <= 1.0:
            raise _bad(budget, "a float budget is a fraction in (0, 1]; give bytes as an int or a size string")
        return _fraction(budget, budget, unoptimised_peak_bytes)
    if not isinstance(budget, str):
        raise _bad(budget, f"type {type(budget).__name__}")
    text = budget.strip()
    if text.lower() == "min":
        raise ValueError("budget='min' is the least step peak a solver reaches on a graph: give it to "
                         "autoremat.solve (or an integration), which resolves it, not to parse_budget")
    if text.startswith("-"):
        raise _bad(budget, "a budget cannot be negative")
    if text.lower() == "auto":
        if margin is None:
            env = os.environ.get("AUTOREMAT_MARGIN")
            try:
                margin = DEFAULT_MARGIN if env is None else float(env)
            except ValueError:
                raise ValueError(f"AUTOREMAT_MARGIN={env!r} must be a fraction in [0, 1)") from None
        if not 0.0 <= margin < 1.0:
            raise ValueError(f"margin={margin!r} must be a fraction in [0, 1)")
        free = device_free_bytes(device)
        step = int(free * (1.0 - margin)) - int(resident_bytes)
        if step <= 0:
            raise ValueError(f"budget='auto': the device has {free} bytes free, which after a "
                             f"{margin:.0%} margin leaves nothing beyond the {resident_bytes} resident "
                             "bytes; give an explicit budget")
        logger.info("budget='auto': %d bytes free on %s, %d resident, margin %.0f%% -> %d bytes",
                    free, device or "cpu", resident_bytes, margin * 100, step)
        return step
    if text.endswith("%"):
        try:
            pct = float(text[:-1])
        except ValueError:
            raise _bad(budget) from None
        if not 0.0 < pct <= 100.0:
            raise _bad(budget, "a percentage must be in (0, 100]")
        return _fraction(budget, Decimal(text[:-1].strip()) / 100, unoptimised_peak_bytes)
    m = _SIZE_RE.match(text)
    if not m:
        raise _bad(budget)
    # Decimal, not float: "2.01kB" is 2010 bytes, not int(2009.9999999999998)
    number, unit = Decimal(m.group(1)), m.group(2).lower()
    if unit == "":
        if number != int(number):
            raise _bad(budget, "a unit-less size must be a whole number of bytes")
        return int(number)
    if unit not in _UNITS:
        raise _bad(budget, f"unknown unit {m.group(2)!r}")
    return int(number * _UNITS[unit])


def _fraction(original: Any, frac: float | Decimal, unoptimised: int | None) -> int:
    if unoptimised is None:
        raise ValueError(f"budget={original!r} is relative to the unoptimised step peak, which is "
                         "unknown here; pass a graph (autoremat.solve does) or give bytes")
    # exact decimal arithmetic: 29% of 100 bytes is 29, not int(28.999999999999996)
    exact = frac if isinstance(frac, Decimal) else Decimal(repr(frac))
    return int(exact * int(unoptimised))
