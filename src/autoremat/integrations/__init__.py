"""Integrations: thin glue between autoremat and training frameworks."""

from __future__ import annotations

__all__: list[str] = []
