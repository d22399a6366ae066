"""What :class:`~autoremat.integrations.lightning.AutoRemat` needs from a Lightning ``Trainer``:
real training batches of a given size, the dataset length, dataloaders rebuilt after the batch
size changed, ``self.log`` silenced for a call of ``training_step`` outside the loop, a trial
step under the trainer's precision that leaves the training state as it was, and its
``on_fit_start`` made atomic (:func:`atomic_fit_start`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..runtime import is_patched, restore
from ._atomic import Rollback
from ._planning import measured_step_peak

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["atomic_fit_start", "batch_of", "dataset_length", "reset_dataloaders", "silenced_logging", "trial_step"]


@contextlib.contextmanager
def silenced_logging(pl_module: nn.Module) -> Iterator[None]:
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


def batch_of(trainer: "pl.Trainer", size: int | None) -> Any:
    """A real training batch, on the device; with ``size``, built from as many batches of the
    training dataloader as needed (tensors concatenated along the first dimension).

    The global RNG is left as it was: starting a dataloader iterator draws its base seed (and a
    shuffling sampler its own seed) from it, which moved every dropout mask of the run after. So
    are the generators a dataloader or its sampler were given (``DataLoader(..., shuffle=True,
    generator=g)``): they drew the same seeds, and the user's epochs saw their rows in another
    order than without the callback."""
    generators = _generators(trainer.train_dataloader)
    states = [g.get_state() for g in generators]
    try:
        with torch.random.fork_rng(devices=[]):
            return _batch_of(trainer, size)
    finally:
        for g, state in zip(generators, states):
            g.set_state(state)


def _generators(loaders: Any) -> list[torch.Generator]:
    """The generators of the dataloaders in ``loaders`` (a dataloader, a list, tuple or dict of
    them, or Lightning's ``CombinedLoader``) and of their samplers, each once."""
    found: dict[int, torch.Generator] = {}
    stack = [loaders]
    while stack:
        obj = stack.pop()
        if isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif hasattr(obj, "flattened"):  # CombinedLoader
            stack.extend(obj.flattened)
        elif obj is not None:
            sampler = getattr(obj, "sampler", None)
            inner = getattr(getattr(obj, "batch_sampler", None), "sampler", None)
            for g in (getattr(obj, "generator", None), getattr(sampler, "generator", None),
                      getattr(inner, "generator", None)):
                if isinstance(g, torch.Generator):
                    found[id(g)] = g
    return list(found.values())


def _batch_of(trainer: "pl.Trainer", size: int | None) -> Any:
    from torch.utils._pytree import tree_flatten, tree_unflatten

    dataloader = trainer.train_dataloader
    if dataloader is None:
        raise ValueError("AutoRemat needs a training dataloader to profile on")
    it = _batches(dataloader)
    first = next(it)
    if size is None:
        return _as_the_loop_does(trainer, first)
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
    return _as_the_loop_does(trainer, tree_unflatten([_rows(col, size) for col in columns], spec))


def _batches(dataloader: Any) -> Iterator[Any]:
    """The batches ``training_step`` gets from ``trainer.train_dataloader``: where
    ``train_dataloader()`` returned several dataloaders (a dict, list or tuple of them), one batch
    of each at a time in that structure, as Lightning's ``CombinedLoader`` in its training mode
    ("max_size_cycle") yields them (iterating the dict itself gave its keys: the recording call
    raised "string indices must be integers" in ``batch["a"]``)."""
    if isinstance(dataloader, (Mapping, list, tuple)):
        from lightning.pytorch.utilities import CombinedLoader

        return (batch for batch, _, _ in CombinedLoader(dataloader, "max_size_cycle"))
    return iter(dataloader)


def _as_the_loop_does(trainer: "pl.Trainer", batch: Any) -> Any:
    """``batch`` as Lightning's training loop hands it to ``training_step``: the precision plugin's
    input conversion (``bf16-true``, ``64-true``, ``16-true``: floating tensors to the trainer's
    dtype; without it a ``bf16-true`` CNN's capture met float32 images and bfloat16 weights),
    ``on_before_batch_transfer`` (the module's or the datamodule's, as the loop calls it), then the
    strategy's transfer with ``on_after_batch_transfer``."""
    batch = trainer.precision_plugin.convert_input(batch)
    batch = trainer.lightning_module._on_before_batch_transfer(batch, dataloader_idx=0)
    return trainer.strategy.batch_to_device(batch, dataloader_idx=0)


def _rows(col: list[Any], size: int) -> Any:
    """The first ``size`` rows of one leaf's batches; a single batch is sliced, not copied (on a
    device that holds the batch once, a copy is a second batch); a leaf without rows as it is."""
    if not (isinstance(col[0], torch.Tensor) and col[0].dim()):
        return col[0]
    return (col[0] if len(col) == 1 else torch.cat(col))[:size]


def dataset_length(trainer: "pl.Trainer") -> int | None:
    loader = trainer.fit_loop._combined_loader
    if loader is None:
        return None
    try:
        return int(loader._dataset_length())
    except (NotImplementedError, TypeError):
        return None


def reset_dataloaders(trainer: "pl.Trainer") -> None:
    loop = trainer.fit_loop
    loop._combined_loader = None
    loop.setup_data()
    val = loop.epoch_loop.val_loop
    val._combined_loader = None
    val.setup_data()


@contextlib.contextmanager
def atomic_fit_start(trainer: "pl.Trainer", pl_module: nn.Module, callback: Any, target: nn.Module) -> Iterator[None]:
    """The callback's ``on_fit_start`` work, undone when it raises (issue 29): the target is
    unpatched again; the callback's attributes (plan, batch size, summary), the batch-size
    attribute (``callback.batch_arg_name``) and the trainer's train/val dataloaders are what they
    were (a later ``fit`` sets the loaders up again); placement and RNG state are put back
    (:class:`~autoremat.integrations._atomic.Rollback`: setting up the training dataloader draws a
    seed from the global RNG). Lightning's ``on_exception`` hooks run after this."""
    from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr, lightning_setattr

    rollback = Rollback(pl_module, [trainer.strategy.root_device])
    own = dict(callback.__dict__)
    name = callback.batch_arg_name
    has_size = lightning_hasattr(pl_module, name)
    size = lightning_getattr(pl_module, name) if has_size else None
    loops = [trainer.fit_loop, trainer.fit_loop.epoch_loop.val_loop]
    loaders = [loop._combined_loader for loop in loops]
    was_patched = is_patched(target)
    try:
        yield
    except BaseException:
        if not was_patched:
            restore(target)
        chosen = callback.__dict__.get("_target")  # the submodule training_step calls (module=None)
        if chosen is not None and chosen is not target:
            restore(chosen)
        if has_size and lightning_getattr(pl_module, name) != size:
            lightning_setattr(pl_module, name, size)
        for loop, loader in zip(loops, loaders):
            loop._combined_loader = loader
        callback.__dict__.clear()
        callback.__dict__.update(own)
        rollback.put_back()
        raise
def trial_step(target: nn.Module, args: tuple, kwargs: dict, loss_fn: Callable[[Any], torch.Tensor],
               trainer: "pl.Trainer") -> int | None:
    """One forward+backward of ``target`` under the trainer's precision; returns its step peak
    (:func:`~autoremat.integrations._planning.measured_step_peak`)."""
    return measured_step_peak(target, args, kwargs, loss_fn, trainer.precision_plugin.forward_context)
