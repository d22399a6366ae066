"""Small models and the equivalence harness of ``tests/test_semantics.py`` (issue 29).

:func:`compare` trains a model and a deep copy of it side by side for a few steps, the copy
patched by autoremat, through train -> eval -> train, and reports the first difference in
outputs, gradients, buffers or RNG state (``torch.equal``), or ``None``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import autoremat
from autoremat.plan import Plan, Segment, module_calls_of

import semantics_models as sm
import semantics_state as ss

W = 16


def _x(*shape: int, seed: int = 7) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


class ModDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.ModuleList(nn.Linear(W, W) for _ in range(3))
        self.d = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in self.l:
            x = self.d(torch.relu(lin(x)))
        return x


class FuncDropout(nn.Module):
    """The issue's example: functional dropout reading ``self.training`` (frozen by fx)."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.ModuleList(nn.Linear(W, W) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in self.l:
            x = F.dropout(torch.relu(lin(x)), 0.3, self.training)
        return x


class Dropout2dAlpha(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3, padding=1)
        self.d2 = nn.Dropout2d(0.25)
        self.a = nn.AlphaDropout(0.2)
        self.c2 = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c2(self.a(self.d2(torch.tanh(self.c(x)))))


class RReLUNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(W, W), nn.Linear(W, W)
        self.r = nn.RReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.r(self.a(x)))


class BatchNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.bn, self.b = nn.Linear(W, W), nn.BatchNorm1d(W), nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.bn(self.a(x))))


class InstanceNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3, padding=1)
        self.n = nn.InstanceNorm2d(4, affine=True, track_running_stats=True)
        self.c2 = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c2(torch.relu(self.n(self.c(x))))


class LSTMNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(W, W)
        self.rnn = nn.LSTM(W, W, batch_first=True, dropout=0.2, num_layers=2)
        self.out = nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.rnn(torch.tanh(self.inp(x)))
        return self.out(y)


class SDPA(nn.Module):
    def __init__(self, dropout: float, train_only: bool = False) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(W, W) for _ in range(4))
        self.p, self.train_only = dropout, train_only

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.p if (self.training or not self.train_only) else 0.0
        a = F.scaled_dot_product_attention(self.q(x), self.k(x), self.v(x), dropout_p=p)
        return self.o(torch.relu(a))


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, W)
        self.mid = nn.Linear(W, W)
        self.head = nn.Linear(W, 20, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.emb(ids))))


class DictOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(W, W), nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = torch.relu(self.a(x))
        return {"h": h, "y": self.b(h)}


class TupleOut(DictOut):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        h = torch.relu(self.a(x))
        return h, torch.sigmoid(self.b(h))


class Kwargs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(W, W), nn.Linear(W, W)

    def forward(self, x: torch.Tensor, *, bias: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
        return self.b(torch.relu(self.a(x) * scale + bias))


class ControlFlow(nn.Module):
    """Python branches on ``self.training`` and on a plain attribute (frozen by an fx trace)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(W, W), nn.Linear(W, W), nn.Linear(W, W)
        self.extra = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        if self.training:
            h = h * 0.5 + torch.tanh(self.c(h))
        return self.b(h)


class SelfCheckpoint(nn.Module):
    """A model checkpointing its own block (reentrant); ``self.frozen`` gets no gradient."""

    def __init__(self, reentrant: bool = True) -> None:
        super().__init__()
        self.a, self.blk, self.b = nn.Linear(W, W), nn.Linear(W, W), nn.Linear(W, W)
        self.reentrant = reentrant

    def _block(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.blk(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        h = checkpoint(self._block, h, use_reentrant=self.reentrant)
        return self.b(h)


class EMA(nn.Module):
    """Custom module updating its own buffer in forward and reading it in arithmetic."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(W))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.mean.copy_(0.9 * self.mean + 0.1 * x.detach().mean(0))
        return x - self.mean


class EMANet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.ema, self.b = nn.Linear(W, W), EMA(), nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.ema(torch.tanh(self.a(x)))))


