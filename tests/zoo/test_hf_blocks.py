"""Inside the layer on Hugging Face models (issue 24): the default capture takes each repeated
layer op by op, the ``blocks`` solver plans below per-layer checkpointing's peak by recomputing
sub-modules of a layer and keeping op outputs inside it (selective saves), and those plans train
with gradients bit-for-bit the unpatched model's, their step peaks predicted within 10 % of the
measured one (CPU storage counter). Per-layer checkpointing itself (``gradient_checkpointing_
enable``) is measured beside the simulator's plan that recomputes every layer whole."""

from __future__ import annotations

import pytest
import torch

import autoremat
from autoremat.cost import simulate
from autoremat.cost.block_chain import chain_plan
from autoremat.measure import gradients, gradients_equal, measure, run_step
from autoremat.solvers import finalize_plan, min_budget
from autoremat.solvers.blocks import chain_of

pytest.importorskip("transformers")
from autoremat.zoo import hf  # noqa: E402  (needs transformers)

TOLERANCE = 0.10
AT_THE_LOSS = {"llama"}


def _grads(ex: hf.HFExample) -> dict:
    torch.manual_seed(11)  # BERT and T5 have dropout on: the same masks in every run
    run_step(ex.model, ex.args, ex.kwargs, ex.loss_fn)
    grads = gradients(ex.model)
    ex.model.zero_grad(set_to_none=True)
    return grads


def _peak(ex: hf.HFExample) -> int:
    return measure(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, steps=1, warmup=1).peak_bytes


def per_layer_plan(graph: autoremat.Graph) -> autoremat.Plan:
    """HF checkpointing's plan: every layer recomputed whole, everything else stored."""
    chain, _profile = chain_of(graph)
    whole = [chain.names[c].index("whole") for c in chain.classes]
    return finalize_plan(graph, chain_plan(graph, chain, whole), 2**62, "per-layer")


def _inside(graph: autoremat.Graph, plan: autoremat.Plan, layers: set[str]) -> tuple[int, int]:
    """(kept op outputs, recomputed regions that are a part of a layer, not a whole one)."""
    kept = sum(len(s.keep) for s in plan.segments)
    parts = sum(1 for path, _ops in plan.module_calls.values() if path not in layers)
    return kept, parts


def _check(name: str, batch: int = 4) -> None:
    ex = hf.example(name, batch=batch)
    graph = autoremat.capture(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, repeats=1, warmup=0)
    assert graph.meta["mode"] == "module" and graph.meta["blocks"] == "ops"
    chain, _profile = chain_of(graph)
    layers = {graph.node(nodes[0])["scope"][0] for nodes in chain.blocks}
    assert len(layers) == len(chain.blocks) >= 2

    # per-layer checkpointing: the simulator's plan against HF's own implementation
    reference = _grads(ex)
    per_layer = simulate(graph, per_layer_plan(graph)).peak_bytes
    ex.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        hf_peak = _peak(ex)
        assert gradients_equal(reference, _grads(ex))
    finally:
        ex.model.gradient_checkpointing_disable()
    assert abs(per_layer - hf_peak) <= TOLERANCE * hf_peak, (name, per_layer, hf_peak)

    # below per-layer checkpointing's peak where the peak is inside the layers' replays (Llama's
    # small example peaks at the loss, above every layer: there only time can be gained)
    least = min_budget(graph, "blocks")
    assert least < per_layer or (least == per_layer and name in AT_THE_LOSS), (name, least, per_layer)
    plans = [autoremat.solve(graph, b, solver="blocks") for b in (least, (least + per_layer) // 2, per_layer)]
    inside = [_inside(graph, p, layers) for p in plans]
    assert any(kept for kept, _ in inside), (name, [p.options["choice"] for p in plans])
    if name not in AT_THE_LOSS:  # splitting a layer lowers its replay, not the peak at the loss
        assert any(parts for _, parts in inside), (name, [p.options["choice"] for p in plans])
    # at per-layer checkpointing's peak, less replay time than per-layer checkpointing
    assert plans[-1].predicted_extra_time_s < simulate(graph, per_layer_plan(graph)).extra_time_s
    for plan in plans:
        autoremat.apply(ex.model, plan)
        try:
            peak = _peak(ex)
            grads = _grads(ex)
        finally:
            autoremat.restore(ex.model)
        assert gradients_equal(reference, grads), (name, plan.options["choice"])
        assert abs(plan.predicted_peak_bytes - peak) <= TOLERANCE * peak, (name, plan.predicted_peak_bytes, peak)


pytestmark = pytest.mark.filterwarnings("ignore:`gradient_checkpointing_(en|dis)able` is deprecated:FutureWarning")


def test_blocks_plans_keep_ops_inside_bert_layers() -> None:
    _check("bert", batch=2)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["t5", "gpt2", "llama", "vit"])
def test_blocks_plans_keep_ops_inside_layers_slow(name: str) -> None:
    _check(name)


@pytest.mark.gpu
def test_blocks_plans_on_cuda_gpt2() -> None:
    """On a GPU (not run on the CPU-only machine this was written on): a GPT-2 of 6 layers,
    hidden 256, 8 x 256 tokens. The simulated per-layer plan predicts HF checkpointing's measured
    (caching allocator) peak within 10 %, the ``blocks`` plans at the least budget and at HF's
    peak are predicted within 10 % and train to the unpatched gradients (``allclose``: CUDA's
    embedding backward accumulates with atomics, so two unpatched runs may differ in the last
    bits), and the least budget is below HF checkpointing's peak."""
    ids = torch.randint(0, 4096, (8, 256), generator=torch.Generator().manual_seed(0)).cuda()
    model = hf.gpt2(n_layer=6, n_embd=256, n_head=8, vocab_size=4096, seq=256).cuda()
    ex = hf.HFExample("gpt2", model, (ids,), {"labels": ids}, lambda o: o.loss)
    graph = autoremat.capture(model, ex.args, ex.kwargs, loss_fn=ex.loss_fn)
    assert graph.meta["blocks"] == "ops"
    reference = _grads(ex)
    per_layer = simulate(graph, per_layer_plan(graph)).peak_bytes
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        hf_peak = measure(model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, steps=2, warmup=1).peak_bytes
    finally:
        model.gradient_checkpointing_disable()
    assert abs(per_layer - hf_peak) <= TOLERANCE * hf_peak, (per_layer, hf_peak)
    least = min_budget(graph, "blocks")
    assert least < hf_peak
    for budget in (least, hf_peak):
        plan = autoremat.solve(graph, budget, solver="blocks")
        autoremat.apply(model, plan)
        try:
            peak = measure(model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, steps=2, warmup=1).peak_bytes
            grads = _grads(ex)
        finally:
            autoremat.restore(model)
        assert abs(plan.predicted_peak_bytes - peak) <= TOLERANCE * peak, (plan.options["choice"], peak)
        assert all(torch.allclose(reference[k], grads[k], rtol=1e-4, atol=1e-6) for k in reference)
