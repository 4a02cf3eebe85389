"""The whole job's memory on one device: weights, gradients, optimizer states, activations.

NOTE [the job's memory]
    A training job holds on each device, besides the step's activations: the weights (every
    parameter and buffer, ``Profile.parameters`` and ``buffer_bytes``), one gradient per
    trainable parameter, the optimizer's states (Adam's two moments, SGD's momentum; master
    weights in mixed precision) and, while ``optimizer.step()`` runs, its transient tensors
    (a foreach Adam's sqrt of the second moments: one state's size; a single-tensor Adam's
    two temporaries of the largest parameter; a fused one's none). Measured on fake tensors
    by ``memfit.profiling.optimizer``; this module only adds them up.

    Gradients are counted once. The profile's activation peak already holds the gradients
    that backward has allocated by then (a step starts with ``.grad`` None, as after
    ``zero_grad(set_to_none=True)``, torch's default), so they are not added to it again.
    The job's peak is the larger of its two phases:

        forward + backward:  weights + optimizer states + activation peak (gradients inside)
        optimizer step:      weights + optimizer states + gradients + the step's transients

    plus the reserve (NOTE [reserve]). The activation budget a plan must meet is therefore
    ``device_memory - reserve - weights - optimizer states`` (the phase that plans change),
    and the step phase must fit on its own: if ``gradients + step transients`` exceed that
    budget no plan can help. ``budget=`` keeps its meaning (a cap on the activation peak
    alone); given with ``device_memory`` the smaller of the two caps holds.

NOTE [gradient accumulation]
    With ``grad_accumulation`` (several micro-batches' backwards add into ``.grad`` before one
    ``optimizer.step()``), every micro-batch after the first runs its forward and backward
    with the gradients already held, so both phases hold them:

        forward + backward:  weights + optimizer states + gradients + activation peak
        optimizer step:      weights + optimizer states + gradients + the step's transients

    and the activation budget is ``device_memory - reserve - weights - states - gradients``.
    An upper bound: the profile's activation peak (one step from ``.grad`` None) holds the
    gradients backward has made by then, which under accumulation are added into the held
    ones and freed, so they are counted twice; the breakdown says which assumption holds.

NOTE [sharded model states]
    With ``world_size = N`` and ``sharding`` (ZeRO's stages, FSDP's strategies):
    ``"optimizer"`` divides optimizer states and the step's transients by N (ZeRO-1),
    ``"gradients"`` also the gradients (ZeRO-2, FSDP ``SHARD_GRAD_OP``), ``"full"`` also the
    parameters (ZeRO-3, FSDP ``FULL_SHARD``; buffers stay whole), each rounded up to whole
    bytes per rank. The activation peak is the profile's, taken on the unsharded model: it
    keeps the whole gradients backward allocates and leaves out the parameters FSDP gathers
    for the units in flight, so it is not exact under sharding (a conservative count of the
    gradients, none of the gathered parameters: give ``reserve=`` for them). A profile of a
    model that is already sharded (FSDP2 DTensor shards) holds per-rank sizes: sharding it
    again is refused.

NOTE [engine memory]
    A training engine allocates buffers of its own while forward and backward run, which no
    profile of the model sees: DeepSpeed ZeRO-1/2's gradient buckets (``reduce_bucket_size``
    elements, two with ``overlap_comm``), freed at the end of backward. ``JobSpec.engine``
    lists them, by the engine's names, in bytes per device; they count in the forward +
    backward phase only:

        forward + backward:  weights + optimizer states + activation peak + engine buffers

    so the activation budget is ``device_memory - reserve - weights - states - engine``, and
    each is a line of the breakdown. An upper bound: the gradients the engine copies into
    its buckets are counted in the activation peak too (with a budget instead of a device,
    the DeepSpeed integration replaces them on the plan's timeline: NOTE [DeepSpeed's
    gradients in the timeline] in ``memfit.integrations.deepspeed_peak``).

NOTE [reserve]
    Memory the job needs that no tensor accounts for. On a CPU it is 0 (malloc, no context).
    On a CUDA device: the CUDA context and library workspaces (cuBLAS, cuDNN) outside
    torch's allocator, and the caching allocator's rounding and fragmentation inside it. The
    default is 1 GiB plus 2% of the device's memory (2.6 GiB on an 80 GiB card, 3.89 GB on
    a 141 GB H200). Measured on an H200 (torch 2.11, ``benchmarks.gpu_probe job``: three AdamW
    steps of six models, plain and every-block checkpointed; results/gpu-probe-2026-12-04):
    the CUDA context took 0.60 GiB after start and 0.75 GiB once the kernels had loaded; the
    allocated peak (weights, gradients, states, activations) was 1.000-1.045 of memfit's
    prediction; the caching allocator's reserved peak plus the context exceeded the allocated
    peak by 0.92-1.82 GB with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, and by
    1.09-2.47 GB for the transformers but 2.90-4.81 GB for the ResNets with the default
    allocator (cuDNN's transient convolution workspaces, up to 1.1 GB, leave cached blocks
    behind). At the card's edge (``benchmarks.gpu_largest_batch``: an HF Llama, 8 x 2048,
    bf16, 2048 tokens a row, AdamW, on the H200's 150,109,880,320 B): with expandable segments
    the largest batch memfit predicted with a reserve of 1 GiB + 2% ran (59 plain, its
    allocated peak 1.0005 of predicted) and so did 60 and 61 (63 did not); with the default
    allocator 59 ran out of memory (a 14.4 GiB block did not fit the 5.1 GiB its fragments
    left) and 55 ran, and under every-block checkpointing 140 ran out and 132 ran. So the
    default reserve on a GPU is 1 GiB + 2% of the device with expandable segments
    (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` in the planning process's
    environment, as in the job's) and 1 GiB + 8% without them (predicting 55 and 131 there).
    Pass ``reserve=`` to choose.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from memfit.profiling.profile import OptimizerMemory
from memfit.units import format_bytes

__all__ = ["OptimizerMemory", "JobSpec", "JobMemory", "SHARDINGS", "model_memory", "activation_budget",
           "job_memory", "step_phase_bytes", "default_reserve_bytes", "expandable_segments", "smallest_world_size"]

SHARDINGS = ("none", "optimizer", "gradients", "full")
_GiB = 1 << 30


@dataclass(frozen=True)
class JobSpec:
    """The device a plan is for and what else the job keeps on it."""

    device_memory_bytes: int
    optimizer: OptimizerMemory
    reserve_bytes: int
    world_size: int = 1
    sharding: str = "none"
    grad_accumulation: bool = False  # NOTE [gradient accumulation]
    engine: tuple[tuple[str, int], ...] = ()  # NOTE [engine memory]: (name, bytes) lines

    @property
    def engine_bytes(self) -> int:
        return sum(n for _, n in self.engine)

    def __post_init__(self) -> None:
        if any(not isinstance(n, int) or n < 0 for _, n in self.engine):
            raise ValueError(f"engine lines must be (name, bytes >= 0), got {self.engine!r}")
        if self.device_memory_bytes <= 0:
            raise ValueError(f"device_memory must be positive bytes, got {self.device_memory_bytes}")
        if self.reserve_bytes < 0:
            raise ValueError(f"reserve must be >= 0 bytes, got {self.reserve_bytes}")
        if self.sharding not in SHARDINGS:
            raise ValueError(f"sharding must be one of {SHARDINGS}, got {self.sharding!r}")
        if self.world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {self.world_size}")
        if not isinstance(self.grad_accumulation, bool):
            raise TypeError(f"grad_accumulation must be True or False, got {self.grad_accumulation!r}")


@dataclass(frozen=True)
class JobMemory:
    """The job's memory on one device, by part (NOTE [the job's memory]); bytes.

    ``total_bytes = weights + optimizer + max(activations + engine, gradients +
    optimizer_step) + reserve``: ``activations_bytes`` is the plan's predicted activation
    peak, which holds the gradients allocated by then; ``engine`` the engine's own buffers
    during forward and backward (NOTE [engine memory]). With ``grad_accumulation`` the gradients are held in
    both phases: ``weights + optimizer + gradients + max(activations, optimizer_step) +
    reserve`` (NOTE [gradient accumulation]).
    """

    device_memory_bytes: int
    weights_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    optimizer_step_bytes: int
    activations_bytes: int
    reserve_bytes: int
    total_bytes: int
    optimizer: str = "no optimizer"
    world_size: int = 1
    sharding: str = "none"
    grad_accumulation: bool = False
    engine: tuple[tuple[str, int], ...] = ()

    @property
    def engine_bytes(self) -> int:
        return sum(n for _, n in self.engine)

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.device_memory_bytes

    @property
    def free_bytes(self) -> int:
        """Device memory left over (negative: the shortfall)."""
        return self.device_memory_bytes - self.total_bytes

    @property
    def activation_budget_bytes(self) -> int:
        """The most the activation peak may reach on this device."""
        held = self.gradients_bytes if self.grad_accumulation else 0
        return (self.device_memory_bytes - self.reserve_bytes - self.weights_bytes
                - self.optimizer_bytes - held - self.engine_bytes)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["engine"] = [list(line) for line in self.engine]
        if not self.engine:  # a job without an engine writes the JSON it wrote before engines
            del out["engine"]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobMemory:
        kinds = {f.name: f.type for f in fields(cls)}
        cast = {"str": str, "bool": bool}
        engine = tuple((str(name), int(n)) for name, n in data.get("engine", ()))
        return cls(**{k: cast.get(str(kinds[k]), int)(v) for k, v in data.items()  # type: ignore[arg-type]
                      if k != "engine"}, engine=engine)

    def lines(self) -> list[str]:
        """The breakdown as a table."""
        shard = (f", {self.sharding} sharding over {self.world_size} devices"
                 if self.sharding != "none" else "")
        grads = ("one per trainable parameter, held through forward and backward (gradient "
                 "accumulation): on top of the activation peak" if self.grad_accumulation else
                 "one per trainable parameter; inside the activation peak, so counted once")
        rows = [("weights", self.weights_bytes, "parameters and buffers"),
                ("gradients", self.gradients_bytes, grads),
                ("optimizer states", self.optimizer_bytes, self.optimizer),
                ("optimizer step", self.optimizer_step_bytes, "transient, while step() runs"),
                ("activations", self.activations_bytes, "the plan's predicted peak"),
                *((name, n, "the engine's, during forward + backward (NOTE [engine memory])")
                  for name, n in self.engine),
                ("reserve", self.reserve_bytes, "CUDA context, allocator (NOTE [reserve])")]
        out = [f"  device memory {format_bytes(self.device_memory_bytes)}{shard}"]
        out += [f"    {name:<17}{format_bytes(n):>12}  {why}" for name, n, why in rows]
        verdict = (f"fits, {format_bytes(self.free_bytes)} free" if self.fits
                   else f"does NOT fit: {format_bytes(-self.free_bytes)} short")
        act = "activations + engine" if self.engine else "activations"
        formula = (f"gradients + max({act}, step)" if self.grad_accumulation
                   else f"max({act}, gradients + step)")
        out.append(f"    {'total':<17}{format_bytes(self.total_bytes):>12}  {verdict} "
                   f"(weights + states + {formula} + reserve)")
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())


@dataclass(frozen=True)
class ModelMemory:
    """Weights, gradients, optimizer states and step transients on one device, sharded."""

    weights_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    optimizer_step_bytes: int


def model_memory(parameters: Iterable[Any], buffer_bytes: int, spec: JobSpec) -> ModelMemory:
    """The model's share of one device under ``spec`` (NOTE [sharded model states]).

    ``parameters`` are ``memfit.profiling.profile.ParameterRecord`` s (anything with
    ``nbytes``, ``trainable`` and ``sharded``).

    Example:
        >>> from memfit.profiling.profile import ParameterRecord
        >>> ps = [ParameterRecord("w", (10,), "float32", 40)]
        >>> model_memory(ps, 0, JobSpec(1000, OptimizerMemory("sgd", 40, 0), 0, 2, "full"))
        ModelMemory(weights_bytes=20, gradients_bytes=20, optimizer_bytes=20, optimizer_step_bytes=0)
    """
    params = list(parameters)
    n = spec.world_size if spec.sharding != "none" else 1
    if n > 1 and any(p.sharded for p in params):
        raise ValueError(
            f"the profile's parameters are already sharded (DTensor shards: a per-rank profile), "
            f"so sharding={spec.sharding!r} over world_size={spec.world_size} would divide them "
            "again; plan it with sharding='none', or profile the unsharded model")
    weights = sum(p.nbytes for p in params)
    grads = sum(p.nbytes for p in params if p.trainable)
    states, step = spec.optimizer.state_bytes, spec.optimizer.step_bytes

    def per_rank(b: int, stages: tuple[str, ...]) -> int:
        return math.ceil(b / n) if spec.sharding in stages else b

    return ModelMemory(per_rank(weights, ("full",)) + buffer_bytes,
                       per_rank(grads, ("gradients", "full")),
                       per_rank(states, ("optimizer", "gradients", "full")),
                       per_rank(step, ("optimizer", "gradients", "full")))


def activation_budget(mm: ModelMemory, spec: JobSpec) -> int:
    """The largest activation peak the device leaves room for (NOTE [the job's memory], NOTE
    [gradient accumulation])."""
    held = mm.gradients_bytes if spec.grad_accumulation else 0
    return (spec.device_memory_bytes - spec.reserve_bytes - mm.weights_bytes - mm.optimizer_bytes
            - held - spec.engine_bytes)


def step_phase_bytes(mm: ModelMemory, spec: JobSpec) -> int:
    """What the optimizer step needs within the activation budget: the gradients (unless
    gradient accumulation holds them already, outside it) and the step's transients."""
    return mm.optimizer_step_bytes + (0 if spec.grad_accumulation else mm.gradients_bytes)


def job_memory(mm: ModelMemory, spec: JobSpec, activations_bytes: int) -> JobMemory:
    """The breakdown for a plan whose activation peak is ``activations_bytes``."""
    held = mm.gradients_bytes if spec.grad_accumulation else 0  # NOTE [gradient accumulation]
    total = (mm.weights_bytes + mm.optimizer_bytes + spec.reserve_bytes + held
             + max(activations_bytes + spec.engine_bytes, step_phase_bytes(mm, spec)))
    return JobMemory(spec.device_memory_bytes, mm.weights_bytes, mm.gradients_bytes,
                     mm.optimizer_bytes, mm.optimizer_step_bytes, activations_bytes,
                     spec.reserve_bytes, total, spec.optimizer.name, spec.world_size, spec.sharding,
                     spec.grad_accumulation, spec.engine)


def expandable_segments(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``PYTORCH_CUDA_ALLOC_CONF`` turns on the caching allocator's expandable segments
    (NOTE [reserve]).

    Example:
        >>> expandable_segments({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
        True
        >>> expandable_segments({})
        False
    """
    conf = (os.environ if environ is None else environ).get("PYTORCH_CUDA_ALLOC_CONF", "")
    for item in conf.split(","):
        key, _, value = item.partition(":")
        if key.strip() == "expandable_segments":
            return value.strip().lower() in ("true", "1")
    return False


def default_reserve_bytes(device_memory_bytes: int, device: str, *,
                          expandable: bool | None = None) -> int:
    """NOTE [reserve]: 0 on a CPU; on a GPU 1 GiB + 2% of ``device_memory_bytes`` with the
    caching allocator's expandable segments, 1 GiB + 8% without them.

    Args:
        expandable: whether the job runs with expandable segments; default: as
            ``PYTORCH_CUDA_ALLOC_CONF`` says in this process.

    Example:
        >>> round(default_reserve_bytes(80 << 30, "h100", expandable=True) / (1 << 30), 2)
        2.6
        >>> round(default_reserve_bytes(80 << 30, "h100", expandable=False) / (1 << 30), 2)
        7.4
    """
    if device.lower().startswith("cpu"):
        return 0
    if expandable is None:
        expandable = expandable_segments()
    return _GiB + (device_memory_bytes // 50 if expandable else device_memory_bytes * 2 // 25)


def smallest_world_size(parameters: Iterable[Any], buffer_bytes: int, spec: JobSpec,
                        activations_bytes: int, limit: int = 1024) -> int | None:
    """The fewest devices (powers of two up to ``limit``) over which the job fits with full
    sharding, for an activation peak of ``activations_bytes``; None if none does."""
    params = list(parameters)
    n = 2
    while n <= limit:
        trial = dataclasses.replace(spec, world_size=n, sharding="full")
        if job_memory(model_memory(params, buffer_bytes, trial), trial, activations_bytes).fits:
            return n
        n *= 2
    return None
