"""The numbers of a Profile worth reading first: peak, time, and where saved memory sits.

``summarize(profile)`` returns data; ``memfit profile MODEL`` prints it (and writes it as
JSON with ``--json``).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from memfit.profiling.profile import Profile, StorageKind

__all__ = ["summarize", "module_group"]


def summarize(prof: Profile, *, top: int = 8) -> dict[str, Any]:
    """The numbers worth printing from ``prof``, as JSON-ready data.

    Args:
        prof: a profile (``memfit.profile``).
        top: modules to list under ``saved_by_module`` (default 8), most saved bytes first;
            saved activation bytes are grouped by :func:`module_group`.

    Returns:
        A dict: ``model``, ``device``, ``mode``, ``cost_model``, ``ops``, ``forward_ops``,
        ``peak_bytes``, ``baseline_bytes``, ``saved_bytes`` (bytes), ``step_time_s``,
        ``forward_time_s`` (seconds), ``signature``, and ``saved_by_module``: a list of
        ``{"module": path, "saved_bytes": bytes}``.

    Example:
        >>> summarize(memfit.profile(model, x))["peak_bytes"]   # doctest: +SKIP
        199184384
    """
    by_module: dict[str, int] = defaultdict(int)
    for s in prof.storages:
        if s.saved and s.kind == StorageKind.ACTIVATION and s.created_by is not None:
            by_module[module_group(prof.ops[s.created_by].module)] += s.nbytes
    ranked = sorted(by_module.items(), key=lambda kv: -kv[1])[:top]
    return {
        "model": prof.model, "device": prof.device, "mode": prof.mode, "cost_model": prof.cost_model,
        "ops": len(prof.ops), "forward_ops": prof.n_forward,
        "peak_bytes": prof.peak_bytes, "baseline_bytes": prof.baseline_bytes,
        "saved_bytes": prof.saved_bytes, "step_time_s": prof.step_time_s,
        "forward_time_s": prof.forward_time_s, "signature": prof.signature,
        "saved_by_module": [{"module": m, "saved_bytes": b} for m, b in ranked],
    }


def module_group(path: str) -> str:
    """The module a path's saved bytes are counted under: down to the first numbered block
    (``blocks.3``, ``model.layers.3``), else the top-level module (``<root>`` for the model).

    Example:
        >>> module_group("model.layers.3.mlp.fc"), module_group("head"), module_group("")
        ('model.layers.3', 'head', '<root>')
    """
    parts = path.split(".") if path else []
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return parts[0] if parts else "<root>"
