"""Workflows of a user fine-tuning with the integrations: a transformers Llama with its base
frozen and low-rank adapters on the attention projections (LoRA), under Lightning, and compiled.

The patched run must train exactly as the run without autoremat, and a module the user compiled
must still run compiled once the callback has planned it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

import autoremat
from autoremat.integrations._planning import measured_step_peak
from autoremat.measure import default_loss

SOLVER = "chen"
"""The callback's solver in fits whose question is not the plan: chen plans in well under
a second where auto's search on measured times took most of each fit (the default solver through
the callback: test_lightning's test_fit_cnn_meets_budget_and_restores and batch-raising tests)."""

transformers = pytest.importorskip("transformers")


class LoRA(nn.Module):
    """``base(x) + b(a(x))`` with ``base`` frozen: the adapter the user trains."""

    def __init__(self, base: nn.Linear, rank: int = 4) -> None:
        super().__init__()
        self.base = base
        self.a = nn.Linear(base.in_features, rank, bias=False)
        self.b = nn.Linear(rank, base.out_features, bias=False)
        nn.init.normal_(self.b.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.b(self.a(x))


def lora_llama(seed: int = 0, layers: int = 2) -> nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   use_cache=False)
    model = transformers.LlamaForCausalLM(cfg)
    model.requires_grad_(False)
    for layer in model.model.layers:
        layer.self_attn.q_proj = LoRA(layer.self_attn.q_proj)
        layer.self_attn.v_proj = LoRA(layer.self_attn.v_proj)
    return model


class LitLoRA(pl.LightningModule):
    def __init__(self, compile_backend: object = None) -> None:
        super().__init__()
        self.model = lora_llama()
        if compile_backend is not None:
            self.model = torch.compile(self.model, backend=compile_backend)
        self.ids = torch.randint(0, 128, (16, 16), generator=torch.Generator().manual_seed(1))
        self.losses: list[float] = []

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(self.ids, batch_size=4)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


