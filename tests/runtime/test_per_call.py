"""Modules run more than once per step (a weight-shared block, ALBERT's layer group): each call is a
node or call region of its own (``"<path>@<k>/<n>"``) and a plan recomputes exactly the calls it
names (:mod:`autoremat.runtime.per_call`). Gradients ``torch.equal`` to the unpatched model with
dropout on, batch-norm statistics updated once per call, step peak within 10 % of the prediction;
a step running the module another number of times is refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autoremat
from autoremat.call_names import call_name, enclosing_paths, is_per_call, parse_call, plain_path
from autoremat.cost import no_recompute_plan, simulate
from autoremat.errors import CallCountError
from autoremat.plan import Segment, module_calls_of
from autoremat.measure import gradients, gradients_equal, measure, run_step
from autoremat.runtime import is_recomputing

from _looped import looped_batch, looped_loss, looped_model

TOLERANCE = 0.10


_loss, _batch, _model = looped_loss, looped_batch, looped_model


def _step(model: nn.Module, x: torch.Tensor, **kwargs: int) -> dict:
    torch.manual_seed(5)  # the same dropout masks in every run
    run_step(model, (x,), kwargs, _loss)
    return gradients(model)


def test_call_names() -> None:
    assert call_name("a.b", 0, 1) == "a.b"
    assert call_name("a.b", 2, 4) == "a.b@2/4"
    assert parse_call("a.b@2/4") == ("a.b", 2, 4) and parse_call("a.b") == ("a.b", None, None)
    assert plain_path("a.b@3/4") == "a.b" and is_per_call("a@0/2") and not is_per_call("a")
    assert enclosing_paths("a.b.c") == ["a", "a.b"]
    with pytest.raises(ValueError, match="not a call name"):
        parse_call("a@4/4")
    with pytest.raises(ValueError, match="call index 5"):
        call_name("a", 5, 4)


@pytest.mark.parametrize("shape,blocks", [("block", "ops"), ("block", "module"), ("leaf", "module")])
def test_each_call_of_a_shared_module_is_a_recomputable_node(shape: str, blocks: str) -> None:
    model, x = _model(shape), _batch()
    graph = autoremat.capture(model, (x,), loss_fn=_loss, repeats=1, warmup=0, blocks=blocks)
    again = autoremat.capture(model, (x,), loss_fn=_loss, repeats=1, warmup=0, blocks=blocks)
    assert graph.fingerprint == again.fingerprint  # stable across steps
    path = "layers.0" if shape == "block" else "seq.0"
    assert graph.meta["reused_modules"][path] == 4
    calls = [p for p in graph.call_regions() if plain_path(p) == path]
    assert calls == [f"{path}@{k}/4" for k in range(4)]
    units = graph.recompute_units()
    for p in calls:
        assert graph.call_regions()[p] in units


@pytest.mark.parametrize("shape,norm,blocks,budgets", [("block", False, "ops", ("min", "50%", "75%")),
                                                       ("block", True, "ops", ("min", "50%", "75%")),
                                                       ("leaf", True, "module", ("min",))])
def test_plans_recompute_the_calls_they_name_exactly(shape: str, norm: bool, blocks: str,
                                                     budgets: tuple[str, ...]) -> None:
    """Gradients and batch-norm statistics equal to the unpatched model's, peak within 10 % of the
    prediction; a block's least plan well below the unpatched peak (single leaf calls recomputed one
    by one save little: each one's input is kept by its neighbour, so the leaf shape's least plan is
    0.99x, as it is for leaves called once)."""
    model, x = _model(shape, norm), _batch()
    graph = autoremat.capture(model, (x,), loss_fn=_loss, repeats=1, warmup=0, blocks=blocks)
    vanilla = measure(model, (x,), loss_fn=_loss, steps=1, warmup=0).peak_bytes
    assert abs(simulate(graph, no_recompute_plan(graph)).peak_bytes - vanilla) <= TOLERANCE * vanilla
    start = {k: v.clone() for k, v in model.state_dict().items()}
    reference = _step(model, x)
    after = {k: v.clone() for k, v in model.state_dict().items()}
    peaks = []
    for budget in budgets:
        plan = autoremat.solve(graph, budget)
        assert any(is_per_call(path) for path, _ in plan.module_calls.values()), plan.module_calls
        model.load_state_dict(start)
        autoremat.apply(model, plan)
        try:
            grads = _step(model, x)
            assert all(torch.equal(v, after[k]) for k, v in model.state_dict().items())  # statistics once per call
            peak = measure(model, (x,), loss_fn=_loss, steps=1, warmup=0).peak_bytes
        finally:
            autoremat.restore(model)
        assert gradients_equal(reference, grads), plan.describe()
        assert abs(plan.predicted_peak_bytes - peak) <= TOLERANCE * peak, (budget, plan.predicted_peak_bytes, peak)
        peaks.append(peak)
    assert shape == "leaf" or peaks[0] < 0.8 * vanilla, (peaks, vanilla)


def test_a_plan_keeps_the_calls_it_does_not_name() -> None:
    """Recompute call 2 of 4 only: that call's forward hook and its replay, nothing else."""
    model, x = _model("block"), _batch()
    graph = autoremat.capture(model, (x,), loss_fn=_loss, repeats=1, warmup=0)
    seen: list[bool] = []
    hook = model.layers[0].up.register_forward_hook(lambda *_: seen.append(is_recomputing()))
    reference = _step(model, x)
    assert seen == [False] * 4
    plan = next(p for p in (autoremat.solve(graph, f"{f}%") for f in range(95, 30, -5))
                if p.recompute_segments)
    plan = autoremat.Plan.from_json(plan.to_json())  # the call names survive a plan file
    named = sorted(parse_call(p)[1] for p, _ in plan.module_calls.values() if plain_path(p) == "layers.0")
    seen.clear()
    autoremat.apply(model, plan)
    try:
        assert gradients_equal(reference, _step(model, x))
    finally:
        autoremat.restore(model)
        hook.remove()
    assert seen.count(False) == 4 and seen.count(True) == len(named) >= 1  # user hooks fire as before


