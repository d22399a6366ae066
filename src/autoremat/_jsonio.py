"""JSON text or file, for the objects that round-trip through ``to_dict`` / ``from_dict``."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["dump_json", "load_json"]


def dump_json(data: dict[str, Any], path: str | None = None) -> str:
    """``data`` as indented JSON text, also written to ``path`` when given."""
    text = json.dumps(data, indent=1)
    if path is not None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    return text


def load_json(text_or_path: str) -> Any:
    """Parse JSON text, or the file at a path (anything not starting with ``{``)."""
    text = text_or_path
    if not text_or_path.lstrip().startswith("{"):
        with open(text_or_path, encoding="utf-8") as f:
            text = f.read()
    return json.loads(text)
