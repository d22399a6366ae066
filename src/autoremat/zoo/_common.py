"""Shared helpers for the model zoo: channel scaling and argument checks.

Every zoo network takes a ``width`` multiplier. Channel counts (and hidden
sizes) are multiplied by it and rounded, but never go below
:data:`MIN_CHANNELS`, so the smallest networks still have a few channels per
layer. ``width=1.0`` reproduces the published channel counts exactly; the
depth and the topology of the graph never depend on ``width``.
"""

from __future__ import annotations

import math

__all__ = ["MIN_CHANNELS", "check_width", "image_shape", "scaled"]

#: Smallest channel count a scaled layer is allowed to have.
MIN_CHANNELS: int = 4


def check_width(width: float) -> float:
    """Return ``width`` as a float after checking it is a positive finite number."""
    value = float(width)
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"width must be a positive finite number, got {width!r}")
    return value


def scaled(channels: int, width: float, minimum: int = MIN_CHANNELS) -> int:
    """Scale a published channel count by ``width``.

    ``scaled(c, 1.0) == c`` for every ``c``; otherwise the result is
    ``round(c * width)`` clamped from below at ``min(minimum, c)``.
    """
    if width == 1.0:
        return channels
    return max(min(minimum, channels), int(round(channels * width)))


def image_shape(input_shape: tuple[int, ...], name: str) -> tuple[int, int, int]:
    """Check that ``input_shape`` is a ``(C, H, W)`` image shape and return it."""
    if len(input_shape) != 3 or any(int(d) <= 0 for d in input_shape):
        raise ValueError(f"{name} expects an input shape (C, H, W) of positive ints, got {input_shape!r}")
    c, h, w = (int(d) for d in input_shape)
    return c, h, w
