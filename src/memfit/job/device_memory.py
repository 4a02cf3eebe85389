"""The job on its device as one value: ``memfit.Job(device="80GiB", optimizer="adamw")``, which
``fit``, ``plan`` and ``largest_batch`` take, and the ``memfit.planning.job.JobSpec`` the
planner reads made from it for a profile (NOTE [the job's memory]).

NOTE [a job's device]
    ``Job.device`` is the memory the whole job must fit on one device, given as:

    1. a device preset's name (``"v100"``, ``"a100"``, ``"h100"``, ``"h200"``, any case): that
       preset's ``memory_bytes`` in ``memfit.timemodel.devices.PRESETS``, the datasheet's
       figure in decimal units (``"h100"``: 80 GB = 80,000,000,000 B, 74.5 GiB). A card
       reports somewhat more (an H200's 141 GB datasheet figure against the 150,109,880,320 B
       torch reported on the H200 of NOTE [reserve]), so a preset errs on the small side;
       give the bytes torch reports (``torch.cuda.get_device_properties(0).total_memory``)
       for the card's own count. ``"cpu"`` is refused: its preset has no memory size.
    2. ``int`` bytes, or a size string (``"80GiB"``, ``"141GB"``; binary and decimal units).

    The device sets the memory only: which device's kernels and cost model a model on the
    meta device is planned with is ``fit``'s ``target=``.

NOTE [the old job keywords]
    Until this release ``fit``, ``plan`` and ``largest_batch`` took the job as eight keywords
    (``device_memory=``, ``optimizer=``, ``optimizer_state_dtype=``, ``master_weights=``,
    ``world_size=``, ``sharding=``, ``reserve=``, ``grad_accumulation=``). For one release
    they are still accepted, turned into the ``Job`` they describe (``OLD_KEYWORDS``: the
    same values under the Job's names) with a ``DeprecationWarning`` naming the new spelling,
    so plans and predictions are those of the ``Job``. A ``job`` and old keywords together
    are a TypeError, as is an old job keyword without ``device_memory`` (as before).
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from memfit.errors import InfeasibleBudget
from memfit.planning.job import SHARDINGS, JobSpec, OptimizerMemory
from memfit.profiling.profile import Profile
from memfit.units import format_bytes

__all__ = ["Job", "OLD_KEYWORDS", "resolve_job", "parse_size", "device_bytes",
           "with_state_dtype_hint"]


@dataclass(frozen=True, kw_only=True, repr=False)
class Job:
    """A training job on one device: what must fit besides the activations (NOTE [the job's
    memory] in ``memfit.planning.job``). Validated when made; the rest (the optimizer's
    states, the default reserve) is measured on the profile a plan is made for.

    Args:
        device: the device's memory (NOTE [a job's device]): a preset name (``"h100"``: 80
            GB), ``int`` bytes or a size (``"80GiB"``).
        optimizer: the optimizer instance (its class and param groups are measured on fake
            tensors, NOTE [optimizer memory on fake tensors]), a name (``"sgd"``,
            ``"sgd-momentum"``, ``"adam"``, ``"adamw"``), your own count
            (``memfit.planning.job.OptimizerMemory``), or None (default: none).
        state_dtype: the optimizer states' dtype (``torch.bfloat16`` or ``"bf16"``; default
            the parameters').
        master_weights: mixed precision's fp32 copy of every trainable parameter (default
            False).
        world_size: the devices the model states are sharded over (default: the process
            group's size, else 1).
        sharding: what is sharded over ``world_size``: ``"none"`` (default),
            ``"optimizer"``, ``"gradients"``, ``"full"`` (ZeRO-1/2/3, FSDP; NOTE [sharded
            model states]).
        reserve: memory for the CUDA context and the allocator, bytes or a size (NOTE
            [reserve]); default 0 on a CPU, 1 GiB + 2% of the device on a GPU (8% without
            expandable segments).
        grad_accumulation: gradients are added over micro-batches before each optimizer step,
            so they are held through forward and backward (NOTE [gradient accumulation]).
            Default False.
        engine: what a training engine allocates during forward and backward, as
            ``(name, bytes)`` lines (DeepSpeed's gradient buckets; NOTE [engine memory]).
            Default none.

    Raises:
        ValueError, TypeError: a value that describes no job, saying which and what to give.

    Example:
        >>> job = Job(device="h100", optimizer="adamw", state_dtype="bf16")
        >>> job.device_memory_bytes
        80000000000
        >>> job
        Job(device='h100', optimizer='adamw', state_dtype='bf16')
    """

    device: int | str
    optimizer: torch.optim.Optimizer | OptimizerMemory | str | None = None
    state_dtype: torch.dtype | str | None = None
    master_weights: bool = False
    world_size: int | None = None
    sharding: str = "none"
    reserve: int | str | None = None
    grad_accumulation: bool = False
    engine: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        from memfit.profiling.optimizer import OPTIMIZER_NAMES, parse_dtype

        device_bytes(self.device)
        opt = self.optimizer
        if not isinstance(opt, str | torch.optim.Optimizer | OptimizerMemory | None):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, a name "
                            f"({sorted(OPTIMIZER_NAMES)}), a memfit.planning.job.OptimizerMemory "
                            f"or None, got {type(opt).__name__}")
        if isinstance(opt, str) and opt.strip().lower() not in OPTIMIZER_NAMES:
            raise ValueError(f"unknown optimizer {opt!r}; name one of {sorted(OPTIMIZER_NAMES)} "
                             "or pass the optimizer itself")
        if isinstance(opt, OptimizerMemory) and (self.state_dtype is not None or self.master_weights):
            raise ValueError(f"optimizer={opt!r} is a count of its own; state_dtype and "
                             "master_weights change a measured one: count them in it and drop them")
        if not isinstance(self.state_dtype, torch.dtype | str | None):
            raise TypeError(f"state_dtype must be a torch.dtype or a name ('bfloat16'), got "
                            f"{type(self.state_dtype).__name__}")
        try:
            parse_dtype(self.state_dtype)
        except ValueError as e:
            raise ValueError(f"state_dtype: {e}") from None
        for name in ("master_weights", "grad_accumulation"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        w = self.world_size
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ValueError(f"world_size must be a whole number of devices >= 1, got "
                             f"{type(w).__name__} {w!r}")
        if self.sharding not in SHARDINGS:
            raise ValueError(f"sharding must be one of {SHARDINGS} (what is divided over "
                             f"world_size devices), got {self.sharding!r}")
        if self.reserve is not None:
            parse_size("reserve", self.reserve, zero=True)

    @property
    def device_memory_bytes(self) -> int:
        """The device's memory in bytes (NOTE [a job's device])."""
        return device_bytes(self.device)

    def spec(self, profile: Profile) -> JobSpec:
        """The ``JobSpec`` the planner reads for ``profile``: the optimizer measured on fake
        tensors over the profile's parameters, the world size and the reserve resolved.

        Raises:
            ValueError: sharding with no world size and no process group, master weights of
                an all-fp32 model, or an optimizer memfit cannot count.
        """
        from memfit.planning.job import default_reserve_bytes
        from memfit.profiling.optimizer import optimizer_memory

        memory = self.device_memory_bytes
        _refuse_nonsense(profile, self.world_size, self.sharding, self.master_weights)
        cuda = not profile.device.lower().startswith("cpu")
        opt = optimizer_memory(self.optimizer, profile.parameters, state_dtype=self.state_dtype,
                               master_weights=self.master_weights, cuda=cuda)
        world_size = self.world_size
        if world_size is None:
            from memfit.parallel.distributed import is_distributed

            world_size = torch.distributed.get_world_size() if is_distributed() else 1
        reserve_bytes = (default_reserve_bytes(memory, profile.device) if self.reserve is None
                         else parse_size("reserve", self.reserve, zero=True))
        return JobSpec(memory, opt, reserve_bytes, world_size, self.sharding, self.grad_accumulation,
                       tuple(self.engine))

    def __repr__(self) -> str:
        shown = [f"{f.name}={_short(getattr(self, f.name))}" for f in dataclasses.fields(self)
                 if f.name == "device" or getattr(self, f.name) != f.default]
        return f"Job({', '.join(shown)})"

    def __str__(self) -> str:
        memory = format_bytes(self.device_memory_bytes)
        device = (memory if isinstance(self.device, int) else self.device
                  if _preset_key(self.device) is None else f"{self.device} ({memory})")
        opt = self.optimizer
        name = (type(opt).__name__ if isinstance(opt, torch.optim.Optimizer)
                else opt.name if isinstance(opt, OptimizerMemory) else opt or "no optimizer")
        dtype = str(self.state_dtype).removeprefix("torch.")
        parts = [f"{name}" + (f" with {dtype} states" if self.state_dtype is not None else "")]
        parts += ["fp32 master weights"] if self.master_weights else []
        if self.sharding != "none":
            over = "the process group's" if self.world_size is None else str(self.world_size)
            parts.append(f"{self.sharding} sharding over {over} devices")
        parts += [] if self.reserve is None else [f"reserve {self.reserve}"]
        parts += ["gradient accumulation"] if self.grad_accumulation else []
        parts += [f"{name} {format_bytes(n)}" for name, n in self.engine]
        return f"a job on {device}: {', '.join(parts)}"


def _short(value: Any) -> str:
    """``value`` for ``Job``'s repr: an optimizer instance by its class (its own repr is a table)."""
    if isinstance(value, torch.optim.Optimizer):
        return f"<{type(value).__module__}.{type(value).__name__}>"
    return repr(value)


