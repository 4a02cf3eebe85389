"""The baselines (every_block, sqrt, save_matmuls) on the common residual loop over an
nn.ModuleList, a model with no blocks, and what fit and sweep do with their fixed plans
(NOTE [baseline blocks] in memfit.planning.solvers.baselines)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memfit
from memfit.api import fit
from memfit.errors import InfeasibleBudget
from memfit.measuring.report import RowKind
from memfit.measuring.tradeoff import sweep
from memfit.planning.planner import plan_for_budget
from memfit.planning.solvers.baselines import NoBlocks
from memfit.profiling.tracer import trace

D, N_BLOCKS, BATCH = 16, 4, 8
BLOCKS = [(f"blocks.{i}",) for i in range(N_BLOCKS)]


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, 4 * D)
        self.fc2 = nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))  # (batch, D)


class ResidualLoop(nn.Module):
    """``for b in self.blocks: x = x + b(x)``: the residual stream jumps over every block, so
    the blocks are no chain (NOTE [chains]), yet they are the model's blocks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(MLP() for _ in range(N_BLOCKS))
        self.head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b(x)  # (batch, D)
        return self.head(x)


class SequentialStack(nn.Module):
    """The same blocks called by an nn.Sequential, no residual: a chain."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(*(MLP() for _ in range(N_BLOCKS)))
        self.head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


class NoChildren(nn.Module):
    """One parameter, no submodule: nothing a baseline could call a block."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.tanh(x @ self.w) @ self.w)


def _x() -> torch.Tensor:
    return torch.randn(BATCH, D, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def residual_profile():
    return trace(ResidualLoop(), _x(), repeats=1)


@pytest.mark.parametrize("solver", ["every_block", "sqrt", "save_matmuls"])
def test_baselines_find_the_blocks_of_a_residual_loop_as_of_a_sequential(residual_profile, solver):
    p = plan_for_budget(residual_profile, budget=1.0, solver=solver)
    assert p.solver == solver
    # a segment cannot span the residual adds between blocks: sqrt checkpoints them one by one
    assert [r.modules for r in p.regions] == BLOCKS
    seq = plan_for_budget(trace(SequentialStack(), _x(), repeats=1), budget=1.0, solver=solver)
    assert len(seq.regions) == (N_BLOCKS // 2 if solver == "sqrt" else N_BLOCKS)  # 2 segments of 2


def test_save_matmuls_on_a_residual_loop_keeps_both_matmuls_of_each_block(residual_profile):
    p = plan_for_budget(residual_profile, budget=1.0, solver="save_matmuls")
    assert [r.save for r in p.regions] == [("aten.addmm.default#0", "aten.addmm.default#1")] * N_BLOCKS


def test_sqrt_is_titled_sqrt_and_says_why_it_cut_no_segment(residual_profile):
    p = plan_for_budget(residual_profile, budget=1.0, solver="sqrt")
    assert str(p).startswith("memfit plan (sqrt) for ResidualLoop:")
    assert "baseline: 4 regions for 4 blocks, segments of up to 2 blocks" in p.notes
    assert any(n.startswith("4 blocks checkpointed one by one: the parent's code runs between them")
               for n in p.notes)


@pytest.mark.parametrize("solver", ["every_block", "sqrt", "save_matmuls"])
def test_a_baseline_that_finds_no_blocks_says_so(solver):
    prof = trace(NoChildren(), _x(), repeats=1)
    with pytest.raises(NoBlocks, match=rf"baseline '{solver}' found no blocks to checkpoint in NoChildren"):
        plan_for_budget(prof, budget=1.0, solver=solver)
    assert plan_for_budget(prof, budget=1.0, solver="none").regions == ()  # "no checkpointing" is a plan


@pytest.mark.slow
def test_fit_refuses_a_baseline_plan_over_the_budget():
    model, x = ResidualLoop(), _x()
    p = plan_for_budget(trace(ResidualLoop(), x, repeats=1), budget=0.5, solver="every_block")
    assert p.predicted_peak_bytes > p.budget_bytes  # planned for comparison, with a note
    assert any(n.startswith("exceeds the budget") for n in p.notes)
    with pytest.raises(InfeasibleBudget, match=r"solver 'every_block' gives a fixed plan \(4 regions\) "
                                               r"whose predicted peak .* exceeds the budget") as e:
        fit(model, x, budget=0.5, search=memfit.Search(solver="every_block"))
    assert e.value.budget_bytes == p.budget_bytes
    assert e.value.min_feasible_bytes == p.predicted_peak_bytes
    assert "memfit_plan" not in model.__dict__  # nothing applied
    fit(model, x, budget=p.predicted_peak_bytes, search=memfit.Search(solver="every_block"))  # a budget it meets
    assert [r.modules for r in model.memfit_plan.regions] == BLOCKS


def test_fit_with_a_baseline_that_finds_no_blocks_raises():
    model = NoChildren()
    with pytest.raises(NoBlocks, match="baseline 'every_block' found no blocks"):
        fit(model, _x(), budget=1.0, search=memfit.Search(solver="every_block"))
    assert "memfit_plan" not in model.__dict__


def test_sweep_shows_a_baseline_that_found_nothing_as_such_not_as_a_peer():
    s = sweep(NoChildren(), _x(), (), baselines=("every_block", "sqrt"), repeats=1, progress=False)
    rows = {r.label: r for r in s.rows if r.kind is RowKind.BASELINE}
    assert list(rows) == ["every_block", "sqrt"]
    for r in rows.values():
        assert r.error == "found no blocks to checkpoint"
        assert r.plan is None and r.overhead is None and r.measured_peak_bytes is None
    table = s.table()
    assert "| every_block | every_block |" in table and "found no blocks to checkpoint" in table
    assert "+0.0%" not in table.split("\n", 3)[3]  # only the plain row reads +0.0%


def test_sweep_measures_the_residual_loops_baselines():
    s = sweep(ResidualLoop(), _x(), (), baselines=("every_block",), repeats=1, progress=False)
    every = s.rows[1]
    assert every.error is None and every.n_regions == N_BLOCKS
    assert memfit.Plan.from_dict(every.plan.to_dict()).regions == every.plan.regions
