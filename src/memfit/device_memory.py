"""The job on its device, from the user's words: ``device_memory="80GiB"``,
``optimizer="adamw"`` ... as a ``memfit.planning.job.JobSpec`` (NOTE [the job's memory])."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from memfit.errors import InfeasibleBudget
from memfit.planning.job import JobSpec, OptimizerMemory
from memfit.profiling.profile import Profile
from memfit.units import format_bytes

__all__ = ["job_spec", "parse_size", "with_state_dtype_hint"]


def job_spec(profile: Profile, *, device_memory: int | str | None,
             optimizer: torch.optim.Optimizer | OptimizerMemory | str | None = None,
             optimizer_state_dtype: torch.dtype | str | None = None, master_weights: bool = False,
             world_size: int | None = None, sharding: str = "none",
             reserve: int | str | None = None, grad_accumulation: bool = False) -> JobSpec | None:
    """The ``JobSpec`` of a device (None when ``device_memory`` is None and nothing else is
    given); the optimizer is measured on fake tensors over the profile's parameters."""
    from memfit.planning.job import default_reserve_bytes
    from memfit.profiling.optimizer import optimizer_memory

    if device_memory is None:
        given = {"optimizer": optimizer, "optimizer_state_dtype": optimizer_state_dtype,
                 "world_size": world_size, "reserve": reserve}
        extra = [k for k, v in given.items() if v is not None]
        extra += ["master_weights"] if master_weights else []
        extra += ["grad_accumulation"] if grad_accumulation else []
        extra += ["sharding"] if sharding != "none" else []
        if extra:
            raise TypeError(f"{', '.join(extra)} describe the job on a device, and count only "
                            "against device_memory=; give device_memory (e.g. '80GiB') too")
        return None
    memory = parse_size("device_memory", device_memory)
    _refuse_nonsense(profile, world_size, sharding, master_weights)
    cuda = not profile.device.lower().startswith("cpu")
    opt = optimizer_memory(optimizer, profile.parameters, state_dtype=optimizer_state_dtype,
                           master_weights=master_weights, cuda=cuda)
    if world_size is None:
        from memfit.distributed import is_distributed

        world_size = torch.distributed.get_world_size() if is_distributed() else 1
    reserve_bytes = (default_reserve_bytes(memory, profile.device) if reserve is None
                     else parse_size("reserve", reserve, zero=True))
    return JobSpec(memory, opt, reserve_bytes, world_size, sharding, grad_accumulation)


def with_state_dtype_hint(e: InfeasibleBudget, profile: Profile, job: JobSpec | None,
                          optimizer: Any, state_dtype: Any, budget: Any, solver: str,
                          options: dict[str, Any]) -> InfeasibleBudget:
    """``e`` with bf16 optimizer states named when they would make the job fit (computed)."""
    if (job is None or not isinstance(optimizer, str | torch.optim.Optimizer)  # None or your count
            or str(state_dtype).removeprefix("torch.") in ("bfloat16", "bf16")):
        return e
    from memfit.planning.planner import plan as make_plan
    from memfit.profiling.optimizer import optimizer_memory

    cuda = not profile.device.lower().startswith("cpu")
    bf16 = optimizer_memory(optimizer, profile.parameters, state_dtype="bfloat16", cuda=cuda)
    if bf16.state_bytes + bf16.step_bytes >= job.optimizer.state_bytes + job.optimizer.step_bytes:
        return e
    trial = dataclasses.replace(job, optimizer=bf16)
    try:
        p = make_plan(profile, budget=budget, solver=solver, job=trial, **options)
    except InfeasibleBudget:
        return e
    assert p.memory is not None
    hint = (f"optimizer_state_dtype='bfloat16' ({bf16.name}: {format_bytes(bf16.state_bytes)} "
            f"of states; the job then needs {format_bytes(p.memory.total_bytes)})")
    message = f"{e}{'; ' if e.fits_with else chr(10) + 'Would fit: '}{hint}"
    return InfeasibleBudget(message, budget_bytes=e.budget_bytes,
                            min_feasible_bytes=e.min_feasible_bytes, memory=e.memory,
                            fits_with=(*e.fits_with, hint))


def _refuse_nonsense(profile: Profile, world_size: Any, sharding: str, master_weights: bool) -> None:
    """Raise for job options that would be accepted and silently mean nothing."""
    if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int)
                                   or world_size < 1):
        raise ValueError(f"world_size must be a whole number of devices >= 1, got "
                         f"{type(world_size).__name__} {world_size!r}")
    if sharding != "none" and world_size is None:
        from memfit.distributed import is_distributed

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
