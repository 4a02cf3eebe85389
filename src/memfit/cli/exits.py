"""The CLI's exit codes: one per kind of error (``EXIT_CODES``), and the JSON object an error
prints under ``--json``. ``memfit --help`` and the README's "Command line" list the same."""

from __future__ import annotations

from typing import Any

from memfit.cli.models import UsageError
from memfit.errors import (
    InfeasibleBudget,
    ModelError,
    PlanMismatch,
    ProfileMismatch,
    RecomputeMismatch,
    SchemaError,
    SolverTimeout,
    UnsupportedTorch,
    WrapError,
)

__all__ = ["EXIT_OK", "EXIT_VERIFY_FAILED", "EXIT_BAD_INPUT", "EXIT_INFEASIBLE", "EXIT_INTERNAL",
           "EXIT_INTERRUPTED", "EXIT_CODES", "exit_code_for", "error_object"]

EXIT_OK = 0
EXIT_VERIFY_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INFEASIBLE = 3
EXIT_INTERNAL = 4
EXIT_INTERRUPTED = 130

#: The exit code of each error class, the first that matches (a subclass before its base).
#: Anything else is a bug in memfit: EXIT_INTERNAL. Keep in step with
#: ``memfit.cli.main.EPILOG`` and the README.
EXIT_CODES: tuple[tuple[type[BaseException], int], ...] = (
    (RecomputeMismatch, EXIT_VERIFY_FAILED),
    (InfeasibleBudget, EXIT_INFEASIBLE),
    (SolverTimeout, EXIT_INFEASIBLE),
    (ModelError, EXIT_BAD_INPUT),
    (UsageError, EXIT_BAD_INPUT),
    (SchemaError, EXIT_BAD_INPUT),
    (PlanMismatch, EXIT_BAD_INPUT),
    (ProfileMismatch, EXIT_BAD_INPUT),
    (WrapError, EXIT_BAD_INPUT),
    (UnsupportedTorch, EXIT_BAD_INPUT),
    (ValueError, EXIT_BAD_INPUT),
    (TypeError, EXIT_BAD_INPUT),
    (OSError, EXIT_BAD_INPUT),
    (ImportError, EXIT_BAD_INPUT),
)


def exit_code_for(error: BaseException) -> int:
    """The exit code of ``error``'s class (``EXIT_CODES``; else ``EXIT_INTERNAL``)."""
    for cls, code in EXIT_CODES:
        if isinstance(error, cls):
            return code
    return EXIT_INTERNAL


def error_object(type_name: str, message: str, exit_code: int, **extra: Any) -> dict[str, Any]:
    """The JSON object an error prints under ``--json``."""
    return {"kind": "memfit.Error", "error": {"type": type_name, "message": message,
                                              "exit_code": exit_code, **extra}}