#: The job keywords ``fit``, ``plan`` and ``largest_batch`` took before ``Job``, and the name
#: of each in ``Job`` (NOTE [the old job keywords]).
OLD_KEYWORDS = {"device_memory": "device", "optimizer": "optimizer",
                "optimizer_state_dtype": "state_dtype", "master_weights": "master_weights",
                "world_size": "world_size", "sharding": "sharding", "reserve": "reserve",
                "grad_accumulation": "grad_accumulation"}
_OLD_DEFAULTS = {"master_weights": False, "sharding": "none", "grad_accumulation": False}


def resolve_job(caller: str, job: Any, old: dict[str, Any], budget: Any = None
                ) -> tuple[int | float | str | None, Job | None]:
    """``(budget, job)`` of a call of ``caller``: a ``Job`` passed as ``budget`` moved to
    ``job``, or the ``Job`` the deprecated keywords ``old`` describe (NOTE [the old job
    keywords]; the ``DeprecationWarning`` points at ``caller``'s caller).

    Raises:
        TypeError: an unknown keyword; a ``job`` that is not a ``Job``; two jobs; a job and
            old keywords; old job keywords without ``device_memory``.
    """
    unknown = sorted(set(old) - set(OLD_KEYWORDS))
    if unknown:
        raise TypeError(f"{caller}() got an unexpected keyword argument {unknown[0]!r}")
    if isinstance(budget, Job):
        if job is not None:
            raise TypeError(f"{caller}() got a Job as budget= and job= too; give it once")
        budget, job = None, budget
    if job is not None and not isinstance(job, Job):
        raise TypeError(f"{caller}'s job must be a memfit.Job (memfit.Job(device='80GiB', "
                        f"optimizer='adamw')), got {type(job).__name__} {job!r}")
    if not old:
        return budget, job
    given = ", ".join(f"{k}=..." for k in old)
    if job is not None:
        raise TypeError(f"{caller}() got a Job and {given}, which describe the job too: put "
                        "them in the Job (memfit.Job(device=..., state_dtype=...)) and drop them")
    spelled = ", ".join(f"{new}=..." for k, new in OLD_KEYWORDS.items() if k in old)
    warnings.warn(f"{caller}({given}) is deprecated: pass job=memfit.Job({spelled})",
                  DeprecationWarning, stacklevel=3)
    if old.get("device_memory") is None:
        extra = [k for k, v in old.items() if k != "device_memory" and v != _OLD_DEFAULTS.get(k)]
        if extra:
            raise TypeError(f"{', '.join(extra)} describe the job on a device, and count only "
                            "against device_memory=; give device_memory (e.g. '80GiB') too, or "
                            "better job=memfit.Job(device='80GiB', ...)")
        return budget, None
    return budget, Job(**{OLD_KEYWORDS[k]: v for k, v in old.items()})


