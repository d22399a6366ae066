"""``AutoRemat``: a Lightning callback that profiles, solves, patches and raises the batch size.

Modelled on Lightning's ``BatchSizeFinder``: a thin callback that validates in ``setup``, does
its work in ``on_fit_start`` (before the first optimisation step, so no step runs unpatched and
no state is lost), keeps its plan and batch size in its ``state_dict`` (a resumed run applies
them without profiling again) and restores the model when fitting ends.

What it does in ``on_fit_start``:

1. takes the first batch of the training dataloader and records the positional and keyword
   inputs of the module to optimise (``module=``, default the LightningModule) by running
   ``training_step`` once without gradients (``self.log`` is silenced for that call; other side
   effects of ``training_step`` happen, so keep it free of them or check
   ``torch.is_grad_enabled()``; it is called again for each batch size tried when raising);
2. captures that module on those inputs under the trainer's precision context (autocast), with
   ``profile_steps`` timed repeats, and measures what is resident before a step (parameters,
   optimizer state, the batch, and under automatic optimisation the previous step's
   gradients, which Lightning frees only after ``training_step``);
3. converts the device budget to a step-peak budget (``"auto"``: free device memory, or
   available host memory on a CPU, minus a margin, minus the resident bytes; a size or byte
   count: minus the resident bytes; a percentage: of the unoptimised step peak), solves, applies;
4. with ``raise_batch_size``: scales the graph's activation bytes with the batch size (they are
   proportional to it; parameter bytes are not), finds the largest batch whose plan fits
   (doubling, then bisection, capped by ``max_batch_size`` and the dataset length), sets it the
   way Lightning does (``batch_size`` on the model, its ``hparams`` or the datamodule), rebuilds
   the dataloaders and confirms with a trial step of the patched module on a real batch of the
   new size (its measured step peak must meet the budget); on out-of-memory (CUDA OOM, or the CPU allocator's "can't allocate memory") or a
   measured peak above the budget it backs off by bisection toward the last size that fitted.
   Model and optimizer state are never changed by any of this (capture restores RNG, buffers
   and gradients; no optimizer step is taken).

Under DDP rank zero profiles and solves; plan and batch size are broadcast, so every rank runs
the same plan. Everything user-facing is printed on rank zero only.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .._units import fmt_bytes
from ..budget import ACCEPTED_FORMS, parse_budget
from ..capture._recorder import preserved_state, tensors_in
from ..capture.scaled import capture_within, profile_limit_bytes
from ..errors import InfeasibleBudgetError
from ..graph import Graph
from ..measure import LiveStorageCounter, default_loss, run_step
from ..offload.bandwidth import measure_bandwidth
from ..plan import Plan
from ..runtime import REGION_MODES, apply, is_patched, restore
from ..simulate import simulate, unoptimised_peak_bytes
from ..solvers import OFFLOAD_ONLY, SOLVERS, solve

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr, lightning_setattr
    from lightning.pytorch.utilities.rank_zero import rank_zero_info
except ImportError as exc:  # pragma: no cover - lightning is a hard dependency
    raise ImportError("autoremat.AutoRemat needs lightning (pip install lightning)") from exc

__all__ = ["AutoRemat", "scale_graph", "is_oom", "optimizer_state_bytes"]

logger = logging.getLogger(__name__)

_OOM_MARKERS = ("out of memory", "can't allocate memory", "cannot allocate memory")
_STATE_VERSION = 1


def is_oom(err: BaseException) -> bool:
    """Whether ``err`` is an out-of-memory error (CUDA, or the CPU allocator's)."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    return isinstance(err, RuntimeError) and any(m in str(err).lower() for m in _OOM_MARKERS)


def scale_graph(graph: Graph, factor: float) -> Graph:
    """A copy of ``graph`` with every activation-sized quantity multiplied by ``factor``.

    Outputs, saved tensors, workspace and times scale with the batch; parameters do not.
    """
    g = graph.copy()
    for v in g.nodes:
        d = g.node(v)
        for key in ("out_bytes", "alloc_bytes", "extra_saved_bytes", "fwd_temp_bytes", "bwd_temp_bytes"):
            d[key] = int(math.ceil(d[key] * factor))
        d["time_s"] *= factor
        d["bwd_time_s"] *= factor
    for key in ("loss_extra_bytes", "loss_fwd_temp_bytes", "loss_bwd_temp_bytes"):
        g.meta[key] = int(math.ceil(g.meta[key] * factor))
    g._refresh()
    return g


class AutoRemat(Callback):
    """Fit the training step into a memory budget by recomputation, and raise the batch size.

    Args:
        budget: device memory budget: ``"auto"`` (free device memory minus a margin), bytes,
            a size string (``"6GB"``, ``"512MiB"``) or a fraction of the unoptimised step peak
            (``"50%"``, ``0.5``).
        solver: a name of :data:`autoremat.SOLVERS` or ``"auto"``.
        offload: ``"auto"``: the ``"combined"`` planner (recomputation plus offload to pinned host
            memory) takes part when the module runs on CUDA; ``True``: always plan with it;
            ``False``: recomputation only.
        profile_steps: timed repeats when profiling the first batch (``>= 1``).
        raise_batch_size: raise the batch size to the largest whose plan fits.
        max_batch_size: upper bound when raising (default 8192, as Lightning's tuner).
        batch_arg_name: the attribute holding the batch size (model, hparams or datamodule).
        module: dotted path of the submodule to optimise, e.g. ``"model"``; default the
            LightningModule itself.
        loss_fn: maps the module's output to the scalar to backpropagate while profiling
            (default: :func:`autoremat.measure.default_loss`).
        verbose: print a summary table on rank zero.
        regions: how recomputed segments run: ``"lean"`` (autoremat's own checkpoint, little
            work per saved tensor) or ``"torch"`` (``torch.utils.checkpoint``); see
            :func:`autoremat.apply`.
    """

    def __init__(
        self,
        budget: int | float | str = "auto",
        solver: str = "auto",
        offload: bool | str = "auto",
        profile_steps: int = 3,
        raise_batch_size: bool = True,
        max_batch_size: int = 8192,
        batch_arg_name: str = "batch_size",
        module: str | None = None,
        loss_fn: Callable[[Any], torch.Tensor] | None = None,
        verbose: bool = True,
        regions: str = "lean",
    ) -> None:
        super().__init__()
        if regions not in REGION_MODES:
            raise ValueError(f"regions={regions!r} must be one of {REGION_MODES}")
        if isinstance(budget, bool) or not isinstance(budget, (int, float, str)):
            raise ValueError(f"budget={budget!r} is not understood; expected {ACCEPTED_FORMS}")
        if isinstance(budget, str) and budget.strip().lower() != "auto":
            parse_budget(budget, unoptimised_peak_bytes=1)  # syntax check now, not mid-run
        if solver != "auto" and solver not in SOLVERS:
            raise ValueError(f"solver={solver!r} is not registered; expected 'auto' or one of {sorted(SOLVERS)}")
        if offload not in ("auto", True, False):
            raise ValueError(f"offload={offload!r} must be 'auto' (offload where a GPU makes it pay), True or False")
        if offload is False and solver in OFFLOAD_ONLY:
            raise ValueError(f"solver={solver!r} plans offloads, which offload=False forbids; pick a recomputation "
                             "solver (e.g. 'dp-approx') or leave offload='auto'")
        if not isinstance(profile_steps, int) or profile_steps < 1:
            raise ValueError(f"profile_steps={profile_steps!r} must be an int >= 1")
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size!r} must be an int >= 1")
        if module is not None and not isinstance(module, str):
            raise ValueError(f"module={module!r} must be a dotted attribute path such as 'model', or None")
        self.budget = budget
        self.solver = solver
        self.offload = offload
        self.profile_steps = profile_steps
        self.raise_batch_size = raise_batch_size
        self.max_batch_size = max_batch_size
        self.batch_arg_name = batch_arg_name
        self.module = module
        self.loss_fn = loss_fn
        self.verbose = verbose
        self.regions = regions
        self.plan: Plan | None = None
        self.batch_size: int | None = None
        self.original_batch_size: int | None = None
        self.step_budget_bytes: int | None = None
        self.summary: dict[str, Any] = {}
        self._target: nn.Module | None = None

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        return {"version": _STATE_VERSION, "plan": None if self.plan is None else self.plan.to_dict(),
                "batch_size": self.batch_size, "original_batch_size": self.original_batch_size,
                "step_budget_bytes": self.step_budget_bytes}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("version") != _STATE_VERSION:
            raise ValueError(f"AutoRemat state version {state_dict.get('version')!r} is not supported")
        self.plan = None if state_dict.get("plan") is None else Plan.from_dict(state_dict["plan"])
        self.batch_size = state_dict.get("batch_size")
        self.original_batch_size = state_dict.get("original_batch_size")
        self.step_budget_bytes = state_dict.get("step_budget_bytes")

    # ------------------------------------------------------------------ hooks
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage != "fit":
            return
        strategy = type(trainer.strategy).__name__
        if not any(s in strategy for s in ("SingleDevice", "DDP")) or "Sharded" in strategy:
            raise ValueError(f"AutoRemat supports single-device and DDP strategies, not {strategy}; "
                             "FSDP/DeepSpeed shard activations their own way")
        if self.offload is True and trainer.strategy.root_device.type != "cuda":
            raise ValueError(f"offload=True needs a CUDA device (this run is on {trainer.strategy.root_device}): "
                             "without separate device memory, offloading saves nothing; use offload='auto' or False")
        target = self._resolve(pl_module)
        if is_patched(target):
            raise ValueError(f"module {self.module or type(pl_module).__name__} is already patched by autoremat; "
                             "use one AutoRemat callback per module")
        if self.raise_batch_size and self.plan is None and not lightning_hasattr(pl_module, self.batch_arg_name):
            raise ValueError(f"raise_batch_size=True needs a `{self.batch_arg_name}` attribute on the model, its "
                             "hparams or the datamodule (as Lightning's BatchSizeFinder does); add one or pass "
                             "raise_batch_size=False")
        if trainer.accumulate_grad_batches != 1 and self.raise_batch_size:
            raise ValueError("raise_batch_size=True with accumulate_grad_batches > 1 is not supported; "
                             "pass raise_batch_size=False")

    def _resolve(self, pl_module: nn.Module) -> nn.Module:
        if self.module is None:
            return pl_module
        obj: Any = pl_module
        for part in self.module.split("."):
            if not hasattr(obj, part):
                raise ValueError(f"module={self.module!r}: {type(obj).__name__} has no attribute {part!r}")
            obj = getattr(obj, part)
        if not isinstance(obj, nn.Module):
            raise ValueError(f"module={self.module!r} is a {type(obj).__name__}, not a torch.nn.Module")
        return obj

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._target = self._resolve(pl_module)
        if self.plan is not None:  # resumed: reuse plan and batch size, no profiling
            if self.batch_size is not None and lightning_hasattr(pl_module, self.batch_arg_name):
                if lightning_getattr(pl_module, self.batch_arg_name) != self.batch_size:
                    lightning_setattr(pl_module, self.batch_arg_name, self.batch_size)
                    _reset_dataloaders(trainer)
            apply(self._target, self.plan, regions=self.regions)
            rank_zero_info(f"AutoRemat: resumed {self.plan.describe()} (batch size {self.batch_size})")
            return
        if trainer.fit_loop._combined_loader is None:
            trainer.fit_loop.setup_data()  # every rank: it synchronises under DDP
        payload = None
        if trainer.is_global_zero:
            payload = self._profile_and_solve(trainer, pl_module)
        payload = trainer.strategy.broadcast(payload, src=0)
        plan = Plan.from_dict(payload["plan"])
        if payload["batch_size"] is not None and lightning_hasattr(pl_module, self.batch_arg_name):
            if lightning_getattr(pl_module, self.batch_arg_name) != payload["batch_size"]:
                lightning_setattr(pl_module, self.batch_arg_name, payload["batch_size"])
                _reset_dataloaders(trainer)
        if not is_patched(self._target):
            apply(self._target, plan, regions=self.regions)
        self.plan = plan
        self.batch_size = payload["batch_size"]
        self.original_batch_size = payload["original_batch_size"]
        self.step_budget_bytes = payload["step_budget_bytes"]
        self.summary = payload["summary"]
        if self.verbose and trainer.is_global_zero:
            self._print_summary()

    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._target is not None:
            restore(self._target)

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        if self._target is not None:
            restore(self._target)

    # ------------------------------------------------------------------ the work (rank zero)
    def _profile_and_solve(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> dict[str, Any]:
        assert self._target is not None, "on_fit_start resolves the target first, please report"
        target = self._target
        args, kwargs, batch_bytes = self._record_inputs(trainer, pl_module)
        loss_fn = self.loss_fn or default_loss
        resident = _resident_bytes(pl_module, trainer) + batch_bytes
        device = _device_of(target, args, kwargs)
        limit = profile_limit_bytes(self.budget, device=device, resident_bytes=resident)
        with trainer.precision_plugin.forward_context():  # never an unpatched step above the device budget
            graph = capture_within(target, args, kwargs, limit_bytes=limit, loss_fn=loss_fn,
                                   repeats=self.profile_steps, warmup=1)
        if device.type == "cuda" and self.offload is not False:
            # offload plans are simulated (and solved) at this machine's host<->device link
            graph.meta["bandwidth_bytes_per_s"] = measure_bandwidth(device)
        step_budget = self._step_budget(graph, device, resident)
        plan = self._solve(graph, step_budget)
        batch_size = original = (lightning_getattr(pl_module, self.batch_arg_name)
                                 if lightning_hasattr(pl_module, self.batch_arg_name) else None)
        if self.raise_batch_size and original is not None:
            batch_size, plan, graph = self._raise(trainer, pl_module, graph, plan, int(original), step_budget,
                                                  loss_fn, resident, batch_bytes)
        sim = simulate(graph, plan, check=False, record=False)
        vanilla = unoptimised_peak_bytes(graph)  # at the final batch size
        measured = self._measure_patched(target, trainer, pl_module, plan, loss_fn, batch_size)
        summary = {
            "solver": plan.solver, "segments": len(plan.segments), "recomputed": len(plan.recompute_segments),
            "graph_nodes": len(graph), "graph_mode": graph.meta["mode"],
            "step_budget_bytes": step_budget, "resident_bytes": resident,
            "unoptimised_peak_bytes": vanilla, "predicted_peak_bytes": sim.peak_bytes,
            "measured_peak_bytes": measured, "predicted_overhead": sim.extra_time_s / max(sim.step_time_s - sim.extra_time_s, 1e-12),
            "batch_size_before": original, "batch_size_after": batch_size,
        }
        return {"plan": plan.to_dict(), "batch_size": batch_size, "original_batch_size": original,
                "step_budget_bytes": step_budget, "summary": summary}

    def _solve(self, graph: Graph, step_budget: int) -> Plan:
        kwargs: dict[str, Any] = {}
        solver = self.solver
        if self.offload is False and solver == "auto":
            kwargs["auto_solvers"] = [n for n in SOLVERS if n != "combined"]
        elif self.offload is True and solver in ("auto", "combined"):
            solver, kwargs["offload"] = "combined", True
        elif self.offload is True and solver in OFFLOAD_ONLY:
            kwargs["offload"] = True
        try:
            return solve(graph, step_budget, solver=solver, **kwargs)
        except InfeasibleBudgetError as err:
            raise InfeasibleBudgetError(step_budget, err.min_budget_bytes, solver=f"AutoRemat/{self.solver}") from err

    def _step_budget(self, graph: Graph, device: torch.device, resident: int) -> int:
        b = self.budget
        if isinstance(b, str) and b.strip().lower() == "auto":
            return parse_budget("auto", device=device, resident_bytes=0)  # free memory already excludes resident
        if isinstance(b, float) or (isinstance(b, str) and b.strip().endswith("%")):
            return parse_budget(b, unoptimised_peak_bytes=unoptimised_peak_bytes(graph))
        step = parse_budget(b) - resident
        if step <= 0:
            raise ValueError(f"budget={b!r} is below what is resident before a step ({fmt_bytes(resident)}: "
                             "parameters, optimizer state, the batch); raise it")
        return step

    def _record_inputs(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                       size: int | None = None) -> tuple[tuple, dict, int]:
        """Inputs of the target module in ``training_step`` on a real batch (of ``size`` rows)."""
        assert self._target is not None, "please report"
        batch = _batch_of(trainer, size)
        batch_bytes = sum(t.untyped_storage().nbytes() for t in tensors_in(batch))
        seen: dict[str, Any] = {}

        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if "args" not in seen:
                seen["args"], seen["kwargs"] = args, dict(kwargs)

        handle = self._target.register_forward_pre_hook(hook, with_kwargs=True)
        device = _device_of(self._target, (), {})
        try:
            with preserved_state(pl_module, [device]), torch.no_grad(), _silenced_logging(pl_module), \
                    trainer.precision_plugin.forward_context():
                pl_module.training_step(batch, 0)
        finally:
            handle.remove()
        if "args" not in seen:
            raise ValueError(f"training_step never called module {self.module or type(pl_module).__name__}; "
                             "pass module= the submodule your training_step runs")
        return tuple(seen["args"]), seen["kwargs"], batch_bytes

    def _measure_patched(self, target: nn.Module, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                         plan: Plan, loss_fn: Callable[[Any], torch.Tensor], size: int | None) -> int | None:
        """Measured step peak of the patched target on a real batch of ``size`` rows."""
        args, kwargs, _ = self._record_inputs(trainer, pl_module, size)
        was = is_patched(target)
        if not was:
            apply(target, plan, regions=self.regions)
        try:
            return _trial_step(target, args, kwargs, loss_fn, trainer)
        finally:
            if not was:
                restore(target)

    def _raise(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", graph: Graph, plan: Plan,
               original: int, step_budget: int, loss_fn: Callable[[Any], torch.Tensor], resident: int,
               batch_bytes: int) -> tuple[int, Plan, Graph]:
        """Largest batch size whose plan fits, confirmed by a trial step; backs off on OOM."""
        limit = self.max_batch_size
        length = _dataset_length(trainer)
        if length is not None:
            limit = min(limit, length)

        def fits(size: int) -> bool:
            g = scale_graph(graph, size / original)
            extra_batch = batch_bytes * (size / original - 1)
            try:
                solve(g, int(step_budget - max(0.0, extra_batch)), solver=self.solver)
                return True
            except InfeasibleBudgetError:
                return False

        best = original
        size = original
        while size < limit:  # doubling
            nxt = min(limit, size * 2)
            if not fits(nxt):
                break
            best = size = nxt
        lo, hi = best, min(limit, size * 2) if best < limit else best
        while hi - lo > 1:  # bisection between the last fit and the first miss
            mid = (lo + hi) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid
        # Confirm with real trial steps: bisection between the last confirmed size and the
        # first size that failed (out of memory, or a measured peak over the budget).
        confirmed: tuple[int, Plan, Graph] | None = None
        good, bad = original, lo + 1
        candidate = lo
        while candidate > good:
            outcome = self._try_size(trainer, pl_module, graph, candidate, original, step_budget, loss_fn,
                                     batch_bytes)
            if outcome is not None:
                confirmed = (candidate, outcome[0], outcome[1])
                good = candidate
            else:
                bad = candidate
            candidate = (good + bad) // 2
        if confirmed is not None:
            return confirmed
        return original, plan, graph

    def _try_size(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", graph: Graph, size: int,
                  original: int, step_budget: int, loss_fn: Callable[[Any], torch.Tensor],
                  batch_bytes: int) -> tuple[Plan, Graph] | None:
        """Set the batch size, solve the scaled graph, and confirm with a patched trial step."""
        assert self._target is not None, "please report"
        target = self._target
        budget = int(step_budget - max(0.0, batch_bytes * (size / original - 1)))
        scaled = scale_graph(graph, size / original)
        try:
            plan = self._solve(scaled, budget)
            args, kwargs, _ = self._record_inputs(trainer, pl_module, size)
            apply(target, plan, regions=self.regions)
            try:
                peak = _trial_step(target, args, kwargs, loss_fn, trainer)
            finally:
                restore(target)
        except InfeasibleBudgetError as err:
            logger.info("AutoRemat: batch size %d does not fit (%s); backing off", size, err)
            return None
        except (RuntimeError, torch.OutOfMemoryError) as err:
            if not is_oom(err):
                raise
            logger.info("AutoRemat: batch size %d ran out of memory in the trial step; backing off", size)
            _empty_cache()
            return None
        if peak is not None and peak > budget:
            logger.info("AutoRemat: batch size %d measured %d bytes over a %d-byte step budget; backing off",
                        size, peak, budget)
            return None
        return plan, scaled

    # ------------------------------------------------------------------ output
    def _print_summary(self) -> None:
        from rich.console import Console
        from rich.table import Table

        s = self.summary
        table = Table(title="AutoRemat")
        table.add_column("")
        table.add_column("value", justify="right")
        rows = [
            ("solver", f"{s['solver']} ({s['graph_mode']} graph, {s['graph_nodes']} nodes)"),
            ("segments (recomputed)", f"{s['segments']} ({s['recomputed']})"),
            ("resident before a step", fmt_bytes(s["resident_bytes"])),
            ("step-peak budget", fmt_bytes(s["step_budget_bytes"])),
            (f"unoptimised step peak (batch {s['batch_size_after']})", fmt_bytes(s["unoptimised_peak_bytes"])),
            ("predicted step peak", fmt_bytes(s["predicted_peak_bytes"])),
            ("measured step peak", "n/a" if s["measured_peak_bytes"] is None else fmt_bytes(s["measured_peak_bytes"])),
            ("predicted time overhead", f"{s['predicted_overhead']:.1%}"),
            ("batch size", f"{s['batch_size_before']} -> {s['batch_size_after']}"),
        ]
        for k, v in rows:
            table.add_row(k, str(v))
        Console().print(table)


@contextlib.contextmanager
def _silenced_logging(pl_module: nn.Module) -> Iterator[None]:
    """``self.log`` outside a loop raises in Lightning; silence it for the recording call."""
    saved = {k: pl_module.__dict__.get(k) for k in ("log", "log_dict")}
    pl_module.__dict__["log"] = lambda *a, **k: None
    pl_module.__dict__["log_dict"] = lambda *a, **k: None
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                del pl_module.__dict__[k]
            else:
                pl_module.__dict__[k] = v


def _trial_step(target: nn.Module, args: tuple, kwargs: dict, loss_fn: Callable[[Any], torch.Tensor],
                trainer: "pl.Trainer") -> int | None:
    """One forward+backward of ``target``; returns its step peak. RNG, buffers and gradients
    are put back, so training is unaffected."""
    device = _device_of(target, args, kwargs)
    with preserved_state(target, [device]):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            with trainer.precision_plugin.forward_context():
                run_step(target, args, kwargs, loss_fn)
            torch.cuda.synchronize(device)
            return int(torch.cuda.max_memory_allocated(device) - base)
        counter = LiveStorageCounter()
        with counter, trainer.precision_plugin.forward_context():
            run_step(target, args, kwargs, loss_fn)
        return int(counter.peak)


def _batch_of(trainer: "pl.Trainer", size: int | None) -> Any:
    """A real training batch, on the device; with ``size``, built from as many batches of the
    training dataloader as needed (tensors concatenated along the first dimension)."""
    from torch.utils._pytree import tree_flatten, tree_unflatten

    dataloader = trainer.train_dataloader
    if dataloader is None:
        raise ValueError("AutoRemat needs a training dataloader to profile on")
    it = iter(dataloader)
    first = next(it)
    if size is None:
        return trainer.strategy.batch_to_device(first)
    leaves, spec = tree_flatten(first)
    columns = [[leaf] for leaf in leaves]
    rows = next((leaf.shape[0] for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.dim()), 0)
    while rows < size:
        try:
            more, _ = tree_flatten(next(it))
        except StopIteration:
            break
        for col, leaf in zip(columns, more):
            col.append(leaf)
        rows += next((leaf.shape[0] for leaf in more if isinstance(leaf, torch.Tensor) and leaf.dim()), 0)
    merged = [torch.cat(col)[:size] if isinstance(col[0], torch.Tensor) and col[0].dim() else col[0]
              for col in columns]
    return trainer.strategy.batch_to_device(tree_unflatten(merged, spec))


def _resident_bytes(pl_module: nn.Module, trainer: "pl.Trainer") -> int:
    params = sum(p.untyped_storage().nbytes() for p in pl_module.parameters())
    buffers = sum(b.untyped_storage().nbytes() for b in pl_module.buffers())
    opt_state = sum(optimizer_state_bytes(opt) for opt in trainer.optimizers)
    # Lightning's automatic optimisation zeroes gradients inside the closure *after*
    # training_step, so the previous step's gradients are still allocated during the forward.
    grads = 0
    if getattr(pl_module, "automatic_optimization", False):
        grads = sum(p.numel() * p.element_size() for p in pl_module.parameters() if p.requires_grad)
    return int(params + buffers + opt_state + grads)


_LAZY_STATE_SLOTS = {"Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2, "Adadelta": 2, "Rprop": 2}


def optimizer_state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of ``opt``'s state; before its first step (state is created lazily) an estimate from
    its type: Adam-family two tensors per parameter, SGD with momentum one, RMSprop one to three."""
    present = sum(t.untyped_storage().nbytes() for st in opt.state.values() for t in tensors_in(st))
    if present or not opt.param_groups:
        return int(present)
    total = 0
    for group in opt.param_groups:
        slots = _LAZY_STATE_SLOTS.get(type(opt).__name__, 0)
        if type(opt).__name__ == "SGD" and group.get("momentum", 0):
            slots = 1
        if type(opt).__name__ == "RMSprop":
            slots = 1 + bool(group.get("momentum", 0)) + bool(group.get("centered", False))
        total += slots * sum(p.numel() * p.element_size() for p in group["params"] if p.requires_grad)
    return int(total)


def _device_of(module: nn.Module, args: tuple, kwargs: dict) -> torch.device:
    for p in module.parameters():
        return p.device
    for t in tensors_in((args, kwargs)):
        return t.device
    return torch.device("cpu")


def _dataset_length(trainer: "pl.Trainer") -> int | None:
    loader = trainer.fit_loop._combined_loader
    if loader is None:
        return None
    try:
        return int(loader._dataset_length())
    except (NotImplementedError, TypeError):
        return None


def _reset_dataloaders(trainer: "pl.Trainer") -> None:
    loop = trainer.fit_loop
    loop._combined_loader = None
    loop.setup_data()
    val = loop.epoch_loop.val_loop
    val._combined_loader = None
    val.setup_data()


def _empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
