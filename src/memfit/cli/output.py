"""Printing for the CLI: text for people, one JSON object with ``--json``."""

from __future__ import annotations

import json
import math
import sys
from typing import Any

__all__ = ["emit", "say"]


def _clean(obj: Any) -> Any:
    """JSON-safe: non-finite floats as strings, tuples as lists."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def emit(args: Any, text: str, data: dict[str, Any]) -> None:
    """Print ``data`` as JSON if ``--json`` was given, else ``text``."""
    if getattr(args, "json", False):
        print(json.dumps(_clean(data), indent=1))
    else:
        print(text)


def say(args: Any, text: str) -> None:
    """A progress line for people: to stderr under ``--json`` (stdout stays one JSON object)."""
    print(text, file=sys.stderr if getattr(args, "json", False) else sys.stdout, flush=True)
