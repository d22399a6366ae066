"""A diffusers ``UNet2DConditionModel`` as a user trains it: autoremat against diffusers' own
``enable_gradient_checkpointing()`` (peak and step time), on a model nobody wrote for autoremat.

    pip install diffusers==0.31.0   # not a dependency of autoremat
    python -P benchmarks/diffusers_unet.py [--size 32] [--batch 8] [--rounds 3] [--out DIR]

The step is the noise-prediction loss (``mse_loss(unet(x, t, encoder_hidden_states=c).sample,
noise)``). The UNet's config is a small Stable-Diffusion-like one (three down blocks, two of them
with cross-attention; every ResNet block shares one ``nn.SiLU`` object, which module-level capture
had to learn, see ``autoremat.capture.aliases``). Rows: the unpatched step, diffusers'
checkpointing, and autoremat's plans at 75 %, 60 %, 50 % and the least budget (a budget below
the least is listed as such) (``solve(g, "min")``),
each with its measured peak (CPU storage counter), predicted peak, median step time over
``--rounds`` interleaved rounds, and whether its gradients equal the unpatched model's bit for bit.
Writes ``diffusers_unet.json`` and ``.md`` to ``--out``. One intra-op thread (a shared machine).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import autoremat
from autoremat.measure import gradients, gradients_equal, measure


def build(size: int, batch: int) -> tuple[Any, tuple, dict, Any]:
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        sample_size=size, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(64, 128, 128),
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=64,
        attention_head_dim=8, norm_num_groups=32).train()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 4, size, size, generator=g)
    t = torch.randint(0, 1000, (batch,), generator=g)
    cond = torch.randn(batch, 16, 64, generator=g)
    noise = torch.randn(batch, 4, size, size, generator=g)
    return unet, (x, t), {"encoder_hidden_states": cond}, lambda out: F.mse_loss(out.sample, noise)


def _timed(model: Any, args: tuple, kwargs: dict, loss_fn: Any) -> float:
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    loss_fn(model(*args, **kwargs)).backward()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/cpu/diffusers_unet")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    import diffusers

    unet, args, kwargs, loss_fn = build(a.size, a.batch)
    start = time.perf_counter()
    graph = autoremat.capture(unet, args, kwargs, loss_fn=loss_fn)
    capture_s = time.perf_counter() - start
    _timed(unet, args, kwargs, loss_fn)
    ref = gradients(unet)
    models: dict[str, tuple[Any, int | None]] = {"unpatched": (unet, autoremat.simulate(graph, autoremat.solve(
        graph, "100%")).peak_bytes)}
    gc_model = build(a.size, a.batch)[0]
    gc_model.enable_gradient_checkpointing()
    models["diffusers checkpointing"] = (gc_model, None)
    plans, infeasible = {}, {}
    for budget in ("75%", "60%", "50%", "min"):
        try:
            plan = autoremat.solve(graph, budget)
        except autoremat.InfeasibleBudgetError as err:  # below the least budget: said in the result
            infeasible[budget] = err.min_budget_bytes
            continue
        patched = build(a.size, a.batch)[0]
        autoremat.apply(patched, plan)
        models[f"autoremat {budget}"] = (patched, autoremat.simulate(graph, plan).peak_bytes)
        plans[f"autoremat {budget}"] = plan.describe()
    rows: dict[str, dict[str, Any]] = {}
    for name, (model, predicted) in models.items():
        _timed(model, args, kwargs, loss_fn)
        got = gradients(model)
        rows[name] = {"measured_peak_bytes": measure(model, args, kwargs, loss_fn=loss_fn, steps=1, warmup=1).peak_bytes,
                      "predicted_peak_bytes": predicted, "grads_equal": gradients_equal(ref, got),
                      "plan": plans.get(name, ""), "times_s": []}
    for _ in range(a.rounds):  # interleaved: each round times every row once
        for name, (model, _p) in models.items():
            rows[name]["times_s"].append(_timed(model, args, kwargs, loss_fn))
    base = rows["unpatched"]
    for r in rows.values():
        r["step_s"] = statistics.median(r["times_s"])
        r["peak_x"] = r["measured_peak_bytes"] / base["measured_peak_bytes"]
        r["time_x"] = r["step_s"] / statistics.median(base["times_s"])
    result = {"machine": f"{platform.machine()}, {torch.get_num_threads()} intra-op thread, CPU",
              "torch": torch.__version__, "diffusers": diffusers.__version__, "size": a.size, "batch": a.batch,
              "graph": {"mode": graph.meta.get("mode"), "nodes": len(graph)}, "capture_s": capture_s, "rows": rows,
              "infeasible": infeasible}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "diffusers_unet.json").write_text(json.dumps(result, indent=1))
    lines = [f"# diffusers UNet2DConditionModel, {a.size} px latents, batch {a.batch}",
             "", f"{result['machine']}; torch {torch.__version__}, diffusers {diffusers.__version__}; "
             f"{graph.meta.get('mode')}-level graph of {len(graph)} nodes, captured in {capture_s:.1f} s.", "",
             "| row | measured peak (B) | x unpatched | predicted / measured | step (s, median) | x unpatched | "
             "grads equal | plan |", "|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        ratio = "" if r["predicted_peak_bytes"] is None else f"{r['predicted_peak_bytes'] / r['measured_peak_bytes']:.3f}"
        lines.append(f"| {name} | {r['measured_peak_bytes']:,} | {r['peak_x']:.3f} | {ratio} | {r['step_s']:.3f} | "
                     f"{r['time_x']:.2f} | {r['grads_equal']} | {r['plan']} |")
    lines += [f"\nBelow the least budget ({v:,} B), no plan: {k}" for k, v in infeasible.items()]
    (out / "diffusers_unet.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


if __name__ == "__main__":
    main()
