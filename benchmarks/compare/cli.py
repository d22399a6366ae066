"""The command line: ``python benchmarks/compare [options]`` (see the package docstring)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from .driver import render, run, run_batch_only
from .model import Options
from .settings import AUTOREMAT_BUDGETS, COMPILE_BUDGETS, DEFAULT_MODELS, DEFAULT_OUT, QUICK_MODELS, ROOT


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def _per_model(text: str, value: Callable[[str, str], int]) -> dict[str, int]:
    """``"a=x,b=y"`` -> ``{"a": value("a=x", "x"), ...}`` (``value`` gets the item, for its error)."""
    out = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        k, _, v = item.partition("=")
        out[k.strip()] = value(item, v.strip())
    return out


def _sizes(text: str) -> dict[str, int]:
    """``--batch-budgets``: ``"resnet50=16MiB"`` -> ``{"resnet50": 16777216}``."""
    from autoremat.budget import parse_budget

    return _per_model(text, lambda _item, v: int(parse_budget(v)))


def _batch_size(item: str, value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise SystemExit(f"--batch-sizes: {item!r} is not MODEL=N with N a positive integer (e.g. resnet50=16)")
    return int(value)


def _batch_sizes(text: str) -> dict[str, int]:
    """``--batch-sizes``: ``"resnet50=16,gpt2=8"`` -> ``{"resnet50": 16, "gpt2": 8}``."""
    return _per_model(text, _batch_size)


def parser(description: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description or __doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=None, help=f"comma-separated (default {','.join(DEFAULT_MODELS)}; "
                                                  "any zoo name or gpt2)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds (default 5; --quick 1)")
    p.add_argument("--steps-per-round", type=int, default=None, help="steps per configuration per round (default 2)")
    p.add_argument("--quick", action="store_true",
                   help="smoke mode: the zoo mlp, 1 round, one compile budget (aot_eager_decomp_partition backend), "
                        "one autoremat budget, a small batch-size task")
    p.add_argument("--out", type=Path, default=None, help=f"output folder (default {DEFAULT_OUT.relative_to(ROOT)})")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (default 1: on a shared 2-core machine more threads make timings "
                        "erratic)")
    p.add_argument("--compile-backend", default=None,
                   help="torch.compile backend (default inductor; --quick aot_eager_decomp_partition)")
    p.add_argument("--compile-budgets", default=None, help="comma-separated activation_memory_budget values")
    p.add_argument("--compile-timeout", type=float, default=150.0,
                   help="seconds one compile may take before it is abandoned and the model's other budgets skipped "
                        "(0: no limit)")
    p.add_argument("--budgets", default=None, help="autoremat budgets as fractions of the unoptimised peak")
    p.add_argument("--solvers", default=None, help="comma-separated solvers (default: all registered but 'none')")
    p.add_argument("--solver-timeout", type=float, default=60.0,
                   help="seconds one solve may take (forked child, killed after; 0: in process, no limit)")
    p.add_argument("--configs", default=None, help="only these families: pytorch,compile,autoremat")
    p.add_argument("--no-batch", action="store_true", help="skip the largest-batch comparison")
    p.add_argument("--no-match", action="store_true",
                   help="skip the autoremat rows at the lowest eager PyTorch peak (autoremat:<solver>@match)")
    p.add_argument("--batch-budgets", default="", help="e.g. resnet50=16MiB,gpt2=48MiB")
    p.add_argument("--batch-sizes", default="",
                   help="MODEL=N,...: step-time tables at these batch sizes instead of the models' own "
                        "(e.g. resnet50=16)")
    p.add_argument("--torch-regions", default="dp-approx@0.5",
                   help="SOLVER@FRACTION,...: also run these autoremat rows on torch.utils.checkpoint regions "
                        "(apply(..., regions='torch')); 'none' for no such row")
    p.add_argument("--compiled-plans", default="dp-approx@0.5,dp-approx@0.3",
                   help="SOLVER@FRACTION,...: also run these autoremat rows under torch.compile (the patched model "
                        "compiled with --compile-backend, activation_memory_budget 1.0); 'none' for no such row")
    p.add_argument("--batch-only", action="store_true",
                   help="only the largest-batch comparison, merged into the existing compare.json under --out "
                        "(the step-time tables are kept as they were measured)")
    p.add_argument("--render", type=Path, default=None, metavar="COMPARE_JSON",
                   help="only rewrite RESULTS.md and the plots from an existing compare.json")
    return p


def options_from(a: argparse.Namespace, *, device: str = "cpu", size: str = "small") -> tuple[list[str], Options]:
    models = ([m.strip() for m in a.models.split(",") if m.strip()] if a.models is not None
              else list(QUICK_MODELS if a.quick else DEFAULT_MODELS))
    batch = {"mlp": 512} if a.quick else {}  # the zoo mlp's own batch (32) leaves nothing to recompute
    batch.update(_batch_sizes(a.batch_sizes))
    opts = Options(
        rounds=a.rounds or (1 if a.quick else 5),
        steps_per_round=a.steps_per_round or (1 if a.quick else 2),
        compile_budgets=_floats(a.compile_budgets) if a.compile_budgets else ((0.5,) if a.quick else COMPILE_BUDGETS),
        compile_backend=a.compile_backend or ("aot_eager_decomp_partition" if a.quick else "inductor"),
        compile_timeout_s=a.compile_timeout or None,
        autoremat_budgets=_floats(a.budgets) if a.budgets else ((0.5,) if a.quick else AUTOREMAT_BUDGETS),
        solvers=tuple(a.solvers.split(",")) if a.solvers else None,
        solver_timeout_s=a.solver_timeout or None,
        size=size, device=device, batch=batch,
        configs=tuple(a.configs.split(",")) if a.configs else None,
        match_pytorch=not a.no_match,
        torch_regions=_solver_fractions(a.torch_regions),
        compiled_plans=_solver_fractions(a.compiled_plans, "--compiled-plans"),
    )
    return models, opts


def _solver_fractions(text: str | None, flag: str = "--torch-regions") -> tuple[tuple[str, float], ...]:
    """``"dp-approx@0.5,chen@0.3"`` -> ``(("dp-approx", 0.5), ("chen", 0.3))``; ``"none"`` -> ``()``."""
    if not text or text.strip().lower() == "none":
        return ()
    out = []
    for part in text.split(","):
        solver, sep, frac = part.strip().partition("@")
        if not sep:
            raise SystemExit(f"{flag}: {part!r} is not SOLVER@FRACTION (e.g. dp-approx@0.5)")
        out.append((solver, float(frac)))
    return tuple(out)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = parser()
    a = p.parse_args(argv)
    if a.render:
        return render(a.render)
    if a.batch_only and a.no_batch:
        p.error("--batch-only and --no-batch exclude each other")
    torch.set_num_threads(max(1, a.threads))
    models, opts = options_from(a)
    out = a.out or (DEFAULT_OUT / "compare_quick" if a.quick else DEFAULT_OUT)
    command = "python benchmarks/compare " + " ".join(sys.argv[1:] if argv is None else argv)
    if a.batch_only:
        return run_batch_only(out, opts, quick=a.quick, command=command.strip(), batch_budgets=_sizes(a.batch_budgets),
                              log=lambda s: print(s, flush=True))
    return run(models, opts, out, batch=not a.no_batch, quick=a.quick, command=command.strip(),
               batch_budgets=_sizes(a.batch_budgets), log=lambda s: print(s, flush=True))

