"""autoremat against what a PyTorch user would pick instead, on the same model, batch and machine.

    python benchmarks/compare.py                                  # full CPU run, ~25 min on 2 cores
    python benchmarks/compare.py --models resnet50,gpt2 --rounds 3
    python benchmarks/compare.py --quick --out /tmp/compare       # smoke mode: one tiny model, 1 round
    python benchmarks/compare.py --batch-only                     # only the largest-batch section, merged
                                                                  # into the existing compare.json

For every model (zoo ``resnet50``, ``densenet121``, ``unet`` at CPU size, and a transformers GPT-2
from a small config with random weights and tokens) each configuration runs on a fresh deepcopy of
the same model and the same batch:

* ``none``: no checkpointing (the reference);
* ``block-ac``: per-block full checkpointing as Lightning's FSDP strategy and Accelerate do it
  (``apply_activation_checkpointing`` with a non-reentrant ``checkpoint_wrapper`` on every block);
* ``block-sac``: the same blocks under selective activation checkpointing that saves the outputs
  of ``aten.mm``/``addmm``/``bmm``/``convolution`` and recomputes the rest;
* ``compile@B``: ``torch.compile`` with ``torch._functorch.config.activation_memory_budget = B``
  (1.0, 0.75, 0.5, 0.25); compile time is reported apart from step time;
* ``ckpt-seq``: ``torch.utils.checkpoint.checkpoint_sequential`` where the model is a sequence;
* ``save-on-cpu``: ``torch.autograd.graph.save_on_cpu`` (everything saved is copied to the host;
  on a CPU-only machine that is a copy in the same memory);
* ``autoremat:<solver>@<f>``: autoremat with every registered solver at budgets of 75 %, 50 % and
  30 % of the measured unoptimised step peak, and ``autoremat:<solver>@match`` at the lowest step
  peak an eager PyTorch option measured (equal-peak comparison; ``--no-match`` leaves it out);
* ``autoremat:<solver>@<f>+torch-regions``: the same plan as ``autoremat:<solver>@<f>`` run with
  ``apply(..., regions="torch")`` (``torch.utils.checkpoint`` regions instead of autoremat's own),
  for ``--torch-regions`` (default ``dp-approx@0.5``; ``none`` leaves it out);
* ``autoremat:<solver>@<f>+compile``: the patched model under ``torch.compile`` (``--compile-backend``,
  ``activation_memory_budget`` 1.0): each recomputed region is traced as PyTorch's checkpoint
  operator and the compiled backward recomputes it; for ``--compiled-plans`` (default
  ``dp-approx@0.5,dp-approx@0.3``: where the 30 % plan exists it shows how far below compile's own
  lowest peak a plan takes a compiled model; ``none`` leaves it out). Its peak is measured, not predicted: the simulator
  models eager PyTorch.

Metrics: the measured step peak (``autoremat.measure``: a live-storage counter on the CPU, the
caching allocator on CUDA), the median step time with all configurations of a model interleaved
round-robin over ``--rounds`` rounds in one process (so machine drift hits all of them alike),
ratios of both to ``none``, for autoremat the predicted peak, prediction error and solver time, and
a gradient check against ``none`` (``torch.equal``; ``torch.compile`` may differ numerically, so its
rows report the largest absolute difference). Then the largest batch that fits one fixed memory
budget: autoremat's ``AutoRemat(raise_batch_size=True, budget=<bytes>)`` against Lightning's
``BatchSizeFinder(mode="binsearch")`` on ``LitClassifier`` (resnet50) and ``LitGPT2``, the budget
enforced by a simulated out-of-memory (see ``SimulatedDevice``).

Writes ``compare.json``, ``RESULTS.md`` and ``compare_<model>.png`` under ``--out``
(default ``benchmarks/results/cpu``). ``benchmarks/compare_gpu.py`` runs the same on a CUDA GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import inspect
import json
import math
import multiprocessing
import os
import platform
import signal
import statistics
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

import autoremat
from autoremat.measure import LiveStorageCounter, measure
from autoremat.resident import resident_bytes as _resident_bytes
from autoremat.resident import storage_bytes

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "cpu"

DEFAULT_MODELS = ("resnet50", "densenet121", "unet", "gpt2")
QUICK_MODELS = ("mlp",)
COMPILE_BUDGETS = (1.0, 0.75, 0.5, 0.25)
AUTOREMAT_BUDGETS = (0.75, 0.5, 0.3)
GPT2_SMALL = {"n_layer": 4, "n_embd": 64, "n_head": 4, "vocab_size": 256, "n_positions": 64}
GPT2_PAPER = {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257, "n_positions": 1024}
GRAD_SEED = 1234
SAC_SAVED_OPS = ("mm", "addmm", "bmm", "convolution")
"""aten ops whose outputs selective checkpointing saves (everything else is recomputed)."""

ROW_FIELDS = (
    "model", "config", "family", "label", "status", "error", "note",
    "measured_peak_bytes", "peak_ratio", "step_time_s", "time_ratio", "step_times_s",
    "gradients_equal", "grad_max_abs_diff",
    "compile_budget", "compile_backend", "compile_s",
    "solver", "budget_fraction", "budget_bytes", "meets_budget", "predicted_peak_bytes",
    "prediction_error", "solver_time_s", "min_budget_bytes", "segments", "recomputed",
)
"""Every configuration row carries these keys (``None`` where a field does not apply)."""

BATCH_METHODS = ("autoremat", "batchsizefinder")
BATCH_FIELDS = (
    "task", "method", "status", "error", "budget_bytes", "resident_bytes", "initial_batch_size",
    "batch_size", "largest_trained_batch", "confirmed", "confirm_peak_bytes", "search_s", "note",
    "step_budget_bytes", "predicted_overhead",
)


# ---------------------------------------------------------------------------------------- workloads
@dataclass
class Workload:
    """One model, its batch and its loss, plus what the PyTorch options need to know about it."""

    name: str
    model: nn.Module
    args: tuple
    loss_fn: Callable[[Any], torch.Tensor]
    block_types: tuple[type, ...]
    block_note: str
    sequential: Callable[[nn.Module], list[nn.Module]] | None
    not_sequential: str | None
    description: str
    batch: int
    copy_list_args: bool = False
    """DenseNet: a dense layer takes its block's growing feature list (see runner_block_ac)."""

    @property
    def has_dropout(self) -> bool:
        if any(isinstance(m, nn.Dropout) and m.p > 0 for m in self.model.modules()):
            return True
        cfg = getattr(self.model, "config", None)  # transformers: attention dropout inside SDPA
        return bool(cfg is not None and getattr(cfg, "attn_pdrop", 0))


def _output_mean(out: torch.Tensor) -> torch.Tensor:
    return out.float().mean()


def _logits_mean(out: Any) -> torch.Tensor:
    return out.logits.float().mean()


def _resnet_seq(m: nn.Module) -> list[nn.Module]:
    return [m.stem, *m.layer1, *m.layer2, *m.layer3, *m.layer4, m.head]


def _densenet_seq(m: nn.Module) -> list[nn.Module]:
    return [*m.features, m.avgpool, nn.Flatten(1), m.classifier]


def _mlp_seq(m: nn.Module) -> list[nn.Module]:
    return list(m.layers)


def _zoo_traits(name: str) -> tuple[tuple[type, ...], str, Callable | None, str | None]:
    import importlib

    # importlib: the zoo package re-exports builder functions named like some of its modules
    resnet, densenet, transformer, unet = (importlib.import_module(f"autoremat.zoo.{m}")
                                           for m in ("resnet", "densenet", "transformer", "unet"))

    if name.startswith("resnet"):
        return ((resnet.Bottleneck,), "Bottleneck", _resnet_seq,
                None)
    if name.startswith("densenet"):
        return ((densenet.DenseLayer,), "DenseLayer", _densenet_seq, None)
    if name == "unet":
        return ((unet._DoubleConv,), "_DoubleConv (two 3x3 conv + ReLU)", None,
                "U-Net's skip connections (each contracting level feeds the expanding path) make it a DAG, "
                "not a sequence")
    if name == "mlp":
        return ((nn.Linear,), "Linear", _mlp_seq, None)
    if name == "transformer":
        return ((transformer.Block,), "Block", None, "token + position embeddings are added before the blocks")
    return ((), "", None, f"no sequential form of {name} is defined here")


def build_workload(name: str, *, size: str = "small", batch: int | None = None,
                   device: str | torch.device = "cpu") -> Workload:
    """The model ``name`` (a zoo name or ``"gpt2"``) with its batch, at ``size``."""
    device = torch.device(device)
    if name == "gpt2":
        import transformers
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        shape = GPT2_SMALL if size == "small" else GPT2_PAPER
        cfg = transformers.GPT2Config(**shape, use_cache=False, bos_token_id=0, eos_token_id=0)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = transformers.GPT2LMHeadModel(cfg)
        model = model.to(device).train()
        b = batch or (4 if size == "small" else 8)
        ids = torch.randint(0, cfg.vocab_size, (b, cfg.n_positions), generator=torch.Generator().manual_seed(1))
        desc = (f"transformers GPT2LMHeadModel (n_layer={cfg.n_layer}, n_embd={cfg.n_embd}, n_head={cfg.n_head}, "
                f"vocab={cfg.vocab_size}), random weights, {b}x{cfg.n_positions} random tokens, "
                "loss = logits.float().mean()")
        return Workload("gpt2", model, (ids.to(device),), _logits_mean, (GPT2Block,), "GPT2Block", None,
                        "GPT2Model is not a sequence of modules (embeddings, position ids and the attention mask are "
                        "computed between them)", desc, b)
    model, args = autoremat.zoo.build(name, size=size, batch_size=batch, device=device)
    blocks, note, seq, why = _zoo_traits(name)
    x = args[0]
    desc = f"zoo {name} ({size} size), batch {tuple(x.shape)}, loss = output.float().mean()"
    return Workload(name, model, tuple(args), _output_mean, blocks, note, seq, why, desc, int(x.shape[0]),
                    copy_list_args=name.startswith("densenet"))


# ---------------------------------------------------------------------------------------- runners
class NotApplicable(Exception):
    """A configuration that does not apply to a model (the reason is the message)."""


@dataclass
class Runner:
    """One configuration ready to step: ``forward(*args)`` on ``model``'s parameters."""

    key: str
    family: str
    label: str
    model: nn.Module
    forward: Callable[..., Any]
    row: dict[str, Any] = field(default_factory=dict)
    compiled: bool = False

    def step(self, args: Sequence[Any], loss_fn: Callable[[Any], torch.Tensor]) -> torch.Tensor:
        self.model.zero_grad(set_to_none=True)
        loss = loss_fn(self.forward(*args))
        loss.backward()
        return loss.detach()


class _Step(nn.Module):
    """``measure`` wants an ``nn.Module``: this one owns the runner's parameters and calls its forward."""

    def __init__(self, runner: Runner) -> None:
        super().__init__()
        self.inner = runner.model
        object.__setattr__(self, "_fwd", runner.forward)  # not a submodule (it may be a compiled wrapper)

    def forward(self, *args: Any) -> Any:
        return self._fwd(*args)


def _copy(w: Workload) -> nn.Module:
    return copy.deepcopy(w.model)


