"""The comparison of ``benchmarks/compare`` on a CUDA GPU (written for an H100 / H200).

    python benchmarks/compare_gpu.py                     # everything (not yet timed on a GPU)
    python benchmarks/compare_gpu.py --models resnet50 --configs pytorch,autoremat
    python benchmarks/compare_gpu.py --offload-only      # only the offload comparison at 50 %
    python benchmarks/compare_gpu.py --quick --size small --batch-budgets resnet50=256MiB  # smoke run, one tiny model
    python benchmarks/compare_gpu.py --dry-run           # list the configurations; needs no GPU
    python benchmarks/compare_gpu.py --models gpt2 --no-batch --out run2   # in pieces: see merge_runs.py
    python benchmarks/compare_gpu.py --batch-only --out run2                # the largest-batch section alone

Same models, configurations and metrics as ``compare`` (see its docstring), with what differs on a GPU:

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

* the host<->device bandwidth is measured first (``autoremat.offload.bandwidth.measure_link``: pinned
  buffers, non_blocking copies timed by CUDA events, median per direction, the smaller used) and every
  captured graph plans and simulates offloads with it (``graph.meta["bandwidth_bytes_per_s"]``).

The offload comparison (``offload.json``, ``OFFLOAD.md``), per model at the 50 % budget (a fraction of the
measured unoptimised step peak, the same bytes for every row): the offload runtime running ``offload-dp``,
``offload-greedy``, ``vdnn`` and ``combined`` plans, against ``torch.autograd.graph.save_on_cpu(pin_memory=True)``
(offload every saved tensor) and recomputation alone (``dp-approx``), each with its measured CUDA step peak
(``torch.cuda.max_memory_allocated``), median step time (CUDA events), gradient check and whether it met the
budget. These are rows of the main comparison, gathered after it; ``--offload-only`` measures only what that
table needs (PyTorch's options and those solvers at 50 %, no compile, no largest-batch section).

Writes ``benchmarks/results/<device-name>/compare.json``, ``RESULTS.md``, ``compare_<model>.png``,
``offload.json`` and ``OFFLOAD.md`` with the device named (``torch.cuda.get_device_name``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS for the gradient check

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare  # noqa: E402  (the CPU harness; everything but the defaults is shared)

import torch  # noqa: E402

import autoremat  # noqa: E402
from autoremat.offload.bandwidth import LinkBandwidth, measure_link  # noqa: E402

GPU_BATCH = {"resnet50": 64, "densenet121": 32, "unet": 4, "gpt2": 8}
"""Batch per model on the GPU (papers: ResNet-50 96, DenseNet 32, U-Net 8; GPT-2 small 8 x 1024 tokens)."""

RESULTS = compare.ROOT / "benchmarks" / "results"

OFFLOAD_FRACTION = 0.5
"""Budget of the offload comparison, as a fraction of the measured unoptimised step peak."""
OFFLOAD_SOLVERS = ("offload-dp", "offload-greedy", "vdnn", "combined", "dp-approx")
"""Solvers of the offload comparison: the chain offloading solvers, the combined planner, and
recomputation alone (dp-approx)."""
OFFLOAD_FIELDS = ("model", "config", "kind", "status", "budget_bytes", "measured_peak_bytes", "peak_ratio",
                  "meets_budget", "predicted_peak_bytes", "step_time_s", "time_ratio", "gradients_equal",
                  "min_budget_bytes", "error")
"""Every row of ``offload.json`` carries these keys (``None`` where a field does not apply)."""


def device_slug(name: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"nvidia-h100-80gb-hbm3"`` (the results folder)."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "cuda"


def offload_configs(fraction: float = OFFLOAD_FRACTION) -> list[tuple[str, str]]:
    """``(config key, kind)`` of the offload comparison's rows, in table order."""
    kinds = {"dp-approx": "recomputation alone", "combined": "recomputation + offload runtime"}
    return [("none", "reference"), ("save-on-cpu", "save_on_cpu, everything offloaded")] + [
        (f"autoremat:{s}@{fraction:g}", kinds.get(s, "offload runtime")) for s in OFFLOAD_SOLVERS]


