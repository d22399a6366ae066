"""autoremat beside Hugging Face's ``gradient_checkpointing_enable()`` on the same model and batch.

    python benchmarks/hf_inside_layer.py                      # llama, bert, gpt2 at CPU sizes
    python benchmarks/hf_inside_layer.py --models llama --rounds 3 --out /tmp/hf_inside_layer

Configurations, each on a fresh deepcopy of the same model and batch:

* ``none``: no checkpointing; ``hf-ckpt``: ``model.gradient_checkpointing_enable()`` (non-reentrant);
* ``block-sac``: every decoder/encoder layer under selective checkpointing that saves the outputs
  of the matmuls (``mm``/``addmm``/``bmm``/attention) and recomputes the rest;
* ``autoremat@least``: the module-level plan at autoremat's least feasible budget;
* ``autoremat@hf``: the module-level plan at the step peak ``hf-ckpt`` measured (equal-peak
  comparison: fewer layers recomputed where the budget allows);
* ``autoremat@hf+sac``: the layers ``autoremat@hf`` recomputes (``autoremat@least``'s where the HF peak is
  below autoremat's least budget), run under selective checkpointing
  that keeps their matmul outputs (:mod:`autoremat.runtime.selective`; peak measured, not predicted);
* ``autoremat@hf+knapsack``: the same layers keeping the op outputs a per-region knapsack
  (:mod:`autoremat.solvers.selective_saves`, op costs from :func:`autoremat.capture.ops.record_ops`)
  picks within the bytes between the plan's predicted peak and the budget; its predicted peak is
  the plan's plus the kept bytes (all live at the start of backward, an upper bound).

Step peak: the live-storage counter (:func:`autoremat.measure.measure`); step time: medians over
``--rounds`` rounds in which every configuration runs once (interleaved, so machine drift hits all
alike). Gradients of every configuration are compared with ``none`` (``torch.equal``). Writes
``hf_inside_layer.json`` and ``hf_inside_layer.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

import autoremat
from autoremat.measure import LiveStorageCounter, gradients, gradients_equal, run_step
from autoremat.capture.ops import record_ops
from autoremat.runtime.selective import apply_selective, layer_paths
from autoremat.solvers.selective_saves import region_policies

DEFAULT_OUT = Path(__file__).parent / "results" / "cpu" / "hf_inside_layer"


def _models() -> dict[str, Callable[[], tuple[torch.nn.Module, tuple, dict, Callable]]]:
    import transformers

    def llama() -> tuple:
        cfg = transformers.LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=6,
                                       num_attention_heads=8, num_key_value_heads=2, use_cache=False)
        torch.manual_seed(0)
        ids = torch.randint(0, 4096, (4, 256))
        return transformers.LlamaForCausalLM(cfg).train(), (ids,), {"labels": ids}, lambda o: o.loss

    def bert() -> tuple:
        cfg = transformers.BertConfig(vocab_size=4096, hidden_size=256, num_hidden_layers=6, num_attention_heads=8,
                                      intermediate_size=1024, max_position_embeddings=256)
        torch.manual_seed(0)
        ids = torch.randint(0, 4096, (4, 256))
        return transformers.BertForMaskedLM(cfg).train(), (ids,), {"labels": ids}, lambda o: o.loss

    def gpt2() -> tuple:
        cfg = transformers.GPT2Config(vocab_size=4096, n_embd=256, n_layer=6, n_head=8, n_positions=256,
                                      use_cache=False)
        torch.manual_seed(0)
        ids = torch.randint(0, 4096, (4, 256))
        return transformers.GPT2LMHeadModel(cfg).train(), (ids,), {"labels": ids}, lambda o: o.loss

    return {"llama": llama, "bert": bert, "gpt2": gpt2}


def _peak(model: torch.nn.Module, args: tuple, kwargs: dict, loss_fn: Callable) -> int:
    model.zero_grad(set_to_none=True)
    counter = LiveStorageCounter()
    with counter:
        run_step(model, args, kwargs, loss_fn)
    model.zero_grad(set_to_none=True)
    return counter.peak


def _grads(model: torch.nn.Module, args: tuple, kwargs: dict, loss_fn: Callable) -> dict:
    torch.manual_seed(3)
    run_step(model, args, kwargs, loss_fn)
    g = gradients(model)
    model.zero_grad(set_to_none=True)
    return g


def _configs(name: str, rounds: int) -> dict[str, Any]:
    build = _models()[name]
    base, args, kwargs, loss_fn = build()
    configs: dict[str, dict[str, Any]] = {}

    def add(label: str, model: torch.nn.Module, **info: Any) -> None:
        configs[label] = {"model": model, **info}

    add("none", copy.deepcopy(base))
    hf = copy.deepcopy(base)
    hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    add("hf-ckpt", hf)
    sac = copy.deepcopy(base)
    apply_selective(sac, {p: "matmuls" for p in layer_paths(sac)})
    add("block-sac", sac)
    hf_peak = _peak(hf, args, kwargs, loss_fn)
    t0 = time.perf_counter()
    graph = autoremat.capture(base, args, kwargs, loss_fn=loss_fn)
    capture_s = time.perf_counter() - t0
    try:
        least = autoremat.solve(graph, 1)
    except autoremat.InfeasibleBudgetError as err:
        least = autoremat.solve(graph, err.min_budget_bytes)
    m = copy.deepcopy(base)
    autoremat.apply(m, least)
    add("autoremat@least", m, predicted_peak_bytes=least.predicted_peak_bytes)
    try:
        at_hf = autoremat.solve(graph, hf_peak)
    except autoremat.InfeasibleBudgetError:
        at_hf = None
    if at_hf is not None:
        m = copy.deepcopy(base)
        autoremat.apply(m, at_hf)
        add("autoremat@hf", m, predicted_peak_bytes=at_hf.predicted_peak_bytes)
    plan = at_hf or least  # below the least budget, the least plan's layers
    names = plan.node_names
    paths = [names[seg.nodes[0]] for seg in plan.recompute_segments]
    m = copy.deepcopy(base)
    apply_selective(m, {p: "matmuls" for p in paths})
    add("autoremat@hf+sac", m)
    # knapsack: keep the op outputs that save the most replay time within the bytes left
    # between the plan's predicted peak and the budget
    ops = record_ops(base, paths, args, kwargs, loss_fn=loss_fn)
    allowance = max(0, hf_peak - plan.predicted_peak_bytes)
    keep = region_policies({p: [(o.out_bytes, o.time_s) for o in ops[p]] for p in paths}, allowance)
    m = copy.deepcopy(base)
    apply_selective(m, {p: set(k) for p, k in keep.items()})
    kept = sum(ops[p][i].out_bytes for p, k in keep.items() for i in k)
    add("autoremat@hf+knapsack", m, predicted_peak_bytes=plan.predicted_peak_bytes + kept, kept_bytes=kept)
    reference = _grads(configs["none"]["model"], args, kwargs, loss_fn)
    for label, c in configs.items():
        c["peak_bytes"] = _peak(c["model"], args, kwargs, loss_fn)
        c["grads_equal"] = gradients_equal(reference, _grads(c["model"], args, kwargs, loss_fn))
        c["times"] = []
    for _ in range(rounds):
        for c in configs.values():
            c["model"].zero_grad(set_to_none=True)
            t = time.perf_counter()
            run_step(c["model"], args, kwargs, loss_fn)
            c["times"].append(time.perf_counter() - t)
    rows = {}
    for label, c in configs.items():
        rows[label] = {"peak_bytes": int(c["peak_bytes"]), "step_time_s": statistics.median(c["times"]),
                       "grads_equal": bool(c["grads_equal"]),
                       "predicted_peak_bytes": c.get("predicted_peak_bytes"), "kept_bytes": c.get("kept_bytes")}
    return {"model": name, "capture_s": capture_s, "hf_peak_bytes": hf_peak, "rows": rows,
            "least_plan": least.describe(), "hf_plan": at_hf.describe() if at_hf else None}


def _markdown(results: list[dict[str, Any]], rounds: int) -> str:
    lines = [f"# autoremat beside HF gradient checkpointing (CPU, {torch.get_num_threads()} threads, "
             f"{rounds} interleaved rounds)", ""]
    for r in results:
        rows = r["rows"]
        hf = rows["hf-ckpt"]
        lines += [f"## {r['model']}", "", "| config | peak MiB | x none | x hf-ckpt | step s | x hf-ckpt | "
                  "predicted MiB | grads equal |", "|---|---|---|---|---|---|---|---|"]
        for label, row in rows.items():
            pred = row["predicted_peak_bytes"]
            lines.append(f"| {label} | {row['peak_bytes'] / 2**20:.2f} | {row['peak_bytes'] / rows['none']['peak_bytes']:.2f}"
                         f" | {row['peak_bytes'] / hf['peak_bytes']:.2f} | {row['step_time_s']:.3f} | "
                         f"{row['step_time_s'] / hf['step_time_s']:.2f} | "
                         f"{'' if pred is None else f'{pred / 2**20:.2f}'} | {row['grads_equal']} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama,bert,gpt2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    results = [_configs(n, a.rounds) for n in a.models.split(",")]
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "hf_inside_layer.json").write_text(json.dumps(results, indent=1))
    (a.out / "hf_inside_layer.md").write_text(_markdown(results, a.rounds))
    print(_markdown(results, a.rounds))


if __name__ == "__main__":
    main()
