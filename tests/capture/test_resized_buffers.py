"""Buffers a forward resizes: quantization-aware training (``torch.ao.quantization.prepare_qat``).
Its observers' ``min_val`` / ``max_val`` and fake-quantizers' ``scale`` / ``zero_point`` start as
``[0]`` / ``[1]`` and take their per-channel shapes in the first forward (``resize_``). Before: a
capture raised while putting the buffers back ("The size of tensor a (8) must match the size of
tensor b (0)"), and a plan, fingerprinted with the shapes after a forward, did not apply to the
model before its first step. Now the capture puts them back at their shapes, records them as
resized (``float32[*]``, :func:`autoremat.capture.signature.resized_signature`), and the plan
applies before and after the first step; the patched model trains as the unpatched one."""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import autoremat
from autoremat.capture.signature import as_recorded, resized_signature

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from semantics_cases import Case, _x, compare  # noqa: E402


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        import torch.ao.quantization as q

        self.quant, self.dequant = q.QuantStub(), q.DeQuantStub()
        self.c1, self.b1, self.r1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()
        self.c2, self.r2 = nn.Conv2d(8, 8, 3, padding=1), nn.ReLU()
        self.fc = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.r1(self.b1(self.c1(self.quant(x))))
        x = self.r2(self.c2(x))
        return self.dequant(self.fc(x.flatten(1)))


def qat_model() -> nn.Module:
    import torch.ao.quantization as q

    m = _Net().train()
    m.qconfig = q.get_default_qat_qconfig("x86")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the observers' reduce_range deprecation
        m = q.fuse_modules_qat(m, [["c1", "b1", "r1"], ["c2", "r2"]])
        return q.prepare_qat(m)


def _batch() -> tuple[torch.Tensor]:
    return (_x(4, 3, 8, 8),)


def _signature(model: nn.Module) -> dict[str, str]:
    return {n: f"{list(b.shape)}" for n, b in model.named_buffers()}


def test_capture_puts_resized_buffers_back_and_records_them_as_resized() -> None:
    torch.manual_seed(0)
    model = qat_model()
    before = {n: b.clone() for n, b in model.named_buffers()}
    graph = autoremat.capture(model, _batch(), repeats=1, warmup=0)  # mode "auto": fx cannot trace it
    assert graph.meta["mode"] == "module"
    after = dict(model.named_buffers())
    assert all(after[n].shape == b.shape and torch.equal(after[n], b) for n, b in before.items())
    assert graph.meta["tensors"]["buffer:c1.weight_fake_quant.scale"] == "float32[*]"
    assert graph.meta["tensors"]["buffer:c1.bn.running_mean"] == "float32[8]"  # not resized: its shape counts


@pytest.mark.parametrize("first_step", ["before", "after"])
def test_a_plan_applies_before_and_after_the_first_step(first_step: str) -> None:
    torch.manual_seed(0)
    model = qat_model()
    plan = autoremat.solve(autoremat.capture(model, _batch(), repeats=1, warmup=0), "min")
    if first_step == "after":
        model(*_batch()).sum().backward()
    assert any(b.shape != torch.Size([1]) for n, b in model.named_buffers() if n.endswith("scale")) == \
        (first_step == "after")
    autoremat.apply(model, plan)
    assert plan.recompute_segments and autoremat.is_patched(model)


@pytest.mark.parametrize("solver,regions", [("auto", "lean"), ("each", "torch"), ("each", "lean")])
def test_a_qat_model_trains_as_the_unpatched_one(solver: str, regions: str) -> None:
    case = Case("qat", qat_model, _batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        assert compare(case, "module", solver, "1%" if solver == "auto" else None, regions) is None


def test_resized_signature_and_its_comparison() -> None:
    before = {"param:w": "float32[8, 3]", "buffer:s": "float32[1]", "buffer:m": "float32[8]"}
    after = {"param:w": "float32[8, 3]", "buffer:s": "float32[8]", "buffer:m": "float32[8]"}
    rec = resized_signature(before, after)
    assert rec == {"param:w": "float32[8, 3]", "buffer:s": "float32[*]", "buffer:m": "float32[8]"}
    assert as_recorded(before, rec) == as_recorded(after, rec) == rec
    assert as_recorded({**after, "buffer:s": "float16[8]"}, rec)["buffer:s"] == "float16[8]"  # dtype still counts
    assert as_recorded({**after, "buffer:m": "float32[9]"}, rec)["buffer:m"] == "float32[9]"
    assert copy.copy(resized_signature(after, after)) == after
