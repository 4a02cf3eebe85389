"""The Plan: which parts of a step are recomputed, and what that is predicted to cost.

A Plan is the seam between analysis (profiling, planning) and runtime. It names modules by
path and ops by region-local keys, never by object, so that it can be saved as JSON, audited,
and applied to a fresh instance of the same model.

NOTE [op keys]
    Inside a region an op occurrence is named ``"<overload>#<k>"``: the k-th (from 0) call of
    that aten overload among the region's forward ops, in dispatch order, e.g.
    ``"aten.mm.default#2"``. The runtime counts the same way in its selective-checkpoint policy,
    so a key means the same op at plan time and at run time. ``Region.ops`` maps keys to an
    :class:`OpPolicy`; ops it does not name are recomputed. Outputs of in-place ops and of
    random ops are never saved (see ``memfit.planning.rules``).

NOTE [plan schema]
    Version 2 (this one) stores each region's per-op decisions as ``"ops": {key: "save"}``.
    Version 1 stored the saved keys as a list, ``"save": [key, ...]``; it is read as the same
    decisions (every listed key SAVE). Other versions are refused with the versions this
    memfit reads.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memfit.errors import SchemaError

__all__ = ["PLAN_SCHEMA_VERSION", "OpPolicy", "Region", "Plan"]

PLAN_SCHEMA_VERSION = 2
READABLE_SCHEMA_VERSIONS = (1, 2)


class OpPolicy(str, enum.Enum):
    """What a region does with one op occurrence's outputs between forward and backward.

    Maps onto ``torch.utils.checkpoint.CheckpointPolicy`` (``memfit.runtime.policies``).
    """

    SAVE = "save"            # keep in memory (MUST_SAVE)
    RECOMPUTE = "recompute"  # drop, rerun in backward (PREFER_RECOMPUTE); the default
    OFFLOAD = "offload"      # copy to host memory and back (not planned or run yet)


Decisions = Mapping[str, OpPolicy]


@dataclass(frozen=True)
class Region:
    """A part of the step whose activations are dropped in forward and recomputed in backward.

    Attributes:
        modules: one module path, or several consecutive sibling modules (a segment: one
            checkpoint spanning their calls, including the parent's code between them).
        ops: per-op decisions, ``(key, OpPolicy)`` pairs in op order (NOTE [op keys]); ops
            not named are recomputed. Give a mapping or pairs; ``Region.saving`` builds one
            from the keys to save.
        recompute_s: predicted seconds this region adds to backward.
        saved_bytes: predicted bytes this region keeps from forward to backward.
        writes_buffers: whether its forward wrote a module buffer in place when profiled
            (the runtime then watches for such writes; NOTE [buffer writes] in
            ``memfit.planning.rules``); None: not known (the runtime decides).
    """

    modules: tuple[str, ...]
    ops: tuple[tuple[str, OpPolicy], ...] = ()
    recompute_s: float = 0.0
    saved_bytes: int = 0
    writes_buffers: bool | None = None

    def __post_init__(self) -> None:
        if not self.modules:
            raise ValueError("a Region needs at least one module path")
        items = self.ops.items() if isinstance(self.ops, Mapping) else self.ops
        pairs = []
        for item in items:
            if not (isinstance(item, tuple) and len(item) == 2):
                raise TypeError(f"Region.ops takes (key, OpPolicy) pairs or a mapping; got {item!r} "
                                "(use Region.saving(modules, keys) for a list of keys to save)")
            key, policy = item
            if not isinstance(policy, OpPolicy):
                raise TypeError(f"Region.ops[{key!r}] is {policy!r}, not a memfit.OpPolicy")
            pairs.append((str(key), policy))
        keys = [k for k, _ in pairs]
        if len(set(keys)) != len(keys):
            raise ValueError(f"Region.ops names an op twice: {sorted(k for k in keys if keys.count(k) > 1)}")
        object.__setattr__(self, "ops", tuple(p for p in pairs if p[1] is not OpPolicy.RECOMPUTE))

    @classmethod
    def saving(cls, modules: tuple[str, ...], keys: Iterable[str] = (), **kw: Any) -> Region:
        """A region that saves the ops named by ``keys`` and recomputes the rest."""
        return cls(modules, tuple((k, OpPolicy.SAVE) for k in keys), **kw)

    @property
    def decisions(self) -> dict[str, OpPolicy]:
        """The per-op decisions other than the default RECOMPUTE, by key."""
        return dict(self.ops)

    def keys_with(self, policy: OpPolicy) -> tuple[str, ...]:
        """The op keys this region treats with ``policy`` (RECOMPUTE: none are listed)."""
        return tuple(k for k, p in self.ops if p is policy)

    @property
    def save(self) -> tuple[str, ...]:
        """The op keys whose outputs are kept."""
        return self.keys_with(OpPolicy.SAVE)

    @property
    def name(self) -> str:
        if len(self.modules) == 1:
            return self.modules[0] or "<root>"
        return f"{self.modules[0]}..{self.modules[-1]}"

    @property
    def is_segment(self) -> bool:
        return len(self.modules) > 1


@dataclass(frozen=True)
class Plan:
    """A checkpoint plan for one model and input shape.

    Example:
        >>> plan = memfit.plan(memfit.profile(model, x), budget="60%")   # doctest: +SKIP
        >>> print(plan); plan.save("plan.json")          # doctest: +SKIP
    """

    regions: tuple[Region, ...]
    predicted_peak_bytes: int
    recompute_s: float
    budget_bytes: int | None
    solver: str
    profile_signature: str
    plain_peak_bytes: int = 0
    plain_step_s: float = 0.0
    model: str = ""
    schema_version: int = PLAN_SCHEMA_VERSION
    notes: tuple[str, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def overhead(self) -> float:
        """Predicted extra step time as a fraction of the plain step (0.2 = +20%)."""
        return self.recompute_s / self.plain_step_s if self.plain_step_s > 0 else 0.0

    @property
    def predicted_step_s(self) -> float:
        """Predicted seconds of one planned step: the plain step plus the recompute."""
        return self.plain_step_s + self.recompute_s

    @property
    def peak_fraction(self) -> float:
        return self.predicted_peak_bytes / self.plain_peak_bytes if self.plain_peak_bytes else 1.0

    # ---- JSON ----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": "memfit.Plan",
            "schema_version": self.schema_version,
            "model": self.model,
            "solver": self.solver,
            "profile_signature": self.profile_signature,
            "budget_bytes": self.budget_bytes,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "plain_peak_bytes": self.plain_peak_bytes,
            "recompute_s": self.recompute_s,
            "plain_step_s": self.plain_step_s,
            "notes": list(self.notes),
            "regions": [
                {"modules": list(r.modules), "ops": {k: p.value for k, p in r.ops},
                 "recompute_s": r.recompute_s, "saved_bytes": r.saved_bytes,
                 "writes_buffers": r.writes_buffers}
                for r in self.regions
            ],
            "extra": self.extra,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        if not isinstance(data, dict) or data.get("kind") != "memfit.Plan":
            raise SchemaError("not a memfit plan (missing kind 'memfit.Plan')")
        version = data.get("schema_version")
        if version not in READABLE_SCHEMA_VERSIONS:
            raise SchemaError(
                f"plan schema version {version!r} is not supported (this memfit reads versions "
                f"{', '.join(map(str, READABLE_SCHEMA_VERSIONS))}); make the plan again"
            )
        try:
            return cls(
                regions=tuple(
                    Region(tuple(r["modules"]), _read_ops(r, version), float(r["recompute_s"]),
                           int(r["saved_bytes"]), _optional_bool(r.get("writes_buffers")))
                    for r in data["regions"]
                ),
                predicted_peak_bytes=int(data["predicted_peak_bytes"]),
                recompute_s=float(data["recompute_s"]),
                budget_bytes=None if data["budget_bytes"] is None else int(data["budget_bytes"]),
                solver=str(data["solver"]),
                profile_signature=str(data["profile_signature"]),
                plain_peak_bytes=int(data["plain_peak_bytes"]),
                plain_step_s=float(data["plain_step_s"]),
                model=str(data["model"]),
                notes=tuple(data.get("notes", ())),
                extra=dict(data.get("extra", {})),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise SchemaError(f"corrupt memfit plan: {type(e).__name__}: {e}") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise SchemaError(f"cannot read plan file {path}: {e.strerror}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise SchemaError(f"{path}: not valid JSON ({e}); is it a memfit plan?") from None
        return cls.from_dict(data)

    def outer_of(self, region: Region) -> Region | None:
        """The region ``region`` is nested in (NOTE [nested regions] in
        ``memfit.planning.nesting``), or None."""
        if region.is_segment:
            return None
        path = region.modules[0]
        for r in self.regions:
            if r is not region and any(path.startswith(m + ".") or (m == "" and path) for m in r.modules):
                return r
        return None

    # ---- display -------------------------------------------------------------------------
    def __str__(self) -> str:
        from memfit.units import format_bytes, format_seconds

        lines = [
            f"memfit plan ({self.solver}) for {self.model or 'model'}: "
            f"peak {format_bytes(self.predicted_peak_bytes)}"
            + (f" of {format_bytes(self.plain_peak_bytes)} ({self.peak_fraction:.0%})" if self.plain_peak_bytes else "")
            + (f", budget {format_bytes(self.budget_bytes)}" if self.budget_bytes else "")
            + f", recompute +{format_seconds(self.recompute_s)}"
            + (f" (+{self.overhead:.1%} step time)" if self.plain_step_s else ""),
        ]
        if not self.regions:
            lines.append("  no checkpointing: every activation is kept")
        else:
            # an inner region (NOTE [nested regions] in memfit.planning.nesting) is indented
            names = [("  " if self.outer_of(r) else "") + r.name for r in self.regions]
            w = max(len(n) for n in names)
            lines.append(f"  {'region'.ljust(w)}  {'kept ops':>8}  {'saved':>10}  {'recompute':>10}")
            for r, name in zip(self.regions, names, strict=True):
                kept = f"{len(r.save)}" if r.save else "none"
                if len(r.ops) > len(r.save):
                    kept += "+"  # decisions other than save (reserved for offload)
                lines.append(
                    f"  {name.ljust(w)}  {kept:>8}  {format_bytes(r.saved_bytes):>10}  "
                    f"{format_seconds(r.recompute_s):>10}"
                )
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)


def _optional_bool(value: Any) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    raise TypeError(f"'writes_buffers' must be true, false or null, got {value!r}")


def _read_ops(region: dict[str, Any], version: int) -> tuple[tuple[str, OpPolicy], ...]:
    """A region's per-op decisions from its JSON (NOTE [plan schema])."""
    if version == 1:
        return tuple((str(k), OpPolicy.SAVE) for k in region["save"])
    ops = region.get("ops", {})
    if not isinstance(ops, dict):
        raise TypeError(f"region 'ops' must be an object of key: decision, got {type(ops).__name__}")
    try:
        return tuple((str(k), OpPolicy(v)) for k, v in ops.items())
    except ValueError:
        bad = sorted({str(v) for v in ops.values()} - {p.value for p in OpPolicy})
        raise ValueError(f"unknown op decision(s) {bad}; this memfit knows "
                         f"{[p.value for p in OpPolicy]}") from None
