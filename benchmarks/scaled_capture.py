"""How good is a capture of a step that does not fit? Scaled capture against full-size captures.

For each zoo model (and a transformers GPT-2, module level) at CPU size and a batch ``B``, in
``--rounds`` interleaved rounds:

1. a full-size capture (:func:`autoremat.capture`) at ``B``;
2. a scaled capture (:func:`autoremat.capture.scaled.capture_within`) with the step limit at
   ``G + limit * (P - G)``, ``P`` the full capture's unoptimised step peak, ``G`` its parameter
   gradient bytes (which no batch size shrinks) and ``limit`` 0.6 by default, so the full step is
   never run: bytes from the meta device at ``B``, times from real runs at smaller sizes.

Per-node times (forward and backward): the reference is the median over the rounds' full
captures; the scaled captures' error is ``|scaled - reference| / reference``; the **noise floor**
is the same statistic for each full capture against the median of the *other* full captures
(what two full captures in the same run disagree by). Reported: median, 90th percentile, share
of nodes within 20 %, share of the step's time held by nodes within 20 %, and the step-time
error. Predicted unoptimised step peak: target within 5 %. Profiling cost: CPU seconds of the
process (``time.process_time``, which other work on a shared machine does not inflate) and wall
seconds, medians over the rounds; target: scaled <= 2x full. Same graph: fingerprints and node
names must be equal.

``--autocast bf16|fp16`` runs every capture under ``torch.autocast(device, dtype)`` (the meta
capture then runs with the device's autocast emulated, :mod:`autoremat.capture.autocast_meta`).

``--width-scale K`` builds the zoo models K times wider than their small size (``mlp`` and
``transformer`` included), where arithmetic, not dispatch, dominates the step.

    python benchmarks/scaled_capture.py [--models resnet50,unet] [--limit 0.6] [--rounds 3]
        [--width-scale 1] [--threads 1] [--autocast bf16] [--out benchmarks/results/cpu/scaled_capture]

Writes ``scaled_capture.json`` and ``scaled_capture.md`` under ``--out`` (``--tag`` names them
``scaled_capture_<tag>.*``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

import autoremat
from autoremat.capture.scaled import capture_within
from autoremat.graph import Graph
from autoremat.cost import unoptimised_peak_bytes
from compare import machine_info  # this folder's comparison package

OUT = Path(__file__).resolve().parent / "results" / "cpu" / "scaled_capture"
BATCH = {"unet": 8, "pspnet": 8, "mlp": 256, "inception_v3": 16, "densenet161": 16, "densenet201": 16}
DEFAULT_BATCH = 16
GPT2_BATCH = 16
_KEYS = ("time_s", "bwd_time_s")


GPT2_PAPER = {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257, "seq": 1024}
"""GPT-2 small (random weights) for ``--size paper``, batch 8."""


def _build(name: str, width_scale: float, size: str = "small", batch: int | None = None,
           device: str = "cpu") -> tuple[torch.nn.Module, tuple, dict, Any]:
    model, args, kwargs, loss = _build_cpu(name, width_scale, size, batch)
    move = (lambda t: t.to(device)) if device != "cpu" else (lambda t: t)
    return model.to(device), tuple(move(a) for a in args), {k: move(v) for k, v in kwargs.items()}, loss


def _build_cpu(name: str, width_scale: float, size: str, batch: int | None) -> tuple[torch.nn.Module, tuple, dict, Any]:
    if name == "gpt2":
        from autoremat.zoo.hf import gpt2, logits_mean

        cfg = GPT2_PAPER if size == "paper" else {"seq": 64}
        model = gpt2(**cfg)
        rows = batch or (8 if size == "paper" else GPT2_BATCH)
        ids = torch.randint(0, model.config.vocab_size, (rows, cfg["seq"]), generator=torch.Generator().manual_seed(0))
        return model, (), {"input_ids": ids}, logits_mean
    if size == "paper":
        model, inputs = autoremat.zoo.build(name, size="paper", batch_size=batch)
        return model, inputs, {}, None
    batch = batch or BATCH.get(name, DEFAULT_BATCH)
    if width_scale == 1:
        model, inputs = autoremat.zoo.build(name, size="small", batch_size=batch)
        return model, inputs, {}, None
    spec = autoremat.zoo.ZOO[name]
    width, shape, classes, _ = spec.config("small")
    torch.manual_seed(0)
    model = spec.builder(width=width * width_scale, input_shape=shape, num_classes=classes)
    if spec.inputs == "tokens":
        x = torch.randint(0, classes, (batch, *shape), generator=torch.Generator().manual_seed(0))
    else:
        x = torch.randn((batch, *shape), generator=torch.Generator().manual_seed(0))
    return model, (x,), {}, None


def _times(g: Graph) -> list[float]:
    return [g.node(v)[k] for v in g.nodes for k in _KEYS]


def _median_times(graphs: Sequence[Graph]) -> list[float]:
    return [statistics.median(col) for col in zip(*(_times(g) for g in graphs))]


def _errors(ref: list[float], other: list[float]) -> tuple[list[float], list[float], float]:
    """Relative errors and reference weights of the nodes with a time, and the step-time error."""
    errs, weights = [], []
    for a, b in zip(ref, other):
        if a > 0:
            errs.append(abs(b - a) / a)
            weights.append(a)
    total = sum(ref)
    return errs, weights, (sum(other) - total) / total if total else 0.0


def _summary(errs: list[float], weights: list[float], step: list[float]) -> dict[str, Any]:
    within = [e <= 0.2 for e in errs]
    return {
        "n": len(errs),
        "median": statistics.median(errs) if errs else 0.0,
        "p90": sorted(errs)[int(0.9 * (len(errs) - 1))] if errs else 0.0,
        "share_within_20pct": sum(within) / max(1, len(errs)),
        "time_share_within_20pct": sum(w for w, ok in zip(weights, within) if ok) / (sum(weights) or 1.0),
        "step_time_error_median": statistics.median(step) if step else 0.0,
        "step_time_error_max_abs": max(abs(s) for s in step) if step else 0.0,
    }


def _pooled(ref: list[float], others: Sequence[list[float]]) -> dict[str, Any]:
    errs, weights, step = [], [], []
    for o in others:
        e, w, s = _errors(ref, o)
        errs += e
        weights += w
        step.append(s)
    return _summary(errs, weights, step)


def _noise_floor(fulls: Sequence[Graph]) -> dict[str, Any]:
    """Each capture against the median of the others (for the full captures: the noise floor)."""
    errs, weights, step = [], [], []
    for i, g in enumerate(fulls):
        rest = [f for j, f in enumerate(fulls) if j != i]
        e, w, s = _errors(_median_times(rest), _times(g))
        errs += e
        weights += w
        step.append(s)
    return _summary(errs, weights, step)


def _by_kind(first: Graph, timed: set[int], ref: list[float], pairs: Sequence[tuple[list[float], list[float]]],
             least_share: float = 0.03) -> dict[str, dict[str, Any]]:
    """Per node kind ("conv*": timed alone at the full batch) and direction holding at least
    ``least_share`` of the step time (``ref``): share, median |error| and step time within 20 %
    of each ``(reference, other)`` pair's times, pooled."""
    labels = [f"{first.node(v)['kind']}{'*' if v in timed else ''} {k.split('_')[0]}"
              for v in first.nodes for k in _KEYS]
    total = sum(ref) or 1.0
    out = {}
    for label in sorted(set(labels)):
        idx = [i for i, lab in enumerate(labels) if lab == label]
        share = sum(ref[i] for i in idx) / total
        if share < least_share:
            continue
        errs, weights, step = [], [], []
        for a, b in pairs:
            e, w, st = _errors([a[i] for i in idx], [b[i] for i in idx])
            errs += e
            weights += w
            step.append(st)
        summary = _summary(errs, weights, step)
        out[label] = {"share": share, **{k: summary[k] for k in ("median", "p90", "time_share_within_20pct")}}
    return out


