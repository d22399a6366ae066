"""Small shared helpers: byte formatting."""

from __future__ import annotations

from .errors import _fmt_bytes as fmt_bytes

__all__ = ["fmt_bytes"]
