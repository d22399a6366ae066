"""Checks of the ``autoremat`` command's arguments, run before any capture or training.

A bad ``--budget``, ``--device`` or output path used to surface after minutes of capture (or
as a raw traceback). Every check here raises ``ValueError`` with one line that names the
option, the value and what to give instead; :func:`autoremat.cli.main` prints it and exits 2.

Decision: ``--budget -1GB`` (a value starting with ``-``, which argparse would read as an
option) is passed through as the budget's value by :func:`normalise_argv`, so that the user
gets the budget's own error message rather than argparse's "expected one argument".
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from collections.abc import Sequence

from .budget import check_budget

__all__ = ["normalise_argv", "check_args", "check_output_path", "check_device"]

_VALUE_OPTIONS = ("--budget",)


def normalise_argv(argv: Sequence[str]) -> list[str]:
    """``["--budget", "-1GB"]`` -> ``["--budget=-1GB"]`` (see the module docstring)."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok in _VALUE_OPTIONS and i + 1 < len(argv) and argv[i + 1].startswith("-") and argv[i + 1] != "--":
            out.append(f"{tok}={argv[i + 1]}")
            i += 2
            continue
        out.append(tok)
        i += 1
    return out


def check_device(device: str) -> None:
    """``cpu``, ``meta`` or an available ``cuda[:N]``."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"--device {device!r} is not a device; give cpu, cuda, cuda:N or meta") from None
    if dev.type not in ("cpu", "cuda", "meta"):
        raise ValueError(f"--device {device!r}: autoremat runs on cpu, cuda, cuda:N or meta, not {dev.type}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device!r}: this PyTorch build has no usable CUDA device "
                             f"(torch {torch.__version__}, torch.cuda.is_available() is False); use --device cpu "
                             "or --device meta")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"--device {device!r}: only {torch.cuda.device_count()} CUDA device(s) visible; "
                             f"give cuda:0..cuda:{torch.cuda.device_count() - 1}")


def check_output_path(option: str, path: str) -> None:
    """A file autoremat can create or overwrite: its directory exists and is writable."""
    if not path:
        raise ValueError(f"{option}: give a file path")
    if os.path.isdir(path):
        example = os.path.join(path, "plan.json" if option == "--out" else "plan.png")
        raise ValueError(f"{option} {path!r} is a directory; give a file path such as {example!r}")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ValueError(f"{option} {path!r}: the directory {parent!r} does not exist; create it first "
                         f"(mkdir -p {parent})")
    if not os.access(parent, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ValueError(f"{option} {path!r}: not writable by this user; choose another location")


def _positive(option: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise ValueError(f"{option} {value}: must be >= 1")


def check_args(args: argparse.Namespace) -> None:
    """Every check that can be made before capture; raises ``ValueError`` (one line)."""
    budget = getattr(args, "budget", None)
    if budget is not None:
        try:
            check_budget(budget)
        except ValueError as err:
            raise ValueError(f"--budget: {err}") from None
    plan = getattr(args, "plan", None)
    if plan is not None and not os.path.isfile(plan):
        raise ValueError(f"--plan {plan!r}: no such file; write one with "
                         "`autoremat plan --model MODEL --out plan.json`")
    if getattr(args, "device", None) is not None:
        check_device(args.device)
    for option, attr in (("--out", "out"), ("--plot", "plot")):
        if getattr(args, attr, None) is not None:
            check_output_path(option, getattr(args, attr))
    if getattr(args, "plot", None) is not None and importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plot needs matplotlib, which is not installed (pip install matplotlib)")
    for option, attr in (("--steps", "steps"), ("--top", "top"), ("--batch-size", "batch_size"),
                         ("--timing-pairs", "timing_pairs")):
        _positive(option, getattr(args, attr, None))
    threads = getattr(args, "threads", None)
    if threads is not None and threads < 0:
        raise ValueError(f"--threads {threads}: must be >= 0 (0: PyTorch's own count, one per core)")
