"""A forward that writes a parameter in place (``nn.Embedding(max_norm=...)`` renormalises the rows it
looks up): a capture leaves the parameter as it was (:mod:`autoremat.capture.param_writes`), the node
writing it is kept from recomputation (:mod:`autoremat.capture.inplace`), and the patched model trains
as the unpatched one. Before: the capture's runs renormalised the rows again (the patched model's first
outputs differed), and recomputing the embedding wrote the parameter a second time (wrong values at
module level, a version error at fx level)."""

from __future__ import annotations

import copy
import logging
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import autoremat
from autoremat.capture.preserved import preserved_state

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from semantics_cases import W, Case, compare  # noqa: E402


class EmbMaxNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.e = nn.Embedding(20, W, max_norm=1.0)
        self.l = nn.ModuleList(nn.Linear(W, W) for _ in range(3))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.e(ids)
        for lin in self.l:
            x = torch.tanh(lin(x))
        return x


def _ids() -> tuple[torch.Tensor]:
    return (torch.randint(0, 20, (4, 6), generator=torch.Generator().manual_seed(3)),)


@pytest.mark.parametrize("mode", ["fx", "module"])
def test_capture_leaves_a_parameter_its_forward_renormalises_as_it_was(mode: str) -> None:
    torch.manual_seed(0)
    model = EmbMaxNorm()
    with torch.no_grad():
        model.e.weight.mul_(3.0)  # every row's norm over max_norm: each forward would renormalise the rows it reads
    before = model.e.weight.detach().clone()
    graph = autoremat.capture(model, _ids(), mode=mode, repeats=2, warmup=1)
    assert torch.equal(model.e.weight, before)
    embedding = next(v for v in graph.nodes if graph.node(v)["name"] == "e")
    assert not graph.node(embedding)["recomputable"]  # a replay would renormalise a second time


@pytest.mark.parametrize("mode", ["fx", "module"])
@pytest.mark.parametrize("solver,regions", [("auto", "lean"), ("each", "torch"), ("each", "lean")])
def test_a_model_renormalising_its_embedding_trains_as_the_unpatched_one(mode: str, solver: str, regions: str) -> None:
    case = Case("embedding_max_norm", EmbMaxNorm, _ids)
    assert compare(case, mode, solver, "1%" if solver == "auto" else None, regions) is None


def test_a_parameter_written_only_in_a_later_run_is_named(caplog: pytest.LogCaptureFixture) -> None:
    """No copy was made before the write (no copy-on-write mode ran): the change stays, and is said."""
    lin = nn.Linear(4, 4)
    with caplog.at_level(logging.WARNING, logger="autoremat"), preserved_state(lin, []):
        with torch.no_grad():
            lin.weight.add_(1.0)
    assert "changed a parameter ((4, 4), torch.float32) in place" in caplog.text


def test_copies_are_taken_on_the_first_write_only_and_put_back() -> None:
    from autoremat.capture.param_writes import written_first

    lin = nn.Linear(4, 4)
    want = copy.deepcopy(lin.state_dict())
    with preserved_state(lin, []):
        with written_first(lin.parameters()), torch.no_grad():
            lin.weight.mul_(2.0)
            lin.weight.add_(1.0)  # a second write: the copy stays the first one's
        with torch.no_grad():
            lin.weight.sub_(5.0)  # after the mode: the copy still restores it
    assert all(torch.equal(lin.state_dict()[k], v) for k, v in want.items())