class Counter(nn.Module):
    """A buffer counting forward calls (an in-place add in forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(W, W), nn.Linear(W, W)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.b(torch.relu(self.a(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.l(x)) + x


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.seq = nn.Sequential(Block(), Block(), Block())
        self.head = nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.seq(x))


@dataclasses.dataclass
class Case:
    """``autocast``: every forward (capture included) under CPU autocast to bfloat16;
    ``mutate``: changes Python state of a model (applied to both, before the second training);
    ``reset``: puts module-level state (globals, closure cells) back before capture and each run."""

    name: str
    make: Callable[[], nn.Module]
    args: Callable[[], tuple[Any, ...]]
    kwargs: Callable[[], dict[str, Any]] = dict
    modes: tuple[str, ...] = ("fx", "module")
    autocast: bool = False
    mutate: Callable[[nn.Module], None] | None = None
    reset: Callable[[], None] | None = None


def _ids() -> tuple[torch.Tensor]:
    return (torch.randint(0, 20, (4, 6), generator=torch.Generator().manual_seed(3)),)


CASES = [
    Case("dropout_module", ModDropout, lambda: (_x(8, W),)),
    Case("dropout_functional_training", FuncDropout, lambda: (_x(8, W),)),
    Case("dropout2d_alpha", Dropout2dAlpha, lambda: (_x(2, 3, 6, 6),)),
    Case("rrelu", RReLUNet, lambda: (_x(8, W),)),
    Case("batchnorm", BatchNormNet, lambda: (_x(8, W),)),
    Case("instancenorm", InstanceNormNet, lambda: (_x(2, 3, 6, 6),)),
    Case("lstm", LSTMNet, lambda: (_x(2, 5, W),)),
    Case("sdpa", lambda: SDPA(0.0), lambda: (_x(2, 5, W),)),
    Case("sdpa_dropout", lambda: SDPA(0.2), lambda: (_x(2, 5, W),)),
    Case("sdpa_dropout_train_only", lambda: SDPA(0.2, train_only=True), lambda: (_x(2, 5, W),)),
    Case("tied_weights", Tied, _ids),
    Case("dict_output", DictOut, lambda: (_x(8, W),)),
    Case("tuple_output", TupleOut, lambda: (_x(8, W),)),
    Case("kwargs", Kwargs, lambda: (_x(8, W),), lambda: {"bias": _x(W, seed=9)}),
    Case("control_flow_training", ControlFlow, lambda: (_x(8, W),)),
    Case("self_checkpoint_reentrant", SelfCheckpoint, lambda: (_x(8, W),)),
    Case("self_checkpoint_nonreentrant", lambda: SelfCheckpoint(False), lambda: (_x(8, W),)),
    Case("ema_buffer", EMANet, lambda: (_x(8, W),)),
    Case("counter_buffer", Counter, lambda: (_x(8, W),)),
    Case("blocks", Blocks, lambda: (_x(8, W),)),
    Case("dataclass_output", sm.DataclassOut, lambda: (_x(8, W),)),
    Case("kwargs_only", sm.KwargsOnly, tuple, lambda: {"x": _x(8, W), "mask": (_x(8, W, seed=5) > 0).float()}),
    Case("amp_bf16", sm.AmpNet, lambda: (_x(8, W),), autocast=True),
    Case("amp_inside_forward", sm.AmpInside, lambda: (_x(8, W),)),
    Case("noise_gumbel_normal", sm.Noise, lambda: (_x(8, W),)),
    Case("dropout_rate_changed", sm.DropoutRate, lambda: (_x(8, W),), mutate=sm.change_rate),
    Case("dropout1d_feature_alpha", sm.FeatureDropouts, lambda: (_x(4, 4, 10),)),
    Case("batchnorm_cumulative", sm.BatchNormCumulative, lambda: (_x(3, 3, 6, 6),)),
    Case("gru_bidirectional", sm.GRUNet, lambda: (_x(3, 5, W),)),
    Case("transformer_encoder_layer", sm.EncoderLayer, lambda: (_x(3, 5, W),)),
    Case("multihead_attention", sm.MHA, lambda: (_x(3, 5, W),)),
    Case("partly_frozen", sm.PartlyFrozen, lambda: (_x(8, W),)),
    Case("shared_module", sm.SharedModule, lambda: (_x(8, W),)),
    Case("weight_norm", sm.WeightNorm, lambda: (_x(8, W),)),
    Case("spectral_norm", sm.SpectralNorm, lambda: (_x(8, W),)),
    Case("custom_autograd_function", sm.CustomFunction, lambda: (_x(8, W),)),
    Case("container_values_changed", sm.ContainerAttrs, lambda: (_x(8, W),), mutate=sm.change_values),
    Case("container_branch_changed", sm.ContainerAttrs, lambda: (_x(8, W),), mutate=sm.change_branch),
    Case("tensor_attribute_replaced", sm.TensorAttr, lambda: (_x(8, W),), mutate=sm.replace_mask),
    Case("string_attribute_routes", sm.Routed, lambda: (_x(8, W),), mutate=sm.switch_task),
    Case("loss_inside_forward", sm.LossInside, lambda: (_x(8, W),),
         lambda: {"labels": torch.randint(0, 5, (8,), generator=torch.Generator().manual_seed(4))}),
    Case("mixed_output", sm.MixedOut, lambda: (_x(8, W),)),
    Case("self_checkpoint_dropout", sm.SelfCheckpointDropout, lambda: (_x(8, W),)),
    Case("batchnorm_frozen_midway", BatchNormNet, lambda: (_x(8, W),), mutate=sm.freeze_batchnorm),
    Case("unfrozen_midway", sm.PartlyFrozen, lambda: (_x(8, W),), mutate=sm.unfreeze),
    Case("parameter_and_head_replaced", sm.FunctionalWeight, lambda: (_x(8, W),), mutate=sm.replace_parameter_and_head),
    Case("other_object_value_changed", ss.OtherObject, lambda: (_x(8, W),), mutate=ss.change_config_value),
    Case("other_object_branch_changed", ss.OtherObject, lambda: (_x(8, W),), mutate=ss.change_config_branch),
    Case("shared_object_changed", ss.Shared, lambda: (_x(8, W),), mutate=ss.change_shared),
    Case("global_values_changed", ss.GlobalFlags, lambda: (_x(8, W),), mutate=ss.change_global_values,
         reset=ss.reset),
    Case("global_flag_changed", ss.GlobalFlags, lambda: (_x(8, W),), mutate=ss.change_global_branch, reset=ss.reset),
    Case("closure_value_changed", ss.ClosureFlags, lambda: (_x(8, W),), mutate=ss.change_cell_value, reset=ss.reset),
    Case("closure_flag_changed", ss.ClosureFlags, lambda: (_x(8, W),), mutate=ss.change_cell_branch, reset=ss.reset),
    Case("class_default_value_overridden", ss.ClassDefaults, lambda: (_x(8, W),), mutate=ss.override_default_value),
    Case("class_default_branch_overridden", ss.ClassDefaults, lambda: (_x(8, W),),
         mutate=ss.override_default_branch),
    Case("fx_tracing_branch", ss.FxTracingBranch, lambda: (_x(8, W),)),
]


def _handmade(graph: autoremat.Graph, kind: str) -> autoremat.Plan:
    """``prefix``: the first half of the nodes (a lower set: ids are topological) in one recomputed
    segment; ``each``: every recomputable node its own recomputed segment."""
    base = autoremat.solve(graph, "100%", solver="none")
    nodes = sorted(graph.nodes)
    ok = {v for v in nodes if graph.node(v)["recomputable"]}
    if kind == "prefix" and graph.meta["mode"] == "fx":
        half = max(1, len(nodes) // 2)
        segs = [Segment(tuple(nodes[:half]), True), Segment(tuple(nodes[half:]), False)]
    else:
        segs = [Segment((v,), v in ok) for v in nodes]
    plan = Plan(segs, solver=f"test-{kind}", options=dict(base.options), graph_mode=base.graph_mode,
                node_names=base.node_names, tensors=base.tensors, inputs=base.inputs,
                graph_fingerprint=graph.fingerprint)
    plan.module_calls = module_calls_of(graph, plan)  # a module run twice: each call named (runtime.per_call)
    return plan


def plan_for(graph: autoremat.Graph, solver: str, budget: Any) -> autoremat.Plan:
    if solver == "none":
        return autoremat.solve(graph, "100%", solver="none")
    if solver in ("prefix", "each"):
        return _handmade(graph, solver)
    try:
        return autoremat.solve(graph, budget, solver=solver)
    except autoremat.InfeasibleBudgetError as err:
        return autoremat.solve(graph, err.min_budget_bytes, solver=solver)


def _flat(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return [t for f in dataclasses.fields(out) for t in _flat(getattr(out, f.name))]
    if isinstance(out, dict):
        return [t for k in sorted(out) for t in _flat(out[k])]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _flat(o)]
    return []


def _loss(out: Any) -> torch.Tensor:
    return sum((t.float().sin().mean() for t in _flat(out) if t.is_floating_point()), torch.zeros(()))


def _state(model: nn.Module) -> dict[str, Any]:
    d: dict[str, Any] = {f"buf:{n}": b.clone() for n, b in model.named_buffers()}
    d.update({f"param:{n}": p.detach().clone() for n, p in model.named_parameters()})
    d.update({f"grad:{n}": None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()})
    return d


def _diff(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    for k in a:
        x, y = a[k], b.get(k)
        if (x is None) != (y is None):
            return f"{k}: {'None' if x is None else 'tensor'} vs {'None' if y is None else 'tensor'}"
        if x is not None and (x.dtype != y.dtype or not torch.equal(x, y)):
            return f"{k} differs (max {(x.float() - y.float()).abs().max().item():.3g})"
    return None


PHASES = ("train", "train", "eval", "train", "train_small", "eval_small", "no_grad")
"""Three training steps, three more, one evaluation, (``Case.mutate``), three more training steps,
then a smaller batch (an epoch's last batch: exact at any batch size) in training and in eval,
and a forward under ``no_grad``."""


def rows(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The batch cut to about 2/3 of its rows (every tensor whose first dimension is the batch's)."""
    first = next(t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor))
    n = first.shape[0]
    keep = max(1, n * 2 // 3)

    def cut(t: Any) -> Any:
        return t[:keep] if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == n else t

    return tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}


