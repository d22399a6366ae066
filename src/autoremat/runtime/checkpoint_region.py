"""A recomputed segment of an fx plan as a module: :class:`CheckpointRegion` runs its body as one
region of autoremat's own kind (:mod:`.region`) or under ``torch.utils.checkpoint``
(``regions="torch"``), which :func:`refuse_offloaded_inputs` keeps from plans offloading a
region's inputs."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .offload import active_offloader
from .recompute_state import SeededProbe, checkpoint_kwargs, prepare_scratch, stateful_buffers
from .region import REGION_MODES, _run, compiled_region
from .substituted import state_dicts
from .transforms import records

__all__ = ["CheckpointRegion", "refuse_offloaded_inputs"]


class CheckpointRegion(nn.Module):
    """Runs ``body`` as one recomputed region (a segment of the plan).

    ``modules``: the modules whose buffers the recomputation must leave untouched (``buffers``:
    more ``(module, name)`` buffers, those the body's ops read or update);
    ``preserve_rng``: replay the RNG state on recomputation (needed only when ``body`` draws
    random numbers; ``None``: find out on the first forward with gradients, see
    :class:`~autoremat.runtime.recompute_state.SeededProbe`); ``mode``: ``"lean"``
    (:func:`~autoremat.runtime.region.recomputed_call`) or ``"torch"`` (``torch.utils.checkpoint``); ``replay``: the body
    with an empty output, run for recomputation (default ``body``). A generated forward holds the values it returns until it
    returns, and an early-stopped recomputation never does: the region's outputs computed before
    its last saving node would stay alive through the whole replay, which the simulator does not
    count (on ResNet-50 a downsample branch recomputed before its block's main branch measured
    3 % above the prediction). The replay frees each value after its last use in the region.
    ``body.forward`` is called directly: a ``GraphModule``'s ``__call__`` formats a traceback for
    every exception passing through it, and both stop each recomputation by raising one.

    ``replay_ends_at_last_save``: the replay's last op is the region's last one that can save a
    tensor for backward (:func:`~autoremat.runtime.region_graph.trim_replay`), so the lean recomputation lets it return instead of
    stopping it with an exception at the last saved tensor (the exception's way back through
    autograd cost ~60-80 µs per recomputation on the CPU-size ResNet-50); it still checks that the
    replay saved exactly what the forward did.

    ``short_replay``: the replay without the region's tail (:mod:`autoremat.replay_tail`),
    returning the tail inputs; ``body`` then calls :func:`~autoremat.runtime.region.tail_mark` with them before the tail.
    The lean recomputation runs it where every tensor the tail saved in that forward was traced
    to a tail input or a parameter, else ``replay``. PyTorch's checkpoint (``mode="torch"``)
    always replays up to the last saved tensor."""

    def __init__(self, body: nn.Module, modules: list[nn.Module], preserve_rng: bool = True,
                 mode: str = "lean", replay: nn.Module | None = None, replay_ends_at_last_save: bool = False,
                 short_replay: nn.Module | None = None, buffers: list[tuple[nn.Module, str]] | None = None,
                 params: tuple[torch.Tensor, ...] = ()) -> None:
        super().__init__()
        if mode not in REGION_MODES:
            raise ValueError(f"regions must be one of {REGION_MODES}, got {mode!r}")
        self.body = body
        self.replay = body if replay is None else replay
        self.short_replay = short_replay
        self.stop = not (replay_ends_at_last_save and replay is not None)
        self.mode = mode
        self.preserve_rng = preserve_rng
        self.stateful = stateful_buffers(modules)
        for slot in buffers or ():  # buffers the region's ops read or update (fx get_attr)
            if not any(slot[0] is m and slot[1] == n for m, n in self.stateful):
                self.stateful.append(slot)
        prepare_scratch(self.stateful)
        seen: set[int] = set()
        self.params = tuple(p for p in (*(q for m in modules for q in m.parameters()), *params)
                            if not (id(p) in seen or seen.add(id(p))))  # type: ignore[func-returns-value]
        self.dicts = state_dicts(modules)
        self._kwargs = checkpoint_kwargs(self.stateful, bool(preserve_rng), self.params, self.dicts)
        self._probed = False  # see SeededProbe: the first forward with gradients finds out more
        self._early_stop = True

    def forward(self, *args: Any) -> Any:
        if not records():  # also under torch.func transforms (.transforms)
            return self.body.forward(*args)
        if torch.compiler.is_compiling():
            return compiled_region(self.body.forward, self.preserve_rng is not False, args, {})
        if not self._probed:  # the first forward: replay the RNG and to the end this time, and find out
            with SeededProbe() as probe:
                out = self._region(True, False, args)
            self._probed = True
            if self.preserve_rng is None:
                self.preserve_rng = probe.seen
                self._kwargs = checkpoint_kwargs(self.stateful, probe.seen, self.params, self.dicts)
            if probe.fills_saved:
                self.stop, self._early_stop = False, False
            return out
        return self._region(self.preserve_rng, self._early_stop, args)

    def _region(self, preserve_rng: bool, early_stop: bool, args: tuple[Any, ...]) -> Any:
        if self.mode == "lean":
            short = None if self.short_replay is None else self.short_replay.forward
            return _run(self.body.forward, self.replay.forward, self.stateful, preserve_rng, args, {},
                        self.stop and early_stop, short, self.params, self.dicts)
        refuse_offloaded_inputs(args, {})
        kwargs = self._kwargs if preserve_rng == self._kwargs["preserve_rng_state"] else \
            checkpoint_kwargs(self.stateful, preserve_rng, self.params, self.dicts)
        return checkpoint(_FirstThenReplay(self.body.forward, self.replay.forward), *args, **kwargs,
                          early_stop=early_stop)


def refuse_offloaded_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """``regions="torch"``: ``torch.utils.checkpoint`` keeps a region's inputs itself, so an input
    the plan offloads (an offloaded checkpoint) would stay on the device: refused."""
    off = active_offloader()
    if off is None:
        return
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor) and off.owner_of(a) is not None:
            raise RuntimeError(
                f"autoremat: the plan offloads an input of a recomputed region (the output of node "
                f"{off.owner_of(a)}), which regions='torch' cannot do (torch.utils.checkpoint keeps its inputs on "
                "the device); apply the plan with regions='lean' (the default)")


class _FirstThenReplay:
    """For ``torch.utils.checkpoint``, which calls one function for the forward and its replays."""

    __slots__ = ("first", "replay")

    def __init__(self, first: Callable[..., Any], replay: Callable[..., Any]) -> None:
        self.first: Callable[..., Any] | None = first
        self.replay = replay

    def __call__(self, *args: Any) -> Any:
        fn, self.first = self.first, None
        return (fn or self.replay)(*args)