def _leave_one_out(graphs: Sequence[Graph]) -> list[tuple[list[float], list[float]]]:
    return [(_median_times([h for j, h in enumerate(graphs) if j != i]), _times(g)) for i, g in enumerate(graphs)]


def _cost(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    gc.collect()
    c0, w0 = time.process_time(), time.perf_counter()
    out = fn()
    return out, time.process_time() - c0, time.perf_counter() - w0


def run_model(name: str, limit: float, rounds: int, width_scale: float = 1.0, size: str = "small",
              batch: int | None = None, device: str = "cpu") -> dict[str, Any]:
    model, args, kwargs, loss = _build(name, width_scale, size, batch, device)
    autoremat.capture(model, args, kwargs, loss_fn=loss)  # first-run costs (kernel set-up) out of the way
    first = autoremat.capture(model, args, kwargs, loss_fn=loss)
    peak = unoptimised_peak_bytes(first)
    fixed = first.param_grad_bytes  # does not shrink with the batch: the limit cuts the rest
    limit_bytes = int(fixed + limit * (peak - fixed))
    fulls, scaleds, cost = [], [], {"full_cpu": [], "full_wall": [], "scaled_cpu": [], "scaled_wall": []}
    for _ in range(rounds):  # interleaved, so load on the machine reaches both alike
        g, c, w = _cost(lambda: autoremat.capture(model, args, kwargs, loss_fn=loss))
        fulls.append(g)
        cost["full_cpu"].append(c)
        cost["full_wall"].append(w)
        g, c, w = _cost(lambda: capture_within(model, args, kwargs, loss_fn=loss, limit_bytes=limit_bytes))
        scaleds.append(g)
        cost["scaled_cpu"].append(c)
        cost["scaled_wall"].append(w)
    scaled = scaleds[-1]
    ref = _median_times(fulls)
    timed = set(scaled.meta["scaled"].get("timed_at_full_batch", []))
    speak = unoptimised_peak_bytes(scaled)
    names = [first.node(v)["name"] for v in first.nodes]
    same = all(s.fingerprint == first.fingerprint and [s.node(v)["name"] for v in s.nodes] == names for s in scaleds)
    med = {k: statistics.median(v) for k, v in cost.items()}
    return {
        "model": name, "width_scale": width_scale, "size": size, "device": device, "mode": first.meta["mode"], "nodes": len(first),
        "batch": scaled.meta["scaled"]["batch_size"], "sizes": scaled.meta["scaled"]["sizes"],
        "timed_at_full_batch": len(scaled.meta["scaled"].get("timed_at_full_batch", [])),
        "bytes_from": scaled.meta["scaled"]["bytes_from"], "limit_bytes": limit_bytes, "same_graph": same,
        "full_peak_bytes": peak, "scaled_peak_bytes": speak, "peak_error": (speak - peak) / peak,
        "step_time_s": sum(_median_times(fulls)),
        "times": _pooled(ref, [_times(s) for s in scaleds]), "noise_floor": _noise_floor(fulls),
        # what is left when the scaled captures' own noise is taken out (the median of them), and that noise
        "bias": _pooled(ref, [_median_times(scaleds)]), "scaled_noise": _noise_floor(scaleds),
        "by_kind": _by_kind(first, timed, ref, [(ref, _times(s)) for s in scaleds]),
        "noise_by_kind": _by_kind(first, timed, ref, _leave_one_out(fulls), least_share=0.0),
        "cost_s": med, "cost_ratio_cpu": med["scaled_cpu"] / med["full_cpu"],
        "cost_ratio_wall": med["scaled_wall"] / med["full_wall"],
        # on a GPU the host waits for the device: wall time is the cost; on a shared CPU, CPU time
        "cost_ratio": med["scaled_wall"] / med["full_wall"] if device != "cpu" else med["scaled_cpu"] / med["full_cpu"],
    }


def _markdown(rows: list[dict[str, Any]], settings: dict[str, Any], machine: dict[str, Any]) -> str:
    where = (f"{machine['device_name']} (CUDA events), {machine.get('cpu_count')} CPU cores"
             if machine.get("device_name") else f"CPU only, {machine.get('cpu_count')} cores, shared (load average "
             f"{machine.get('load_avg_1m', float('nan')):.1f} at the start), {settings['threads']} thread(s)")
    lines = [
        f"# Scaled capture vs full-size captures ({machine.get('device_name') or 'CPU'})", "",
        f"Machine: {machine.get('platform_machine')}, {where}; torch {machine.get('torch')}. Zoo size "
        f"{settings.get('size', 'small')}" + (f", width {settings['width_scale']}x the small size"
                                            if settings.get("size", "small") == "small" else "")
        + (f", batch {settings['batch']}" if settings.get("batch") else "")
        + (f", under {settings['autocast']} autocast" if settings.get("autocast") else "") + ".", "",
        f"Step limit G + {settings['limit']:.0%} x (P - G), P the full capture's unoptimised step peak and G its "
        "parameter-gradient bytes (the full step never runs in the scaled capture). "
        f"{settings['rounds']} interleaved rounds of one full and one scaled capture. Time errors: "
        "|scaled - ref| / ref over forward and backward node times, ref = the median of the full captures; "
        "'noise' = each full capture against the median of the other full captures (two full captures "
        "of the same run). Cost: median seconds, CPU seconds of the process on a CPU, wall seconds on a GPU "
        "(both in the JSON).", "",
        "| model | nodes | batch (sizes run) | timed at B | bytes | same graph | peak error | time err median / p90 "
        "| noise median / p90 | bias median / p90 (scaled's own noise) | nodes within 20 % (noise) "
        "| step time within 20 % (noise) | step time error (noise) | cost full / scaled (s) | cost ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    unit, kind = ("wall" if settings.get("device", "cpu") != "cpu" else "cpu"), ""
    for r in rows:
        t, n, c = r["times"], r["noise_floor"], r["cost_s"]
        lines.append(
            f"| {r['model']} ({r['mode']}) | {r['nodes']} | {r['batch']} ({', '.join(map(str, r['sizes']))}) "
            f"| {r['timed_at_full_batch']} | {r['bytes_from']} | {'yes' if r['same_graph'] else 'NO'} "
            f"| {r['peak_error']:+.2%} | {t['median']:.1%} / {t['p90']:.1%} | {n['median']:.1%} / {n['p90']:.1%} "
            f"| {r['bias']['median']:.1%} / {r['bias']['p90']:.1%} ({r['scaled_noise']['median']:.1%}) "
            f"| {t['share_within_20pct']:.0%} ({n['share_within_20pct']:.0%}) "
            f"| {t['time_share_within_20pct']:.0%} ({n['time_share_within_20pct']:.0%}) "
            f"| {t['step_time_error_median']:+.1%} ({n['step_time_error_median']:+.1%}) "
            f"| {c[kind + 'full_' + unit]:.2f} / {c['scaled_' + unit]:.2f} | {r['cost_ratio']:.2f}x |")
    lines += ["", "Per node kind and direction (kinds holding >= 3 % of the step; `*`: timed alone at the full "
              "batch): share of the step time, median |error| of the scaled captures (of the full captures "
              "against the others' median), step time within 20 % (noise).", ""]
    for r in rows:
        parts = [f"{k} {v['share']:.0%}: {v['median']:.0%} ({r['noise_by_kind'].get(k, {}).get('median', 0):.0%}), "
                 f"{v['time_share_within_20pct']:.0%} ({r['noise_by_kind'].get(k, {}).get('time_share_within_20pct', 0):.0%})"
                 for k, v in r["by_kind"].items()]
        lines.append(f"- {r['model']}: " + "; ".join(parts))
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join([*autoremat.zoo.names(), "gpt2"]))
    p.add_argument("--limit", type=float, default=0.6, help="step limit as a fraction of the full peak")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--width-scale", type=float, default=1.0, help="zoo width multiplier over the small size")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--size", default="small", choices=("small", "paper"), help="zoo size (paper: the papers' "
                   "width, resolution and batch; GPT-2 small at 8 x 1024 tokens)")
    p.add_argument("--batch", type=int, default=None, help="batch size for every model (default: per model)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--tag", default="", help="suffix of the output files")
    p.add_argument("--autocast", default=None, choices=("bf16", "fp16"), help="run every capture under "
                   "torch.autocast(device, dtype) (default: full precision)")
    a = p.parse_args(argv)
    if a.rounds < 2:
        p.error("--rounds must be >= 2 (the noise floor compares full captures with each other)")
    torch.set_num_threads(a.threads)
    settings = {"limit": a.limit, "rounds": a.rounds, "threads": a.threads, "width_scale": a.width_scale,
                "size": a.size, "batch": a.batch, "device": a.device, "autocast": a.autocast}
    machine = machine_info(torch.device(a.device))
    rows = []
    for name in a.models.split(","):
        with (torch.autocast(a.device, dtype={"bf16": torch.bfloat16, "fp16": torch.float16}[a.autocast])
              if a.autocast else contextlib.nullcontext()):
            row = run_model(name, a.limit, a.rounds, a.width_scale, a.size, a.batch, a.device)
        print(f"{name}: peak error {row['peak_error']:+.2%}, time err median {row['times']['median']:.1%} "
              f"(noise {row['noise_floor']['median']:.1%}), step time within 20 % "
              f"{row['times']['time_share_within_20pct']:.0%} (noise {row['noise_floor']['time_share_within_20pct']:.0%}), "
              f"cost {row['cost_ratio']:.2f}x", flush=True)
        rows.append(row)
    import os

    machine["load_avg_1m_end"] = os.getloadavg()[0]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"scaled_capture_{a.tag}" if a.tag else "scaled_capture"
    (out / f"{stem}.json").write_text(json.dumps({"machine": machine, "settings": settings, "rows": rows}, indent=1))
    (out / f"{stem}.md").write_text(_markdown(rows, settings, machine))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