def _amp(case: Case) -> Any:
    return torch.autocast("cpu", dtype=torch.bfloat16) if case.autocast else contextlib.nullcontext()


def run_phases(model: nn.Module, case: Case, steps: int = 3) -> list[Any]:
    """Per step: phase, outputs, state after the step, RNG state."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if case.reset is not None:
        case.reset()
    torch.manual_seed(1234)
    record: list[Any] = []
    full = case.args(), case.kwargs()
    small = rows(*full)
    for i, phase in enumerate(PHASES):
        if i == 3 and case.mutate is not None:
            case.mutate(model)
        model.train(phase.startswith("train"))
        args, kwargs = small if phase.endswith("_small") else full
        for _ in range(steps if phase in ("train",) else 1):
            if phase == "no_grad":
                with torch.no_grad(), _amp(case):
                    out = model(*args, **kwargs)
            else:
                opt.zero_grad(set_to_none=True)
                with _amp(case):
                    out = model(*args, **kwargs)
                if phase.startswith("train"):
                    _loss(out).backward()
                    opt.step()
            record.append((phase, [o.detach().clone() for o in _flat(out)], _state(model), torch.get_rng_state()))
    return record


def compare(case: Case, mode: str, solver: str, budget: Any = None, regions: str = "lean") -> str | None:
    """The first difference between the unpatched and the patched model, or ``None``."""
    torch.manual_seed(0)
    if case.reset is not None:
        case.reset()
    ref = case.make()
    pat = copy.deepcopy(ref)
    with _amp(case):
        graph = autoremat.capture(pat, case.args(), case.kwargs(), mode=mode, repeats=1, warmup=0)
    plan = plan_for(graph, solver, budget)
    autoremat.apply(pat, plan, regions=regions)
    try:
        want, got = run_phases(ref, case), run_phases(pat, case)
    finally:
        autoremat.restore(pat)
        if case.reset is not None:
            case.reset()
    for i, ((phase, wo, ws, wr), (_, go, gs, gr)) in enumerate(zip(want, got)):
        if len(wo) != len(go) or any(a.dtype != b.dtype or not torch.equal(a, b) for a, b in zip(wo, go)):
            return f"step {i} ({phase}): outputs differ"
        d = _diff(ws, gs)
        if d:
            return f"step {i} ({phase}): {d}"
        if not torch.equal(wr, gr):
            return f"step {i} ({phase}): RNG state differs"
    return None


# ---------------------------------------------------------------------- through the Lightning callback
def lightning_module(traceable: bool) -> nn.Module:
    """A LightningModule (its own forward is the model: dropout, batch norm) that records every
    output of ``training_step`` and ``validation_step``. ``traceable=False`` adds a data-dependent
    branch, which fx cannot trace: the callback then captures at module level."""
    import lightning.pytorch as pl

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.bn, self.b = nn.Linear(W, W), nn.BatchNorm1d(W), nn.Linear(W, W)
            self.d = nn.Dropout(0.3)
            self.traceable = traceable
            self.recorded: list[tuple[str, torch.Tensor]] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.d(torch.relu(self.bn(self.a(x))))
            if not self.traceable and bool(h.sum() < -1e9):
                h = -h
            return self.b(h)

        def training_step(self, batch: Any, idx: int) -> torch.Tensor:
            out = self(batch[0])
            if torch.is_grad_enabled():  # the callback's recording call runs without gradients
                self.recorded.append(("train", out.detach().clone()))
            return F.mse_loss(out, batch[1])

        def validation_step(self, batch: Any, idx: int) -> None:
            self.recorded.append(("val", self(batch[0]).detach().clone()))

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self) -> Any:  # 20 rows in batches of 8: the epoch's last batch has 4
            data = torch.utils.data.TensorDataset(_x(20, W, seed=11), _x(20, W, seed=12))
            return torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)

        def val_dataloader(self) -> Any:
            data = torch.utils.data.TensorDataset(_x(12, W, seed=13), _x(12, W, seed=14))
            return torch.utils.data.DataLoader(data, batch_size=8)

    return Lit()


def fit_lightning(traceable: bool, callback: Any, root: Any) -> tuple[nn.Module, torch.Tensor]:
    """Two epochs (3 training batches, 2 validation batches each, validation before training as
    Lightning's sanity check); the module and the RNG state after the fit."""
    import lightning.pytorch as pl

    torch.manual_seed(0)
    lit = lightning_module(traceable)
    pl.Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
               callbacks=[] if callback is None else [callback]).fit(lit)
    return lit, torch.get_rng_state()


def compare_lightning(traceable: bool, callback: Any, root: Any) -> str | None:
    """The first difference between a fit without and with ``callback``, or ``None``."""
    (want, wr), (got, gr) = fit_lightning(traceable, None, root), fit_lightning(traceable, callback, root)
    if [k for k, _ in want.recorded] != [k for k, _ in got.recorded]:
        return "other steps ran"
    for i, ((kind, a), (_, b)) in enumerate(zip(want.recorded, got.recorded)):
        if not torch.equal(a, b):
            return f"output {i} ({kind}) differs"
    d = _diff(_state(want), _state(got))
    if d:
        return d
    return None if torch.equal(wr, gr) else "RNG state differs"
