"""The Literal types of ``check=`` and ``solver=`` name exactly what the library accepts."""

from __future__ import annotations

from typing import get_args

import pytest

from memfit.planning.solvers import SOLVERS, SolverName, get_solver
from memfit.runtime.divergence import _NAMED, CheckName, DivergenceCheck, resolve_check


def test_solver_name_lists_every_registered_solver():
    assert get_args(SolverName) == tuple(SOLVERS)
    for name in get_args(SolverName):
        assert callable(get_solver(name))


@pytest.mark.parametrize("name", get_args(CheckName))
def test_every_check_name_resolves(name):
    assert isinstance(resolve_check(name), DivergenceCheck)


def test_check_name_lists_every_named_check():
    assert set(get_args(CheckName)) == set(_NAMED)
