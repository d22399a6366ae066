"""AutoRemat under Lightning's mixed precision (``"bf16-mixed"``, ``"16-mixed"``) and autoremat's
runtime under ``torch.autocast``.

Lightning 2.6 turns ``Trainer(accelerator="cpu", precision="16-mixed")`` into ``"bf16-mixed"`` with a
warning (fp16 AMP "is not supported on CPU"), so on the CPU the ``"16-mixed"`` cases pass Lightning's
own plugin explicitly: ``plugins=[MixedPrecision("16-mixed", "cpu")]`` is the plugin that
``precision="16-mixed"`` builds on a GPU (``torch.autocast(dtype=torch.float16, cache_enabled=False)``
and a ``GradScaler``), only with ``device="cpu"``. The GPU-marked test runs the plain
``precision="16-mixed"`` on CUDA.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

import autoremat
from autoremat.integrations import lightning as lit
from autoremat.measure import LiveStorageCounter, gradients, gradients_equal, measure, run_step
from autoremat.cost import simulate, unoptimised_peak_bytes
from autoremat.zoo.lightning import LitClassifier

PRECISIONS = ("bf16-mixed", "16-mixed")
DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
PEAK_TOLERANCE = 0.03
"""Simulated vs measured unoptimised step peak under autocast (measured: within 1 % on resnet50)."""
SOLVER = "chen"
"""The CPU fits' solver: the question here is the precision (profiled, patched and recomputed under
the trainer's autocast), not the plan; chen plans in well under a second where auto's search on
measured times took most of each fit. The default solver through the callback: test_lightning."""


def _trainer(callbacks: list[pl.Callback], tmp_path: Path, precision: str, accelerator: str = "cpu",
             **kw: Any) -> pl.Trainer:
    opts: dict[str, Any] = dict(max_steps=3, accelerator=accelerator, devices=1, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, default_root_dir=tmp_path)
    if accelerator == "cpu":
        opts["plugins"] = [MixedPrecision(precision, "cpu")]  # type: ignore[arg-type]
    else:
        opts["precision"] = precision
    opts.update(kw)
    return pl.Trainer(callbacks=callbacks, **opts)


def test_lightning_replaces_cpu_16_mixed_by_bf16(tmp_path: Path) -> None:
    """Why the CPU cases pass the plugin: the precision string alone would silently test bf16."""
    with pytest.warns(UserWarning, match="not supported on CPU"):
        trainer = pl.Trainer(accelerator="cpu", precision="16-mixed", logger=False, default_root_dir=tmp_path)
    assert trainer.precision_plugin.precision == "bf16-mixed"
    trainer = _trainer([], tmp_path, "16-mixed")
    plugin = trainer.precision_plugin
    assert isinstance(plugin, MixedPrecision) and plugin.precision == "16-mixed" and plugin.scaler is not None
    with plugin.forward_context():
        assert torch.get_autocast_dtype("cpu") == torch.float16 and torch.is_autocast_enabled("cpu")


class _StepPeaks:
    """Wraps the LightningModule's ``optimizer_step`` (training_step, backward and the update under
    automatic optimisation) in a live-storage counter and records each step's peak."""

    def __init__(self, pl_module: pl.LightningModule) -> None:
        self.peaks: list[int] = []
        self.autocast: list[tuple[bool, torch.dtype]] = []
        original_step, original_train = pl_module.optimizer_step, pl_module.training_step

        def optimizer_step(*args: Any, **kwargs: Any) -> Any:
            counter = LiveStorageCounter()
            with counter:
                out = original_step(*args, **kwargs)
            self.peaks.append(counter.peak)
            return out

        def training_step(*args: Any, **kwargs: Any) -> Any:
            if torch.is_grad_enabled():  # not AutoRemat's recording call
                self.autocast.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
            return original_train(*args, **kwargs)

        pl_module.optimizer_step = optimizer_step  # type: ignore[method-assign]
        pl_module.training_step = training_step  # type: ignore[method-assign]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_fit_under_mixed_precision(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, precision: str) -> None:
    dtype = DTYPES[precision]
    captured: dict[str, Any] = {}
    real_capture = lit.capture_within

    def spy(*args: Any, **kwargs: Any) -> autoremat.Graph:
        captured["autocast"] = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
        captured["graph"] = real_capture(*args, **kwargs)
        return captured["graph"]

    monkeypatch.setattr(lit, "capture_within", spy)
    model = LitClassifier()
    steps = _StepPeaks(model)
    patched: list[bool] = []

    class Probe(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
            patched.append(autoremat.is_patched(pl_module.model))

    cb = autoremat.AutoRemat(budget="60%", module="model", raise_batch_size=False, verbose=False, solver=SOLVER)
    trainer = _trainer([cb, Probe()], tmp_path, precision)
    trainer.fit(model)

    # profiled under the trainer's autocast, so the graph holds the low-precision activations
    assert captured["autocast"] == (True, dtype)
    x = model.images[:4]
    with trainer.precision_plugin.forward_context():
        amp_peak = measure(model.model, (x,), steps=1, warmup=0).peak_bytes
    fp32_peak = measure(model.model, (x,), steps=1, warmup=0).peak_bytes
    graph_peak = unoptimised_peak_bytes(captured["graph"])
    assert abs(graph_peak - amp_peak) <= PEAK_TOLERANCE * amp_peak, (graph_peak, amp_peak)
    assert graph_peak < 0.8 * fp32_peak, (graph_peak, fp32_peak)

    # every real training step ran patched, under autocast, within the step budget
    assert patched == [True, True, True]
    assert steps.autocast == [(True, dtype)] * 3
    assert cb.plan is not None and cb.plan.recompute_segments
    assert cb.step_budget_bytes is not None
    # The step budget reserves room for the previous step's gradients (Lightning frees them inside the
    # next step's closure); the first step has none, so it may use that room. The counter does not see
    # the old gradients freed, so later steps are over-counted, never under-counted.
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    assert len(steps.peaks) == 3, steps.peaks
    assert steps.peaks[0] <= cb.step_budget_bytes + grad_bytes, (steps.peaks, cb.step_budget_bytes, grad_bytes)
    assert max(steps.peaks[1:]) <= cb.step_budget_bytes, (steps.peaks, cb.step_budget_bytes)
    assert all(torch.isfinite(torch.tensor(model.step_losses)))

    # a patched step under the same autocast gives the unpatched step's gradients bit for bit
    reference = copy.deepcopy(model.model)
    autoremat.apply(model.model, cb.plan)
    try:
        with trainer.precision_plugin.forward_context():
            torch.manual_seed(0)
            run_step(reference, (x,))
            torch.manual_seed(0)
            run_step(model.model, (x,))
    finally:
        autoremat.restore(model.model)
    assert gradients_equal(gradients(reference), gradients(model.model))


@pytest.mark.parametrize("precision", PRECISIONS)
def test_training_under_mixed_precision_is_unchanged(tmp_path: Path, precision: str) -> None:
    """Same losses and weights with and without the callback (for "16-mixed" the GradScaler too)."""
    torch.manual_seed(0)
    plain = LitClassifier()
    torch.manual_seed(0)
    patched = LitClassifier()
    plain_trainer = _trainer([], tmp_path, precision)
    plain_trainer.fit(plain)
    cb = autoremat.AutoRemat(budget="60%", module="model", raise_batch_size=False, verbose=False, solver=SOLVER)
    patched_trainer = _trainer([cb], tmp_path, precision)
    patched_trainer.fit(patched)
    assert cb.plan is not None and cb.plan.recompute_segments
    assert len(plain.step_losses) == 3 and plain.step_losses == patched.step_losses
    for (k, a), (_, b) in zip(plain.state_dict().items(), patched.state_dict().items()):
        assert torch.equal(a, b), k
    assert plain_trainer.precision_plugin.state_dict() == patched_trainer.precision_plugin.state_dict()


def test_patched_step_under_fp16_autocast_matches_the_plan() -> None:
    """The runtime path of "16-mixed" without Lightning: capture, solve and run under
    ``torch.autocast("cpu", dtype=torch.float16)``; recomputation reruns under the same state."""
    model, (x,) = autoremat.zoo.build("resnet50", size="small")
    reference = copy.deepcopy(model)
    fp32 = autoremat.capture(model, (x,), times="flops")  # only its bytes are compared
    with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
        g = autoremat.capture(model, (x,), times="flops")  # deterministic times: one solve, no stability pass
    conv = next(v for v in g.nodes if g.node(v)["kind"] == "conv")
    assert g.node(conv)["out_bytes"] * 2 == fp32.node(conv)["out_bytes"]  # fp16 activations
    plan = autoremat.solve(g, "50%")
    assert plan.recompute_segments
    autoremat.apply(model, plan)
    try:
        with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
            patched_peak = measure(model, (x,), steps=1, warmup=0).peak_bytes
            torch.manual_seed(0)
            run_step(reference, (x,))
            torch.manual_seed(0)
            run_step(model, (x,))
    finally:
        autoremat.restore(model)
    assert gradients_equal(gradients(reference), gradients(model))
    predicted = simulate(g, plan).peak_bytes
    assert abs(patched_peak - predicted) <= PEAK_TOLERANCE * predicted, (patched_peak, predicted)
    assert patched_peak <= 0.5 * unoptimised_peak_bytes(g) * (1 + PEAK_TOLERANCE)


@pytest.mark.gpu
def test_fit_16_mixed_on_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``precision="16-mixed"`` as users pass it, on CUDA (skipped without a GPU)."""
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)  # equal gradients need fixed conv algorithms
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    model = LitClassifier(batch_size=512, samples=1024)  # a step peak of ~100 MiB: not allocator rounding
    cb = autoremat.AutoRemat(budget="60%", module="model", raise_batch_size=False, verbose=False)
    trainer = _trainer([cb], tmp_path, "16-mixed", accelerator="gpu")
    assert trainer.precision_plugin.precision == "16-mixed"
    trainer.fit(model)
    assert cb.plan is not None and (cb.plan.recompute_segments or cb.plan.offload)  # offload alone may do on a GPU
    # An H200 measured 15,341 bytes (0.02 %) over the 60 % budget: the plan predicted within it; held to 1 %.
    assert cb.summary["measured_peak_bytes"] <= cb.step_budget_bytes * 1.01
    assert all(torch.isfinite(torch.tensor(model.step_losses)))
    net = model.model.cuda()
    x = model.images[:4].cuda()
    reference = copy.deepcopy(net)
    autoremat.apply(net, cb.plan)
    try:
        with trainer.precision_plugin.forward_context():
            torch.manual_seed(0)
            run_step(reference, (x,))
            torch.manual_seed(0)
            run_step(net, (x,))
    finally:
        autoremat.restore(net)
    assert gradients_equal(gradients(reference), gradients(net))


def test_the_measured_step_runs_backward_outside_the_precision_context() -> None:
    """Lightning's precision plugin wraps ``training_step``, not the backward, so autocast's cast
    cache (the bf16 weight copies) is gone before backward; the callback's measured step (summary,
    batch-size trial steps) ran the backward inside it and measured those copies too (a ConvNeXt's
    least plan: 1.55 MB against 1.26 MB in training)."""
    from autoremat.integrations._planning import measured_step_peak

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(6)))  # weights >> activations
    x = torch.randn(4, 256)
    context = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731 - the plugin's forward_context
    measured = measured_step_peak(model, (x,), {}, lambda out: out.float().mean(), context)
    counter = LiveStorageCounter()
    with counter:
        with context():
            loss = model(x).float().mean()
        loss.backward()
    weights = 6 * 256 * 256 * 2  # the bf16 copies
    assert abs(measured - counter.peak) < 0.1 * weights, (measured, counter.peak)