def test_a_step_running_the_module_another_number_of_times_is_refused() -> None:
    """A data-dependent loop: the plan cannot tell which call is which, so the step raises
    (more calls: at the call past the plan's count; fewer: at the end of the forward); eval and
    no_grad forwards run untouched whatever their calls."""
    model, x = _model("block"), _batch()
    graph = autoremat.capture(model, (x,), loss_fn=_loss, repeats=1, warmup=0)
    reference = {s: _step(model, x, steps=s) for s in (3, 4)}
    autoremat.apply(model, autoremat.solve(graph, "min"))
    try:
        with pytest.raises(CallCountError, match=r"'layers\.0' more than 4 times.*made for a step that runs it 4"):
            model(x, steps=5)
        with pytest.raises(CallCountError, match=r"'layers\.0' 3 times"):
            model(x, steps=3)
        with torch.no_grad():
            model(x, steps=6)
        model.eval()
        model(x, steps=2)
        model.train()
        assert gradients_equal(reference[4], _step(model, x, steps=4))  # a step as captured runs on
    finally:
        autoremat.restore(model)
    assert gradients_equal(reference[3], _step(model, x, steps=3))


def test_bf16_autocast_gradients_stay_bit_equal() -> None:
    """Under autocast every call uses the first call's cached parameter casts; a recomputed call
    does too (else its weight gradient is summed in fp32, not bf16: not bit-equal)."""
    model, x = _model("block"), _batch()

    def amp_step() -> dict:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            value = _loss(model(x)).float()
        value.backward()
        return gradients(model)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        graph = autoremat.capture(model, (x,), loss_fn=_loss, repeats=1, warmup=0)
    reference = amp_step()
    plan = autoremat.solve(graph, "50%")
    assert any(is_per_call(path) for path, _ in plan.module_calls.values())
    autoremat.apply(model, plan)
    try:
        grads = [amp_step() for _ in range(2)]
    finally:
        autoremat.restore(model)
    assert all(gradients_equal(reference, g) for g in grads)


def test_a_call_keeping_ops_runs_exactly_and_is_refused_under_cached_autocast() -> None:
    """Selective saves in one call of a shared block: exact in fp32; under autocast with its cast
    cache, refused with the reason (the replay would make casts the forward took from the cache)."""
    model, x = _model("block"), _batch()
    graph = autoremat.capture(model, (x,), loss_fn=_loss, repeats=1, warmup=0)
    plan = autoremat.solve(graph, "50%")
    i, seg = next((i, s) for i, s in enumerate(plan.segments) if s.recompute and len(s.nodes) > 1)
    mm = [v for v in seg.nodes if graph.node(v)["target"].startswith("aten.addmm")]
    plan.segments[i] = Segment(seg.nodes, True, tuple(mm[:1]))
    plan.module_calls = module_calls_of(graph, plan)
    assert plan.module_calls[i][1] and is_per_call(plan.module_calls[i][0])
    reference = _step(model, x)
    autoremat.apply(model, plan)
    try:
        assert gradients_equal(reference, _step(model, x))
        with pytest.raises(RuntimeError, match="selective saves.*autocast"):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                model(x)
    finally:
        autoremat.restore(model)


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_a_compiled_model_runs_the_calls_the_plan_names(backend: str) -> None:
    """Dynamo traces the per-call counters: the compiled patched step recomputes the named calls
    (its peak well below the compiled unpatched step's) with that step's gradients. The counters
    were switched off while compiling, which ran every call plain: nothing was recomputed.
    (Inductor compiles C++ on the CPU: slow.)"""
    model, x = _model("block"), _batch()
    graph = autoremat.capture(model, (x,), loss_fn=_loss, repeats=1, warmup=0)
    plan = autoremat.solve(graph, "min")
    assert any(is_per_call(c[0]) for c in plan.module_calls.values())
    torch._dynamo.reset()
    reference = _step(torch.compile(model, backend=backend), x)
    plain = measure(torch.compile(model, backend=backend), (x,), loss_fn=_loss, steps=1, warmup=0).peak_bytes
    torch._dynamo.reset()
    autoremat.apply(model, plan)
    try:
        compiled = torch.compile(model, backend=backend)
        assert gradients_equal(reference, _step(compiled, x))
        peak = measure(compiled, (x,), loss_fn=_loss, steps=1, warmup=0).peak_bytes
    finally:
        autoremat.restore(model)
        torch._dynamo.reset()
    assert peak <= 0.6 * plain, (peak, plain)
