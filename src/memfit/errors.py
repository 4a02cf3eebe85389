"""memfit's exceptions: one base class, subclasses named for what happened.

Every message says what was received, why it is wrong and what to do about it.
Bad arguments (wrong type, unparseable value) raise ``ValueError``/``TypeError``.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "MemfitError",
    "InfeasibleBudget",
    "ModelError",
    "NewInputShape",
    "PlanMismatch",
    "PlansDiffer",
    "ProfileMismatch",
    "RecomputeMismatch",
    "SchemaError",
    "SolverTimeout",
    "UnsupportedTorch",
    "WrapError",
]


class MemfitError(RuntimeError):
    """Base class of every error memfit raises on purpose."""


class InfeasibleBudget(MemfitError):
    """No plan in the plan space fits the budget.

    Attributes:
        budget_bytes: the activation budget asked for (for a whole job, what the device left).
        min_feasible_bytes: the smallest predicted activation peak any plan reaches.
        memory: for a plan made for a device (a ``memfit.Job``), the job's breakdown with
            the smallest plan (``memfit.planning.job.JobMemory``); else None.
        fits_with: what would make it fit, computed (another sharding, a smaller batch, a
            state dtype), one phrase each.
    """

    def __init__(self, message: str, *, budget_bytes: int, min_feasible_bytes: int,
                 memory: Any = None, fits_with: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.min_feasible_bytes = min_feasible_bytes
        self.memory = memory
        self.fits_with = fits_with


class ModelError(MemfitError):
    """The user's model (its forward, or the loss function given with it) raised, or its step
    cannot be differentiated: the fault is in the model or its example inputs, not in memfit.

    The model's own exception is ``__cause__``.

    Attributes:
        model: the model's name (its class name, or the CLI's MODEL).
    """

    def __init__(self, message: str, *, model: str) -> None:
        super().__init__(message)
        self.model = model


class NewInputShape(MemfitError):
    """A planned model was called on inputs (shapes, dtypes) its plan was not made for, and
    ``fit(on_new_shape="raise")`` asked for an error (NOTE [inputs other than the profiled
    ones] in ``memfit.runtime.shapes``).

    Attributes:
        planned: the signatures the model holds plans for, ``((name, shape, dtype), ...)`` each.
        got: the call's signature.
    """

    def __init__(self, message: str, *, planned: tuple[Any, ...], got: tuple[Any, ...]) -> None:
        super().__init__(message)
        self.planned = planned
        self.got = got


class PlanMismatch(MemfitError):
    """A plan was applied to a model it was not made for."""


class PlansDiffer(PlanMismatch):
    """The ranks of a distributed job hold different plans (or some could not apply theirs).

    Raised on every rank by ``apply`` (NOTE [one plan per job] in ``memfit.parallel.distributed``).

    Attributes:
        ranks: for each distinct plan digest, the ranks holding it (``{"ab12...": (0, 2)}``);
            a rank that could not apply its plan is listed under ``"error: <message>"``.
    """

    def __init__(self, message: str, *, ranks: dict[str, tuple[int, ...]]) -> None:
        super().__init__(message)
        self.ranks = ranks


class ProfileMismatch(MemfitError):
    """A profile does not describe the model or inputs it is used with."""


class RecomputeMismatch(MemfitError):
    """The recomputation of a checkpointed region diverged from its first forward."""


class SchemaError(MemfitError):
    """A saved file (profile, plan) is corrupt or from another schema version."""


class SolverTimeout(MemfitError, TimeoutError):
    """A solver chosen by name found no plan within its time limit.

    Only an explicitly chosen solver raises it: ``solver="auto"`` falls back to another solver
    instead. It is also a ``TimeoutError``.

    Attributes:
        solver: the solver's name.
        time_limit_s: the time limit it ran under, seconds.
    """

    def __init__(self, message: str, *, solver: str, time_limit_s: float) -> None:
        super().__init__(message)
        self.solver = solver
        self.time_limit_s = time_limit_s


class UnsupportedTorch(MemfitError, ImportError):
    """The installed torch is older than the range memfit supports, or lacks a private API
    memfit relies on (``memfit._torch``).

    Raised when ``memfit._torch`` is first imported (by the first profiling, planning or
    runtime module imported) for an older torch and for the APIs every stage needs, or when a
    feature is first used for the APIs only that feature needs (chain segments, the CPU
    allocator meter, offload). It is also an ``ImportError``. NOTE [private torch APIs] in
    ``memfit._torch``.
    """


class WrapError(MemfitError):
    """A module cannot be wrapped or unwrapped as asked."""
