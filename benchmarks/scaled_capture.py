"""How good is a capture of a step that does not fit? Scaled capture against a full-size capture.

For each zoo model (and a transformers GPT-2, module level) at CPU size and a batch ``B``:

1. a full-size capture (:func:`autoremat.capture`) at ``B``, and a second one (the noise floor:
   how far two full captures' per-node times differ from each other);
2. a scaled capture (:func:`autoremat.capture.scaled.capture_within`) with the step limit at
   ``G + limit * (P - G)``, ``P`` the full capture's unoptimised step peak, ``G`` its parameter
   gradient bytes (which no batch size shrinks) and ``limit`` 0.6 by default, so the full step is
   never run: bytes from the meta device at ``B``, times from real runs at two smaller sizes
   fitted per node as ``a + b * batch``.

Reported per model: the predicted unoptimised step peak of each (target: within 5 %), the
distribution of per-node time errors (forward and backward, |scaled - full| / full: median, 90th
percentile, share of nodes within 20 %, and the share of the step's time held by nodes within
20 %), the same distribution between the two full captures, the total step time error, and the
profiling cost (wall seconds, best of ``--rounds``; target: scaled <= 2x full). Same graph:
fingerprints and node names must be equal.

    python benchmarks/scaled_capture.py [--models resnet50,unet] [--limit 0.6] [--rounds 2]
                                        [--threads 1] [--out benchmarks/results/cpu/scaled_capture]

Writes ``scaled_capture.json`` and ``scaled_capture.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import autoremat
from autoremat.capture.scaled import capture_within
from autoremat.graph import Graph
from autoremat.cost import unoptimised_peak_bytes
from compare import machine_info  # this folder's comparison script

OUT = Path(__file__).resolve().parent / "results" / "cpu" / "scaled_capture"
BATCH = {"unet": 8, "pspnet": 8, "mlp": 256, "inception_v3": 16, "densenet161": 16, "densenet201": 16}
DEFAULT_BATCH = 16
GPT2_BATCH = 16


def _build(name: str) -> tuple[torch.nn.Module, tuple, dict, Any]:
    if name == "gpt2":
        from autoremat.zoo.hf import gpt2, logits_mean

        model = gpt2()
        ids = torch.randint(0, 256, (GPT2_BATCH, 64), generator=torch.Generator().manual_seed(0))
        return model, (), {"input_ids": ids}, logits_mean
    model, inputs = autoremat.zoo.build(name, size="small", batch_size=BATCH.get(name, DEFAULT_BATCH))
    return model, inputs, {}, None


def _errors(ref: Graph, other: Graph) -> dict[str, Any]:
    errs: list[float] = []
    weights: list[float] = []
    for v in ref.nodes:
        a, b = ref.node(v), other.node(v)
        for key in ("time_s", "bwd_time_s"):
            if a[key] > 0:
                errs.append(abs(b[key] - a[key]) / a[key])
                weights.append(a[key])
    within = [e <= 0.2 for e in errs]
    total = sum(weights) or 1.0
    ref_t = ref.total("time_s") + ref.total("bwd_time_s")
    oth_t = other.total("time_s") + other.total("bwd_time_s")
    return {
        "n": len(errs),
        "median": statistics.median(errs) if errs else 0.0,
        "p90": sorted(errs)[int(0.9 * (len(errs) - 1))] if errs else 0.0,
        "share_within_20pct": sum(within) / max(1, len(errs)),
        "time_share_within_20pct": sum(w for w, ok in zip(weights, within) if ok) / total,
        "step_time_error": (oth_t - ref_t) / ref_t if ref_t else 0.0,
    }


def _timed(fn: Any, rounds: int) -> tuple[Any, float]:
    best, out = float("inf"), None
    for _ in range(rounds):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return out, best


def run_model(name: str, limit: float, rounds: int) -> dict[str, Any]:
    model, args, kwargs, loss = _build(name)
    full, full_s = _timed(lambda: autoremat.capture(model, args, kwargs, loss_fn=loss), rounds)
    again = autoremat.capture(model, args, kwargs, loss_fn=loss)
    peak = unoptimised_peak_bytes(full)
    fixed = full.param_grad_bytes  # does not shrink with the batch: the limit cuts the rest
    limit_bytes = int(fixed + limit * (peak - fixed))
    scaled, scaled_s = _timed(lambda: capture_within(model, args, kwargs, loss_fn=loss, limit_bytes=limit_bytes),
                              rounds)
    speak = unoptimised_peak_bytes(scaled)
    same = (full.fingerprint == scaled.fingerprint
            and [full.node(v)["name"] for v in full.nodes] == [scaled.node(v)["name"] for v in scaled.nodes])
    return {
        "model": name, "mode": full.meta["mode"], "nodes": len(full), "batch": scaled.meta["scaled"]["batch_size"],
        "sizes": scaled.meta["scaled"]["sizes"], "bytes_from": scaled.meta["scaled"]["bytes_from"],
        "limit_bytes": limit_bytes, "same_graph": same,
        "full_peak_bytes": peak, "scaled_peak_bytes": speak, "peak_error": (speak - peak) / peak,
        "times": _errors(full, scaled), "noise_floor": _errors(full, again),
        "full_capture_s": full_s, "scaled_capture_s": scaled_s, "cost_ratio": scaled_s / full_s,
    }


def _markdown(rows: list[dict[str, Any]], settings: dict[str, Any]) -> str:
    lines = [
        "# Scaled capture vs full-size capture (CPU)", "",
        f"Step limit G + {settings['limit']:.0%} x (P - G), P the full capture's unoptimised step peak and G its "
        "parameter-gradient bytes (the full step never runs in the scaled capture); "
        f"torch threads {settings['threads']}; cost = best of {settings['rounds']} wall-clock runs. "
        "Time errors are |scaled - full| / full over forward and backward node times; "
        "'noise' is the same statistic between two full captures.", "",
        "| model | mode | nodes | batch (sizes run) | bytes | same graph | peak error | time err median / p90 "
        "| nodes within 20 % | step time within 20 % (by time) | noise median / p90 | step time error (noise) "
        "| cost full / scaled (s) | cost ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t, n = r["times"], r["noise_floor"]
        lines.append(
            f"| {r['model']} | {r['mode']} | {r['nodes']} | {r['batch']} ({', '.join(map(str, r['sizes']))}) "
            f"| {r['bytes_from']} | {'yes' if r['same_graph'] else 'NO'} | {r['peak_error']:+.2%} "
            f"| {t['median']:.1%} / {t['p90']:.1%} | {t['share_within_20pct']:.0%} "
            f"| {t['time_share_within_20pct']:.0%} | {n['median']:.1%} / {n['p90']:.1%} "
            f"| {t['step_time_error']:+.1%} ({n['step_time_error']:+.1%}) | {r['full_capture_s']:.2f} / {r['scaled_capture_s']:.2f} "
            f"| {r['cost_ratio']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join([*autoremat.zoo.names(), "gpt2"]))
    p.add_argument("--limit", type=float, default=0.6, help="step limit as a fraction of the full peak")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(OUT))
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    settings = {"limit": a.limit, "rounds": a.rounds, "threads": a.threads}
    rows = []
    for name in a.models.split(","):
        row = run_model(name, a.limit, a.rounds)
        print(f"{name}: peak error {row['peak_error']:+.2%}, time err median {row['times']['median']:.1%}, "
              f"cost {row['cost_ratio']:.2f}x", flush=True)
        rows.append(row)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scaled_capture.json").write_text(json.dumps({"machine": machine_info(torch.device("cpu")), "settings": settings,
                                                          "rows": rows}, indent=1))
    (out / "scaled_capture.md").write_text(_markdown(rows, settings))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
