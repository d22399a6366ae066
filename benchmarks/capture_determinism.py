"""Is a capture the same from one run to the next, but for its times?

    python benchmarks/capture_determinism.py [--names convnext zoo:resnet50 ...] [--captures 3]
                                             [--precision fp32 bf16] [--out DIR]

A plan follows its graph: a capture whose bytes, edges or flags change from run to run gives a user
another plan (and another least budget) on every run. For each architecture of
:data:`autoremat.zoo.hf_breadth.CASES` (and each ``zoo:<model>`` of :mod:`autoremat.zoo` at CPU
size) and each precision (``bf16``: forward and loss under CPU autocast), capture ``--captures``
times (``repeats=1``, fresh model each time) and compare everything in the graph's nodes and meta
but the times (``time_s``, ``bwd_time_s``, meta keys naming a time, the fingerprint). Writes
``capture_determinism.json`` and ``.md`` to ``--out``, one row per case: ``same``, or the fields
that differed (node, field, the two values).

Found with it (2026-11-29), both fixed: autocast parameter-cast pins at random in a bf16 Mamba
(:mod:`autoremat.capture.shared_casts`); an Encodec quantizer op's freed saves counted by chance
(the recorder's ``settle_saves``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
from pathlib import Path
from typing import Any

import torch

import autoremat
from autoremat.zoo.hf_breadth import CASES, build

ZOO = ("resnet50", "unet", "densenet121", "googlenet", "inception_v3", "pspnet", "vgg19", "transformer", "mlp")


def _doc(graph: autoremat.Graph) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    d = graph.to_dict()
    for n in d["nodes"]:
        n.pop("time_s", None)
        n.pop("bwd_time_s", None)
    meta = {k: v for k, v in d.get("meta", {}).items() if "time" not in k and k != "fingerprint"}
    return d["nodes"], meta


def _text(x: Any) -> str:
    return json.dumps(x, sort_keys=True, default=str)


def differences(a: tuple[list[dict], dict], b: tuple[list[dict], dict]) -> list[str]:
    """What differs between two captures' documents (:func:`_doc`), one line each."""
    (na, ma), (nb, mb) = a, b
    if len(na) != len(nb):
        return [f"node count {len(na)} vs {len(nb)}"]
    out = [f"meta[{k}]" for k in sorted(set(ma) | set(mb)) if _text(ma.get(k)) != _text(mb.get(k))]
    for i, (x, y) in enumerate(zip(na, nb)):
        out += [f"node {i} {str(x.get('name', ''))[:40]} [{k}]: {str(x.get(k))[:60]} vs {str(y.get(k))[:60]}"
                for k in sorted(set(x) | set(y)) if _text(x.get(k)) != _text(y.get(k))]
    return out


def _capture(name: str, bf16: bool) -> autoremat.Graph:
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    if name.startswith("zoo:"):
        model, inputs = autoremat.zoo.build(name[4:], size="small")
        with amp:
            return autoremat.capture(model, inputs, repeats=1, warmup=0)
    model, args, kwargs, loss = build(name)
    with amp:
        return autoremat.capture(model, args, kwargs, loss_fn=loss, repeats=1, warmup=0)


def run(name: str, precision: str, captures: int) -> dict[str, Any]:
    """One case: ``same`` or the differences between its first capture and each later one."""
    row: dict[str, Any] = {"name": name, "precision": precision}
    try:
        docs = [_doc(_capture(name, precision == "bf16")) for _ in range(captures)]
    except Exception as err:  # a case that does not capture is a result here
        row["error"] = f"{type(err).__name__}: {str(err)[:200]}"
        return row
    found: list[str] = []
    for later in docs[1:]:
        found += [d for d in differences(docs[0], later) if d not in found]
    row.update(nodes=len(docs[0][0]), same=not found, differences=found)
    return row


def report(rows: list[dict[str, Any]], captures: int, machine: str) -> str:
    lines = ["# Captures compared but for their times", "", f"Machine: {machine}; {captures} captures per case.", "",
             "| case | precision | nodes | result |", "|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            result = f"error: {r['error']}"
        elif r["same"]:
            result = "same"
        else:
            result = f"{len(r['differences'])} difference(s): " + "; ".join(r["differences"][:3])
        lines.append(f"| {r['name']} | {r['precision']} | {r.get('nodes', '')} | {result} |")
    same = sum(bool(r.get("same")) for r in rows)
    lines += ["", f"The same in {same} of {len(rows)} cases."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--names", nargs="*", default=[*sorted(CASES), *(f"zoo:{m}" for m in ZOO)])
    p.add_argument("--captures", type=int, default=3)
    p.add_argument("--precision", nargs="*", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "cpu" / "capture_determinism")
    args = p.parse_args(argv)
    if args.captures < 2:
        p.error("--captures must be >= 2")
    torch.set_num_threads(1)
    rows = []
    for name in args.names:
        for precision in args.precision:
            rows.append(run(name, precision, args.captures))
            print(json.dumps(rows[-1])[:300], flush=True)
    machine = f"{platform.machine()}, CPU only, torch {torch.__version__}, 1 intra-op thread"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "capture_determinism.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))
    (args.out / "capture_determinism.md").write_text(report(rows, args.captures, machine))
    return 0


if __name__ == "__main__":
    sys.exit(main())
