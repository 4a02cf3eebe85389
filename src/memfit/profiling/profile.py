"""The Profile: frozen data describing one training step, op by op.

A Profile is what ``profiling`` produces and ``planning`` consumes. It holds no tensors and no
modules, only numbers and names, so that solvers and their tests need no model.

NOTE [op positions]
    Ops are numbered 0..N-1 in the order the dispatcher ran them: the forward ops (and the
    loss) first, then the backward ops. ``Profile.n_forward`` is the number of forward ops, so
    op ``i`` is in backward iff ``i >= n_forward``. Every position in the step is an op index.

NOTE [storage lifetimes]
    Memory is counted per storage (a view shares its base's storage and costs nothing). A
    storage created by op ``i`` is live from op ``i`` on; ``freed_after = j`` means the storage
    was released after op ``j`` finished and before op ``j + 1`` began. Storages live before
    the step (parameters, inputs, buffers) have ``created_by = None`` and are not activation
    memory; storages still live after the step (parameter gradients) have ``freed_after =
    None``. ``Profile.live_bytes[i]`` is the activation memory live while op ``i``'s outputs
    exist and its inputs are still held, plus ``ops[i].workspace_bytes`` (its local peak); the
    step's peak is the maximum.

NOTE [Python releases]
    ``StorageRecord.released_after`` is the forward op after which the step's Python code let
    go of a storage the forward created: where it is freed in a forward whose saved-tensor
    hooks keep nothing (the profiler traces one such forward and loss besides the step; its
    storages are matched to the step's by creating op and order). It is where a storage that
    a checkpointed region no longer saves is freed in that region's forward (NOTE [region
    memory model] in ``memfit.planning.effects``): ``y = self.bn2(self.conv2(y))`` lets the
    first ReLU's output go at that line, not when the block returns. ``None``: still held at
    the forward's end (or by nothing the step's code frees), or not traced; profiles without
    the trace (``Profile.extra["python_releases"]`` absent: written before the field, or a
    forward whose ops differed) keep the older rule, the end of the module that created it;
    so do autocast's cached casts, which a region makes without the cache (NOTE [autocast's
    cast cache] in ``memfit.planning.cast_cache``): the cache held the zoo GPT's to the
    forward's end, 98,304 B over the measured peak of its checkpointed blocks in bfloat16.

NOTE [kernel workspaces]
    ``OpRecord.workspace_bytes`` is memory an op's kernel allocates internally and frees before
    returning, on top of its outputs (the im2col buffers of CPU convolutions). No dispatch mode
    sees it; in measure mode on CPU the tracer reads it for every op from the CPU allocator's
    events inside the op's call in the traced run (``local peak - new output bytes``, at
    least 0; NOTE [workspace measurement] in ``memfit.profiling.workspace``). It counts at op
    ``i`` only (not "just before" op ``i``), and again wherever a recompute replays op ``i``.
    Fake-mode profiles and CUDA workspaces are not modelled yet: ``workspace_bytes`` is 0 there.

NOTE [region state bytes]
    ``Profile.region_state_bytes`` is what each checkpointed call keeps on the profiled
    device besides tensors of the step: torch's checkpoint stashes the CPU generator's state
    (``torch.get_rng_state()``, 5,056 B on torch 2.13) at the call, to replay random ops,
    and holds it until the call's recompute. On a CPU device that is device memory (a plan
    of 13 regions measured 65,792 B over its prediction before it was counted); on a GPU
    the CPU state, and the CUDA generators' states torch reads into CPU tensors, are host
    memory: 0. Profiles written before the field load with 0.

NOTE [autocast-cached storages]
    ``autocast_cached = True`` marks the output of a cast autocast keeps in its weight-cast
    cache (``memfit.ops.is_cached_cast``): the plain step holds it until the cache is cleared
    with the forward (NOTE [a fresh autocast cache per run] in ``memfit.step``), a checkpointed
    region, which runs without the cache, only while it is used (NOTE [autocast's cast cache]
    in ``memfit.planning.effects``). Profiles written before the field load with False.

NOTE [saved tensors]
    ``saved = True`` marks a storage that autograd packed for backward (a saved-tensor hook saw
    it). ``first_unpack`` is the backward op during which backward first read it; a region's
    recomputation happens just before the first of its saved storages is unpacked.
    ``saves`` has one ``(op, first_unpack, released_after)`` per forward pack of it: ``op`` is
    the forward op that saved it (its output, packed after it ran, or, packed in another
    module than the op before, its input: ``OpRecord.packs``/``next_packs``), so a pack
    belongs to the checkpoint of a region iff ``op`` is one of the region's ops;
    ``first_unpack`` the backward op during which that pack was first read, ``released_after``
    the op after which autograd let it go (its node ran), ``None`` for never. A storage
    saved by a region's own op and read after it (the region's output, saved by its last
    activation) is held by that node in the plain step, by nothing of the region's under
    checkpointing (NOTE [region memory model] in ``memfit.planning.effects``). Profiles
    written before the field have no ``saves``.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memfit.errors import SchemaError
from memfit.timemodel.calibration import Calibration

__all__ = [
    "PROFILE_SCHEMA_VERSION",
    "Phase",
    "StorageKind",
    "TensorMeta",
    "StorageRecord",
    "OpRecord",
    "ModuleRecord",
    "ParameterRecord",
    "Profile",
    "OptimizerMemory",
    "live_timeline",
    "op_signature",
    "COMPILED",
    "is_for_compiler",
    "NO_TAILS",
    "without_tails",
    "PYTHON_RELEASES",
]

PROFILE_SCHEMA_VERSION = 1
# ``Profile.extra["costs"]`` of a profile priced as torch.compile runs the step (NOTE [compiled
# costs] in ``memfit.profiling.compiled_costs``, which makes it; here for the torch-free planner)
COMPILED = "compiled"


def is_for_compiler(profile: Profile) -> bool:
    """Whether ``profile`` carries compiled costs (``memfit.profiling.compiled_costs.for_compiler``)."""
    return profile.extra.get("costs") == COMPILED


# Profile.extra: the storages' ``released_after`` were traced (NOTE [Python releases])
PYTHON_RELEASES = "python_releases"

# Profile.extra: plans of this profile give no region a tail (``memfit.Search(tails=False)``;
# NOTE [region tails] in memfit.planning.tails)
NO_TAILS = "no_region_tails"


def without_tails(profile: Profile) -> Profile:
    """``profile`` marked so that its plans give no region a tail."""
    return dataclasses.replace(profile, extra={**profile.extra, NO_TAILS: True})


class Phase(str, enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"


class StorageKind(str, enum.Enum):
    PARAMETER = "parameter"
    BUFFER = "buffer"
    INPUT = "input"          # an example input, live before the step
    ACTIVATION = "activation"  # created in forward (incl. loss)
    GRADIENT = "gradient"    # created in backward
    OTHER = "other"          # live before the step, but neither parameter, buffer nor input


@dataclass(frozen=True)
class TensorMeta:
    """One tensor an op produced: the storage it lives in, its shape and dtype."""

    storage: int
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class StorageRecord:
    """One storage seen during the step (see NOTE [storage lifetimes])."""

    id: int
    nbytes: int
    kind: StorageKind
    created_by: int | None = None
    freed_after: int | None = None
    saved: bool = False
    first_unpack: int | None = None
    last_forward_use: int | None = None
    autocast_cached: bool = False
    saves: tuple[tuple[int, int | None, int | None], ...] = ()  # NOTE [saved tensors]
    released_after: int | None = None  # NOTE [Python releases]


@dataclass(frozen=True)
class OpRecord:
    """One aten op the step ran.

    Attributes:
        index: position in the step (see NOTE [op positions]).
        name: the overload's name, e.g. ``"aten.mm.default"``.
        module: path of the innermost module running it (``"layers.3.attn"``); ``""`` is the
            root module, and backward ops carry the module whose forward they differentiate
            where known, else ``""``.
        phase: forward or backward.
        inputs: storage ids the op read.
        outputs: the tensors it returned.
        time_s: its run time (median of repeats when measured; a cost-model estimate in fake
            mode).
        inplace: it mutates an input (name ends with ``_`` or the schema says so).
        random: it consumes the random-number generator (dropout's ``bernoulli_``).
        flops: floating-point operations, where a formula is known (else 0).
        workspace_bytes: bytes the op's kernel allocates and frees inside itself, on top of its
            outputs (NOTE [kernel workspaces]); 0 where not measured.
        packs: tensors autograd saved for backward between this forward op's dispatch and
            the next one's, while this op's module was current: its saved outputs, and the
            next op's saved inputs (autograd saves an op's inputs before the op runs) when
            the next op runs in the same module. Where a checkpoint's replay stops (NOTE
            [region memory model] in ``memfit.planning.effects``). 0 in profiles written
            before the field.
        next_packs: the tensors saved in that interval while another module was current:
            the saved inputs of the next op, which runs in another module (a block's output
            saved by the next block's norm), so in no region this op's module ends.
        forward_op: for a backward op, the forward op whose autograd node runs it (NOTE
            [module paths of backward ops]); ``None`` for forward ops, gradient accumulation,
            and profiles written before the field.
        saveable: whether a plan may save this op's outputs at all; False where the front
            end cannot name them for its runtime (``memfit.jax``: a value JAX's
            differentiation rules made, NOTE [a jaxpr as a Profile]). True in profiles
            written before the field.
    """

    index: int
    name: str
    module: str
    phase: Phase
    inputs: tuple[int, ...] = ()
    outputs: tuple[TensorMeta, ...] = ()
    time_s: float = 0.0
    inplace: bool = False
    random: bool = False
    flops: int = 0
    workspace_bytes: int = 0
    packs: int = 0
    next_packs: int = 0
    forward_op: int | None = None
    saveable: bool = True


@dataclass(frozen=True)
class ModuleRecord:
    """One module of the model and what its (first) forward call did.

    ``first_op``/``last_op`` bound the forward ops of its first call (``None`` if it ran no
    op). ``calls`` counts forward calls in the step (shared modules run more than once).
    """

    path: str
    type: str
    parent: str | None
    children: tuple[str, ...] = ()
    first_op: int | None = None
    last_op: int | None = None
    calls: int = 0
    inputs: tuple[int, ...] = ()
    outputs: tuple[int, ...] = ()
    parameter_bytes: int = 0
    backward_time_s: float = 0.0


@dataclass(frozen=True)
class ParameterRecord:
    """One parameter of the model (NOTE [the job's memory] in ``memfit.planning.job``).

    ``shape`` and ``nbytes`` are what this process holds: for a DTensor (an FSDP shard) its
    local shard, with ``sharded = True``. ``trainable`` is ``requires_grad``: it gets a
    gradient and optimizer state.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    trainable: bool = True
    sharded: bool = False


@dataclass(frozen=True)
class Profile:
    """One training step, op by op. See the module docstring for the invariants.

    Example:
        >>> p = memfit.profile(model, x)            # doctest: +SKIP
        >>> p.peak_bytes, len(p.ops), p.n_forward    # doctest: +SKIP
    """

    ops: tuple[OpRecord, ...]
    storages: tuple[StorageRecord, ...]
    modules: tuple[ModuleRecord, ...]
    n_forward: int
    live_bytes: tuple[int, ...]
    peak_bytes: int
    baseline_bytes: int
    step_time_s: float
    model: str = ""
    device: str = "cpu"
    mode: str = "measure"
    cost_model: str = "measured"
    signature: str = ""
    # the recompute time model (NOTE [calibration] in memfit.timemodel); None: not
    # calibrated (a profile made before calibration, or by the tracer alone): the defaults
    calibration: Calibration | None = None
    region_state_bytes: int = 0  # NOTE [region state bytes]
    # the root module's first call: (name, shape, dtype) of each tensor, the parameters' dtype
    # (NOTE [input signature] in memfit.step.inputs); () in profiles written before it
    input_signature: tuple[tuple[str, tuple[int, ...], str], ...] = ()
    # the model's parameters and the bytes of its buffers (the weights the device holds
    # besides activations; NOTE [the job's memory]); () and 0 in profiles written before them
    parameters: tuple[ParameterRecord, ...] = ()
    buffer_bytes: int = 0
    schema_version: int = PROFILE_SCHEMA_VERSION
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    # ---- lookups -------------------------------------------------------------------------
    def storage(self, sid: int) -> StorageRecord:
        rec = self.storages[sid]
        if rec.id != sid:  # storages are stored densely, id == position
            raise SchemaError(f"profile storage table is not dense: position {sid} holds id {rec.id}")
        return rec

    def module(self, path: str) -> ModuleRecord:
        for m in self.modules:
            if m.path == path:
                return m
        raise KeyError(f"no module {path!r} in the profile; known: {[m.path for m in self.modules][:20]}")

    @property
    def forward_ops(self) -> tuple[OpRecord, ...]:
        return self.ops[: self.n_forward]

    @property
    def backward_ops(self) -> tuple[OpRecord, ...]:
        return self.ops[self.n_forward :]

    @property
    def forward_time_s(self) -> float:
        return sum(op.time_s for op in self.forward_ops)

    @property
    def saved_bytes(self) -> int:
        """Bytes of activation storages autograd saved for backward."""
        return sum(s.nbytes for s in self.storages if s.saved and s.kind == StorageKind.ACTIVATION)

    # ---- JSON ----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return _to_jsonable(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        if not isinstance(data, dict) or data.get("kind") != "memfit.Profile":
            raise SchemaError("not a memfit profile (missing kind 'memfit.Profile')")
        version = data.get("schema_version")
        if version != PROFILE_SCHEMA_VERSION:
            raise SchemaError(
                f"profile schema version {version!r} is not supported by this memfit "
                f"(it reads version {PROFILE_SCHEMA_VERSION}); profile the model again"
            )
        try:
            return Profile(
                ops=tuple(
                    OpRecord(
                        **{**o, "phase": Phase(o["phase"]), "inputs": tuple(o["inputs"]),
                           "outputs": tuple(TensorMeta(t["storage"], tuple(t["shape"]), t["dtype"]) for t in o["outputs"])}
                    )
                    for o in data["ops"]
                ),
                storages=tuple(StorageRecord(**{**s, "kind": StorageKind(s["kind"]),
                                                "saves": tuple(tuple(x) for x in s.get("saves", ()))})
                               for s in data["storages"]),
                modules=tuple(
                    ModuleRecord(**{**m, "children": tuple(m["children"]), "inputs": tuple(m["inputs"]),
                                    "outputs": tuple(m["outputs"])})
                    for m in data["modules"]
                ),
                **_scalar_fields(data),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise SchemaError(f"corrupt memfit profile: {type(e).__name__}: {e}") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), separators=(",", ":")))

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise SchemaError(f"{path}: not valid JSON ({e}); is it a memfit profile?") from None
        return cls.from_dict(data)


def op_signature(ops: Iterable[OpRecord], n_forward: int | None = None) -> str:
    """A short hash of the forward op sequence (names and module paths).

    Two profiles of the same model and input shapes share it; plans carry it so that applying a
    plan to another model is caught.
    """
    h = hashlib.sha256()
    for op in ops:
        if n_forward is not None and op.index >= n_forward:
            break
        if op.phase is Phase.FORWARD:
            h.update(f"{op.name}@{op.module};".encode())
    return h.hexdigest()[:16]


def _scalar_fields(data: dict[str, Any]) -> dict[str, Any]:
    """The Profile fields of ``data`` other than the op, storage and module tables."""
    out: dict[str, Any] = {
        k: v for k, v in data.items() if k not in ("ops", "storages", "modules", "kind")
    }
    out["live_bytes"] = tuple(data["live_bytes"])
    out["input_signature"] = tuple((str(n), tuple(s), str(d)) for n, s, d in data.get("input_signature", ()))
    out["parameters"] = tuple(ParameterRecord(**{**r, "shape": tuple(r["shape"])})
                              for r in data.get("parameters", ()))
    cal = data.get("calibration")
    out["calibration"] = Calibration.from_dict(cal) if cal is not None else None
    return out


def _to_jsonable(obj: Any) -> Any:
    if isinstance(obj, Calibration):
        return obj.to_dict()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {f.name: _to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        if isinstance(obj, Profile):
            out = {"kind": "memfit.Profile", **out}
        return out
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, dict):
        return {str(k): _to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_to_jsonable(v) for v in obj]
    return obj


@dataclass(frozen=True)
class OptimizerMemory:
    """What an optimizer keeps and allocates on the device (NOTE [the job's memory] in ``memfit.planning.job``;
    measured by ``memfit.profiling.optimizer``, read by the planner).

    Attributes:
        name: what was measured, e.g. ``"AdamW (foreach, bfloat16 states)"``.
        state_bytes: kept between steps: states, and master weights where there are any.
        step_bytes: allocated and freed inside ``optimizer.step()``, on top of the states.
    """

    name: str
    state_bytes: int
    step_bytes: int

    @classmethod
    def none(cls) -> OptimizerMemory:
        return cls("no optimizer", 0, 0)


def live_timeline(storages: Any, n_ops: int, workspace: Sequence[int] | None = None) -> list[int]:
    """Bytes of activation/gradient storages live at each op: ``created_by <= i`` and not
    ``freed_after < i``, plus ``workspace[i]`` (the Profile's ``live_bytes`` contract, NOTE
    [storage lifetimes]). Takes ``StorageRecord``s or ``TracedStorage``s."""
    delta = [0] * (n_ops + 1)
    for s in storages:
        if s.created_by is None or s.kind not in (StorageKind.ACTIVATION, StorageKind.GRADIENT):
            continue
        delta[min(s.created_by, n_ops)] += s.nbytes
        end = n_ops if s.freed_after is None else min(s.freed_after + 1, n_ops)
        delta[end] -= s.nbytes
    out, live = [], 0
    for i in range(n_ops):
        live += delta[i]
        out.append(live + (workspace[i] if workspace is not None and i < len(workspace) else 0))
    return out
