"""Saved tensors of a graph no gradient reaches: capture frees them when the model does.

The Hugging Face ``EncodecModel`` encodes its input to integer codes and decodes the codes: the
encoder runs with gradients on, autograd records it, and no gradient can reach it, so autograd
frees it (saved tensors and all) once the model drops it. The recorder's pack hook handed autograd
each saved tensor as it was: a tensor an op saves of its own output (``exp``, ELU) then holds that
op's autograd node, a cycle only backward breaks, and such a graph stayed alive after ``capture``
returned. And a saved storage freed before the recorder attributed it could have its address taken
by a later node's output: the saver was then recorded saving a node that runs after it (on Encodec,
two captures in six failed with "edge 260->218 goes backwards").
"""

from __future__ import annotations

import gc

import torch
from torch import nn

import autoremat
from autoremat.capture._recorder import NodeRecord, Recorder


class Coded(nn.Module):
    """A linear layer whose output also picks integer codes through ``exp`` (no gradient reaches it)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        codes = torch.exp(h * 2).argmax(-1)
        return self.b(h).sum() + codes.sum() * 0


def _with_history() -> set[int]:
    """The ids of the tensors alive that have autograd history (the other tests' too: compare sets)."""
    gc.collect()
    return {id(o) for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.grad_fn is not None}


def test_capture_leaves_no_graph_alive_that_no_gradient_reaches():
    torch.manual_seed(0)
    model, x = Coded(), torch.randn(64, 32)
    for mode in ("fx", "module"):
        before = _with_history()
        autoremat.capture(model, (x,), loss_fn=lambda o: o, mode=mode, repeats=1, warmup=0)
        assert not _with_history() - before, mode


def test_a_freed_save_whose_address_a_later_output_took_is_not_that_output():
    rec = Recorder([])
    rec.nodes += [NodeRecord(name=f"n{i}", kind="op", target="") for i in range(3)]
    rec.owner = {111: 0, 222: 2}  # 222: freed after node 1 saved it, now node 2's output
    rec._packed = [(1, 111, 64), (1, 222, 64)]
    rec.settle_saves()
    assert rec.nodes[1].saves == {0}
    assert rec.nodes[1].extra_saved_bytes == 0  # its saver was freed: nothing of it is held


def test_a_save_freed_before_it_is_settled_is_nothing_held_in_every_capture():
    """A saved storage freed before the recorder settles it is skipped whether or not a later storage
    took its address (the recorder holds a weak reference to each saved storage while it records, so
    none can): Encodec's quantizer ops under bf16 counted their freed saves (4,096 B for a matmul's
    cast) in most captures and nothing where the address had been taken. A save still alive counts."""
    rec = Recorder([])
    rec.nodes += [NodeRecord(name=f"n{i}", kind="op", target="") for i in range(2)]
    freed, kept = torch.randn(16), torch.randn(32)
    key = freed.untyped_storage()._cdata
    rec.current = 1
    alias = rec._pack_hook(freed)
    rec._pack_hook(kept)
    del freed, alias
    later = [torch.randn(16) for _ in range(200)]
    assert all(t.untyped_storage()._cdata != key for t in later)  # the address stays the freed storage's
    rec.settle_saves()
    assert rec.nodes[1].extra_saved_bytes == 32 * 4  # the live one only
