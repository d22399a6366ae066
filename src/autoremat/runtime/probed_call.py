"""Module-level recomputed calls: ``apply`` wraps a module's ``forward`` with a
:class:`ProbedCall`, one region of autoremat's own kind (:func:`~autoremat.runtime.region.recomputed_call`'s
machinery) or ``torch.utils.checkpoint``, whose first forward with gradients finds out, under
:class:`~autoremat.runtime.recompute_state.SeededProbe`, whether its replay needs the RNG."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..capture.kv_cache import refuse_cache_writes
from .recompute_state import SeededProbe, checkpoint_kwargs, prepare_scratch
from .checkpoint_region import refuse_offloaded_inputs
from .region import _run, compiled_region
from .transforms import records

__all__ = ["ProbedCall"]


class ProbedCall:
    """A module-level recomputed call (``apply`` wraps a module's ``forward`` with it): ``fn`` as
    one region, of autoremat's own kind (``mode="lean"``) or ``torch.utils.checkpoint``. Its first
    forward with gradients runs under :class:`SeededProbe` (RNG replayed, replay run to its end);
    later ones replay the RNG only if a seeded op ran, and stop the replay early unless an op of
    :data:`_FILLS_SAVED` ran."""

    def __init__(self, fn: Callable[..., Any], stateful: list[tuple[nn.Module, str]], mode: str,
                 params: tuple[torch.Tensor, ...] = (), where: str = "a module call",
                 dicts: tuple[dict[str, Any], ...] = ()) -> None:
        self.fn, self.stateful, self.mode, self.params, self.where = fn, stateful, mode, params, where
        self.dicts = dicts  # the module's instance, parameter and buffer dicts (.substituted)
        prepare_scratch(stateful)
        self.probed: SeededProbe | None = None
        self.generators: list[torch.Generator] = []  # the module's own generators its random ops draw from
        self.active = True  # False after restore: a user wrapper still holding it runs plain fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.active or not records():  # also under torch.func transforms (.transforms)
            return self.fn(*args, **kwargs)
        if torch.compiler.is_compiling():  # the buffer guard (context_fn) is eager code
            return compiled_region(self.fn, True, args, kwargs)
        refuse_cache_writes(self.where, args, kwargs)
        if self.probed is None:
            gens: list[tuple[torch.Generator, torch.Tensor]] = []  # filled once the forward has run
            with SeededProbe() as probe:
                # the replay stops early unless the forward ran an op that fills what it saves: known
                # once the forward has run, before the replay (it ran to its end: 1.05x the prediction)
                out = self._call(True, lambda: not probe.fills_saved, args, kwargs, gens)
            gens += probe.generators  # their states before their first draw: the forward's
            self.generators = [g for g, _ in probe.generators]
            self.probed = probe
            return out
        gens = [(g, g.get_state()) for g in self.generators] if self.generators else None
        return self._call(self.probed.seen, not self.probed.fills_saved, args, kwargs, gens)

    def _call(self, rng: bool, stop: bool | Callable[[], bool], args: tuple[Any, ...], kwargs: dict[str, Any],
              gens: list[tuple[torch.Generator, torch.Tensor]] | None = None) -> Any:
        if self.mode == "lean":
            return _run(self.fn, self.fn, self.stateful, rng, args, kwargs, stop, params=self.params, dicts=self.dicts,
                        generators=gens)
        refuse_offloaded_inputs(args, kwargs)
        return checkpoint(self.fn, *args, **checkpoint_kwargs(self.stateful, rng, self.params, self.dicts, gens),
                          early_stop=stop if isinstance(stop, bool) else False, **kwargs)
