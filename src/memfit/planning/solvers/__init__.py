"""Solvers: the fastest plan (least recompute time) whose predicted peak fits a budget.

Each solver is a function ``solve(ctx, budget_bytes, *, time_limit_s) -> Solution`` registered
under a name in :data:`SOLVERS`; ``get_solver(name)`` looks one up. Solvers work on the linear
cost model (``memfit.planning.costs``); the planner re-checks every plan with ``simulate``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from memfit.planning.plan import Region

if TYPE_CHECKING:
    from memfit.planning.candidates import PlanningContext  # noqa: F401  (for solver signatures)

__all__ = ["Solution", "SOLVERS", "SolverName", "get_solver", "solver_names", "Infeasible",
           "refuse_offload"]


@dataclass(frozen=True)
class Solution:
    """A solver's answer: regions plus what the solver's model predicts for them."""

    regions: tuple[Region, ...]
    predicted_peak_bytes: int
    recompute_s: float
    solver: str
    notes: tuple[str, ...] = ()


class Infeasible(Exception):  # noqa: N818 - internal signal, turned into InfeasibleBudget
    """No plan of the solver's plan space fits; ``min_bytes`` is the smallest peak it reaches."""

    def __init__(self, min_bytes: int, note: str = "") -> None:
        super().__init__(f"smallest feasible peak {min_bytes} bytes {note}".strip())
        self.min_bytes = min_bytes
        self.note = note


SolveFn = Callable[..., Solution]

#: What ``solver=`` takes: the solvers, then the baselines (fixed plans); ``SOLVERS`` maps each.
SolverName = Literal["auto", "chain", "milp", "greedy", "brute",
                     "none", "every_block", "sqrt", "save_matmuls"]

# name -> "module:function"; imported on first use (milp needs scipy)
SOLVERS: dict[str, str] = {
    "auto": "memfit.planning.solvers.auto:solve",
    "chain": "memfit.planning.solvers.chain:solve",
    "milp": "memfit.planning.solvers.milp:solve",
    "greedy": "memfit.planning.solvers.greedy:solve",
    "brute": "memfit.planning.solvers.brute:solve",
    "none": "memfit.planning.solvers.baselines:solve_none",
    "every_block": "memfit.planning.solvers.baselines:solve_every_block",
    "sqrt": "memfit.planning.solvers.baselines:solve_sqrt",
    "save_matmuls": "memfit.planning.solvers.baselines:solve_save_matmuls",
}

# baselines return a fixed plan whatever the budget
BASELINES = frozenset({"none", "every_block", "sqrt", "save_matmuls"})


def solver_names() -> tuple[str, ...]:
    return tuple(SOLVERS)


def get_solver(name: str) -> SolveFn:
    """The solve function registered as ``name``.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    target = SOLVERS.get(name) if isinstance(name, str) else None
    if target is None:
        raise ValueError(f"unknown solver {name!r}; choose one of {', '.join(SOLVERS)}")
    mod, fn = target.split(":")
    return getattr(importlib.import_module(mod), fn)  # type: ignore[no-any-return]


def refuse_offload(ctx: PlanningContext, name: str) -> None:
    """Raise ValueError when ``ctx`` plans with offload, which solver ``name`` cannot model."""
    if ctx.offload is not None:
        raise ValueError(f"solver {name!r} cannot model offload: offloaded copies share one host link "
                         "(NOTE [chain and offload] in memfit.planning.solvers.offload_pass). Pass a "
                         f"PlanningContext without offload; plan(..., solver={name!r}, offload=True) plans "
                         "without it, then offloads")