def _fit(model: pl.LightningModule, callbacks: list, tmp_path: Path, **kw: object) -> pl.Trainer:
    opts: dict = dict(max_steps=3, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    opts.update(kw)
    trainer = pl.Trainer(callbacks=callbacks, **opts)
    trainer.fit(model)
    return trainer


class _Graphs:
    """A ``torch.compile`` backend counting the graphs Dynamo hands it (run with ``aot_eager``)."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        self.graphs.append(gm)
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend("aot_eager")(gm, example_inputs)


def test_lora_fine_tuning_trains_exactly_as_without_autoremat(tmp_path: Path) -> None:
    """Frozen base, trainable adapters, accumulation, clipping: the same losses and parameters."""
    kw = dict(accumulate_grad_batches=2, gradient_clip_val=0.5, max_steps=2)
    plain, patched = LitLoRA(), LitLoRA()
    _fit(plain, [], tmp_path, **kw)
    cb = autoremat.AutoRemat(budget="70%", module="model", raise_batch_size=False, verbose=False, solver=SOLVER)
    _fit(patched, [cb], tmp_path, **kw)
    assert cb.plan is not None and cb.plan.recompute_segments
    assert plain.losses == patched.losses and len(plain.losses) == 4
    for (name, a), b in zip(plain.state_dict().items(), patched.state_dict().values()):
        assert torch.equal(a, b), name
    summary = cb.summary
    assert abs(summary["measured_peak_bytes"] - summary["predicted_peak_bytes"]) <= 0.01 * summary["predicted_peak_bytes"]


def test_measuring_a_step_leaves_a_compiled_module_compiling() -> None:
    """The CPU step peak is counted under a ``TorchDispatchMode``; Dynamo, called under one, marks
    the code it meets to run eagerly from then on, so the user's compiled model never compiled
    again. The measured step runs the module inside the wrapper."""
    torch._dynamo.reset()
    backend = _Graphs()
    net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    compiled = torch.compile(net, backend=backend)
    x = torch.randn(4, 8)
    assert measured_step_peak(compiled, (x,), {}, default_loss) > 0
    compiled(x).sum().backward()
    assert backend.graphs


def test_a_compiled_transformers_model_still_compiles_under_the_callback(tmp_path: Path) -> None:
    torch._dynamo.reset()
    backend = _Graphs()
    model = LitLoRA(compile_backend=backend)
    cb = autoremat.AutoRemat(budget="70%", module="model", raise_batch_size=False, verbose=False)
    _fit(model, [cb], tmp_path, max_steps=2)
    assert cb.plan is not None and cb.plan.recompute_segments
    assert backend.graphs, "the training steps ran eagerly: the user's torch.compile was lost"
    assert len(model.losses) == 2
    # the compiled steps run the plan: its regions reach Dynamo as activation-checkpoint ops
    assert any("checkpoint" in str(n.target) for gm in backend.graphs for n in gm.graph.nodes), \
        "the compiled steps do not recompute: the plan was lost under torch.compile"


def test_hooks_see_the_users_steps_once_when_they_skip_autoremats_own_runs(tmp_path: Path) -> None:
    """A forward hook and a full backward hook registered before fitting fire in autoremat's own
    runs too (capture, timing, the measured step); skipping those (``is_profiling``) and
    recomputations (``is_recomputing``), they see the steps and values of the run without it."""

    def fit(callbacks: list) -> tuple[list, list]:
        model, seen, every = LitLoRA(), [], []
        # a module of every layer whose forward returns inside a recomputed layer's replay (the
        # replay stops at the layer's last saved tensor, inside its mlp, before the mlp's forward
        # hook would run); every layer, as the least plans tie in peak and the measured times
        # choose among them (times scaled 0.2-5x per node: 32 of 100 recompute layer 0 only; a CI
        # run hooking layer 1 alone saw no recomputation)
        norms = [layer.post_attention_layernorm for layer in model.model.model.layers]

        def forward_hook(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
            every.append("r" if autoremat.runtime.is_recomputing() and not autoremat.is_profiling() else "f")
            if not autoremat.is_profiling() and not autoremat.runtime.is_recomputing():
                seen.append(("f", out.detach().clone()))

        def backward_hook(module: nn.Module, grad_in: tuple, grad_out: tuple) -> None:
            every.append("b")
            if not autoremat.is_profiling():
                seen.append(("b", grad_out[0].detach().clone()))

        for norm in norms:
            norm.register_forward_hook(forward_hook)
            norm.register_full_backward_hook(backward_hook)
        _fit(model, callbacks, tmp_path, max_steps=2)
        return seen, every

    plain, plain_every = fit([])
    cb = autoremat.AutoRemat(budget="min", module="model", raise_batch_size=False, verbose=False, solver=SOLVER)
    patched, patched_every = fit([cb])
    assert cb.plan is not None and cb.plan.recompute_segments
    assert len(patched_every) > len(plain_every) == 8  # the capture ran the hooks
    assert patched_every.count("r") >= 2  # the training steps recomputed a hooked layer
    assert [k for k, _ in plain] == [k for k, _ in patched] == ["f", "f", "b", "b"] * 2
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(plain, patched))


def _accelerate_run(patched: bool, steps: int = 4) -> tuple[nn.Module, list[float]]:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    import autoremat.integrations.accelerate as ar

    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(cpu=True, mixed_precision="bf16", gradient_accumulation_steps=2)
    model = lora_llama()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 128, (4 * steps, 16), generator=torch.Generator().manual_seed(1))
    if patched:
        ar.prepare(accelerator, model, (), {"input_ids": ids[:4], "labels": ids[:4]}, budget="70%",
                   optimizer=optimizer)
        assert model.__dict__["_autoremat_patch"].plan.recompute_segments
    prepared, optimizer = accelerator.prepare(model, optimizer)
    losses = []
    for i in range(steps):
        batch = ids[4 * i:4 * i + 4]
        with accelerator.accumulate(prepared):
            outputs = prepared(input_ids=batch, labels=batch)
            accelerator.backward(outputs.loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(outputs.loss.item())
    AcceleratorState._reset_state(reset_partial_state=True)
    return model, losses


def test_lora_under_accelerate_accumulation_and_bf16_trains_exactly_as_without_autoremat(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("AUTOREMAT_BUDGET", "AUTOREMAT_SOLVER", "AUTOREMAT_ENABLED", "AUTOREMAT_CONFIG", "AUTOREMAT_PLAN"):
        monkeypatch.delenv(key, raising=False)
    plain, plain_losses = _accelerate_run(False)
    patched, patched_losses = _accelerate_run(True)
    assert plain_losses == patched_losses
    for (name, a), b in zip(plain.state_dict().items(), patched.state_dict().values()):
        assert torch.equal(a, b), name
    autoremat.restore(patched)


def test_autoremat_measure_leaves_a_compiled_module_compiling() -> None:
    """``autoremat.measure`` counts the CPU peak in a step of its own, under the storage counter."""
    torch._dynamo.reset()
    backend = _Graphs()
    compiled = torch.compile(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)), backend=backend)
    assert autoremat.measure(compiled, (torch.randn(4, 8),), steps=1, warmup=1).peak_bytes > 0
    assert len(backend.graphs) == 1
    compiled(torch.randn(5, 8)).sum().backward()  # a new batch size: Dynamo compiles again
    assert len(backend.graphs) == 2


class _RenormLit(pl.LightningModule):
    """An embedding renormalising the rows it looks up (``max_norm``): every forward writes the parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.e = nn.Embedding(20, 16, max_norm=1.0)
        self.l = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
        with torch.no_grad():
            self.e.weight.mul_(3.0)  # every row over max_norm
        self.outs: list[torch.Tensor] = []

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.l(self.e(ids))

    def training_step(self, batch: Any, idx: int) -> torch.Tensor:
        out = self(batch[0])
        if torch.is_grad_enabled():
            self.outs.append(out.detach().clone())
        return out.square().mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> Any:
        ids = torch.randint(0, 20, (24, 6), generator=torch.Generator().manual_seed(5))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=8)


