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
    memfit reads. The optional ``"tuning"`` object (``Tuning``: what ``memfit.tune`` measured)
    was added within version 2: files without it read as ``tuning=None``, and readers that
    predate it ignore it. ``"host_peak_bytes"`` (offload) is optional too: a file without it
    reads as 0, and so is ``"memory"`` (the job's breakdown, ``JobMemory``): absent, None.
    ``"extra_flops"`` (the FLOPs the recompute adds to one step) and ``"profile_device"`` (the
    device the plan's seconds are for) are optional as well: absent, None and ``""``
    (``Plan.cost`` then reports no FLOPs and asks for ``target=``). ``"compressed"`` (the saved
    tensors kept packed, ``memfit.planning.compression``) is optional: absent, ``()``.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memfit.errors import SchemaError
from memfit.planning.compression import Compressed, compressed_lines
from memfit.planning.job import JobMemory
from memfit.planning.tuning_record import TunedCandidate, Tuning

if TYPE_CHECKING:
    from memfit.planning.runcost import RunCost

__all__ = ["PLAN_SCHEMA_VERSION", "OpPolicy", "Region", "Plan", "TunedCandidate", "Tuning"]

PLAN_SCHEMA_VERSION = 2
READABLE_SCHEMA_VERSIONS = (1, 2)


class OpPolicy(str, enum.Enum):
    """What a region does with one op occurrence's outputs between forward and backward.

    Maps onto ``torch.utils.checkpoint.CheckpointPolicy`` (``memfit.runtime.policies``).
    """

    SAVE = "save"            # keep in memory (MUST_SAVE); for a random op of
                             # memfit.ops.KEPT_DRAW_OPS, keep its draw (NOTE [kept draws])
    RECOMPUTE = "recompute"  # drop, rerun in backward (PREFER_RECOMPUTE); the default
    OFFLOAD = "offload"      # keep in host memory: copied out in forward, back for the replay
    # keep packed by a codec (Plan.compressed, ops outside regions; inside a region: not yet)
    COMPRESS = "compress"


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
        tail_after: the sub-module after whose call the region's tail runs: ops whose saves
            autograd keeps as in the plain step, which the replay never reaches (NOTE [region
            tails] in ``memfit.planning.tails``); None: no tail. One module only.
    """

    modules: tuple[str, ...]
    ops: tuple[tuple[str, OpPolicy], ...] = ()
    recompute_s: float = 0.0
    saved_bytes: int = 0
    writes_buffers: bool | None = None
    tail_after: str | None = None

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
            if policy is OpPolicy.COMPRESS:
                raise ValueError(f"Region.ops[{key!r}]: COMPRESS inside a checkpointed region is not "
                                 "supported yet; Plan.compressed names ops outside regions")
            pairs.append((str(key), policy))
        keys = [k for k, _ in pairs]
        if len(set(keys)) != len(keys):
            raise ValueError(f"Region.ops names an op twice: {sorted(k for k in keys if keys.count(k) > 1)}")
        object.__setattr__(self, "ops", tuple(p for p in pairs if p[1] is not OpPolicy.RECOMPUTE))
        if self.tail_after is not None:
            if len(self.modules) != 1:
                raise ValueError(f"region {self.modules}: a segment has no tail (tail_after="
                                 f"{self.tail_after!r}); a tail belongs to a one-module region")
            prefix = self.modules[0] + "." if self.modules[0] else ""
            if not str(self.tail_after).startswith(prefix) or self.tail_after == self.modules[0]:
                raise ValueError(f"region {self.modules[0]!r}: tail_after={self.tail_after!r} is not "
                                 "one of its sub-modules")

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
    host_peak_bytes: int = 0  # peak host memory of offloaded outputs (0: nothing offloaded)
    # the inputs the profile was made on: (name, shape, dtype) per tensor and the parameters'
    # dtype (NOTE [input signature] in memfit.step.inputs); the planned model warns once
    # when called on others (memfit.runtime.shapes); () in plans made before the field
    input_signature: tuple[tuple[str, tuple[int, ...], str], ...] = ()
    # what measured selection timed (``memfit.tune``); a measurement, not part of the plan
    tuning: Tuning | None = field(default=None, compare=False, hash=False)
    # the whole job's memory on the device, for a plan made for a ``memfit.Job`` (NOTE [the
    # job's memory] in memfit.planning.job); None for an activation budget alone
    memory: JobMemory | None = None
    # FLOPs the recompute adds to one step (simulate's recompute_flops: the non-saved forward
    # ops each replay reruns, from the profile's OpRecord.flops); None in plans made before it
    extra_flops: int | None = None
    # the device the plan's seconds are for: the profile's fake-mode target ("h100") or the
    # device it was measured on ("cpu", "cuda:0"); "" in plans made before the field
    profile_device: str = ""
    # saved tensors of ops outside every region kept packed (memfit.planning.compression)
    compressed: tuple[Compressed, ...] = ()

    @property
    def lossy(self) -> bool:
        """Whether a codec of the plan changes values (NOTE [what lossy means])."""
        return any(not c.lossless for c in self.compressed)

    def cost(self, steps: int, gpus: int = 1, *, target: str | None = None,
             board_power_w: float | None = None, price_per_gpu_hour: float | None = None) -> RunCost:
        """What this plan's recompute costs over a training run (NOTE [run cost] in
        ``memfit.planning.runcost``).

        Args:
            steps: training steps of the run (a positive int).
            gpus: devices running the step, each its own micro-batch (default 1).
            target: the device preset of the run (``"v100"``, ``"a100"``, ``"h100"``,
                ``"h200"``, ``"cpu"``); default: the one the profile was made for. A target
                other than the profile's raises ``ValueError``: profile for it instead.
            board_power_w: watts charged per device for every extra second; default the
                preset's datasheet board power (none for ``"cpu"``: then required).
            price_per_gpu_hour: price of one device-hour, any currency; default None (no cost).

        Returns:
            A :class:`~memfit.planning.runcost.RunCost` (``print`` it for a summary).

        Raises:
            ValueError: ``steps`` or ``gpus`` not positive, an unknown target or one other than
                the profile's, no board power known, a negative power or price.
            TypeError: ``steps`` or ``gpus`` not an int, a power or price not a number.

        Example:
            >>> print(plan.cost(100_000, 8, price_per_gpu_hour=2.5))   # doctest: +SKIP
        """
        from memfit.planning.runcost import run_cost

        return run_cost(self, steps, gpus, target=target, board_power_w=board_power_w,
                        price_per_gpu_hour=price_per_gpu_hour)

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
            "host_peak_bytes": self.host_peak_bytes,
            "input_signature": [[n, list(s), d] for n, s, d in self.input_signature],
            "notes": list(self.notes),
            "regions": [
                {"modules": list(r.modules), "ops": {k: p.value for k, p in r.ops},
                 "recompute_s": r.recompute_s, "saved_bytes": r.saved_bytes,
                 "writes_buffers": r.writes_buffers,
                 **({"tail_after": r.tail_after} if r.tail_after is not None else {})}
                for r in self.regions
            ],
            "extra": self.extra,
            "tuning": None if self.tuning is None else self.tuning.to_dict(),
            "memory": None if self.memory is None else self.memory.to_dict(),
            "extra_flops": self.extra_flops,
            "profile_device": self.profile_device,
            "compressed": [c.to_dict() for c in self.compressed],
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
            plan = cls(
                regions=tuple(
                    Region(tuple(r["modules"]), _read_ops(r, version), float(r["recompute_s"]),
                           int(r["saved_bytes"]), _optional_bool(r.get("writes_buffers")),
                           None if r.get("tail_after") is None else str(r["tail_after"]))
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
                host_peak_bytes=int(data.get("host_peak_bytes", 0)),  # absent before offload
                input_signature=tuple((str(n), tuple(int(d) for d in s), str(t))
                                      for n, s, t in data.get("input_signature", ())),
                tuning=None if data.get("tuning") is None else Tuning.from_dict(data["tuning"]),
                memory=None if data.get("memory") is None else JobMemory.from_dict(data["memory"]),
                extra_flops=None if data.get("extra_flops") is None else int(data["extra_flops"]),
                profile_device=str(data.get("profile_device", "")),
                compressed=tuple(Compressed.from_dict(c) for c in data.get("compressed", ())),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise SchemaError(f"corrupt memfit plan: {type(e).__name__}: {e}") from None
        quantities = {"predicted_peak_bytes": plan.predicted_peak_bytes, "recompute_s": plan.recompute_s,
                      "budget_bytes": plan.budget_bytes, "plain_peak_bytes": plan.plain_peak_bytes,
                      "plain_step_s": plan.plain_step_s, "host_peak_bytes": plan.host_peak_bytes,
                      "extra_flops": plan.extra_flops}
        quantities |= {f"region {r.name}'s {k}": v for r in plan.regions
                       for k, v in (("saved_bytes", r.saved_bytes), ("recompute_s", r.recompute_s))}
        for name, value in quantities.items():
            if value is not None and value < 0:
                raise SchemaError(f"corrupt memfit plan: {name} is {value}, and bytes, seconds and "
                                  "FLOPs are never negative; make the plan again (memfit plan)")
        return plan

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
        """The innermost region ``region`` is nested in (NOTE [nested regions] in
        ``memfit.planning.nesting``), or None."""
        return max(self.outers_of(region), key=lambda r: len(self.outers_of(r)), default=None)

    def outers_of(self, region: Region) -> list[Region]:
        """Every region ``region`` is nested in, at any depth (NOTE [regions nested deeper] in
        ``memfit.planning.nesting``: a segment whose modules are some of another's is in it)."""
        path = region.modules[0]
        out = []
        for r in self.regions:
            if r is region:
                continue
            if region.is_segment and r.is_segment:
                if set(region.modules) < set(r.modules):
                    out.append(r)
            elif any(path.startswith(m + ".") or (m == "" and path)
                     or (r.is_segment and path == m) for m in r.modules):
                out.append(r)
        return out

    # ---- display -------------------------------------------------------------------------
    def per_step_line(self) -> str:
        """What the recompute adds to one step: FLOPs and seconds (for ``print(plan)``)."""
        from memfit.units import format_flops, format_seconds

        flops = "FLOPs not recorded" if self.extra_flops is None else f"{format_flops(self.extra_flops)} recomputed"
        on = f" on {self.profile_device}" if self.profile_device else ""
        return f"  extra per step: {flops}, +{format_seconds(self.recompute_s)}{on}"

    def __str__(self) -> str:
        from memfit.units import format_bytes, format_seconds

        lines = [
            f"memfit plan ({self.solver}) for {self.model or 'model'}: "
            f"peak {format_bytes(self.predicted_peak_bytes)}"
            + (f" of {format_bytes(self.plain_peak_bytes)} ({self.peak_fraction:.0%})" if self.plain_peak_bytes else "")
            + (f", budget {format_bytes(self.budget_bytes)}" if self.budget_bytes else "")
            + f", recompute +{format_seconds(self.recompute_s)}"
            + (f" (+{self.overhead:.1%} step time)" if self.plain_step_s else "")
            + (f", host {format_bytes(self.host_peak_bytes)}" if self.host_peak_bytes else ""),
        ]
        if self.regions:
            lines.append(self.per_step_line())
        if self.memory is not None:
            lines.extend(self.memory.lines())
        if not self.regions:
            lines.append("  no checkpointing: every activation is kept")
        else:
            # an inner region (NOTE [nested regions] in memfit.planning.nesting) is indented
            names = ["  " * len(self.outers_of(r)) + r.name for r in self.regions]
            w = max(len(n) for n in names)
            lines.append(f"  {'region'.ljust(w)}  {'kept ops':>8}  {'saved':>10}  {'recompute':>10}")
            for r, name in zip(self.regions, names, strict=True):
                kept = f"{len(r.save)}" if r.save else "none"
                n_off = len(r.keys_with(OpPolicy.OFFLOAD))
                if n_off:
                    kept = f"{len(r.save)}+{n_off}"  # saved + offloaded
                lines.append(
                    f"  {name.ljust(w)}  {kept:>8}  {format_bytes(r.saved_bytes):>10}  "
                    f"{format_seconds(r.recompute_s):>10}"
                )
        if any(r.keys_with(OpPolicy.OFFLOAD) for r in self.regions):
            lines.append("  kept ops a+b: a saved on the device, b offloaded to host memory")
        from memfit.ops import KEPT_DRAW_OPS  # here: importing memfit needs no torch internals

        draws = sum(1 for r in self.regions for k in r.save if k.rpartition("#")[0] in KEPT_DRAW_OPS)
        if draws:
            lines.append(f"  kept ops include {draws} dropout draw(s): the mask is kept, 1 byte per "
                         "element, and not drawn again in the replay")
        lines.extend(compressed_lines(self.compressed))
        lines.extend(f"  note: {n}" for n in self.notes)
        if self.tuning is not None:
            lines.extend(self.tuning.lines())
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
