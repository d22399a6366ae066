"""``import autoremat`` stays light: no Lightning, Accelerate or transformers (STYLE.md 19)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HEAVY = ("lightning", "pytorch_lightning", "accelerate", "transformers")


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ})


@pytest.fixture(scope="module")
def fresh_import() -> dict:
    """One fresh interpreter: whether ``import autoremat`` alone imported dynamo, then which heavy
    frameworks are loaded once the integrations and the CLI are imported too, then what
    ``from autoremat import AutoRemat`` loads (after ``heavy`` was read: Lightning, on first use)."""
    code = ("import json, sys, autoremat; dynamo = 'torch._dynamo' in sys.modules; "
            "import autoremat.integrations.accelerate, autoremat.cli; "
            f"heavy = sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})); "
            "from autoremat import AutoRemat; "
            "callback = [AutoRemat.__module__, 'lightning' in sys.modules, 'AutoRemat' in dir(autoremat)]; "
            "print(json.dumps({'dynamo': dynamo, 'heavy': heavy, 'callback': callback}))")
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_autoremat_loads_no_training_framework(fresh_import: dict) -> None:
    assert fresh_import["heavy"] == []


def test_autoremat_callback_still_importable_from_the_package(fresh_import: dict) -> None:
    """In the fresh interpreter of the fixture, once the integrations were imported without Lightning."""
    assert fresh_import["heavy"] == [] and fresh_import["callback"] == ["autoremat.integrations.lightning", True, True]


def test_unknown_attribute_is_an_attribute_error() -> None:
    """In process (the package's ``__getattr__`` answers the same in any interpreter)."""
    import autoremat

    with pytest.raises(AttributeError, match="NoSuchThing"):
        autoremat.NoSuchThing  # noqa: B018


def test_import_autoremat_does_not_import_dynamo(fresh_import: dict) -> None:
    """Dynamo costs about a second to import (issue 23's target: ``import autoremat`` under 1.5x
    ``import torch``): it is imported when a guarded forward is first made, not before."""
    assert fresh_import["dynamo"] is False


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
