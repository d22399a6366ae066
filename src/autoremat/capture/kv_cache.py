"""Module calls that write a key/value cache: kept, never recomputed.

A Hugging Face decoder layer called with a cache (``past_key_values`` / ``layer_past``, a
``transformers`` ``Cache`` such as ``DynamicCache``) appends its keys and values to that cache.
``use_cache`` defaults to true in most causal-LM configs, so in a plain training loop
(``model(input_ids, labels=labels)``) every layer writes the cache the model made for the step.
Recomputing such a call in backward would write the cache a second time: the replay attends over
twice the keys (a shape error in most models, or, under ``torch.utils.checkpoint``'s selective
mode, "encountered during backward but not found in storage") and the cache the user gets back
holds the step's keys twice. ``gradient_checkpointing_enable()`` avoids it by turning the cache
off (``use_cache=False``, with a warning); autoremat does not change the user's call, so:

* **capture** pins every module call that is handed a cache (``recomputable=False``, listed in
  ``graph.meta["pinned_by_cache"]`` as call -> argument) and logs once how to lift it: pass
  ``use_cache=False`` (as ``gradient_checkpointing_enable()`` does) if the training step does
  not use the returned cache;
* **apply**: a recomputed call that is handed a cache anyway (a plan made from a capture without
  one) raises :class:`CacheWriteError` at its first forward, before anything is written.

A cache is recognised by its class (a subclass of a class named ``Cache`` from ``transformers``,
found by name so that ``transformers`` is not imported), as a positional or keyword argument or
one level inside a tuple, list or dict argument. A ``None`` cache (``use_cache=False``) is not one.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CacheWriteError", "cache_arguments", "is_kv_cache", "refuse_cache_writes"]


class CacheWriteError(RuntimeError):
    """A call the plan recomputes is handed a key/value cache its replay would write again."""


def is_kv_cache(obj: Any) -> bool:
    """Whether ``obj`` is a ``transformers`` key/value cache (any ``Cache`` subclass)."""
    return obj is not None and any(
        c.__name__ == "Cache" and c.__module__.startswith("transformers") for c in type(obj).__mro__)


def cache_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
    """The names (``"past_key_values"``, ``"args[1]"``) of the arguments of one call that are, or
    directly hold, a key/value cache."""
    found: list[str] = []
    named = [(f"args[{i}]", a) for i, a in enumerate(args)] + list(kwargs.items())
    for name, value in named:
        inner = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
        if is_kv_cache(value) or any(is_kv_cache(v) for v in inner):
            found.append(name)
    return found


def refuse_cache_writes(where: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raise :class:`CacheWriteError` when a recomputed call ``where`` is handed a cache."""
    names = cache_arguments(args, kwargs)
    if names:
        raise CacheWriteError(
            f"autoremat: the plan recomputes {where}, but this call is handed a key/value cache "
            f"({', '.join(names)}); recomputing it in backward would write the cache a second time. "
            "Pass use_cache=False to the model (as gradient_checkpointing_enable() does) if the step does "
            "not use the returned cache, or plan again from a capture of this call (capture keeps calls "
            "that write a cache)")
