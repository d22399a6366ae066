"""PyTorch's own ``nn.TransformerEncoder``: fx calls it as one leaf (a torch.nn module) and cannot
trace its code (the fast-path checks branch on tensors), so an fx capture had one node for all
layers and no plan below the unpatched peak; ``mode="auto"`` now captures it at module level, its
layers op by op. Its layers call ``self_attn(x, x, x)``, whose replay must see one tensor again
(``query is key`` picks nn.MultiheadAttention's path; see ``tests/runtime/test_region.py``)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autoremat
from autoremat.cost.simulator import unoptimised_peak_bytes
from autoremat.measure import gradients, gradients_equal


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.1, activation="gelu", batch_first=True,
                                           norm_first=True)
        self.emb = nn.Embedding(50, 32)
        self.enc = nn.TransformerEncoder(layer, num_layers=3, enable_nested_tensor=False)
        self.head = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.emb(x)).mean(1))


def _setup() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return _Net(), torch.randint(0, 50, (4, 16)), torch.randint(0, 5, (4,))


def test_auto_captures_the_encoder_layer_by_layer_and_plans_apply_exactly() -> None:
    net, x, y = _setup()
    g = autoremat.capture(net, (x,), loss_fn=lambda out: F.cross_entropy(out, y), times="flops")
    assert g.meta["mode"] == "module"
    assert any(g.node(v)["scope"][:1] == ("enc.layers.1",) for v in g)
    for budget in ("50%", "min"):
        plan = autoremat.solve(g, budget)
        assert autoremat.simulate(g, plan).peak_bytes <= 0.5 * unoptimised_peak_bytes(g)
        want, got = copy.deepcopy(net), copy.deepcopy(net)
        autoremat.apply(got, plan)
        for m in (want, got):  # dropout on: the replay draws the forward's numbers
            torch.manual_seed(1)
            F.cross_entropy(m(x), y).backward()
        assert gradients_equal(gradients(want), gradients(got)), budget


def test_fx_mode_keeps_the_leaf_and_says_what_it_costs(caplog: pytest.LogCaptureFixture) -> None:
    net, x, y = _setup()
    with caplog.at_level(logging.WARNING, logger="autoremat"):
        g = autoremat.capture(net, (x,), mode="fx", loss_fn=lambda out: F.cross_entropy(out, y), times="flops")
    assert g.meta["mode"] == "fx" and len(g) == 4
    assert "'enc' (TransformerEncoder, 3 layers)" in caplog.text and "mode='module'" in caplog.text
