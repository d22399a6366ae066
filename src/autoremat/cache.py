"""A plan cache, so that the second run of a training script does not profile again.

``AUTOREMAT_CACHE_DIR=~/.cache/autoremat`` (or ``cache_dir=`` of ``AutoRemat`` / ``prepare``)
turns it on; it is off otherwise. An entry is one JSON file named by its key, holding what the
integration decided (the plan, the batch size, the step budget, the summary) and the settings it
was made under.

The key (:func:`plan_key`) is a SHA-256 of everything the plan depends on that is known
*before* a capture:

* the model: :func:`autoremat.capture.module.module_fingerprint` (its submodule tree and the
  shape and dtype of every parameter and buffer), the source code of the ``forward`` of each
  module class in it (a rewired forward with the same modules gets another key) and which of its
  parameters are trainable (:func:`trainable_digest`: a frozen layer keeps less for backward, so a
  fine-tuning stage with the body frozen and one with it trainable get two keys);
* the inputs: their shapes, dtypes and device types (:func:`autoremat.capture.signature.input_signature`);
* the settings: budget as written, solver, options, precision, time source, and the versions
  of autoremat and torch.

Decisions:

* a budget of ``"auto"`` or bytes is a *device* budget whose step budget depends on what is
  free and resident now; the integration checks a cached plan's predicted peak against the
  step budget of this run and profiles again (saying so) where it no longer fits;
* a cached plan is still checked when it is applied: :func:`autoremat.apply` compares its
  graph fingerprint with the model (an fx plan traces the model, so a changed forward is
  caught even where the source check missed it), and the inputs are compared with
  :func:`~autoremat.capture.signature.check_inputs`; a refused entry is ignored, logged, and
  replaced;
* a file that cannot be read or parsed is ignored with a warning, never an error; entries are
  written to a temporary file and renamed, so a crash never leaves half a file.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import nn

__all__ = ["PlanCache", "plan_key", "code_fingerprint", "trainable_digest", "CACHE_FORMAT_VERSION"]

logger = logging.getLogger(__name__)

CACHE_FORMAT_VERSION = 1


def code_fingerprint(model: nn.Module) -> str:
    """Hash of the ``forward`` source of every module class in ``model`` (classes whose source
    is not available, e.g. built in C, count by their qualified name only)."""
    h = hashlib.sha256()
    for cls in sorted({type(m) for m in model.modules()}, key=lambda c: f"{c.__module__}.{c.__qualname__}"):
        h.update(f"{cls.__module__}.{cls.__qualname__}:".encode())
        try:
            h.update(inspect.getsource(cls.forward).encode())
        except (OSError, TypeError):
            pass
    return h.hexdigest()[:16]


def plan_key(model: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any] | None,
             settings: Mapping[str, Any]) -> str:
    """The cache key of ``model`` on a batch like ``args``/``kwargs`` under ``settings`` (module
    docstring). ``settings`` must be JSON-serialisable."""
    import torch

    from . import __version__
    from ._compiled import uncompiled
    from .capture.module import module_fingerprint
    from .capture.signature import input_signature

    model = uncompiled(model)
    doc = {
        "model": module_fingerprint(model), "code": code_fingerprint(model), "trainable": trainable_digest(model),
        "inputs": input_signature(tuple(args), dict(kwargs or {})),
        "settings": dict(settings), "autoremat": __version__, "torch": torch.__version__,
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:32]


def trainable_digest(model: nn.Module) -> str:
    """A hash of the names of ``model``'s parameters that require a gradient: what its step keeps
    and allocates depends on them (a frozen layer keeps no input for its weight's gradient)."""
    names = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    return hashlib.sha256("\n".join(names).encode()).hexdigest()[:16]


class PlanCache:
    """JSON entries in one directory, one file per key."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        path = Path(directory).expanduser()
        if path.exists() and not path.is_dir():
            raise ValueError(f"cache_dir={str(directory)!r} is a file; give a directory (it is created if missing)")
        self.directory = path

    @classmethod
    def from_setting(cls, cache_dir: str | os.PathLike[str] | None) -> "PlanCache | None":
        """``cache_dir``, else ``AUTOREMAT_CACHE_DIR``; ``None`` (no cache) when neither is set."""
        value = cache_dir if cache_dir is not None else os.environ.get("AUTOREMAT_CACHE_DIR")
        if value is None or str(value).strip() == "":
            return None
        return cls(value)

    def path(self, key: str) -> Path:
        return self.directory / f"plan-{key}.json"

    def load(self, key: str) -> dict[str, Any] | None:
        """The entry stored under ``key``, or ``None`` (missing, unreadable or another format: logged)."""
        path = self.path(key)
        if not path.exists():
            return None
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
        except (OSError, ValueError) as exc:
            logger.warning("autoremat: ignoring the unreadable plan cache entry %s (%s)", path, exc)
            return None
        if not isinstance(doc, dict) or doc.get("format") != "autoremat.cache" \
                or doc.get("version") != CACHE_FORMAT_VERSION or doc.get("key") != key:
            logger.warning("autoremat: ignoring the plan cache entry %s (another format or key)", path)
            return None
        return doc.get("entry")

    def store(self, key: str, entry: Mapping[str, Any]) -> Path:
        """Write ``entry`` under ``key`` (atomically); returns the file's path."""
        self.directory.mkdir(parents=True, exist_ok=True)
        doc = {"format": "autoremat.cache", "version": CACHE_FORMAT_VERSION, "key": key, "entry": dict(entry)}
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".plan-", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(doc, f, indent=1)
            os.replace(tmp, self.path(key))
        except BaseException:
            _unlink(tmp)
            raise
        return self.path(key)

    def forget(self, key: str) -> None:
        """Remove the entry under ``key`` (a refused one), if any."""
        _unlink(str(self.path(key)))


def _unlink(path: str) -> None:
    """Remove ``path`` if it exists."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
