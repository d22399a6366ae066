"""The comparison of ``benchmarks/compare.py`` on a CUDA GPU (written for an H100 / H200).

    python benchmarks/compare_gpu.py                     # everything, ~1 h on an H100
    python benchmarks/compare_gpu.py --models resnet50 --configs pytorch,autoremat
    python benchmarks/compare_gpu.py --dry-run           # list the configurations; needs no GPU

Same models, configurations and metrics as ``compare.py`` (see its docstring), with what differs on a GPU:

* models at the papers' size (``autoremat.zoo.build(..., size="paper")``: ResNet-50 and DenseNet-121 on
  3x224x224, U-Net on 1x572x572 tiles) with GPU batches (``GPU_BATCH``, below the papers' batch where a
  full configuration sweep would take too long), and GPT-2 small (12 layers, 768 wide, vocabulary 50257,
  1024 tokens) in place of the CPU-size config;
* the step peak is the caching allocator's ``max_memory_allocated`` after ``reset_peak_memory_stats``,
  minus what was allocated when the step began (``autoremat.measure`` on CUDA);
* step times come from CUDA events, interleaved round-robin as on the CPU;
* ``save_on_cpu`` really offloads (pinned host memory);
* the gradient check runs with deterministic kernels (``torch.use_deterministic_algorithms``, cuDNN
  deterministic), both for the reference and for each configuration;
* the largest-batch comparison uses a real budget: ``torch.cuda.set_per_process_memory_fraction(B / total)``
  makes the allocator raise ``torch.OutOfMemoryError`` above B bytes (``LitClassifier`` at paper size and
  GPT-2 small in ``LitGPT2``; budgets in ``compare.batch_tasks``).

Writes ``benchmarks/results/<device-name>/compare.json``, ``RESULTS.md`` and ``compare_<model>.png`` with
the device named (``torch.cuda.get_device_name``).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS for the gradient check

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare  # noqa: E402  (the CPU harness; everything but the defaults is shared)

import torch  # noqa: E402

GPU_BATCH = {"resnet50": 64, "densenet121": 32, "unet": 4, "gpt2": 8}
"""Batch per model on the GPU (papers: ResNet-50 96, DenseNet 32, U-Net 8; GPT-2 small 8 x 1024 tokens)."""

RESULTS = compare.ROOT / "benchmarks" / "results"


def device_slug(name: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"nvidia-h100-80gb-hbm3"`` (the results folder)."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "cuda"


def parser() -> Any:
    p = compare.parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="list configurations and batch tasks, run nothing")
    p.add_argument("--size", default="paper", choices=("paper", "small"), help="zoo size (default paper)")
    p.add_argument("--batch", default="", help="per-model batch overrides, e.g. resnet50=32,unet=2")
    p.set_defaults(threads=0, compile_timeout=900.0, solver_timeout=300.0)
    return p


def main(argv: Sequence[str] | None = None) -> Any:
    a = parser().parse_args(argv)
    if a.render:
        return compare.render(a.render)
    models, opts = compare.options_from(a, device="cuda", size=a.size)
    batch = dict(GPU_BATCH) if a.size == "paper" else {}
    for item in filter(None, (t.strip() for t in a.batch.split(","))):
        k, _, v = item.partition("=")
        batch[k.strip()] = int(v)
    opts.batch = batch
    budgets = compare._sizes(a.batch_budgets)
    if a.dry_run:
        plan = compare.planned_configurations(models, opts)
        tasks = [] if a.no_batch else [(t.name, t.capacity, t.description)
                                       for t in compare.batch_tasks(False, budgets, size=a.size)]
        print(f"{len(plan)} configurations on {len(models)} models ({a.size} size, batches {batch}):")
        for c in plan:
            print(f"  {c['model']:12s} {c['family']:9s} {c['config']}")
        for name, cap, desc in tasks:
            for method in compare.BATCH_METHODS:
                print(f"  largest batch: {name} under {cap / 2**30:.1f} GiB, {method} ({desc})")
        return {"configurations": plan, "batch_tasks": tasks, "models": models, "options": opts}
    if not torch.cuda.is_available():
        raise SystemExit("compare_gpu.py needs a CUDA GPU (torch.cuda.is_available() is False); "
                         "use benchmarks/compare.py on the CPU or --dry-run")
    if a.threads:
        torch.set_num_threads(a.threads)
    name = torch.cuda.get_device_name(0)
    out = a.out or RESULTS / device_slug(name)
    command = "python benchmarks/compare_gpu.py " + " ".join(sys.argv[1:] if argv is None else argv)
    return compare.run(models, opts, out, batch=not a.no_batch, quick=a.quick, command=command.strip(),
                       batch_budgets=budgets, log=lambda s: print(s, flush=True))


if __name__ == "__main__":
    main()
