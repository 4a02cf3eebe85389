"""memfit: train models that do not fit in memory, at the least extra compute.

Three stages, data between them, and measuring above them (see docs/design.md):
``profile`` one step -> ``plan`` for a budget -> ``apply`` it to the unchanged module, then
``verify`` gradients and peak (``sweep``, ``fit(tune=True)`` also measure). ``fit`` profiles,
plans and applies in one call; ``applied_plan(model)`` is the plan a model carries.

Example:
    >>> import memfit, torch
    >>> model = memfit.zoo.gpt(n_layer=2, d_model=32, n_head=2, seq_len=128)
    >>> x = torch.randint(0, 512, (8, 128))
    >>> model = memfit.fit(model, x, budget="60%")    # doctest: +SKIP
    >>> print(model.memfit_plan)                      # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import Any

from memfit.errors import (
    InfeasibleBudget,
    MemfitError,
    ModelError,
    NewInputShape,
    PlanMismatch,
    PlansDiffer,
    ProfileMismatch,
    RecomputeMismatch,
    SchemaError,
    SolverTimeout,
    UnsupportedTorch,
    WrapError,
)
from memfit.planning.plan import OpPolicy, Plan, Region
from memfit.profiling.profile import Profile

__version__ = "0.1.0"

# Public names defined in submodules, imported on first use so that `import memfit` stays
# light (torch, numpy and the standard library only).
_LAZY = {
    "checkpoint": "memfit.runtime.checkpoint",
    "wrap": "memfit.runtime.wrap",
    "unwrap": "memfit.runtime.wrap",
    "apply": "memfit.api",
    "unapply": "memfit.runtime.apply",
    "applied_plan": "memfit.runtime.marks",
    "measure": "memfit.profiling.measure",
    "Measurement": "memfit.profiling.measure",
    "profile": "memfit.measuring.calibration",
    "simulate": ("memfit.planning.hidden_host", "simulate_plan"),
    "Simulation": "memfit.planning.simulate",
    "plan": "memfit.api",
    "Job": "memfit.job.device_memory",
    "Search": "memfit.job.fit_options",
    "Training": "memfit.job.fit_options",
    "Parallel": "memfit.job.fit_options",
    "largest_batch": "memfit.job.capacity",
    "capabilities": "memfit.torch_support.capabilities",
    "Capabilities": "memfit.torch_support.capabilities",
    "fit": "memfit.api",
    "compile": ("memfit.compiled", "compile_planned"),
    "CompiledRound": "memfit.compiled",
    "verify": "memfit.measuring.verification",
    "VerifyReport": "memfit.measuring.verification",
    "sweep": "memfit.measuring.tradeoff",
    "Sweep": "memfit.measuring.report",
    "policies": "memfit.runtime.policies",
    "zoo": "memfit.zoo",
    "distributed": "memfit.parallel.distributed",
    "pipeline": "memfit.parallel.pipeline",
}

_SUBMODULES = {"policies", "zoo", "distributed", "pipeline"}

__all__ = [
    "InfeasibleBudget",
    "MemfitError",
    "ModelError",
    "NewInputShape",
    "OpPolicy",
    "Plan",
    "PlanMismatch",
    "PlansDiffer",
    "Profile",
    "ProfileMismatch",
    "RecomputeMismatch",
    "Region",
    "SchemaError",
    "SolverTimeout",
    "UnsupportedTorch",
    "WrapError",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'memfit' has no attribute {name!r}")
    # a (module, attribute) pair: the public name is another name there
    where, attr = target if isinstance(target, tuple) else (target, name)
    module = importlib.import_module(where)
    value = module if name in _SUBMODULES else getattr(module, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