def offload_summary(result: dict[str, Any], link: dict[str, Any], fraction: float = OFFLOAD_FRACTION) -> dict[str, Any]:
    """The offload comparison gathered from a ``compare.run`` result (no measuring)."""
    wanted = offload_configs(fraction)
    models: dict[str, list[dict[str, Any]]] = {}
    for name, info in result["models"].items():
        rows = {r["config"]: r for r in info["rows"]}
        budget = next((r["budget_bytes"] for r in info["rows"]
                       if r["family"] == "autoremat" and r["budget_fraction"] == fraction), None)
        out = []
        for key, kind in wanted:
            r = rows.get(key)
            row = dict.fromkeys(OFFLOAD_FIELDS)
            row.update(model=name, config=key, kind=kind, budget_bytes=budget)
            if r is None:
                row.update(status="not_run", error="not in this run (see --solvers, --budgets, --configs)")
            else:
                row.update({k: r.get(k) for k in OFFLOAD_FIELDS if k not in ("model", "kind", "budget_bytes")})
                if r["status"] == "ok" and budget is not None and row["meets_budget"] is None:
                    row["meets_budget"] = r["measured_peak_bytes"] <= budget
            out.append(row)
        models[name] = out
    return {"fraction": fraction, "bandwidth": link, "models": models,
            "machine": result.get("machine"), "command": result.get("command")}


def _mib(b: Any) -> str:
    return "" if b is None else f"{b / 2**20:.1f}"


def offload_markdown(summary: dict[str, Any]) -> str:
    link = summary["bandwidth"]
    how = ("measured: pinned buffers, CUDA events, median of each direction" if link["measured"] else
           "not measured, no CUDA: the default")
    lines = [f"# Offloading at {summary['fraction']:.0%} of the unoptimised step peak", "",
             f"Host<->device bandwidth {link['bytes_per_s'] / 1e9:.2f} GB/s ({how}; host->device "
             f"{link['host_to_device_bytes_per_s'] / 1e9:.2f} GB/s, device->host "
             f"{link['device_to_host_bytes_per_s'] / 1e9:.2f} GB/s), used to plan every offload.", "",
             "Peak: measured step peak (the allocator's max_memory_allocated above the step's start); time: median "
             "step time; ratios against `none`. `save-on-cpu` has no budget: it offloads everything.", ""]
    for name, rows in summary["models"].items():
        budget = rows[0]["budget_bytes"]
        lines += [f"## {name} (budget {_mib(budget)} MiB)", "",
                  "| configuration | kind | status | peak MiB | peak ratio | meets budget | predicted MiB | "
                  "step ms | time ratio | gradients equal |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            status = r["status"]
            if status == "infeasible" and r["min_budget_bytes"]:
                status += f" (needs {_mib(r['min_budget_bytes'])} MiB)"
            elif r["error"] and status != "ok":
                status += f" ({str(r['error'])[:80]})"
            fmt = (lambda v, f: "" if v is None else f.format(v))
            lines.append(f"| {r['config']} | {r['kind']} | {status} | {_mib(r['measured_peak_bytes'])} | "
                         f"{fmt(r['peak_ratio'], '{:.2f}')} | {fmt(r['meets_budget'], '{}')} | "
                         f"{_mib(r['predicted_peak_bytes'])} | {fmt(r['step_time_s'] and r['step_time_s'] * 1e3, '{:.1f}')} | "
                         f"{fmt(r['time_ratio'], '{:.2f}')} | {fmt(r['gradients_equal'], '{}')} |")
        lines.append("")
    return "\n".join(lines)


def write_offload(summary: dict[str, Any], out: Path) -> None:
    """``offload.json`` and ``OFFLOAD.md`` under ``out``."""
    (out / "offload.json").write_text(json.dumps(compare.driver._finite(summary), indent=1,
                                                 default=compare.driver._json_default,
                                                 allow_nan=False) + "\n")
    (out / "OFFLOAD.md").write_text(offload_markdown(summary))


@contextlib.contextmanager
def planned_with_bandwidth(bytes_per_s: float) -> Iterator[None]:
    """Every graph ``compare`` solves plans and simulates offloads at ``bytes_per_s`` (set in the
    graph's ``meta`` before its first solve, unless it has one)."""
    original = compare.solving.solve_limited  # the seam compare.model calls through

    def solve_limited(graph: autoremat.Graph, budget_bytes: int, solver: str, timeout_s: float | None
                      ) -> tuple[str, Any, float]:
        graph.meta.setdefault("bandwidth_bytes_per_s", float(bytes_per_s))
        return original(graph, budget_bytes, solver, timeout_s)

    compare.solving.solve_limited = solve_limited
    try:
        yield
    finally:
        compare.solving.solve_limited = original


def run(models: Sequence[str], opts: Any, out: Path, link: LinkBandwidth, *, log: Callable[[str], None] = print,
        **run_kwargs: Any) -> dict[str, Any]:
    """``compare.run`` with offloads planned at ``link``'s bandwidth, then the offload comparison."""
    log(f"host<->device bandwidth {link.bytes_per_s / 1e9:.2f} GB/s "
        f"({'measured on ' + link.device if link.measured else 'default, not measured'})")
    with planned_with_bandwidth(link.bytes_per_s):
        result = compare.run(models, opts, out, log=log, **run_kwargs)
    summary = offload_summary(result, link.to_dict())
    write_offload(summary, out)
    result["offload"] = summary
    log(f"wrote {out / 'offload.json'} and {out / 'OFFLOAD.md'}")
    return result


def parser() -> Any:
    p = compare.parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="list configurations and batch tasks, run nothing")
    p.add_argument("--offload-only", action="store_true",
                   help=f"only the offload comparison: PyTorch's options and {','.join(OFFLOAD_SOLVERS)} at "
                        f"{OFFLOAD_FRACTION * 100:.0f}%% of the unoptimised peak, no compile, no largest-batch section")
    p.add_argument("--size", default="paper", choices=("paper", "small"), help="zoo size (default paper)")
    p.add_argument("--batch", default="", help="per-model batch overrides, e.g. resnet50=32,unet=2")
    p.set_defaults(threads=0, compile_timeout=900.0, solver_timeout=300.0)
    return p


