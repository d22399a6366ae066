"""Meta capture under emulated autocast against the real capture under real autocast (issue 20).

For each zoo model (small size, batch 4) and each ``autoremat.zoo.hf_breadth`` architecture,
under ``torch.autocast("cpu", torch.bfloat16)``: the real capture (``times="flops"``, so graphs
compare exactly) and the meta capture that :func:`autoremat.capture.scaled.capture_within` makes
for a step that does not fit (:func:`autoremat.capture.scaled.meta.meta_capture`, with the CPU's
autocast emulated, :mod:`autoremat.capture.autocast_meta`). Reported per model: whether the meta
capture ran, whether it equals the real capture node for node (bytes, saves, workspace, flags,
edges), the ratio of predicted unoptimised step peaks, and the medians over ``--rounds``
interleaved rounds of the meta capture's seconds under autocast, without autocast (fp32) and
of the real capture under autocast.

    python benchmarks/meta_autocast.py [--models resnet50,hf:gpt2_labels] [--rounds 3]
        [--out benchmarks/results/cpu/meta_autocast]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import autoremat
from autoremat.capture import capture
from autoremat.capture.scaled.meta import meta_capture, traced_on_meta
from autoremat.cost import unoptimised_peak_bytes

OUT = Path(__file__).parent / "results" / "cpu" / "meta_autocast"
FIELDS = ("name", "out_bytes", "alloc_bytes", "alias_of", "saves", "extra_saved_bytes", "fwd_temp_bytes",
          "bwd_temp_bytes", "param_grad_bytes", "requires_grad", "is_output", "held_by_output",
          "grad_passthrough", "recomputable", "scope", "op_index")


def _same(a: Any, b: Any) -> bool:
    return len(a) == len(b) and set(a.nx.edges) == set(b.nx.edges) and all(
        {f: a.node(v)[f] for f in FIELDS} == {f: b.node(v)[f] for f in FIELDS} for v in a.nodes)


def _build(name: str) -> tuple[Any, tuple, dict, Any]:
    if name.startswith("hf:"):
        from autoremat.zoo.hf_breadth import build

        return build(name[3:])
    model, args = autoremat.zoo.build(name, size="small", batch_size=4)
    return model, tuple(args), {}, None


def _meta(model: Any, args: tuple, kwargs: dict, loss: Any, autocast: bool) -> tuple[Any, float]:
    opts = dict(loss_fn=loss, mode="auto", repeats=1, warmup=0, times="flops", blocks="auto")
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        gm = traced_on_meta(model, "auto")
        if gm is None:
            opts["mode"] = "module"
        out = meta_capture(model, args, kwargs, opts, gm)
    return (out[0] if out else None), time.perf_counter() - start


def run_model(name: str, rounds: int) -> dict[str, Any]:
    model, args, kwargs, loss = _build(name)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        full = capture(model, args, kwargs, loss_fn=loss, times="flops")
    t_emu, t_fp32, t_real = [], [], []
    g = None
    for _ in range(rounds):  # interleaved
        g, dt = _meta(model, args, kwargs, loss, True)
        t_emu.append(dt)
        t_fp32.append(_meta(model, args, kwargs, loss, False)[1])
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            capture(model, args, kwargs, loss_fn=loss, times="flops")
        t_real.append(time.perf_counter() - start)
    return {"model": name, "nodes": len(full), "on_meta": g is not None,
            "node_for_node": bool(g is not None and _same(full, g)),
            "peak_ratio": unoptimised_peak_bytes(g) / unoptimised_peak_bytes(full) if g is not None else None,
            "meta_autocast_s": statistics.median(t_emu), "meta_fp32_s": statistics.median(t_fp32),
            "real_autocast_s": statistics.median(t_real)}


def markdown(rows: list[dict[str, Any]], machine: str) -> str:
    lines = ["# Meta capture under emulated CPU bf16 autocast vs the real capture under real autocast", "",
             f"Machine: {machine}. Seconds: medians of interleaved rounds.", "",
             "| model | nodes | on meta | node for node | peak ratio | meta autocast s | meta fp32 s | real autocast s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['peak_ratio']:.4f}" if r["peak_ratio"] is not None else "-"
        lines.append(f"| {r['model']} | {r['nodes']} | {'yes' if r['on_meta'] else 'no (fallback)'} "
                     f"| {'yes' if r['node_for_node'] else 'no'} | {ratio} | {r['meta_autocast_s']:.2f} "
                     f"| {r['meta_fp32_s']:.2f} | {r['real_autocast_s']:.2f} |")
    ok = [r for r in rows if r["on_meta"]]
    if ok:
        cost = sorted(r["meta_autocast_s"] / r["meta_fp32_s"] for r in ok)
        lines += ["", f"{sum(r['node_for_node'] for r in ok)} of {len(rows)} node for node; meta capture under "
                  f"autocast / without: median {statistics.median(cost):.2f}x (range {cost[0]:.2f}-{cost[-1]:.2f})."]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    from autoremat.zoo.hf_breadth import CASES

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join([*autoremat.zoo.names(), *(f"hf:{n}" for n in CASES)]))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--machine", default="x86_64, CPU only", help="the machine, in words, for the report")
    p.add_argument("--out", default=str(OUT))
    a = p.parse_args(argv)
    logging.disable(logging.WARNING)
    rows = []
    for name in a.models.split(","):
        rows.append(run_model(name, a.rounds))
        print(json.dumps(rows[-1]), flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "meta_autocast.json").write_text(json.dumps({"machine": a.machine, "rows": rows}, indent=1))
    (out / "meta_autocast.md").write_text(markdown(rows, a.machine))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