def with_state_dtype_hint(e: InfeasibleBudget, profile: Profile, job: Job | None,
                          spec: JobSpec | None, budget: Any, solver: str,
                          options: dict[str, Any]) -> InfeasibleBudget:
    """``e`` with bf16 optimizer states named when they would make the job fit (computed)."""
    if (job is None or spec is None or not isinstance(job.optimizer, str | torch.optim.Optimizer)
            or str(job.state_dtype).removeprefix("torch.") in ("bfloat16", "bf16")):
        return e  # no job, your own count, or bf16 already
    from memfit.planning.planner import plan_for_budget
    from memfit.profiling.optimizer import optimizer_memory

    cuda = not profile.device.lower().startswith("cpu")
    bf16 = optimizer_memory(job.optimizer, profile.parameters, state_dtype="bfloat16", cuda=cuda)
    if bf16.state_bytes + bf16.step_bytes >= spec.optimizer.state_bytes + spec.optimizer.step_bytes:
        return e
    trial = dataclasses.replace(spec, optimizer=bf16)
    try:
        p = plan_for_budget(profile, budget=budget, solver=solver, job=trial, **options)
    except InfeasibleBudget:
        return e
    assert p.memory is not None
    hint = (f"state_dtype='bfloat16' ({bf16.name}: {format_bytes(bf16.state_bytes)} "
            f"of states; the job then needs {format_bytes(p.memory.total_bytes)})")
    message = f"{e}{'; ' if e.fits_with else chr(10) + 'Would fit: '}{hint}"
    return InfeasibleBudget(message, budget_bytes=e.budget_bytes,
                            min_feasible_bytes=e.min_feasible_bytes, memory=e.memory,
                            fits_with=(*e.fits_with, hint))


