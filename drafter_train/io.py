"""Small file helpers every layer shares."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file and a rename: a reader (or a kill mid-write) sees the old file
    or the new one, never half of one. The temporary name carries the process id, so two writers never share it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def read_json_or_empty(path: Path) -> dict:
    """A JSON file's object, or {} when it is missing or unreadable (reports say what is not known)."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
