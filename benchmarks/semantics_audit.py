"""Issue 29's audit: every model kind of the semantics table, at fx and module level, under every
plan configuration, trained patched and unpatched side by side (``tests/semantics_cases.py``:
3 training steps, 3 more, eval, 3 more after a change of Python state where the kind has one,
a smaller batch in training and in eval, ``no_grad``), plus a LightningModule fitted two epochs
with and without the ``AutoRemat`` callback (``compare_lightning``; "fx" there means the
traceable variant, "module" one with a data-dependent branch). Each run is classified as

* ``equal``: outputs, gradients, parameters, buffers and the RNG state ``torch.equal`` at every
  step (``fallback`` counts the equal runs in which a :class:`StateGuardWarning` said the model
  ran its own forward for a state the plan does not cover);
* ``clear``: refused before training with an autoremat error whose message says what to do
  (it names ``mode='module'``, "capture" / "solve again", ``del model.forward`` or a budget);
* ``crash``: any other exception (also any exception once training started);
* ``silent``: ran, and some tensor differs.

Run from the repository root: ``.venv/bin/python benchmarks/semantics_audit.py [--label L]``
(1-4 min on a loaded 2-core CPU machine); writes ``audit_<label>.json`` and ``audit_<label>.md``
under ``benchmarks/results/cpu/semantics_audit/``. The ``before`` results are this script with
the library of main at 39f4c94 (``PYTHONPATH=<its src>``); ``after``: the library at the end of
that work (47 kinds); ``before_state``: the ten kinds of ``tests/semantics_state.py`` (Python
state outside the modules' attributes: other objects, globals, closure cells, class defaults,
``is_fx_tracing``) with the library of main at bb8a47f; ``final``: all 57 kinds after guarding them.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import pathlib
import sys
import tempfile
import time
import traceback
import warnings

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from semantics_cases import CASES, compare, compare_lightning  # noqa: E402

from autoremat.runtime import StateGuardWarning  # noqa: E402

CONFIGS = [("none", None, "lean"), ("auto", "1%", "lean"), ("auto", "50%", "torch"), ("chen", "20%", "lean"),
           ("dp-approx", "40%", "torch"), ("prefix", None, "lean"), ("prefix", None, "torch"),
           ("each", None, "lean"), ("each", None, "torch")]
LIGHTNING = [("none", "auto", "lean"), ("auto", "95%", "lean"), ("auto", "86%", "torch")]
"""The Lightning-driven kind: ``AutoRemat`` settings (its tiny graph's least budget is ~85 %)."""
_FIXES = ("mode='module'", "capture", "solve again", "del model.forward", "budget")


def _origin_is_autoremat(exc: BaseException) -> bool:
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and "autoremat" in frames[-1].filename


def classify(case, mode: str, solver: str, budget, regions: str) -> tuple[str, str]:  # type: ignore[no-untyped-def]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", StateGuardWarning)
        try:
            if case == "lightning_callback":
                import autoremat

                cb = autoremat.AutoRemat(budget=budget, solver=solver, raise_batch_size=False, verbose=False,
                                         regions=regions)
                with tempfile.TemporaryDirectory() as root:
                    diff = compare_lightning(mode == "fx", cb, root)
            else:
                diff = compare(case, mode, solver, budget, regions)
        except Exception as exc:  # noqa: BLE001 - the audit classifies every exception
            msg = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            clear = (_origin_is_autoremat(exc) and not isinstance(exc, (AssertionError, KeyError, IndexError,
                                                                         AttributeError))
                     and any(f in str(exc) for f in _FIXES))
            return ("clear" if clear else "crash"), msg
    if diff is not None:
        return "silent", diff
    fell_back = any(issubclass(w.category, StateGuardWarning) for w in seen)
    return "equal", "fallback" if fell_back else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/cpu/semantics_audit"))
    ap.add_argument("--label", default="after", help="name of this run in the output files")
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    cases: list = [c for c in CASES if not a.cases or c.name in a.cases.split(",")]
    if not a.cases or "lightning_callback" in a.cases.split(","):
        cases.append("lightning_callback")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    rows = []
    start = time.perf_counter()
    for case in cases:
        name = case if isinstance(case, str) else case.name
        for mode in ("fx", "module"):
            for solver, budget, regions in (LIGHTNING if isinstance(case, str) else CONFIGS):
                kind, detail = classify(case, mode, solver, budget, regions)
                cfg = f"{solver}{'@' + budget if budget else ''}/{regions}"
                rows.append({"case": name, "mode": mode, "config": cfg, "result": kind, "detail": detail})
                if kind != "equal" or detail:
                    print(f"{name:28s} {mode:6s} {cfg:22s} {kind:6s} {detail}", flush=True)
    counts = collections.Counter(r["result"] for r in rows)
    fallback = sum(1 for r in rows if r["detail"] == "fallback")
    took = time.perf_counter() - start
    summary = {"label": a.label, "kinds": len(cases), "runs": len(rows), "counts": dict(counts),
               "equal_with_fallback": fallback, "seconds": round(took, 1), "torch": torch.__version__}
    print(json.dumps(summary))
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"audit_{a.label}.json").write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    lines = [f"# Semantics audit ({a.label})", "", f"{len(cases)} model kinds x fx/module x {len(CONFIGS)} plan "
             f"configurations ({len(LIGHTNING)} callback settings for the Lightning kind) = {len(rows)} runs "
             f"({took:.0f} s, torch {torch.__version__}, x86_64 2-core CPU, shared).", "",
             "| result | runs |", "|---|---|"]
    lines += [f"| {k} | {counts.get(k, 0)} |" for k in ("equal", "clear", "crash", "silent")]
    lines += ["", f"equal runs where a StateGuardWarning said the model ran its own forward: {fallback}", "",
              "| case | mode | config | result | detail |", "|---|---|---|---|---|"]
    lines += [f"| {r['case']} | {r['mode']} | {r['config']} | {r['result']} | {r['detail'].replace('|', '/')} |"
              for r in rows if r["result"] != "equal" or r["detail"]]
    (out / f"audit_{a.label}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
