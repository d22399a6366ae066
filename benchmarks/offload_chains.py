"""Beaumont et al.'s Figure 4 on the zoo: offloading makespan over the lower bound vs memory limit.

    python benchmarks/offload_chains.py [--nets resnet50,densenet121,inception_v3]
        [--points 11] [--slots 100,500,2000,8000@100,2000d] [--bandwidth 12e9] [--time-scale 1]
        [--groupings fine,split-points] [--out benchmarks/results/cpu]

For each network at paper size (meta capture: FLOP-based times of an H100-class GPU, see
``autoremat.capture``), the chain of ``autoremat.offload.chain_from_graph`` (both groupings), and
memory limits from the minimum (offload everything) to ``M_peak`` (no offloading) in equal
steps: the makespan of GREEDY, DYNPROG (``offload_dp``) with a few slot counts, VDNN
(thresholds on ``u_F / |x|``, as the paper's §6.1) and vDNN_all, each over Proposition 3's lower
bound, plus Theorem 2's fractional optimum (a tighter lower bound). Every schedule is checked
with ``validate_schedule``. ``B`` defaults to 12 GB/s (PCIe 4 pinned copies; a default, not a
measurement). ``--time-scale 8`` approximates a V100-class GPU (the paper's), whose compute is
about 8x slower than the meta capture's 100 TFLOP/s assumption.

Writes ``offload_chains.json``, ``offload_chains.md`` and ``offload_chains.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

import autoremat
from autoremat.offload import (
    DEFAULT_BANDWIDTH_BYTES_PER_S,
    chain_from_graph,
    lower_bound,
    offload_dp,
    offload_greedy,
    simulate_relaxed,
    validate_schedule,
    vdnn,
)
from autoremat.cost import unoptimised_peak_bytes

NETS = ["resnet50", "densenet121", "inception_v3"]


def run_chain(chain, points: int, slots: list[tuple[int, str]]) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """Every algorithm at ``points`` limits from ``chain.min_memory_bytes`` to ``chain.peak_bytes``."""
    lo, hi = chain.min_memory_bytes, chain.peak_bytes
    rows = []
    for k in range(points):
        limit = lo + (hi - lo) * k // (points - 1)
        lb = lower_bound(chain, limit)
        row: dict[str, Any] = {"limit_bytes": limit, "limit_pct": 100.0 * k / (points - 1), "lower_bound_s": lb}

        def record(name: str, sched, seconds: float) -> None:  # type: ignore[no-untyped-def]
            validate_schedule(chain, sched)
            row[name] = {"ratio": sched.makespan_s / lb, "makespan_s": sched.makespan_s,
                         "offloaded": len(sched.offloaded), "offloaded_bytes": sched.offloaded_bytes,
                         "runtime_s": seconds}
            if "repaired" in sched.options:
                row[name]["repaired"] = list(sched.options["repaired"])
            if name.startswith("dp-"):
                # the same decisions in the relaxation the DP optimises, in exact arithmetic
                relaxed = simulate_relaxed(chain, limit, sched.fractions).makespan_s
                row[name]["relaxed_ratio"] = relaxed / lb
                if "estimated_makespan_s" in sched.options:
                    row[name]["dp_estimate_ratio"] = sched.options["estimated_makespan_s"] / lb
                    row[name]["max_states"] = sched.options["max_states"]

        for name, fn in [("fractional-optimum", lambda: offload_greedy(chain, limit, fractional=True)),
                         ("greedy", lambda: offload_greedy(chain, limit)),
                         ("vdnn", lambda: vdnn(chain, limit, mode="conv")),
                         ("vdnn-all", lambda: vdnn(chain, limit, mode="all"))]:
            t = time.perf_counter()
            s = fn()
            record(name, s, time.perf_counter() - t)
        for sl, rounding in slots:
            t = time.perf_counter()
            s = offload_dp(chain, limit, slots=sl, rounding=rounding)
            record(_dp_name(sl, rounding), s, time.perf_counter() - t)
        rows.append(row)
    return {"rows": rows}


def _dp_name(slots: int, rounding: str) -> str:
    return f"dp-{slots}" + ("" if rounding == "up" else f"-{rounding}")


def summarise(rows: list[dict[str, Any]], algos: list[str]) -> dict[str, Any]:
    out = {}
    for a in algos:
        r = [row[a]["ratio"] for row in rows]
        rt = [row[a]["runtime_s"] for row in rows]
        out[a] = {"worst": max(r), "median": statistics.median(r), "mean": statistics.mean(r),
                  "runtime_mean_s": statistics.mean(rt), "runtime_max_s": max(rt)}
    return out


def to_markdown(result: dict[str, Any]) -> str:
    cfg = result["config"]
    lines = [f"# Offloading on zoo chains: makespan / lower bound ({result['machine']})", "",
             f"Beaumont et al. 2019, Figure 4 format. Paper-size meta capture (FLOP-based times of an "
             f"H100-class GPU, x{cfg['time_scale']:g}), B = {cfg['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s "
             f"(a default, not a measurement). Memory limits from the minimum (0 %: offload everything) "
             f"to M_peak (100 %: nothing to offload) in {cfg['points']} equal steps. Ratio = makespan / "
             "Proposition 3's bound `max(sum u, 2 (M_peak - M) / B)`. `fractional-optimum` is Theorem 2's "
             "optimum of the fractional relaxation (a lower bound on every schedule); `dp-N` is DYNPROG "
             "with N memory slots; `vdnn` the paper's VDNN (ratio thresholds), `vdnn-all` offloads "
             "everything whatever the limit (left out of the PNG, whose y axis stops at 2). Every "
             "schedule passed `validate_schedule`.", "",
             "## Chains", "",
             "| network | grouping | graph nodes | ops | M_min | M_peak | simulated step peak | kept bytes | "
             "largest x | compute (fwd+bwd) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for g in cfg["groupings"]:
        for net, data in result["networks"].items():
            ch = data[g]["chain"]
            lines.append(f"| {net} | {g} | {ch['graph_nodes']} | {ch['n_ops']} | {ch['min_memory_bytes'] / 2**30:.2f} GiB | "
                         f"{ch['peak_bytes'] / 2**30:.3f} GiB | {ch['simulated_peak_bytes'] / 2**30:.3f} GiB | "
                         f"{ch['kept_bytes'] / 2**30:.2f} GiB | {ch['largest_activation_bytes'] / 2**20:.0f} MiB | "
                         f"{ch['compute_time_s'] * 1e3:.1f} ms |")
    lines.append("")
    for g in cfg["groupings"]:
        algos: list[str] = []
        for data in result["networks"].values():
            algos += [a for a in data[g]["summary"] if a not in algos]
        lines += [f"## Ratios, grouping = {g} (worst / median over the limits)", "",
                  "| network | " + " | ".join(algos) + " |", "|---|" + "---|" * len(algos)]
        for net, data in result["networks"].items():
            sm = data[g]["summary"]
            lines.append(f"| {net} | " + " | ".join(
                f"{sm[a]['worst']:.3f} / {sm[a]['median']:.3f}" if a in sm else "" for a in algos) + " |")
        lines += ["", "Per memory limit (`*`: DP decisions repaired to fit, see `offload_dp`):", ""]
        for net, data in result["networks"].items():
            d = data[g]
            names = list(d["summary"])
            lines += [f"**{net}**", "", "| limit | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
            for row in d["rows"]:
                cells = [f"{row[a]['ratio']:.3f}{'*' if row[a].get('repaired') else ''}" for a in names]
                lines.append(f"| {row['limit_pct']:.0f} % ({row['limit_bytes'] / 2**30:.2f} GiB) | "
                             + " | ".join(cells) + " |")
            lines.append("")
    lines += ["## DYNPROG: discretisation and integrality", ""] + result["discretisation"] + [""]
    return "\n".join(lines)


def discretisation_notes(result: dict[str, Any]) -> list[str]:
    """Per chain and slot count: integral ratio, and how far the decisions are from the best
    decisions found for the relaxation DYNPROG optimises (discretisation loss) and from their
    own relaxed value (integrality loss)."""
    lines = ["DYNPROG's loss splits in two: *discretisation* (its decisions' exact relaxed makespan above "
             "the best relaxed makespan any slot count found) and *integrality* (the integral schedule of "
             "those decisions above their relaxed makespan). Ratios over the lower bound.", "",
             "| network | grouping | ops | slots | worst | median | discretisation loss: worst / median | "
             "integrality loss: worst / median | runtime median / max |",
             "|---|---|---|---|---|---|---|---|---|"]
    for g in result["config"]["groupings"]:
        for net, data in result["networks"].items():
            d = data[g]
            rows = d["rows"]
            dps = [a for a in d["summary"] if a.startswith("dp-")]
            best_relaxed = [min(r[a]["relaxed_ratio"] for a in dps) for r in rows]
            for a in dps:
                ratio = [r[a]["ratio"] for r in rows]
                disc = [r[a]["relaxed_ratio"] - b for r, b in zip(rows, best_relaxed)]
                integ = [r[a]["ratio"] - r[a]["relaxed_ratio"] for r in rows]
                rt = [r[a]["runtime_s"] for r in rows]
                lines.append(f"| {net} | {g} | {d['chain']['n_ops']} | {a[3:].replace('-', ' ')} | {max(ratio):.3f} | "
                             f"{statistics.median(ratio):.3f} | {max(disc):.3f} / {statistics.median(disc):.3f} | "
                             f"{max(integ):.3f} / {statistics.median(integ):.3f} | "
                             f"{statistics.median(rt):.2f} s / {max(rt):.2f} s |")
    return lines


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groupings = result["config"]["groupings"]
    nets = list(result["networks"])
    fig, axes = plt.subplots(len(groupings), len(nets), figsize=(5 * len(nets), 3.6 * len(groupings)),
                             squeeze=False)
    names: list[str] = []
    for net in nets:
        for g in groupings:
            names += [a for a in result["networks"][net][g]["summary"] if a not in names and a != "vdnn-all"]
    colours = {a: plt.get_cmap("tab10")(i % 10) for i, a in enumerate(names)}
    for gi, g in enumerate(groupings):
        for ni, net in enumerate(nets):
            ax = axes[gi][ni]
            d = result["networks"][net][g]
            xs = [r["limit_pct"] for r in d["rows"]]
            top = 1.0
            for a in d["summary"]:
                if a == "vdnn-all":  # off the scale (offloads everything at every limit)
                    continue
                ys = [r[a]["ratio"] for r in d["rows"]]
                top = max(top, *ys)
                style = "--" if a == "fractional-optimum" else "-"
                ax.plot(xs, ys, style, marker=".", label=a, color=colours[a])
            ax.set_ylim(0.98, min(top, 2.0) + 0.02)
            ax.set_title(f"{net} ({g}, {d['chain']['n_ops']} ops)")
            ax.set_xlabel("memory limit (% from minimum to M_peak)")
            ax.set_ylabel("makespan / lower bound")
            ax.grid(alpha=0.3)
    handles = {}
    for row in axes:
        for ax in row:
            for h, lab in zip(*ax.get_legend_handles_labels()):
                handles.setdefault(lab, h)
    axes[0][0].legend(handles.values(), handles.keys(), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nets", default=",".join(NETS))
    p.add_argument("--points", type=int, default=11)
    p.add_argument("--slots", default="100,500,2000,8000@100,2000d",
                   help="DP slot counts; N@K: only on chains of at most K operations; Nd: sizes rounded down")
    p.add_argument("--bandwidth", type=float, default=DEFAULT_BANDWIDTH_BYTES_PER_S)
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--groupings", default="fine,split-points")
    p.add_argument("--out", default="benchmarks/results/cpu")
    p.add_argument("--name", default="offload_chains")
    a = p.parse_args()
    slots_spec = []
    for tok in a.slots.split(","):
        n, _, k = tok.partition("@")
        rounding = "down" if n.endswith("d") else "up"
        slots_spec.append((int(n.rstrip("d")), rounding, int(k) if k else None))
    groupings = a.groupings.split(",")
    machine = f"{platform.machine()} CPU, {os.cpu_count()} cores, torch {torch.__version__}"
    result: dict[str, Any] = {
        "machine": machine,
        "config": {"points": a.points, "slots": a.slots, "bandwidth_bytes_per_s": a.bandwidth,
                   "time_scale": a.time_scale, "groupings": groupings,
                   "time_source": "meta capture: FLOP-based estimate (autoremat.capture.estimate_time)"},
        "networks": {},
    }
    for net in a.nets.split(","):
        model, args = autoremat.zoo.build(net, size="paper", device="meta")
        graph = autoremat.capture(model, args)
        sim_peak = unoptimised_peak_bytes(graph)
        result["networks"][net] = {}
        for g in groupings:
            chain = chain_from_graph(graph, bandwidth_bytes_per_s=a.bandwidth, grouping=g)
            if a.time_scale != 1.0:
                chain = chain.with_time_scale(a.time_scale)
            slots = [(n, r) for n, r, k in slots_spec if k is None or chain.n_ops <= k]
            t = time.perf_counter()
            d = run_chain(chain, a.points, slots)
            algos = ["fractional-optimum", "greedy"] + [_dp_name(n, r) for n, r in slots] + ["vdnn", "vdnn-all"]
            d["summary"] = summarise(d["rows"], algos)
            d["chain"] = {"n_ops": chain.n_ops, "min_memory_bytes": chain.min_memory_bytes,
                          "peak_bytes": chain.peak_bytes, "simulated_peak_bytes": sim_peak,
                          "compute_time_s": chain.compute_time_s, "kept_bytes": sum(chain.x_bytes),
                          "largest_activation_bytes": max(chain.x_bytes), "graph_nodes": len(graph)}
            result["networks"][net][g] = d
            print(f"{net} {g}: {chain.n_ops} ops, {time.perf_counter() - t:.1f} s; " + ", ".join(
                f"{k} {v['worst']:.3f}/{v['median']:.3f}" for k, v in d["summary"].items()), flush=True)
    result["discretisation"] = discretisation_notes(result)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{a.name}.json").write_text(json.dumps(result, indent=1))
    (out / f"{a.name}.md").write_text(to_markdown(result))
    plot(result, out / f"{a.name}.png")
    print(to_markdown(result))


if __name__ == "__main__":
    main()
