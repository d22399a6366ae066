"""Plans under FSDP (issue 21): time, per-rank memory and communication, two CPU processes (gloo).

For each engine (FSDP2 ``fully_shard``, FSDP1 ``FullyShardedDataParallel``) and model (zoo
ResNet-50 small at fx level, a transformers GPT-2 from a small config at module level), at a
``--budget`` of the unoptimised step peak, runs ``tests/integrations/fsdp_script.py`` and reports
per rank:

* **time**: interleaved median step times of the unsharded model with and without the plan,
  and of the sharded model with and without it (and with PyTorch's per-block checkpointing);
  ``ratio_local`` = plan / no plan unsharded, ``ratio_sharded`` the same sharded, and their
  quotient (target under FSDP2 at 50 %: sharded ratio within 1.1x of the unsharded one);
* **memory**: the measured per-rank step peak (live storage counter, FSDP's storage resizes and
  ``DTensor`` local shards counted) against the per-rank prediction (:mod:`autoremat.per_rank`;
  target under FSDP2: within 10 %), with and without the plan, and with PyTorch's checkpointing;
* **communication**: the collectives of one step (count and bytes) with the plan, without it and
  with PyTorch's checkpointing.

    python benchmarks/fsdp.py [--budget 50%] [--steps 15] [--out benchmarks/results/cpu/fsdp]

Writes ``fsdp.json`` and ``fsdp.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "integrations" / "fsdp_script.py"
CASES = (("fsdp2", "cnn"), ("fsdp2", "gpt2"), ("fsdp1", "cnn"), ("fsdp1", "gpt2"), ("fsdp2", "gpt2+blocks"))
"""``gpt2+blocks``: the ``blocks`` solver on the default capture (layers op by op); the other GPT-2
cases use ``dp-approx`` on one node per layer (``tests/integrations/fsdp_script.py``)."""


def run_case(engine: str, model: str, budget: str, steps: int) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "AUTOREMAT_TEST_OUT": out}
        proc = subprocess.run([sys.executable, str(SCRIPT), engine, model, "shard-first,apply-first", budget,
                               str(steps)], env=env, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(f"{engine} {model} failed:\n{proc.stderr[-4000:]}")
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in (0, 1)]


def summarise(engine: str, model: str, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    rows = []
    for rank, data in enumerate(ranks):
        case = data["orders"]["shard-first"]
        other = data["orders"]["apply-first"]
        t = data["timing"]
        ac = data["fsdp_checkpointing"]
        rows.append({
            "rank": rank, "grads_equal": case["grads_equal"] and other["grads_equal"],
            "median_ms": {k: round(v * 1e3, 2) for k, v in t["median_s"].items()},
            "ratio_local": t["ratio_local"], "ratio_sharded": t["ratio_sharded"],
            "ratio_of_ratios": t["ratio_sharded"] / t["ratio_local"],
            "peak_bytes": case["peak_bytes"], "predicted_bytes": case["predicted_bytes"],
            "error": case["predicted_bytes"] / case["peak_bytes"] - 1,
            "ref_peak_bytes": case["ref_peak_bytes"], "ref_predicted_bytes": case["ref_predicted_bytes"],
            "ref_error": case["ref_predicted_bytes"] / case["ref_peak_bytes"] - 1,
            "fsdp_ac_peak_bytes": ac["peak_bytes"],
            "comm": case["comm"], "ref_comm": case["ref_comm"], "fsdp_ac_comm": ac["comm"],
            "comm_bytes": case["comm_bytes"], "ref_comm_bytes": case["ref_comm_bytes"],
            "fsdp_ac_comm_bytes": ac["comm_bytes"],
            "recomputed": case["recomputed"], "recomputed_after_cut": case["recomputed_after_cut"],
            "units": case["units"],
        })
    return {"engine": engine, "model": model, "ranks": rows}


def markdown(results: dict[str, Any]) -> str:
    m = results["machine"]
    lines = [f"# Plans under FSDP, 2 processes (gloo), budget {results['budget']}", "",
             f"Machine: {m['platform_machine']}, {m['cpu_count']} cores, CPU only, shared/loaded (load average "
             f"{m['load_average']}); torch {m['torch']}; one thread per process; {results['steps']} interleaved "
             "steps per configuration, medians.", "",
             "## Time (per rank: plan / no plan, unsharded and sharded)", "",
             "| engine | model | rank | unsharded ms (plan) | sharded ms (plan) | sharded + PyTorch AC ms | ratio unsharded | "
             "ratio sharded | sharded / unsharded ratio |", "|---|---|---|---|---|---|---|---|---|"]
    for c in results["cases"]:
        for r in c["ranks"]:
            t = r["median_ms"]
            lines.append(f"| {c['engine']} | {c['model']} | {r['rank']} | {t['local']} ({t['local+plan']}) | "
                         f"{t['sharded']} ({t['sharded+plan']}) | {t['sharded+fsdp-ac']} | {r['ratio_local']:.3f} | "
                         f"{r['ratio_sharded']:.3f} | {r['ratio_of_ratios']:.3f} |")
    lines += ["", "## Per-rank step peak (bytes): measured vs predicted", "",
              "| engine | model | rank | plan: measured | predicted | error | no plan: measured | predicted | error | "
              "PyTorch AC: measured | recomputed segments (cut at units) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in results["cases"]:
        for r in c["ranks"]:
            lines.append(f"| {c['engine']} | {c['model']} | {r['rank']} | {r['peak_bytes']} | {r['predicted_bytes']} | "
                         f"{r['error']:+.1%} | {r['ref_peak_bytes']} | {r['ref_predicted_bytes']} | "
                         f"{r['ref_error']:+.1%} | {r['fsdp_ac_peak_bytes']} | {r['recomputed']} "
                         f"({r['recomputed_after_cut']}) |")
    lines += ["", "## Collectives of one step (count, bytes)", "",
              "| engine | model | rank | with the plan | without | PyTorch AC |", "|---|---|---|---|---|---|"]
    for c in results["cases"]:
        for r in c["ranks"]:
            def fmt(counts: dict[str, int], nbytes: dict[str, int]) -> str:
                return ", ".join(f"{k} {counts[k]} ({nbytes[k]} B)" for k in sorted(counts))
            lines.append(f"| {c['engine']} | {c['model']} | {r['rank']} | {fmt(r['comm'], r['comm_bytes'])} | "
                         f"{fmt(r['ref_comm'], r['ref_comm_bytes'])} | {fmt(r['fsdp_ac_comm'], r['fsdp_ac_comm_bytes'])} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="50%")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--cases", default=",".join(f"{e}:{m}" for e, m in CASES))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cpu" / "fsdp"))
    args = parser.parse_args(argv)
    cases = [tuple(c.split(":")) for c in args.cases.split(",")]
    results: dict[str, Any] = {
        "budget": args.budget, "steps": args.steps,
        "machine": {"platform_machine": platform.machine(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
                    "load_average": ", ".join(f"{x:.1f}" for x in os.getloadavg())},
        "cases": []}
    for engine, model in cases:
        print(f"{engine} {model} ...", flush=True)
        results["cases"].append(summarise(engine, model, run_case(engine, model, args.budget, args.steps)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fsdp.json").write_text(json.dumps(results, indent=1))
    (out / "fsdp.md").write_text(markdown(results))
    print(markdown(results))
    return results


if __name__ == "__main__":
    main()
