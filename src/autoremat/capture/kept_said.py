"""Saying once per process what capture keeps from recomputation, and why.

A model is often captured more than once (``capture_within``'s meta and real captures, the
Lightning callback's captures), and each capture finds the same kept calls: each line (a message
with its count and first example) is said once per process.
"""

from __future__ import annotations

import logging

__all__ = ["say_kept"]

logger = logging.getLogger("autoremat.capture")

_SAID: set[tuple[object, ...]] = set()


def say_kept(message: str, count: int, *example: str) -> None:
    """``logger.warning(message, count, *example)``, unless said already in this process."""
    key = (message, count, *example)
    if key not in _SAID:
        _SAID.add(key)
        logger.warning(message, count, *example)
