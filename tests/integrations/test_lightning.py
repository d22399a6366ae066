"""The AutoRemat Lightning callback on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

import autoremat
from autoremat.integrations import lightning as lit
from autoremat.integrations import _lightning_steps as steps
from autoremat.integrations.summary import batch_size_row
from autoremat.measure import LiveStorageCounter, measure

from autoremat.zoo.lightning import LitClassifier, LitGPT2

HERE = Path(__file__).parent
SOLVER = "chen"
"""The solver of the fits whose question is not the plan (regions, resume, compile, dropout's RNG,
the module-level graph, the back-off from a confirmation step out of memory): chen plans in well
under a second where auto's search on measured times took most of each fit. The default solver
through the callback: test_fit_cnn_meets_budget_and_restores, test_raise_batch_size_under_byte_budget,
test_batch_search_probes_with_the_same_solve_as_the_confirmation and the DDP fit."""


def _trainer(cb: pl.Callback, tmp_path: Path, **kw) -> pl.Trainer:  # type: ignore[no-untyped-def]
    opts = dict(max_steps=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    opts.update(kw)
    return pl.Trainer(callbacks=[cb], **opts)


def test_fit_cnn_meets_budget_and_restores(tmp_path: Path) -> None:
    model = LitClassifier()
    vanilla = measure(model.model, (model.images[:4],)).peak_bytes
    cb = autoremat.AutoRemat(budget="50%", module="model", raise_batch_size=False, verbose=False)
    seen = {}

    class Probe(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
            seen["patched"] = autoremat.is_patched(pl_module.model)
            x, _ = batch
            seen["peak"] = measure(pl_module.model, (x,), steps=1, warmup=0).peak_bytes

    trainer = _trainer(cb, tmp_path)
    trainer.callbacks.append(Probe())
    trainer.fit(model)
    assert seen["patched"]
    assert cb.plan is not None and cb.plan.recompute_segments
    assert seen["peak"] <= cb.step_budget_bytes
    assert seen["peak"] < 0.6 * vanilla
    assert cb.summary["measured_peak_bytes"] <= cb.step_budget_bytes
    assert len(model.step_losses) == 2 and all(torch.isfinite(torch.tensor(model.step_losses)))
    assert not autoremat.is_patched(model.model)  # restored when fitting ended
    # the summary says why the batch was not raised (was a test of its own, on the same fit)
    assert cb.summary["batch_size_before"] == cb.summary["batch_size_after"] == 4
    assert cb.summary["batch_size_not_raised"] == "raise_batch_size=False"
    assert batch_size_row(cb.summary) == "4 (not raised: raise_batch_size=False)"


@pytest.mark.parametrize("regions", ["lean", "torch"])
def test_training_is_unchanged_by_the_callback(tmp_path: Path, regions: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import autoremat.integrations.lightning as integration

    used: list[str] = []
    real_apply = integration.apply
    monkeypatch.setattr(integration, "apply",
                        lambda m, p, regions: used.append(regions) or real_apply(m, p, regions=regions))
    torch.manual_seed(0)
    plain = LitClassifier()
    torch.manual_seed(0)
    patched = LitClassifier()
    _trainer(pl.Callback(), tmp_path, max_steps=3).fit(plain)
    cb = autoremat.AutoRemat(budget="50%", module="model", raise_batch_size=False, verbose=False, regions=regions,
                             solver=SOLVER)
    _trainer(cb, tmp_path, max_steps=3).fit(patched)
    assert cb.plan is not None and cb.plan.recompute_segments
    assert used and set(used) == {regions}
    assert plain.step_losses == patched.step_losses
    for (k, a), (_, b) in zip(plain.state_dict().items(), patched.state_dict().items()):
        assert torch.equal(a, b), k


def test_fit_gpt2_module_level(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    model = LitGPT2()
    cb = autoremat.AutoRemat(budget="50%", module="model", raise_batch_size=False, verbose=False,
                             loss_fn=lambda out: out.logits.float().mean(), solver=SOLVER)
    _trainer(cb, tmp_path).fit(model)
    assert cb.summary["graph_mode"] == "module"
    assert cb.plan is not None and cb.plan.recompute_segments
    assert cb.summary["measured_peak_bytes"] <= cb.step_budget_bytes


def test_raise_batch_size_under_byte_budget(tmp_path: Path) -> None:
    model = LitClassifier(samples=256)
    resident = sum(p.numel() * 4 for p in model.parameters()) * 2  # params + SGD momentum
    cb = autoremat.AutoRemat(budget=resident + 3 * 2**20, module="model", verbose=False)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = _trainer(cb, tmp_path, max_steps=1)
    trainer.fit(model)
    assert cb.original_batch_size == 4
    assert cb.batch_size is not None and cb.batch_size >= 8
    assert model.batch_size == cb.batch_size
    assert trainer.train_dataloader.batch_size == cb.batch_size
    # a step at the chosen size, patched, fits the step budget; one more sample would not be chosen
    x = model.images[: cb.batch_size]
    autoremat.apply(model.model, cb.plan)
    try:
        peak = measure(model.model, (x,), steps=1, warmup=0).peak_bytes
    finally:
        autoremat.restore(model.model)
    assert peak <= cb.step_budget_bytes
    assert len(before) == len(list(model.parameters()))


def test_raise_batch_size_backs_off_on_simulated_oom(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU allocator that fails above a limit: the callback must back off and keep state."""
    limit = 2 * 2**20
    original_trial = lit.trial_step

    def failing_trial(target, args, kwargs, loss_fn, trainer):  # type: ignore[no-untyped-def]
        counter = _Limited(limit)
        with counter:
            return original_trial(target, args, kwargs, loss_fn, trainer)

    calls = []

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return failing_trial(*args, **kwargs)

    monkeypatch.setattr(lit, "trial_step", failing_trial)  # the confirmation step
    monkeypatch.setattr(steps, "trial_step", counted)  # the batch search's trial steps
    model = LitClassifier(samples=256)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    cb = autoremat.AutoRemat(budget=10 * 2**20, module="model", verbose=False, max_batch_size=64, solver=SOLVER)
    trainer = _trainer(cb, tmp_path, max_steps=1)
    trainer.fit(model)
    assert 4 <= cb.batch_size < 64 and calls  # the search met the simulated allocator
    # every confirmed size stayed under the simulated allocator limit
    x = model.images[: cb.batch_size]
    autoremat.apply(model.model, cb.plan)
    try:
        counter = LiveStorageCounter()
        with counter:
            model.model(x).mean().backward()
    finally:
        autoremat.restore(model.model)
    assert counter.peak <= limit
    assert set(state) == set(model.state_dict())