def runner_none(w: Workload) -> Runner:
    m = _copy(w)
    return Runner("none", "baseline", "no checkpointing", m, m)


def _wrap_blocks(w: Workload, m: nn.Module, **checkpoint_kwargs: Any) -> int:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    if not w.block_types:
        raise NotApplicable(f"no block type is known for {w.name}")
    n = sum(isinstance(mod, w.block_types) for mod in m.modules())
    if w.copy_list_args:
        checkpoint_kwargs["checkpoint_fn"] = _checkpoint_copying_lists
    apply_activation_checkpointing(
        m,
        checkpoint_wrapper_fn=partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                      **checkpoint_kwargs),
        check_fn=lambda mod: isinstance(mod, w.block_types),
    )
    return n


def _checkpoint_copying_lists(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """``checkpoint(fn, *args, use_reentrant=False)`` with list arguments shallow-copied.

    Non-reentrant checkpoint keeps a reference to each argument for the recomputation; a DenseNet
    dense layer gets its block's list of features, which the block keeps appending to, so by
    backward the recomputation would concatenate more features than the forward did (BatchNorm
    then fails: "running_mean should contain 128 elements not 124"). Copying the list freezes it.
    """
    from torch.utils.checkpoint import checkpoint

    args = tuple(list(a) if isinstance(a, list) else a for a in args)
    return checkpoint(fn, *args, use_reentrant=False, **kwargs)


_LIST_NOTE = ("; the dense layer takes its block's growing feature list, which plain non-reentrant checkpoint holds "
              "by reference, so the recomputation in backward fails (\"running_mean should contain 128 elements not "
              "124\"): the checkpoint_fn here passes a copy of the list")


def runner_block_ac(w: Workload) -> Runner:
    m = _copy(w)
    n = _wrap_blocks(w, m)
    return Runner("block-ac", "pytorch", "per-block checkpoint (apply_activation_checkpointing)", m, m,
                  row={"note": f"{n} x {w.block_note} wrapped in checkpoint_wrapper(NO_REENTRANT), as Lightning's "
                               "FSDP strategy / Accelerate do" + (_LIST_NOTE if w.copy_list_args else "")})


def sac_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """Selective checkpointing policy: save matmul and convolution outputs, recompute the rest."""
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in _sac_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def _sac_ops() -> set:
    return {getattr(torch.ops.aten, name).default for name in SAC_SAVED_OPS}


def runner_block_sac(w: Workload) -> Runner:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    m = _copy(w)
    n = _wrap_blocks(w, m, context_fn=partial(create_selective_checkpoint_contexts, sac_policy))
    return Runner("block-sac", "pytorch", "per-block selective checkpoint (save mm/conv outputs)", m, m,
                  row={"note": f"{n} x {w.block_note}: checkpoint(use_reentrant=False, context_fn="
                               "create_selective_checkpoint_contexts(policy)); the policy saves "
                               + "/".join(f"aten.{o}" for o in SAC_SAVED_OPS) + " outputs"
                               + (_LIST_NOTE if w.copy_list_args else "")})


def runner_ckpt_seq(w: Workload) -> Runner:
    from torch.utils.checkpoint import checkpoint_sequential

    if w.sequential is None:
        raise NotApplicable(f"not a sequential model: {w.not_sequential}")
    m = _copy(w)
    fns = w.sequential(m)
    segments = max(2, round(math.sqrt(len(fns))))

    def forward(x: torch.Tensor) -> torch.Tensor:
        return checkpoint_sequential(fns, segments, x, use_reentrant=False)

    return Runner("ckpt-seq", "pytorch", f"checkpoint_sequential ({segments} segments)", m, forward,
                  row={"note": f"{len(fns)} modules in {segments} segments (~sqrt(n)); the last segment is not "
                               "checkpointed"})


def runner_save_on_cpu(w: Workload, device: torch.device) -> Runner:
    m = _copy(w)
    pin = device.type == "cuda"

    def forward(*args: Any) -> Any:
        with torch.autograd.graph.save_on_cpu(pin_memory=pin):
            return m(*args)

    note = ("every saved tensor copied to pinned host memory, copied back in backward" if pin else
            "CPU-only machine: every saved tensor is copied into (the same) host memory, so this shows the cost of "
            "the copies, not a saving")
    return Runner("save-on-cpu", "pytorch", "save_on_cpu (offload all saved tensors)", m, forward, row={"note": note})


class CompileBackend:
    """A ``torch.compile`` backend that compiles under one ``activation_memory_budget``.

    Each configuration gets its own backend object, so Dynamo keeps a separate cache entry per
    configuration (it checks the backend before reusing a compiled frame) and a recompilation can
    never pick up another configuration's budget. (Inductor's ``fallback_random``, which would make
    dropout draw from the eager generator, is left off: with it, budgets below 1.0 fail to lower on
    models with dropout, "should be handled in replace_random.py", torch 2.13.)
    """

    def __init__(self, budget: float, backend: str) -> None:
        self.budget = float(budget)
        self.backend = backend
        self.compile_s = 0.0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        import torch._functorch.config as functorch_config

        t0 = time.perf_counter()
        try:
            with functorch_config.patch(activation_memory_budget=self.budget):
                if self.backend == "inductor":
                    from torch._inductor.compile_fx import compile_fx

                    return compile_fx(gm, example_inputs)
                from torch._dynamo.backends.registry import lookup_backend

                return lookup_backend(self.backend)(gm, example_inputs)
        finally:
            self.compile_s += time.perf_counter() - t0


def runner_compile(w: Workload, budget: float, backend: str) -> Runner:
    m = _copy(w)
    be = CompileBackend(budget, backend)
    cm = torch.compile(m, backend=be)
    r = Runner(f"compile@{budget:g}", "compile", f"torch.compile, activation_memory_budget={budget:g}", m, cm,
               compiled=True)
    r.row.update(compile_budget=budget, compile_backend=backend)
    if w.has_dropout:
        r.row["note"] = ("the model has dropout and Inductor draws its own random numbers, so the gradient difference "
                         "includes different dropout masks, not only rounding")
    r.row["_backend"] = be
    return r


def runner_autoremat(w: Workload, plan: autoremat.Plan, solver: str, fraction: float, tag: str | None = None,
                     regions: str = "lean", compile_backend: str | None = None) -> Runner:
    """``tag`` names the budget in the key instead of the fraction (``"match"``: see ``MATCH_TAG``);
    ``regions="torch"`` runs the plan on ``torch.utils.checkpoint`` regions (key ``+torch-regions``);
    ``compile_backend``: the patched model under ``torch.compile`` (key ``+compile``; its regions are
    traced as the checkpoint higher-order op, ``activation_memory_budget`` left at 1.0)."""
    m = _copy(w)
    autoremat.apply(m, plan, regions=regions)
    name = tag or f"{fraction:g}"
    label = f"autoremat {solver} @ " + (f"{tag} ({fraction:.0%})" if tag else f"{fraction:.0%}")
    if compile_backend is not None:
        be = CompileBackend(1.0, compile_backend)
        r = Runner(f"autoremat:{solver}@{name}{COMPILED}", "autoremat", label + f", torch.compile ({compile_backend})",
                   m, torch.compile(m, backend=be), compiled=True)
        r.row["_backend"] = be
        return r
    if regions == "torch":
        return Runner(f"autoremat:{solver}@{name}{TORCH_REGIONS}", "autoremat",
                      label + ", torch.utils.checkpoint regions", m, m)
    return Runner(f"autoremat:{solver}@{name}", "autoremat", label, m, m)


TORCH_REGIONS = "+torch-regions"
COMPILED = "+compile"


MATCH_TAG = "match"
"""``autoremat:<solver>@match``: the budget is the lowest step peak an eager PyTorch option
(per-block, selective, sequential checkpointing, save_on_cpu) measured on this model, so that the
step times compare at equal peak (the first target of issue 6)."""


# ---------------------------------------------------------------------------------------- measuring
class CompileAwareCounter(LiveStorageCounter):
    """The live-storage counter, left on while compiled code runs.

    Dynamo falls back to eager under a user ``TorchDispatchMode``; a mode that ignores compile
    internals is switched off while compiling and on while the compiled artefacts run. Inductor's
    CPU wrapper allocates its buffers with ``torch._C._dynamo.guards._empty_strided_cpu``, which
    bypasses the dispatcher; :func:`counted_inductor_buffers` routes it through
    ``torch.empty_strided`` so those buffers are counted too.
    """

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


@contextlib.contextmanager
def counted_inductor_buffers() -> Iterator[None]:
    """Make Inductor's CPU buffer allocations visible to dispatch modes (see CompileAwareCounter).

    Generated wrapper modules bind ``empty_strided_cpu = torch._C._dynamo.guards._empty_strided_cpu``
    (a C function that bypasses the dispatcher) as a module global; for the duration of the block
    that global is swapped, in every loaded module, for a function calling ``torch.empty_strided``.
    Only the peak measurement runs inside: timed steps keep the C function (the swap costs a few
    microseconds per buffer).
    """
    from torch._inductor.codecache import PyCodeCache

    original = torch._C._dynamo.guards._empty_strided_cpu

    def empty_strided_cpu(size: Any, stride: Any, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty_strided(size, stride, dtype=dtype, device="cpu")

    mods = {id(m): m for m in [*PyCodeCache.modules, *PyCodeCache.modules_no_attr.values()]
            if getattr(m, "empty_strided_cpu", None) is original}
    for m in mods.values():
        m.empty_strided_cpu = empty_strided_cpu
    try:
        yield
    finally:
        for m in mods.values():
            m.empty_strided_cpu = original


class _Timeout(BaseException):
    """Raised by the alarm in :func:`time_limit` (a BaseException, so no ``except Exception`` eats it)."""


@contextlib.contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Interrupt the block after ``seconds`` (main thread only; otherwise no limit)."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    outer_left, outer_interval = signal.getitimer(signal.ITIMER_REAL)  # e.g. pytest-timeout's alarm
    if outer_left and outer_left <= seconds:  # the outer alarm fires first anyway
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise _Timeout(f"did not finish within {seconds:g} s")

    old = signal.signal(signal.SIGALRM, handler)
    t0 = time.monotonic()
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        if outer_left:
            signal.setitimer(signal.ITIMER_REAL, max(1e-3, outer_left - (time.monotonic() - t0)), outer_interval)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_step(r: Runner, w: Workload, device: torch.device) -> float:
    """Wall time of one step (CUDA events on a GPU)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        r.step(w.args, w.loss_fn)
        end.record()
        torch.cuda.synchronize(device)
        s = start.elapsed_time(end) / 1e3
    else:
        t0 = time.perf_counter()
        r.step(w.args, w.loss_fn)
        s = time.perf_counter() - t0
    r.model.zero_grad(set_to_none=True)  # untimed: many configurations share the device
    return s


def measure_peak(r: Runner, w: Workload, device: torch.device) -> int:
    """Step peak of one configuration (it has run at least once before)."""
    if r.compiled and device.type != "cuda":
        r.model.zero_grad(set_to_none=True)
        counter = CompileAwareCounter()
        with counted_inductor_buffers(), counter:
            r.step(w.args, w.loss_fn)
        r.model.zero_grad(set_to_none=True)
        return int(counter.peak)
    return int(measure(_Step(r), w.args, loss_fn=w.loss_fn, steps=1, warmup=0).peak_bytes)


def _param_name(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


@contextlib.contextmanager
def deterministic(device: torch.device) -> Iterator[None]:
    """On CUDA, deterministic kernels for the gradient check (cuDNN and atomics otherwise reorder sums)."""
    if device.type != "cuda":
        yield
        return
    was = torch.are_deterministic_algorithms_enabled()
    warn = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True):
            yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn)


def grads_of(r: Runner, w: Workload) -> dict[str, torch.Tensor | None]:
    """Parameter gradients of one step from a fixed RNG state (dropout masks alike in every config)."""
    device = w.args[0].device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), deterministic(device):
        torch.manual_seed(GRAD_SEED)
        r.step(w.args, w.loss_fn)
    out = {_param_name(n): (None if p.grad is None else p.grad.detach().clone()) for n, p in r.model.named_parameters()}
    r.model.zero_grad(set_to_none=True)
    return out


def compare_grads(ref: dict[str, torch.Tensor | None], got: dict[str, torch.Tensor | None]) -> tuple[bool, float]:
    """(bit-for-bit equal, largest absolute difference)."""
    if ref.keys() != got.keys():
        return False, math.inf
    equal, diff = True, 0.0
    for k, a in ref.items():
        b = got[k]
        if (a is None) != (b is None):
            return False, math.inf
        if a is None:
            continue
        if a.dtype != b.dtype or a.shape != b.shape:
            return False, math.inf
        if not torch.equal(a, b):
            equal = False
            diff = max(diff, float((a.double() - b.double()).abs().max()))
    return equal, diff


# ---------------------------------------------------------------------------------------- solving
def solve_limited(graph: autoremat.Graph, budget_bytes: int, solver: str, timeout_s: float | None
                  ) -> tuple[str, Any, float]:
    """``("ok", plan, s)``, ``("infeasible", min_budget_bytes, s)``, ``("timeout", None, s)`` or
    ``("error", text, s)``. With a timeout the solver runs in a forked child that is killed when
    time runs out (solvers are pure Python over the graph)."""
    def run() -> tuple[str, Any, float]:
        t0 = time.perf_counter()
        try:
            plan = autoremat.solve(graph, int(budget_bytes), solver=solver)
            return "ok", plan.to_dict(), time.perf_counter() - t0
        except autoremat.InfeasibleBudgetError as err:
            return "infeasible", err.min_budget_bytes, time.perf_counter() - t0
        except Exception as err:  # noqa: BLE001 - recorded in the results
            return "error", f"{type(err).__name__}: {err}", time.perf_counter() - t0

    if not timeout_s or "fork" not in multiprocessing.get_all_start_methods():
        status, payload, s = run()
    else:
        ctx = multiprocessing.get_context("fork")
        recv, send = ctx.Pipe(duplex=False)

        def child() -> None:
            try:
                send.send(run())
            finally:
                os._exit(0)

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads: the child runs no torch
            proc = ctx.Process(target=child, daemon=True)
            proc.start()
        send.close()
        if recv.poll(timeout_s):
            try:
                status, payload, s = recv.recv()
            except EOFError:
                status, payload, s = "error", "solver process died without an answer", float("nan")
        else:
            status, payload, s = "timeout", None, float(timeout_s)
        proc.kill()
        proc.join()
        recv.close()
    if status == "ok":
        payload = autoremat.Plan.from_dict(payload)
    return status, payload, s


# ---------------------------------------------------------------------------------------- one model
@dataclass
class Options:
    rounds: int = 5
    steps_per_round: int = 2
    compile_budgets: tuple[float, ...] = COMPILE_BUDGETS
    compile_backend: str = "inductor"
    compile_timeout_s: float | None = 150.0
    autoremat_budgets: tuple[float, ...] = AUTOREMAT_BUDGETS
    match_pytorch: bool = True
    """Also run every solver at the lowest eager PyTorch option's measured peak (``@match``)."""
    solvers: tuple[str, ...] | None = None
    solver_timeout_s: float | None = 60.0
    size: str = "small"
    batch: dict[str, int] = field(default_factory=dict)
    device: str = "cpu"
    configs: tuple[str, ...] | None = None
    """Only these config families ("pytorch", "compile", "autoremat"); None: all."""
    torch_regions: tuple[tuple[str, float], ...] = (("dp-approx", 0.5),)
    """(solver, budget fraction) rows repeated with ``regions="torch"`` (``+torch-regions``)."""
    compiled_plans: tuple[tuple[str, float], ...] = (("dp-approx", 0.5), ("dp-approx", 0.3))
    """(solver, budget fraction) rows repeated under ``torch.compile`` (``+compile``)."""


def solvers_to_run(opts: Options) -> list[str]:
    return list(opts.solvers) if opts.solvers else [s for s in sorted(autoremat.SOLVERS) if s != "none"]


def planned_configurations(models: Sequence[str], opts: Options) -> list[dict[str, Any]]:
    """Every (model, configuration) the run would measure, without building anything."""
    out = []
    for name in models:
        keys = [("none", "baseline"), ("block-ac", "pytorch"), ("block-sac", "pytorch"), ("ckpt-seq", "pytorch"),
                ("save-on-cpu", "pytorch")]
        keys += [(f"compile@{b:g}", "compile") for b in opts.compile_budgets]
        keys += [(f"autoremat:{s}@{f:g}", "autoremat") for s in solvers_to_run(opts) for f in opts.autoremat_budgets]
        if opts.match_pytorch:
            keys += [(f"autoremat:{s}@{MATCH_TAG}", "autoremat") for s in solvers_to_run(opts)]
        for suffix, pairs in ((TORCH_REGIONS, opts.torch_regions), (COMPILED, opts.compiled_plans)):
            keys += [(f"autoremat:{s}@{f:g}{suffix}", "autoremat") for s, f in pairs
                     if s in solvers_to_run(opts) and f in opts.autoremat_budgets]
        for key, fam in keys:
            if opts.configs is None or fam == "baseline" or fam in opts.configs:
                out.append({"model": name, "config": key, "family": fam})
    return out


def _row(model: str, r: Runner | None = None, **kw: Any) -> dict[str, Any]:
    row = dict.fromkeys(ROW_FIELDS)
    row["model"] = model
    if r is not None:
        row.update(config=r.key, family=r.family, label=r.label)
        row.update({k: v for k, v in r.row.items() if not k.startswith("_")})
    row.update(kw)
    return row


def _err(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}".strip()
    return text if len(text) <= 1500 else text[:1500] + " ..."


def run_model(name: str, opts: Options, log: Callable[[str], None]) -> dict[str, Any]:
    device = torch.device(opts.device)
    w = build_workload(name, size=opts.size, batch=opts.batch.get(name), device=device)
    log(f"== {name}: {w.description}")
    rows: list[dict[str, Any]] = []
    ready: list[Runner] = []
    info: dict[str, Any] = {"description": w.description, "batch": w.batch,
                            "parameters": sum(p.numel() for p in w.model.parameters())}
    want = (lambda fam: True) if opts.configs is None else (lambda fam: fam in opts.configs)

    # reference: no checkpointing
    base = runner_none(w)
    base.step(w.args, w.loss_fn)
    base_peak = measure_peak(base, w, device)
    ref = grads_of(base, w)
    rows.append(_row(name, base, status="ok", measured_peak_bytes=base_peak, gradients_equal=True,
                     grad_max_abs_diff=0.0))
    ready.append(base)
    info["unoptimised_peak_bytes"] = base_peak
    log(f"   none: peak {base_peak / 2**20:.2f} MiB")

    def prepare(r: Runner, row: dict[str, Any]) -> bool:
        """Warm up (compiling if needed), measure the peak, check gradients; False if it failed."""
        try:
            if r.compiled:
                t0 = time.perf_counter()
                with time_limit(opts.compile_timeout_s):
                    r.step(w.args, w.loss_fn)
                    _sync(device)
                row["compile_s"] = time.perf_counter() - t0
                r.step(w.args, w.loss_fn)  # a second call: anything compiled lazily is compiled now
            else:
                r.step(w.args, w.loss_fn)
            row["measured_peak_bytes"] = measure_peak(r, w, device)
            equal, diff = compare_grads(ref, grads_of(r, w))
            row["gradients_equal"], row["grad_max_abs_diff"] = equal, diff
            row["status"] = "ok"
            return True
        except _Timeout as err:
            row.update(status="timeout", error=f"compilation {err} on this machine; abandoned")
            with contextlib.suppress(Exception):  # stop kernel builds still queued for the abandoned graph
                from torch._inductor.async_compile import shutdown_compile_workers

                shutdown_compile_workers()
        except Exception as err:  # noqa: BLE001 - a failing configuration is a result, not a crash
            row.update(status="failed", error=_err(err))
            log("   " + traceback.format_exc(limit=3).replace("\n", "\n   "))
        return False

    # PyTorch's own options
    if want("pytorch"):
        for make in (runner_block_ac, runner_block_sac, runner_ckpt_seq, partial(runner_save_on_cpu, device=device)):
            key = {runner_block_ac: "block-ac", runner_block_sac: "block-sac",
                   runner_ckpt_seq: "ckpt-seq"}.get(make, "save-on-cpu")
            try:
                r = make(w)
            except NotApplicable as why:
                rows.append(_row(name, config=key, family="pytorch", label=key, status="not_applicable",
                                 note=str(why)))
                log(f"   {key}: not applicable ({why})")
                continue
            except Exception as err:  # noqa: BLE001
                rows.append(_row(name, config=key, family="pytorch", label=key, status="failed", error=_err(err)))
                continue
            row = _row(name, r)
            if prepare(r, row):
                ready.append(r)
            rows.append(row)
            log(f"   {r.key}: {row['status']} peak {(row['measured_peak_bytes'] or 0) / 2**20:.2f} MiB")

    # torch.compile with activation_memory_budget
    skip_reason = None  # set when a compile timed out: the +compile rows of autoremat are skipped too
    if want("compile"):
        for b in opts.compile_budgets:
            r = runner_compile(w, b, opts.compile_backend)
            row = _row(name, r)
            if skip_reason:
                row.update(status="skipped", error=skip_reason)
                rows.append(row)
                continue
            if prepare(r, row):
                ready.append(r)
            elif row["status"] == "timeout":
                skip_reason = (f"skipped: the compile at budget {b:g} did not finish within "
                               f"{opts.compile_timeout_s:g} s on this machine")
            rows.append(row)
            log(f"   {r.key}: {row['status']} compile {row['compile_s'] or float('nan'):.1f} s, "
                f"peak {(row['measured_peak_bytes'] or 0) / 2**20:.2f} MiB {row['error'] or ''}")

    # autoremat with every solver
    if want("autoremat"):
        t0 = time.perf_counter()
        graph = autoremat.capture(_copy(w), w.args, loss_fn=w.loss_fn)
        info["capture_s"] = time.perf_counter() - t0
        info["graph_nodes"] = len(graph)
        info["graph_mode"] = graph.meta.get("mode")
        from autoremat.cost import unoptimised_peak_bytes

        info["simulated_unoptimised_peak_bytes"] = int(unoptimised_peak_bytes(graph))
        log(f"   captured {len(graph)} nodes ({info['graph_mode']}) in {info['capture_s']:.1f} s")
        targets: list[tuple[str | None, float, int, str | None]] = [
            (None, f, int(f * base_peak), None) for f in opts.autoremat_budgets]
        eager = [r for r in rows if r["family"] == "pytorch" and r["status"] == "ok"
                 and r["measured_peak_bytes"] and r["measured_peak_bytes"] < base_peak]
        if opts.match_pytorch and eager:
            low = min(eager, key=lambda r: r["measured_peak_bytes"])
            b = int(low["measured_peak_bytes"])
            targets.append((MATCH_TAG, b / base_peak, b, f"budget = {low['config']}'s measured peak"))
        for solver in solvers_to_run(opts):
            timed_out = None
            for tag, f, budget, why in targets:
                key = f"autoremat:{solver}@{tag or format(f, 'g')}"
                label = f"autoremat {solver} @ " + (f"{tag} ({f:.0%})" if tag else f"{f:.0%}")
                row = _row(name, config=key, family="autoremat", label=label,
                           solver=solver, budget_fraction=f, budget_bytes=budget, note=why)
                if timed_out is not None:  # solver cost hardly depends on the budget
                    row.update(status="skipped", error=f"skipped: {solver} timed out at the {timed_out:.0%} budget")
                    rows.append(row)
                    continue
                status, payload, solve_s = solve_limited(graph, budget, solver, opts.solver_timeout_s)
                extra: list[dict[str, Any]] = []
                row["solver_time_s"] = solve_s
                if status == "timeout":
                    timed_out = f
                if status == "infeasible":
                    row.update(status="infeasible", min_budget_bytes=payload,
                               note=why)
                elif status == "timeout":
                    row.update(status="timeout", error=f"solver did not finish within {solve_s:g} s")
                elif status == "error":
                    row.update(status="failed", error=payload)
                else:
                    plan = payload
                    row.update(predicted_peak_bytes=plan.predicted_peak_bytes, segments=len(plan.segments),
                               recomputed=len(plan.recompute_segments))
                    if plan.options.get("fallback"):
                        row["note"] = "; ".join(filter(None, [why, f"fell back to {plan.options['fallback']}"]))
                    variants = [("lean", row)]
                    if tag is None and (solver, f) in opts.torch_regions:
                        extra.append(dict(row, config=key + TORCH_REGIONS,
                                          label=label + ", torch.utils.checkpoint regions"))
                        variants.append(("torch", extra[-1]))
                    if tag is None and (solver, f) in opts.compiled_plans:
                        extra.append(dict(row, config=key + COMPILED, label=label + ", torch.compile"))
                        if skip_reason:
                            extra[-1].update(status="skipped", error=skip_reason)
                        else:
                            variants.append(("compile", extra[-1]))
                    for regions, vrow in variants:
                        try:
                            r = (runner_autoremat(w, plan, solver, f, tag, compile_backend=opts.compile_backend)
                                 if regions == "compile" else runner_autoremat(w, plan, solver, f, tag, regions=regions))
                        except Exception as err:  # noqa: BLE001
                            vrow.update(status="failed", error=_err(err))
                        else:
                            vrow.update(config=r.key)
                            if not prepare(r, vrow):
                                continue
                            ready.append(r)
                            if regions == "compile":  # the simulator predicts eager PyTorch, not Inductor
                                vrow["note"] = ("compiled: the plan's regions become checkpoint ops that the "
                                                "compiled backward recomputes; the prediction and the budget are "
                                                "eager PyTorch's, not checked here")
                                continue
                            m = vrow["measured_peak_bytes"]
                            vrow["prediction_error"] = plan.predicted_peak_bytes / m - 1.0 if m else None
                            vrow["meets_budget"] = m <= budget
                rows.append(row)
                rows.extend(extra)
                log(f"   {key}: {row['status']} solve {row['solver_time_s'] or 0:.2f} s "
                    f"peak {(row['measured_peak_bytes'] or 0) / 2**20:.2f} MiB {row['error'] or row['note'] or ''}")

    # interleaved timing
    times: dict[str, list[float]] = {r.key: [] for r in ready}
    log(f"   timing {len(ready)} configurations, {opts.rounds} rounds x {opts.steps_per_round} steps")
    for rnd in range(opts.rounds):
        gc.collect()
        k = rnd % len(ready)
        for r in ready[k:] + ready[:k]:
            for _ in range(opts.steps_per_round):
                times[r.key].append(timed_step(r, w, device))
    base_t = statistics.median(times["none"])
    for row in rows:
        ts = times.get(row["config"])
        if ts and row["status"] == "ok":
            row["step_times_s"] = ts
            row["step_time_s"] = statistics.median(ts)
            row["time_ratio"] = row["step_time_s"] / base_t
        if row["measured_peak_bytes"] is not None and base_peak:
            row["peak_ratio"] = row["measured_peak_bytes"] / base_peak
    info["rows"] = rows
    del ready, base
    gc.collect()
    return info


# ---------------------------------------------------------------------------------------- largest batch
class SimulatedOOMCounter(LiveStorageCounter):
    """A live-storage counter that fails like the CPU allocator once its live bytes pass ``limit``."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = int(limit)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.live > self.limit:
            raise RuntimeError(f"DefaultCPUAllocator: can't allocate memory: you tried to allocate more than the "
                               f"simulated device holds ({self.live} bytes live in this step, limit {self.limit})")
        return out


def resident_bytes(pl_module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> int:
    """What is allocated before a step: parameters, their gradients, buffers and optimizer state
    (:func:`autoremat.resident.resident_bytes`, counting what exists now)."""
    return _resident_bytes(pl_module, optimizers=optimizers, grads="present", optimizer_state="present")


class SimulatedDevice:
    """A device of ``capacity`` bytes for Lightning training on the CPU.

    Each optimisation step of the LightningModule (``optimizer_step``, which in automatic
    optimisation runs the closure: ``training_step``, ``backward`` and the optimizer update) runs
    under a :class:`SimulatedOOMCounter` whose limit is ``capacity`` minus what was resident when the
    step began (parameters, gradients, buffers, optimizer state: :func:`resident_bytes`) minus the
    batch (``training_step`` lowers the limit by the bytes of its batch). Above the limit it raises
    the CPU allocator's out-of-memory message, which Lightning's ``is_oom_error`` (used by both
    ``BatchSizeFinder`` and ``AutoRemat``) recognises. ``training_step`` alone would not do: backward runs after it returns.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = int(capacity)
        self.counter: SimulatedOOMCounter | None = None
        self.batch_rows = 0
        self.steps: list[tuple[int, int, bool]] = []
        """(batch rows, bytes in use at the step's peak incl. resident and batch, succeeded)."""

    def install(self, pl_module: Any) -> None:
        opt_step, train_step = pl_module.optimizer_step, pl_module.training_step

        def optimizer_step(*args: Any, **kwargs: Any) -> Any:
            base = resident_bytes(pl_module, pl_module.trainer.optimizers)
            counter = SimulatedOOMCounter(self.capacity - base)
            counter.base = base  # type: ignore[attr-defined]
            counter.batch_bytes = 0  # type: ignore[attr-defined]
            self.counter, self.batch_rows = counter, 0
            ok = False
            try:
                with counter:
                    out = opt_step(*args, **kwargs)
                ok = True
                return out
            finally:
                self.counter = None
                in_use = base + counter.batch_bytes + counter.peak  # type: ignore[attr-defined]
                self.steps.append((self.batch_rows, in_use, ok))

        def training_step(batch: Any, *args: Any, **kwargs: Any) -> Any:
            c = self.counter
            if c is not None and torch.is_grad_enabled():
                nb = storage_bytes(batch)
                c.batch_bytes += nb  # type: ignore[attr-defined]
                c.limit -= nb
                self.batch_rows = _rows(batch)
                if c.live > c.limit:
                    raise RuntimeError("DefaultCPUAllocator: can't allocate memory: the batch alone does not fit "
                                       "the simulated device")
            return train_step(batch, *args, **kwargs)

        pl_module.optimizer_step = optimizer_step
        pl_module.training_step = training_step

    def largest_trained(self) -> int:
        return max((rows for rows, _, ok in self.steps if ok), default=0)

    def peak_at(self, rows: int) -> int | None:
        peaks = [p for r, p, ok in self.steps if ok and r == rows]
        return max(peaks) if peaks else None


def _rows(batch: Any) -> int:
    from autoremat.capture._recorder import tensors_in

    return next((int(t.shape[0]) for t in tensors_in(batch) if t.dim()), 0)


@contextlib.contextmanager
def limited_trial_steps(capacity: int) -> Iterator[None]:
    """autoremat's trial steps (``_trial_step``: one forward+backward of the patched module on a
    real batch of the size being tried) run under a :class:`SimulatedOOMCounter` with limit
    ``capacity`` minus :func:`resident_bytes` of the LightningModule minus the trial inputs."""
    from autoremat.integrations import lightning as lit

    original = lit._trial_step

    def trial(target: nn.Module, args: tuple, kwargs: dict, loss_fn: Callable, trainer: Any) -> int | None:
        base = resident_bytes(trainer.lightning_module, trainer.optimizers) + storage_bytes((args, kwargs))
        with SimulatedOOMCounter(capacity - base):
            return original(target, args, kwargs, loss_fn, trainer)

    lit._trial_step = trial
    try:
        yield
    finally:
        lit._trial_step = original


@dataclass
class BatchTask:
    name: str
    make: Callable[[], Any]
    capacity: int
    loss_fn: Callable[[Any], torch.Tensor] | None
    description: str


def _paper_classifier(name: str, batch_size: int, samples: int) -> Any:
    """``LitClassifier`` over the zoo model at paper size (the class itself builds the small size)."""
    from autoremat.zoo.lightning import LitClassifier

    m = LitClassifier(name, batch_size=batch_size, samples=1)
    m.model, (x,) = autoremat.zoo.build(name, size="paper", batch_size=1)
    g = torch.Generator().manual_seed(0)
    m.images = torch.randn((samples, *x.shape[1:]), generator=g)
    m.labels = torch.randint(0, 10, (samples,), generator=g)
    return m


def batch_tasks(quick: bool, budgets: dict[str, int] | None = None, size: str = "small") -> list[BatchTask]:
    from autoremat.zoo.lightning import LitClassifier, LitGPT2

    budgets = budgets or {}
    if size == "paper":
        return [
            BatchTask("LitClassifier(resnet50, paper size)", lambda: _paper_classifier("resnet50", 16, 2048),
                      budgets.get("resnet50", 8 * 2**30), None,
                      "zoo resnet50 (paper size, 3x224x224 images), cross-entropy, SGD with momentum"),
            BatchTask("LitGPT2 (GPT-2 small)",
                      lambda: LitGPT2(batch_size=2, samples=512, seq=1024, n_layer=12, n_embd=768, n_head=12,
                                      vocab_size=50257),
                      budgets.get("gpt2", 16 * 2**30), lambda out: out.loss,
                      "transformers GPT-2 small (12 layers, 768 wide, 1024 tokens, vocab 50257), AdamW"),
        ]
    if quick:
        return [BatchTask("LitClassifier(resnet50)", lambda: LitClassifier("resnet50", batch_size=4, samples=64),
                          budgets.get("resnet50", 5 * 2**20), None,
                          "zoo resnet50 (small, 3x64x64 images), cross-entropy, SGD with momentum")]
    return [
        BatchTask("LitClassifier(resnet50)", lambda: LitClassifier("resnet50", batch_size=4, samples=1024),
                  budgets.get("resnet50", 16 * 2**20), None,
                  "zoo resnet50 (small, 3x64x64 images), cross-entropy, SGD with momentum"),
        BatchTask("LitGPT2", lambda: LitGPT2(batch_size=4, samples=2048),
                  budgets.get("gpt2", 48 * 2**20), lambda out: out.loss,
                  "transformers GPT-2 (n_layer=4, n_embd=64, n_head=4, vocab 256, 64 tokens), AdamW"),
    ]


def _trainer(tmp: str, callbacks: list, max_steps: int, accelerator: str = "cpu") -> Any:
    import lightning.pytorch as pl

    return pl.Trainer(max_steps=max_steps, accelerator=accelerator, devices=1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=tmp, callbacks=callbacks)


@contextlib.contextmanager
def cuda_memory_cap(capacity: int) -> Iterator[None]:
    """On a GPU the budget is real: the caching allocator may hold at most ``capacity`` bytes
    (``set_per_process_memory_fraction``), beyond which it raises ``torch.OutOfMemoryError``."""
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(min(1.0, capacity / total), 0)
    torch.cuda.reset_peak_memory_stats(0)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
        torch.cuda.empty_cache()


def run_batch_task(task: BatchTask, method: str, log: Callable[[str], None], *, max_batch: int = 8192,
                   confirm_steps: int = 2, device: str = "cpu") -> dict[str, Any]:
    """Largest batch under ``task.capacity`` found by ``method`` (see ``BATCH_METHODS``), then
    ``confirm_steps`` training steps at that size under the same (simulated or real) budget."""
    import logging

    from lightning.pytorch.callbacks import BatchSizeFinder

    cuda = torch.device(device).type == "cuda"
    row = dict.fromkeys(BATCH_FIELDS)
    row.update(task=task.name, method=method, budget_bytes=task.capacity)
    model = task.make()
    row["initial_batch_size"] = int(model.batch_size)
    dev = SimulatedDevice(task.capacity if not cuda else 2**62)  # on a GPU it only records the batch sizes
    dev.install(model)
    row["resident_bytes"] = resident_bytes(model, [])
    if method == "autoremat":
        row["note"] = "AutoRemat(budget=B, raise_batch_size=True, solver='auto')"
        cb = autoremat.AutoRemat(budget=task.capacity, module="model", raise_batch_size=True, verbose=False,
                                 max_batch_size=max_batch, loss_fn=task.loss_fn)
        limiter = limited_trial_steps(task.capacity) if not cuda else contextlib.nullcontext()
    else:
        # max_val (the same ceiling as AutoRemat's) exists from Lightning 2.6; before, the search has none
        capped = "max_val" in inspect.signature(BatchSizeFinder.__init__).parameters
        cb = BatchSizeFinder(mode="binsearch", init_val=row["initial_batch_size"],
                             **({"max_val": max_batch} if capped else {}))
        limiter = contextlib.nullcontext()
        row["note"] = ("BatchSizeFinder(mode='binsearch', steps_per_trial=3, margin=0.05 (default)); its trial steps "
                       "(real training steps) run under the simulated device"
                       + ("" if capped else "; this Lightning's BatchSizeFinder has no max_val: no ceiling"))
    quiet = logging.getLogger("lightning.pytorch")
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, limiter, warnings.catch_warnings(), \
            (cuda_memory_cap(task.capacity) if cuda else contextlib.nullcontext()):
        warnings.simplefilter("ignore")
        trainer = _trainer(tmp, [cb], confirm_steps, accelerator="gpu" if cuda else "cpu")
        try:
            trainer.fit(model)
            row["confirmed"] = True
            row["status"] = "ok"
        except RuntimeError as err:
            row.update(status="failed", confirmed=False, error=_err(err))
        except Exception as err:  # noqa: BLE001
            row.update(status="failed", confirmed=False, error=_err(err))
    quiet.setLevel(level)
    row["search_s"] = time.perf_counter() - t0
    auto = method == "autoremat"
    row["batch_size"] = int(cb.batch_size) if auto and cb.batch_size else int(model.batch_size)
    row["largest_trained_batch"] = dev.largest_trained()
    row["confirm_peak_bytes"] = dev.peak_at(row["batch_size"]) or max(
        (p for r, p, _ in dev.steps if r == row["batch_size"]), default=None)
    if cuda:  # the allocator's peak over the whole fit (search included), not per step
        row["confirm_peak_bytes"] = int(torch.cuda.max_memory_allocated(0))
    if auto and cb.summary:
        row["step_budget_bytes"] = cb.step_budget_bytes
        row["predicted_overhead"] = cb.summary.get("predicted_overhead")
        row["note"] += (f"; plan {cb.summary.get('solver')} ({cb.summary.get('segments')} segments, "
                        f"{cb.summary.get('recomputed')} recomputed), step budget "
                        f"{(cb.step_budget_bytes or 0) / 2**20:.2f} MiB")
    log(f"   {task.name} {method}: batch {row['initial_batch_size']} -> {row['batch_size']} "
        f"({row['status']}, {row['search_s']:.1f} s) {row['error'] or ''}")
    return row


# ---------------------------------------------------------------------------------------- summary
def headline(models: dict[str, dict[str, Any]], batch_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The numbers the README quotes, computed from the rows."""
    out: dict[str, Any] = {"per_model": {}, "resnet50_50pct": None, "largest_batch": {}, "worst_prediction_error": None,
                           "budget_exceeded": [], "regions": [], "compiled_plans": []}
    worst = None
    for name, info in models.items():
        rows = [r for r in info["rows"] if r["status"] == "ok" and r["step_time_s"] is not None]
        base = next((r for r in rows if r["config"] == "none"), None)
        torch_rows = [r for r in rows if r["family"] in ("pytorch", "compile")
                      and base is not None and r["measured_peak_bytes"] < base["measured_peak_bytes"]]
        auto = [r for r in rows if r["family"] == "autoremat"]
        by_key = {r["config"]: r for r in auto}
        low = min((r for r in rows if r["family"] == "compile"), key=lambda c: c["measured_peak_bytes"], default=None)
        for r in auto:
            if r["config"].endswith(COMPILED):
                out["compiled_plans"].append({
                    "model": name, "config": r["config"], "peak_ratio": r["peak_ratio"], "time_ratio": r["time_ratio"],
                    "lowest_compile": None if low is None else low["config"],
                    "lowest_compile_peak_ratio": None if low is None else low["peak_ratio"],
                    "lowest_compile_time_ratio": None if low is None else low["time_ratio"]})
            lean = by_key.get(r["config"].removesuffix(TORCH_REGIONS))
            if r["config"].endswith(TORCH_REGIONS) and lean is not None:
                out["regions"].append({"model": name, "config": lean["config"], "lean_time_s": lean["step_time_s"],
                                       "torch_time_s": r["step_time_s"],
                                       "time_ratio": lean["step_time_s"] / r["step_time_s"],
                                       "same_peak": lean["measured_peak_bytes"] == r["measured_peak_bytes"]})
        matches = []
        for p in sorted(torch_rows, key=lambda r: r["measured_peak_bytes"]):
            cands = [a for a in auto if a["measured_peak_bytes"] <= p["measured_peak_bytes"]]
            best = min(cands, key=lambda a: a["step_time_s"]) if cands else None
            matches.append({
                "pytorch": p["config"], "pytorch_peak_bytes": p["measured_peak_bytes"],
                "pytorch_time_s": p["step_time_s"],
                "autoremat": best["config"] if best else None,
                "autoremat_peak_bytes": best["measured_peak_bytes"] if best else None,
                "autoremat_time_s": best["step_time_s"] if best else None,
                "time_ratio": best["step_time_s"] / p["step_time_s"] if best else None,
            })
        lowest = matches[0] if matches else None
        matched = next((mt for mt in matches if mt["autoremat"]), None)
        out["per_model"][name] = {"lowest_peak_pytorch": lowest, "lowest_matched_pytorch": matched,
                                  "matches": matches}
        for r in info["rows"]:
            if r["meets_budget"] is False:
                out["budget_exceeded"].append({"model": name, "config": r["config"], "budget_bytes": r["budget_bytes"],
                                               "measured_peak_bytes": r["measured_peak_bytes"]})
            if r["prediction_error"] is not None and (worst is None or abs(r["prediction_error"]) > abs(worst["error"])):
                worst = {"model": name, "config": r["config"], "error": r["prediction_error"]}
        if name == "resnet50":
            half = [r for r in info["rows"] if r["family"] == "autoremat" and r["budget_fraction"] == 0.5
                    and not r["config"].endswith((TORCH_REGIONS, COMPILED))]
            out["resnet50_50pct"] = {r["solver"]: {"status": r["status"], "time_ratio": r["time_ratio"],
                                                   "peak_ratio": r["peak_ratio"]} for r in half}
    out["worst_prediction_error"] = worst
    for r in batch_rows:
        out["largest_batch"].setdefault(r["task"], {})[r["method"]] = {
            "batch_size": r["batch_size"], "confirmed": r["confirmed"], "initial": r["initial_batch_size"]}
    return out


def machine_info(device: torch.device) -> dict[str, Any]:
    import lightning

    info = {"platform_machine": platform.machine(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "lightning": lightning.__version__, "device": str(device), "system": platform.system(),
            "cuda_available": torch.cuda.is_available()}
    with contextlib.suppress(OSError, AttributeError):
        info["load_avg_1m"] = os.getloadavg()[0]  # other work on a shared machine
    with contextlib.suppress(ImportError):
        import transformers

        info["transformers"] = transformers.__version__
    if device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(device)
        info["device_memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
    return info


def _mib(b: Any) -> str:
    return "" if b is None else f"{b / 2**20:.2f} MiB"


def _ms(s: Any) -> str:
    return "" if s is None else f"{s * 1e3:.1f} ms"


def _sec(v: Any) -> str:
    return "" if v is None else f"{v:.1f} s"


def _x(v: Any) -> str:
    return "" if v is None else f"{v:.2f}x"


def _pct(v: Any) -> str:
    return "" if v is None else f"{v:.0%}"


def _command_lines(result: dict[str, Any]) -> list[str]:
    """What was run: one command, or the runs a merged result joins (``merge_runs.py``); a note
    when the run had not finished."""
    runs = result.get("runs")
    if runs:
        lines = [f"Merged from {len(runs)} runs on the same machine kind (`benchmarks/merge_runs.py`); every ratio is "
                 "to the `none` measured side by side with the row in its own run:", ""]
        lines += [f"* run {k + 1}: `{r['command']}` ({r['wall_s'] / 60:.1f} min"
                  f"{', stopped before it finished' if r['partial'] else ''}): {', '.join(r['models']) or 'no model'}"
                  f"{'; largest-batch section' if r['largest_batch'] else ''}" for k, r in enumerate(runs)]
        return lines + [""]
    lines = [f"Command: `{result['command']}` ({result['wall_s'] / 60:.1f} min).", ""]
    if result.get("partial"):
        lines += [f"**Partial results**: written after each model; the run had not finished (models so far: "
                  f"{', '.join(result['models']) or 'none'}; no largest-batch section yet).", ""]
    return lines


def to_markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    s = result["settings"]
    where = (f"{m.get('device_name', m['device'])}" if m["device"].startswith("cuda")
             else f"{m['platform_machine']} CPU, os.cpu_count() = {m['cpu_count']}")
    lines = [
        f"# autoremat vs PyTorch's own memory savers ({where})", "",
        f"Machine: `platform.machine()` = {m['platform_machine']}, `os.cpu_count()` = {m['cpu_count']}, "
        f"torch {m['torch']} ({m['torch_threads']} intra-op thread(s)), Lightning {m['lightning']}, "
        f"transformers {m.get('transformers', '-')}, Python {m['python']}"
        + (f", GPU {m['device_name']} ({m['device_memory_bytes'] / 2**30:.1f} GiB)" if "device_name" in m else
           ", CPU only (no GPU), shared with other jobs running at the same time"
           + ("" if m.get("load_avg_1m") is None else f" (1-minute load average {m['load_avg_1m']:.2f} at the start)"))
        + ".", "",
        *_command_lines(result),
    ]
    if m["device"] == "cpu":
        lines += [
            "**Timings on this shared 2-core machine are noisy: read the ratios, not the milliseconds.** Each "
            f"model's configurations ran round-robin in one process ({s['rounds']} rounds x {s['steps_per_round']} "
            "steps, the order rotated every round), so drift hits all of them alike; the time is the median of "
            "those steps and the ratio is to `none` from the same rounds. Step peak: the live-storage counter of "
            "`autoremat.measure` (bytes of storages created during one forward+backward above what was live when "
            "the step started). `torch.compile` rows: the same counter, left on while the compiled code runs "
            "(`ignore_compile_internals`), with Inductor's CPU buffer allocation routed through the dispatcher so "
            "its buffers are counted; compile time is the first compiled step (Dynamo + AOTAutograd + Inductor + "
            "C++ build, cold cache) and is not in the step time.", ""]
    else:
        lines += [
            f"Step peak: `torch.cuda.max_memory_allocated` after `reset_peak_memory_stats`, minus what was allocated "
            f"when the step began; step time: CUDA events, median of {s['rounds']} interleaved rounds x "
            f"{s['steps_per_round']} steps. Compile time is the first compiled step.", ""]
    lines += [
        "Configurations (each on a fresh deepcopy of the same model and batch): `none`; `block-ac`: per-block "
        "`apply_activation_checkpointing(checkpoint_wrapper(NO_REENTRANT))` as Lightning's FSDP strategy and "
        "Accelerate apply it; `block-sac`: the same blocks under selective checkpointing saving "
        "`aten.mm/addmm/bmm/convolution` outputs; `ckpt-seq`: `checkpoint_sequential` with ~sqrt(n) segments where "
        "the model is a sequence; `save-on-cpu`: `torch.autograd.graph.save_on_cpu`; `compile@B`: `torch.compile` "
        f"({s['compile_backend']}) with `activation_memory_budget = B`; `autoremat:<solver>@f`: "
        "`autoremat.solve(graph, f x measured unoptimised "
        "peak, solver=...)` applied with `autoremat.apply` (autoremat's own recomputed regions; a "
        "`+torch-regions` row runs the same plan on `torch.utils.checkpoint` regions, a `+compile` row the patched "
        "model under `torch.compile`, where each region becomes a checkpoint op that the compiled backward "
        "recomputes). Gradients: `torch.equal` on every parameter gradient "
        "against `none` from the same RNG state; compile rows report the largest absolute difference (on models with "
        "dropout it includes different dropout masks: Inductor draws its own random numbers).", ""]
    h = result["headline"]
    lines += ["## Headline", ""]
    for name, hm in h["per_model"].items():
        lo = hm["lowest_peak_pytorch"]
        if lo is None:
            lines.append(f"* **{name}**: no PyTorch option measured below the unoptimised peak.")
        elif lo["autoremat"] is None:
            mt = hm.get("lowest_matched_pytorch")
            lines.append(f"* **{name}**: the lowest-peak PyTorch option is `{lo['pytorch']}` "
                         f"({_mib(lo['pytorch_peak_bytes'])}); no autoremat row measured at or below it."
                         + ("" if not mt else
                            f" The lowest-peak PyTorch option that one matches is `{mt['pytorch']}` "
                            f"({_mib(mt['pytorch_peak_bytes'])}, {_ms(mt['pytorch_time_s'])}) vs `{mt['autoremat']}` "
                            f"({_mib(mt['autoremat_peak_bytes'])}, {_ms(mt['autoremat_time_s'])}): step time ratio "
                            f"**{mt['time_ratio']:.2f}**."))
        else:
            lines.append(f"* **{name}**: lowest-peak PyTorch option `{lo['pytorch']}` ({_mib(lo['pytorch_peak_bytes'])}, "
                         f"{_ms(lo['pytorch_time_s'])}) vs fastest autoremat row at an equal or lower peak "
                         f"`{lo['autoremat']}` ({_mib(lo['autoremat_peak_bytes'])}, {_ms(lo['autoremat_time_s'])}): "
                         f"step time ratio autoremat / PyTorch = **{lo['time_ratio']:.2f}**.")
    if h["resnet50_50pct"]:
        parts = [f"{sv}: {_x(v['time_ratio'])} ({_pct(v['peak_ratio'])} peak)" if v["status"] == "ok"
                 else f"{sv}: {v['status']}" for sv, v in h["resnet50_50pct"].items()]
        lines.append("* **resnet50 at a 50 % budget**, step time vs `none`: " + "; ".join(parts) + ".")
    steps = s.get("confirm_steps", 2)
    for task, d in h["largest_batch"].items():
        def one(method: str) -> str:
            v = d.get(method)
            if v is None:
                return "n/a"
            return f"{v['batch_size']}" + (f" (trained {steps} steps)" if v["confirmed"]
                                           else " (**failed** its training steps)")
        a, b = d.get("autoremat"), d.get("batchsizefinder")
        ratio = (f": **{a['batch_size'] / b['batch_size']:.1f}x** BatchSizeFinder's"
                 if a and b and a["confirmed"] and b["confirmed"] and b["batch_size"] else "")
        lines.append(f"* **Largest batch, {task}** (from {next(iter(d.values()))['initial']}, same simulated budget): "
                     f"autoremat {one('autoremat')}; BatchSizeFinder {one('batchsizefinder')}{ratio}.")
    for rg in h.get("regions", []):
        lines.append(f"* **autoremat's regions vs `torch.utils.checkpoint` regions**, {rg['model']} `{rg['config']}` "
                     f"(same plan): step time {_ms(rg['lean_time_s'])} vs {_ms(rg['torch_time_s'])}, ratio "
                     f"**{rg['time_ratio']:.2f}**, " + ("same" if rg["same_peak"] else "**different**") + " measured peak.")
    for cp in h.get("compiled_plans", []):
        low = (f"; the lowest peak `torch.compile` reached by itself: `{cp['lowest_compile']}` "
               f"{_pct(cp['lowest_compile_peak_ratio'])} at {_x(cp['lowest_compile_time_ratio'])}"
               if cp["lowest_compile"] else "")
        lines.append(f"* **An autoremat plan under `torch.compile`**, {cp['model']} `{cp['config']}`: "
                     f"{_pct(cp['peak_ratio'])} of `none`'s peak at {_x(cp['time_ratio'])} its step time{low}.")
    if h["worst_prediction_error"]:
        wpe = h["worst_prediction_error"]
        lines.append(f"* **Worst autoremat prediction error**: {wpe['error']:+.1%} ({wpe['model']}, `{wpe['config']}`).")
    for ex in h.get("budget_exceeded", []):
        lines.append(f"* **Budget exceeded**: {ex['model']} `{ex['config']}` measured {_mib(ex['measured_peak_bytes'])} "
                     f"against a budget of {_mib(ex['budget_bytes'])}.")
    lines.append("")
    for name, info in result["models"].items():
        lines += [f"## {name}", "", info["description"] + ".", ""]
        if "capture_s" in info:
            lines += [f"autoremat graph: {info['graph_nodes']} nodes ({info['graph_mode']} level), captured in "
                      f"{info['capture_s']:.1f} s; simulated unoptimised peak "
                      f"{_mib(info['simulated_unoptimised_peak_bytes'])} vs measured "
                      f"{_mib(info['unoptimised_peak_bytes'])}.", ""]
        if len(info.get("runs", ())) > 1:  # joined row by row by merge_runs.py
            lines += [f"Measured in {len(info['runs'])} runs (" + ", ".join(
                f"run {i + 1}: {sum(r.get('run') == i for r in info['rows'])} rows" for i in info["runs"])
                + "); every ratio is to the `none` of the row's own run, and a row from another run than this "
                "table's `none` shows its ratio times this `none`'s step time (what it measured is "
                "`measured_step_time_s` in `compare.json`).", ""]
        lines += ["| configuration | status | measured peak | vs none | step time | vs none | predicted peak | "
                  "pred. error | solver / compile time | gradients | notes |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in info["rows"]:
            if r["family"] == "compile":
                grads = "" if r["grad_max_abs_diff"] is None else (
                    "equal" if r["gradients_equal"] else f"max abs diff {r['grad_max_abs_diff']:.2e}")
                extra = "" if r["compile_s"] is None else f"compile {r['compile_s']:.1f} s"
            else:
                grads = "" if r["gradients_equal"] is None else ("bit-for-bit equal" if r["gradients_equal"]
                                                                 else f"DIFFER (max {r['grad_max_abs_diff']:.2e})")
                extra = "" if r["solver_time_s"] is None else f"solve {r['solver_time_s']:.2f} s"
            notes = "; ".join(x for x in (r["error"], r["note"]) if x)
            if r["status"] == "infeasible" and r["min_budget_bytes"]:
                notes = f"budget {_mib(r['budget_bytes'])} < solver minimum {_mib(r['min_budget_bytes'])}" + (
                    f"; {r['note']}" if r["note"] and "solver minimum" not in r["note"] else "")  # old JSONs
            elif r["meets_budget"] is not None:
                notes = (f"budget {_mib(r['budget_bytes'])} " + ("met" if r["meets_budget"] else "**exceeded**")
                         + (f"; {notes}" if notes else ""))
            notes = notes.replace("|", "/").replace("\n", " ")
            pe = "" if r["prediction_error"] is None else f"{r['prediction_error']:+.1%}"
            lines.append(f"| `{r['config']}` | {r['status']} | {_mib(r['measured_peak_bytes'])} | "
                         f"{_pct(r['peak_ratio'])} | {_ms(r['step_time_s'])} | {_x(r['time_ratio'])} | "
                         f"{_mib(r['predicted_peak_bytes'])} | {pe} | {extra} | {grads} | {notes} |")
        hm = h["per_model"].get(name)
        if hm and hm["matches"]:
            lines += ["", "PyTorch options that lower the peak, each against the fastest autoremat row at an equal or "
                      "lower measured peak:", "",
                      "| PyTorch option | peak | time | autoremat row | peak | time | time ratio |",
                      "|---|---|---|---|---|---|---|"]
            for mt in hm["matches"]:
                lines.append(f"| `{mt['pytorch']}` | {_mib(mt['pytorch_peak_bytes'])} | {_ms(mt['pytorch_time_s'])} | "
                             + (f"`{mt['autoremat']}` | {_mib(mt['autoremat_peak_bytes'])} | "
                                f"{_ms(mt['autoremat_time_s'])} | {mt['time_ratio']:.2f} |" if mt["autoremat"]
                                else "none at or below this peak | | | |"))
        if (Path(result["out"]) / f"compare_{name}.png").exists():
            lines += ["", f"![{name}: step peak vs step time](compare_{name}.png)"]
        lines.append("")
    if result["largest_batch"]:
        batch_run = result.get("batch_run")
        cuda_text = (
            "Both methods start from the module's `batch_size` under the same real budget: the caching allocator "
            "may hold at most B bytes (`torch.cuda.set_per_process_memory_fraction(B / total)`), beyond which it "
            "raises `torch.OutOfMemoryError`, which BatchSizeFinder and AutoRemat both catch. Afterwards both "
            f"train {result['settings']['confirm_steps']} steps at the size they chose (confirmed = no "
            "out-of-memory; peak = `max_memory_allocated` over the whole fit).")
        lines += ["## Largest batch under a fixed budget", ""]
        if batch_run:
            bm = batch_run["machine"]
            load = ("" if bm.get("load_avg_1m") is None
                    else f", 1-minute load average {bm['load_avg_1m']:.2f} at its start")
            lines += [f"This section was re-run on its own after the tables above: `{batch_run['command']}` "
                      f"({batch_run['wall_s'] / 60:.1f} min; torch {bm['torch']}, Lightning {bm['lightning']}, "
                      f"`os.cpu_count()` = {bm['cpu_count']}{load}).", ""]
        if m["device"].startswith("cuda"):
            lines += [cuda_text, ""]
        else:
            lines += [
                  "Both methods start from the module's `batch_size` and see the same simulated device. On the CPU a "
                  "device of B bytes is simulated by a live-storage counter that raises the CPU allocator's "
                  "out-of-memory error (`DefaultCPUAllocator: can't allocate memory`, which Lightning's "
                  "`is_oom_error`, used by both, recognises) once the bytes created in a step pass B minus "
                  "what was resident when the step began (parameters, gradients, buffers, optimizer state) minus the "
                  "batch. *BatchSizeFinder*: the counter wraps the LightningModule's `optimizer_step` (in automatic "
                  "optimisation it runs the closure: `training_step`, `backward`, the optimizer update; wrapping "
                  "`training_step` alone would leave backward unenforced), so every trial step of the search is "
                  "enforced. *AutoRemat*: the counter wraps `autoremat.integrations.lightning._trial_step` (one "
                  "forward+backward of the patched module on a real batch of the size tried; inputs charged as "
                  "batch), and AutoRemat's own check compares the measured step peak with its step budget (B minus "
                  "parameters, buffers, estimated optimizer state, under automatic optimisation the previous step's "
                  "parameter gradients, and the batch); profiling runs once at the starting batch size, unenforced. "
                  "Afterwards both train "
                  f"{result['settings']['confirm_steps']} steps at the size they chose with the `optimizer_step` "
                  "wrapper on (confirmed = no out-of-memory; peak in use = resident + batch + the step's peak).", ""]
        lines += ["| task | budget | parameters + buffers | method | batch | largest batch trained | confirmed | "
                  "peak in use at that batch | search + training time | notes |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in result["largest_batch"]:
            notes = "; ".join(x for x in (r["error"], r["note"]) if x).replace("|", "/")
            lines.append(f"| {r['task']} | {_mib(r['budget_bytes'])} | {_mib(r['resident_bytes'])} | {r['method']} | "
                         f"{r['initial_batch_size']} -> **{r['batch_size']}** | {r['largest_trained_batch']} | "
                         f"{r['confirmed']} | {_mib(r['confirm_peak_bytes'])} | "
                         f"{_sec(r['search_s'])} | {notes} |")
        lines.append("")
        lines += _batch_text(result["largest_batch"], result["settings"].get("confirm_steps", 2))
    fails = result["failures"]
    lines += ["## What failed or did not apply", ""]
    if not fails:
        lines.append("Nothing.")
    for f in fails:
        why = (f["error"] or f["note"] or "").strip()
        why = why[len(f["status"]) + 2:] if why.startswith(f"{f['status']}: ") else why
        lines.append(f"* {f['model']} `{f['config']}`: {f['status'].replace('_', ' ')}: {why}")
    lines.append("")
    return "\n".join(lines)


def _batch_text(rows: list[dict[str, Any]], steps: int) -> list[str]:
    """What the largest-batch table shows, per task, from the recorded numbers."""
    import re

    out = []
    for task in dict.fromkeys(r["task"] for r in rows):
        a = next((r for r in rows if r["task"] == task and r["method"] == "autoremat"), None)
        b = next((r for r in rows if r["task"] == task and r["method"] == "batchsizefinder"), None)
        if a is None:
            continue
        if a["status"] == "ok":
            text = (f"*{task}*: AutoRemat raised the batch from {a['initial_batch_size']} to {a['batch_size']} and "
                    f"trained {steps} real steps at that size on the simulated device, at most "
                    f"{_mib(a['confirm_peak_bytes'])} in use of {_mib(a['budget_bytes'])}")
            if a["predicted_overhead"] is not None:
                text += f"; its plan predicts {a['predicted_overhead']:.0%} more step time than no recomputation"
            if b is not None and b["status"] == "ok" and b["batch_size"]:
                text += (f". BatchSizeFinder, which does not recompute, settled on {b['batch_size']} (the largest of "
                         f"its trial steps that trained: {b['largest_trained_batch']}), so AutoRemat's batch is "
                         f"{a['batch_size'] / b['batch_size']:.1f}x")
            out += [text + ".", ""]
            continue
        text = f"*{task}*: AutoRemat chose batch {a['batch_size']}, but "
        m = re.search(r"\((\d+) bytes live in this step, limit (\d+)\)", a["error"] or "")
        if m:
            text += (f"the training steps at that size ran out of the simulated device by "
                     f"{(int(m.group(1)) - int(m.group(2))) / 2**10:.0f} KiB: its step budget left out something "
                     "the real Lightning step allocates (its trial step is one forward+backward of the patched "
                     "module; the training step also runs the loss, `optimizer.zero_grad` after `training_step` "
                     "and the optimizer update).")
        else:
            text += f"the run failed: {a['error']}."
        out += [text, ""]
    return out


def plot(result: dict[str, Any], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    colors = {"baseline": "black", "pytorch": "tab:blue", "compile": "tab:orange", "autoremat": "tab:green"}
    for name, info in result["models"].items():
        rows = [r for r in info["rows"] if r["status"] == "ok" and r["step_time_s"] is not None]
        if not rows:
            continue
        fig, ax = plt.subplots(figsize=(8, 5.5))
        for fam, color in colors.items():
            pts = [r for r in rows if r["family"] == fam]
            if pts:
                ax.scatter([r["measured_peak_bytes"] / 2**20 for r in pts], [r["step_time_s"] * 1e3 for r in pts],
                           c=color, label=fam, s=36, zorder=3)
        for r in rows:
            ax.annotate(r["config"].replace("autoremat:", ""), (r["measured_peak_bytes"] / 2**20, r["step_time_s"] * 1e3),
                        fontsize=6.5, xytext=(3, 2), textcoords="offset points")
        front, best = [], math.inf
        for r in sorted(rows, key=lambda r: (r["measured_peak_bytes"], r["step_time_s"])):
            if r["step_time_s"] < best:
                front.append(r)
                best = r["step_time_s"]
        ax.step([r["measured_peak_bytes"] / 2**20 for r in front], [r["step_time_s"] * 1e3 for r in front],
                where="post", color="grey", lw=1, ls="--", label="Pareto front", zorder=2)
        ax.set_xlabel("measured step peak (MiB)")
        ax.set_ylabel("median step time (ms)")
        dev = result["machine"].get("device_name", f"{result['machine']['platform_machine']} CPU")
        ax.set_title(f"{name}: step peak vs step time ({dev})", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / f"compare_{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(str(path))
    return written


# ---------------------------------------------------------------------------------------- driver
def run(models: Sequence[str], opts: Options, out: Path, *, batch: bool = True, quick: bool = False,
        command: str = "", batch_budgets: dict[str, int] | None = None, confirm_steps: int = 2,
        log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run every model, then the largest-batch comparison; write JSON, markdown and plots to ``out``."""
    t_start = time.perf_counter()
    device = torch.device(opts.device)
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "schema": 1, "command": command, "out": str(out), "machine": machine_info(device),
        "settings": {"rounds": opts.rounds, "steps_per_round": opts.steps_per_round, "size": opts.size,
                     "compile_budgets": list(opts.compile_budgets), "compile_backend": opts.compile_backend,
                     "compile_timeout_s": opts.compile_timeout_s, "autoremat_budgets": list(opts.autoremat_budgets),
                     "solvers": solvers_to_run(opts), "solver_timeout_s": opts.solver_timeout_s, "quick": quick,
                     "confirm_steps": confirm_steps, "models": list(models)},
        "models": {}, "rows": [], "largest_batch": [], "failures": [],
    }
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir
    import torch._dynamo.config as dynamo_config

    with tempfile.TemporaryDirectory(prefix="compare_inductor_") as cache, temporary_cache_dir(cache), \
            dynamo_config.patch(recompile_limit=64, accumulated_recompile_limit=4096):
        for name in models:
            try:
                info = run_model(name, opts, log)
            except Exception as err:  # noqa: BLE001 - one model failing must not lose the others
                log(traceback.format_exc())
                result["failures"].append({"model": name, "config": "*", "status": "failed", "error": _err(err),
                                           "note": None})
                continue
            result["models"][name] = info
            result["rows"].extend(info["rows"])
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if batch or name != models[-1]:  # else the final outputs follow at once
                _write_partial(result, out, t_start, log)
    if batch:
        result["largest_batch"] = run_batch_section(opts, quick=quick, batch_budgets=batch_budgets,
                                                    confirm_steps=confirm_steps, log=log)
    result["failures"] += row_failures(result["rows"]) + batch_failures(result["largest_batch"])
    result["headline"] = headline(result["models"], result["largest_batch"])
    result["wall_s"] = time.perf_counter() - t_start
    result["partial"] = False
    write_outputs(result, out)
    log(f"wrote {out / 'compare.json'}, {out / 'RESULTS.md'} and {len(result['plots'])} plots "
        f"in {result['wall_s'] / 60:.1f} min")
    return result


def _write_partial(result: dict[str, Any], out: Path, t_start: float, log: Callable[[str], None]) -> None:
    """The outputs with the models measured so far (``"partial": true``): a run stopped later (a
    time limit, a crash) still leaves its finished models on disk, and ``merge_runs.py`` can join
    them with another run's."""
    done = {**result, "failures": result["failures"] + row_failures(result["rows"]), "partial": True,
            "wall_s": time.perf_counter() - t_start}
    done["headline"] = headline(done["models"], [])
    write_outputs(done, out)
    log(f"wrote the {len(done['models'])} model(s) measured so far to {out / 'compare.json'} (partial)")


def run_batch_section(opts: Options, *, quick: bool, batch_budgets: dict[str, int] | None, confirm_steps: int,
                      log: Callable[[str], None]) -> list[dict[str, Any]]:
    """The largest-batch comparison: every task of :func:`batch_tasks` with every ``BATCH_METHODS``."""
    rows = []
    log("== largest batch under a fixed budget")
    for task in batch_tasks(quick, batch_budgets, size=opts.size):
        for method in BATCH_METHODS:
            try:
                rows.append(run_batch_task(task, method, log, confirm_steps=confirm_steps, device=opts.device))
            except Exception as err:  # noqa: BLE001 - one task failing must not lose the others
                log(traceback.format_exc())
                row = dict.fromkeys(BATCH_FIELDS)
                row.update(task=task.name, method=method, status="failed", error=_err(err),
                           budget_bytes=task.capacity)
                rows.append(row)
    return rows


def row_failures(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``failures`` entries of step-time rows that neither ran nor were infeasible."""
    return [{k: r[k] for k in ("model", "config", "status", "error", "note")}
            for r in rows if r["status"] not in ("ok", "infeasible")]


def batch_failures(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``failures`` entries of largest-batch rows that did not finish."""
    return [{"model": r["task"], "config": r["method"], "status": r["status"], "error": r["error"], "note": None}
            for r in rows if r["status"] != "ok"]


def run_batch_only(out: Path, opts: Options, *, quick: bool = False, command: str = "",
                   batch_budgets: dict[str, int] | None = None, confirm_steps: int = 2,
                   log: Callable[[str], None] = print) -> dict[str, Any]:
    """Re-run only the largest-batch comparison and merge it into ``out/compare.json``: the step-time
    tables stay as measured, the batch rows, their failures and the headline are replaced, and the
    section records its own command, wall time and machine (``batch_run``)."""
    path = out / "compare.json"
    if not path.is_file():
        raise SystemExit(f"--batch-only merges into an existing {path}, which does not exist; "
                         "run the full comparison first (without --batch-only)")
    result = json.loads(path.read_text())
    t_start = time.perf_counter()
    machine = machine_info(torch.device(opts.device))
    old_tasks = {r["task"] for r in result.get("largest_batch", [])}
    rows = run_batch_section(opts, quick=quick, batch_budgets=batch_budgets, confirm_steps=confirm_steps, log=log)
    result["largest_batch"] = rows
    result["failures"] = [f for f in result.get("failures", []) if f["model"] not in old_tasks] + batch_failures(rows)
    result["settings"]["confirm_steps"] = confirm_steps
    result["batch_run"] = {"command": command, "wall_s": time.perf_counter() - t_start, "machine": machine}
    result["headline"] = headline(result["models"], rows)
    write_outputs(result, out)
    log(f"merged the largest-batch section into {path} and rewrote {out / 'RESULTS.md'} "
        f"in {result['batch_run']['wall_s'] / 60:.1f} min")
    return result


def write_outputs(result: dict[str, Any], out: Path) -> None:
    """``compare.json``, ``RESULTS.md`` and the plots under ``out``."""
    result["out"] = str(out)
    result["plots"] = plot(result, out)
    (out / "compare.json").write_text(json.dumps(_finite(result), indent=1, default=_json_default,
                                                 allow_nan=False) + "\n")
    (out / "RESULTS.md").write_text(to_markdown(result))


def render(path: Path) -> dict[str, Any]:
    """Rewrite RESULTS.md and the plots from an existing compare.json (no measuring)."""
    result = json.loads(Path(path).read_text())
    result["headline"] = headline(result["models"], result["largest_batch"])
    write_outputs(result, Path(path).parent)
    return result


def _finite(obj: Any) -> Any:
    """The result with NaN and infinities as None (strict JSON)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _json_default(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return str(obj)


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def _per_model(text: str, value: Callable[[str, str], int]) -> dict[str, int]:
    """``"a=x,b=y"`` -> ``{"a": value("a=x", "x"), ...}`` (``value`` gets the item, for its error)."""
    out = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        k, _, v = item.partition("=")
        out[k.strip()] = value(item, v.strip())
    return out


def _sizes(text: str) -> dict[str, int]:
    """``--batch-budgets``: ``"resnet50=16MiB"`` -> ``{"resnet50": 16777216}``."""
    from autoremat.budget import parse_budget

    return _per_model(text, lambda _item, v: int(parse_budget(v)))


def _batch_size(item: str, value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise SystemExit(f"--batch-sizes: {item!r} is not MODEL=N with N a positive integer (e.g. resnet50=16)")
    return int(value)


def _batch_sizes(text: str) -> dict[str, int]:
    """``--batch-sizes``: ``"resnet50=16,gpt2=8"`` -> ``{"resnet50": 16, "gpt2": 8}``."""
    return _per_model(text, _batch_size)


def parser(description: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description or __doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=None, help=f"comma-separated (default {','.join(DEFAULT_MODELS)}; "
                                                  "any zoo name or gpt2)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds (default 5; --quick 1)")
    p.add_argument("--steps-per-round", type=int, default=None, help="steps per configuration per round (default 2)")
    p.add_argument("--quick", action="store_true",
                   help="smoke mode: the zoo mlp, 1 round, one compile budget (aot_eager_decomp_partition backend), "
                        "one autoremat budget, a small batch-size task")
    p.add_argument("--out", type=Path, default=None, help=f"output folder (default {DEFAULT_OUT.relative_to(ROOT)})")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (default 1: on a shared 2-core machine more threads make timings "
                        "erratic)")
    p.add_argument("--compile-backend", default=None,
                   help="torch.compile backend (default inductor; --quick aot_eager_decomp_partition)")
    p.add_argument("--compile-budgets", default=None, help="comma-separated activation_memory_budget values")
    p.add_argument("--compile-timeout", type=float, default=150.0,
                   help="seconds one compile may take before it is abandoned and the model's other budgets skipped "
                        "(0: no limit)")
    p.add_argument("--budgets", default=None, help="autoremat budgets as fractions of the unoptimised peak")
    p.add_argument("--solvers", default=None, help="comma-separated solvers (default: all registered but 'none')")
    p.add_argument("--solver-timeout", type=float, default=60.0,
                   help="seconds one solve may take (forked child, killed after; 0: in process, no limit)")
    p.add_argument("--configs", default=None, help="only these families: pytorch,compile,autoremat")
    p.add_argument("--no-batch", action="store_true", help="skip the largest-batch comparison")
    p.add_argument("--no-match", action="store_true",
                   help="skip the autoremat rows at the lowest eager PyTorch peak (autoremat:<solver>@match)")
    p.add_argument("--batch-budgets", default="", help="e.g. resnet50=16MiB,gpt2=48MiB")
    p.add_argument("--batch-sizes", default="",
                   help="MODEL=N,...: step-time tables at these batch sizes instead of the models' own "
                        "(e.g. resnet50=16)")
    p.add_argument("--torch-regions", default="dp-approx@0.5",
                   help="SOLVER@FRACTION,...: also run these autoremat rows on torch.utils.checkpoint regions "
                        "(apply(..., regions='torch')); 'none' for no such row")
    p.add_argument("--compiled-plans", default="dp-approx@0.5,dp-approx@0.3",
                   help="SOLVER@FRACTION,...: also run these autoremat rows under torch.compile (the patched model "
                        "compiled with --compile-backend, activation_memory_budget 1.0); 'none' for no such row")
    p.add_argument("--batch-only", action="store_true",
                   help="only the largest-batch comparison, merged into the existing compare.json under --out "
                        "(the step-time tables are kept as they were measured)")
    p.add_argument("--render", type=Path, default=None, metavar="COMPARE_JSON",
                   help="only rewrite RESULTS.md and the plots from an existing compare.json")
    return p


def options_from(a: argparse.Namespace, *, device: str = "cpu", size: str = "small") -> tuple[list[str], Options]:
    models = ([m.strip() for m in a.models.split(",") if m.strip()] if a.models is not None
              else list(QUICK_MODELS if a.quick else DEFAULT_MODELS))
    batch = {"mlp": 512} if a.quick else {}  # the zoo mlp's own batch (32) leaves nothing to recompute
    batch.update(_batch_sizes(a.batch_sizes))
    opts = Options(
        rounds=a.rounds or (1 if a.quick else 5),
        steps_per_round=a.steps_per_round or (1 if a.quick else 2),
        compile_budgets=_floats(a.compile_budgets) if a.compile_budgets else ((0.5,) if a.quick else COMPILE_BUDGETS),
        compile_backend=a.compile_backend or ("aot_eager_decomp_partition" if a.quick else "inductor"),
        compile_timeout_s=a.compile_timeout or None,
        autoremat_budgets=_floats(a.budgets) if a.budgets else ((0.5,) if a.quick else AUTOREMAT_BUDGETS),
        solvers=tuple(a.solvers.split(",")) if a.solvers else None,
        solver_timeout_s=a.solver_timeout or None,
        size=size, device=device, batch=batch,
        configs=tuple(a.configs.split(",")) if a.configs else None,
        match_pytorch=not a.no_match,
        torch_regions=_solver_fractions(a.torch_regions),
        compiled_plans=_solver_fractions(a.compiled_plans, "--compiled-plans"),
    )
    return models, opts


def _solver_fractions(text: str | None, flag: str = "--torch-regions") -> tuple[tuple[str, float], ...]:
    """``"dp-approx@0.5,chen@0.3"`` -> ``(("dp-approx", 0.5), ("chen", 0.3))``; ``"none"`` -> ``()``."""
    if not text or text.strip().lower() == "none":
        return ()
    out = []
    for part in text.split(","):
        solver, sep, frac = part.strip().partition("@")
        if not sep:
            raise SystemExit(f"{flag}: {part!r} is not SOLVER@FRACTION (e.g. dp-approx@0.5)")
        out.append((solver, float(frac)))
    return tuple(out)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = parser()
    a = p.parse_args(argv)
    if a.render:
        return render(a.render)
    if a.batch_only and a.no_batch:
        p.error("--batch-only and --no-batch exclude each other")
    torch.set_num_threads(max(1, a.threads))
    models, opts = options_from(a)
    out = a.out or (DEFAULT_OUT / "compare_quick" if a.quick else DEFAULT_OUT)
    command = "python benchmarks/compare.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if a.batch_only:
        return run_batch_only(out, opts, quick=a.quick, command=command.strip(), batch_budgets=_sizes(a.batch_budgets),
                              log=lambda s: print(s, flush=True))
    return run(models, opts, out, batch=not a.no_batch, quick=a.quick, command=command.strip(),
               batch_budgets=_sizes(a.batch_budgets), log=lambda s: print(s, flush=True))


if __name__ == "__main__":
    main()