def test_a_forward_writing_a_parameter_trains_as_without_autoremat_under_the_callback(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The callback's own runs of ``training_step`` and its measured steps copy a parameter before the first
    write and put it back (:mod:`autoremat.capture.param_writes`): no change stays, none is warned about."""
    fits = []
    for cb in (None, autoremat.AutoRemat(budget="min", raise_batch_size=False, verbose=False)):
        torch.manual_seed(0)
        lit = _RenormLit()
        with caplog.at_level("WARNING", logger="autoremat"):
            pl.Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                       enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                       callbacks=[] if cb is None else [cb]).fit(lit)
        fits.append(lit)
    ref, pat = fits
    assert len(ref.outs) == len(pat.outs) == 6 and all(torch.equal(a, b) for a, b in zip(ref.outs, pat.outs))
    assert all(torch.equal(a, b) for a, b in zip(ref.state_dict().values(), pat.state_dict().values()))
    assert not [r for r in caplog.records if "changed a parameter" in r.getMessage()]


class _ScaledInputs(pl.LightningModule):
    """A CNN whose ``on_before_batch_transfer`` rescales the images (what a user's hook may do
    before the batch reaches ``training_step``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                                   nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                   nn.Linear(8, 4))
        self.seen: list[torch.dtype] = []

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        x, y = batch
        return x * 4.0, y, torch.ones(len(y))  # the third tensor says the hook ran

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, _ = batch  # raises where on_before_batch_transfer did not run
        self.seen.append(x.dtype)
        return nn.functional.cross_entropy(self.model(x).float(), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> Any:
        g = torch.Generator().manual_seed(3)
        data = torch.utils.data.TensorDataset(torch.randn(16, 3, 16, 16, generator=g), torch.randint(0, 4, (16,), generator=g))
        return torch.utils.data.DataLoader(data, batch_size=8)


def _without_and_with(make: Any, tmp_path: Path, **trainer_kw: Any) -> tuple[Any, Any, autoremat.AutoRemat]:
    """``make()`` fit without and with the callback (least budget, chen), from the same seed: both
    modules and the callback."""
    fits = []
    cb = autoremat.AutoRemat(budget="min", solver=SOLVER, raise_batch_size=False, verbose=False)
    for callbacks in ([], [cb]):
        torch.manual_seed(0)
        lit = make()
        pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, default_root_dir=tmp_path, callbacks=callbacks, **trainer_kw).fit(lit)
        fits.append(lit)
    return fits[0], fits[1], cb


@pytest.mark.parametrize("precision", ["bf16-true", "64-true"])
def test_the_callback_profiles_the_batch_training_step_gets(tmp_path: Path, precision: str) -> None:
    """Under ``bf16-true`` (and ``64-true``) Lightning casts the batch's floating tensors to the
    trainer's dtype, and a module's ``on_before_batch_transfer`` may change the batch: the callback
    profiles what the loop hands ``training_step``, not the dataloader's raw rows (the capture of a
    ``bf16-true`` CNN raised "Input type (torch.FloatTensor) and weight type (CPUBFloat16Type) should
    be the same")."""
    ref, pat, cb = _without_and_with(_ScaledInputs, tmp_path, max_steps=2, precision=precision)
    assert cb.plan is not None and cb.plan.recompute_segments
    dtype = torch.bfloat16 if precision == "bf16-true" else torch.float64
    assert pat.seen == ref.seen == [dtype, dtype]  # what the callback's own runs appended is put back
    assert all(torch.equal(a, b) for a, b in zip(ref.state_dict().values(), pat.state_dict().values()))


class _TwoLoaders(pl.LightningModule):
    """``train_dataloader`` returns a dict of two dataloaders; ``training_step`` gets one batch of each."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(16, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256),
                                   nn.GELU(), nn.Linear(256, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (xa,), (xb,) = batch["a"], batch["b"]
        return self.model(xa).pow(2).mean() + self.model(xb).abs().mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> Any:
        g = torch.Generator().manual_seed(1)
        a = torch.utils.data.TensorDataset(torch.randn(32, 16, generator=g))
        b = torch.utils.data.TensorDataset(torch.randn(24, 16, generator=g))
        return {"a": torch.utils.data.DataLoader(a, batch_size=8), "b": torch.utils.data.DataLoader(b, batch_size=4)}


def test_several_training_dataloaders_are_profiled_as_training_step_gets_them(tmp_path: Path) -> None:
    """A dict of dataloaders (Lightning's ``CombinedLoader``, "max_size_cycle"): the callback profiles a
    batch of each, as the loop hands them (it iterated the dict's keys: "string indices must be integers")."""
    ref, pat, cb = _without_and_with(_TwoLoaders, tmp_path, max_epochs=2)
    assert cb.plan is not None and cb.plan.recompute_segments
    assert all(torch.equal(a, b) for a, b in zip(ref.state_dict().values(), pat.state_dict().values()))


def test_a_callback_reused_after_unfreezing_plans_again(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Fine-tuning in two fits with one callback: the head alone first, then the whole model. The
    plan of the first fit was made with the body frozen (no gradient of its weights, less kept); the
    second fit plans again (it reused the first plan before), puts back the batch size it had, and
    trains as without autoremat; a third fit with nothing changed reuses the second's plan."""
    def fits(callbacks: list) -> _TwoLoaders:
        torch.manual_seed(0)
        lit = _TwoLoaders()
        for stage in range(3):
            for i, p in enumerate(lit.model.parameters()):
                p.requires_grad_(stage > 0 or i >= 4)
            pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                       enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                       callbacks=callbacks).fit(lit)
        return lit

    ref = fits([])
    cb = autoremat.AutoRemat(budget="min", solver=SOLVER, raise_batch_size=False, verbose=False)
    with caplog.at_level("INFO"):
        pat = fits([cb])
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("AutoRemat: ")]
    assert sum("trainable parameters changed" in m for m in said) == 1 and sum("resumed" in m for m in said) == 1
    assert cb.plan is not None and cb.plan.options["trainable_at_planning"]
    assert all(torch.equal(a, b) for a, b in zip(ref.state_dict().values(), pat.state_dict().values()))