def main(argv: Sequence[str] | None = None) -> Any:
    a = parser().parse_args(argv)
    if a.render:
        return compare.render(a.render)
    if a.batch_only and (a.no_batch or a.offload_only or a.dry_run):
        raise SystemExit("--batch-only excludes --no-batch, --offload-only and --dry-run")
    models, opts = compare.options_from(a, device="cuda", size=a.size)
    batch = dict(GPU_BATCH) if a.size == "paper" else {}
    for item in filter(None, (t.strip() for t in a.batch.split(","))):
        k, _, v = item.partition("=")
        batch[k.strip()] = int(v)
    opts.batch = batch
    if a.offload_only:
        opts.configs, opts.solvers, opts.autoremat_budgets = ("pytorch", "autoremat"), OFFLOAD_SOLVERS, (OFFLOAD_FRACTION,)
        a.no_batch = True
    budgets = compare.cli._sizes(a.batch_budgets)
    if a.dry_run:
        plan = compare.planned_configurations(models, opts)
        tasks = [] if a.no_batch else [(t.name, t.capacity, t.description)
                                       for t in compare.batch_tasks(a.quick, budgets, size=a.size)]
        print(f"{len(plan)} configurations on {len(models)} models ({a.size} size, batches {batch}):")
        for c in plan:
            print(f"  {c['model']:12s} {c['family']:9s} {c['config']}")
        for name, cap, desc in tasks:
            for method in compare.BATCH_METHODS:
                print(f"  largest batch: {name} under {cap / 2**30:.1f} GiB, {method} ({desc})")
        planned = {c["config"] for c in plan}
        offload = [(key, kind) for key, kind in offload_configs() if key in planned]
        print(f"offload comparison at {OFFLOAD_FRACTION:.0%} (bandwidth measured first), per model:")
        for key, kind in offload:
            print(f"  {key:28s} {kind}")
        return {"configurations": plan, "batch_tasks": tasks, "models": models, "options": opts,
                "offload_configs": offload}
    if not torch.cuda.is_available():
        raise SystemExit("compare_gpu.py needs a CUDA GPU (torch.cuda.is_available() is False); "
                         "use benchmarks/compare on the CPU or --dry-run")
    if a.threads:
        torch.set_num_threads(a.threads)
    name = torch.cuda.get_device_name(0)
    out = a.out or RESULTS / device_slug(name)
    command = "python benchmarks/compare_gpu.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if a.batch_only:
        return compare.run_batch_only(out, opts, quick=a.quick, command=command.strip(), batch_budgets=budgets,
                                      log=lambda s: print(s, flush=True))
    link = measure_link()
    return run(models, opts, out, link, batch=not a.no_batch, quick=a.quick, command=command.strip(),
               batch_budgets=budgets, log=lambda s: print(s, flush=True))


if __name__ == "__main__":
    main()
