"""The ``autoremat`` command: ``demo``, ``profile`` and ``plan``."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from . import zoo
from ._cli_checks import check_args, normalise_argv
from ._units import fmt_bytes
from .capture.scaled import CaptureDoesNotFitError, capture_within, profile_limit_bytes, resident_bytes_of
from .errors import InfeasibleBudgetError
from .cost import simulate, unoptimised_peak_bytes
from .solvers import SOLVERS, solve

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="autoremat", description="Automatic recomputation under a memory budget.")
    p.add_argument("-v", "--verbose", action="store_true", help="log what autoremat decides")
    sub = p.add_subparsers(dest="command", required=True)
    solvers = ["auto", *sorted(SOLVERS)]

    d = sub.add_parser("demo", help="train a zoo model on synthetic data without and with a plan (CPU works)")
    d.add_argument("--model", default="resnet50", choices=zoo.names())
    d.add_argument("--budget", default="50%", help='step-peak budget: bytes, "6GB", "512MiB", "40%%" (default 50%%)')
    d.add_argument("--solver", default="auto", choices=solvers)
    d.add_argument("--steps", type=int, default=4)

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
        if name == "plan":
            s.add_argument("--budget", default="50%")
            s.add_argument("--solver", default="auto", choices=solvers)
            s.add_argument("--out", default=None, help="write the plan JSON here")
            s.add_argument("--plot", default=None, help="write a PNG of the memory timeline, unpatched vs planned")
            s.add_argument("--gap", action="store_true",
                           help='compare the plan\'s extra time with the proven optimum (the "milp" solver; '
                                'pip install "autoremat[milp]")')
            s.add_argument("--gap-time-limit", type=float, default=60.0, help="seconds for --gap (default 60)")
        else:
            s.add_argument("--top", type=int, default=10, help="how many nodes to list")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(normalise_argv(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    console = Console(width=None if sys.stdout.isatty() else 120)
    try:
        check_args(args)  # before any capture: bad budgets, devices and output paths fail in a second
        if args.command == "demo":
            return _demo(console, args)
        if args.command == "profile":
            return _profile(console, args)
        return _plan(console, args)
    except (ValueError, TypeError, OSError, CaptureDoesNotFitError) as err:
        console.print(f"[red]error:[/red] {err}", highlight=False, soft_wrap=True)  # one line, no wrapping
        return 2


def _demo(console: Console, args: argparse.Namespace) -> int:
    from .demo import run_demo

    with console.status(f"training {args.model} {args.steps} steps, plain and patched…"):
        report = run_demo(args.model, args.budget, args.solver, args.steps)
    table = Table(title=f"autoremat demo: {report.model} (small size, CPU), {report.nodes} nodes, "
                        f"budget {report.budget}")
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
    console.print(f"plan: {report.plan.describe()}; capture {report.capture_s:.2f} s, solve {report.solve_s:.3f} s")
    return 0 if report.rows[-1].grads_equal else 1


def _captured(console: Console, args: argparse.Namespace):  # type: ignore[no-untyped-def]
    with console.status(f"capturing {args.model} ({args.size}, {args.device})…"):
        model, inputs = zoo.build(args.model, size=args.size, batch_size=args.batch_size, device=args.device)
        limit = None if args.device == "meta" else profile_limit_bytes(
            args.memory_limit, device=args.device, resident_bytes=resident_bytes_of(model, inputs))
        return capture_within(model, inputs, limit_bytes=limit)


def _profile(console: Console, args: argparse.Namespace) -> int:
    g = _captured(console, args)
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
    return 0


def _plan(console: Console, args: argparse.Namespace) -> int:
    g = _captured(console, args)
    try:
        plan = solve(g, args.budget, solver=args.solver)
    except InfeasibleBudgetError as err:
        console.print(f"[red]infeasible:[/red] {err}")
        return 3
    sim = simulate(g, plan)
    table = Table(title=f"plan for {args.model}: {plan.describe()}")
    for col in ("segment", "nodes", "first", "last", "recompute"):
        table.add_column(col)
    for i, seg in enumerate(plan.segments):
        table.add_row(str(i), str(len(seg.nodes)), g.node(seg.nodes[0])["name"][:30],
                      g.node(seg.nodes[-1])["name"][:30], "yes" if seg.recompute else "no")
    console.print(table)
    console.print(f"budget {fmt_bytes(plan.budget_bytes or 0)}; predicted step peak {fmt_bytes(sim.peak_bytes)} "
                  f"(unoptimised {fmt_bytes(unoptimised_peak_bytes(g))}); extra time {sim.extra_time_s * 1e3:.2f} ms")
    if args.gap:
        from .solvers.milp import optimality_gap

        try:
            with console.status(f"bounding the optimum (up to {args.gap_time_limit:g} s)…"):
                gap = optimality_gap(g, plan, plan.budget_bytes or 0, time_limit_s=args.gap_time_limit)
        except ImportError as err:  # highspy missing: the message names the extra to install
            console.print(f"error: {err}", markup=False)
            return 2
        console.print(gap.describe(), markup=False)
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