class _Limited(LiveStorageCounter):
    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.live > self.limit:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate (simulated)")
        return out


def test_resume_reuses_plan_without_profiling(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = LitClassifier()
    cb = autoremat.AutoRemat(budget="50%", module="model", raise_batch_size=False, verbose=False, solver=SOLVER)
    trainer = _trainer(cb, tmp_path, max_steps=2, enable_checkpointing=True)
    trainer.fit(model)
    ckpt = tmp_path / "last.ckpt"
    trainer.save_checkpoint(ckpt)
    saved_plan = cb.plan.to_dict()

    def no_capture(*a, **k):  # type: ignore[no-untyped-def]
        raise AssertionError("resumed run profiled again")

    monkeypatch.setattr(lit, "capture_within", no_capture)
    cb2 = autoremat.AutoRemat(budget="50%", module="model", raise_batch_size=False, verbose=False, solver=SOLVER)
    seen = {}

    class Probe(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
            seen["patched"] = autoremat.is_patched(pl_module.model)

    trainer2 = _trainer(cb2, tmp_path, max_steps=4, enable_checkpointing=True)
    trainer2.callbacks.append(Probe())
    trainer2.fit(LitClassifier(), ckpt_path=ckpt)
    assert cb2.plan.to_dict() == saved_plan and seen["patched"]
    # the resumed run's summary is the planning run's (it was empty: no measured peak to report)
    assert cb2.summary["measured_peak_bytes"] == cb.summary["measured_peak_bytes"] > 0
    assert cb2.summary["source"].startswith("checkpoint")


def test_offload_true_needs_cuda(tmp_path: Path) -> None:
    cb = autoremat.AutoRemat(budget="60%", module="model", offload=True, raise_batch_size=False, verbose=False)
    with pytest.raises(ValueError, match="offload=True needs a CUDA device"):
        _trainer(cb, tmp_path).fit(LitClassifier())


def test_offload_false_excludes_the_combined_planner(monkeypatch: pytest.MonkeyPatch) -> None:
    """At the user's own batch size too. Checked on what ``solve`` is asked: a CPU fit cannot tell
    (``auto`` leaves ``combined`` out of a CPU graph anyway, ``solvers.combined.offload_allowed``;
    the fit it ran, 25 s, passed with the setting ignored)."""
    import autoremat.integrations.lightning as lightning_mod

    seen: list[dict] = []
    monkeypatch.setattr(lightning_mod, "solve", lambda graph, budget, **kw: seen.append(kw) or "plan")
    assert autoremat.AutoRemat(offload=False, verbose=False)._solve(object(), 10) == "plan"
    assert seen[-1]["solver"] == "auto" and "combined" not in seen[-1]["auto_solvers"]
    assert "dp-approx" in seen[-1]["auto_solvers"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"budget": "lots"}, "accepted|expected"),
        ({"budget": [1]}, "expected"),
        ({"solver": "magic"}, "not registered"),
        ({"offload": "yes"}, "offload"),
        ({"solver": "offload-dp", "offload": False}, "offload=False forbids"),
        ({"profile_steps": 0}, "profile_steps"),
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"module": 3}, "dotted"),
        ({"regions": "fast"}, "regions"),
        # numeric budgets and the other arguments are checked here, not at fit time (issue 29 item 12)
        ({"budget": -0.5}, r"fraction in \(0, 1\]"),
        ({"budget": 5.0}, r"fraction in \(0, 1\]"),
        ({"budget": -3}, r"bytes must be >= 0"),
        ({"raise_batch_size": "yes"}, "raise_batch_size='yes' must be 'auto'"),
        ({"verbose": None}, "verbose=None must be True or False"),
        ({"loss_fn": 3}, "loss_fn=3 must be callable"),
        ({"batch_arg_name": ""}, "batch_arg_name"),
    ],
)
def test_bad_arguments_rejected(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        autoremat.AutoRemat(**kwargs)


def test_unsupported_setups_rejected_in_setup(tmp_path: Path) -> None:
    cb = autoremat.AutoRemat(module="nonexistent", verbose=False)
    with pytest.raises(ValueError, match="no attribute 'nonexistent'"):
        _trainer(cb, tmp_path).fit(LitClassifier())
    model = LitClassifier()
    del model.batch_size
    cb = autoremat.AutoRemat(module="model", raise_batch_size=True, verbose=False)
    with pytest.raises((ValueError, AttributeError), match="batch_size"):
        _trainer(cb, tmp_path).fit(model)
    cb = autoremat.AutoRemat(budget=1000, module="model", raise_batch_size=False, verbose=False)
    with pytest.raises(ValueError, match="resident"):
        _trainer(cb, tmp_path).fit(LitClassifier())


def test_ddp_two_processes_share_one_plan(tmp_path: Path) -> None:
    # HERE first, then whatever the suite runs with (a source checkout on PYTHONPATH, e.g. on a GPU machine)
    env = {**os.environ, "AUTOREMAT_TEST_OUT": str(tmp_path),
           "PYTHONPATH": os.pathsep.join(filter(None, (str(HERE), os.environ.get("PYTHONPATH"))))}
    proc = subprocess.run([sys.executable, str(HERE / "ddp_script.py")], env=env, capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    plans = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert plans[0] == plans[1]
    assert plans[0]["plan"]["segments"] and plans[0]["patched"] and plans[1]["patched"]
    assert plans[0]["module"] == plans[1]["module"] == "model"  # chosen on rank zero (no module=)


def test_a_compiled_network_is_planned_and_recompiled_with_its_regions(tmp_path: Path) -> None:
    """The user compiled the network before fitting: AutoRemat plans the module inside the
    ``torch.compile`` wrapper, and Dynamo recompiles the patched forward with the plan's regions
    as checkpoint operators."""
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend("aot_eager")(gm, example_inputs)

    torch._dynamo.reset()
    model = LitClassifier()
    model.model = torch.compile(model.model, backend=backend)
    cb = autoremat.AutoRemat(budget="50%", module="model", raise_batch_size=False, verbose=False, solver=SOLVER)
    seen = {}

    class Probe(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
            seen["patched"] = autoremat.is_patched(pl_module.model)

    trainer = _trainer(cb, tmp_path)
    trainer.callbacks.append(Probe())
    trainer.fit(model)
    assert seen["patched"] and cb.plan is not None and cb.plan.recompute_segments
    counts = [sum(1 for n in g.graph.nodes if "checkpoint" in str(n.target)) for g in graphs]
    assert len(cb.plan.recompute_segments) in counts  # the training steps ran the compiled regions
    assert len(model.step_losses) == 2 and all(torch.isfinite(torch.tensor(model.step_losses)))
    assert not autoremat.is_patched(model.model)


def test_numpy_budget_is_a_plain_number() -> None:
    np = pytest.importorskip("numpy")
    assert autoremat.AutoRemat(budget=np.float64(0.5)).budget == 0.5
    assert type(autoremat.AutoRemat(budget=np.int64(2**30)).budget) is int


class _Plain(pl.LightningModule):
    """An ordinary LightningModule: no ``batch_size`` attribute, no hparams."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                                       torch.nn.ReLU(), torch.nn.Linear(64, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(32, 16, generator=g), torch.randn(32, 1, generator=g))
        return torch.utils.data.DataLoader(data, batch_size=8)


def test_ordinary_module_skips_batch_size_raising_with_one_line(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]) -> None:
    cb = autoremat.AutoRemat(budget="auto")  # the README snippet: defaults only
    with caplog.at_level("INFO"):
        _trainer(cb, tmp_path, max_steps=1).fit(_Plain())
    assert cb.plan is not None
    assert cb.batch_size is None and "batch_size" in cb.summary["batch_size_not_raised"]
    lines = [r.getMessage() for r in caplog.records if "batch size not raised" in r.getMessage()]
    assert len(lines) == 1 and "add one" in lines[0]
    table = capsys.readouterr().out
    assert "not raised" in table and "None" not in table


def test_explicit_raise_batch_size_still_needs_the_attribute(tmp_path: Path) -> None:
    cb = autoremat.AutoRemat(budget="auto", raise_batch_size=True, verbose=False)
    with pytest.raises(ValueError, match="needs a `batch_size` attribute"):
        _trainer(cb, tmp_path, max_steps=1).fit(_Plain())
    with pytest.raises(ValueError, match="raise_batch_size"):
        autoremat.AutoRemat(raise_batch_size="yes")


def test_batch_search_probes_with_the_same_solve_as_the_confirmation(tmp_path: Path) -> None:
    """The prediction solves through the callback's own ``_solve`` as the confirmation does
    (solver, offload handling; recomputation only under ``"auto"``, a subset of what the
    confirmation weighs): a size the callback's own solve rejects must never reach a trial step;
    the probes ask for the first plan that fits (``first_fit``) and the trial step solves its size
    in full, each once (the trial once solved every predicted size again)."""
    rejected_in_trial: list[int] = []
    solved: list[tuple[int, bool, bool]] = []

    class Restricted(autoremat.AutoRemat):
        """A solve that rejects graphs over twice the original activation bytes."""

        base: int | None = None
        trying: bool = False

        def _solve(self, graph, step_budget, **kwargs):  # type: ignore[no-untyped-def]
            size = graph.total("out_bytes")
            solved.append((size, kwargs.get("recompute_only", False), kwargs.get("first_fit", False)))
            self.base = self.base or size
            if size > 2.2 * self.base:
                if self.trying:
                    rejected_in_trial.append(size)
                raise autoremat.InfeasibleBudgetError(step_budget, None, solver="restricted")
            return super()._solve(graph, step_budget, **kwargs)

        def _try_size(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            self.trying = True
            try:
                return super()._try_size(*args, **kwargs)
            finally:
                self.trying = False

    model = LitClassifier(samples=64)
    cb = Restricted(budget=2**40, module="model", verbose=False, max_batch_size=32)
    _trainer(cb, tmp_path, max_steps=1).fit(model)
    assert cb.batch_size == 8  # twice the original 4: the largest the restricted solve accepts
    assert rejected_in_trial == []
    assert len(solved) == len(set(solved)) >= 3, solved  # 4 (the first plan), 8, 16 (rejected), ...
    full, probed = {g for g, r, f in solved if r and not f}, {g for g, r, f in solved if f}
    assert full and full <= probed  # a trial's size was probed first, then solved in full once


def test_dropout_training_is_unchanged_by_the_callback(tmp_path: Path) -> None:
    """With dropout on, a fit with AutoRemat trains to exactly the weights of a fit without it:
    profiling must leave the global RNG where it was (starting a dataloader iterator draws a seed
    from it, which once moved every dropout mask of the run)."""
    pytest.importorskip("transformers")
    from autoremat.zoo.lightning import LitGPT2

    def fit(callbacks: list) -> pl.LightningModule:
        torch.manual_seed(0)
        lit = LitGPT2(batch_size=8, samples=32, n_layer=2)
        assert any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in lit.modules())
        pl.Trainer(max_steps=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                   callbacks=callbacks).fit(lit)
        return lit

    reference = fit([])
    patched = fit([autoremat.AutoRemat(budget="60%", module="model", raise_batch_size=False, verbose=False,
                                       loss_fn=lambda out: out.loss, solver=SOLVER)])
    for (k, a), (_, b) in zip(reference.state_dict().items(), patched.state_dict().items()):
        assert torch.equal(a, b), k


def test_the_batch_prediction_plans_recomputation_only_under_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_raise`` solves at every size of its search and trial: under ``solver="auto"`` it leaves
    out ``combined`` (minutes of offload search on a CUDA graph), unless offload is forced; the
    plan at the user's own batch size keeps every solver."""
    import autoremat.integrations.lightning as lightning_mod

    seen: list[dict] = []
    monkeypatch.setattr(lightning_mod, "solve", lambda graph, budget, **kw: seen.append(kw) or "plan")
    graph = object()
    assert autoremat.AutoRemat(verbose=False)._solve(graph, 10, recompute_only=True) == "plan"
    assert seen[-1]["solver"] == "auto" and "combined" not in seen[-1]["auto_solvers"]
    autoremat.AutoRemat(verbose=False)._solve(graph, 10)
    assert "auto_solvers" not in seen[-1]
    autoremat.AutoRemat(verbose=False, offload=True)._solve(graph, 10, recompute_only=True)
    assert seen[-1]["solver"] == "combined" and seen[-1]["offload"] is True
    autoremat.AutoRemat(verbose=False, solver="dp-approx")._solve(graph, 10, recompute_only=True)
    assert seen[-1] == {"solver": "dp-approx", "first_fit": False}
    autoremat.AutoRemat(verbose=False)._solve(graph, 10, recompute_only=True, first_fit=True)
    assert seen[-1]["first_fit"] is True


class _SharedBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)
        self.drop = torch.nn.Dropout(0.2)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(self.drop(torch.nn.functional.gelu(self.up(h))))


class _LitShared(_Plain):
    """One block run four times per step (shared weights, as ALBERT's layer group), dropout on."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), _Loop(torch.nn.ModuleList([_SharedBlock()])),
                                       torch.nn.Linear(32, 1))
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.item())
        return loss


class _Loop(torch.nn.Module):
    def __init__(self, layers: torch.nn.ModuleList) -> None:
        super().__init__()
        self.layers = layers

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for _ in range(4 if h.shape[-1] == 32 else 0):  # a branch on a shape: fx cannot trace it (module level)
            h = self.layers[0](h)
        return h


def test_a_shared_block_is_recomputed_per_call_in_training(tmp_path: Path) -> None:
    """The callback plans a block run four times per step call by call; training is unchanged."""
    torch.manual_seed(1)
    plain = _LitShared()
    _trainer(pl.Callback(), tmp_path, max_steps=3).fit(plain)
    torch.manual_seed(1)
    patched = _LitShared()
    cb = autoremat.AutoRemat(budget="min", module="net", raise_batch_size=False, verbose=False)
    _trainer(cb, tmp_path, max_steps=3).fit(patched)
    assert cb.plan is not None and cb.plan.graph_mode == "module"
    assert any("@" in path for path, _ in cb.plan.module_calls.values()), cb.plan.module_calls
    assert plain.losses == patched.losses
    for (k, a), (_, b) in zip(plain.state_dict().items(), patched.state_dict().items()):
        assert torch.equal(a, b), k
