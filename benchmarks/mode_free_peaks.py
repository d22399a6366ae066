"""Step peaks measured with and without a Python dispatch mode.

Any Python dispatch mode active during backward makes PyTorch sum two gradients of one tensor out
of place (``aten.add.Tensor``, a third buffer) where a plain run sums them in place (``aten::add_``
in the profiler): seen on a ReLU output read by a max pool and a slice. The storage counter that
measures every CPU peak of the tests and benchmarks (:class:`autoremat.measure.LiveStorageCounter`)
is such a mode, so it can report a gradient-sized buffer a plain run does not allocate. This script
measures each plan's step peak three ways, one thread:

* ``predicted``: :func:`autoremat.cost.simulate`;
* ``counter``: :func:`autoremat.measure.measure` (the storage counter);
* ``profiler``: ``torch.profiler`` with ``profile_memory=True`` and no dispatch mode: each op's own
  allocations and frees summed in time order, so op-level resolution (a transient inside one op is
  not seen) and without what was allocated before the profiled step (parameters, the inputs).
  It misses allocations: on a Hugging Face SpeechT5's least plan it read 42.1 MB where the
  allocator's timeline and the counter read 50.4 MB (2026-11-29);
* ``allocator``: the profiler's memory timeline (``_memory_profile``: every allocation and free
  of the CPU allocator, no dispatch mode), what the tests hold the counter to
  (``tests/test_measure_accumulation.py``); it also sees workspace an op allocates and frees
  inside itself, which neither the counter nor the cost model count (DESIGN.md).

The counter follows the engine's rule for a second gradient since 2026-11-29: added in place into
the first where that is dense (contiguous or permuted, channels_last) and not a view of another
buffer, out of place otherwise; before, it took only contiguous sums as in place (channels_last
U-Net least plan: 5,605,888 B counted, now 4,479,488 B, predicted 4,516,352 B).

    python benchmarks/mode_free_peaks.py [--models unet,resnet50,gpt2] [--budgets none,min,60%]
                                         [--out benchmarks/results/cpu/mode_free_peaks]

Writes ``mode_free_peaks.json`` and ``.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import torch
from torch.profiler import ProfilerActivity, profile

import autoremat
from autoremat.cost import no_recompute_plan, simulate
from autoremat.measure import measure
from compare import machine_info  # this folder's comparison script


def profiler_peak(model: torch.nn.Module, args: tuple, kwargs: dict, loss_fn: Callable[[Any], torch.Tensor]) -> int:
    """The live-bytes peak of one step (after a warm-up step) from the profiler's memory events."""
    loss_fn(model(*args, **kwargs)).backward()
    model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = loss_fn(model(*args, **kwargs))
        loss.backward()
        del loss
    model.zero_grad(set_to_none=True)
    live = peak = 0
    for e in sorted((e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start):
        live += e.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


def allocator_peak(model: torch.nn.Module, args: tuple, kwargs: dict, loss_fn: Callable[[Any], torch.Tensor]) -> int:
    """The live-bytes peak of one step (after a warm-up step) from the CPU allocator's timeline."""
    loss_fn(model(*args, **kwargs)).backward()
    model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        loss = loss_fn(model(*args, **kwargs))
        loss.backward()
        del loss
    model.zero_grad(set_to_none=True)
    live = peak = 0
    for _, action, _, size in prof._memory_profile().timeline:
        live += size if action.name == "CREATE" else -size if action.name == "DESTROY" else 0
        peak = max(peak, live)
    return peak


def _mean(y: Any) -> torch.Tensor:
    return (y if isinstance(y, torch.Tensor) else y.logits).float().mean()


def cases(names: list[str]) -> Iterator[tuple[str, str, torch.nn.Module, tuple, dict]]:
    """``(model, memory format, module, args, kwargs)``: zoo CNNs contiguous and channels_last,
    Hugging Face examples as they are."""
    for name in names:
        if name in autoremat.zoo.names():
            for fmt in ("contiguous", "channels_last"):
                model, args = autoremat.zoo.build(name, size="small")
                if fmt == "channels_last":
                    model = model.to(memory_format=torch.channels_last)
                    args = tuple(a.to(memory_format=torch.channels_last) for a in args)
                yield name, fmt, model, args, {}
        else:
            from autoremat.zoo import hf

            ex = hf.example(name)
            yield name, "contiguous", ex.model, ex.args, ex.kwargs


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="unet,resnet50,gpt2")
    ap.add_argument("--budgets", default="none,min,60%")
    ap.add_argument("--out", default="benchmarks/results/cpu/mode_free_peaks")
    opts = ap.parse_args(argv)
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    rows = []
    for name, fmt, model, args, kwargs in cases(opts.models.split(",")):
        graph = autoremat.capture(model, args, kwargs=kwargs, loss_fn=_mean, times="flops")
        for budget in opts.budgets.split(","):
            plan = no_recompute_plan(graph) if budget == "none" else autoremat.solve(graph, budget)
            patched = model if budget == "none" else autoremat.apply(copy.deepcopy(model), plan)
            row = {"model": name, "format": fmt, "budget": budget, "predicted": simulate(graph, plan).peak_bytes,
                   "counter": measure(patched, args, kwargs, loss_fn=_mean, steps=1, warmup=1).peak_bytes,
                   "profiler": profiler_peak(patched, args, kwargs, _mean),
                   "allocator": allocator_peak(patched, args, kwargs, _mean)}
            row["predicted/profiler"] = round(row["predicted"] / row["profiler"], 4)
            row["counter/profiler"] = round(row["counter"] / row["profiler"], 4)
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {"machine": machine_info(torch.device("cpu")), "rows": rows}
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "mode_free_peaks.json").write_text(json.dumps(result, indent=1))
    lines = ["# Step peaks with and without a dispatch mode", "",
             f"Machine: {result['machine']['platform_machine']}, {result['machine']['cpu_count']} cores, CPU, 1 thread, "
             f"load {result['machine'].get('load_avg_1m')}; torch {result['machine']['torch']}; bytes.", "",
             "| model | format | budget | predicted | counter | profiler | allocator | predicted/profiler | "
             "counter/profiler |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['format']} | {r['budget']} | {r['predicted']:,} | {r['counter']:,} | "
              f"{r['profiler']:,} | {r['allocator']:,} | {r['predicted/profiler']} | {r['counter/profiler']} |"
              for r in rows]
    (out / "mode_free_peaks.md").write_text("\n".join(lines) + "\n")
    return result


if __name__ == "__main__":
    main()
