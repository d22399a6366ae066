"""The headline numbers, ``RESULTS.md`` and the plots, from a result (no measuring)."""

from __future__ import annotations

import contextlib
import math
import os
import platform
from pathlib import Path
from typing import Any

import torch

from .runners import COMPILED, TORCH_REGIONS


def headline(models: dict[str, dict[str, Any]], batch_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The numbers the README quotes, computed from the rows."""
    out: dict[str, Any] = {"per_model": {}, "resnet50_50pct": None, "largest_batch": {}, "worst_prediction_error": None,
                           "budget_exceeded": [], "regions": [], "compiled_plans": []}
    worst = None
    for name, info in models.items():
        rows = [r for r in info["rows"] if r["status"] == "ok" and r["step_time_s"] is not None]
        base = next((r for r in rows if r["config"] == "none"), None)
        torch_rows = [r for r in rows if r["family"] in ("pytorch", "compile")
                      and base is not None and r["measured_peak_bytes"] < base["measured_peak_bytes"]]
        auto = [r for r in rows if r["family"] == "autoremat"]
        by_key = {r["config"]: r for r in auto}
        low = min((r for r in rows if r["family"] == "compile"), key=lambda c: c["measured_peak_bytes"], default=None)
        for r in auto:
            if r["config"].endswith(COMPILED):
                out["compiled_plans"].append({
                    "model": name, "config": r["config"], "peak_ratio": r["peak_ratio"], "time_ratio": r["time_ratio"],
                    "lowest_compile": None if low is None else low["config"],
                    "lowest_compile_peak_ratio": None if low is None else low["peak_ratio"],
                    "lowest_compile_time_ratio": None if low is None else low["time_ratio"]})
            lean = by_key.get(r["config"].removesuffix(TORCH_REGIONS))
            if r["config"].endswith(TORCH_REGIONS) and lean is not None:
                out["regions"].append({"model": name, "config": lean["config"], "lean_time_s": lean["step_time_s"],
                                       "torch_time_s": r["step_time_s"],
                                       "time_ratio": lean["step_time_s"] / r["step_time_s"],
                                       "same_peak": lean["measured_peak_bytes"] == r["measured_peak_bytes"]})
        matches = []
        for p in sorted(torch_rows, key=lambda r: r["measured_peak_bytes"]):
            cands = [a for a in auto if a["measured_peak_bytes"] <= p["measured_peak_bytes"]]
            best = min(cands, key=lambda a: a["step_time_s"]) if cands else None
            matches.append({
                "pytorch": p["config"], "pytorch_peak_bytes": p["measured_peak_bytes"],
                "pytorch_time_s": p["step_time_s"],
                "autoremat": best["config"] if best else None,
                "autoremat_peak_bytes": best["measured_peak_bytes"] if best else None,
                "autoremat_time_s": best["step_time_s"] if best else None,
                "time_ratio": best["step_time_s"] / p["step_time_s"] if best else None,
            })
        lowest = matches[0] if matches else None
        matched = next((mt for mt in matches if mt["autoremat"]), None)
        out["per_model"][name] = {"lowest_peak_pytorch": lowest, "lowest_matched_pytorch": matched,
                                  "matches": matches}
        for r in info["rows"]:
            if r["meets_budget"] is False:
                out["budget_exceeded"].append({"model": name, "config": r["config"], "budget_bytes": r["budget_bytes"],
                                               "measured_peak_bytes": r["measured_peak_bytes"]})
            if r["prediction_error"] is not None and (worst is None or abs(r["prediction_error"]) > abs(worst["error"])):
                worst = {"model": name, "config": r["config"], "error": r["prediction_error"]}
        if name == "resnet50":
            half = [r for r in info["rows"] if r["family"] == "autoremat" and r["budget_fraction"] == 0.5
                    and not r["config"].endswith((TORCH_REGIONS, COMPILED))]
            out["resnet50_50pct"] = {r["solver"]: {"status": r["status"], "time_ratio": r["time_ratio"],
                                                   "peak_ratio": r["peak_ratio"]} for r in half}
    out["worst_prediction_error"] = worst
    for r in batch_rows:
        out["largest_batch"].setdefault(r["task"], {})[r["method"]] = {
            "batch_size": r["batch_size"], "confirmed": r["confirmed"], "initial": r["initial_batch_size"]}
    return out


def machine_info(device: torch.device) -> dict[str, Any]:
    import lightning

    info = {"platform_machine": platform.machine(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "lightning": lightning.__version__, "device": str(device), "system": platform.system(),
            "cuda_available": torch.cuda.is_available()}
    with contextlib.suppress(OSError, AttributeError):
        info["load_avg_1m"] = os.getloadavg()[0]  # other work on a shared machine
    with contextlib.suppress(ImportError):
        import transformers

        info["transformers"] = transformers.__version__
    if device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(device)
        info["device_memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
    return info


def _mib(b: Any) -> str:
    return "" if b is None else f"{b / 2**20:.2f} MiB"


def _ms(s: Any) -> str:
    return "" if s is None else f"{s * 1e3:.1f} ms"


def _sec(v: Any) -> str:
    return "" if v is None else f"{v:.1f} s"


def _x(v: Any) -> str:
    return "" if v is None else f"{v:.2f}x"


def _pct(v: Any) -> str:
    return "" if v is None else f"{v:.0%}"


def _command_lines(result: dict[str, Any]) -> list[str]:
    """What was run: one command, or the runs a merged result joins (``merge_runs.py``); a note
    when the run had not finished."""
    runs = result.get("runs")
    if runs:
        lines = [f"Merged from {len(runs)} runs on the same machine kind (`benchmarks/merge_runs.py`); every ratio is "
                 "to the `none` measured side by side with the row in its own run:", ""]
        lines += [f"* run {k + 1}: `{r['command']}` ({r['wall_s'] / 60:.1f} min"
                  f"{', stopped before it finished' if r['partial'] else ''}): {', '.join(r['models']) or 'no model'}"
                  f"{'; largest-batch section' if r['largest_batch'] else ''}" for k, r in enumerate(runs)]
        return lines + [""]
    lines = [f"Command: `{result['command']}` ({result['wall_s'] / 60:.1f} min).", ""]
    if result.get("partial"):
        lines += [f"**Partial results**: written after each model; the run had not finished (models so far: "
                  f"{', '.join(result['models']) or 'none'}; no largest-batch section yet).", ""]
    return lines


def to_markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    s = result["settings"]
    where = (f"{m.get('device_name', m['device'])}" if m["device"].startswith("cuda")
             else f"{m['platform_machine']} CPU, os.cpu_count() = {m['cpu_count']}")
    lines = [
        f"# autoremat vs PyTorch's own memory savers ({where})", "",
        f"Machine: `platform.machine()` = {m['platform_machine']}, `os.cpu_count()` = {m['cpu_count']}, "
        f"torch {m['torch']} ({m['torch_threads']} intra-op thread(s)), Lightning {m['lightning']}, "
        f"transformers {m.get('transformers', '-')}, Python {m['python']}"
        + (f", GPU {m['device_name']} ({m['device_memory_bytes'] / 2**30:.1f} GiB)" if "device_name" in m else
           ", CPU only (no GPU), shared with other jobs running at the same time"
           + ("" if m.get("load_avg_1m") is None else f" (1-minute load average {m['load_avg_1m']:.2f} at the start)"))
        + ".", "",
        *_command_lines(result),
    ]
    if m["device"] == "cpu":
        lines += [
            "**Timings on this shared 2-core machine are noisy: read the ratios, not the milliseconds.** Each "
            f"model's configurations ran round-robin in one process ({s['rounds']} rounds x {s['steps_per_round']} "
            "steps, the order rotated every round), so drift hits all of them alike; the time is the median of "
            "those steps and the ratio is to `none` from the same rounds. Step peak: the live-storage counter of "
            "`autoremat.measure` (bytes of storages created during one forward+backward above what was live when "
            "the step started). `torch.compile` rows: the same counter, left on while the compiled code runs "
            "(`ignore_compile_internals`), with Inductor's CPU buffer allocation routed through the dispatcher so "
            "its buffers are counted; compile time is the first compiled step (Dynamo + AOTAutograd + Inductor + "
            "C++ build, cold cache) and is not in the step time.", ""]
    else:
        lines += [
            f"Step peak: `torch.cuda.max_memory_allocated` after `reset_peak_memory_stats`, minus what was allocated "
            f"when the step began; step time: CUDA events, median of {s['rounds']} interleaved rounds x "
            f"{s['steps_per_round']} steps. Compile time is the first compiled step.", ""]
    lines += [
        "Configurations (each on a fresh deepcopy of the same model and batch): `none`; `block-ac`: per-block "
        "`apply_activation_checkpointing(checkpoint_wrapper(NO_REENTRANT))` as Lightning's FSDP strategy and "
        "Accelerate apply it; `block-sac`: the same blocks under selective checkpointing saving "
        "`aten.mm/addmm/bmm/convolution` outputs; `ckpt-seq`: `checkpoint_sequential` with ~sqrt(n) segments where "
        "the model is a sequence; `save-on-cpu`: `torch.autograd.graph.save_on_cpu`; `compile@B`: `torch.compile` "
        f"({s['compile_backend']}) with `activation_memory_budget = B`; `autoremat:<solver>@f`: "
        "`autoremat.solve(graph, f x measured unoptimised "
        "peak, solver=...)` applied with `autoremat.apply` (autoremat's own recomputed regions; a "
        "`+torch-regions` row runs the same plan on `torch.utils.checkpoint` regions, a `+compile` row the patched "
        "model under `torch.compile`, where each region becomes a checkpoint op that the compiled backward "
        "recomputes). Gradients: `torch.equal` on every parameter gradient "
        "against `none` from the same RNG state; compile rows report the largest absolute difference (on models with "
        "dropout it includes different dropout masks: Inductor draws its own random numbers).", ""]
    h = result["headline"]
    lines += ["## Headline", ""]
    for name, hm in h["per_model"].items():
        lo = hm["lowest_peak_pytorch"]
        if lo is None:
            lines.append(f"* **{name}**: no PyTorch option measured below the unoptimised peak.")
        elif lo["autoremat"] is None:
            mt = hm.get("lowest_matched_pytorch")
            lines.append(f"* **{name}**: the lowest-peak PyTorch option is `{lo['pytorch']}` "
                         f"({_mib(lo['pytorch_peak_bytes'])}); no autoremat row measured at or below it."
                         + ("" if not mt else
                            f" The lowest-peak PyTorch option that one matches is `{mt['pytorch']}` "
                            f"({_mib(mt['pytorch_peak_bytes'])}, {_ms(mt['pytorch_time_s'])}) vs `{mt['autoremat']}` "
                            f"({_mib(mt['autoremat_peak_bytes'])}, {_ms(mt['autoremat_time_s'])}): step time ratio "
                            f"**{mt['time_ratio']:.2f}**."))
        else:
            lines.append(f"* **{name}**: lowest-peak PyTorch option `{lo['pytorch']}` ({_mib(lo['pytorch_peak_bytes'])}, "
                         f"{_ms(lo['pytorch_time_s'])}) vs fastest autoremat row at an equal or lower peak "
                         f"`{lo['autoremat']}` ({_mib(lo['autoremat_peak_bytes'])}, {_ms(lo['autoremat_time_s'])}): "
                         f"step time ratio autoremat / PyTorch = **{lo['time_ratio']:.2f}**.")
    if h["resnet50_50pct"]:
        parts = [f"{sv}: {_x(v['time_ratio'])} ({_pct(v['peak_ratio'])} peak)" if v["status"] == "ok"
                 else f"{sv}: {v['status']}" for sv, v in h["resnet50_50pct"].items()]
        lines.append("* **resnet50 at a 50 % budget**, step time vs `none`: " + "; ".join(parts) + ".")
    steps = s.get("confirm_steps", 2)
    for task, d in h["largest_batch"].items():
        def one(method: str) -> str:
            v = d.get(method)
            if v is None:
                return "n/a"
            return f"{v['batch_size']}" + (f" (trained {steps} steps)" if v["confirmed"]
                                           else " (**failed** its training steps)")
        a, b = d.get("autoremat"), d.get("batchsizefinder")
        ratio = (f": **{a['batch_size'] / b['batch_size']:.1f}x** BatchSizeFinder's"
                 if a and b and a["confirmed"] and b["confirmed"] and b["batch_size"] else "")
        lines.append(f"* **Largest batch, {task}** (from {next(iter(d.values()))['initial']}, same simulated budget): "
                     f"autoremat {one('autoremat')}; BatchSizeFinder {one('batchsizefinder')}{ratio}.")
    for rg in h.get("regions", []):
        lines.append(f"* **autoremat's regions vs `torch.utils.checkpoint` regions**, {rg['model']} `{rg['config']}` "
                     f"(same plan): step time {_ms(rg['lean_time_s'])} vs {_ms(rg['torch_time_s'])}, ratio "
                     f"**{rg['time_ratio']:.2f}**, " + ("same" if rg["same_peak"] else "**different**") + " measured peak.")
    for cp in h.get("compiled_plans", []):
        low = (f"; the lowest peak `torch.compile` reached by itself: `{cp['lowest_compile']}` "
               f"{_pct(cp['lowest_compile_peak_ratio'])} at {_x(cp['lowest_compile_time_ratio'])}"
               if cp["lowest_compile"] else "")
        lines.append(f"* **An autoremat plan under `torch.compile`**, {cp['model']} `{cp['config']}`: "
                     f"{_pct(cp['peak_ratio'])} of `none`'s peak at {_x(cp['time_ratio'])} its step time{low}.")
    if h["worst_prediction_error"]:
        wpe = h["worst_prediction_error"]
        lines.append(f"* **Worst autoremat prediction error**: {wpe['error']:+.1%} ({wpe['model']}, `{wpe['config']}`).")
    for ex in h.get("budget_exceeded", []):
        lines.append(f"* **Budget exceeded**: {ex['model']} `{ex['config']}` measured {_mib(ex['measured_peak_bytes'])} "
                     f"against a budget of {_mib(ex['budget_bytes'])}.")
    lines.append("")
    for name, info in result["models"].items():
        lines += [f"## {name}", "", info["description"] + ".", ""]
        if "capture_s" in info:
            lines += [f"autoremat graph: {info['graph_nodes']} nodes ({info['graph_mode']} level), captured in "
                      f"{info['capture_s']:.1f} s; simulated unoptimised peak "
                      f"{_mib(info['simulated_unoptimised_peak_bytes'])} vs measured "
                      f"{_mib(info['unoptimised_peak_bytes'])}.", ""]
        if len(info.get("runs", ())) > 1:  # joined row by row by merge_runs.py
            lines += [f"Measured in {len(info['runs'])} runs (" + ", ".join(
                f"run {i + 1}: {sum(r.get('run') == i for r in info['rows'])} rows" for i in info["runs"])
                + "); every ratio is to the `none` of the row's own run, and a row from another run than this "
                "table's `none` shows its ratio times this `none`'s step time (what it measured is "
                "`measured_step_time_s` in `compare.json`).", ""]
        lines += ["| configuration | status | measured peak | vs none | step time | vs none | predicted peak | "
                  "pred. error | solver / compile time | gradients | notes |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in info["rows"]:
            if r["family"] == "compile":
                grads = "" if r["grad_max_abs_diff"] is None else (
                    "equal" if r["gradients_equal"] else f"max abs diff {r['grad_max_abs_diff']:.2e}")
                extra = "" if r["compile_s"] is None else f"compile {r['compile_s']:.1f} s"
            else:
                grads = "" if r["gradients_equal"] is None else ("bit-for-bit equal" if r["gradients_equal"]
                                                                 else f"DIFFER (max {r['grad_max_abs_diff']:.2e})")
                extra = "" if r["solver_time_s"] is None else f"solve {r['solver_time_s']:.2f} s"
            notes = "; ".join(x for x in (r["error"], r["note"]) if x)
            if r["status"] == "infeasible" and r["min_budget_bytes"]:
                notes = f"budget {_mib(r['budget_bytes'])} < solver minimum {_mib(r['min_budget_bytes'])}" + (
                    f"; {r['note']}" if r["note"] and "solver minimum" not in r["note"] else "")  # old JSONs
            elif r["meets_budget"] is not None:
                notes = (f"budget {_mib(r['budget_bytes'])} " + ("met" if r["meets_budget"] else "**exceeded**")
                         + (f"; {notes}" if notes else ""))
            notes = notes.replace("|", "/").replace("\n", " ")
            pe = "" if r["prediction_error"] is None else f"{r['prediction_error']:+.1%}"
            lines.append(f"| `{r['config']}` | {r['status']} | {_mib(r['measured_peak_bytes'])} | "
                         f"{_pct(r['peak_ratio'])} | {_ms(r['step_time_s'])} | {_x(r['time_ratio'])} | "
                         f"{_mib(r['predicted_peak_bytes'])} | {pe} | {extra} | {grads} | {notes} |")
        hm = h["per_model"].get(name)
        if hm and hm["matches"]:
            lines += ["", "PyTorch options that lower the peak, each against the fastest autoremat row at an equal or "
                      "lower measured peak:", "",
                      "| PyTorch option | peak | time | autoremat row | peak | time | time ratio |",
                      "|---|---|---|---|---|---|---|"]
            for mt in hm["matches"]:
                lines.append(f"| `{mt['pytorch']}` | {_mib(mt['pytorch_peak_bytes'])} | {_ms(mt['pytorch_time_s'])} | "
                             + (f"`{mt['autoremat']}` | {_mib(mt['autoremat_peak_bytes'])} | "
                                f"{_ms(mt['autoremat_time_s'])} | {mt['time_ratio']:.2f} |" if mt["autoremat"]
                                else "none at or below this peak | | | |"))
        if (Path(result["out"]) / f"compare_{name}.png").exists():
            lines += ["", f"![{name}: step peak vs step time](compare_{name}.png)"]
        lines.append("")
    if result["largest_batch"]:
        batch_run = result.get("batch_run")
        cuda_text = (
            "Both methods start from the module's `batch_size` under the same real budget: the caching allocator "
            "may hold at most B bytes (`torch.cuda.set_per_process_memory_fraction(B / total)`), beyond which it "
            "raises `torch.OutOfMemoryError`, which BatchSizeFinder and AutoRemat both catch. Afterwards both "
            f"train {result['settings']['confirm_steps']} steps at the size they chose (confirmed = no "
            "out-of-memory; peak = `max_memory_allocated` over the whole fit).")
        lines += ["## Largest batch under a fixed budget", ""]
        if batch_run:
            bm = batch_run["machine"]
            load = ("" if bm.get("load_avg_1m") is None
                    else f", 1-minute load average {bm['load_avg_1m']:.2f} at its start")
            lines += [f"This section was re-run on its own after the tables above: `{batch_run['command']}` "
                      f"({batch_run['wall_s'] / 60:.1f} min; torch {bm['torch']}, Lightning {bm['lightning']}, "
                      f"`os.cpu_count()` = {bm['cpu_count']}{load}).", ""]
        if m["device"].startswith("cuda"):
            lines += [cuda_text, ""]
        else:
            lines += [
                  "Both methods start from the module's `batch_size` and see the same simulated device. On the CPU a "
                  "device of B bytes is simulated by a live-storage counter that raises the CPU allocator's "
                  "out-of-memory error (`DefaultCPUAllocator: can't allocate memory`, which Lightning's "
                  "`is_oom_error`, used by both, recognises) once the bytes created in a step pass B minus "
                  "what was resident when the step began (parameters, gradients, buffers, optimizer state) minus the "
                  "batch. *BatchSizeFinder*: the counter wraps the LightningModule's `optimizer_step` (in automatic "
                  "optimisation it runs the closure: `training_step`, `backward`, the optimizer update; wrapping "
                  "`training_step` alone would leave backward unenforced), so every trial step of the search is "
                  "enforced. *AutoRemat*: the counter wraps `autoremat.integrations.lightning.trial_step` (one "
                  "forward+backward of the patched module on a real batch of the size tried; inputs charged as "
                  "batch), and AutoRemat's own check compares the measured step peak with its step budget (B minus "
                  "parameters, buffers, estimated optimizer state, under automatic optimisation the previous step's "
                  "parameter gradients, and the batch); profiling runs once at the starting batch size, unenforced. "
                  "Afterwards both train "
                  f"{result['settings']['confirm_steps']} steps at the size they chose with the `optimizer_step` "
                  "wrapper on (confirmed = no out-of-memory; peak in use = resident + batch + the step's peak).", ""]
        lines += ["| task | budget | parameters + buffers | method | batch | largest batch trained | confirmed | "
                  "peak in use at that batch | search + training time | notes |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in result["largest_batch"]:
            notes = "; ".join(x for x in (r["error"], r["note"]) if x).replace("|", "/")
            lines.append(f"| {r['task']} | {_mib(r['budget_bytes'])} | {_mib(r['resident_bytes'])} | {r['method']} | "
                         f"{r['initial_batch_size']} -> **{r['batch_size']}** | {r['largest_trained_batch']} | "
                         f"{r['confirmed']} | {_mib(r['confirm_peak_bytes'])} | "
                         f"{_sec(r['search_s'])} | {notes} |")
        lines.append("")
        lines += _batch_text(result["largest_batch"], result["settings"].get("confirm_steps", 2))
    fails = result["failures"]
    lines += ["## What failed or did not apply", ""]
    if not fails:
        lines.append("Nothing.")
    for f in fails:
        why = (f["error"] or f["note"] or "").strip()
        why = why[len(f["status"]) + 2:] if why.startswith(f"{f['status']}: ") else why
        lines.append(f"* {f['model']} `{f['config']}`: {f['status'].replace('_', ' ')}: {why}")
    lines.append("")
    return "\n".join(lines)


def _batch_text(rows: list[dict[str, Any]], steps: int) -> list[str]:
    """What the largest-batch table shows, per task, from the recorded numbers."""
    import re

    out = []
    for task in dict.fromkeys(r["task"] for r in rows):
        a = next((r for r in rows if r["task"] == task and r["method"] == "autoremat"), None)
        b = next((r for r in rows if r["task"] == task and r["method"] == "batchsizefinder"), None)
        if a is None:
            continue
        if a["status"] == "ok":
            text = (f"*{task}*: AutoRemat raised the batch from {a['initial_batch_size']} to {a['batch_size']} and "
                    f"trained {steps} real steps at that size on the simulated device, at most "
                    f"{_mib(a['confirm_peak_bytes'])} in use of {_mib(a['budget_bytes'])}")
            if a["predicted_overhead"] is not None:
                text += f"; its plan predicts {a['predicted_overhead']:.0%} more step time than no recomputation"
            if b is not None and b["status"] == "ok" and b["batch_size"]:
                text += (f". BatchSizeFinder, which does not recompute, settled on {b['batch_size']} (the largest of "
                         f"its trial steps that trained: {b['largest_trained_batch']}), so AutoRemat's batch is "
                         f"{a['batch_size'] / b['batch_size']:.1f}x")
            out += [text + ".", ""]
            continue
        text = f"*{task}*: AutoRemat chose batch {a['batch_size']}, but "
        m = re.search(r"\((\d+) bytes live in this step, limit (\d+)\)", a["error"] or "")
        if m:
            text += (f"the training steps at that size ran out of the simulated device by "
                     f"{(int(m.group(1)) - int(m.group(2))) / 2**10:.0f} KiB: its step budget left out something "
                     "the real Lightning step allocates (its trial step is one forward+backward of the patched "
                     "module; the training step also runs the loss, `optimizer.zero_grad` after `training_step` "
                     "and the optimizer update).")
        else:
            text += f"the run failed: {a['error']}."
        out += [text, ""]
    return out


def plot(result: dict[str, Any], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    colors = {"baseline": "black", "pytorch": "tab:blue", "compile": "tab:orange", "autoremat": "tab:green"}
    for name, info in result["models"].items():
        rows = [r for r in info["rows"] if r["status"] == "ok" and r["step_time_s"] is not None]
        if not rows:
            continue
        fig, ax = plt.subplots(figsize=(8, 5.5))
        for fam, color in colors.items():
            pts = [r for r in rows if r["family"] == fam]
            if pts:
                ax.scatter([r["measured_peak_bytes"] / 2**20 for r in pts], [r["step_time_s"] * 1e3 for r in pts],
                           c=color, label=fam, s=36, zorder=3)
        for r in rows:
            ax.annotate(r["config"].replace("autoremat:", ""), (r["measured_peak_bytes"] / 2**20, r["step_time_s"] * 1e3),
                        fontsize=6.5, xytext=(3, 2), textcoords="offset points")
        front, best = [], math.inf
        for r in sorted(rows, key=lambda r: (r["measured_peak_bytes"], r["step_time_s"])):
            if r["step_time_s"] < best:
                front.append(r)
                best = r["step_time_s"]
        ax.step([r["measured_peak_bytes"] / 2**20 for r in front], [r["step_time_s"] * 1e3 for r in front],
                where="post", color="grey", lw=1, ls="--", label="Pareto front", zorder=2)
        ax.set_xlabel("measured step peak (MiB)")
        ax.set_ylabel("median step time (ms)")
        dev = result["machine"].get("device_name", f"{result['machine']['platform_machine']} CPU")
        ax.set_title(f"{name}: step peak vs step time ({dev})", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / f"compare_{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(str(path))
    return written
