"""Recording the ops of module calls: indices line up with what selective checkpointing sees."""

from __future__ import annotations

import pytest
import torch

from autoremat.capture.ops import record_ops
from autoremat.measure import gradients, gradients_equal, measure, run_step
from autoremat.runtime.selective import MATMUL_OPS, apply_selective, layer_paths, restore_selective

pytest.importorskip("transformers")
from autoremat.zoo import hf  # noqa: E402  (needs transformers)


def test_indices_match_selective_checkpointing_and_gradients_stay() -> None:
    ex = hf.example("llama")
    paths = layer_paths(ex.model)
    before = gradients(ex.model)
    ops = record_ops(ex.model, paths, ex.args, ex.kwargs, loss_fn=ex.loss_fn)
    assert gradients_equal(before, gradients(ex.model)), "record_ops must leave gradients as they were"
    assert set(ops) == set(paths)
    first = ops[paths[0]]
    assert [o.index for o in first] == list(range(len(first)))
    assert all(o.name != "aten::detach" for o in first)
    mm = [o for o in first if o.name == "aten::mm"]
    assert len(mm) == 7 and all(o.out_bytes > 0 and o.time_s > 0 for o in mm)  # q, k, v, o, gate, up, down
    assert all(o.out_bytes == 0 for o in first if o.name in ("aten::view", "aten::t", "aten::transpose.int"))
    # keeping the recorded matmul indices is the same as keeping matmuls by name
    peaks = []
    torch.manual_seed(0)
    run_step(ex.model, ex.args, ex.kwargs, ex.loss_fn)
    reference = gradients(ex.model)
    for policy in ({p: "matmuls" for p in paths}, {p: {o.index for o in ops[p] if o.name in MATMUL_OPS} for p in paths}):
        apply_selective(ex.model, policy)
        try:
            peaks.append(measure(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, steps=1, warmup=0).peak_bytes)
            torch.manual_seed(0)
            run_step(ex.model, ex.args, ex.kwargs, ex.loss_fn)
            assert gradients_equal(reference, gradients(ex.model))
        finally:
            restore_selective(ex.model)
    assert peaks[0] == peaks[1]


def test_unknown_paths_are_named() -> None:
    ex = hf.example("llama")
    with pytest.raises(ValueError, match="no submodules"):
        record_ops(ex.model, ["model.nope"], ex.args, ex.kwargs, loss_fn=ex.loss_fn)
