"""A model holding a TorchScript submodule (``torch.jit.script(nn.Sequential(...))``), which takes no
hooks and cannot be patched. Before: every capture raised (``'OrderedDictWrapper' object has no
attribute 'clear'`` putting the model back, then ``register_forward_pre_hook is not supported on
ScriptModules``). Now neither it nor anything inside it is a node (its ops are glue of the call
around it), and the patched model trains as the unpatched one."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import autoremat

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from semantics_cases import Case, _diff, _x, plan_for, run_phases  # noqa: E402

W = 16


class WithScripted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.ModuleList(nn.Linear(W, W) for _ in range(3))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.script's own
            self.head = torch.jit.script(nn.Sequential(nn.Linear(W, W), nn.BatchNorm1d(W), nn.Tanh()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in self.l:
            x = torch.tanh(lin(x))
        return self.head(x)


def _made() -> WithScripted:
    torch.manual_seed(0)  # (a deep copy of a TorchScript module has non-leaf parameters: build two instead)
    return WithScripted()


def test_a_scripted_submodule_is_glue_of_its_caller() -> None:
    graph = autoremat.capture(_made(), (_x(8, W),), repeats=1, warmup=0)  # "auto": fx cannot trace into it
    names = [graph.node(v)["name"] for v in graph.nodes]
    assert graph.meta["mode"] == "module" and names[:1] == ["l.0"] and not any(n.startswith("head") for n in names)


@pytest.mark.parametrize("solver,regions", [("each", "lean"), ("each", "torch")])
def test_a_model_with_a_scripted_submodule_trains_as_the_unpatched_one(solver: str, regions: str) -> None:
    case = Case("scripted", WithScripted, lambda: (_x(8, W),))
    ref, pat = _made(), _made()
    plan = plan_for(autoremat.capture(pat, case.args(), mode="module", repeats=1, warmup=0), solver, None)
    assert plan.recompute_segments
    autoremat.apply(pat, plan, regions=regions)
    for (phase, want_out, want, _), (_, got_out, got, _) in zip(run_phases(ref, case), run_phases(pat, case)):
        assert all(torch.equal(a, b) for a, b in zip(want_out, got_out)), phase
        assert _diff(want, got) is None, phase
