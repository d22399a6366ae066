"""The offloader sends a node's *own* saves of its output to the host (the producer's window)."""

from __future__ import annotations

import pytest
import torch
from _offloaded import offloaded_step
from torch import nn

import autoremat
from autoremat.plan import Plan, offloadable_nodes
from autoremat.cost import no_recompute_plan


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # b saves a's output; sigmoid saves its own output, and c saves it again
        return self.c(torch.sigmoid(self.b(self.a(x))))


@pytest.mark.parametrize("offload_sigmoid", [True, False])
def test_producers_own_save_goes_to_the_host(offload_sigmoid: bool) -> None:
    model, x = _Net(), torch.randn(16, 32)
    g = autoremat.capture(model, (x,))
    sig = next(v for v in g.nodes if "sigmoid" in g.node(v)["name"])
    assert sig in g.node(sig)["saves"] and any(sig in g.node(w)["saves"] for w in g.nodes if w != sig)
    node = sig if offload_sigmoid else next(v for v in g.nodes if g.node(v)["name"] == "a")
    plan = autoremat.solvers.finalize_plan(
        g, Plan(list(no_recompute_plan(g).segments), offload=(node,)), 10**12, "manual")
    stats = offloaded_step(model, (x,), plan)
    assert stats.packed_nodes == [node] and stats.fetched_nodes == [node]
    # sigmoid's output: saved by sigmoid itself (inside its window) and by c; a's: by b only
    saves_of = sum(1 for w in g.nodes if node in g.node(w)["saves"])
    assert stats.saves == saves_of == (2 if offload_sigmoid else 1)


def test_module_level_window_keeps_other_saves_and_gradients() -> None:
    """Module level: everything a block saves inside its window waits in a pending holder; only
    saves of its output's storage go to the host, the rest come back as they were."""
    pytest.importorskip("transformers")
    from autoremat.zoo import hf

    model = hf.gpt2(n_layer=2, n_embd=32, n_head=2, vocab_size=64, seq=32)
    ids = torch.randint(0, 64, (2, 32))
    g = autoremat.capture(model, (ids,), loss_fn=hf.logits_mean)
    base = no_recompute_plan(g)
    blocks = [v for v in offloadable_nodes(g, base) if g.node(v)["kind"] != "glue"]
    assert blocks
    plan = autoremat.solvers.finalize_plan(g, Plan(list(base.segments), offload=tuple(blocks)), 10**12, "manual")
    stats = offloaded_step(model, (ids,), plan, loss_fn=hf.logits_mean, seed=1)
    assert set(stats.packed_nodes) == set(blocks)
    assert stats.saves == sum(1 for v in blocks for w in g.nodes if v in g.node(w)["saves"])
