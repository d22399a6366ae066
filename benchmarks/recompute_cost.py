"""Where the step time of a recomputation plan goes, measured on the CPU.

CPU only by design: models are built on the CPU, and its probes use ``perf_counter`` without
device synchronisation, which on a GPU would time kernel launches rather than kernels
(``compare_gpu.py`` is the GPU script).

For one zoo model at CPU size: capture, solve at a fraction of the unoptimised step peak,
apply, and time steps of the unpatched and the patched model alternately (one process, the
order flipped every round). Per step of the patched model it also times, inside the runtime,

* the forward of each recomputed region (what the first forward pays for it),
* each replay of a region's forward in backward (the recomputation itself), and
* each recomputation with its set-up (inputs, RNG / autocast state, batch-norm buffers).

and sets them beside the profile's prediction (the simulator's extra time, i.e. the captured
forward times of the recomputed nodes). The gap between the measured step-time ratio and a
target such as "1.25x at a 50 % budget" then splits into what the plan must recompute, what
the replay costs beyond the profile, and the runtime's overhead.

    python benchmarks/recompute_cost.py [--model resnet50] [--solver dp-exact] [--budget 0.5]
                                        [--batch N] [--rounds 40] [--threads 1] [--out benchmarks/results/cpu]

Writes ``recompute_cost.json`` and ``recompute_cost.md`` under ``--out``. It wraps two private
pieces of the runtime (``autoremat.runtime.checkpoint_region.CheckpointRegion.forward`` and
``autoremat.runtime.region._Frame.recompute``) for the timed steps and puts them back afterwards.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

import autoremat
from autoremat.measure import default_loss
from autoremat.runtime import checkpoint_region, region
from autoremat.cost import simulate, unoptimised_peak_bytes
from compare import machine_info  # this folder's comparison script

OUT = Path(__file__).resolve().parent / "results" / "cpu"


@contextmanager
def _probes(clock: dict[str, float]) -> Iterator[None]:
    """Adds the seconds spent in region forwards, replays and recomputations to ``clock``."""
    fwd, rec = checkpoint_region.CheckpointRegion.forward, region._Frame.recompute

    def timed_forward(self: checkpoint_region.CheckpointRegion, *args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fwd(self, *args)
        finally:
            if torch.is_grad_enabled():
                clock["region_forward_s"] += time.perf_counter() - t0

    def timed(replay: Callable[..., Any] | None) -> Callable[..., Any] | None:
        if replay is None:
            return None

        def timed_replay(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return replay(*args, **kwargs)
            finally:  # the early stop leaves by an exception: counted too
                clock["replay_s"] += time.perf_counter() - t0

        return timed_replay

    def timed_recompute(self: Any) -> Any:
        replay, short = self.replay, self.short  # the whole replay, or the one without the tail
        self.replay, self.short = timed(replay), timed(short)
        t0 = time.perf_counter()
        try:
            return rec(self)
        finally:
            clock["recompute_s"] += time.perf_counter() - t0
            self.replay, self.short = replay, short

    checkpoint_region.CheckpointRegion.forward = timed_forward  # type: ignore[method-assign]
    region._Frame.recompute = timed_recompute  # type: ignore[method-assign]
    try:
        yield
    finally:
        checkpoint_region.CheckpointRegion.forward = fwd  # type: ignore[method-assign]
        region._Frame.recompute = rec  # type: ignore[method-assign]


def _step(model: torch.nn.Module, args: Sequence[Any]) -> tuple[float, float]:
    """Forward and backward seconds of one training step (``autoremat.measure.default_loss``)."""
    t0 = time.perf_counter()
    loss = default_loss(model(*args))
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    for p in model.parameters():
        p.grad = None
    return t1 - t0, t2 - t1


def run(model_name: str, solver: str, fraction: float, rounds: int, batch: int | None = None) -> dict[str, Any]:
    """Capture, solve, apply and time ``rounds`` alternating steps; medians and ratios (``batch``:
    instead of the zoo's small-size batch)."""
    model, args = autoremat.zoo.build(model_name, size="small", batch_size=batch)
    model.train()
    graph = autoremat.capture(copy.deepcopy(model), args)
    base = unoptimised_peak_bytes(graph)
    try:
        plan = autoremat.solve(graph, int(fraction * base), solver=solver)
    except autoremat.InfeasibleBudgetError as err:
        least = (err.min_budget_bytes or base) / base
        raise SystemExit(f"{err}\nrecompute_cost: pass --budget {least:.3f} or more for {model_name}") from None
    sim = simulate(graph, plan)
    plain = copy.deepcopy(model)
    patched = autoremat.apply(copy.deepcopy(model), plan)
    for m in (plain, patched):  # warm-up
        _step(m, args)
        _step(m, args)
    cols: dict[str, list[float]] = {k: [] for k in (
        "none_fwd_s", "none_bwd_s", "plan_fwd_s", "plan_bwd_s", "region_forward_s", "replay_s", "recompute_s")}
    for r in range(rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        for use_plan in order:
            if not use_plan:
                f, b = _step(plain, args)
                cols["none_fwd_s"].append(f)
                cols["none_bwd_s"].append(b)
                continue
            clock = {"region_forward_s": 0.0, "replay_s": 0.0, "recompute_s": 0.0}
            with _probes(clock):
                f, b = _step(patched, args)
            cols["plan_fwd_s"].append(f)
            cols["plan_bwd_s"].append(b)
            for k, v in clock.items():
                cols[k].append(v)
    med = {k: statistics.median(v) for k, v in cols.items()}
    none_step = med["none_fwd_s"] + med["none_bwd_s"]
    plan_step = med["plan_fwd_s"] + med["plan_bwd_s"]
    return {
        "model": model_name, "solver": solver, "budget_fraction": fraction, "rounds": rounds,
        "batch": list(args[0].shape), "graph_nodes": len(graph),
        "recomputed_segments": len(plan.recompute_segments),
        "recomputed_nodes": sum(len(s.nodes) for s in plan.recompute_segments),
        "predicted_peak_fraction": sim.peak_bytes / base,
        "profile_fwd_s": sim.fwd_time_s, "profile_bwd_s": sim.bwd_time_s,
        "predicted_extra_s": sim.extra_time_s,
        "predicted_ratio": 1 + sim.extra_time_s / (sim.fwd_time_s + sim.bwd_time_s),
        **{f"median_{k}": v for k, v in med.items()},
        "none_step_s": none_step, "plan_step_s": plan_step,
        "measured_ratio": plan_step / none_step,
        # what the ratio would be if a step only added each piece on top of the unpatched step
        "ratio_if_replay_only": (none_step + med["replay_s"]) / none_step,
        "ratio_if_recompute_at_profile_cost": (none_step + sim.extra_time_s * med["none_fwd_s"] / sim.fwd_time_s)
        / none_step,
        "forward_overhead_s": med["plan_fwd_s"] - med["none_fwd_s"],
        "backward_extra_s": med["plan_bwd_s"] - med["none_bwd_s"],
        "recompute_setup_s": med["recompute_s"] - med["replay_s"],
        "steps": {k: v for k, v in cols.items()},
    }


def _markdown(res: dict[str, Any], machine: dict[str, Any], command: str) -> str:
    ms = lambda s: f"{s * 1e3:.2f} ms"  # noqa: E731
    none_step = res["none_step_s"]
    share = lambda s: f"{s / none_step:.1%} of the unpatched step"  # noqa: E731
    lines = [
        f"# Where the step time of a recomputation plan goes ({machine['platform_machine']} CPU, "
        f"os.cpu_count() = {machine['cpu_count']})",
        "",
        f"Machine: {machine['platform_machine']}, {machine['cpu_count']} cores, torch {machine['torch']} "
        f"({machine['torch_threads']} intra-op thread(s)), Python {machine['python']}, CPU only; shared with other "
        f"jobs (1-minute load average {machine.get('load_avg_1m', float('nan')):.2f} at the start). "
        f"Command: `{command}`.",
        "",
        f"zoo `{res['model']}` (small size), batch {tuple(res['batch'])}, `{res['solver']}` at "
        f"{res['budget_fraction']:.0%} of the simulated unoptimised step peak: {res['recomputed_segments']} recomputed "
        f"segments, {res['recomputed_nodes']} of {res['graph_nodes']} nodes; predicted peak "
        f"{res['predicted_peak_fraction']:.1%}. Medians of {res['rounds']} steps of each model, alternating.",
        "",
        "| quantity | value |",
        "|---|---|",
        f"| unpatched step (forward + backward) | {ms(none_step)} ({ms(res['median_none_fwd_s'])} + "
        f"{ms(res['median_none_bwd_s'])}) |",
        f"| patched step | {ms(res['plan_step_s'])} ({ms(res['median_plan_fwd_s'])} + "
        f"{ms(res['median_plan_bwd_s'])}) |",
        f"| **measured ratio** | **{res['measured_ratio']:.3f}x** |",
        f"| profiled forward / backward (capture) | {ms(res['profile_fwd_s'])} / {ms(res['profile_bwd_s'])} |",
        f"| predicted extra time (profile) | {ms(res['predicted_extra_s'])}; predicted ratio "
        f"{res['predicted_ratio']:.3f}x |",
        f"| the recomputed regions' forward (first pass) | {ms(res['median_region_forward_s'])} |",
        f"| their replays in backward | {ms(res['median_replay_s'])} ({share(res['median_replay_s'])}) |",
        f"| recomputations with their set-up | {ms(res['median_recompute_s'])} (set-up "
        f"{ms(res['recompute_setup_s'])}) |",
        f"| forward overhead of the patched model | {ms(res['forward_overhead_s'])} |",
        f"| backward extra of the patched model | {ms(res['backward_extra_s'])} |",
        f"| ratio if a step only added the replays | {res['ratio_if_replay_only']:.3f}x |",
        f"| ratio if the recomputation cost what the profile says (scaled to the measured forward) | "
        f"{res['ratio_if_recompute_at_profile_cost']:.3f}x |",
        "",
        "Reading: the replays are the recomputation the plan asks for; a runtime without any overhead would "
        "still land at the 'replays only' ratio. The set-up, the forward overhead and the rest of the backward "
        "extra are the runtime's cost. Timings on a shared 2-core machine are noisy: read the ratios.",
        "",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="resnet50", help="zoo model (small size)")
    ap.add_argument("--solver", default="dp-exact")
    ap.add_argument("--budget", type=float, default=0.5, help="fraction of the unoptimised step peak")
    ap.add_argument("--batch", type=int, default=None, help="batch size (default: the zoo's small-size batch)")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--out", type=Path, default=OUT)
    opts = ap.parse_args(argv)
    if opts.rounds < 1 or not 0 < opts.budget <= 1 or opts.threads < 1 or (opts.batch is not None and opts.batch < 1):
        ap.error("--rounds, --threads and --batch must be >= 1 and --budget in (0, 1]")
    torch.set_num_threads(opts.threads)
    machine = machine_info(torch.device("cpu"))
    res = run(opts.model, opts.solver, opts.budget, opts.rounds, opts.batch)
    command = "python benchmarks/recompute_cost.py " + " ".join(argv if argv is not None else [])
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / "recompute_cost.json").write_text(json.dumps({"machine": machine, "result": res}, indent=1) + "\n")
    text = _markdown(res, machine, command.strip())
    (opts.out / "recompute_cost.md").write_text(text)
    print(text)
    return res


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
