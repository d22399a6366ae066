"""ALBERT (one layer group run for every layer) under autoremat's per-call plans against a
hand-written per-layer checkpoint, side by side in one process (Hugging Face's
``gradient_checkpointing_enable()`` does not support ALBERT).

    python benchmarks/albert_shared.py [--size small|large] [--rounds 7] [--out DIR]

Variants, each trained from the same weights on the same batch: the unpatched model;
``torch.utils.checkpoint`` (non-reentrant) around every call of the shared layer group (the
wrapper a user would write); autoremat's least plan (``solve(g, "min")``); autoremat at the
per-layer checkpoint's measured peak. Peak: CPU storage counter, one step after a warm-up step;
time: median step (forward + backward) over ``--rounds`` rounds, variants interleaved in each
round, their order rotated from round to round. Gradients compared bit for bit with the unpatched
model's. Writes ``albert_shared_<size>.json`` and ``albert_shared_<size>.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils.checkpoint import checkpoint

import autoremat
from autoremat.measure import LiveStorageCounter, gradients, gradients_equal, run_step
from autoremat.runtime import patched

SIZES = {"small": dict(embedding_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                       num_attention_heads=4, batch=4, seq=64),
         "large": dict(embedding_size=128, hidden_size=256, intermediate_size=1024, num_hidden_layers=12,
                       num_attention_heads=4, batch=8, seq=128)}


def build(size: str) -> tuple[torch.nn.Module, tuple, Callable[[Any], torch.Tensor]]:
    import transformers as T

    cfg = dict(SIZES[size])
    batch, seq = cfg.pop("batch"), cfg.pop("seq")
    torch.manual_seed(0)
    model = T.AlbertForMaskedLM(T.AlbertConfig(vocab_size=1000, hidden_dropout_prob=0.1, **cfg)).train()
    ids = torch.randint(0, 1000, (batch, seq), generator=torch.Generator().manual_seed(2))
    return model, (ids,), lambda out: out.logits.float().square().mean()


class PerLayerCheckpoint:
    """``torch.utils.checkpoint`` around every call of the shared layer group (installed as its forward)."""

    def __init__(self, group: torch.nn.Module) -> None:
        self.group, self.fn = group, group.forward

    def __enter__(self) -> "PerLayerCheckpoint":
        self.group.forward = lambda *a, **k: checkpoint(self.fn, *a, use_reentrant=False, **k)
        return self

    def __exit__(self, *exc: Any) -> None:
        del self.group.forward


def _peak_and_grads(model: torch.nn.Module, args: tuple, loss: Any) -> tuple[int, dict]:
    torch.manual_seed(7)
    run_step(model, args, {}, loss)  # warm-up (a plan's first step probes)
    counter = LiveStorageCounter()
    torch.manual_seed(7)
    with counter:
        run_step(model, args, {}, loss)
    return counter.peak, gradients(model)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "cpu" / "albert_shared")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    machine = (f"{platform.machine()}, {os.cpu_count()} cores (1 intra-op thread), CPU only, torch {torch.__version__}, "
               f"load average {os.getloadavg()[0]:.1f} at the start")
    model, args, loss = build(a.size)
    group = model.albert.encoder.albert_layer_groups[0]
    graph = autoremat.capture(model, args, loss_fn=loss, repeats=3, warmup=1)
    vanilla, reference = _peak_and_grads(model, args, loss)
    with PerLayerCheckpoint(group):
        ckpt_peak, ckpt_grads = _peak_and_grads(model, args, loss)
    least = autoremat.solve(graph, "min")
    plans = {"autoremat least": least, "autoremat at checkpoint's peak":
             least if least.predicted_peak_bytes >= ckpt_peak else autoremat.solve(graph, ckpt_peak)}
    variants: dict[str, Callable[[], Any]] = {"unpatched": lambda: _Null(), "per-layer checkpoint":
                                              lambda: PerLayerCheckpoint(group)}
    variants.update({k: (lambda plan=plan: patched(model, plan)) for k, plan in plans.items()})
    rows = {"unpatched": {"peak_bytes": vanilla, "gradients_equal": True},
            "per-layer checkpoint": {"peak_bytes": ckpt_peak, "gradients_equal": gradients_equal(reference, ckpt_grads)}}
    for k, plan in plans.items():
        with patched(model, plan):
            peak, grads = _peak_and_grads(model, args, loss)
        rows[k] = {"peak_bytes": peak, "gradients_equal": gradients_equal(reference, grads),
                   "predicted_peak_bytes": plan.predicted_peak_bytes, "plan": plan.describe()}
    times: dict[str, list[float]] = {k: [] for k in variants}
    names = list(variants)
    for r in range(a.rounds):  # interleaved, the order rotated each round (no variant always follows another)
        for k in names[r % len(names):] + names[:r % len(names)]:
            with variants[k]():
                run_step(model, args, {}, loss)
                t0 = time.perf_counter()
                run_step(model, args, {}, loss)
                times[k].append(time.perf_counter() - t0)
    for k, row in rows.items():
        row["step_s"] = statistics.median(times[k])
        row["peak_over_unpatched"] = row["peak_bytes"] / vanilla
        row["time_over_unpatched"] = row["step_s"] / rows["unpatched"]["step_s"]
    a.out.mkdir(parents=True, exist_ok=True)
    data = {"machine": machine, "size": a.size, "config": SIZES[a.size], "rounds": a.rounds, "rows": rows}
    (a.out / f"albert_shared_{a.size}.json").write_text(json.dumps(data, indent=1))
    text = _report(data)
    (a.out / f"albert_shared_{a.size}.md").write_text(text)
    print(text)
    return 0


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _report(data: dict[str, Any]) -> str:
    lines = [f"# ALBERT ({data['size']}: {data['config']}): per-call plans against a per-layer checkpoint", "",
             f"Machine: {data['machine']}. Peak: CPU storage counter, one step after a warm-up step; time: median "
             f"of {data['rounds']} interleaved rounds (order rotated each round). The plans: "
             + "; ".join(f"{k}: {r['plan']}" for k, r in data["rows"].items() if "plan" in r) + ".", "",
             "| variant | step peak | of unpatched | predicted/measured | step time | of unpatched | gradients equal |",
             "|---|---|---|---|---|---|---|"]
    for k, r in data["rows"].items():
        pm = f"{r['predicted_peak_bytes'] / r['peak_bytes']:.3f}" if "predicted_peak_bytes" in r else ""
        lines.append(f"| {k} | {r['peak_bytes']:,} B | {r['peak_over_unpatched']:.3f}x | {pm} | {r['step_s'] * 1e3:.1f} ms "
                     f"| {r['time_over_unpatched']:.2f}x | {'yes' if r['gradients_equal'] else 'NO'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
