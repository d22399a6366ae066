"""The random generators a model's Python may draw from beside torch's: Python's ``random`` and
numpy's global generator.

* **Kept** (:func:`host_rng_kept`): :func:`~autoremat.capture.preserved.preserved_state` saves and
  restores them, as it forks torch's, around autoremat's own runs of the model (a capture's
  profiling and timing steps, the Lightning callback's trial steps), so that a model drawing its
  augmentation from numpy gets the same draws in training with autoremat as without.
* **Refused in a trace** (:func:`draws`): ``torch.fx`` runs forward's Python once, so a draw made
  outside the traced tensor ops (``np.random.rand()``, ``random.random()``, or ``torch.rand(())``
  on no traced input: executed at trace time, not recorded) becomes a constant of the graph, the
  same value in every step. Measured: a stack of blocks each scaling its branch by ``rand() >
  0.3`` was captured at fx level and its least plan's gradients differed from the model's (torch,
  numpy and Python draws alike); at module level, which runs the model's own Python each step,
  they are bit-equal. Decision: :func:`~autoremat.capture._tracing.semantic_trace` compares the
  three generators' states around the trace and raises
  :class:`~autoremat.capture._tracing.RandomDrawError` if one moved (``mode="auto"`` then captures
  at module level). Generators of the model's own (``np.random.default_rng()``, a
  ``random.Random`` instance) are not seen.
* **Kept from recomputation** (:func:`host_states`): a recomputation replays torch's draws, not
  these, so a module call drawing from them drew again in its replay (measured, CPU: a stack of
  blocks scaling their branch by ``random.uniform(0.5, 1.5)`` and adding ``np.random.rand()``,
  module level, least plan: from the second step on the outputs differed from the unpatched model's,
  both generators having advanced twice per recomputed call). Module-level capture compares the two
  around each node call and keeps the calls that moved one
  (:class:`~autoremat.capture.container_writes.ContainerWrites`; ``graph.meta["pinned_by_host_rng"]``),
  with a log line: draw from torch's generator to let them be recomputed.
"""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["host_rng_kept", "rng_states", "host_states", "draws"]


def _numpy_random() -> Any:
    np = sys.modules.get("numpy")  # a model that draws from numpy has imported it
    return None if np is None else np.random


@contextlib.contextmanager
def host_rng_kept() -> Iterator[None]:
    """Within: Python's and numpy's global generators are restored on exit (module docstring)."""
    npr = _numpy_random()
    py, nps = random.getstate(), None if npr is None else npr.get_state()
    try:
        yield
    finally:
        random.setstate(py)
        if nps is not None:
            npr.set_state(nps)


def rng_states() -> dict[str, Any]:
    """The states of torch's CPU generator, Python's ``random`` and numpy's global generator."""
    return {"torch": torch.get_rng_state().numpy().tobytes(), **host_states()}


def host_states() -> dict[str, Any]:
    """Python's and numpy's generator states, comparable by :func:`draws` (not torch's, whose draws a
    recomputation replays; reading these runs no torch op, so a capture's recorder, which sees every op,
    can read them between calls). numpy's is its position and key, not pickled: read around every module
    call of a capture."""
    states: dict[str, Any] = {"random": random.getstate()}
    npr = _numpy_random()
    if npr is not None:
        _, key, pos, *_rest = npr.get_state()
        states["numpy.random"] = (pos, key.tobytes())
    return states


def draws(before: dict[str, Any]) -> list[str]:
    """The generators of :func:`rng_states` (or :func:`host_states`) ``before`` whose state has moved since."""
    now = rng_states() if "torch" in before else host_states()
    return [name for name, state in before.items() if now.get(name) != state]
