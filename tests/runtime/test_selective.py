"""Selective saves inside module regions: gradients bit-for-bit, the kept op outputs really kept
(the step peak lies between per-layer checkpointing and no checkpointing), exact restore."""

from __future__ import annotations

import pytest
import torch

from autoremat.measure import gradients, gradients_equal, measure, run_step
from autoremat.runtime.selective import apply_selective, is_selective, layer_paths, restore_selective

pytest.importorskip("transformers")
from autoremat.zoo import hf  # noqa: E402  (needs transformers)


def _grads(ex: hf.HFExample) -> dict:
    torch.manual_seed(5)  # BERT has dropout on: same masks in every run
    run_step(ex.model, ex.args, ex.kwargs, ex.loss_fn)
    return gradients(ex.model)


def _peak(ex: hf.HFExample) -> int:
    return measure(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, steps=1, warmup=0).peak_bytes


@pytest.mark.parametrize("name", ["bert", "llama"])
def test_selective_layers_gradients_and_peaks(name: str) -> None:
    ex = hf.example(name)
    paths = layer_paths(ex.model)
    assert len(paths) == 4 and all(".layer" in p for p in paths)
    reference, vanilla = _grads(ex), _peak(ex)
    peaks = {}
    for policy in ("none", "matmuls", {0, 3}):
        apply_selective(ex.model, {p: policy for p in paths})
        try:
            peaks[str(policy)] = _peak(ex)
            assert gradients_equal(reference, _grads(ex)), policy
        finally:
            restore_selective(ex.model)
    # keeping matmul outputs costs memory over full recomputation and stays below no checkpointing
    assert peaks["none"] < peaks["matmuls"] < vanilla, peaks
    assert peaks["none"] <= peaks["{0, 3}"] <= peaks["matmuls"], peaks


def test_restore_leaves_no_trace_and_errors_name_the_fix() -> None:
    ex = hf.example("llama")
    before = {k: v.clone() for k, v in ex.model.state_dict().items()}
    paths = layer_paths(ex.model)
    with pytest.raises(ValueError, match="has no submodule"):
        apply_selective(ex.model, {"model.nope": "matmuls"})
    with pytest.raises(ValueError, match="a set of op indices"):
        apply_selective(ex.model, {paths[0]: "everything"})
    assert not is_selective(ex.model)
    apply_selective(ex.model, {paths[0]: "matmuls"})
    with pytest.raises(ValueError, match="restore_selective"):
        apply_selective(ex.model, {paths[1]: "matmuls"})
    restore_selective(ex.model)
    assert not is_selective(ex.model)
    assert all("forward" not in m.__dict__ for m in ex.model.modules())
    assert all(torch.equal(before[k], v) for k, v in ex.model.state_dict().items())


def test_batchnorm_modules_refused() -> None:
    ex = hf.example("resnet")
    bn_owner = next(p for p, m in ex.model.named_modules()
                    if any(isinstance(c, torch.nn.BatchNorm2d) for c in m.children()))
    with pytest.raises(ValueError, match="running statistics"):
        apply_selective(ex.model, {bn_owner: "matmuls"})