def _refuse_nonsense(profile: Profile, world_size: int | None, sharding: str,
                     master_weights: bool) -> None:
    """Raise for job options that would be accepted and silently mean nothing on ``profile``."""
    if sharding != "none" and world_size is None:
        from memfit.parallel.distributed import is_distributed

        if not is_distributed():
            raise ValueError(
                f"sharding={sharding!r} divides the model states over world_size devices, but no "
                "world_size was given and no process group is initialised (1 device: nothing "
                "would be divided); give world_size=N, or sharding='none'")
    trainable = {p.dtype for p in profile.parameters if p.trainable}
    if master_weights and trainable <= {"float32"}:
        raise ValueError(
            "master_weights=True counts an fp32 copy of low-precision parameters, but every "
            "trainable parameter of this model is already float32 (no copy is kept); drop "
            "master_weights, or give the model its training dtype (e.g. .to(torch.bfloat16))")


def device_bytes(device: int | str) -> int:
    """The memory of a job's ``device`` in bytes (NOTE [a job's device])."""
    from memfit.timemodel.devices import PRESETS

    key = _preset_key(device)
    if key is not None:
        if PRESETS[key].memory_bytes <= 0:
            raise ValueError(f"device={device!r} names the {key} preset, which has no memory "
                             "size; give the memory the job must fit as bytes or a size such as "
                             "'64GiB'")
        return PRESETS[key].memory_bytes
    presets = sorted(k for k, p in PRESETS.items() if p.memory_bytes > 0)
    try:
        return parse_size("device", device)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{e}; or name a device preset: {presets}") from None


def _preset_key(device: Any) -> str | None:
    """The preset ``device`` names (``"H100"`` -> ``"h100"``); None for a size or bytes."""
    from memfit.timemodel.devices import PRESETS

    key = device.strip().lower() if isinstance(device, str) else None
    return key if key in PRESETS else None


def parse_size(name: str, value: int | str, zero: bool = False) -> int:
    """``value`` (int bytes or a size such as ``"80GiB"``) as bytes; ``name`` for the error."""
    from memfit.units import parse_bytes

    if isinstance(value, bool) or not isinstance(value, int | str):
        raise TypeError(f"{name} must be int bytes or a size such as '80GiB', got "
                        f"{type(value).__name__} {value!r}")
    try:
        n = parse_bytes(value) if isinstance(value, str) else value
    except ValueError as e:
        raise ValueError(f"cannot parse {name}={value!r}: {e}") from None
    if n < 0 or (n == 0 and not zero):
        raise ValueError(f"{name} must be {'>= 0' if zero else 'positive'} bytes, got {value!r}")
    return n
