"""``import autoremat`` stays light: no Lightning, Accelerate or transformers (STYLE.md 19)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

HEAVY = ("lightning", "pytorch_lightning", "accelerate", "transformers")


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ})


def test_import_autoremat_loads_no_training_framework() -> None:
    code = ("import json, sys, autoremat, autoremat.integrations.accelerate, autoremat.cli; "
            f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))))")
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


def test_autoremat_callback_still_importable_from_the_package() -> None:
    proc = _run("import sys; from autoremat import AutoRemat; import autoremat; "
                "print(AutoRemat.__module__, 'lightning' in sys.modules, 'AutoRemat' in dir(autoremat))")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["autoremat.integrations.lightning", "True", "True"]


def test_unknown_attribute_is_an_attribute_error() -> None:
    proc = _run("import autoremat\ntry:\n    autoremat.NoSuchThing\nexcept AttributeError as e:\n    print(e)")
    assert proc.returncode == 0 and "NoSuchThing" in proc.stdout
