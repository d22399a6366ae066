"""The ``autoremat`` command: ``demo``, ``profile`` and ``plan``."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

import torch
from rich.console import Console
from rich.table import Table

from . import zoo
from ._cli_checks import check_args, normalise_argv
from ._units import fmt_bytes
from .budget import is_min, reachable_range_text
from .capture import TIMES
from .capture.scaled import CaptureDoesNotFitError, capture_within, profile_limit_bytes, resident_bytes_of
from .errors import InfeasibleBudgetError
from .cost import simulate, unoptimised_peak_bytes
from .progress import Progress
from .integrations._common import capture_blocks
from .solvers import SOLVERS, least_budget, solve

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="autoremat", description="Automatic recomputation under a memory budget.")
    p.add_argument("-v", "--verbose", action="store_true", help="log what autoremat decides")
    sub = p.add_subparsers(dest="command", required=True)
    solvers = ["auto", *sorted(SOLVERS)]

    d = sub.add_parser("demo", help="train a zoo model on synthetic data without and with a plan (CPU works)")
    d.add_argument("--model", default="resnet50", choices=zoo.names())
    d.add_argument("--budget", default="50%", help='step-peak budget: bytes, "6GB", "512MiB", "40%%" or "min" '
                                                   '(the least reachable; default 50%%)')
    d.add_argument("--solver", default="auto", choices=solvers)
    d.add_argument("--steps", type=int, default=4, help="training steps compared (default 4)")
    d.add_argument("--timing-pairs", type=int, default=7,
                   help="interleaved pairs of timed runs, plain and patched (default 7)")
    d.add_argument("--plan", default=None, help="use this saved plan (autoremat plan ... --out plan.json) instead of "
                                                "solving; refused if made for another model or batch")
    _common_options(d)
    _threads_option(d, 1)

    for name, helptext in (("profile", "capture a zoo model and summarise its graph"),
                           ("plan", "capture a zoo model, solve, print the plan and write its JSON")):
        s = sub.add_parser(name, help=helptext)
        s.add_argument("--model", default="resnet50", choices=zoo.names())
        s.add_argument("--size", default="small", choices=list(zoo.SIZES))
        s.add_argument("--device", default="cpu", help='"cpu", "cuda" or "meta" (meta: nothing allocated)')
        s.add_argument("--batch-size", type=int, default=None)
        s.add_argument("--memory-limit", default="auto",
                       help='device memory profiling may use: "auto" (free device memory; host memory on a CPU), '
                            'bytes or "6GB"; a step predicted above it is profiled at smaller batches and scaled')
        s.add_argument("--times", default=None, choices=TIMES,
                       help='node times: "measured" (default, or AUTOREMAT_TIMES) or "flops" (deterministic)')
        if name == "plan":
            s.add_argument("--budget", default="50%", help='step-peak budget: bytes, "6GB", "512MiB", "40%%" or "min" '
                                                          '(the least the solver reaches; default 50%%)')
            s.add_argument("--solver", default="auto", choices=solvers)
            s.add_argument("--on-infeasible", default="min", choices=("min", "error"),
                           help="a budget below the least reachable: plan at the least and say so (min, the "
                                "default) or exit 3 (error)")
            s.add_argument("--out", default=None, help="write the plan JSON here")
            s.add_argument("--plot", default=None, help="write a PNG of the memory timeline, unpatched vs planned")
            s.add_argument("--gap", action="store_true",
                           help='compare the plan\'s extra time with the proven optimum (the "milp" solver; '
                                'pip install "autoremat[milp]")')
            s.add_argument("--gap-time-limit", type=float, default=60.0, help="seconds for --gap (default 60)")
            s.add_argument("--gap-price", default="as-run", choices=("as-run", "whole"),
                           help="--gap's extra times: as the plans run, recomputed segments replayed to their "
                                "tails (as-run, the default), or replayed whole (the papers' price)")
        else:
            s.add_argument("--top", type=int, default=10, help="how many nodes to list")
        _threads_option(s, 0)
    return p


def _threads_option(d: argparse.ArgumentParser, default: int) -> None:
    """``--threads``: 1 for the demo (it times the plain and the patched step against each other); 0
    (PyTorch's own count) where the capture's times should be those of the user's training."""
    d.add_argument("--threads", type=int, default=default,
                   help=f"CPU threads per op while the model runs on the CPU (default {default}; 0: PyTorch's own, "
                        "one per core). More threads than idle cores make every op wait for a time slice: on a 2-core "
                        "machine beside one busy process the demo's step took 11-12 ms with 1 thread, 0.5-1.2 s with 2")


def _use_threads(args: argparse.Namespace) -> None:
    """``--threads`` for a command that runs the model on the CPU (the demo; ``--device cpu``)."""
    if args.threads and getattr(args, "device", "cpu") == "cpu":
        torch.set_num_threads(args.threads)


def _common_options(d: argparse.ArgumentParser) -> None:
    d.add_argument("--on-infeasible", default="min", choices=("min", "error"),
                   help="a budget below the least reachable: plan at the least and say so (min, the default) or "
                        "exit 3 (error)")
    d.add_argument("--times", default=None, choices=TIMES,
                   help='node times: "measured" (default, or AUTOREMAT_TIMES) or "flops" (deterministic)')


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(normalise_argv(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    console = Console(width=None if sys.stdout.isatty() else 120)
    progress = Progress(console=Console(stderr=True, width=None if sys.stderr.isatty() else 120))
    try:
        check_args(args)  # before any capture: bad budgets, devices and output paths fail in a second
        _use_threads(args)
        if args.command == "demo":
            return _demo(console, progress, args)
        if args.command == "profile":
            return _profile(console, progress, args)
        return _plan(console, progress, args)
    except (ValueError, TypeError, OSError, CaptureDoesNotFitError) as err:
        console.print(f"[red]error:[/red] {err}", highlight=False, soft_wrap=True)  # one line, no wrapping
        return 2


def _demo(console: Console, progress: Progress, args: argparse.Namespace) -> int:
    from .demo import run_demo
    from .plan import Plan

    plan = Plan.from_json(args.plan) if args.plan else None
    try:
        report = run_demo(args.model, args.budget, args.solver, args.steps, plan=plan,
                          on_infeasible=args.on_infeasible, times=args.times, progress=progress,
                          timing_pairs=args.timing_pairs)
    except InfeasibleBudgetError as err:
        console.print(f"[red]infeasible:[/red] {err}", highlight=False, soft_wrap=True)
        return 3
    budget = args.budget if report.plan_source == "solved" else f"{args.plan} (saved)"
    threads = torch.get_num_threads()
    table = Table(title=f"autoremat demo: {report.model} (small size, CPU, {threads} thread{'s' * (threads > 1)}), "
                        f"{report.nodes} nodes, budget {budget}")
    for col in ("run", "measured step peak", "predicted step peak", "time / step", "gradients"):
        table.add_column(col, justify="right" if col != "run" else "left")
    base = report.rows[0]
    for row in report.rows:
        ratio = "" if row is base else f" ({row.measured_peak_bytes / base.measured_peak_bytes:.0%})"
        tratio = "" if row is base else f" ({row.step_time_s / base.step_time_s:.2f}x)"
        grads = "reference" if row.grads_equal is None else ("bit-for-bit equal" if row.grads_equal else "DIFFER")
        table.add_row(row.label, fmt_bytes(row.measured_peak_bytes) + ratio, fmt_bytes(row.predicted_peak_bytes),
                      f"{row.step_time_s * 1e3:.1f} ms{tratio}", grads)
    console.print(table)
    what = "plan" if report.plan_source == "solved" else "saved plan"
    console.print(f"{what}: {report.plan.describe()}; capture {report.capture_s:.2f} s, solve {report.solve_s:.3f} s",
                  highlight=False)
    if report.least_bytes is not None:
        console.print(f"reachable step peak: {reachable_range_text(report.least_bytes, report.peak_bytes)}",
                      highlight=False)
    if report.budget_note:
        console.print(f"note: budget {args.budget} is {report.budget_note}", highlight=False)
    if report.pair_ratios:
        ratios = sorted(report.pair_ratios)
        trimmed = ratios[1:-1] if len(ratios) >= 5 else ratios  # one hiccup of a busy machine is not the spread
        left_out = " without the lowest and highest" if len(ratios) >= 5 else ""
        console.print(f"time / step: median of {len(ratios)} interleaved pairs; per pair the patched step took "
                      f"{trimmed[0]:.2f}x to {trimmed[-1]:.2f}x the plain one{left_out} (the timing noise of this "
                      "machine: compare such ratios, not single runs)", highlight=False)
    return 0 if report.rows[-1].grads_equal else 1


def _captured(progress: Progress, args: argparse.Namespace):  # type: ignore[no-untyped-def]
    with progress.phase(f"capture {args.model} ({args.size}, {args.device})"):
        model, inputs = zoo.build(args.model, size=args.size, batch_size=args.batch_size, device=args.device)
        limit = None if args.device == "meta" else profile_limit_bytes(
            args.memory_limit, device=args.device, resident_bytes=resident_bytes_of(model, inputs))
        return capture_within(model, inputs, limit_bytes=limit, times=args.times,
                              blocks=capture_blocks(getattr(args, "solver", "auto")))


def _profile(console: Console, progress: Progress, args: argparse.Namespace) -> int:
    g = _captured(progress, args)
    peak = unoptimised_peak_bytes(g)
    console.print(f"{g}  unoptimised step peak {fmt_bytes(peak)}, saved for backward (summed over nodes) "
                  f"{fmt_bytes(int(g.total('saved_bytes')))}, parameter gradients {fmt_bytes(g.param_grad_bytes)}, "
                  f"forward {g.total('time_s') * 1e3:.2f} ms ({g.meta['time_source']})")
    table = Table(title=f"top {args.top} nodes by saved bytes")
    for col in ("node", "name", "kind", "out", "saved", "fwd time"):
        table.add_column(col)
    top = sorted(g.nodes, key=lambda v: -g.node(v)["saved_bytes"])[: args.top]
    for v in top:
        d = g.node(v)
        table.add_row(str(v), d["name"][:40], d["kind"], fmt_bytes(d["out_bytes"]), fmt_bytes(d["saved_bytes"]),
                      f"{d['time_s'] * 1e6:.0f} µs")
    console.print(table)
    with progress.phase("reachable range (least budget of solver auto)"):
        least = least_budget(g)
    console.print(f"reachable step peak (solver auto): {reachable_range_text(least, peak)}", highlight=False)
    return 0


def _plan(console: Console, progress: Progress, args: argparse.Namespace) -> int:
    g = _captured(progress, args)
    note = None
    with progress.phase(f"solve ({len(g)} nodes, solver {args.solver})"):
        try:
            plan = solve(g, args.budget, solver=args.solver)
        except InfeasibleBudgetError as err:
            if args.on_infeasible == "error":
                console.print(f"[red]infeasible:[/red] {err}", highlight=False, soft_wrap=True)
                return 3
            plan = solve(g, "min", solver=args.solver)
            note = (f"note: budget {args.budget} is below the least step peak solver {args.solver!r} reaches; "
                    "planned at the least (--on-infeasible error to fail instead)")
        least = int(plan.budget_bytes or 0) if is_min(args.budget) or note else least_budget(g, args.solver)
    sim = simulate(g, plan)
    table = Table(title=f"plan for {args.model}: {plan.describe()}")
    for col in ("segment", "nodes", "first", "last", "recompute"):
        table.add_column(col)
    for i, seg in enumerate(plan.segments):
        table.add_row(str(i), str(len(seg.nodes)), g.node(seg.nodes[0])["name"][:30],
                      g.node(seg.nodes[-1])["name"][:30], "yes" if seg.recompute else "no")
    console.print(table)
    console.print(f"budget {fmt_bytes(plan.budget_bytes or 0)}; predicted step peak {fmt_bytes(sim.peak_bytes)} "
                  f"(unoptimised {fmt_bytes(unoptimised_peak_bytes(g))}); extra time {sim.extra_time_s * 1e3:.3g} ms",
                  highlight=False)
    console.print(f"reachable step peak (solver {args.solver}): "
                  f"{reachable_range_text(least, unoptimised_peak_bytes(g))}", highlight=False)
    if note:
        console.print(f"[yellow]{note}[/yellow]", highlight=False, soft_wrap=True)
    if args.gap:
        from .solvers.milp import optimality_gap

        try:
            with progress.phase(f"bound the optimum (up to {args.gap_time_limit:g} s)"):
                gap = optimality_gap(g, plan, plan.budget_bytes or 0, time_limit_s=args.gap_time_limit,
                                     tails=args.gap_price == "as-run")
        except ImportError as err:  # highspy missing: the message names the extra to install
            console.print(f"error: {err}", markup=False)
            return 2
        console.print(gap.describe(as_run_s=plan.predicted_extra_time_s), markup=False)
    if args.out:
        plan.to_json(args.out)
        console.print(f"wrote {args.out}")
    if args.plot:
        from .plot import plot_timelines
        from .cost import no_recompute_plan

        plot_timelines(g, {"no recomputation": no_recompute_plan(g), f"{plan.solver} plan": plan}, args.plot,
                       title=f"{args.model} ({args.size}): simulated memory during one step")
        console.print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
