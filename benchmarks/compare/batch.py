"""The largest batch under one memory budget: ``AutoRemat(raise_batch_size=True)`` against Lightning's
``BatchSizeFinder``, the budget enforced by a simulated out-of-memory device (``SimulatedDevice``)."""

from __future__ import annotations

import contextlib
import inspect
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import autoremat
from autoremat.measure import LiveStorageCounter
from autoremat.resident import resident_bytes as _resident_bytes, storage_bytes

from .model import _err
from .settings import BATCH_FIELDS


class SimulatedOOMCounter(LiveStorageCounter):
    """A live-storage counter that fails like the CPU allocator once its live bytes pass ``limit``."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = int(limit)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        # a gradient sum the engine makes in place without a dispatch mode counts at its in-place
        # level, and at its counted one once settled out of place (as tests/_oom.py's device)
        settled = self._settle()
        if settled is not None and settled > self.limit:
            raise self._full(settled)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.live - self.accumulation_slack() > self.limit:
            raise self._full(self.live - self.accumulation_slack())
        return out

    def _full(self, level: int) -> RuntimeError:
        return RuntimeError(f"DefaultCPUAllocator: can't allocate memory: you tried to allocate more than the "
                            f"simulated device holds ({level} bytes live in this step, limit {self.limit})")


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
    """autoremat's trial steps (``trial_step``: one forward+backward of the patched module on a
    real batch of the size being tried) run under a :class:`SimulatedOOMCounter` with limit
    ``capacity`` minus :func:`resident_bytes` of the LightningModule minus the trial inputs."""
    from autoremat.integrations import lightning as lit

    original = lit.trial_step

    def trial(target: nn.Module, args: tuple, kwargs: dict, loss_fn: Callable, trainer: Any) -> int | None:
        base = resident_bytes(trainer.lightning_module, trainer.optimizers) + storage_bytes((args, kwargs))
        with SimulatedOOMCounter(capacity - base):
            return original(target, args, kwargs, loss_fn, trainer)

    lit.trial_step = trial
    try:
        yield
    finally:
        lit.trial_step = original


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
