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


def test_import_autoremat_does_not_import_dynamo() -> None:
    """Dynamo costs about a second to import (issue 23's target: ``import autoremat`` under 1.5x
    ``import torch``): it is imported when a guarded forward is first made, not before."""
    proc = _run("import sys, autoremat; print('torch._dynamo' in sys.modules)")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["False"]


def test_a_patched_model_compiles_with_its_guard_left_eager() -> None:
    code = """
import sys, torch, autoremat
from torch import nn
torch.manual_seed(0)
m = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
ref = nn.Sequential(*[type(l)(*([] if isinstance(l, nn.ReLU) else [l.in_features, l.out_features])) for l in m])
ref.load_state_dict(m.state_dict())
x = torch.randn(512, 8)
g = autoremat.capture(m, (x,))
plan = autoremat.solve(g, "min", solver="chen")
assert any(s.recompute for s in plan.segments)
autoremat.apply(m, plan)
c = torch.compile(m, backend="eager")
c(x).sum().backward(); ref(x).sum().backward()
print(all(torch.equal(a.grad, b.grad) for a, b in zip(m.parameters(), ref.parameters())))
"""
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-1:] == ["True"]
