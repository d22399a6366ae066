"""The callback's real steps on a batch: recording the target's inputs in ``training_step``, and
confirming the chosen plan with a measured step (backing off when it runs out of memory)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..capture.param_writes import written_first
from ..capture.preserved import preserved_state
from ..capture.scaled.limits import is_oom
from ..errors import InfeasibleBudgetError
from ..graph import Graph
from ..measure import profiling_run
from ..plan import Plan
from ..resident import device_of, storage_bytes
from ..runtime import apply, is_patched, restore
from ._planning import BACK_OFF, CONFIRM_TRIES
from ._lightning_trainer import batch_of, silenced_logging, trial_step

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from .lightning import AutoRemat

from lightning.pytorch.utilities.memory import garbage_collection_cuda, is_oom_error
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

__all__ = ["record_inputs", "calls_per_step", "confirmed", "try_size", "CONFIRM_TRIES"]

logger = logging.getLogger("autoremat.integrations.lightning")  # the callback's own log


class _Recorded(Exception):
    """Raised by the recording hook once the target's inputs are held: the rest of the step is
    not needed (and, at the user's batch, may not fit the device)."""


@profiling_run
def record_inputs(cb: "AutoRemat", trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                  size: int | None = None, *, choose: bool = False) -> tuple[tuple, dict, int]:
    """Inputs of the target module in ``training_step`` on a real batch (of ``size`` rows).

    ``training_step`` runs without gradients only up to the target's first call: a pre-hook keeps
    its inputs and stops the step there, so the target never runs at the user's batch here
    (profiling decides what runs at which size, :func:`~autoremat.capture.capture_within`). Where
    the part of the step before the target runs out of memory, the module is left as it was
    (state preserved, allocator emptied) and a ``torch.OutOfMemoryError`` says what to change.

    ``choose`` (no ``module=`` given): where ``training_step`` calls a submodule with trainable
    parameters before (or instead of) the LightningModule's own ``forward`` (``self.unet(...)``),
    the first such call's module becomes the target, ``cb.module`` its path, said in the log."""
    assert cb._target is not None, "please report"
    seen: dict[str, Any] = {}
    candidates = [(cb.module or "", cb._target)]
    if choose and cb.module is None:
        candidates += [(path, m) for path, m in pl_module.named_modules()
                       if path and any(p.requires_grad for p in m.parameters())
                       and not isinstance(m, torch.jit.ScriptModule)]  # (takes no hooks)

    def hook_for(path: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if "args" not in seen:
                seen["args"], seen["kwargs"], seen["path"], seen["module"] = args, dict(kwargs), path, module
            raise _Recorded
        return hook

    device = device_of(cb._target)
    handles = [m.register_forward_pre_hook(hook_for(path), with_kwargs=True) for path, m in candidates]
    try:
        with _own_step(trainer, pl_module, device):
            batch = batch_of(trainer, size)
            pl_module.training_step(batch, 0)
    except _Recorded:
        pass
    except RuntimeError as err:  # torch.OutOfMemoryError is a RuntimeError
        if not (is_oom(err) or is_oom_error(err)):
            raise
        seen.clear()
        if device.type == "cuda":
            garbage_collection_cuda()
        raise torch.OutOfMemoryError(
            f"AutoRemat: recording the inputs of {cb.module or type(pl_module).__name__} ran out of memory before "
            f"the model was called (loading the batch{'' if size is None else f' of {size} rows'} and the part of "
            f"training_step before it, without gradients: {str(err).splitlines()[0][:1000]}); the module is left "
            "as it was. Lower the batch size, move that work into the model or the dataloader, or pass module= "
            "the submodule that needs planning") from err
    finally:
        for handle in handles:
            handle.remove()
    if "args" not in seen:
        raise ValueError(f"training_step never called module {cb.module or type(pl_module).__name__}"
                         + (" nor any submodule with trainable parameters" if len(candidates) > 1 else "")
                         + "; pass module= the submodule your training_step runs")
    if seen["module"] is not cb._target:
        _chose(cb, pl_module, seen["path"], seen["module"])
    return tuple(seen["args"]), seen["kwargs"], storage_bytes(batch)


@contextlib.contextmanager
def _own_step(trainer: "pl.Trainer", pl_module: "pl.LightningModule", device: torch.device) -> Iterator[None]:
    """Where the callback runs ``training_step`` itself (:func:`record_inputs`,
    :func:`calls_per_step`): the module's state preserved (parameters, buffers, RNG, and its and
    its submodules' other attributes, the LightningModule's private ones too:
    :func:`~autoremat.capture.preserved.kept_attributes`), no gradients, ``self.log`` silenced,
    under the trainer's precision."""
    with preserved_state(pl_module, [device], private_root=True), torch.no_grad(), silenced_logging(pl_module), \
            trainer.precision_plugin.forward_context(), written_first(pl_module.parameters()):
        yield


COUNT_ROWS = 2
"""Rows of the batch :func:`calls_per_step` runs ``training_step`` on (batch norm trains on two)."""


@profiling_run
def calls_per_step(cb: "AutoRemat", trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> int:
    """How many times ``training_step`` calls the target (a contrastive model's encoder on two
    views, a discriminator on real and generated images): each call's activations stay until the
    backward, so an absolute budget is shared between the calls
    (:func:`~autoremat.integrations._planning.plan_within`).

    Counted on a batch of :data:`COUNT_ROWS` rows (cheap at any batch size), without gradients,
    the module's state preserved, up to the first ``manual_backward`` (manual optimisation steps
    its optimizers after it, and a later part of the step would count calls of another
    backward). What the step does to the LightningModule's and its submodules' attributes is
    undone (:func:`_own_step`: a loss appended to ``self.losses``, a step counter, a metric's
    state). Where the step cannot run without gradients (``torch.autograd.grad`` in it), the
    calls before the failure count, said in the log."""
    assert cb._target is not None, "please report"
    count = 0

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        nonlocal count
        count += 1

    def stop(*args: Any, **kwargs: Any) -> None:
        raise _Recorded

    handle = cb._target.register_forward_pre_hook(hook, with_kwargs=True)
    pl_module.__dict__["manual_backward"] = stop
    try:
        with _own_step(trainer, pl_module, device_of(cb._target)):
            pl_module.training_step(batch_of(trainer, COUNT_ROWS), 0)
    except _Recorded:
        pass
    except Exception as err:  # noqa: BLE001 - any failure of a no-grad step: the calls so far count
        logger.info("AutoRemat: counting the calls of %s in training_step stopped at %s: %s",
                    cb.module or type(pl_module).__name__, type(err).__name__, str(err).splitlines()[0][:200])
    finally:
        handle.remove()
        pl_module.__dict__.pop("manual_backward", None)
    if count > 1:
        rank_zero_info(f"AutoRemat: training_step calls {cb.module or type(pl_module).__name__} {count} times per "
                       "step, and each call's activations stay until backward: each call is planned at 1/"
                       f"{count} of a byte or 'auto' budget (a percentage is of one call's peak)")
    return max(count, 1)


def _chose(cb: "AutoRemat", pl_module: nn.Module, path: str, module: nn.Module) -> None:
    """Make ``module`` (at ``path``) the callback's target, and say so."""
    if is_patched(module):
        raise ValueError(f"module {path!r}, the first one training_step calls, is already patched by autoremat; "
                         "use one AutoRemat callback per module")
    trainable = sum(p.numel() for p in pl_module.parameters() if p.requires_grad)
    share = sum(p.numel() for p in module.parameters() if p.requires_grad) / max(trainable, 1)
    cb._target, cb.module = module, path
    rank_zero_info(f"AutoRemat: planning module {path!r} ({type(module).__name__}, {share:.0%} of the trainable "
                   f"parameters): training_step calls it, not {type(pl_module).__name__}'s forward; pass module= "
                   "to plan another")


def confirmed(cb: "AutoRemat", target: nn.Module, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
              loss_fn: Callable[[Any], torch.Tensor], chosen: tuple[Plan, Graph, Any, int],
               first: tuple[Plan, Graph], original: Any) -> tuple[int | None, Plan, Graph, Any, int]:
    """The measured step of the chosen plan; where it runs out of memory (a prediction can
    miss allocator fragmentation or a workspace the profile did not see), a raised batch size
    goes back to the original, then the plan is solved again at 85 % of the step budget, up to
    :data:`CONFIRM_TRIES` times, each said in a warning. Returns ``(measured, plan, graph,
    batch_size, step_budget)``."""
    plan, graph, batch_size, step_budget = chosen
    tries: list[str] = []
    for _ in range(CONFIRM_TRIES):
        try:
            return cb._measure_patched(target, trainer, pl_module, plan, loss_fn, batch_size), \
                plan, graph, batch_size, step_budget
        except RuntimeError as err:  # torch.OutOfMemoryError is a RuntimeError
            if not is_oom_error(err):
                raise
            tries.append(f"{len(tries) + 1}) {step_budget} bytes: {str(err).splitlines()[0][:1000]}")
        # Out of the except block: the error's traceback holds the failed step's frames (its
        # activations, the patched model's buffers) until the block ends; emptying the cache in
        # it freed none of them, and each retry started with the last one's memory still held.
        if torch.cuda.is_available():
            garbage_collection_cuda()
        if batch_size != original:
            rank_zero_warn(f"AutoRemat: the patched step at the raised batch size {batch_size} ran out of "
                           f"memory; keeping batch size {original}")
            (plan, graph), batch_size = first, original
            continue
        lower = int(step_budget * BACK_OFF)
        rank_zero_warn(f"AutoRemat: the patched step ran out of memory although its predicted peak "
                       f"({plan.predicted_peak_bytes} bytes) is within the {step_budget}-byte step budget "
                       f"(allocator fragmentation, or a workspace the profile did not see); planning again "
                       f"at {lower} bytes")
        step_budget = lower
        plan = cb._solve(graph, step_budget)  # InfeasibleBudgetError states the reachable range
    raise torch.OutOfMemoryError(
        f"AutoRemat: the patched step still ran out of memory after {CONFIRM_TRIES} tries down to a "
        f"{step_budget}-byte step budget; raise the margin (AUTOREMAT_MARGIN, now the fraction of free "
        f"memory kept back by budget='auto') or give a smaller budget. The tries: {' '.join(tries)}")


def try_size(cb: "AutoRemat", trainer: "pl.Trainer", pl_module: "pl.LightningModule", graph: Graph, size: int,
             original: int, step_budget: int, loss_fn: Callable[[Any], torch.Tensor],
             batch_bytes: int) -> tuple[Plan, Graph] | None:
    """``AutoRemat._try_size``: solve at ``size`` and confirm with a patched trial step on a real
    batch of that size; ``None`` where it does not fit, runs out of memory or measures over budget."""
    assert cb._target is not None, "please report"
    target = cb._target
    try:
        plan, scaled, budget = cb._plan_at(graph, size, original, step_budget, batch_bytes, recompute_only=True)
        args, kwargs, _ = cb._record_inputs(trainer, pl_module, size)
        apply(target, plan, regions=cb.regions)
        try:
            peak = trial_step(target, args, kwargs, loss_fn, trainer)
        finally:
            restore(target)
    except InfeasibleBudgetError as err:
        logger.info("AutoRemat: batch size %d does not fit (%s); backing off", size, err)
        return None
    except RuntimeError as err:  # torch.OutOfMemoryError is a RuntimeError
        if not is_oom_error(err):
            raise
        logger.info("AutoRemat: batch size %d ran out of memory in the trial step; backing off", size)
    else:
        if peak is not None and peak > budget:
            logger.info("AutoRemat: batch size %d measured %d bytes over a %d-byte step budget; backing off",
                        size, peak, budget)
            return None
        return plan, scaled
    if torch.cuda.is_available():  # out of the except block (its traceback holds the failed step): see confirmed()
        garbage_collection_cuda()
    return None
